//! The shard thread: pins itself, runs a tokio current-thread runtime with a `LocalSet`, takes
//! requests from its channel into its [`ShardCore`], sleeps when the bucket owes it tokens, and
//! spawns the dispatched futures locally.
//!
//! Everything the loop owns is local to the thread (`RefCell`, `Rc`, `Cell`): the only shared
//! state on the hot path is the bucket and the classes' fairness counters.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{oneshot, Notify};

use crate::sync::Arc;
use crate::DispatchError;

use super::queue::Entry;
use super::shard::{Next, ShardCore};
use super::shard_io;
#[cfg(target_os = "linux")]
use super::shard_timer;
use super::spawn::{self, SpawnJob};
use super::state::Shared;
use super::stats::ShardStats;
use super::task::{
    add_panics, count_panic, panic_message, Activity, BoxTask, Completion, InFlight,
};
use super::timer::{FineTimer, FINE_BELOW};

/// What reaches a shard through its channel.
pub(crate) enum Msg {
    Submit(Entry<BoxTask>),
    Stats(StatsReply),
    Shutdown(ShutdownMode),
    /// Poll again: a run-time setting changed (rate, shares, cap).
    Wake,
    /// Start a task of the engine's own on the shard ([`Dispatcher::spawn_on`]).
    ///
    /// [`Dispatcher::spawn_on`]: super::Dispatcher::spawn_on
    Spawn(SpawnJob),
    /// Run a future to its end on the shard, counted among its running futures (a shutdown
    /// waits for it): a request dispatched on its caller's thread whose handle was dropped, or
    /// a background transfer its caller handed over ([`Dispatcher::run_on`]).
    ///
    /// [`Dispatcher::run_on`]: super::Dispatcher::run_on
    Run(crate::dispatcher::task::BoxFuture),
}

/// Where a shard sends a copy of its stats.
pub(crate) enum StatsReply {
    Async(oneshot::Sender<ShardStats>),
    Blocking(std::sync::mpsc::Sender<ShardStats>),
}

impl StatsReply {
    fn send(self, stats: ShardStats) {
        match self {
            StatsReply::Async(tx) => {
                let _ = tx.send(stats);
            }
            StatsReply::Blocking(tx) => {
                let _ = tx.send(stats);
            }
        }
    }
}

/// How a shard shuts down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShutdownMode {
    /// Dispatch everything queued (at the configured rate), wait for it, then stop.
    Drain,
    /// Fail everything not yet dispatched with [`DispatchError::ShutDown`], wait for the
    /// futures already running, then stop.
    Cancel,
}

/// Held by a shard thread: when it ends, however it ends, the dispatcher's exit latch counts
/// it (and the panics caught in its last steps are counted).
struct Exit(Arc<Shared>);

impl Drop for Exit {
    fn drop(&mut self) {
        add_panics(&self.0);
        self.0.exits.exited();
    }
}

/// The fine timer and its thread (to wake it when a deadline changes).
pub(crate) type Timer = (Arc<FineTimer>, std::thread::Thread);

/// A hook run on each shard thread as it starts ([`DispatcherBuilder::on_shard_start`]).
///
/// [`DispatcherBuilder::on_shard_start`]: super::DispatcherBuilder::on_shard_start
pub(crate) type StartHook = Arc<dyn Fn(usize) -> std::io::Result<()> + Send + Sync>;

/// A hook run on each shard thread as it ends ([`DispatcherBuilder::on_shard_stop`]).
///
/// [`DispatcherBuilder::on_shard_stop`]: super::DispatcherBuilder::on_shard_stop
pub(crate) type StopHook = Arc<dyn Fn(usize) + Send + Sync>;

/// What a builder says about the shard threads: pinned or not, the slice they ask for, the
/// hooks.
pub(crate) struct Threads {
    pub(crate) pin: bool,
    pub(crate) slice: Option<Duration>,
    pub(crate) start: Option<StartHook>,
    pub(crate) stop: Option<StopHook>,
}

/// How a shard thread starts: the core it pins itself to, the slice it asks for, the hook it
/// runs after that with the channel its outcome goes back on (the builder waits for it), and
/// the hook it runs as it ends.
pub(crate) struct Start {
    pub(crate) core: Option<core_affinity::CoreId>,
    pub(crate) slice: Option<Duration>,
    pub(crate) hook: Option<(StartHook, std::sync::mpsc::SyncSender<std::io::Result<()>>)>,
    pub(crate) stop: Option<StopHook>,
    /// The shard's own channel, for code running on it ([`spawn::current_shard`]).
    pub(crate) tx: tokio::sync::mpsc::WeakUnboundedSender<Msg>,
}

/// Runs a shard's stop hook when dropped: as the thread ends, however it ends (a panic of the
/// hook is caught, logged and counted in [`Dispatcher::panics`](super::Dispatcher::panics);
/// the thread is ending).
struct OnStop {
    hook: StopHook,
    index: usize,
}

impl Drop for OnStop {
    fn drop(&mut self) {
        let (hook, index) = (&self.hook, self.index);
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(index)))
        {
            // Counted with the user futures' panics (the thread's `Exit` adds it).
            count_panic();
            tracing::error!(
                shard = index,
                "the shard's stop hook panicked: {}",
                panic_message(&*payload)
            );
        }
    }
}

