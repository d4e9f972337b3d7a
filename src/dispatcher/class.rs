//! Priority classes: [`ClassConfig`], [`ClassId`], [`Priority`], and each class's shared state
//! (its configuration, its bandwidth-cap bucket, its fairness counters in [`Fairness`]).
//!
//! The cross-shard fairness rules (virtual time, tiers, no banking, wrap safety) are described
//! in [`fair`](super::fair), the loom-checked core.

use std::fmt;
use std::sync::RwLock;
use std::time::Duration;

use crate::bucket::{BucketConfig, Rate, SharedTokenBucket, Uncapped};
use crate::BuildError;
use crossbeam_utils::CachePadded;

use crate::sync::{Arc, AtomicU64, Ordering};

use super::bound::InFlightBound;
pub(crate) use super::fair::Ahead;
use super::fair::Fairness;
use super::latency::LatencyControl;
use super::ArcClock;

/// A class's bandwidth cap: a bucket of bytes shared by all shards.
pub(crate) type CapBucket = SharedTokenBucket<Uncapped, ArcClock>;

/// A class's tier. [`High`](Priority::High) classes are served before any
/// [`Normal`](Priority::Normal) class, still inside the dispatcher's rate (RocksDB's
/// `IO_USER`); within a tier classes share by their shares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Shares the disk with the other normal classes by shares (the default).
    #[default]
    Normal,
    /// Goes first: a normal class reserves only while no high class has requests waiting on
    /// any shard. High classes share among themselves by shares.
    High,
}

/// Identifies a class of a dispatcher: the order in which it was added (0, 1, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub(crate) usize);

impl ClassId {
    /// The class's index (the order of [`add_class`](super::DispatcherBuilder::add_class)).
    pub fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for ClassId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "class#{}", self.0)
    }
}

/// A priority class: a name, shares in `1..=1000`, an optional bandwidth cap and a
/// [`Priority`] tier. Shares and cap can be changed while the dispatcher runs
/// ([`Dispatcher::set_shares`](super::Dispatcher::set_shares),
/// [`Dispatcher::set_bandwidth_cap`](super::Dispatcher::set_bandwidth_cap)).
///
/// ```
/// use iothrottle::dispatcher::{ClassConfig, Priority};
/// use iothrottle::Rate;
///
/// let compaction = ClassConfig::new("compaction", 200).with_bandwidth_cap(Rate::mib_per_second(50));
/// assert_eq!(compaction.shares(), 200);
/// let user = ClassConfig::new("user reads", 100).with_priority(Priority::High);
/// assert_eq!(user.priority(), Priority::High);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClassConfig {
    name: String,
    shares: u32,
    bandwidth_cap: Option<Rate>,
    priority: Priority,
    latency_target: Option<Duration>,
    max_in_flight: Option<Duration>,
    background: bool,
}

impl ClassConfig {
    /// The most shares a class can have.
    pub const MAX_SHARES: u32 = 1000;

    /// A [background](Self::background) class may hold at most the dispatcher's
    /// [latency goal](super::DispatcherBuilder::latency_goal) divided by this in flight: 47 µs
    /// of disk time at the default goal, pieces of about 100 KiB on a disk that writes 2 GB/s.
    pub const BACKGROUND_GOAL_DIVISOR: u32 = 16;

    /// A class named `name` with `shares` (checked by the builder: `1..=1000`).
    pub fn new(name: impl Into<String>, shares: u32) -> Self {
        ClassConfig {
            name: name.into(),
            shares,
            bandwidth_cap: None,
            priority: Priority::Normal,
            latency_target: None,
            max_in_flight: None,
            background: false,
        }
    }

