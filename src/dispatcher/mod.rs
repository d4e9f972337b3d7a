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
//! let mut builder = Dispatcher::builder().shards(2).disk(disk);
//! let fg = builder.add_class(ClassConfig::new("foreground", 800))?;
//! let bg = builder.add_class(ClassConfig::new("compaction", 200))?;
//! let dispatcher = builder.build()?;
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

mod budget;
mod class;
mod cost;
mod handle;
mod queue;
mod runner;
mod shard;
mod stats;
mod timer;

#[cfg(test)]
mod tests;

use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::oneshot;

pub use class::{ClassConfig, ClassId};
pub use cost::{DiskModel, IoKind, IoRequest, Piece, SPLIT_ALIGN};
pub use handle::{IoHandle, SplitHandle};
pub use stats::{ClassStats, DispatcherStats, ShardStats};

use crate::bucket::{BucketConfig, BucketState, Rate, SharedTokenBucket};
use crate::clock::{Clock, MonotonicClock};
use crate::error::{BuildError, ConfigError, SubmitError};
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
    /// One per shard: notified when a completion gives capacity back (capped mode), so that a
    /// shard waiting for it re-polls at once instead of at its next timed check.
    pub(crate) released: Vec<tokio::sync::Notify>,
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
            classes,
            disk,
            max_cost,
            latency_goal,
            batch,
            clock,
            final_stats: Mutex::new(vec![None; shards]),
            released: (0..shards).map(|_| tokio::sync::Notify::new()).collect(),
        }
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
    classes: Vec<ClassConfig>,
    clock: ArcClock,
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
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

impl DispatcherBuilder {
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
            classes: Vec::new(),
            clock: Arc::new(MonotonicClock::new()),
        }
    }

    /// The number of shards (threads). Default: the available cores.
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

    /// Where time comes from (default a new [`MonotonicClock`]).
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Adds a class; its id is its position (0, 1, …).
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
        Dispatcher::start(shared, shards, self.pin)
    }

    /// The shared state this configuration describes, and the number of shards.
    pub(crate) fn shared(&self) -> Result<(Arc<Shared>, usize), BuildError> {
        let shards = match self.shards {
            Some(0) => return Err(BuildError::ZeroShards),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if self.classes.is_empty() {
            return Err(BuildError::NoClasses);
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
        let limit = self.limit.unwrap_or(goal_tokens);
        let threshold = self.threshold.unwrap_or_else(|| {
            let t = self.rate.tokens_in(Duration::from_micros(20));
            u64::try_from(t).unwrap_or(u64::MAX).clamp(1, limit.max(1))
        });
        let config = BucketConfig::new(self.rate, limit).with_threshold(threshold);
        let budget = if self.capped {
            Budget::Capped(SharedTokenBucket::with_clock(config, self.clock.clone())?)
        } else {
            Budget::Uncapped(SharedTokenBucket::with_clock(config, self.clock.clone())?)
        };
        let max_cost = self.max_cost.unwrap_or((limit / 2).max(1));
        // An eighth of the limit at most: in capped mode a reservation that does not fit in
        // what completions left waits whole, so coarse batches would leave part of the goal's
        // capacity unused (a third of it with batches of a third).
        let batch = self.batch.unwrap_or_else(|| {
            let b = self.rate.tokens_in(Duration::from_micros(250));
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
            batch,
            idle_credit,
            &self.clock,
        )?;
        let shared = Shared::new(
            budget,
            classes,
            disk,
            (max_cost, batch),
            self.latency_goal,
            self.clock.clone(),
            shards,
        );
        Ok((Arc::new(shared), shards))
    }
}

/// A thread-per-core I/O dispatcher over one shared token bucket. See the
/// [module documentation](self).
///
/// `Send + Sync`: submit from any thread (share it in an `Arc`). Dropping it shuts it down
/// like [`shutdown_now`](Self::shutdown_now).
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

    fn start(shared: Arc<Shared>, shards: usize, pin: bool) -> Result<Self, BuildError> {
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
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .map_err(|source| BuildError::Spawn {
                    shard: index,
                    source,
                })?;
            let (tx, rx) = unbounded_channel();
            let core = cores.as_ref().map(|c| c[index % c.len()]);
            let timer = (fine.clone(), wake_timer.clone());
            let thread = runner::spawn(index, id, shared.clone(), rx, rt, core, timer).map_err(
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

    /// A class's configuration.
    pub fn class_config(&self, class: ClassId) -> Option<&ClassConfig> {
        (class.0 < self.classes()).then(|| &self.shared.classes.get(class.0).config)
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

    /// Changes the bucket's rate; takes effect at the next replenish.
    pub fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        self.shared.budget.set_rate(rate)
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
        self.check(shard, class)?;
        let cost = self.shared.disk.cost(&request);
        if cost > self.shared.max_cost {
            return Err(self.too_large(&request, cost));
        }
        let (task, handle) = handle::task(fut);
        self.send(shard, class, cost, request.bytes(), task)?;
        Ok(handle)
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
                .map(|c| {
                    stats::ClassRecorder::new().snapshot(c.config.name(), c.config.shares(), 0)
                })
                .collect(),
        })
    }

    /// Stops taking requests, dispatches everything already queued (at the configured rate),
    /// waits for all futures to finish and joins the shard threads. Idempotent.
    ///
    /// Called from one of this dispatcher's own shards it only starts the shutdown (a shard
    /// cannot join itself); the threads are joined when the dispatcher is dropped elsewhere.
    pub fn shutdown(&self) {
        self.stop(ShutdownMode::Drain);
    }

    /// Stops taking requests, fails everything not yet dispatched with
    /// [`DispatchError::ShutDown`](crate::error::DispatchError::ShutDown) (their tokens go
    /// back), waits for the futures already running and joins the shard threads. Idempotent.
    pub fn shutdown_now(&self) {
        self.stop(ShutdownMode::Cancel);
    }

    fn stop(&self, mode: ShutdownMode) {
        // Release: pairs with the Acquire in `check`.
        self.closed.store(1, Ordering::Release);
        for tx in &self.senders {
            let _ = tx.send(Msg::Shutdown(mode));
        }
        if self.current_shard().is_some() {
            return;
        }
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

fn fine_thread_handle(t: &timer::TimerThread) -> std::thread::Thread {
    t.thread().clone()
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.stop(ShutdownMode::Cancel);
        // Dropped on one of its own shards: the threads could not be joined; at least let the
        // timer thread end (the shards fall back to tokio's timer).
        if let Ok(mut t) = self.timer_thread.lock() {
            if let Some(t) = t.take() {
                t.signal_stop(&self.timer);
            }
        }
    }
}