#[cfg(not(target_os = "linux"))] // No timerfds: every short sleep uses the timer thread.
mod shard_timer {
    pub(super) async fn expired(_own: Option<&()>) {}
}

/// Starts shard `index` on its own thread, running `rt`.
pub(crate) fn spawn(
    index: usize,
    id: usize,
    shared: Arc<Shared>,
    rx: UnboundedReceiver<Msg>,
    rt: tokio::runtime::Runtime,
    start: Start,
    timer: Timer,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("iothrottle-shard-{index}"))
        .spawn(move || {
            if let Some(core) = start.core {
                if !core_affinity::set_for_current(core) {
                    tracing::warn!(
                        shard = index,
                        core = core.id,
                        "could not pin the shard thread to its core; it runs unpinned"
                    );
                }
            }
            if let Some(slice) = start.slice {
                if let Err(e) = super::slice::set_current(slice) {
                    tracing::warn!(
                        shard = index,
                        "could not set the shard thread's scheduler slice ({e}); it runs with \
                         its default"
                    );
                }
            }
            let _exit = Exit(shared.clone());
            if let Some((hook, ready)) = start.hook {
                let outcome = run_hook(&hook, index);
                let failed = outcome.is_err();
                // The builder waits for this; should it be gone, there is nobody to run for.
                if ready.send(outcome).is_err() || failed {
                    return;
                }
            }
            // The shard runs from here: its stop hook runs as the thread ends (dropped before
            // `_exit`, so before the dispatcher's shutdown sees the thread gone).
            let _stop = start.stop.map(|hook| OnStop { hook, index });
            // Owned here, after the hook's guard: even unwinding drops it before the hook runs.
            let rt = rt;
            spawn::enter(id, index, shared.clone(), start.tx);
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, run(index, shared, rx, timer));
            // Dropping the LocalSet drops any future still running; their `Completion`s
            // release their tokens. Then the runtime, with the ring's reaper tasks.
            drop(local);
            spawn::leave();
            drop(rt);
        })
}

/// Runs the start hook of shard `index`; a panic becomes an error carrying its message.
fn run_hook(hook: &StartHook, index: usize) -> std::io::Result<()> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(index))) {
        Ok(outcome) => outcome,
        Err(payload) => Err(std::io::Error::other(format!(
            "the start hook panicked: {}",
            panic_message(&*payload)
        ))),
    }
}

/// A polling round in which the thread was preempted (an involuntary context switch) and off
/// its CPU for longer than this (wall-clock time minus the thread's CPU time) lost that time to
/// another thread. Blocking in a system call (a submission waiting for the device) is a
/// voluntary switch and does not count; a kernel worker's short run does not either.
const PREEMPTED: Duration = Duration::from_micros(50);
/// The core is contended when preempted rounds lost more than this share (1/16) of the time
/// polled since the last back-off (over [`SHARE_WINDOW`]). Traced on a 2-vCPU VM during the
/// main job: on a core shared with a thread that wants it all, a polling shard lost 24% of its
/// time (preemptions of 50–150 µs every 0.2–1.5 ms of polling); on a core that only kernel
/// workers and short-lived threads visit, 2% (16 preemptions of 52 µs to 1.7 ms, most under
/// 120 µs, 0.3–45 ms of polling apart). Backing off for each of those would leave a shard
/// serving a read every 500 µs parked most of the time.
const LOST_SHARE: u32 = 16;
/// The polling time the share is taken over: past it, both figures halve, so that contention
/// that starts after a long quiet spell shows within one window. Polling a whole window
/// without being found contended also starts the next back-off from
/// [`CONTENDED_BACKOFF_MIN`] again.
const SHARE_WINDOW: Duration = Duration::from_millis(100);
/// Once it finds its core contended, the shard parks at once when idle for a back-off: this
/// long after the first, twice the last after each further one, up to [`CONTENDED_BACKOFF`]; a
/// poll that then runs its whole time undisturbed, or a window's polling
/// ([`SHARE_WINDOW`]) that does not find the core contended, starts the next back-off here
/// again.
const CONTENDED_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest back-off. Polling a contended core costs the other threads CPU, and the shard
/// its wake-up priority: a poller preempted with a read in flight waits as a runnable thread
/// for the other's time slice to end, where a parked one is woken by the completion and may
/// preempt it. On a core kept busy the back-off is a second from the eighth time in a row the
/// core is found contended, and the shard then polls, and is preempted, once a second at most;
/// on a core contended now and then it polls again after 10 ms.
const CONTENDED_BACKOFF: Duration = Duration::from_secs(1);

/// A shard polls only while its ring runs at most this deep: this many io_uring operations in
/// flight, and no more in the last batch of completions it reaped. With more, each wake-up
/// already serves several completions (they arrive while it wakes), and polling would only take
/// the CPU the submitting threads need; with one, every event would cost a wake-up. The last
/// batch counts because a deep queue on a disk that completes requests together (a virtio disk
/// completes 32 random reads in one batch) drains to nothing in flight between batches: a
/// shard polling then takes the next batch's requests one by one as they arrive and submits
/// them in small pieces, which measured 1.25–1.30× direct io_uring at depth 32 against
/// 1.13–1.17× parked (`disk/read_4k`).
const POLL_MAX_IN_FLIGHT: usize = 1;