    /// A class for background work (compaction, flush, backup): a [`new`](Self::new) class
    /// whose disk time in flight is bounded, when the dispatcher is built, to its latency goal
    /// divided by [`BACKGROUND_GOAL_DIVISOR`](Self::BACKGROUND_GOAL_DIVISOR) (unless
    /// [`with_max_in_flight`](Self::with_max_in_flight) sets a bound of its own).
    ///
    /// Why: a foreground read dispatched now still waits in the device behind the writes
    /// already there. The bound keeps those few and small (a
    /// [`ThrottledFile`](crate::disk::ThrottledFile) cuts the class's requests into pieces
    /// within it), at the cost of the background's bandwidth when the disk is idle. This is
    /// the recommended configuration for every class that is not on a request's path.
    ///
    /// ```
    /// use std::time::Duration;
    /// use iothrottle::dispatcher::{ClassConfig, Dispatcher, DiskModel, Figures};
    ///
    /// let dispatcher = Dispatcher::builder()
    ///     .shards(1)
    ///     .disk(DiskModel::symmetric(Figures { iops: 20_000, bandwidth: 200_000_000 }))
    ///     .latency_goal(Duration::from_micros(800))
    ///     .class(ClassConfig::new("query", 800))
    ///     .class(ClassConfig::background("compaction", 200))
    ///     .build()?;
    /// let compaction = dispatcher.class_id("compaction").expect("configured above");
    /// let bound = dispatcher.class_config(compaction).and_then(|c| c.max_in_flight());
    /// assert_eq!(bound, Some(Duration::from_micros(50)));
    /// # Ok::<(), iothrottle::BuildError>(())
    /// ```
    pub fn background(name: impl Into<String>, shares: u32) -> Self {
        ClassConfig {
            background: true,
            ..Self::new(name, shares)
        }
    }

    /// Caps the class at `cap` bytes, whatever its shares (a per-class token bucket of bytes,
    /// shared by all shards, with a burst of 100 ms of the cap). The same [`Rate`] as
    /// [`Dispatcher::set_bandwidth_cap`](super::Dispatcher::set_bandwidth_cap) takes.
    pub fn with_bandwidth_cap(mut self, cap: Rate) -> Self {
        self.bandwidth_cap = Some(cap);
        self
    }

    /// Puts the class in a [`Priority`] tier (default [`Priority::Normal`]).
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Protects the class's p99 latency (submission to completion of its futures): the
    /// dispatcher serves it in the high tier and lowers the other classes' share of the disk
    /// while the target is missed, giving it back while it is met (latency-target mode; no disk
    /// speed needs to be configured). See the module documentation.
    pub fn with_latency_target(mut self, p99: Duration) -> Self {
        self.latency_target = Some(p99);
        self
    }

    /// Bounds the class's disk time in flight: the requests of this class reserved or running
    /// (dispatched, their futures not yet completed), on all shards together, cost at most
    /// `disk_time` (in the disk model's tokens, one per nanosecond). A request that would go past
    /// the bound waits for the class's completions; one request alone always goes, whatever
    /// its cost, so a bound below one request's cost serialises the class instead of stalling
    /// it.
    ///
    /// This is what keeps a latency goal for the *other* classes when the disk stalls this
    /// one's requests: in capped mode the dispatcher's whole goal is shared by what is in
    /// flight, and without a bound, stalled background writes can hold all of it, so a new
    /// foreground read waits for them to complete. With the background bounded to a part of
    /// the goal, the rest stays free for the foreground.
    pub fn with_max_in_flight(mut self, disk_time: Duration) -> Self {
        self.max_in_flight = Some(disk_time);
        self
    }

    /// The bound on the class's disk time in flight, if any. A [background](Self::background)
    /// class without a bound of its own gets one from the goal when the dispatcher is built:
    /// `None` here before, the bound in
    /// [`Dispatcher::class_config`](super::Dispatcher::class_config).
    pub fn max_in_flight(&self) -> Option<Duration> {
        self.max_in_flight
    }

    /// Whether the class was made with [`background`](Self::background).
    pub fn is_background(&self) -> bool {
        self.background
    }

    /// The class as the dispatcher of latency goal `goal` runs it: a background class without
    /// a bound of its own bounded to `goal / BACKGROUND_GOAL_DIVISOR` (at least 1 ns).
    pub(crate) fn resolved(&self, goal: Duration) -> ClassConfig {
        let mut c = self.clone();
        if c.background && c.max_in_flight.is_none() {
            let bound = goal / Self::BACKGROUND_GOAL_DIVISOR;
            c.max_in_flight = Some(bound.max(Duration::from_nanos(1)));
        }
        c
    }

    /// The p99 latency target, if any.
    pub fn latency_target(&self) -> Option<Duration> {
        self.latency_target
    }

    /// The class's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The class's shares.
    pub fn shares(&self) -> u32 {
        self.shares
    }

    /// The bandwidth cap, in bytes.
    pub fn bandwidth_cap(&self) -> Option<Rate> {
        self.bandwidth_cap
    }

    /// The class's tier.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        check_shares(&self.name, self.shares)?;
        if matches!(self.bandwidth_cap, Some(cap) if cap.tokens() == 0) {
            return Err(BuildError::ZeroBandwidthCap {
                class: self.name.clone(),
            });
        }
        if self.latency_target == Some(Duration::ZERO) {
            return Err(BuildError::ZeroLatencyTarget {
                class: self.name.clone(),
            });
        }
        if self.max_in_flight == Some(Duration::ZERO) {
            return Err(BuildError::ZeroInFlightBound {
                class: self.name.clone(),
            });
        }
        Ok(())
    }
}

