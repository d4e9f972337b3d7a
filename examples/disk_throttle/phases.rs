//! The phases, and the drivers of one slice: the open-loop readers, the compaction writers,
//! where they run (the dispatcher's shards or the tokio runtime) and what they record.

use std::fs::File;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use iothrottle::disk::{AlignedBuf as DiskBuf, ThrottledFile};
use iothrottle::dispatcher::{ClassId, Dispatcher, DispatcherStats};
use iothrottle::{DiskError, Throttle, Uncapped};

use crate::args::Args;
use crate::direct::{cpu_ticks, DiskBusy, Rng};
use crate::open_loop::Schedule;
use crate::placement::Placement;
use crate::report::{new_hist, print_row, record, Row};
use crate::shard_timer::ShardTimer;
use crate::stall::StallWatch;
use crate::{BoxError, READ_BYTES};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    Unthrottled,
    Plain,
    /// Thread-per-core: readers and compaction on the dispatcher's shards.
    IoThrottle,
    /// The same dispatcher, submitted to from a tokio multi-thread runtime.
    Cross,
    /// Thread-per-core in latency-target mode.
    Target,
}

impl Phase {
    /// The order within a round: the unthrottled slice last, then a pause for its write-back.
    pub(crate) const ALL: [Phase; 6] = [
        Phase::Idle,
        Phase::Plain,
        Phase::IoThrottle,
        Phase::Cross,
        Phase::Target,
        Phase::Unthrottled,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Unthrottled => "unthrottled",
            Phase::Plain => "plain",
            Phase::IoThrottle => "iothrottle",
            Phase::Cross => "cross",
            Phase::Target => "target",
        }
    }

    pub(crate) fn index(self) -> usize {
        Phase::ALL.iter().position(|p| *p == self).expect("listed")
    }
}

/// What the drivers of one slice record.
pub(crate) struct Recorder {
    /// Foreground latency from the scheduled arrival, the lag from the arrival to the read's
    /// issue, and the read's own time from its issue to its completion (ns).
    pub(crate) fg: Mutex<(Histogram<u64>, Histogram<u64>, Histogram<u64>)>,
    pub(crate) fg_errors: AtomicU64,
    /// Arrivals given up at the drain bound (counted with the latency they had reached).
    pub(crate) fg_abandoned: AtomicU64,
    pub(crate) bg_bytes: AtomicU64,
    pub(crate) bg_errors: AtomicU64,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Recorder {
            fg: Mutex::new((new_hist(), new_hist(), new_hist())),
            fg_errors: AtomicU64::new(0),
            fg_abandoned: AtomicU64::new(0),
            bg_bytes: AtomicU64::new(0),
            bg_errors: AtomicU64::new(0),
        }
    }

    pub(crate) fn fg(&self, latency: Duration, lag: Duration) {
        if let Ok(mut h) = self.fg.lock() {
            record(&mut h.0, latency);
            record(&mut h.1, lag);
            record(&mut h.2, latency.saturating_sub(lag));
        }
    }
}

/// One dispatcher's file, serving both classes.
pub(crate) struct Io {
    pub(crate) file: ThrottledFile,
    pub(crate) fg: ClassId,
    pub(crate) bg: ClassId,
}

/// How a phase issues its I/O.
#[derive(Clone)]
pub(crate) enum Route {
    /// From the tokio runtime through the pass-through dispatcher.
    Direct(Arc<Io>),
    /// The same, the compaction's bytes through a plain limiter first.
    Plain(Throttle<Uncapped>, Arc<Io>),
    /// Through a throttling dispatcher: from its shards (`on`, which ones for what) or from
    /// the runtime (`None`).
    Dispatched {
        d: Arc<Dispatcher>,
        io: Arc<Io>,
        on: Option<Arc<Placement>>,
    },
}

/// What a driver is: a foreground reader or a compaction writer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    Reader,
    Writer,
}

impl Route {
    pub(crate) fn io(&self) -> &Arc<Io> {
        match self {
            Route::Direct(io) | Route::Plain(_, io) | Route::Dispatched { io, .. } => io,
        }
    }
}

pub(crate) struct Ctx {
    pub(crate) file: Arc<File>,
    pub(crate) fg_region: (u64, u64),
    pub(crate) bg_region: (u64, u64),
    pub(crate) bg_bytes: u64,
    pub(crate) interrupted: Arc<AtomicBool>,
    pub(crate) busy: DiskBusy,
    /// The machine's watch (`--stall-watch`): how late its threads woke over each slice.
    pub(crate) stall: Option<StallWatch>,
}

/// The dispatcher stopped: the phase is over for this driver.
pub(crate) fn is_shutdown(e: &DiskError) -> bool {
    matches!(e, DiskError::Dispatch(_) | DiskError::Submit(_))
}