/// The calling thread's CPU time and its involuntary context switches so far (the times the
/// OS took its CPU to run another thread), from `getrusage(RUSAGE_THREAD)`; zeros if refused.
fn thread_usage() -> (Duration, i64) {
    // SAFETY: `rusage` is plain old data; all zeros is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: writes one `rusage` into a live local.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return (Duration::ZERO, 0);
    }
    let micros = |t: libc::timeval| t.tv_sec.max(0) as u64 * 1_000_000 + t.tv_usec.max(0) as u64;
    (
        Duration::from_micros(micros(ru.ru_utime) + micros(ru.ru_stime)),
        ru.ru_nivcsw as i64,
    )
}

/// A shard's idle poll ([`DispatcherBuilder::idle_poll`](super::DispatcherBuilder::idle_poll)).
struct IdlePoll {
    /// Poll for this long after the last activity; zero: never.
    time: Duration,
    /// A round off the CPU for longer than this means the core is contended ([`PREEMPTED`]).
    preempted: Duration,
    /// No polling before this (the core was found contended).
    backoff_until: Option<Instant>,
    /// The next back-off's length ([`CONTENDED_BACKOFF_MIN`] to [`CONTENDED_BACKOFF`]).
    backoff: Duration,
    /// The activity count last seen, and when it was first seen (the last activity's time, to
    /// within one round).
    seen: Option<(u64, Instant)>,
    /// Back-offs taken so far ([`ShardStats::idle_poll_backoffs`]).
    backoffs: u64,
    /// Wall-clock time spent polling since the last back-off (halved past [`SHARE_WINDOW`]).
    polled: Duration,
    /// Of `polled`, the time preempted rounds spent off the CPU.
    lost: Duration,
}

impl IdlePoll {
    /// A poll of `time` after the last activity that takes a round off the CPU for over
    /// `preempted` as lost to another thread; no back-off yet, nothing polled.
    fn new(time: Duration, preempted: Duration) -> Self {
        IdlePoll {
            time,
            preempted,
            backoff_until: None,
            backoff: CONTENDED_BACKOFF_MIN,
            seen: None,
            backoffs: 0,
            polled: Duration::ZERO,
            lost: Duration::ZERO,
        }
    }

    /// Polls while the shard is idle, for up to `time` after its last activity: each round
    /// lets the runtime poll its I/O driver without blocking and run what that woke (the
    /// io_uring reaper, the requests' futures), then checks the channel. Returns `true` when a
    /// message is waiting, `false` when the shard should park: the time is up, polling is off,
    /// or the core was found contended while polling (then it does not poll for a back-off;
    /// see [`CONTENDED_BACKOFF_MIN`], [`PREEMPTED`] and [`LOST_SHARE`]), or the ring runs deeper than
    /// [`POLL_MAX_IN_FLIGHT`].
    /// `reap` is called each round: it submits what is queued on the shard's ring, hands the
    /// completions already posted to their futures (when the ring runs at most
    /// [`POLL_MAX_IN_FLIGHT`] deep) and returns how deep it runs. Time spent
    /// running the woken futures does not count as descheduled: only wall-clock time the
    /// thread spent off its CPU does.
    async fn poll(
        &mut self,
        rx: &UnboundedReceiver<Msg>,
        activity: &Activity,
        mut reap: impl FnMut() -> usize,
    ) -> bool {
        if self.time.is_zero() {
            return false;
        }
        let mut last = Instant::now();
        if self.backoff_until.is_some_and(|t| last < t) {
            return false;
        }
        let started = last;
        // Dates the last activity: the first round that sees the count move.
        let active_at = |seen: &mut Option<(u64, Instant)>, now: Instant| -> Instant {
            let count = activity.count();
            match *seen {
                Some((c, at)) if c == count => at,
                _ => {
                    *seen = Some((count, now));
                    now
                }
            }
        };
        // Read only once the shard does poll (a system call): a shard that parks at once
        // (too much in flight) pays nothing for it.
        let mut last_cpu = None;
        loop {
            if !rx.is_empty() {
                return true;
            }
            // io_uring completions already posted reach their futures now; they run below.
            if last.saturating_duration_since(active_at(&mut self.seen, last)) >= self.time {
                // Polled its whole time, never found contended: the core is free.
                if last.saturating_duration_since(started) >= self.time {
                    self.undisturbed();
                }
                return false;
            }
            if reap() > POLL_MAX_IN_FLIGHT {
                return false;
            }
            let (before_cpu, before_switches) = *last_cpu.get_or_insert_with(thread_usage);
            // Deferred until the runtime has polled its driver with a zero timeout.
            tokio::task::yield_now().await;
            let (now, (cpu, switches)) = (Instant::now(), thread_usage());
            let round = now - last;
            let off_cpu = round.saturating_sub(cpu.saturating_sub(before_cpu));
            let preempted = off_cpu > self.preempted && switches > before_switches;
            if self.round(now, round, preempted.then_some(off_cpu)) {
                return !rx.is_empty();
            }
            (last, last_cpu) = (now, Some((cpu, switches)));
        }
    }

    /// Accounts for a polling round of `round` that ended at `now`, `lost` off the CPU when it
    /// was preempted; whether the core is now found contended (the shard backs off).
    fn round(&mut self, now: Instant, round: Duration, lost: Option<Duration>) -> bool {
        self.polled += round;
        if let Some(lost) = lost {
            self.lost += lost;
            if self.lost * LOST_SHARE > self.polled {
                self.contended(now);
                return true;
            }
        }
        if self.polled >= SHARE_WINDOW {
            self.polled /= 2;
            self.lost /= 2;
            self.undisturbed();
        }
        false
    }

