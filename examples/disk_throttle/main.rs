//! The main job: does the dispatcher protect foreground reads from a compaction on a **real
//! disk**, and at what bandwidth, compared with no throttling and with a plain rate limiter?
//! (One file over the usual size: the phases, the loop that measures them and the report are
//! read together; the flags, the open-loop schedule and the modelled demo have files of their own.)
//!
//! ```text
//! cargo run --release --example disk_throttle
//! cargo run --release --example disk_throttle -- --saturate      # a spinning thread per core
//! cargo run --release --example disk_throttle -- --properties io_properties.yaml --dir /data
//! cargo run --release --example disk_throttle -- --modelled      # the modelled-disk demo
//! ```
//!
//! 1. **Disk model**: measured in a few seconds with O_DIRECT, or loaded from a Seastar
//!    `io_properties.yaml` (`--properties`). The dispatcher is the builder's defaults plus one
//!    line for the compaction class (docs/disk.md, "Recommended configuration").
//! 2. **Phases**, run as interleaved slices (`--slice-ms`, one of each phase per round,
//!    `--phase-secs` rounds), on a scratch file under `--dir`, removed at the end:
//!    - `idle`: the foreground alone: random 4 KiB O_DIRECT reads at `--fg-iops`, open loop;
//!    - `unthrottled`: the foreground plus a compaction of `--bg-kib` O_DIRECT writes,
//!      `--bg-depth` in flight, as fast as the disk takes them;
//!    - `plain`: the compaction through a plain rate limiter at `--plain-rate`;
//!    - `iothrottle`: **thread-per-core**: the readers and the compaction run on the
//!      dispatcher's shards (`Dispatcher::spawn_on`), their I/O queued and dispatched on the
//!      shard that issues it;
//!    - `cross`: the same dispatcher configuration, the readers and the compaction on a tokio
//!      multi-thread runtime submitting from its threads;
//!    - `target`: thread-per-core in latency-target mode (`ClassConfig::with_latency_target`).
//!
//!    `idle`, `unthrottled` and `plain` issue the same I/O (`ThrottledFile` on io_uring) from
//!    the tokio runtime through a pass-through dispatcher that never holds a request back.
//!    One `ThrottledFile` per dispatcher serves both classes (`read_at_in` / `write_at_in`).
//! 3. **Latency from arrival.** Each of `--fg-depth` readers has a fixed schedule of arrivals
//!    (together `--fg-iops`); a read's latency counts from its scheduled arrival to its
//!    completion, and a reader that falls behind never moves its schedule: the backlog shows as
//!    latency (`open_loop.rs`). That includes the runtime timer's lateness in waking a reader
//!    (tokio's timer ticks in milliseconds), alike in every phase: the `lag p99` column shows it.
//! 4. `--saturate` runs one spinning thread per core for the whole run.
//!
//! Per slice a row; per phase the pooled figures, the median over rounds and the worst round;
//! an SVG plot (bandwidth; latency on a log axis); one machine-readable `summary:` line.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use iothrottle::disk::{AlignedBuf as DiskBuf, FileOptions, ThrottledFile};
use iothrottle::dispatcher::{
    ClassConfig, ClassId, DiskModel, Dispatcher, DispatcherBuilder, DispatcherStats, Figures,
    IoRequest,
};
use iothrottle::DiskError;
use iothrottle::{BucketConfig, Rate, Throttle, Uncapped};

mod args;
mod modelled;
mod open_loop;

use args::{check_values, Args, MAX_BG_KIB};
use open_loop::{Rounds, Schedule};

