//! The thread-per-core I/O dispatcher: [`Dispatcher`].
//!
//! A storage engine submits reads and writes with [`Dispatcher::submit`]; each request's future
//! runs on a shard (a pinned OS thread with its own tokio current-thread runtime) once the
//! shared token bucket has its tokens, so that the disk is never oversubscribed. Priority
//! classes share the disk by their shares, across shards too.
//!
//! ```
//! use iothrottle::dispatcher::{ClassConfig, Dispatcher, DiskModel, IoRequest};
//!
//! // Your disk, measured (fio, iotune) or loaded from an io_properties.yaml: 200 MB/s, 20k IOPS.
//! let disk = DiskModel::symmetric(200_000_000, 20_000);
//! // At most 0.75 ms of disk time in flight (the default latency goal); reads get 4× the
//! // disk time of compaction.
//! let dispatcher = Dispatcher::builder()
//!     .shards(2)
//!     .disk(disk)
//!     .class(ClassConfig::new("foreground", 800))
//!     .class(ClassConfig::new("compaction", 200))
//!     .build()?;
//! let fg = dispatcher.class_id("foreground").ok_or("no such class")?;
//! let bg = dispatcher.class_id("compaction").ok_or("no such class")?;
//!
//! // The future runs on a shard once its tokens are there; the handle resolves to its output.
//! let read = dispatcher.submit(fg, IoRequest::read(4096), async { /* pread */ 4096 })?;
//! // 1 MiB is 5 ms of this disk's time: split into 4 KiB-aligned pieces within the goal.
//! let write = dispatcher.submit_split(bg, IoRequest::write(1 << 20), |piece| async move {
//!     /* pwrite piece.range */
//!     piece.len()
//! })?;
//! let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! assert_eq!(rt.block_on(read)?, 4096);
//! assert_eq!(rt.block_on(write)?.iter().sum::<u64>(), 1 << 20);
//!
//! let stats = dispatcher.stats_blocking();
//! assert_eq!(stats.classes[fg.index()].requests, 1);
//! println!("read p99 end to end: {:?}", stats.classes[fg.index()].latency_p99());
//! dispatcher.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The long-form description (the shard loop, the cost model, cross-shard fairness and what we
//! do differently from Seastar) follows.
#![doc = include_str!("../../docs/dispatcher.md")]

pub(crate) mod alarm;
pub(crate) mod bound;
mod budget;
mod class;
mod cost;
pub(crate) mod fair;
mod handle;
mod latency;
mod queue;
mod runner;
pub(crate) use handle::{boxed as boxed_task, channel as result_channel, BoxTask, ResultTx, Task};
pub(crate) use runner::{on_any_shard, Completion};
mod shard;
mod stats;
mod timer;

#[cfg(test)]
mod tests;

use std::fmt;
use std::future::Future;
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::oneshot;

pub use class::{ClassConfig, ClassId, Priority};
pub use cost::{DiskModel, IoKind, IoRequest, Piece, SPLIT_ALIGN};
pub use handle::{IoHandle, SplitHandle};
pub use stats::{ClassStats, DispatcherStats, ShardStats};

use crate::bucket::{BucketConfig, BucketState, Rate, SharedTokenBucket};
use crate::bucket::{Capped, Mode, Uncapped};
use crate::checkpoint::{CheckpointedBucket, MarkGate};
use crate::clock::{Clock, MonotonicClock};
use crate::error::{BuildError, ConfigError, ControlError, ShutdownError, SubmitError};
use crate::sync::{Arc, AtomicU64, Ordering};

use budget::Budget;
use class::Classes;
use queue::Entry;
use runner::{Msg, ShutdownMode, StatsReply};

/// The clock every part of a dispatcher reads.
pub(crate) type ArcClock = Arc<dyn Clock>;

/// What all shards share: the bucket, the classes' fairness state, the configuration.
pub(crate) struct Shared {
    pub(crate) budget: Budget,
    /// The checkpoint layer ([`DispatcherBuilder::checkpoint`]): in strict mode a shard
    /// dispatches a reservation only once the durable mark covers it. `None`: no checkpoint,
    /// and the shards' hot path is unchanged.
    pub(crate) gate: Option<Arc<MarkGate>>,
    pub(crate) classes: Classes,
    pub(crate) disk: DiskModel,
    /// The most tokens one request (or piece) may cost; at most the bucket's limit.
    pub(crate) max_cost: u64,
    /// The latency goal: the disk time (tokens) the bucket's limit was sized for.
    pub(crate) latency_goal: Duration,
    /// A shard's reservation target: the tokens it reserves at once when it has that much
    /// queued (a request costing more is reserved alone).
    pub(crate) batch: u64,
    pub(crate) clock: ArcClock,
    /// Each shard's stats as it stopped, for [`Dispatcher::stats`] after shutdown.
    pub(crate) final_stats: Mutex<Vec<Option<ShardStats>>>,
    /// The control generation: bumped after every run-time change (rate, shares, cap); a
    /// shard that sees a new value re-reads what it caches (its replenish pace, the cap
    /// buckets). The change itself is published by its own atomics or lock; this counter
    /// only says "look again".
    control: AtomicU64,
    /// User futures whose `poll` or `drop` panicked (caught on the shards).
    pub(crate) panics: AtomicU64,
    /// Counts the shard threads still running, for a bounded or async shutdown.
    pub(crate) exits: ExitLatch,
    /// One per shard: notified when a completion gives capacity back (capped mode), so that a
    /// shard waiting for it re-polls at once instead of at its next timed check.
    pub(crate) released: Vec<tokio::sync::Notify>,
    /// How long an idle shard keeps polling after its last activity before it parks
    /// ([`DispatcherBuilder::idle_poll`]).
    pub(crate) idle_poll: Duration,
    /// One per shard: how many times its thread parked with nothing queued (a statistic, for
    /// the tests of the idle poll).
    pub(crate) parks: Vec<AtomicU64>,
}