    /// The core was found contended at `now`: no polling for the current back-off, and the
    /// next one twice as long (up to [`CONTENDED_BACKOFF`]).
    fn contended(&mut self, now: Instant) {
        self.backoffs += 1;
        (self.polled, self.lost) = (Duration::ZERO, Duration::ZERO);
        self.backoff_until = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(CONTENDED_BACKOFF);
    }

    /// A poll ran its whole time (the idle-poll time, in one call), or a window's polling
    /// ([`SHARE_WINDOW`]), without finding the core contended: the core is free again, and the
    /// next back-off starts from [`CONTENDED_BACKOFF_MIN`]. A poll that ends at once because
    /// the last activity is already that long ago says nothing of the core and leaves the
    /// back-off as it is.
    fn undisturbed(&mut self) {
        self.backoff = CONTENDED_BACKOFF_MIN;
    }
}

/// Resolves when a request of the shard's outstanding reservation is cancelled: the shard then
/// gives its tokens back at once instead of waiting for them to accrue.
fn cancelled(core: &RefCell<ShardCore<BoxTask>>) -> impl std::future::Future<Output = ()> + '_ {
    std::future::poll_fn(move |cx| match core.try_borrow_mut() {
        Ok(mut core) => core.poll_reservation_cancelled(cx),
        // Borrowed by a completion running inside this poll: looked at again at the next one.
        Err(_) => std::task::Poll::Pending,
    })
}

async fn run(
    index: usize,
    shared: Arc<Shared>,
    mut rx: UnboundedReceiver<Msg>,
    (timer, timer_thread): Timer,
) {
    let core = Rc::new(RefCell::new(ShardCore::<BoxTask>::new(
        shared.clone(),
        index,
    )));
    let inflight = Rc::new(InFlight {
        count: Cell::new(0),
        idle: Notify::new(),
        shared: shared.clone(),
        core: Rc::downgrade(&core),
        activity: Activity::default(),
        kick: Notify::new(),
    });
    // The shard's own tasks may dispatch requests that can go at once themselves.
    spawn::set_inflight(inflight.clone());
    let mut idle_poll = IdlePoll::new(shared.idle_poll, PREEMPTED);
    let mut published_backoffs = 0;
    // Made here, on the shard's runtime (its reactor registers the fd).
    #[cfg(target_os = "linux")]
    let own_timer = shard_timer::for_shard(index);
    let mut closing: Option<ShutdownMode> = None;
    let mut open = true;

    let handle = |msg: Msg, closing: &mut Option<ShutdownMode>| match msg {
        Msg::Submit(e) => {
            let class = e.class;
            if *closing == Some(ShutdownMode::Cancel) {
                e.payload.fail(DispatchError::ShutDown);
            } else {
                core.borrow_mut().enqueue(e);
            }
            // Counted by the sender while in the channel (after the queue counted it).
            shared.classes.queued_sub(class);
        }
        Msg::Stats(reply) => reply.send(ShardStats::new(&shared, index, core.borrow().stats())),
        Msg::Shutdown(mode) => {
            if *closing != Some(ShutdownMode::Cancel) {
                *closing = Some(mode);
            }
        }
        // The loop polls the core next, which takes up the change.
        Msg::Wake => {}
        // Runs to its end here, counted as a dispatched request's future is: even a shutdown
        // in progress waits for it (it ends soon, as what it submits from now is refused).
        Msg::Run(fut) => {
            let running = Running::start(inflight.clone());
            tokio::task::spawn_local(async move {
                let _running = running;
                fut.await;
            });
        }
        // Dropped unrun once shutdown started: its handle resolves to `Cancelled`.
        Msg::Spawn(job) => {
            if closing.is_none() {
                job();
            }
        }
    };
    // A message from the channel, or `None`: every sender is gone (the dispatcher was dropped),
    // which shuts the shard down as `shutdown_now` does.
    let receive = |msg: Option<Msg>, open: &mut bool, closing: &mut Option<ShutdownMode>| match msg
    {
        Some(msg) => handle(msg, closing),
        None => {
            *open = false;
            *closing = Some(ShutdownMode::Cancel);
        }
    };

    loop {
        while open {
            match rx.try_recv() {
                Ok(msg) => {
                    inflight.touch();
                    handle(msg, &mut closing);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => receive(None, &mut open, &mut closing),
            }
        }
        if closing.is_some() {
            // Any shutdown cancels the spawned tasks (see `Dispatcher::spawn_on`).
            spawn::close_current();
        }
        if closing == Some(ShutdownMode::Cancel) {
            let drained = core.borrow_mut().drain();
            for e in drained {
                e.payload.fail(DispatchError::ShutDown);
            }
        }
        let now = shared.clock.now();
        let next = core.borrow_mut().poll(now, &mut |e| {
            inflight.enter();
            let done = Completion {
                cost: e.cost,
                class: e.class,
                times: (e.submitted, now),
                inflight: inflight.clone(),
            };
            e.payload.spawn_local(done);
        });
        add_panics(&shared);
        if closing.is_some() && core.borrow().is_idle() {
            break;
        }
        match next {
            Next::Idle => {
                let woken = open
                    && idle_poll
                        .poll(&rx, &inflight.activity, || {
                            shard_io::poll(POLL_MAX_IN_FLIGHT)
                        })
                        .await;
                // Stored only when it moved (rarely): the shards' counters share cache lines.
                if published_backoffs != idle_poll.backoffs {
                    published_backoffs = idle_poll.backoffs;
                    // Relaxed: a statistic with this thread its only writer; nothing is
                    // published with it.
                    shared.poll_backoffs[index]
                        .store(published_backoffs, crate::sync::Ordering::Relaxed);
                }
                if woken {
                    // A message is waiting: take it without parking.
                    continue;
                }
                // Relaxed: a statistic of the unit tests.
                #[cfg(test)]
                shared.parks[index].fetch_add(1, crate::sync::Ordering::Relaxed);
                tokio::select! {
                    msg = rx.recv(), if open => receive(msg, &mut open, &mut closing),
                    // One of the shard's tasks dispatched a request itself: poll for it.
                    _ = inflight.kick.notified(), if open => {}
                    else => {}
                }
            }
            Next::WakeAfter(d) if d < FINE_BELOW => {
                // tokio's timer ticks in milliseconds: short sleeps go to the shard's timerfd
                // (`shard_timer`), else the timer thread, with a tokio sleep as a backstop.
                #[cfg(target_os = "linux")]
                let own = shard_timer::arm(own_timer.as_ref(), index, d);
                #[cfg(not(target_os = "linux"))]
                let own: Option<&()> = None;
                if own.is_none() {
                    timer.arm(index, d, &timer_thread);
                }
                // Relaxed: a statistic of the unit tests.
                #[cfg(test)]
                shared.short_sleeps[index][usize::from(own.is_none())]
                    .fetch_add(1, crate::sync::Ordering::Relaxed);
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => receive(msg, &mut open, &mut closing),
                    _ = timer.notify(index).notified(), if own.is_none() => {}
                    _ = shard_timer::expired(own), if own.is_some() => {}
                    _ = shared.released[index].notified() => {}
                    _ = cancelled(&core) => {}
                    _ = tokio::time::sleep(d + FINE_BELOW) => {}
                }
                match own {
                    #[cfg(target_os = "linux")]
                    Some(t) => shard_timer::disarm(t, index),
                    _ => timer.disarm(index),
                }
            }
            Next::WaitDurable(tail) => {
                let gate = shared
                    .gate
                    .as_deref()
                    .expect("only a gated shard waits for the mark");
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => receive(msg, &mut open, &mut closing),
                    _ = gate.wait_durable(tail) => {}
                }
            }
            Next::WakeAfter(d) => {
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => receive(msg, &mut open, &mut closing),
                    _ = shared.released[index].notified() => {}
                    _ = cancelled(&core) => {}
                    _ = tokio::time::sleep(d.max(Duration::from_nanos(1))) => {}
                }
            }
        }
    }
    // Everything is dispatched (or failed): wait for the running futures.
    while inflight.count.get() > 0 {
        inflight.idle.notified().await;
    }
    let stats = ShardStats::new(&shared, index, core.borrow().stats());
    if let Ok(mut slot) = shared.final_stats.lock() {
        slot[index] = Some(stats);
    }
    // Anything still in the channel (submitted while we stopped) is dropped with `rx`: its
    // handles resolve to `DispatchError::ShutDown`.
}

