//! [`DispatcherBuilder`]: the configuration of a [`Dispatcher`], checked and turned into the
//! shards' [`Shared`] state.

use std::fmt;
use std::time::Duration;

use crate::bucket::{BucketConfig, Capped, Mode, Rate, SharedTokenBucket, Uncapped};
use crate::checkpoint::{CheckpointedBucket, MarkGate};
use crate::clock::{Clock, MonotonicClock};
use crate::sync::Arc;
use crate::BuildError;

use super::budget::Budget;
use super::class::{ClassConfig, ClassId, Classes};
use super::cost::{DiskModel, IoKind, IoRequest, SPLIT_ALIGN};
use super::runner;
use super::slice;
use super::state::{ArcClock, Shared};
use super::Dispatcher;

/// Configures and starts a [`Dispatcher`]. Made by [`Dispatcher::builder`].
///
/// A [`disk`](Self::disk) model is required (there is no default disk). Defaults: one shard per
/// available core, the rate that keeps the disk exactly busy ([`DiskModel::full_rate`]), a
/// [latency goal](Self::latency_goal) of 0.75 ms — the bucket's limit is that much disk time
/// and the bucket is [capped](Self::capped), so at most 0.75 ms of modelled disk time is
/// dispatched and not yet completed — requests of at most half the goal (larger ones are split
/// by [`Dispatcher::submit_split`]), reservations of 250 µs of disk time but at most an eighth
/// of the limit (94 µs for the default goal), a replenish threshold of 20 µs, threads pinned
/// and asking the OS scheduler for a 100 µs [slice](Self::shard_slice).
pub struct DispatcherBuilder {
    shards: Option<usize>,
    disk: Option<DiskModel>,
    pub(super) latency_goal: Duration,
    rate: Rate,
    limit: Option<u64>,
    threshold: Option<u64>,
    max_cost: Option<u64>,
    batch: Option<u64>,
    idle_credit: Option<u64>,
    capped: bool,
    pin: bool,
    slice: Option<Duration>,
    /// `None`: the default (files on the caller's ring, submitted futures on the shards).
    caller_dispatch: Option<bool>,
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
            .field("shard_slice", &self.slice)
            .field("on_shard_start", &self.start_hook.is_some())
            .field("on_shard_stop", &self.stop_hook.is_some())
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

impl DispatcherBuilder {
    /// The most shards a dispatcher may have (each is an OS thread with its own runtime).
    pub const MAX_SHARDS: usize = 1024;