pub(crate) fn check_shares(class: &str, shares: u32) -> Result<(), BuildError> {
    if (1..=ClassConfig::MAX_SHARES).contains(&shares) {
        Ok(())
    } else {
        Err(BuildError::SharesOutOfRange {
            class: class.to_owned(),
            shares,
        })
    }
}

/// A cap bucket for `rate` bytes per period: a burst of 100 ms of the cap, replenished in
/// steps of 1 ms.
pub(crate) fn cap_bucket(rate: Rate, clock: &ArcClock) -> Result<CapBucket, crate::ConfigError> {
    rate.validate()?;
    let limit = u64::try_from(rate.tokens_in(Duration::from_millis(100)))
        .unwrap_or(BucketConfig::MAX_LIMIT)
        .clamp(1, BucketConfig::MAX_LIMIT);
    let threshold = u64::try_from(rate.tokens_in(Duration::from_millis(1)))
        .unwrap_or(limit)
        .clamp(1, limit);
    let cfg = BucketConfig::new(rate, limit).with_threshold(threshold);
    SharedTokenBucket::with_clock(cfg, clock.clone())
}

/// The cap bucket that replaces `old` for a cap of `rate`: `None` when `rate` is the cap `old`
/// already has (re-applying a cap changes nothing). Otherwise a bucket for the new rate that
/// holds what `old` held now (counted up to now at the old rate, at most the new burst): a
/// changed cap carries the class's recent use over instead of starting with a full burst on
/// top of it. Without an old cap, a new one starts full (as at build).
pub(crate) fn next_cap_bucket(
    rate: Rate,
    clock: &ArcClock,
    old: Option<&CapBucket>,
) -> Result<Option<CapBucket>, crate::ConfigError> {
    let fresh = cap_bucket(rate, clock)?;
    let Some(old) = old else {
        return Ok(Some(fresh));
    };
    if old.rate().cmp_rate(&rate).is_eq() {
        return Ok(None);
    }
    old.replenish();
    let held = old.available().min(fresh.limit());
    let state = crate::bucket::BucketState {
        tail: 0,
        head: held,
        ceil: None,
    };
    SharedTokenBucket::from_state(fresh.config(), clock.clone(), state).map(Some)
}

/// One class's shared state.
pub(crate) struct ClassShared {
    /// The configuration as built (name and tier are fixed; shares and cap may change since:
    /// see [`Classes::config`]).
    pub(crate) config: ClassConfig,
    /// The bandwidth cap. Shards keep their own copy of the `Arc`, refreshed when the
    /// dispatcher's control generation changes, so the lock is off the hot path.
    cap: RwLock<Option<Arc<CapBucket>>>,
    /// Tokens of this class reserved or running, all shards together, when the class has a
    /// bound (see [`ClassConfig::with_max_in_flight`]).
    in_flight: Option<InFlightBound>,
}

impl fmt::Debug for ClassShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassShared")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// All classes' shared state, and the fairness rules over it.
#[derive(Debug)]
pub(crate) struct Classes {
    classes: Box<[ClassShared]>,
    fair: Fairness,
    /// Latency-target mode, when a class has a target.
    latency: Option<LatencyControl>,
    /// Per class: requests submitted and not yet dispatched (in a shard's channel, queue or
    /// reservation), all shards together. Zero means nothing of the class waits anywhere, the
    /// first condition of a dispatch from the caller's thread.
    queued: Box<[CachePadded<AtomicU64>]>,
}