/// A future counted among a shard's running ones ([`Msg::Run`]) from its start until it is
/// dropped, finished or not (a panic unwinds through it too).
struct Running(Rc<InFlight>);

impl Running {
    fn start(inflight: Rc<InFlight>) -> Self {
        inflight.enter();
        Running(inflight)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures, IoRequest};
    use crate::sync::Ordering;

    fn one_shard(idle_poll: Duration) -> (Dispatcher, ClassId) {
        one_shard_pinned(idle_poll, false)
    }

    /// One shard with one class, pinned to a core or not.
    fn one_shard_pinned(idle_poll: Duration, pin: bool) -> (Dispatcher, ClassId) {
        let mut b = Dispatcher::builder()
            .shards(1)
            .pin_threads(pin)
            .idle_poll(idle_poll)
            .disk(DiskModel::symmetric(Figures {
                iops: 100_000,
                bandwidth: 1 << 30,
            }));
        let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
        (b.build().unwrap(), class)
    }

    fn parks(d: &Dispatcher) -> u64 {
        // Relaxed: a statistic; the waits below re-read it.
        d.shared.parks[0].load(Ordering::Relaxed)
    }

    /// Waits until shard 0 has parked at least `n` times. Polled, not timed: the test runner's
    /// timeout catches a shard that never parks.
    fn wait_parks(d: &Dispatcher, n: u64) {
        while parks(d) < n {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn without_idle_poll_the_shard_parks_after_every_request() {
        let (d, class) = one_shard(Duration::ZERO);
        let rt = rt();
        let mut before = parks(&d);
        for _ in 0..20 {
            let job = d.submit(class, IoRequest::read(4096), async {}).unwrap();
            rt.block_on(job).unwrap();
            // The shard parks before the request's future runs (it runs while the shard
            // waits), so the count is up before the result arrives.
            let now = parks(&d);
            assert!(now > before, "no park for this request ({before} → {now})");
            before = now;
        }
    }

    #[test]
    fn an_idle_polling_shard_parks_once_the_idle_poll_time_is_up() {
        let (d, class) = one_shard(Duration::from_millis(2));
        // Started, nothing submitted: it polls, then parks.
        wait_parks(&d, 1);
        let rt = rt();
        for _ in 0..5 {
            let before = parks(&d);
            let job = d.submit(class, IoRequest::read(4096), async {}).unwrap();
            rt.block_on(job).unwrap();
            // The request woke it; with nothing more to do it polls, then parks again.
            wait_parks(&d, before + 1);
        }
        d.shutdown();
    }

    /// A future sent with `run_on` is counted as running: a shutdown does not end before it
    /// does, and it runs to its end though the shutdown began while it waited.
    #[test]
    fn a_shutdown_waits_for_a_future_sent_to_run_on_the_shard() {
        let (d, _) = one_shard(Duration::ZERO);
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::channel();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ended = done.clone();
        let sent = d.run_on(
            0,
            Box::pin(async move {
                started_tx.send(()).unwrap();
                let _ = wait.await;
                ended.store(true, std::sync::atomic::Ordering::SeqCst);
            }),
        );
        assert!(sent.is_ok(), "the shard takes it");
        started.recv().unwrap();
        // It cannot end while the future waits, whatever the time allowed.
        assert!(matches!(
            d.shutdown_timeout(Duration::from_millis(20)),
            Err(crate::ShutdownError::TimedOut { running: 1 })
        ));
        // Shutting down: nothing more is taken, and the caller gets its future back.
        assert!(d.run_on(0, Box::pin(async {})).is_err());
        go.send(()).unwrap();
        d.shutdown();
        assert!(
            done.load(std::sync::atomic::Ordering::SeqCst),
            "it ran to its end"
        );
    }

    /// An idle poll that never finds its core contended (the tests run on a loaded machine).
    fn uncontended(time: Duration) -> IdlePoll {
        IdlePoll::new(time, Duration::MAX)
    }

    /// Runs `f` on a current-thread runtime in a `LocalSet`, as a shard does; a poll that never
    /// returns fails the test after a minute (a liveness bound, not a speed check).
    fn on_local<F: std::future::Future<Output = ()>>(f: F) {
        let rt = rt();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            tokio::time::timeout(Duration::from_secs(60), f)
                .await
                .expect("the idle poll never returned")
        });
    }