/// Counts the shard threads still running; each decrements it as it ends (even by a panic).
#[derive(Debug)]
pub(crate) struct ExitLatch {
    running: Mutex<usize>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl ExitLatch {
    fn new(running: usize) -> Self {
        ExitLatch {
            running: Mutex::new(running),
            cv: Condvar::new(),
            notify: tokio::sync::Notify::new(),
        }
    }

    fn running(&self) -> usize {
        *self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A shard thread ended.
    pub(crate) fn exited(&self) {
        let mut n = self.running.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        drop(n);
        self.cv.notify_all();
        self.notify.notify_waiters();
    }

    /// Blocks until every shard ended or `timeout` passed; the shards still running.
    fn wait_timeout(&self, timeout: Duration) -> usize {
        let n = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let (n, _) = self
            .cv
            .wait_timeout_while(n, timeout, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
        *n
    }

    /// Waits, without blocking the thread, until every shard ended.
    async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("budget", &self.budget)
            .field("classes", &self.classes)
            .field("disk", &self.disk)
            .field("max_cost", &self.max_cost)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn new(
        budget: Budget,
        classes: Classes,
        disk: DiskModel,
        (max_cost, batch): (u64, u64),
        latency_goal: Duration,
        clock: ArcClock,
        shards: usize,
    ) -> Self {
        Shared {
            budget,
            gate: None,
            classes,
            disk,
            max_cost,
            latency_goal,
            batch,
            clock,
            final_stats: Mutex::new(vec![None; shards]),
            control: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            exits: ExitLatch::new(shards),
            released: (0..shards).map(|_| tokio::sync::Notify::new()).collect(),
            idle_poll: DispatcherBuilder::DEFAULT_IDLE_POLL,
            parks: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The control generation (see the field).
    pub(crate) fn control(&self) -> u64 {
        // Acquire: pairs with the AcqRel increment in `changed`, so a shard that sees the new
        // generation also sees the change made before it.
        self.control.load(Ordering::Acquire)
    }

    fn changed(&self) {
        // AcqRel: publishes the change made before it to the shards' Acquire loads.
        self.control.fetch_add(1, Ordering::AcqRel);
    }

    /// Changes the bucket's rate (the shards then need a wake-up).
    pub(crate) fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        self.budget.set_rate(rate)?;
        self.changed();
        Ok(())
    }

    fn check_class(&self, class: ClassId) -> Result<(), ControlError> {
        if class.0 < self.classes.len() {
            Ok(())
        } else {
            Err(ControlError::UnknownClass {
                class: class.0,
                classes: self.classes.len(),
            })
        }
    }

    /// Changes a class's shares (the shards then need a wake-up).
    pub(crate) fn set_shares(&self, class: ClassId, shares: u32) -> Result<(), ControlError> {
        self.check_class(class)?;
        let name = self.classes.get(class.0).config.name();
        class::check_shares(name, shares).map_err(|_| ControlError::SharesOutOfRange {
            class: name.to_owned(),
            shares,
        })?;
        self.classes.set_shares(class.0, shares);
        self.changed();
        Ok(())
    }

    /// Changes a class's cap (the shards then need a wake-up).
    pub(crate) fn set_bandwidth_cap(
        &self,
        class: ClassId,
        cap: Option<Rate>,
    ) -> Result<(), ControlError> {
        self.check_class(class)?;
        let bucket = match cap {
            None => None,
            Some(rate) => Some(Arc::new(class::cap_bucket(rate, &self.clock)?)),
        };
        self.classes.set_cap(class.0, bucket);
        self.changed();
        Ok(())
    }
}

/// Configures and starts a [`Dispatcher`]. Made by [`Dispatcher::builder`].
///
/// A [`disk`](Self::disk) model is required (there is no default disk). Defaults: one shard per
/// available core, the rate that keeps the disk exactly busy ([`DiskModel::full_rate`]), a
/// [latency goal](Self::latency_goal) of 0.75 ms — the bucket's limit is that much disk time
/// and the bucket is [capped](Self::capped), so at most 0.75 ms of modelled disk time is
/// dispatched and not yet completed — requests of at most half the goal (larger ones are split
/// by [`Dispatcher::submit_split`]), reservations of 250 µs of disk time but at most an eighth
/// of the limit (94 µs for the default goal), a replenish threshold of 20 µs, threads pinned.
pub struct DispatcherBuilder {
    shards: Option<usize>,
    disk: Option<DiskModel>,
    latency_goal: Duration,
    rate: Rate,
    limit: Option<u64>,
    threshold: Option<u64>,
    max_cost: Option<u64>,
    batch: Option<u64>,
    idle_credit: Option<u64>,
    capped: bool,
    pin: bool,
    idle_poll: Duration,
    start_hook: Option<runner::StartHook>,
    stop_hook: Option<runner::StopHook>,
    classes: Vec<ClassConfig>,
    clock: ArcClock,
    /// The checkpointed bucket's own bucket and its gate ([`checkpoint`](Self::checkpoint)).
    checkpoint: Option<(Budget, Arc<MarkGate>)>,
    /// A bucket given whole ([`shared_bucket`](Self::shared_bucket)).
    shared: Option<Budget>,
}

impl fmt::Debug for DispatcherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("shards", &self.shards)
            .field("disk", &self.disk)
            .field("latency_goal", &self.latency_goal)
            .field("rate", &self.rate)
            .field("limit", &self.limit)
            .field("threshold", &self.threshold)
            .field("max_cost", &self.max_cost)
            .field("batch", &self.batch)
            .field("capped", &self.capped)
            .field("on_shard_start", &self.start_hook.is_some())
            .field("on_shard_stop", &self.stop_hook.is_some())
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

impl DispatcherBuilder {
    /// The most shards a dispatcher may have (each is an OS thread with its own runtime).
    pub const MAX_SHARDS: usize = 1024;

    fn new() -> Self {
        DispatcherBuilder {
            shards: None,
            disk: None,
            latency_goal: Self::DEFAULT_LATENCY_GOAL,
            rate: DiskModel::full_rate(),
            limit: None,
            threshold: None,
            max_cost: None,
            batch: None,
            idle_credit: None,
            capped: true,
            pin: true,
            idle_poll: Self::DEFAULT_IDLE_POLL,
            start_hook: None,
            stop_hook: None,
            classes: Vec::new(),
            clock: Arc::new(MonotonicClock::new()),
            checkpoint: None,
            shared: None,
        }
    }

    /// The number of shards (threads), `1..=MAX_SHARDS`. Default: the available cores. More
    /// shards than cores is allowed (a `tracing` warning says so at build).
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = Some(n);
        self
    }

    /// The disk model that turns requests into tokens (required: [`build`](Self::build)
    /// without one is [`BuildError::NoDiskModel`]).
    pub fn disk(mut self, disk: DiskModel) -> Self {
        self.disk = Some(disk);
        self
    }

    /// The default [latency goal](Self::latency_goal): 0.75 ms, as Seastar's
    /// `--io-latency-goal-ms` (1.5 × its 0.5 ms task quota).
    pub const DEFAULT_LATENCY_GOAL: Duration = Duration::from_micros(750);

    /// The latency goal (Seastar's io-latency-goal): how much modelled disk time may be
    /// dispatched ahead of a newly arrived request. Default
    /// [`DEFAULT_LATENCY_GOAL`](Self::DEFAULT_LATENCY_GOAL).
    ///
    /// It sets the bucket's limit to the goal's worth of tokens (one token is one nanosecond of
    /// disk time, whatever the rate), unless [`limit`](Self::limit) is given, and the default
    /// [`max_cost`](Self::max_cost) to half of it: larger requests are split
    /// ([`Dispatcher::submit_split`]) so that no piece exceeds the goal. In
    /// [capped](Self::capped) mode (the default), completions give the capacity back, so the
    /// tokens of requests dispatched and not yet completed never exceed the limit: a new
    /// request finds at most the goal's worth of disk time ahead of it on the disk, plus at
    /// most one reservation per shard (a batch and one request) in the bucket.
    ///
    /// `1 ns..=`[`BucketConfig::MAX_LIMIT`] ns, else [`BuildError::LatencyGoalOutOfRange`].
    pub fn latency_goal(mut self, goal: Duration) -> Self {
        self.latency_goal = goal;
        self
    }

    /// The bucket's rate in tokens (nanoseconds of disk time) per period. Default
    /// [`DiskModel::full_rate`]; `Rate::per_second(DiskModel::TOKENS_PER_SECOND / 2)` keeps the
    /// disk half busy.
    pub fn rate(mut self, rate: Rate) -> Self {
        self.rate = rate;
        self
    }

    /// The bucket's limit (burst) in tokens. Default: the [latency goal](Self::latency_goal)
    /// in nanoseconds of disk time (750_000 for the default goal).
    pub fn limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The bucket's replenish threshold in tokens. Default: 20 µs worth at the rate.
    pub fn threshold(mut self, threshold: u64) -> Self {
        self.threshold = Some(threshold);
        self
    }

    /// Rate, limit and threshold at once.
    pub fn bucket(self, config: BucketConfig) -> Self {
        self.rate(config.rate())
            .limit(config.limit())
            .threshold(config.threshold())
    }

    /// The most one request may cost (larger ones are split by
    /// [`Dispatcher::submit_split`] into 4 KiB-aligned pieces, or refused by
    /// [`Dispatcher::submit`]). `1..=limit`; default half the limit.
    pub fn max_cost(mut self, tokens: u64) -> Self {
        self.max_cost = Some(tokens);
        self
    }

    /// How many tokens a shard reserves at once when it has that much queued (it reserves
    /// less when less is queued, and a request costing more alone). Smaller batches decide
    /// the order closer to dispatch (latency, fairness); larger ones grab less often.
    /// `1..=limit`; default 250 µs worth at the rate, but at most an eighth of the limit.
    pub fn batch(mut self, tokens: u64) -> Self {
        self.batch = Some(tokens);
        self
    }

    /// How much credit, in tokens of its own, a class (or a shard of a class) waking from
    /// idle keeps over those that kept working. Default: one batch.
    pub fn idle_credit(mut self, tokens: u64) -> Self {
        self.idle_credit = Some(tokens);
        self
    }

    /// Capped release (default `true`): the bucket never runs more than its limit ahead of the
    /// completions, so the rate follows what the disk really completes and the disk time in
    /// flight stays within the [latency goal](Self::latency_goal). A request's tokens are
    /// released when its future ends. Uncapped, the limit is only a burst: a disk slower than
    /// its model accumulates a queue.
    pub fn capped(mut self, capped: bool) -> Self {
        self.capped = capped;
        self
    }

    /// Pin each shard thread to a core (default `true`). When the OS refuses, the shard runs
    /// unpinned and a `tracing` warning says so.
    pub fn pin_threads(mut self, pin: bool) -> Self {
        self.pin = pin;
        self
    }

    /// The default [idle poll](Self::idle_poll): 200 µs, as Seastar's `--idle-poll-time-us`.
    pub const DEFAULT_IDLE_POLL: Duration = Duration::from_micros(200);

    /// How long a shard with nothing queued keeps polling (its channel, its runtime's I/O
    /// driver and timers, so its io_uring completions too) after its last activity — a request
    /// received or dispatched, a request ending — before it parks its thread. Default
    /// [`DEFAULT_IDLE_POLL`](Self::DEFAULT_IDLE_POLL); `Duration::ZERO` turns polling off.
    ///
    /// A parked shard pays a thread wake-up (tens of µs on a VM) for the next request and for
    /// each completion; a polling one picks both up at once. It polls only while at most one
    /// io_uring operation is in flight on its ring: with more, each wake-up already serves
    /// several completions, and polling would take the CPU the submitting threads need. The
    /// cost is CPU: a shard serving
    /// one request at a time keeps its core busy, and an idle shard stops polling within this
    /// time of its last activity (a quiet dispatcher uses no CPU). A polling round in which the
    /// OS preempted the thread and it was off its CPU for over 50 µs means another thread
    /// wants the core: the shard then parks at once whenever idle for the next 10 ms, so
    /// polling does not compete with the application's threads. The bound is wall-clock time
    /// (`Instant`), not the dispatcher's [`clock`](Self::clock), counted from the polling round
    /// that first sees the activity (activity is counted, not timed, so that a request costs
    /// the shard no clock read for it: the last activity is dated up to one round late).
    pub fn idle_poll(mut self, time: Duration) -> Self {
        self.idle_poll = time;
        self
    }

    /// Runs `hook` on each shard thread as it starts, with the shard's index, after the thread
    /// pinned itself and before its runtime runs anything: the place to give the shards an OS
    /// scheduling policy or priority, an I/O priority, a cgroup, a thread-local (tokio's
    /// `on_thread_start`, for shards). [`build`](Self::build) waits for every shard's hook and
    /// returns [`BuildError::ShardStart`] when one returns an error or panics (the shards
    /// already started are stopped again).
    ///
    /// ```
    /// # use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher};
    /// // Shards on SCHED_BATCH: a woken shard does not preempt the thread that woke it, so a
    /// // caller sharing its core submits a whole batch before the shard takes it (Linux).
    /// let dispatcher = Dispatcher::builder()
    ///     .disk(DiskModel::symmetric(200_000_000, 20_000))
    ///     .class(ClassConfig::new("io", 1))
    ///     .on_shard_start(|_shard| {
    ///         let param = libc::sched_param { sched_priority: 0 };
    ///         // SAFETY: sets the calling thread's policy from a live `sched_param`.
    ///         match unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } {
    ///             0 => Ok(()),
    ///             _ => Err(std::io::Error::last_os_error()),
    ///         }
    ///     })
    ///     .build()?;
    /// # Ok::<(), iothrottle::BuildError>(())
    /// ```
    pub fn on_shard_start<F>(mut self, hook: F) -> Self
    where
        F: Fn(usize) -> std::io::Result<()> + Send + Sync + 'static,
    {
        self.start_hook = Some(Arc::new(hook));
        self
    }

    /// Runs `hook` on each shard thread as it ends, with the shard's index: after the shard
    /// stopped taking requests and every request it dispatched has ended, after its runtime is
    /// gone, and before the calls that wait for the shards return ([`Dispatcher::shutdown`],
    /// `shutdown_now`, `shutdown_async`, `shutdown_timeout` when it returns `Ok`, a drop outside
    /// any tokio runtime) — the place to undo what [`on_shard_start`](Self::on_shard_start) did,
    /// or to flush a thread-local (tokio's `on_thread_stop`, for shards). It runs on every shard
    /// that started (its start hook, if any, succeeded), however the shard ends, a failed build
    /// included. The shard is ending: a panic in the hook is caught, logged (`tracing`) and
    /// counted in [`Dispatcher::panics`], never propagated.
    ///
    /// ```
    /// # use std::sync::atomic::{AtomicUsize, Ordering};
    /// # use std::sync::Arc;
    /// # use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher};
    /// let stopped = Arc::new(AtomicUsize::new(0));
    /// let counter = stopped.clone();
    /// let dispatcher = Dispatcher::builder()
    ///     .shards(2)
    ///     .disk(DiskModel::symmetric(200_000_000, 20_000))
    ///     .class(ClassConfig::new("io", 1))
    ///     .on_shard_stop(move |_shard| {
    ///         counter.fetch_add(1, Ordering::SeqCst);
    ///     })
    ///     .build()?;
    /// dispatcher.shutdown();
    /// assert_eq!(stopped.load(Ordering::SeqCst), 2);
    /// # Ok::<(), iothrottle::BuildError>(())
    /// ```
    pub fn on_shard_stop<F>(mut self, hook: F) -> Self
    where
        F: Fn(usize) + Send + Sync + 'static,
    {
        self.stop_hook = Some(Arc::new(hook));
        self
    }

    /// Where time comes from (default a new [`MonotonicClock`]).
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Dispatches from a checkpointed bucket, the layer [`Throttle::with_checkpoint`] also
    /// accepts: a [`Checkpointer`] over the same `checkpointed` saves the bucket the shards
    /// grab from, so a restart ([`CheckpointedBucket::restore`]) restores the dispatcher's
    /// rovers (no free burst). In [`Durability::Strict`] mode (without `fail_open`) a shard
    /// dispatches a reservation only once the durable mark covers its tail: while the store
    /// stalls, nothing past the mark is dispatched, and the shard sleeps, without polling,
    /// until the checkpointer publishes a new mark. Queued requests whose handles are dropped
    /// meanwhile give their tokens back when the shard gets to them.
    ///
    /// The bucket's rate, limit, threshold, mode ([`Capped`] or [`Uncapped`]) and clock replace
    /// the builder's [`rate`](Self::rate), [`limit`](Self::limit),
    /// [`threshold`](Self::threshold), [`capped`](Self::capped) and [`clock`](Self::clock). Build
    /// the bucket on an `Arc<dyn Clock>`, the dispatcher's clock type.
    ///
    /// [`Throttle::with_checkpoint`]: crate::Throttle::with_checkpoint
    /// [`Checkpointer`]: crate::checkpoint::Checkpointer
    /// [`Durability::Strict`]: crate::checkpoint::Durability::Strict
    pub fn checkpoint<M: Mode>(
        mut self,
        checkpointed: &CheckpointedBucket<M, Arc<dyn Clock>>,
    ) -> Self {
        let bucket: Arc<dyn std::any::Any + Send + Sync> = checkpointed.shared_bucket().clone();
        let budget = match bucket.downcast::<SharedTokenBucket<Uncapped, ArcClock>>() {
            Ok(b) => Budget::Uncapped(b),
            Err(bucket) => Budget::Capped(
                bucket
                    .downcast::<SharedTokenBucket<Capped, ArcClock>>()
                    .expect("Mode is sealed: Capped or Uncapped"),
            ),
        };
        self.checkpoint = Some((budget, Arc::clone(checkpointed.gate())));
        self
    }

    /// Dispatches from a bucket made elsewhere, typically one shared by several processes
    /// through memory ([`SharedTokenBucket::open_with_clock`](crate::SharedTokenBucket::open_with_clock),
    /// feature `shm`): then the dispatchers of every process that opened it split one disk's
    /// budget, each by the shares of its own classes.
    ///
    /// The bucket's rate, limit, threshold, mode and clock replace the builder's, as with
    /// [`checkpoint`](Self::checkpoint) (which takes precedence if both are given). Build the
    /// bucket on an `Arc<dyn Clock>`, the dispatcher's clock type; for a bucket in shared
    /// memory, that clock must be a [`SystemMonotonicClock`](crate::SystemMonotonicClock).
    ///
    /// Waiting stays per process: a shard that is short of tokens sleeps for the time the
    /// shared rovers say its reservation needs (`duration_for` of its deficiency) and polls
    /// again; no process wakes another, and none needs to.
    pub fn shared_bucket<M: Mode>(mut self, bucket: Arc<SharedTokenBucket<M, ArcClock>>) -> Self {
        let bucket: Arc<dyn std::any::Any + Send + Sync> = bucket;
        self.shared = Some(
            match bucket.downcast::<SharedTokenBucket<Uncapped, ArcClock>>() {
                Ok(b) => Budget::Uncapped(b),
                Err(bucket) => Budget::Capped(
                    bucket
                        .downcast::<SharedTokenBucket<Capped, ArcClock>>()
                        .expect("Mode is sealed: Capped or Uncapped"),
                ),
            },
        );
        self
    }

    /// Adds a class and keeps the chain going; its id is its position (0, 1, …), and
    /// [`Dispatcher::class_id`] finds it by name. The class is checked by
    /// [`build`](Self::build) (shares in `1..=1000`, a positive cap, a unique name).
    ///
    /// ```
    /// use iothrottle::dispatcher::{ClassConfig, Dispatcher, DiskModel};
    ///
    /// let dispatcher = Dispatcher::builder()
    ///     .shards(1)
    ///     .disk(DiskModel::symmetric(200_000_000, 20_000))
    ///     .class(ClassConfig::new("foreground", 800))
    ///     .class(ClassConfig::new("compaction", 200))
    ///     .build()?;
    /// let fg = dispatcher.class_id("foreground").expect("configured above");
    /// assert_eq!(fg.index(), 0);
    /// # Ok::<(), iothrottle::BuildError>(())
    /// ```
    pub fn class(mut self, class: ClassConfig) -> Self {
        self.classes.push(class);
        self
    }

    /// Adds a class and returns its id at once (its position: 0, 1, …), checking it now.
    /// [`class`](Self::class) is the chaining form.
    pub fn add_class(&mut self, class: ClassConfig) -> Result<ClassId, BuildError> {
        class.validate()?;
        if self.classes.iter().any(|c| c.name() == class.name()) {
            return Err(BuildError::DuplicateClass {
                class: class.name().to_owned(),
            });
        }
        self.classes.push(class);
        Ok(ClassId(self.classes.len() - 1))
    }

    /// Checks the configuration and starts the shards.
    pub fn build(self) -> Result<Dispatcher, BuildError> {
        let (shared, shards) = self.shared()?;
        let hooks = runner::Hooks {
            start: self.start_hook,
            stop: self.stop_hook,
        };
        Dispatcher::start(shared, shards, self.pin, hooks)
    }

    /// The shared state this configuration describes, and the number of shards.
    pub(crate) fn shared(&self) -> Result<(Arc<Shared>, usize), BuildError> {
        let shards = match self.shards {
            Some(0) => return Err(BuildError::ZeroShards),
            Some(n) if n > Self::MAX_SHARDS => {
                return Err(BuildError::TooManyShards {
                    shards: n,
                    max: Self::MAX_SHARDS,
                })
            }
            Some(n) => {
                if let Ok(cores) = std::thread::available_parallelism() {
                    if n > cores.get() {
                        tracing::warn!(
                            shards = n,
                            cores = cores.get(),
                            "more dispatcher shards than cores: shards will share cores"
                        );
                    }
                }
                n
            }
            None => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(Self::MAX_SHARDS),
        };
        if self.classes.is_empty() {
            return Err(BuildError::NoClasses);
        }
        for (i, c) in self.classes.iter().enumerate() {
            c.validate()?;
            if self.classes[..i].iter().any(|o| o.name() == c.name()) {
                return Err(BuildError::DuplicateClass {
                    class: c.name().to_owned(),
                });
            }
        }
        let disk = self.disk.ok_or(BuildError::NoDiskModel)?;
        disk.validate()?;
        self.rate.validate()?;
        let goal_tokens = u64::try_from(self.latency_goal.as_nanos()).unwrap_or(u64::MAX);
        if goal_tokens == 0 || goal_tokens > BucketConfig::MAX_LIMIT {
            return Err(BuildError::LatencyGoalOutOfRange {
                goal: self.latency_goal,
                max: Duration::from_nanos(BucketConfig::MAX_LIMIT),
            });
        }
        let (budget, gate) = match (&self.checkpoint, &self.shared) {
            (Some((budget, gate)), _) => (budget.clone(), Some(Arc::clone(gate))),
            (None, Some(budget)) => (budget.clone(), None),
            (None, None) => {
                let limit = self.limit.unwrap_or(goal_tokens);
                let threshold = self.threshold.unwrap_or_else(|| {
                    let t = self.rate.tokens_in(Duration::from_micros(20));
                    u64::try_from(t).unwrap_or(u64::MAX).clamp(1, limit.max(1))
                });
                let config = BucketConfig::new(self.rate, limit).with_threshold(threshold);
                let budget = if self.capped {
                    Budget::Capped(Arc::new(SharedTokenBucket::with_clock(
                        config,
                        self.clock.clone(),
                    )?))
                } else {
                    Budget::Uncapped(Arc::new(SharedTokenBucket::with_clock(
                        config,
                        self.clock.clone(),
                    )?))
                };
                (budget, None)
            }
        };
        let (limit, rate, clock) = (budget.limit(), budget.rate(), budget.clock().clone());
        let max_cost = self.max_cost.unwrap_or((limit / 2).max(1));
        // An eighth of the limit at most: in capped mode a reservation that does not fit in
        // what completions left waits whole, so coarse batches would leave part of the goal's
        // capacity unused (a third of it with batches of a third).
        let batch = self.batch.unwrap_or_else(|| {
            let b = rate.tokens_in(Duration::from_micros(250));
            u64::try_from(b)
                .unwrap_or(u64::MAX)
                .clamp(1, (limit / 8).max(1))
        });
        for (what, value) in [("max_cost", max_cost), ("batch", batch)] {
            if value == 0 || value > limit {
                return Err(BuildError::TokensOutOfRange { what, value, limit });
            }
        }
        let idle_credit = self.idle_credit.unwrap_or(batch);
        let classes = Classes::new(
            self.classes.clone(),
            shards,
            (batch, idle_credit),
            rate,
            &clock,
        )?;
        let mut shared = Shared::new(
            budget,
            classes,
            disk,
            (max_cost, batch),
            self.latency_goal,
            clock,
            shards,
        );
        shared.gate = gate;
        shared.idle_poll = self.idle_poll;
        Ok((Arc::new(shared), shards))
    }
}

/// A thread-per-core I/O dispatcher over one shared token bucket. See the
/// [module documentation](self).
///
/// `Send + Sync`: submit from any thread (share it in an `Arc`). Dropping it shuts it down
/// like [`shutdown_now`](Self::shutdown_now) (without waiting when dropped in async code).
///
/// **Which shutdown to call.** On a plain thread: [`shutdown`](Self::shutdown) (drain) or
/// [`shutdown_now`](Self::shutdown_now) (cancel what is queued); both block until the running
/// futures end. In async code: [`shutdown_async`](Self::shutdown_async), or
/// [`shutdown_timeout`](Self::shutdown_timeout) for a bound.
pub struct Dispatcher {
    shared: Arc<Shared>,
    senders: Vec<UnboundedSender<Msg>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The fine timer for the shards' short sleeps, and its thread.
    timer: Arc<timer::FineTimer>,
    timer_thread: Mutex<Option<timer::TimerThread>>,
    /// 1 once shutdown started.
    closed: AtomicU64,
    /// Round-robin position for submissions from outside the shards.
    next: AtomicU64,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("shards", &self.senders.len())
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// A builder with the defaults.
    pub fn builder() -> DispatcherBuilder {
        DispatcherBuilder::new()
    }

    fn start(
        shared: Arc<Shared>,
        shards: usize,
        pin: bool,
        hooks: runner::Hooks,
    ) -> Result<Self, BuildError> {
        let cores = if pin {
            core_affinity::get_core_ids().filter(|c| !c.is_empty())
        } else {
            None
        };
        if pin && cores.is_none() {
            tracing::warn!("cannot list the cores; shard threads run unpinned");
        }
        let (fine, fine_thread) = timer::FineTimer::start(shards)
            .map_err(|source| BuildError::Spawn { shard: 0, source })?;
        let wake_timer = fine_thread_handle(&fine_thread);
        let mut dispatcher = Dispatcher {
            shared: shared.clone(),
            senders: Vec::with_capacity(shards),
            threads: Mutex::new(Vec::with_capacity(shards)),
            timer: fine.clone(),
            timer_thread: Mutex::new(Some(fine_thread)),
            closed: AtomicU64::new(0),
            next: AtomicU64::new(0),
        };
        let id = dispatcher.id();
        for index in 0..shards {
            // I/O: `disk` reaps io_uring completions on the shard's own reactor.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .enable_io()
                .build()
                .map_err(|source| BuildError::Spawn {
                    shard: index,
                    source,
                })?;
            let (tx, rx) = unbounded_channel();
            let core = cores.as_ref().map(|c| c[index % c.len()]);
            let timer = (fine.clone(), wake_timer.clone());
            let (hook, ready) = match &hooks.start {
                Some(h) => {
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    (Some((h.clone(), tx)), Some(rx))
                }
                None => (None, None),
            };
            let start = runner::Start {
                core,
                hook,
                stop: hooks.stop.clone(),
            };
            let thread = runner::spawn(index, id, shared.clone(), rx, rt, start, timer).map_err(
                |source| BuildError::Spawn {
                    shard: index,
                    source,
                },
            )?;
            dispatcher.senders.push(tx);
            dispatcher
                .threads
                .get_mut()
                .expect("not shared yet")
                .push(thread);
            if let Some(ready) = ready {
                // A thread that ended without an answer panicked outside the hook's guard.
                let outcome = ready.recv().unwrap_or_else(|_| {
                    Err(std::io::Error::other(
                        "the shard thread ended before its start hook ran",
                    ))
                });
                // Dropping `dispatcher` on the way out stops the shards already started.
                outcome.map_err(|source| BuildError::ShardStart {
                    shard: index,
                    source,
                })?;
            }
        }
        Ok(dispatcher)
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.senders.len()
    }

    /// The shard the calling thread runs, if it is one of this dispatcher's.
    pub fn current_shard(&self) -> Option<usize> {
        runner::current_shard(self.id())
    }

    /// The number of classes.
    pub fn classes(&self) -> usize {
        self.shared.classes.len()
    }

    /// The class named `name`.
    pub fn class_id(&self, name: &str) -> Option<ClassId> {
        self.shared
            .classes
            .iter()
            .position(|c| c.config.name() == name)
            .map(ClassId)
    }

    /// A class's configuration now: its current shares and cap.
    pub fn class_config(&self, class: ClassId) -> Option<ClassConfig> {
        (class.0 < self.classes()).then(|| self.shared.classes.config(class.0))
    }

    /// The disk model.
    pub fn disk(&self) -> DiskModel {
        self.shared.disk
    }

    /// What `request` costs, in tokens.
    pub fn cost(&self, request: &IoRequest) -> u64 {
        self.shared.disk.cost(request)
    }

    /// The most one request may cost.
    pub fn max_cost(&self) -> u64 {
        self.shared.max_cost
    }

    /// The latency goal the dispatcher was built with (see
    /// [`DispatcherBuilder::latency_goal`]).
    pub fn latency_goal(&self) -> Duration {
        self.shared.latency_goal
    }

    /// The largest piece of `kind` that [`submit_split`](Self::submit_split) issues: a
    /// multiple of [`SPLIT_ALIGN`] costing at most [`max_cost`](Self::max_cost), or `None`
    /// when not even one aligned block fits.
    pub fn max_piece(&self, kind: IoKind) -> Option<u64> {
        self.shared
            .disk
            .max_aligned_bytes_within(kind, self.shared.max_cost)
    }

    /// `true` in capped-release mode.
    pub fn is_capped(&self) -> bool {
        self.shared.budget.is_capped()
    }

    /// The bucket's limit.
    pub fn limit(&self) -> u64 {
        self.shared.budget.limit()
    }

    /// The shared bucket's rovers (see [`SharedTokenBucket::snapshot`]). In capped mode, once
    /// nothing is queued or running, `ceil - tail` equals the limit again: every token grabbed
    /// was released or refunded exactly once.
    pub fn bucket_state(&self) -> BucketState {
        self.shared.budget.snapshot()
    }

    /// The bucket's rate.
    pub fn rate(&self) -> Rate {
        self.shared.budget.rate()
    }

    /// Changes the bucket's rate, on every shard within one replenish period: the tokens
    /// earned before the call count at the old rate, later ones at the new rate (the bucket's
    /// [`set_rate`](SharedTokenBucket::set_rate)), and every shard is woken to re-compute its
    /// wait, so a request waiting for tokens is served at the new rate's pace.
    pub fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        self.shared.set_rate(rate)?;
        self.wake_shards();
        Ok(())
    }

    /// Changes a class's shares (`1..=1000`) while running, like Seastar's
    /// `update_shares_for_class`: its later reservations count at the new shares (its virtual
    /// time so far stays). Every shard is woken, so the change holds within one replenish
    /// period.
    pub fn set_shares(&self, class: ClassId, shares: u32) -> Result<(), ControlError> {
        self.shared.set_shares(class, shares)?;
        self.wake_shards();
        Ok(())
    }

    /// Sets, changes or removes (`None`) a class's bandwidth cap while running; `rate` counts
    /// bytes (`Rate::per_second(50 << 20)` is 50 MiB/s). A new cap starts with a full burst
    /// (100 ms of it), as at build; a request waiting for bytes of the old cap claims them
    /// again from the new one. Every shard is woken, so the change holds within one
    /// replenish period.
    pub fn set_bandwidth_cap(&self, class: ClassId, cap: Option<Rate>) -> Result<(), ControlError> {
        self.shared.set_bandwidth_cap(class, cap)?;
        self.wake_shards();
        Ok(())
    }

    /// Makes every shard poll again (after a run-time change).
    fn wake_shards(&self) {
        for tx in &self.senders {
            // A shard that stopped needs no wake-up.
            let _ = tx.send(Msg::Wake);
        }
    }

    /// Submits `request` of `class`: `fut` runs on a shard once the request's tokens are there,
    /// and the handle resolves to its output. From a shard thread the request stays on that
    /// shard; from elsewhere shards take turns.
    ///
    /// The future must not be polled before: it is the I/O itself. In capped mode its tokens are
    /// released when it ends.
    pub fn submit<F>(
        &self,
        class: ClassId,
        request: IoRequest,
        fut: F,
    ) -> Result<IoHandle<F::Output>, SubmitError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.submit_to(self.pick_shard(), class, request, fut)
    }

    /// [`submit`](Self::submit) to a given shard.
    pub fn submit_to<F>(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        fut: F,
    ) -> Result<IoHandle<F::Output>, SubmitError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let (task, handle) = handle::task(fut);
        self.submit_task_to(shard, class, request, task)?;
        Ok(handle)
    }