impl Classes {
    /// The classes, each allowed to run `window_tokens` (converted to its own virtual time)
    /// ahead of the slowest backlogged class, and to keep `idle_credit_tokens` of credit.
    pub(crate) fn new(
        configs: Vec<ClassConfig>,
        shards: usize,
        (window_tokens, idle_credit_tokens): (u64, u64),
        rate: Rate,
        clock: &ArcClock,
    ) -> Result<Self, BuildError> {
        let mut classes = Vec::with_capacity(configs.len());
        for config in configs {
            config.validate()?;
            let cap = match config.bandwidth_cap {
                None => None,
                Some(cap) => Some(Arc::new(cap_bucket(cap, clock)?)),
            };
            let in_flight = config
                .max_in_flight
                .map(|d| InFlightBound::new(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)));
            classes.push(ClassShared {
                config,
                cap: RwLock::new(cap),
                in_flight,
            });
        }
        let specs: Vec<_> = classes
            .iter()
            .map(|c| {
                let high = c.config.priority == Priority::High || c.config.latency_target.is_some();
                (c.config.shares, high)
            })
            .collect();
        let targets = classes.iter().map(|c| c.config.latency_target).collect();
        Ok(Classes {
            queued: (0..classes.len())
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            fair: Fairness::new(&specs, shards, window_tokens, idle_credit_tokens),
            latency: LatencyControl::new(targets, rate, clock)?,
            classes: classes.into_boxed_slice(),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.classes.len()
    }

    pub(crate) fn get(&self, class: usize) -> &ClassShared {
        &self.classes[class]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &ClassShared> {
        self.classes.iter()
    }

    /// The class's configuration now (current shares and cap).
    pub(crate) fn config(&self, class: usize) -> ClassConfig {
        let mut config = self.classes[class].config.clone();
        config.shares = self.shares(class);
        config.bandwidth_cap = self.cap(class).map(|c| c.rate());
        config
    }

    /// Tests: the fairness counters.
    #[cfg(test)]
    pub(crate) fn fair(&self) -> &Fairness {
        &self.fair
    }

    /// The class's current shares.
    pub(crate) fn shares(&self, class: usize) -> u32 {
        u32::try_from(self.fair.shares(class)).unwrap_or(ClassConfig::MAX_SHARES)
    }

    /// Changes the class's shares (checked by the caller).
    pub(crate) fn set_shares(&self, class: usize, shares: u32) {
        self.fair.set_shares(class, shares);
    }

    /// The class's cap bucket now.
    pub(crate) fn cap(&self, class: usize) -> Option<Arc<CapBucket>> {
        match self.classes[class].cap.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replaces the class's cap bucket.
    #[cfg(test)]
    pub(crate) fn set_cap(&self, class: usize, cap: Option<Arc<CapBucket>>) {
        self.update_cap(class, |_| Ok::<_, ()>(Some(cap))).ok();
    }

    /// Replaces the class's cap bucket with what `next` makes of the current one (`None`: keep
    /// it), under the lock, so that concurrent changes each start from the other's result.
    /// Returns whether it changed.
    pub(crate) fn update_cap<E>(
        &self,
        class: usize,
        next: impl FnOnce(Option<&CapBucket>) -> Result<Option<Option<Arc<CapBucket>>>, E>,
    ) -> Result<bool, E> {
        let mut guard = match self.classes[class].cap.write() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        match next(guard.as_deref())? {
            Some(cap) => {
                *guard = cap;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The class's virtual time.
    pub(crate) fn vtime(&self, class: usize) -> u64 {
        self.fair.vtime(class)
    }

    /// Latency-target mode, when a class has a target.
    pub(crate) fn latency(&self) -> Option<&LatencyControl> {
        self.latency.as_ref()
    }

    /// `true` for a class of the high tier.
    pub(crate) fn is_high(&self, class: usize) -> bool {
        self.fair.is_high(class)
    }

    /// Charges `tokens` reserved by `shard` for `class`.
    pub(crate) fn charge(&self, class: usize, shard: usize, tokens: u64) {
        self.fair.charge(class, shard, tokens);
    }

    /// See [`Fairness::activate`].
    pub(crate) fn activate(&self, class: usize, shard: usize) {
        self.fair.activate(class, shard);
    }

    /// See [`Fairness::deactivate`].
    pub(crate) fn deactivate(&self, class: usize, shard: usize) {
        self.fair.deactivate(class, shard);
    }

    /// See [`Fairness::cap_waiting`].
    pub(crate) fn cap_waiting(&self, class: usize, waiting: bool) {
        self.fair.cap_waiting(class, waiting);
    }

    /// Counts `cost` more tokens of `class` in flight if its bound allows it (always when
    /// nothing of the class is in flight, and always for a class without a bound); `false`
    /// when the request must wait for the class's completions.
    pub(crate) fn try_start(&self, class: usize, cost: u64) -> bool {
        match &self.classes[class].in_flight {
            Some(b) => b.try_start(cost),
            None => true,
        }
    }

    /// `cost` tokens of `class` counted by [`try_start`](Self::try_start) completed or were
    /// given back; `true` when the class has a bound (its waiting requests may go now).
    pub(crate) fn finish(&self, class: usize, cost: u64) -> bool {
        match self.classes.get(class).and_then(|c| c.in_flight.as_ref()) {
            Some(b) => {
                b.finish(cost);
                true
            }
            None => false,
        }
    }

    /// One more request of `class` waits (submitted, not yet dispatched).
    pub(crate) fn queued_add(&self, class: usize) {
        // AcqRel: one counter, one modification order; a request is counted on its way in
        // (send, then queue) before it is uncounted from the channel, so the count never reads
        // zero while it waits.
        self.queued[class].fetch_add(1, Ordering::AcqRel);
    }

    /// A request of `class` no longer waits (dispatched, cancelled, or failed).
    pub(crate) fn queued_sub(&self, class: usize) {
        // AcqRel: see `queued_add`.
        self.queued[class].fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether any request of `class` waits anywhere.
    pub(crate) fn any_queued(&self, class: usize) -> bool {
        // Acquire: pairs with the AcqRel updates (an advisory count, see `queued_add`).
        self.queued[class].load(Ordering::Acquire) != 0
    }

    /// Whether `class` has a bandwidth cap now.
    pub(crate) fn has_cap(&self, class: usize) -> bool {
        match self.classes[class].cap.read() {
            Ok(c) => c.is_some(),
            Err(poisoned) => poisoned.into_inner().is_some(),
        }
    }

    /// Tests: the tokens of `class` in flight now.
    #[cfg(test)]
    pub(crate) fn in_flight(&self, class: usize) -> u64 {
        self.classes[class]
            .in_flight
            .as_ref()
            .map_or(0, InFlightBound::in_flight)
    }

    /// See [`Fairness::may_go_now`].
    pub(crate) fn may_go_now(&self, class: usize, shard: usize) -> Result<(), Ahead> {
        self.fair.may_go_now(class, shard)
    }

    /// Whether no class with requests waiting is behind `class` in virtual time (see
    /// [`Fairness::first_among`]).
    pub(crate) fn first_among_waiting(&self, class: usize) -> bool {
        self.fair.first_among(class, |o| self.any_queued(o))
    }

    /// See [`Fairness::may_reserve`].
    pub(crate) fn may_reserve(&self, class: usize, shard: usize) -> Result<(), Ahead> {
        self.fair.may_reserve(class, shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    /// A goal too short to divide still leaves a background class a valid bound (1 ns: one
    /// request at a time), never the zero bound `validate` refuses.
    #[test]
    fn a_background_bound_is_never_zero() {
        let bg = ClassConfig::background("bg", 1);
        for (goal, bound) in [(1, 1), (15, 1), (16, 1), (33, 2), (750_000, 46_875)] {
            let c = bg.resolved(Duration::from_nanos(goal));
            assert_eq!(
                c.max_in_flight(),
                Some(Duration::from_nanos(bound)),
                "goal {goal} ns"
            );
            assert!(c.validate().is_ok());
        }
        let plain = ClassConfig::new("fg", 1).resolved(Duration::from_nanos(750_000));
        assert_eq!(plain.max_in_flight(), None);
    }

    #[test]
    fn shares_are_checked() {
        let clock: ArcClock = Arc::new(ManualClock::new());
        for bad in [0, 1001] {
            let err = Classes::new(
                vec![ClassConfig::new("x", bad)],
                1,
                (1, 1),
                Rate::per_second(1),
                &clock,
            )
            .unwrap_err();
            assert!(matches!(err, BuildError::SharesOutOfRange { shares, .. } if shares == bad));
        }
        let err = Classes::new(
            vec![ClassConfig::new("x", 1).with_bandwidth_cap(Rate::per_second(0))],
            1,
            (1, 1),
            Rate::per_second(1000),
            &clock,
        )
        .unwrap_err();
        assert!(matches!(err, BuildError::ZeroBandwidthCap { .. }));
    }

    #[test]
    fn the_current_configuration_follows_changes() {
        let clock: ArcClock = Arc::new(ManualClock::new());
        let c = Classes::new(
            vec![ClassConfig::new("x", 10).with_bandwidth_cap(Rate::per_second(1 << 20))],
            1,
            (1, 1),
            Rate::per_second(1000),
            &clock,
        )
        .unwrap();
        assert_eq!(c.config(0).bandwidth_cap(), Some(Rate::per_second(1 << 20)));
        c.set_shares(0, 20);
        c.set_cap(0, None);
        assert_eq!(c.config(0).shares(), 20);
        assert_eq!(c.config(0).bandwidth_cap(), None);
        assert_eq!(c.get(0).config.shares(), 10);
    }
}