    #[test]
    fn with_idle_poll_off_the_shard_parks_at_once_even_with_a_message_waiting() {
        on_local(async {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            tx.send(Msg::Wake).unwrap();
            let activity = Activity::default();
            assert!(!uncontended(Duration::ZERO).poll(&rx, &activity, || 0).await);
            assert!(matches!(rx.try_recv(), Ok(Msg::Wake)));
        });
    }

    #[test]
    fn the_idle_poll_ends_once_its_time_since_the_last_activity_is_up() {
        on_local(async {
            let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            let (activity, start) = (Activity::default(), Instant::now());
            let mut poll = uncontended(Duration::from_millis(1));
            assert!(!poll.poll(&rx, &activity, || 0).await);
            assert!(start.elapsed() >= Duration::from_millis(1));
            assert!(poll.backoff_until.is_none());
        });
    }

    /// Activity is a count, dated by the round that sees it move: activity while the shard
    /// polls (a completion, a dispatch) restarts the poll time from that round; a poll that
    /// starts with no activity since the last one ended parks at once.
    #[test]
    fn activity_seen_while_polling_restarts_the_poll_time() {
        on_local(async {
            let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            let activity = Rc::new(Activity::default());
            let time = Duration::from_millis(2);
            let mut poll = uncontended(time);
            // A task on the shard that records activity for 6 ms (three poll times).
            let busy = {
                let activity = activity.clone();
                tokio::task::spawn_local(async move {
                    let start = Instant::now();
                    let mut last = start;
                    while last.duration_since(start) < 3 * time {
                        // The clock is read before the touch: the poll sees it after.
                        last = Instant::now();
                        activity.touch();
                        tokio::task::yield_now().await;
                    }
                    last
                })
            };
            assert!(!poll.poll(&rx, &activity, || 0).await);
            let ended = Instant::now();
            let last_touch = busy.await.unwrap();
            assert!(
                ended.saturating_duration_since(last_touch) >= time,
                "the poll ended {:?} after the last activity",
                ended.saturating_duration_since(last_touch)
            );
            // Nothing since: the next poll dates no new activity, so it parks in its first
            // round (the last activity is already more than the poll time ago).
            let dated = poll.seen;
            assert!(!poll.poll(&rx, &activity, || 0).await);
            assert_eq!(poll.seen, dated, "no activity dated anew");
            assert_eq!(poll.seen.map(|(count, _)| count), Some(activity.count()));
        });
    }

    #[test]
    fn a_message_sent_while_the_shard_polls_is_taken_without_parking() {
        on_local(async {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            let activity = Activity::default();
            // Another task on the shard sends after a few rounds (a request submitted from
            // the shard itself, or one whose completion arrives through the driver).
            let send = tokio::task::spawn_local(async move {
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
                tx.send(Msg::Wake).unwrap();
            });
            assert!(
                uncontended(Duration::from_secs(3600))
                    .poll(&rx, &activity, || 0)
                    .await
            );
            send.await.unwrap();
            assert!(matches!(rx.try_recv(), Ok(Msg::Wake)));
        });
    }