const READ_BYTES: u64 = 4096;
const ALIGN: usize = 4096;
const TMPFS_MAGIC: u64 = 0x0102_1994;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let result = if args.modelled {
        modelled::run(&args)
    } else {
        real_disk(&args)
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// Checks before any work.

/// Every flag checked before anything runs; returns the scratch directory's parent.
fn check_args(args: &Args) -> Result<PathBuf, BoxError> {
    check_values(args)?;
    check_plot_path(&args.plot)?;
    if let Some(p) = &args.properties {
        // Parsed now so that a bad file fails before any work.
        DiskModel::from_properties(p)?;
    }
    match &args.dir {
        Some(d) => {
            check_dir(d)?;
            Ok(d.clone())
        }
        None => default_dir(),
    }
}

/// The plot's directory must exist and be writable: tried now, not after the run.
fn check_plot_path(plot: &Path) -> Result<(), BoxError> {
    let existed = plot.exists();
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(plot)
        .map_err(|e| format!("cannot write the plot to {}: {e}", plot.display()))?;
    if !existed {
        let _ = std::fs::remove_file(plot);
    }
    Ok(())
}

fn is_tmpfs(dir: &Path) -> Result<bool, BoxError> {
    let st = rustix::fs::statfs(dir).map_err(|e| format!("statfs {}: {e}", dir.display()))?;
    Ok(st.f_type as u64 == TMPFS_MAGIC)
}

fn check_dir(dir: &Path) -> Result<(), BoxError> {
    if !dir.is_dir() {
        return Err(format!("--dir {} is not a directory", dir.display()).into());
    }
    if is_tmpfs(dir)? {
        return Err(format!(
            "--dir {} is on tmpfs, which has no O_DIRECT and no disk: choose a directory on a real disk",
            dir.display()
        )
        .into());
    }
    Ok(())
}

fn default_dir() -> Result<PathBuf, BoxError> {
    for d in [PathBuf::from("target"), PathBuf::from("/var/tmp")] {
        if d.is_dir() && !is_tmpfs(&d).unwrap_or(true) {
            return Ok(d);
        }
    }
    Err("neither ./target nor /var/tmp is a directory on a real disk: pass --dir".into())
}

// ---------------------------------------------------------------------------------------------
// Aligned buffers and O_DIRECT files.

/// A zeroed buffer aligned to 4 KiB, as O_DIRECT needs.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (no aliasing pointers are kept), so moving
// it to another thread or sharing `&AlignedBuf` (read-only access) is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (a positive multiple of 4 KiB); an error, not an abort, when memory is short.
    fn new(len: usize, fill: u8) -> Result<Self, BoxError> {
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|e| format!("buffer of {len} bytes: {e}"))?;
        if len == 0 {
            return Err("empty buffer".into());
        }
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| format!("out of memory for a buffer of {len} bytes"))?;
        let mut b = AlignedBuf { ptr, len };
        b.as_mut_slice().fill(fill);
        Ok(b)
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then written) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("checked at allocation");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

fn open_direct(path: &Path, write: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .create(write)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

/// Busy time of the block device holding `file`, from /sys (io_ticks, milliseconds).
struct DiskBusy {
    stat: Option<PathBuf>,
}

impl DiskBusy {
    fn new(file: &File) -> Self {
        let stat = file.metadata().ok().and_then(|m| {
            let dev = m.dev();
            let p = PathBuf::from(format!(
                "/sys/dev/block/{}:{}/stat",
                rustix::fs::major(dev),
                rustix::fs::minor(dev)
            ));
            p.exists().then_some(p)
        });
        DiskBusy { stat }
    }

    fn busy_ms(&self) -> Option<u64> {
        let s = std::fs::read_to_string(self.stat.as_ref()?).ok()?;
        s.split_whitespace().nth(9)?.parse().ok()
    }
}

// ---------------------------------------------------------------------------------------------
// The disk model: io_properties.yaml, or a quick measurement.

/// `depth` threads doing `size`-byte O_DIRECT I/O (random within `region` if `random`, else
/// sequential) for `RAMP + time`: operations and bytes per second after the ramp, which is
/// discarded (a virtio disk's host cache absorbs the first fraction of a second of writes
/// faster than it sustains them).
fn measure(
    file: &Arc<File>,
    region: (u64, u64),
    write: bool,
    random: bool,
    size: usize,
    depth: usize,
    time: Duration,
) -> Result<(f64, f64), BoxError> {
    let ops = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let slots = (region.1 / size as u64).max(1);
    let start = Instant::now() + QUICK_RAMP;
    let end = start + time;
    let mut threads = Vec::new();
    for t in 0..depth {
        let (file, ops, next) = (file.clone(), ops.clone(), next.clone());
        let mut buf = AlignedBuf::new(size, 0x5A)?;
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut rng = Rng(0x1234_5678 + t as u64 * 7919);
            while Instant::now() < end {
                let slot = if random {
                    rng.below(slots)
                } else {
                    // Relaxed: a lone counter handing out positions.
                    next.fetch_add(1, Ordering::Relaxed) % slots
                };
                let off = region.0 + slot * size as u64;
                if write {
                    file.write_all_at(buf.as_slice(), off)?;
                } else {
                    file.read_exact_at(buf.as_mut_slice(), off)?;
                }
                if Instant::now() >= start {
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        }));
    }
    for t in threads {
        t.join().map_err(|_| "a measuring thread panicked")??;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed) as f64;
    Ok((n / secs, n * size as f64 / secs))
}