/// A task of the slice, wherever it runs.
pub(crate) type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Starts `make()`'s future, the `n`-th of its role: on the role's shards in turn, or on the
/// tokio runtime.
pub(crate) fn start<F, Fut>(
    route: &Route,
    (role, n): (Role, usize),
    make: F,
) -> Result<Driver, BoxError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    match route {
        Route::Dispatched { d, on: Some(p), .. } => {
            let shards = match role {
                Role::Reader => &p.fg,
                Role::Writer => &p.bg,
            };
            let h = d.spawn_on(shards[n % shards.len()], make)?;
            Ok(Box::pin(async move {
                let _ = h.await;
            }))
        }
        _ => {
            let h = tokio::spawn(make());
            Ok(Box::pin(async move {
                let _ = h.await;
            }))
        }
    }
}

/// One foreground reader: its schedule's arrivals, each read issued when the reader is free,
/// its latency counted from the arrival. Past `give_up` the remaining arrivals are counted with
/// the latency they had reached.
pub(crate) async fn reader(
    io: Arc<Io>,
    rec: Arc<Recorder>,
    mut sched: Schedule,
    region: (u64, u64),
    seed: u64,
    give_up: Instant,
) {
    let mut rng = Rng(seed);
    let slots = region.1 / READ_BYTES;
    let Ok(mut buf) = DiskBuf::zeroed(READ_BYTES as usize) else {
        return;
    };
    // The arrivals' timer: a timerfd, since tokio's timer ticks in whole milliseconds.
    let Ok(alarm) = ShardTimer::new() else {
        rec.fg_errors.fetch_add(1, Ordering::Relaxed);
        return;
    };
    while let Some(at) = sched.next_arrival() {
        let now = Instant::now();
        if now >= give_up {
            let mut late = sched.abandon(now);
            late.push(now.saturating_duration_since(at));
            rec.fg_abandoned
                .fetch_add(late.len() as u64, Ordering::Relaxed);
            for d in late {
                rec.fg(d, d);
            }
            return;
        }
        // Armed after `now`: it rings at `at` or later, never before.
        let wait = at.saturating_duration_since(now);
        if !wait.is_zero() {
            let rung = match alarm.arm(wait) {
                Ok(()) => alarm.expired().await,
                Err(e) => Err(e),
            };
            if rung.is_err() {
                rec.fg_errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let issued = Instant::now();
        let off = region.0 + rng.below(slots) * READ_BYTES;
        let (r, b) = io.file.read_at_in(io.fg, buf, off).await;
        buf = b;
        rec.fg(at.elapsed(), issued.saturating_duration_since(at));
        match r {
            Ok(n) if n == READ_BYTES as usize => {}
            Err(e) if is_shutdown(&e) => return,
            _ => {
                rec.fg_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One compaction writer: sequential writes over its region until `stop`.
pub(crate) async fn writer(
    route: Route,
    rec: Arc<Recorder>,
    stop: Arc<AtomicBool>,
    next_write: Arc<AtomicU64>,
    (base, len, bg_bytes): (u64, u64, u64),
) {
    let Ok(mut buf) = DiskBuf::zeroed(bg_bytes as usize) else {
        return;
    };
    buf.fill(0xC0);
    let io = route.io().clone();
    let slots = len / bg_bytes;
    while !stop.load(Ordering::Relaxed) {
        // Relaxed: a lone counter handing out positions.
        let n = next_write.fetch_add(1, Ordering::Relaxed) % slots;
        let off = base + n * bg_bytes;
        // The plain limiter: the write's bytes first, held while it runs.
        let _permit = match &route {
            Route::Plain(t, _) => match t.acquire(bg_bytes).await {
                Ok(p) => Some(p),
                Err(_) => return,
            },
            _ => None,
        };
        let (r, b) = io.file.write_at_in(io.bg, buf, off).await;
        buf = b;
        match r {
            Ok(()) => {
                rec.bg_bytes.fetch_add(bg_bytes, Ordering::Relaxed);
            }
            Err(e) if is_shutdown(&e) => return,
            Err(e) => {
                eprintln!("compaction write: {e}");
                rec.bg_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Runs one slice of `phase`: every arrival scheduled within the slice is served (or, past four
/// slices' time, counted with the latency it reached), the compaction runs until then.
pub(crate) async fn run_slice(
    ctx: &Ctx,
    args: &Args,
    (phase, round): (Phase, u64),
    route: Route,
) -> Result<Row, BoxError> {
    let rec = Arc::new(Recorder::new());
    let stop = Arc::new(AtomicBool::new(false));
    let slice = Duration::from_millis(args.slice_ms);
    let interval = Duration::from_secs_f64(args.fg_depth as f64 / args.fg_iops as f64);
    let dispatcher = match &route {
        Route::Dispatched { d, io, .. } => Some((d.clone(), io.fg)),
        _ => None,
    };
    let stats0 = match &dispatcher {
        Some((d, _)) => Some(d.stats().await),
        None => None,
    };
    let busy0 = ctx.busy.busy_ms();
    let ticks0 = cpu_ticks();
    if let Some(watch) = &ctx.stall {
        // From here on the watch counts for this slice.
        watch.take();
    }
    // The drivers start a little after now, so that starting them is not on the clock.
    let t0 = Instant::now() + Duration::from_millis(2);
    let give_up = t0 + slice * 4;
    let mut writers = Vec::new();
    if !matches!(phase, Phase::Idle) {
        let next_write = Arc::new(AtomicU64::new(0));
        for w in 0..args.bg_depth {
            let (r, rec, stop, next) =
                (route.clone(), rec.clone(), stop.clone(), next_write.clone());
            let region = (ctx.bg_region.0, ctx.bg_region.1, ctx.bg_bytes);
            writers.push(start(&route, (Role::Writer, w), move || {
                writer(r, rec, stop, next, region)
            })?);
        }
    }
    let mut readers = Vec::new();
    for w in 0..args.fg_depth {
        // The readers' arrivals interleave: reader w's first is w/depth of an interval in.
        let offset = interval.mul_f64(w as f64 / args.fg_depth as f64);
        let sched = Schedule::new(t0, offset, interval, slice);
        let (io, rec) = (route.io().clone(), rec.clone());
        let seed = 0x9E37_79B9_7F4A_7C15 ^ ((round << 16) + w as u64 + 1).wrapping_mul(0x1000_0001);
        let region = ctx.fg_region;
        readers.push(start(&route, (Role::Reader, w), move || {
            reader(io, rec, sched, region, seed, give_up)
        })?);
    }
    for r in readers {
        if ctx.interrupted.load(Ordering::Relaxed) {
            stop.store(true, Ordering::Relaxed);
            return Err("interrupted".into());
        }
        r.await;
    }
    let end = Instant::now();
    let stall = ctx.stall.as_ref().and_then(StallWatch::take);
    stop.store(true, Ordering::Relaxed);
    let bg_bytes = rec.bg_bytes.load(Ordering::Relaxed);
    let busy1 = ctx.busy.busy_ms();
    let ticks1 = cpu_ticks();
    for w in writers {
        w.await;
    }
    let (fg_queue_p99, backoffs) = match (&dispatcher, &stats0) {
        (Some((d, fg)), Some(s0)) => {
            let s: DispatcherStats = d.stats().await;
            let slice = s.since(s0);
            (
                Some(slice.classes[fg.index()].queue_wait_p99()),
                Some(slice.idle_poll_backoffs()),
            )
        }
        _ => (None, None),
    };
    let (fg, lag, io) = rec.fg.lock().map_err(|_| "poisoned")?.clone();
    let row = Row {
        phase,
        round,
        fg,
        lag,
        io,
        elapsed: end.saturating_duration_since(t0).as_secs_f64(),
        bg_bytes,
        fg_queue_p99,
        backoffs,
        busy_ms: busy1.zip(busy0).map(|(b, a)| b - a),
        steal: ticks1
            .zip(ticks0)
            .map(|((s1, t1), (s0, t0))| (s1.saturating_sub(s0), t1.saturating_sub(t0))),
        stall,
        fg_errors: rec.fg_errors.load(Ordering::Relaxed),
        fg_abandoned: rec.fg_abandoned.load(Ordering::Relaxed),
        bg_errors: rec.bg_errors.load(Ordering::Relaxed),
    };
    print_row(&row);
    Ok(row)
}

/// A few hundred reads by each route, not recorded: the rings' and the shards' first
/// wake-ups are not what the phases measure.
pub(crate) async fn warm_up(ctx: &Ctx, ios: &[&Arc<Io>]) -> Result<(), BoxError> {
    let mut buf = DiskBuf::zeroed(READ_BYTES as usize)?;
    let slots = ctx.fg_region.1 / READ_BYTES;
    let mut rng = Rng(42);
    for i in 0..200 * ios.len() {
        let io = ios[i % ios.len()];
        let off = rng.below(slots) * READ_BYTES;
        let (r, b) = io.file.read_at_in(io.fg, buf, off).await;
        r?;
        buf = b;
    }
    Ok(())
}

/// Flushes and pauses, so that the previous step's write-back does not land in the next phase.
pub(crate) async fn settle(ctx: &Ctx, args: &Args) -> Result<(), BoxError> {
    let f = ctx.file.clone();
    tokio::task::spawn_blocking(move || f.sync_data()).await??;
    let end = Instant::now() + Duration::from_millis(args.settle_ms);
    while Instant::now() < end {
        if ctx.interrupted.load(Ordering::Relaxed) {
            return Err("interrupted".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
