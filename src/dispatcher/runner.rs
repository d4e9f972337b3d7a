//! The shard thread: pins itself, runs a tokio current-thread runtime with a `LocalSet`, takes
//! requests from its channel into its [`ShardCore`], sleeps when the bucket owes it tokens, and
//! spawns the dispatched futures locally.
//!
//! Everything the loop owns is local to the thread (`RefCell`, `Rc`, `Cell`): the only shared
//! state on the hot path is the bucket and the classes' fairness counters.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{oneshot, Notify};

use crate::error::DispatchError;
use crate::sync::Arc;

use super::handle::{take_panics, BoxTask};
use super::queue::Entry;
use super::shard::{Next, ShardCore};
use super::stats::ShardStats;
use super::timer::{FineTimer, FINE_BELOW};
use super::Shared;

/// What reaches a shard through its channel.
pub(crate) enum Msg {
    Submit(Entry<BoxTask>),
    Stats(StatsReply),
    Shutdown(ShutdownMode),
    /// Poll again: a run-time setting changed (rate, shares, cap).
    Wake,
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

thread_local! {
    /// On a shard thread: (dispatcher identity, shard index).
    static CURRENT: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// Whether the calling thread is a shard of some dispatcher (its runtime is current-thread, with
/// an I/O driver).
pub(crate) fn on_any_shard() -> bool {
    CURRENT.with(|c| c.get()).is_some()
}

/// The shard of dispatcher `id` that the calling thread runs, if any.
pub(crate) fn current_shard(id: usize) -> Option<usize> {
    CURRENT
        .with(|c| c.get())
        .and_then(|(d, s)| (d == id).then_some(s))
}

/// Futures running on a shard, and the shared state their completions release tokens to (kept
/// here so that a completion clones one `Rc`, not an `Arc`: no atomic per request).
struct InFlight {
    count: Cell<usize>,
    idle: Notify,
    shared: Arc<Shared>,
    /// The shard's core, to record completions in its stats (gone once the shard stopped).
    core: Weak<RefCell<ShardCore<BoxTask>>>,
}

/// Held by a running request: when dropped (the future ended, or was torn down), its tokens are
/// released (capped mode) and the shard's in-flight count drops.
pub(crate) struct Completion {
    cost: u64,
    class: usize,
    /// When the request was submitted and dispatched, on the dispatcher's clock.
    times: (Duration, Duration),
    inflight: Rc<InFlight>,
}

impl Completion {
    /// Adds the panics caught on this shard so far to the dispatcher's count (before a
    /// result reaches its handle, so the count is up to date for whoever awaits it).
    pub(crate) fn count_panics(&self) {
        add_panics(&self.inflight.shared);
    }
}

/// Moves this thread's caught panics into the dispatcher's count.
fn add_panics(shared: &Shared) {
    let n = take_panics();
    if n > 0 {
        // Relaxed: a statistic.
        shared.panics.fetch_add(n, crate::sync::Ordering::Relaxed);
    }
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

impl Drop for Completion {
    fn drop(&mut self) {
        let shared = &self.inflight.shared;
        if let Some(lc) = shared.classes.latency() {
            // Latency-target mode samples the end-to-end latency (submission → completion).
            let latency = shared.clock.now().saturating_sub(self.times.0);
            lc.record(self.class, latency);
        }
        shared.budget.release(self.cost);
        let bounded = shared.classes.finish(self.class, self.cost);
        if shared.budget.is_capped() || bounded {
            // Capacity came back (the bucket's, or the class's in-flight bound): wake the
            // shards that wait for it (every shard shares both).
            for n in &shared.released {
                n.notify_one();
            }
        }
        #[cfg(feature = "metrics")]
        crate::metrics::class_completed(
            shared.classes.get(self.class).config.name(),
            shared.clock.now().saturating_sub(self.times.1),
        );
        if let Some(core) = self.inflight.core.upgrade() {
            // Completions run in the shard's tasks, never inside the loop's own borrow; should
            // one ever overlap, the sample is skipped rather than panicking.
            if let Ok(mut core) = core.try_borrow_mut() {
                let now = self.inflight.shared.clock.now();
                core.completed(self.class, self.cost, self.times, now);
            }
        }
        let n = self.inflight.count.get() - 1;
        self.inflight.count.set(n);
        if n == 0 {
            self.inflight.idle.notify_one();
        }
    }
}

/// The fine timer and its thread (to wake it when a deadline changes).
pub(crate) type Timer = (Arc<FineTimer>, std::thread::Thread);

/// Starts shard `index` on its own thread, running `rt`.
pub(crate) fn spawn(
    index: usize,
    id: usize,
    shared: Arc<Shared>,
    rx: UnboundedReceiver<Msg>,
    rt: tokio::runtime::Runtime,
    core: Option<core_affinity::CoreId>,
    timer: Timer,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("iothrottle-shard-{index}"))
        .spawn(move || {
            if let Some(core) = core {
                if !core_affinity::set_for_current(core) {
                    tracing::warn!(
                        shard = index,
                        core = core.id,
                        "could not pin the shard thread to its core; it runs unpinned"
                    );
                }
            }
            let _exit = Exit(shared.clone());
            CURRENT.with(|c| c.set(Some((id, index))));
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, run(index, shared, rx, timer));
            // Dropping the LocalSet drops any future still running; their `Completion`s
            // release their tokens.
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
    });
    let mut closing: Option<ShutdownMode> = None;
    let mut open = true;

    let handle = |msg: Msg, closing: &mut Option<ShutdownMode>| match msg {
        Msg::Submit(e) => {
            if *closing == Some(ShutdownMode::Cancel) {
                e.payload.fail(DispatchError::ShutDown);
            } else {
                core.borrow_mut().enqueue(e);
            }
        }
        Msg::Stats(reply) => reply.send(ShardStats {
            shard: index,
            classes: core.borrow().stats(),
        }),
        Msg::Shutdown(mode) => {
            if *closing != Some(ShutdownMode::Cancel) {
                *closing = Some(mode);
            }
        }
        // The loop polls the core next, which takes up the change.
        Msg::Wake => {}
    };

    loop {
        while open {
            match rx.try_recv() {
                Ok(msg) => handle(msg, &mut closing),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    closing = Some(ShutdownMode::Cancel);
                }
            }
        }
        if closing == Some(ShutdownMode::Cancel) {
            let drained = core.borrow_mut().drain();
            for e in drained {
                e.payload.fail(DispatchError::ShutDown);
            }
        }
        let now = shared.clock.now();
        let next = core.borrow_mut().poll(now, &mut |e| {
            inflight.count.set(inflight.count.get() + 1);
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
                tokio::select! {
                    msg = rx.recv(), if open => match msg {
                        Some(msg) => handle(msg, &mut closing),
                        None => {
                            open = false;
                            closing = Some(ShutdownMode::Cancel);
                        }
                    },
                    else => {}
                }
            }
            Next::WakeAfter(d) if d < FINE_BELOW => {
                // tokio's timer ticks in milliseconds: short sleeps go to the fine timer, with
                // a tokio sleep as a backstop should its thread be gone.
                timer.arm(index, d, &timer_thread);
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => match msg {
                        Some(msg) => handle(msg, &mut closing),
                        None => {
                            open = false;
                            closing = Some(ShutdownMode::Cancel);
                        }
                    },
                    _ = timer.notify(index).notified() => {}
                    _ = shared.released[index].notified() => {}
                    _ = tokio::time::sleep(d + FINE_BELOW) => {}
                }
                timer.disarm(index);
            }
            Next::WaitDurable(tail) => {
                let gate = shared
                    .gate
                    .as_deref()
                    .expect("only a gated shard waits for the mark");
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => match msg {
                        Some(msg) => handle(msg, &mut closing),
                        None => {
                            open = false;
                            closing = Some(ShutdownMode::Cancel);
                        }
                    },
                    _ = gate.wait_durable(tail) => {}
                }
            }
            Next::WakeAfter(d) => {
                tokio::select! {
                    biased;
                    msg = rx.recv(), if open => match msg {
                        Some(msg) => handle(msg, &mut closing),
                        None => {
                            open = false;
                            closing = Some(ShutdownMode::Cancel);
                        }
                    },
                    _ = shared.released[index].notified() => {}
                    _ = tokio::time::sleep(d.max(Duration::from_nanos(1))) => {}
                }
            }
        }
    }
    // Everything is dispatched (or failed): wait for the running futures.
    while inflight.count.get() > 0 {
        inflight.idle.notified().await;
    }
    let stats = ShardStats {
        shard: index,
        classes: core.borrow().stats(),
    };
    if let Ok(mut slot) = shared.final_stats.lock() {
        slot[index] = Some(stats);
    }
    // Anything still in the channel (submitted while we stopped) is dropped with `rx`: its
    // handles resolve to `DispatchError::ShutDown`.
}