    #[test]
    fn a_shard_with_more_than_one_operation_in_flight_parks_at_once() {
        on_local(async {
            let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            let activity = Activity::default();
            let mut poll = uncontended(Duration::from_secs(3600));
            assert!(!poll.poll(&rx, &activity, || 2).await);
            // One in flight: polls (until a message comes).
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            tx.send(Msg::Wake).unwrap();
            assert!(poll.poll(&rx, &activity, || 1).await);
        });
    }

    #[test]
    fn a_shard_blocking_in_a_system_call_while_polling_is_not_taken_for_descheduled() {
        on_local(async {
            let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            // Retried until a poll ran without the OS preempting the thread (the tests run on
            // a loaded machine; a preemption may rightly end the poll).
            loop {
                let (activity, start) = (Activity::default(), Instant::now());
                let mut poll = uncontended(Duration::from_millis(20));
                poll.preempted = PREEMPTED;
                // A woken future that blocks for a millisecond (as a submission waiting for
                // the device): off the CPU, but a voluntary switch.
                let blocks = tokio::task::spawn_local(async {
                    tokio::task::yield_now().await;
                    std::thread::sleep(Duration::from_millis(1));
                });
                let (_, switches) = thread_usage();
                let parked = !poll.poll(&rx, &activity, || 0).await;
                blocks.await.unwrap();
                if thread_usage().1 != switches {
                    continue;
                }
                assert!(parked);
                assert!(
                    poll.backoff_until.is_none(),
                    "took a sleep for a preemption"
                );
                assert!(start.elapsed() >= Duration::from_millis(20));
                break;
            }
        });
    }