/// The ramp of each quick measurement, discarded.
const QUICK_RAMP: Duration = Duration::from_millis(250);

/// The quick disk model: random 4 KiB reads and writes at depth 32, sequential 1 MiB reads
/// and writes at depth 4, each after a discarded ramp of 250 ms (a virtio disk's host cache
/// absorbs the first fraction of a second of writes faster than it sustains them); the reads
/// measured for 0.5 s, the writes for 1 s.
fn quick_model(file: &Arc<File>, fg: (u64, u64), bg: (u64, u64)) -> Result<DiskModel, BoxError> {
    let t = Duration::from_millis(500);
    let (read_iops, _) = measure(file, fg, false, true, 4096, 32, t)?;
    let (_, read_bw) = measure(file, fg, false, false, 1 << 20, 4, t)?;
    let (write_iops, _) = measure(file, bg, true, true, 4096, 32, t * 2)?;
    let (_, write_bw) = measure(file, bg, true, false, 1 << 20, 4, t * 2)?;
    let m = DiskModel::new(
        Figures {
            iops: read_iops.max(1.0) as u64,
            bandwidth: read_bw.max(1.0) as u64,
        },
        Figures {
            iops: write_iops.max(1.0) as u64,
            bandwidth: write_bw.max(1.0) as u64,
        },
    );
    m.validate()?;
    Ok(m)
}

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

// ---------------------------------------------------------------------------------------------
// The phases.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
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
    const ALL: [Phase; 6] = [
        Phase::Idle,
        Phase::Plain,
        Phase::IoThrottle,
        Phase::Cross,
        Phase::Target,
        Phase::Unthrottled,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Unthrottled => "unthrottled",
            Phase::Plain => "plain",
            Phase::IoThrottle => "iothrottle",
            Phase::Cross => "cross",
            Phase::Target => "target",
        }
    }

    fn index(self) -> usize {
        Phase::ALL.iter().position(|p| *p == self).expect("listed")
    }
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("constant bounds")
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record((d.as_nanos() as u64).max(1));
}

/// What the drivers of one slice record.
struct Recorder {
    /// Foreground latency from the scheduled arrival, and the lag from the arrival to the
    /// read's issue (ns).
    fg: Mutex<(Histogram<u64>, Histogram<u64>)>,
    fg_errors: AtomicU64,
    /// Arrivals given up at the drain bound (counted with the latency they had reached).
    fg_abandoned: AtomicU64,
    bg_bytes: AtomicU64,
    bg_errors: AtomicU64,
}

impl Recorder {
    fn new() -> Self {
        Recorder {
            fg: Mutex::new((new_hist(), new_hist())),
            fg_errors: AtomicU64::new(0),
            fg_abandoned: AtomicU64::new(0),
            bg_bytes: AtomicU64::new(0),
            bg_errors: AtomicU64::new(0),
        }
    }

    fn fg(&self, latency: Duration, lag: Duration) {
        if let Ok(mut h) = self.fg.lock() {
            record(&mut h.0, latency);
            record(&mut h.1, lag);
        }
    }
}

/// One slice of one phase.
struct Row {
    phase: Phase,
    round: u64,
    fg: Histogram<u64>,
    lag: Histogram<u64>,
    /// Seconds from the slice's start to its last read's end.
    elapsed: f64,
    bg_bytes: u64,
    /// Queue wait of the foreground in the dispatcher (dispatched phases).
    fg_queue_p99: Option<Duration>,
    busy_ms: Option<u64>,
    fg_errors: u64,
    fg_abandoned: u64,
    bg_errors: u64,
}

impl Row {
    fn bg_mb_s(&self) -> f64 {
        self.bg_bytes as f64 / self.elapsed.max(1e-9) / 1e6
    }
}

/// One phase's totals over all rounds.
struct PhaseResult {
    phase: Phase,
    fg: Histogram<u64>,
    lag: Histogram<u64>,
    elapsed: f64,
    bg_bytes: u64,
    busy_ms: Option<u64>,
    errors: (u64, u64, u64),
    rounds: Rounds,
}

impl PhaseResult {
    fn empty(phase: Phase) -> Self {
        PhaseResult {
            phase,
            fg: new_hist(),
            lag: new_hist(),
            elapsed: 0.0,
            bg_bytes: 0,
            busy_ms: Some(0),
            errors: (0, 0, 0),
            rounds: Rounds::default(),
        }
    }