    fn submit_task_to(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        let cost = self.shared.disk.cost(&request);
        self.submit_costed_to(shard, class, request, cost, task)
    }

    /// [`submit`](Self::submit) of a task that delivers its own result (the disk module's
    /// operations, which need no future on the shard), for a request whose cost the caller
    /// has computed already ([`cost`](Self::cost) of `request`: the disk module checks it
    /// before it submits anything).
    pub(crate) fn submit_costed(
        &self,
        class: ClassId,
        request: IoRequest,
        cost: u64,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        self.submit_costed_to(self.pick_shard(), class, request, cost, task)
    }

    fn submit_costed_to(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        cost: u64,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        debug_assert_eq!(cost, self.shared.disk.cost(&request));
        self.check(shard, class)?;
        if cost > self.shared.max_cost {
            return Err(self.too_large(&request, cost));
        }
        self.send(shard, class, cost, request.bytes(), task)
    }

    /// Submits a request that may be split: `make` is called once per piece (in order, at
    /// submission) with the byte range the piece covers, and its future runs once that piece's
    /// tokens are there. Each piece costs at most [`max_cost`](Self::max_cost).
    /// The handle resolves to the pieces' outputs in order.
    ///
    /// Pieces are as few as `max_cost` allows and about equal; each starts at a multiple of
    /// [`SPLIT_ALIGN`] (4 KiB) from the request's start and all but the last are a multiple of
    /// it long ([`max_piece`](Self::max_piece) is the longest), so that with an aligned offset
    /// and buffer every piece can be issued with `O_DIRECT`.
    ///
    /// A raw token cost ([`IoRequest::tokens`]) cannot be split, nor a request of which not
    /// even one 4 KiB block fits in `max_cost`: both are [`SubmitError::TooLarge`].
    pub fn submit_split<F, Fut>(
        &self,
        class: ClassId,
        request: IoRequest,
        make: F,
    ) -> Result<SplitHandle<Fut::Output>, SubmitError>
    where
        F: FnMut(Piece) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.submit_split_to(self.pick_shard(), class, request, make)
    }

    /// [`submit_split`](Self::submit_split) to a given shard.
    pub fn submit_split_to<F, Fut>(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        mut make: F,
    ) -> Result<SplitHandle<Fut::Output>, SubmitError>
    where
        F: FnMut(Piece) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.check(shard, class)?;
        let cost = self.shared.disk.cost(&request);
        let pieces = match request.kind() {
            _ if cost <= self.shared.max_cost => cost::split(request.bytes(), u64::MAX),
            None => return Err(self.too_large(&request, cost)),
            Some(kind) => match self.max_piece(kind) {
                Some(max) => cost::split(request.bytes(), max),
                None => return Err(self.too_large(&request, cost)),
            },
        };
        let mut handles = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let bytes = piece.len();
            let piece_req = match request.kind() {
                Some(IoKind::Read) => IoRequest::read(bytes),
                Some(IoKind::Write) => IoRequest::write(bytes),
                None => request,
            };
            let piece_cost = self.shared.disk.cost(&piece_req);
            let (task, handle) = handle::task(make(piece));
            self.send(shard, class, piece_cost, bytes, task)?;
            handles.push(handle);
        }
        Ok(SplitHandle::new(handles))
    }

    fn check(&self, shard: usize, class: ClassId) -> Result<(), SubmitError> {
        // Acquire: pairs with the Release in `begin_shutdown`; a submit that sees 0 may still
        // race with a shutdown, which the shard then handles (see `runner`).
        if self.closed.load(Ordering::Acquire) != 0 {
            return Err(SubmitError::ShutDown);
        }
        if shard >= self.senders.len() {
            return Err(SubmitError::UnknownShard {
                shard,
                shards: self.senders.len(),
            });
        }
        if class.0 >= self.classes() {
            return Err(SubmitError::UnknownClass {
                class: class.0,
                classes: self.classes(),
            });
        }
        Ok(())
    }

    fn too_large(&self, request: &IoRequest, cost: u64) -> SubmitError {
        SubmitError::TooLarge {
            cost,
            max_cost: self.shared.max_cost,
            max_bytes: request
                .kind()
                .and_then(|k| self.shared.disk.max_bytes_within(k, self.shared.max_cost)),
        }
    }

    fn pick_shard(&self) -> usize {
        if let Some(s) = self.current_shard() {
            return s;
        }
        // Relaxed: a lone counter; any interleaving spreads the requests.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        (n % self.senders.len() as u64) as usize
    }

    fn send(
        &self,
        shard: usize,
        class: ClassId,
        cost: u64,
        bytes: u64,
        task: handle::BoxTask,
    ) -> Result<(), SubmitError> {
        let entry = Entry {
            class: class.0,
            cost,
            bytes,
            submitted: self.shared.clock.now(),
            payload: task,
        };
        self.senders[shard]
            .send(Msg::Submit(entry))
            .map_err(|_| SubmitError::ShutDown)
    }

    /// A snapshot of the figures of every shard and class. After shutdown, the figures each
    /// shard had when it stopped.
    pub async fn stats(&self) -> DispatcherStats {
        let mut waiting = Vec::with_capacity(self.senders.len());
        for (i, tx) in self.senders.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            let sent = tx.send(Msg::Stats(StatsReply::Async(reply))).is_ok();
            waiting.push((i, sent.then_some(rx)));
        }
        let mut shards = Vec::with_capacity(waiting.len());
        for (i, rx) in waiting {
            let got = match rx {
                Some(rx) => rx.await.ok(),
                None => None,
            };
            shards.push(got.unwrap_or_else(|| self.final_stats(i)));
        }
        DispatcherStats::from_shards(shards)
    }

    /// [`stats`](Self::stats), blocking the calling thread (do not call it from a shard's
    /// future: the shard would wait for itself).
    pub fn stats_blocking(&self) -> DispatcherStats {
        let (reply, rx) = std::sync::mpsc::channel();
        let mut asked = vec![false; self.senders.len()];
        for (i, tx) in self.senders.iter().enumerate() {
            asked[i] = tx
                .send(Msg::Stats(StatsReply::Blocking(reply.clone())))
                .is_ok();
        }
        drop(reply);
        let mut shards: Vec<Option<ShardStats>> = vec![None; self.senders.len()];
        // Ends when every shard answered or dropped our request (it stopped).
        while let Ok(s) = rx.recv() {
            let i = s.shard;
            shards[i] = Some(s);
        }
        let shards = shards
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.unwrap_or_else(|| self.final_stats(i)))
            .collect();
        DispatcherStats::from_shards(shards)
    }

    fn final_stats(&self, shard: usize) -> ShardStats {
        let saved = self
            .shared
            .final_stats
            .lock()
            .ok()
            .and_then(|s| s[shard].clone());
        saved.unwrap_or_else(|| ShardStats {
            shard,
            classes: self
                .shared
                .classes
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    stats::ClassRecorder::new().snapshot(
                        c.config.name(),
                        self.shared.classes.shares(i),
                        0,
                    )
                })
                .collect(),
        })
    }

    /// User futures whose `poll` or `drop` panicked, and stop hooks
    /// ([`DispatcherBuilder::on_shard_stop`]) that panicked. Each panic was caught on its
    /// shard, which kept running; a panic in `poll` (or in `drop` after completing) reaches the
    /// request's handle as [`DispatchError::Panicked`](crate::error::DispatchError::Panicked);
    /// one in the `drop` of a cancelled request has no handle to reach and is only counted, as
    /// is a stop hook's.
    pub fn panics(&self) -> u64 {
        // Relaxed: a statistic; the shards add to it after each step.
        self.shared.panics.load(Ordering::Relaxed)
    }

    /// Stops taking requests, dispatches everything already queued (at the configured rate),
    /// waits for all futures to finish and joins the shard threads. Idempotent.
    ///
    /// **Blocks the calling thread** until the last running future ends. From async code,
    /// where a running future may wait for the very task that calls this (a deadlock), use
    /// [`shutdown_async`](Self::shutdown_async) or [`shutdown_timeout`](Self::shutdown_timeout).
    ///
    /// Called from one of this dispatcher's own shards it only starts the shutdown (a shard
    /// cannot join itself); the threads are joined when the dispatcher is dropped elsewhere.
    pub fn shutdown(&self) {
        // Joining cannot time out.
        let _ = self.stop(ShutdownMode::Drain, Wait::Join);
    }

    /// Stops taking requests, fails everything not yet dispatched with
    /// [`DispatchError::ShutDown`](crate::error::DispatchError::ShutDown) (their tokens go
    /// back), waits for the futures already running and joins the shard threads. Idempotent.
    ///
    /// **Blocks the calling thread** like [`shutdown`](Self::shutdown).
    pub fn shutdown_now(&self) {
        // Joining cannot time out.
        let _ = self.stop(ShutdownMode::Cancel, Wait::Join);
    }

    /// [`shutdown`](Self::shutdown), waiting at most `timeout` for the running futures. On
    /// time out the shards keep draining in the background (detached) and the error says how
    /// many still run; calling it again (or [`shutdown_async`](Self::shutdown_async)) waits
    /// more. Bounded, so safe to call from async code (it still blocks for up to `timeout`).
    pub fn shutdown_timeout(&self, timeout: Duration) -> Result<(), ShutdownError> {
        self.stop(ShutdownMode::Drain, Wait::Timeout(timeout))
    }

    /// [`shutdown`](Self::shutdown) for async code: the waiting is `.await`ed, never blocking
    /// the runtime's thread, so futures on the shards that wait for the caller's own tasks can
    /// finish. Cancelling it (dropping the future) leaves the shards draining in the
    /// background.
    pub async fn shutdown_async(&self) {
        self.signal(ShutdownMode::Drain);
        if self.current_shard().is_some() {
            return;
        }
        self.shared.exits.wait().await;
        self.join();
    }

    fn signal(&self, mode: ShutdownMode) {
        // Release: pairs with the Acquire in `check`.
        self.closed.store(1, Ordering::Release);
        for tx in &self.senders {
            let _ = tx.send(Msg::Shutdown(mode));
        }
    }

    fn stop(&self, mode: ShutdownMode, wait: Wait) -> Result<(), ShutdownError> {
        self.signal(mode);
        if self.current_shard().is_some() {
            return Ok(());
        }
        match wait {
            Wait::Join => {}
            Wait::Timeout(t) => {
                let running = self.shared.exits.wait_timeout(t);
                if running > 0 {
                    return Err(ShutdownError::TimedOut { running });
                }
            }
            Wait::Detach => return Ok(()),
        }
        self.join();
        Ok(())
    }

    /// Joins the shard threads and stops the timer thread.
    fn join(&self) {
        let threads = match self.threads.lock() {
            Ok(mut t) => std::mem::take(&mut *t),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a dispatcher shard thread panicked");
            }
        }
        let timer = match self.timer_thread.lock() {
            Ok(mut t) => t.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(mut t) = timer {
            t.stop(&self.timer);
        }
    }
}

/// How [`Dispatcher::stop`] waits for the shard threads.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// Until they end.
    Join,
    /// At most this long.
    Timeout(Duration),
    /// Not at all: they end on their own.
    Detach,
}

fn fine_thread_handle(t: &timer::TimerThread) -> std::thread::Thread {
    t.thread().clone()
}

impl Drop for Dispatcher {
    /// Shuts down like [`shutdown_now`](Dispatcher::shutdown_now). On a thread that runs a
    /// tokio runtime (async code) it does not wait: the running futures may need that very
    /// thread, so the shards finish them in the background and end on their own.
    fn drop(&mut self) {
        let wait = if tokio::runtime::Handle::try_current().is_ok() {
            Wait::Detach
        } else {
            Wait::Join
        };
        let _ = self.stop(ShutdownMode::Cancel, wait);
        // Dropped on one of its own shards: the threads could not be joined; at least let the
        // timer thread end (the shards fall back to tokio's timer).
        if let Ok(mut t) = self.timer_thread.lock() {
            if let Some(t) = t.take() {
                t.signal_stop(&self.timer);
            }
        }
    }
}