    #[test]
    fn a_shard_preempted_while_polling_parks_and_backs_off() {
        let Some(core) = core_affinity::get_core_ids().and_then(|c| c.first().copied()) else {
            eprintln!("cannot list the cores: skipped");
            return;
        };
        // A thread that spins on the same core as the polling one, so the OS preempts them in
        // turn.
        let stop = Arc::new(crate::sync::AtomicU64::new(0));
        let hog = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                core_affinity::set_for_current(core);
                // Relaxed: a flag polled in a loop; nothing else is published with it.
                while stop.load(Ordering::Relaxed) == 0 {
                    std::hint::spin_loop();
                }
            })
        };
        let pinned = std::thread::spawn(move || {
            if !core_affinity::set_for_current(core) {
                return None;
            }
            let mut got = None;
            on_local(async {
                let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
                let activity = Activity::default();
                let mut poll = uncontended(Duration::from_secs(3600));
                poll.preempted = PREEMPTED;
                let before = Instant::now();
                assert!(!poll.poll(&rx, &activity, || 0).await);
                let until = poll.backoff_until.expect("backing off");
                assert!(until >= before + CONTENDED_BACKOFF_MIN);
                assert_eq!(poll.backoffs, 1, "one back-off counted");
                assert_eq!(
                    poll.backoff,
                    2 * CONTENDED_BACKOFF_MIN,
                    "the next one is longer"
                );
                // While backing off it parks at once, though its poll time is far from up.
                poll.backoff_until = Some(Instant::now() + Duration::from_secs(3600));
                activity.touch();
                assert!(!poll.poll(&rx, &activity, || 0).await);
                assert_eq!(poll.backoffs, 1, "parking during a back-off is not another");
                got = Some(());
            });
            got
        })
        .join();
        // Relaxed: see the loop above.
        stop.store(1, Ordering::Relaxed);
        hog.join().unwrap();
        if pinned.unwrap().is_none() {
            eprintln!("cannot pin threads: skipped");
        }
    }

    /// Each back-off in a row doubles the next up to a second; a poll that runs its
    /// whole time undisturbed starts it again from the shortest.
    #[test]
    fn the_back_off_doubles_while_preempted_and_restarts_after_an_undisturbed_poll() {
        let mut poll = uncontended(Duration::from_millis(1));
        let now = Instant::now();
        let mut lengths = Vec::new();
        for _ in 0..10 {
            poll.contended(now);
            lengths.push(poll.backoff_until.expect("backing off") - now);
        }
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(
            lengths,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000].map(ms),
            "doubling from the shortest, capped at the longest"
        );
        assert_eq!(poll.backoffs, 10, "each one counted");
        poll.undisturbed();
        poll.contended(now);
        assert_eq!(poll.backoff_until, Some(now + CONTENDED_BACKOFF_MIN));
        assert_eq!(poll.backoffs, 11);
    }

    /// Occasional preemptions (a kernel worker's run every 10 ms of polling) leave the poll on;
    /// preemptions that take a real share of the polling time back it off, the ladder climbing
    /// while they go on; polling a window without being found contended restarts it.
    #[test]
    fn only_preemptions_that_take_a_share_of_the_polling_back_off() {
        let us = Duration::from_micros;
        let mut poll = uncontended(Duration::from_millis(1));
        let now = Instant::now();
        // 60 µs lost per 10 ms polled: 0.6%, for 5 s.
        for _ in 0..500 {
            assert!(!poll.round(now, us(9_900), None));
            assert!(!poll.round(now, us(100), Some(us(60))));
        }
        assert_eq!(poll.backoffs, 0);
        assert!(poll.backoff_until.is_none());
        // A thread that wants the core: 100 µs lost per 500 µs polled. Found within a window.
        let mut polled = Duration::ZERO;
        while !poll.round(now, us(500), Some(us(100))) {
            polled += us(500);
            assert!(polled < SHARE_WINDOW, "not found contended");
        }
        assert_eq!(poll.backoffs, 1);
        assert_eq!(poll.backoff_until, Some(now + CONTENDED_BACKOFF_MIN));
        // After the back-off the share is taken afresh: the next such round backs off again,
        // for twice as long.
        assert!(poll.round(now, us(500), Some(us(100))));
        assert_eq!(poll.backoff_until, Some(now + 2 * CONTENDED_BACKOFF_MIN));
        // Right after a back-off, one preemption early in the polling is a share of it too.
        assert!(poll.round(now, us(300), Some(us(60))));
        assert_eq!(poll.backoffs, 3);
        // A window's polling, one occasional preemption in it: the ladder starts again.
        assert!(!poll.round(now, SHARE_WINDOW - us(100), None));
        assert!(!poll.round(now, us(100), Some(us(60))));
        while !poll.round(now, us(500), Some(us(100))) {}
        assert_eq!(poll.backoff_until, Some(now + CONTENDED_BACKOFF_MIN));
        assert_eq!(poll.backoffs, 4);
        // The polling after a back-off is judged on its own: a round that lost most of its
        // time backs off, and the next one, which lost under 1/16, does not.
        assert!(poll.round(now, us(500), Some(us(400))));
        assert!(!poll.round(now, us(1_000), Some(us(60))));
        assert_eq!(poll.backoffs, 5);
    }

    /// A shard whose core another thread keeps busy backs off from its idle poll, and its
    /// stats say so: `idle_poll_backoffs` counts it, and `since` gives the interval's share.
    #[test]
    fn a_shard_on_a_busy_core_counts_its_back_offs_in_its_stats() {
        let (d, class) = one_shard_pinned(Duration::from_secs(3600), true);
        let Some(cpu) = d.shard_cpu(0) else {
            eprintln!("the shard is not pinned: skipped");
            d.shutdown();
            return;
        };
        let before = d.stats_blocking();
        assert_eq!(
            before.idle_poll_backoffs(),
            0,
            "nothing ran on its core yet"
        );
        let stop = Arc::new(crate::sync::AtomicU64::new(0));
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        let hog = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let pinned = core_affinity::set_for_current(core_affinity::CoreId { id: cpu });
                pinned_tx.send(pinned).unwrap();
                // Relaxed: a flag polled in a loop; nothing else is published with it.
                while pinned && stop.load(Ordering::Relaxed) == 0 {
                    std::hint::spin_loop();
                }
            })
        };
        if !pinned_rx.recv().unwrap() {
            hog.join().unwrap();
            eprintln!("cannot pin threads: skipped");
            d.shutdown();
            return;
        }
        let rt = rt();
        // Each request is activity after which the shard polls again (once its back-off is
        // over), on the core the spinning thread wants. Polled, not timed: the liveness guard
        // only ends a wait that never comes.
        let guard = Instant::now() + Duration::from_secs(60);
        let mut after = d.stats_blocking();
        while after.idle_poll_backoffs() == 0 && Instant::now() < guard {
            rt.block_on(d.submit(class, IoRequest::tokens(1), async {}).unwrap())
                .unwrap();
            std::thread::sleep(Duration::from_millis(20));
            after = d.stats_blocking();
        }
        // Relaxed: see the loop above.
        stop.store(1, Ordering::Relaxed);
        hog.join().unwrap();
        let n = after.idle_poll_backoffs();
        assert!(n >= 1, "the shard never backed off from a busy core");
        assert_eq!(after.shards[0].idle_poll_backoffs, n);
        let interval = after.since(&before);
        assert_eq!(
            interval.idle_poll_backoffs(),
            n - before.idle_poll_backoffs()
        );
        assert_eq!(after.since(&after).idle_poll_backoffs(), 0);
        d.shutdown();
    }

    /// Runs one uncontended poll of 200 µs with nothing to do, starting from the longest
    /// back-off and `seen` as given; returns the back-off it leaves.
    fn back_off_after_a_poll(seen_ago: Option<Duration>) -> Duration {
        let mut left = Duration::ZERO;
        on_local(async {
            let (_tx, rx) = tokio::sync::mpsc::unbounded_channel::<Msg>();
            let activity = Activity::default();
            let mut poll = uncontended(Duration::from_micros(200));
            poll.backoff = CONTENDED_BACKOFF;
            poll.seen = seen_ago.map(|ago| (activity.count(), Instant::now() - ago));
            assert!(!poll.poll(&rx, &activity, || 0).await);
            left = poll.backoff;
        });
        left
    }

    /// A poll that runs out its time, with nothing else happening, counts as undisturbed.
    #[test]
    fn a_poll_that_runs_out_its_time_resets_the_back_off() {
        assert_eq!(back_off_after_a_poll(None), CONTENDED_BACKOFF_MIN);
    }

    /// A poll that ends at once, its last activity already past the poll time, has not polled:
    /// it leaves the back-off as it is.
    #[test]
    fn a_poll_that_ends_at_once_leaves_the_back_off() {
        // The last activity, dated ten poll times before the poll.
        let ago = Some(Duration::from_millis(2));
        assert_eq!(back_off_after_a_poll(ago), CONTENDED_BACKOFF, "kept");
    }
}