    fn add(&mut self, r: &Row) {
        self.fg.add(&r.fg).expect("same bounds");
        self.lag.add(&r.lag).expect("same bounds");
        self.elapsed += r.elapsed;
        self.bg_bytes += r.bg_bytes;
        self.busy_ms = self.busy_ms.zip(r.busy_ms).map(|(a, b)| a + b);
        self.errors.0 += r.fg_errors;
        self.errors.1 += r.fg_abandoned;
        self.errors.2 += r.bg_errors;
        self.rounds.push(q(&r.fg, 0.99), r.bg_mb_s());
    }

    fn bg_mb_s(&self) -> f64 {
        self.bg_bytes as f64 / self.elapsed.max(1e-9) / 1e6
    }

    fn busy(&self) -> Option<f64> {
        self.busy_ms
            .map(|b| b as f64 / (self.elapsed.max(1e-9) * 1000.0))
    }
}

fn q(h: &Histogram<u64>, q: f64) -> Duration {
    if h.is_empty() {
        Duration::ZERO
    } else {
        Duration::from_nanos(h.value_at_quantile(q))
    }
}

/// One dispatcher's file, serving both classes.
struct Io {
    file: ThrottledFile,
    fg: ClassId,
    bg: ClassId,
}

/// How a phase issues its I/O.
#[derive(Clone)]
enum Route {
    /// From the tokio runtime through the pass-through dispatcher.
    Direct(Arc<Io>),
    /// The same, the compaction's bytes through a plain limiter first.
    Plain(Throttle<Uncapped>, Arc<Io>),
    /// Through a throttling dispatcher: from its shards (`on_shards`) or from the runtime.
    Dispatched {
        d: Arc<Dispatcher>,
        io: Arc<Io>,
        on_shards: bool,
    },
}

impl Route {
    fn io(&self) -> &Arc<Io> {
        match self {
            Route::Direct(io) | Route::Plain(_, io) | Route::Dispatched { io, .. } => io,
        }
    }
}

struct Ctx {
    file: Arc<File>,
    fg_region: (u64, u64),
    bg_region: (u64, u64),
    bg_bytes: u64,
    interrupted: Arc<AtomicBool>,
    busy: DiskBusy,
}

/// The dispatcher stopped: the phase is over for this driver.
fn is_shutdown(e: &DiskError) -> bool {
    matches!(e, DiskError::Dispatch(_) | DiskError::Submit(_))
}