    pub(super) fn new() -> Self {
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
            slice: Some(Self::DEFAULT_SHARD_SLICE),
            caller_dispatch: None,
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

    /// The most one request may cost (larger ones are split by
    /// [`Dispatcher::submit_split`] into 4 KiB-aligned pieces, or refused by
    /// [`Dispatcher::submit`]). `1..=limit`; default half the limit. While it and the limit
    /// follow the [latency goal](Self::latency_goal) (neither set, no checkpointed bucket),
    /// [`build`](Self::build) refuses a disk model of which not even one 4 KiB read or write
    /// fits ([`BuildError::DiskTooSlowForGoal`], naming the goal that would fit); values set
    /// here are taken as given.
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

    /// The default [shard slice](Self::shard_slice): 100 µs, the shortest Linux grants.
    pub const DEFAULT_SHARD_SLICE: Duration = Duration::from_micros(100);

    /// The time slice each shard thread asks the OS scheduler for, or `None` to leave the
    /// threads' scheduling as it is. Default [`DEFAULT_SHARD_SLICE`](Self::DEFAULT_SHARD_SLICE);
    /// accepted from 100 µs to 100 ms, the range Linux grants
    /// ([`BuildError::ShardSliceOutOfRange`] otherwise).
    ///
    /// Linux 6.12 and later (EEVDF custom slices, `sched_setattr`; no privilege needed) give a
    /// woken thread with a shorter slice an earlier deadline, so a shard woken by a completion
    /// or a request takes its core from an application thread that keeps the core busy instead
    /// of waiting for that thread's slice to run out (up to a scheduler tick, 4 ms at 250 Hz).
    /// With a spinning thread on each core, the main job's foreground p99 was lower with
    /// shards at 100 µs than at the kernel's default slice in each of six alternating runs (see
    /// `docs/dispatcher.md`, "Busy cores: who runs when"). Older kernels accept the request and
    /// ignore it.
    ///
    /// The cost is on CPU-bound shards: a shard that runs long stretches of CPU work (engine
    /// tasks given to [`Dispatcher::spawn_on`] that compute for milliseconds) is preempted
    /// after each 100 µs when another thread wants its core, a context switch each time; a
    /// longer slice, or `None`, suits such shards.
    ///
    /// The slice is set after the thread pins itself and before the
    /// [`on_shard_start`](Self::on_shard_start) hook, which may change it. The shard keeps its
    /// policy and nice value (inherited from the thread that calls `build`); a shard whose
    /// policy is real-time or deadline is left as it is. Should the OS refuse, the shard runs
    /// with its default slice and a `tracing` warning says so.
    pub fn shard_slice(mut self, slice: Option<Duration>) -> Self {
        self.slice = slice;
        self
    }

    /// Dispatch from the caller's thread: a request from outside the shards that can go at
    /// once — its tokens are in the bucket, nothing of its class waits anywhere, the shares let
    /// its class go — is not sent to a shard, so no shard thread has to wake for it (the
    /// tokens, the class's fairness and the stats are accounted exactly as for a shard's
    /// request).
    ///
    /// - **`ThrottledFile` I/O** (on unless this is set to `false`): a piece that may go at once
    ///   is issued on an io_uring ring of the calling thread's own, reaped by the caller's
    ///   tokio runtime (it needs the runtime's I/O driver; without one, outside tokio, or on the
    ///   blocking pool, the piece keeps the shard's path); its buffer and tokens are held until
    ///   the kernel completes it, even if its future is dropped. It takes a ring (an fd and
    ///   locked memory) per calling thread that issues disk I/O.
    /// - **Futures submitted** with [`Dispatcher::submit`] or [`Dispatcher::submit_to`] (only
    ///   when this is set to `true`): the future of a request that can go at once runs inside
    ///   its [`IoHandle`] on the thread that awaits it. Should the handle be dropped before the
    ///   future ended, the future is sent to the shard and runs to its end there. Off unless
    ///   asked for because it changes where a request's future runs: on the caller's thread and
    ///   runtime, not on a shard; a future that spawns onto the shard's `LocalSet`, or relies
    ///   on the shard's io_uring ring, needs the shard (use [`Dispatcher::spawn_on`] to run code
    ///   on a shard).
    ///
    /// - **`ThrottledFile` I/O from a task on a shard** (on unless this is set to `false`): a
    ///   piece that may go at once is issued by the task itself on the shard's ring and handed
    ///   to the kernel at once, without a turn of the shard's loop; it counts among the shard's
    ///   running requests, so a shutdown waits for it.
    ///
    /// `false` sends every request through a shard's queue. See `docs/dispatcher.md`, "No hop
    /// when none is needed".
    ///
    /// [`IoHandle`]: super::IoHandle
    pub fn caller_dispatch(mut self, on: bool) -> Self {
        self.caller_dispatch = Some(on);
        self
    }

    /// The default [idle poll](Self::idle_poll): 1 ms, five times Seastar's
    /// `--idle-poll-time-us`. On a VM a core left idle halts, and the next interrupt (a
    /// completion, a timer, a request from another thread) waits for the hypervisor to run it
    /// again. A shard that serves a request at least every millisecond, or whose I/O completes
    /// within one, keeps polling between them while its core is its own and at most one
    /// operation is in flight (docs/dispatcher.md, "Idle poll").
    pub const DEFAULT_IDLE_POLL: Duration = Duration::from_millis(1);

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
    /// time of its last activity (a quiet dispatcher uses no CPU). When the polling rounds in
    /// which the OS preempted the thread (off its CPU for over 50 µs) lost over 1/16 of the
    /// time polled since the last back-off, another thread wants the core: the shard then parks
    /// at once whenever idle for a back-off of 10 ms, doubled each further time up to a second
    /// and started again at 10 ms after a poll that runs its whole time, or 100 ms of polling,
    /// without finding the core contended, so polling does not compete with the application's
    /// threads; a kernel worker's occasional run does not count as contention
    /// ([`ShardStats::idle_poll_backoffs`](super::ShardStats::idle_poll_backoffs) counts the
    /// back-offs). The bound is wall-clock time
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
    /// # use iothrottle::dispatcher::{ClassConfig, DiskModel, Figures, Dispatcher};
    /// // Shards on SCHED_BATCH: a woken shard does not preempt the thread that woke it, so a
    /// // caller sharing its core submits a whole batch before the shard takes it (Linux).
    /// let dispatcher = Dispatcher::builder()
    ///     .disk(DiskModel::symmetric(Figures { iops: 20_000, bandwidth: 200_000_000 }))
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
    /// # use iothrottle::dispatcher::{ClassConfig, DiskModel, Figures, Dispatcher};
    /// let stopped = Arc::new(AtomicUsize::new(0));
    /// let counter = stopped.clone();
    /// let dispatcher = Dispatcher::builder()
    ///     .shards(2)
    ///     .disk(DiskModel::symmetric(Figures { iops: 20_000, bandwidth: 200_000_000 }))
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
    /// through memory (`SharedTokenBucket::open_with_clock`,
    /// feature `shm`): then the dispatchers of every process that opened it split one disk's
    /// budget, each by the shares of its own classes.
    ///
    /// The bucket's rate, limit, threshold, mode and clock replace the builder's, as with
    /// [`checkpoint`](Self::checkpoint) (which takes precedence if both are given). Build the
    /// bucket on an `Arc<dyn Clock>`, the dispatcher's clock type; for a bucket in shared
    /// memory, that clock must be a `SystemMonotonicClock`.
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
    /// use iothrottle::dispatcher::{ClassConfig, Dispatcher, DiskModel, Figures};
    ///
    /// let dispatcher = Dispatcher::builder()
    ///     .shards(1)
    ///     .disk(DiskModel::symmetric(Figures { iops: 20_000, bandwidth: 200_000_000 }))
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
        if let Some(slice) = self.slice {
            if !(slice::MIN..=slice::MAX).contains(&slice) {
                return Err(BuildError::ShardSliceOutOfRange {
                    slice,
                    min: slice::MIN,
                    max: slice::MAX,
                });
            }
        }
        let (shared, shards) = self.shared()?;
        let threads = runner::Threads {
            pin: self.pin,
            slice: self.slice,
            start: self.start_hook,
            stop: self.stop_hook,
        };
        Dispatcher::start(shared, shards, threads)
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
        // A disk too slow for the goal would refuse every read or write later: say so now.
        // Checked when `max_cost` follows the goal; an explicit `max_cost`, limit or
        // checkpointed or shared bucket is taken as given (raw-token requests need no disk model).
        let follows_goal = self.max_cost.is_none()
            && self.limit.is_none()
            && self.checkpoint.is_none()
            && self.shared.is_none();
        for (kind, name) in [(IoKind::Read, "read"), (IoKind::Write, "write")] {
            if follows_goal && disk.max_aligned_bytes_within(kind, max_cost).is_none() {
                let cost = disk.cost(&IoRequest::new(kind, SPLIT_ALIGN));
                return Err(BuildError::DiskTooSlowForGoal {
                    kind: name,
                    cost,
                    max_cost,
                    goal: self.latency_goal,
                    needed_goal: Duration::from_nanos(cost.saturating_mul(2)),
                });
            }
        }
        let idle_credit = self.idle_credit.unwrap_or(batch);
        let configs = self
            .classes
            .iter()
            .map(|c| c.resolved(self.latency_goal))
            .collect();
        let classes = Classes::new(configs, shards, (batch, idle_credit), rate, &clock)?;
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
        shared.caller_dispatch = self.caller_dispatch == Some(true);
        shared.caller_files = self.caller_dispatch != Some(false);
        Ok((Arc::new(shared), shards))
    }
}