/// A task of the slice, wherever it runs.
type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Starts `make()`'s future on shard `n % shards` of `d`, or on the tokio runtime.
fn start<F, Fut>(route: &Route, n: usize, make: F) -> Result<Driver, BoxError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    match route {
        Route::Dispatched {
            d, on_shards: true, ..
        } => {
            let h = d.spawn_on(n % d.shards(), make)?;
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
async fn reader(
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
        tokio::time::sleep_until(at.into()).await;
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
async fn writer(
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
async fn run_slice(
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
            writers.push(start(&route, w, move || {
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
        readers.push(start(&route, w, move || {
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
    stop.store(true, Ordering::Relaxed);
    let bg_bytes = rec.bg_bytes.load(Ordering::Relaxed);
    let busy1 = ctx.busy.busy_ms();
    for w in writers {
        w.await;
    }
    let fg_queue_p99 = match (&dispatcher, &stats0) {
        (Some((d, fg)), Some(s0)) => {
            let s: DispatcherStats = d.stats().await;
            Some(s.since(s0).classes[fg.index()].queue_wait_p99())
        }
        _ => None,
    };
    let (fg, lag) = rec.fg.lock().map_err(|_| "poisoned")?.clone();
    let row = Row {
        phase,
        round,
        fg,
        lag,
        elapsed: end.saturating_duration_since(t0).as_secs_f64(),
        bg_bytes,
        fg_queue_p99,
        busy_ms: busy1.zip(busy0).map(|(b, a)| b - a),
        fg_errors: rec.fg_errors.load(Ordering::Relaxed),
        fg_abandoned: rec.fg_abandoned.load(Ordering::Relaxed),
        bg_errors: rec.bg_errors.load(Ordering::Relaxed),
    };
    print_row(&row);
    Ok(row)
}

/// A few hundred reads by each route, not recorded: the rings' and the shards' first
/// wake-ups are not what the phases measure.
async fn warm_up(ctx: &Ctx, ios: &[&Arc<Io>]) -> Result<(), BoxError> {
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
async fn settle(ctx: &Ctx, args: &Args) -> Result<(), BoxError> {
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

/// One spinning thread per core until dropped (`--saturate`).
struct Spinners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    fn start() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    // Relaxed: a flag polled until set; nothing else is published with it.
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        // Relaxed: see the spinning loop.
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn fmt_d(d: Duration) -> String {
    if d >= Duration::from_millis(10) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else if d >= Duration::from_millis(1) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.0} µs", d.as_secs_f64() * 1e6)
    }
}

fn print_header() {
    println!(
        "{:<11} {:>3} | {:>7} {:>10} {:>10} {:>10} {:>12} | {:>8} | {:>5}",
        "phase", "rnd", "fg IOPS", "fg p50", "fg p99", "lag p99", "qwait p99", "bg MB/s", "util"
    );
}

fn print_row(r: &Row) {
    println!(
        "{:<11} {:>3} | {:>7.0} {:>10} {:>10} {:>10} {:>12} | {:>8.1} | {:>5}",
        r.phase.name(),
        r.round,
        r.fg.len() as f64 / r.elapsed.max(1e-9),
        fmt_d(q(&r.fg, 0.5)),
        fmt_d(q(&r.fg, 0.99)),
        fmt_d(q(&r.lag, 0.99)),
        r.fg_queue_p99.map_or("–".to_owned(), fmt_d),
        r.bg_mb_s(),
        r.busy_ms.map_or("?".to_owned(), |b| format!(
            "{:.0}%",
            b as f64 / (r.elapsed.max(1e-9) * 10.0)
        )),
    );
}

fn real_disk(args: &Args) -> Result<(), BoxError> {
    let parent = check_args(args)?;
    let bg_bytes = args.bg_kib * 1024;
    let region_bytes = args.fg_mib << 20;
    // The compaction cycles over whole writes of its region.
    let bg_region_len = (args.bg_mib << 20) / bg_bytes * bg_bytes;
    // Checked before the run: the buffers can be had.
    drop(AlignedBuf::new(bg_bytes as usize, 0)?);

    let dir = tempfile::Builder::new()
        .prefix("disk_throttle-")
        .tempdir_in(&parent)
        .map_err(|e| {
            format!(
                "cannot make a scratch directory in {}: {e}",
                parent.display()
            )
        })?;
    // The cross-thread phase's submitters, and the idle/plain/unthrottled drivers.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        rt.spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("\ninterrupted: stopping and removing the scratch files");
                interrupted.store(true, Ordering::Relaxed);
            }
        });
    }
    let result = rt.block_on(real_disk_inner(
        args,
        dir.path(),
        (bg_bytes, region_bytes, bg_region_len),
        interrupted,
    ));
    // The scratch directory goes whatever happened (TempDir's drop; said explicitly here).
    let path = dir.path().to_owned();
    if let Err(e) = dir.close() {
        eprintln!("could not remove {}: {e}", path.display());
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

/// The recommended configuration (docs/disk.md): the builder's defaults, the compaction bounded
/// to a quarter of the goal in flight. The flags only override what they name.
fn dispatcher(
    args: &Args,
    disk: DiskModel,
    target: Option<Duration>,
    file: &File,
    path: &Path,
) -> Result<(Arc<Dispatcher>, Arc<Io>), BoxError> {
    let goal = args.goal_us.map_or(
        DispatcherBuilder::DEFAULT_LATENCY_GOAL,
        Duration::from_micros,
    );
    let mut b = Dispatcher::builder().disk(disk).capped(!args.uncapped);
    if let Some(us) = args.goal_us {
        b = b.latency_goal(Duration::from_micros(us));
    }
    if let Some(s) = args.shards {
        b = b.shards(s);
    }
    let mut fg = ClassConfig::new("foreground", args.shares.0);
    if let Some(t) = target {
        fg = fg.with_latency_target(t);
    }
    let mut bg = ClassConfig::new("compaction", args.shares.1);
    match (args.no_bg_bound, args.bg_in_flight_us) {
        (true, _) => {}
        (false, Some(us)) => bg = bg.with_max_in_flight(Duration::from_micros(us)),
        (false, None) => bg = bg.with_max_in_flight(goal / 4),
    }
    let fg = b.add_class(fg)?;
    let bg = b.add_class(bg)?;
    let d = Arc::new(b.build()?);
    let io = open_io(&d, (fg, bg), file, path)?;
    Ok((d, io))
}

fn open_io(
    d: &Arc<Dispatcher>,
    (fg, bg): (ClassId, ClassId),
    file: &File,
    path: &Path,
) -> Result<Arc<Io>, BoxError> {
    let options = FileOptions {
        write: true,
        // The scratch file was written in full: nothing to reserve.
        reserve_writes: false,
        ..FileOptions::default()
    };
    let file = ThrottledFile::from_file(d.clone(), fg, file.try_clone()?, path, options)?;
    Ok(Arc::new(Io { file, fg, bg }))
}

async fn real_disk_inner(
    args: &Args,
    dir: &Path,
    (bg_bytes, region_bytes, bg_region_len): (u64, u64, u64),
    interrupted: Arc<AtomicBool>,
) -> Result<(), BoxError> {
    let path = dir.join("data");
    let file = Arc::new(open_direct(&path, true).map_err(|e| {
        format!(
            "cannot open {} with O_DIRECT: {e} (is --dir on a file system that supports it?)",
            path.display()
        )
    })?);
    let fg_region = (0, region_bytes);
    let bg_region = (region_bytes, bg_region_len);
    println!(
        "iothrottle disk_throttle: foreground 4 KiB O_DIRECT random reads (open loop, from arrival) vs a compaction of {} KiB O_DIRECT writes",
        args.bg_kib
    );
    println!(
        "  scratch file {} ({} MiB read by the foreground, {} MiB written by the compaction)",
        path.display(),
        args.fg_mib,
        args.bg_mib
    );
    // Write the whole file once (unwritten extents would read as zeros without touching the disk).
    let t = Instant::now();
    {
        let file = file.clone();
        let total = region_bytes + bg_region_len;
        let interrupted = interrupted.clone();
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let buf = AlignedBuf::new(4 << 20, 0xA5)?;
            let mut off = 0;
            while off < total {
                if interrupted.load(Ordering::Relaxed) {
                    return Err("interrupted".into());
                }
                let n = (total - off).min(buf.len as u64) as usize;
                file.write_all_at(&buf.as_slice()[..n], off)
                    .map_err(|e| format!("writing the scratch file: {e}"))?;
                off += n as u64;
            }
            file.sync_all()?;
            Ok(())
        })
        .await??;
    }
    println!(
        "  wrote {} MiB in {:.1} s",
        (region_bytes + bg_region_len) >> 20,
        t.elapsed().as_secs_f64()
    );
    let disk = match &args.properties {
        Some(p) => {
            let m = DiskModel::from_properties(p)?;
            println!("  disk model from {}", p.display());
            m
        }
        None => {
            let t = Instant::now();
            let f = file.clone();
            let m = tokio::task::spawn_blocking(move || quick_model(&f, fg_region, bg_region))
                .await??;
            println!("  disk model measured in {:.1} s (O_DIRECT, 4 KiB random at depth 32, 1 MiB sequential at depth 4)", t.elapsed().as_secs_f64());
            m
        }
    };
    println!(
        "  reads {:.0} IOPS, {:.0} MB/s; writes {:.0} IOPS, {:.0} MB/s",
        disk.read.iops as f64,
        disk.read.bandwidth as f64 / 1e6,
        disk.write.iops as f64,
        disk.write.bandwidth as f64 / 1e6
    );
    let (d, io) = dispatcher(args, disk, None, &file, &path)?;
    let (d_cross, cross_io) = dispatcher(args, disk, None, &file, &path)?;
    // Built when the target is known (after the first idle slice, unless given).
    let mut target: Option<(Duration, Arc<Dispatcher>, Arc<Io>)> = None;
    if let Some(us) = args.target_us {
        let t = Duration::from_micros(us);
        let (dt, io) = dispatcher(args, disk, Some(t), &file, &path)?;
        target = Some((t, dt, io));
    }
    // The idle, unthrottled and plain phases' engine: io_uring through a dispatcher that never
    // holds a request back (a modelled disk a thousand times faster than any, uncapped).
    let engine = Arc::new(
        Dispatcher::builder()
            .disk(DiskModel::symmetric(Figures {
                iops: 1 << 30,
                bandwidth: 1 << 40,
            }))
            .capped(false)
            .class(ClassConfig::new("all", 1))
            .build()?,
    );
    let all = engine.class_id("all").expect("configured above");
    let direct = open_io(&engine, (all, all), &file, &path)?;
    if direct.file.backend() != io.file.backend() {
        return Err("the pass-through and the throttled files use different I/O backends".into());
    }
    println!(
        "  I/O on {:?}, {} shards; dispatcher: latency goal {} ({}), compaction in flight at most {}, pieces of {} KiB (compaction) and {} KiB (foreground); one 4 KiB read costs {}, one {} KiB write {}",
        io.file.backend(),
        d.shards(),
        fmt_d(d.latency_goal()),
        if args.uncapped { "uncapped" } else { "capped" },
        d.class_config(io.bg)
            .and_then(|c| c.max_in_flight())
            .map_or("unbounded".to_owned(), fmt_d),
        io.file.piece_size(io.bg, iothrottle::dispatcher::IoKind::Write).unwrap_or(0) / 1024,
        io.file.piece_size(io.fg, iothrottle::dispatcher::IoKind::Read).unwrap_or(0) / 1024,
        fmt_d(disk.disk_time(&IoRequest::read(READ_BYTES))),
        args.bg_kib,
        fmt_d(disk.disk_time(&IoRequest::write(bg_bytes))),
    );
    println!(
        "  foreground: {} readers, {} reads/s in total, open loop; compaction: {} writes in flight; plain limiter at {:.1} MB/s; {} rounds of {} ms slices{}\n",
        args.fg_depth,
        args.fg_iops,
        args.bg_depth,
        args.plain_rate as f64 / 1e6,
        args.phase_secs,
        args.slice_ms,
        if args.saturate { "; a spinning thread per core (--saturate)" } else { "" },
    );

    let ctx = Ctx {
        busy: DiskBusy::new(&file),
        file: file.clone(),
        fg_region,
        bg_region,
        bg_bytes,
        interrupted,
    };
    let spinners = args.saturate.then(Spinners::start);
    warm_up(&ctx, &[&direct, &io, &cross_io]).await?;
    print_header();
    let mut rows = Vec::new();
    let mut results: Vec<PhaseResult> = Phase::ALL.iter().map(|p| PhaseResult::empty(*p)).collect();
    for (round, phase) in (1..=args.phase_secs).flat_map(|r| Phase::ALL.map(|p| (r, p))) {
        let route = match phase {
            Phase::Idle | Phase::Unthrottled => Route::Direct(direct.clone()),
            Phase::Plain => {
                let cfg = BucketConfig::new(
                    Rate::per_second(args.plain_rate),
                    bg_bytes.max(args.plain_rate / 100),
                );
                Route::Plain(Throttle::<Uncapped>::new(cfg)?, direct.clone())
            }
            Phase::IoThrottle => Route::Dispatched {
                d: d.clone(),
                io: io.clone(),
                on_shards: true,
            },
            Phase::Cross => Route::Dispatched {
                d: d_cross.clone(),
                io: cross_io.clone(),
                on_shards: false,
            },
            Phase::Target => {
                if target.is_none() {
                    let idle = &results[Phase::Idle.index()].fg;
                    let t = q(idle, 0.99).mul_f64(1.5).max(Duration::from_micros(100));
                    let (dt, tio) = dispatcher(args, disk, Some(t), &file, &path)?;
                    warm_up(&ctx, &[&tio]).await?;
                    println!("  (latency target {})", fmt_d(t));
                    target = Some((t, dt, tio));
                }
                let (_, dt, tio) = target.as_ref().expect("built above");
                Route::Dispatched {
                    d: dt.clone(),
                    io: tio.clone(),
                    on_shards: true,
                }
            }
        };
        if phase == Phase::Idle {
            settle(&ctx, args).await?;
        }
        let row = run_slice(&ctx, args, (phase, round), route).await?;
        results[phase.index()].add(&row);
        rows.push(row);
    }
    drop(spinners);
    let panics = d.panics() + d_cross.panics();
    d.shutdown();
    d_cross.shutdown();
    engine.shutdown();
    let target_p99 = match &target {
        Some((t, dt, _)) => {
            dt.shutdown();
            *t
        }
        None => return Err("the target phase did not run".into()),
    };
    if panics > 0 {
        return Err(format!("{panics} tasks panicked on the shards").into());
    }

    // Side by side.
    println!();
    println!(
        "{:<11} | {:>9} {:>9} {:>9} | {:>9} {:>9} | {:>9} | {:>8} {:>8} {:>8} | {:>5}",
        "phase",
        "p50",
        "p99",
        "p999",
        "med p99",
        "worst p99",
        "lag p99",
        "bg MB/s",
        "med",
        "worst",
        "util"
    );
    println!(
        "{:<11} | {:>29} | {:>19} | {:>9} | {:>26} |",
        "", "fg latency from arrival", "p99 over rounds", "", "compaction (all, median, worst)"
    );
    for r in &results {
        println!(
            "{:<11} | {:>9} {:>9} {:>9} | {:>9} {:>9} | {:>9} | {:>8.1} {:>8.1} {:>8.1} | {:>5}",
            r.phase.name(),
            fmt_d(q(&r.fg, 0.5)),
            fmt_d(q(&r.fg, 0.99)),
            fmt_d(q(&r.fg, 0.999)),
            fmt_d(r.rounds.median_p99()),
            fmt_d(r.rounds.worst_p99()),
            fmt_d(q(&r.lag, 0.99)),
            r.bg_mb_s(),
            r.rounds.median_bg(),
            r.rounds.worst_bg(),
            r.busy()
                .map_or("?".to_owned(), |b| format!("{:.0}%", b * 100.0)),
        );
        let (fe, fa, be) = r.errors;
        if fe + fa + be > 0 {
            println!(
                "  ({fe} foreground errors, {fa} arrivals given up after 4 slices (counted with the latency they reached), {be} compaction errors)"
            );
        }
    }
    let p99 = |p: Phase| q(&results[p.index()].fg, 0.99);
    let bw = |p: Phase| results[p.index()].bg_mb_s();
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let idle = p99(Phase::Idle);
    println!(
        "targets: iothrottle (thread-per-core) fg p99 / idle = {:.2} (≤ 1.3); cross-thread / idle = {:.2} (≤ 1.5); compaction iothrottle / plain = {:.2}× (≥ 5); iothrottle p99 / plain p99 = {:.2} (≤ 1 with --saturate); target {} (p99 {})",
        ratio(p99(Phase::IoThrottle), idle),
        ratio(p99(Phase::Cross), idle),
        bw(Phase::IoThrottle) / bw(Phase::Plain).max(1e-9),
        ratio(p99(Phase::IoThrottle), p99(Phase::Plain)),
        fmt_d(target_p99),
        fmt_d(p99(Phase::Target)),
    );
    plot_real(args, &rows)?;
    println!("plot written to {}", args.plot.display());
    let us = |d: Duration| d.as_micros();
    println!(
        "summary: idle_p99_us={} unthrottled_p99_us={} unthrottled_bg_mb_s={:.0} plain_p99_us={} plain_bg_mb_s={:.0} iothrottle_p99_us={} iothrottle_bg_mb_s={:.0} target_p99_us={} target_bg_mb_s={:.0} cross_p99_us={} cross_bg_mb_s={:.0}",
        us(idle),
        us(p99(Phase::Unthrottled)),
        bw(Phase::Unthrottled),
        us(p99(Phase::Plain)),
        bw(Phase::Plain),
        us(p99(Phase::IoThrottle)),
        bw(Phase::IoThrottle),
        us(p99(Phase::Target)),
        bw(Phase::Target),
        us(p99(Phase::Cross)),
        bw(Phase::Cross),
    );
    std::io::stdout().flush()?;
    Ok(())
}

fn phase_color(p: Phase) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match p {
        Phase::Idle => RGBColor(44, 160, 44),
        Phase::Cross => RGBColor(148, 103, 189),
        Phase::Unthrottled => RGBColor(214, 39, 40),
        Phase::Plain => RGBColor(255, 127, 14),
        Phase::IoThrottle => RGBColor(31, 119, 180),
        Phase::Target => RGBColor(23, 190, 207),
    }
}

fn plot_real(args: &Args, rows: &[Row]) -> Result<(), BoxError> {
    use plotters::prelude::*;

    let root = SVGBackend::new(&args.plot, (1000, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(380);
    let x_max = args.phase_secs as f64 + 0.5;
    let bw_max = rows.iter().map(|r| r.bg_mb_s()).fold(1.0, f64::max) * 1.3;
    let p99_ms = |r: &Row| (q(&r.fg, 0.99).as_secs_f64() * 1e3).max(1e-3);
    let lat_max = rows.iter().map(p99_ms).fold(0.1, f64::max) * 2.0;
    let lat_min = rows
        .iter()
        .map(p99_ms)
        .fold(f64::MAX, f64::min)
        .min(lat_max)
        / 2.0;
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "disk_throttle: compaction bandwidth by phase ({} KiB O_DIRECT writes)",
                args.bg_kib
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..x_max, 0.0..bw_max)?;
    chart
        .configure_mesh()
        .x_desc("round (one slice of each phase per round)")
        .y_desc("compaction MB/s")
        .draw()?;
    for p in Phase::ALL {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.phase == p)
            .map(|r| (r.round as f64, r.bg_mb_s()))
            .collect();
        let c = phase_color(p);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(p.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            "foreground 4 KiB read latency from arrival, p99 per slice (log scale)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..x_max, (lat_min..lat_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("round (one slice of each phase per round)")
        .y_desc("ms")
        .draw()?;
    for p in Phase::ALL {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.phase == p)
            .map(|r| (r.round as f64, p99_ms(r)))
            .collect();
        let c = phase_color(p);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(format!("{} p99", p.name()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
