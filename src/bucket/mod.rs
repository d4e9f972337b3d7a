//! The shared token bucket: [`SharedTokenBucket`] and its configuration.
//!
//! This is the only lock-free core of the crate; everything else (the async throttle, the
//! dispatcher, the checkpoints) is built on it and it uses nothing of theirs. The design, its
//! invariants and the orderings are described in `docs/design.md`, included below.
#![doc = include_str!("../../docs/design.md")]

pub(crate) mod error;
mod give_back;
mod mode;
pub(crate) mod price;
mod rate;
mod rate_cell;
mod rovers;
#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
mod shm;

use std::fmt;
use std::time::Duration;

pub use mode::{Capped, Mode, Uncapped};
pub use rate::Rate;

#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
use crate::clock::SystemMonotonicClock;
use crate::clock::{Clock, MonotonicClock};
use error::ConfigError;
#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
use error::ShmError;
use give_back::GiveBacks;
use price::PriceCache;
use rovers::{Rovers, MAX_TIMESTAMP};

/// How far rover `a` is in front of rover `b`: the wrapping signed difference that every
/// comparison of rovers (and of other wrapping counters, such as virtual times) goes through.
pub(crate) use rovers::ahead;

/// What a bucket is made from: a rate, a limit and a replenish threshold.
///
/// `Copy`, checked when a bucket is built from it.
///
/// ```
/// use iothrottle::{BucketConfig, Rate};
///
/// let cfg = BucketConfig::new(Rate::per_second(1_000), 100).with_threshold(10);
/// assert_eq!(cfg.limit(), 100);
/// assert!(BucketConfig::new(Rate::per_second(1_000), 100).with_threshold(101).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BucketConfig {
    rate: Rate,
    limit: u64,
    threshold: u64,
}

impl BucketConfig {
    /// The largest limit: 2^62 tokens, so that a full bucket plus a queue of claimed tokens as
    /// large again stays within the 2^63 that wrapping comparisons allow.
    pub const MAX_LIMIT: u64 = 1 << 62;

    /// `rate`, and at most `limit` tokens in the bucket. The threshold defaults to 1.
    pub const fn new(rate: Rate, limit: u64) -> Self {
        BucketConfig {
            rate,
            limit,
            threshold: 1,
        }
    }

    /// A replenish that would add fewer than `threshold` tokens does nothing and lets the time
    /// keep accruing (saves the CAS when replenish is called very often). Must be in
    /// `1..=limit`.
    pub const fn with_threshold(mut self, threshold: u64) -> Self {
        self.threshold = threshold;
        self
    }

    /// The rate.
    pub const fn rate(&self) -> Rate {
        self.rate
    }

    /// The most tokens the bucket can hold.
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// The replenish threshold.
    pub const fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Checks the configuration; every problem is a [`ConfigError`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.rate.validate()?;
        if self.limit == 0 {
            return Err(ConfigError::ZeroLimit);
        }
        if self.limit > Self::MAX_LIMIT {
            return Err(ConfigError::LimitTooLarge {
                limit: self.limit,
                max: Self::MAX_LIMIT,
            });
        }
        if self.threshold == 0 || self.threshold > self.limit {
            return Err(ConfigError::ThresholdOutOfRange {
                threshold: self.threshold,
                limit: self.limit,
            });
        }
        Ok(())
    }
}

/// The rovers' positions, as saved by [`SharedTokenBucket::snapshot`] and restored by
/// [`SharedTokenBucket::from_state`].
///
/// Positions are absolute and wrap: only differences mean something.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BucketState {
    /// Tokens ever claimed (wrapping).
    pub tail: u64,
    /// Tokens ever made available (wrapping).
    pub head: u64,
    /// Capped mode: how far `head` may go. `None` for an uncapped bucket.
    pub ceil: Option<u64>,
}

impl BucketState {
    /// Tokens in the bucket (positive) or owed to waiters (negative): `head - tail`.
    pub fn tokens(&self) -> i64 {
        ahead(self.head, self.tail)
    }
}

/// A token bucket shared by threads without locks: claim with [`grab`](Self::grab), check with
/// [`deficiency`](Self::deficiency), refill with [`replenish`](Self::replenish).
///
/// Three rovers only move forward: `tail` (claimed), `head` (made available) and, in
/// [`Capped`] mode, `ceil` (completions). A grab never fails and never blocks: it takes a place
/// in line, and the caller waits until `deficiency` of that place is zero. Waiting is the
/// caller's business (the async `Throttle` does it without blocking a thread).
///
/// Tokens are issued exactly: from the bucket's epoch (its creation, restore or last rate
/// change) to any replenish at `t`, the tokens added plus the tokens discarded by the cap equal
/// `floor(rate × (t − epoch))`, over any sequence of replenishes; a rate change counts the time
/// before it at the old rate. Replenish is lock-free.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::{BucketConfig, ManualClock, Rate, SharedTokenBucket, Uncapped};
///
/// let clock = ManualClock::new();
/// let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
/// let bucket = SharedTokenBucket::<Uncapped, _>::with_clock(cfg, clock.clone())?;
/// bucket.replenish(); // the first replenish fills the bucket
/// let mine = bucket.grab(150); // more than there is: 50 are owed
/// assert_eq!(bucket.deficiency(mine), 50);
/// assert_eq!(bucket.duration_for(50), Duration::from_millis(50));
/// clock.advance(Duration::from_millis(50));
/// bucket.replenish();
/// assert_eq!(bucket.deficiency(mine), 0);
/// # Ok::<(), iothrottle::ConfigError>(())
/// ```
///
/// # Memory ordering
///
/// The rovers are counters, not locks: seeing `deficiency(t) == 0` does not make other threads'
/// memory writes visible beyond the bucket's own state. Use your own synchronisation for data.
pub struct SharedTokenBucket<M: Mode = Uncapped, C: Clock = MonotonicClock> {
    rovers: Home<M>,
    clock: C,
    /// Claims given back before `head` reached them ([`give_back`](Self::give_back)).
    give_backs: GiveBacks,
    /// The current rate as the common replenish prices with it, kept by this process (a
    /// bucket in shared memory too: each process has its own).
    price: PriceCache,
}

/// Where the rovers live: in the bucket, or in a file mapped by several processes. Every
/// method of the bucket works on either through `Deref`.
#[derive(Debug)]
// The in-process rovers stay inline: boxing them would add a pointer chase to every grab.
#[allow(clippy::large_enum_variant)]
enum Home<M: Mode> {
    Local(Rovers<M>),
    #[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
    Mapped(shm::Mapped<M>),
}

impl<M: Mode> std::ops::Deref for Home<M> {
    type Target = Rovers<M>;

    #[inline(always)]
    fn deref(&self) -> &Rovers<M> {
        match self {
            Home::Local(r) => r,
            #[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
            Home::Mapped(m) => m.rovers(),
        }
    }
}

impl<M: Mode> SharedTokenBucket<M, MonotonicClock> {
    /// A bucket on a new [`MonotonicClock`]. Empty until the first [`replenish`](Self::replenish),
    /// which fills it to the limit.
    pub fn new(config: BucketConfig) -> Result<Self, ConfigError> {
        Self::with_clock(config, MonotonicClock::new())
    }
}

impl<M: Mode, C: Clock> SharedTokenBucket<M, C> {
    /// A bucket reading time from `clock`. Empty until the first
    /// [`replenish`](Self::replenish), which fills it to the limit.
    pub fn with_clock(config: BucketConfig, clock: C) -> Result<Self, ConfigError> {
        config.validate()?;
        let rate = config.rate.raw()?;
        let now = timestamp(clock.now());
        Ok(SharedTokenBucket {
            rovers: Home::Local(Rovers::new(rate, config.limit, config.threshold, 0, now)),
            clock,
            give_backs: GiveBacks::new(),
            price: PriceCache::new(),
        })
    }

    /// A bucket at saved positions, as if replenished now: time accrues from now on.
    ///
    /// The state must be one this configuration allows: no more than `limit` tokens, a deficit
    /// below 2^62, and in capped mode a `ceil` that `head` has not passed (and no `ceil` for an
    /// uncapped bucket). Checkpoints use this after computing what the downtime earned.
    pub fn from_state(
        config: BucketConfig,
        clock: C,
        state: BucketState,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let tokens = state.tokens();
        if tokens > config.limit as i64 {
            return Err(ConfigError::InvalidState {
                reason: "more tokens than the limit",
            });
        }
        if tokens < -(BucketConfig::MAX_LIMIT as i64) {
            return Err(ConfigError::InvalidState {
                reason: "a deficit of 2^62 tokens or more",
            });
        }
        let ceil = match (M::CAPPED, state.ceil) {
            (true, Some(ceil)) if ahead(state.head, ceil) <= 0 => ceil,
            (true, Some(_)) => {
                return Err(ConfigError::InvalidState {
                    reason: "head is past ceil",
                })
            }
            (true, None) => {
                return Err(ConfigError::InvalidState {
                    reason: "a capped bucket needs a ceil",
                })
            }
            (false, Some(_)) => {
                return Err(ConfigError::InvalidState {
                    reason: "an uncapped bucket has no ceil",
                })
            }
            (false, None) => 0,
        };
        let rate = config.rate.raw()?;
        let now = timestamp(clock.now());
        Ok(SharedTokenBucket {
            rovers: Home::Local(Rovers::restored(
                rate,
                config.limit,
                config.threshold,
                (state.tail, state.head, ceil),
                now,
            )),
            clock,
            give_backs: GiveBacks::new(),
            price: PriceCache::new(),
        })
    }

    /// Opens the bucket kept in the file at `path`, shared by every process that opens it,
    /// creating it if there is none (feature `shm`, Unix). Time comes from `clock`, which must
    /// read `CLOCK_MONOTONIC` since boot, like [`SystemMonotonicClock`] (the default of
    /// [`open`](SharedTokenBucket::open)); the dispatcher wants it as an `Arc<dyn Clock>`.
    ///
    /// Every process that opens the same path with the same configuration (mode, limit,
    /// threshold and rate) shares one bucket: one set of rovers and one rate, which
    /// [`set_rate`](Self::set_rate) changes for all of them. A file that is not a bucket, is
    /// cut short, has another layout version or comes from another boot, or a different
    /// configuration, is a [`ShmError`] naming the problem. Creation is race-free: the file
    /// appears at `path` whole (written under a temporary name in the same directory, then
    /// linked). See `docs/shared-memory.md` for what to put the file on, and the limits.
    ///
    /// ```
    /// # #[cfg(all(feature = "shm", target_os = "linux"))] {
    /// use iothrottle::{BucketConfig, Rate, SharedMemoryBucket, ShmError, Uncapped};
    ///
    /// let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("disk0.bucket");
    /// let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
    /// let a = SharedMemoryBucket::<Uncapped>::open(&path, cfg)?;
    /// let b = SharedMemoryBucket::<Uncapped>::open(&path, cfg)?; // another process, as well
    /// a.grab(30);
    /// assert_eq!(b.snapshot().tail, 30); // one set of rovers
    /// let other = BucketConfig::new(Rate::per_second(1_000), 200);
    /// let err = SharedMemoryBucket::<Uncapped>::open(&path, other).unwrap_err();
    /// assert!(matches!(err, ShmError::Incompatible { setting: "limit", .. }));
    /// # }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
    #[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
    pub fn open_with_clock(
        path: impl AsRef<std::path::Path>,
        config: BucketConfig,
        clock: C,
    ) -> Result<Self, ShmError> {
        let now = timestamp(clock.now());
        let mapped = shm::open::<M>(path.as_ref(), &config, now)?;
        Ok(SharedTokenBucket {
            rovers: Home::Mapped(mapped),
            clock,
            // Deferred give-backs stay with this process: a claim it gives back is applied
            // when this process next sees `head` reach it (its refunds and replenishes).
            give_backs: GiveBacks::new(),
            price: PriceCache::new(),
        })
    }

    /// The file the bucket lives in, if it is shared through memory
    /// ([`open`](SharedTokenBucket::open)); `None` for a bucket of this process.
    #[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
    #[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
    pub fn shared_path(&self) -> Option<&std::path::Path> {
        match &self.rovers {
            Home::Local(_) => None,
            Home::Mapped(m) => Some(m.path()),
        }
    }

    /// Claims `n` tokens and returns the new tail: the tokens are there once
    /// `deficiency(tail) == 0`. Never fails, never blocks.
    ///
    /// A claim is met once `head` reaches the returned position. The bucket never holds more
    /// than `limit` tokens, so a claim of `n > limit` behaves according to the mode:
    ///
    /// - [`Uncapped`]: it is met by queueing. `tail` moves past `head` (a deficit), replenishes
    ///   pay the queue at the rate, and the claim is met once the claims before it are paid
    ///   and `n` minus what was in the bucket has accrued (`duration_for` of that). Claims
    ///   behind it wait that much longer.
    /// - [`Capped`]: it is not met by completions. `head` never passes `ceil`, which is at most
    ///   `limit` ahead of the work that completed; the work before the claim can complete, but
    ///   the claim needs `head` more than `limit` past where that work ends. It waits (and every
    ///   later claim waits behind it) until tokens are refunded or released for work that never
    ///   ran.
    ///
    /// Split claims above [`limit`](Self::limit), or refuse them (the async layers return a
    /// typed error). Claims must stay below 2^62 tokens in total ahead of `head`, or the
    /// wrapping comparisons break.
    #[inline]
    pub fn grab(&self, n: u64) -> u64 {
        self.rovers.grab(n)
    }

    /// How many tokens up to position `tail` are not there yet; 0 means they are all there.
    #[inline]
    pub fn deficiency(&self, tail: u64) -> u64 {
        self.rovers.deficiency(tail)
    }

    /// Tokens in the bucket now, 0 when waiters are owed tokens. A snapshot.
    pub fn available(&self) -> u64 {
        self.rovers.available()
    }

    /// Adds the tokens earned since the last replenish, reading the bucket's clock. Returns how
    /// many were added.
    ///
    /// The first call fills the bucket to the limit. Adds nothing when fewer than the threshold
    /// were earned (the time keeps accruing), when another thread moved the replenish time
    /// meanwhile (its replenish covers the same time), when the clock reads no later than the
    /// last replenish (a clock that went backwards changes nothing), or when the bucket is full
    /// (tokens over the limit are discarded).
    ///
    /// Lock-free: a thread stalled inside `replenish` delays only the tokens of the interval it
    /// claimed; every other replenish proceeds. Between `t₀` (the bucket's creation, restore or
    /// last rate change) and any replenish at `t`, the tokens issued (added plus discarded) are
    /// exactly `floor(rate × (t − t₀))`.
    #[inline]
    pub fn replenish(&self) -> u64 {
        self.replenish_ns(self.clock.now_nanos().min(MAX_TIMESTAMP))
    }

    #[inline]
    fn replenish_ns(&self, now: u64) -> u64 {
        #[cfg(all(feature = "shm-test-hooks", unix, not(iothrottle_loom)))]
        if let Home::Mapped(m) = &self.rovers {
            return shm::hooks::replenish(m.rovers(), now, &self.price);
        }
        self.rovers.replenish(now, &self.price)
    }

    /// [`replenish`](Self::replenish) at a time the caller already read from the bucket's clock
    /// (saves a clock read on a hot path).
    ///
    /// Any `Duration` is accepted: a reading not after the last replenish does nothing, and
    /// readings beyond 2^63 − 2 ns (about 292 years after the clock's origin) count as that
    /// time.
    #[inline]
    pub fn replenish_at(&self, now: Duration) -> u64 {
        self.replenish_ns(timestamp(now))
    }

    /// The loom models only: the first half of a replenish at `now` (the CAS on the replenish
    /// time), returning the tokens claimed; [`loom_fill`](Self::loom_fill) adds them. Lets a
    /// model stall a replenisher between the two halves.
    #[cfg(all(test, iothrottle_loom))]
    pub(crate) fn loom_claim_at(&self, now: Duration) -> Option<u128> {
        self.rovers.claim(timestamp(now), &self.price)
    }

    /// The loom models only: the second half of a replenish (see `loom_claim_at`).
    #[cfg(all(test, iothrottle_loom))]
    pub(crate) fn loom_fill(&self, extra: u128) -> u64 {
        self.rovers.fill(extra)
    }

    /// The loom models only: [`set_rate`](Self::set_rate) at `now`, returning the tokens it added
    /// when it closed the old rate's interval.
    #[cfg(all(test, iothrottle_loom))]
    pub(crate) fn loom_set_rate_at(&self, rate: Rate, now: Duration) -> u64 {
        self.rovers.set_rate(rate.raw().unwrap(), timestamp(now))
    }

    /// The loom models only: [`set_rate`](Self::set_rate) at `now` by a participant that stops
    /// for ever at step `stop_at` (0: holding a ticket, 1..=12: after that many words of its
    /// record, 13: published but not closed), or completes if it never gets there. Returns
    /// what it added, `None` if it stopped.
    #[cfg(all(test, iothrottle_loom))]
    pub(crate) fn loom_set_rate_stopping_at(
        &self,
        rate: Rate,
        now: Duration,
        stop_at: u32,
    ) -> Option<u64> {
        self.rovers
            .set_rate_stopping(rate.raw().unwrap(), timestamp(now), &|step| {
                rate_cell::step_code(step) == stop_at
            })
    }

    /// Gives back `n` grabbed-but-unused tokens; returns how many fitted (the rest would have
    /// overfilled the bucket and is discarded). For tokens that were there (a claim met, then
    /// not used); a claim that may still be waiting goes back through
    /// [`give_back`](Self::give_back).
    ///
    /// In capped mode the refunded tokens also advance `ceil`: unused tokens were never in
    /// flight, so they must not hold back the cap. Deferred give-backs that `head` reaches are
    /// applied as well.
    pub fn refund(&self, n: u64) -> u64 {
        let fitted = self.rovers.refund(n);
        self.give_backs.after_head_moved(self);
        fitted
    }

    /// Gives back a claim that will never be served: `tail` is what [`grab(n)`](Self::grab)
    /// returned. Returns whether tokens went back into the bucket now.
    ///
    /// If `head` has reached the claim's start, its tokens are refunded now: the claims behind
    /// it move up. Otherwise claims in front of it are still waiting, and refunding now would
    /// serve them early; the give-back is deferred until `head` reaches the claim's start, and
    /// then applied by whoever moves `head` there: a [`refund`](Self::refund), another give-back,
    /// or [`settle_give_backs`](Self::settle_give_backs) after a replenish (the async and
    /// blocking throttles call it after theirs). The effect is exactly as if the claim had never
    /// been made, whoever on the bucket made it and whatever becomes of them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use iothrottle::{BucketConfig, ManualClock, Rate, SharedTokenBucket, Uncapped};
    ///
    /// let clock = ManualClock::new();
    /// let cfg = BucketConfig::new(Rate::per_second(1), 10);
    /// let bucket = SharedTokenBucket::<Uncapped, _>::with_clock(cfg, clock.clone())?;
    /// bucket.replenish(); // 10 tokens
    /// bucket.grab(10); // taken
    /// let waiting = bucket.grab(10); // waits for 10 more
    /// let cancelled = bucket.grab(10); // behind it
    /// assert!(!bucket.give_back(cancelled, 10)); // deferred: `waiting` is not served early
    /// assert_eq!(bucket.deficiency(waiting), 10);
    /// clock.advance(Duration::from_secs(10));
    /// bucket.replenish(); // `head` reaches `waiting`, and the cancelled claim's start...
    /// assert!(bucket.settle_give_backs()); // ...so its tokens go back
    /// assert_eq!(bucket.deficiency(waiting), 0);
    /// assert_eq!(bucket.deficiency(bucket.grab(5)), 5); // as if it had never been made
    /// # Ok::<(), iothrottle::ConfigError>(())
    /// ```
    pub fn give_back(&self, tail: u64, n: u64) -> bool {
        self.give_backs.give_back(self, tail.wrapping_sub(n), n)
    }

    /// Applies the deferred give-backs that `head` has reached (see
    /// [`give_back`](Self::give_back)); to be called after a replenish by code that shares the
    /// bucket with give-backs. Returns whether tokens went back into the bucket. One fence and
    /// one load when nothing is deferred.
    pub fn settle_give_backs(&self) -> bool {
        self.give_backs.after_head_moved(self)
    }

    /// Claims given back and not applied yet (deferred behind claims still waiting).
    pub fn deferred_give_backs(&self) -> u64 {
        self.give_backs.len()
    }

    /// Reports `n` tokens' worth of completed work, whatever the mode: in [`Capped`] mode this
    /// is [`release`](SharedTokenBucket::release); an [`Uncapped`] bucket does not track
    /// completions and ignores it. For code generic over the mode (permits, dispatchers);
    /// code that knows its bucket is capped should call `release`.
    #[inline]
    pub fn complete(&self, n: u64) {
        self.rovers.release(n)
    }

    /// How long until `n` more tokens accumulate at the current rate, rounded up to the
    /// nanosecond (never zero for `n > 0`).
    pub fn duration_for(&self, n: u64) -> Duration {
        self.rovers.rate().duration_for(n)
    }

    /// Changes the rate from now on. The time since the last replenish is counted at the old
    /// rate and its tokens are added now, even fewer than the threshold (nothing earned is lost
    /// or re-priced); the time after this call is counted at the new rate, from a new epoch.
    ///
    /// Exact for sequential calls: a replenish at `t` after a change at `s` issues
    /// `floor(old × (s − t₀)) + floor(new × (t − s))` in all. Racing replenishes that read the
    /// clock after this call did may still count up to their own reading at the old rate: the
    /// change then takes effect at a clock reading between this call's start and its return.
    ///
    /// Lock-free, against other `set_rate` calls too: a caller stopped for ever at any point
    /// (a thread descheduled, a process killed while sharing the bucket through memory) holds
    /// back no other change and no replenish; the next `set_rate` closes an interval it left
    /// open. Progress is guaranteed while fewer than four callers change the rate at the same
    /// instant (more still proceed unless they keep overtaking each other).
    pub fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        let raw = rate.raw()?;
        let now = timestamp(self.clock.now());
        #[cfg(all(feature = "shm-test-hooks", unix, not(iothrottle_loom)))]
        if let Home::Mapped(m) = &self.rovers {
            shm::hooks::set_rate(m.rovers(), raw, now);
            return Ok(());
        }
        self.rovers.set_rate(raw, now);
        Ok(())
    }

    /// The current rate (as stored: a period longer than `u64` nanoseconds is not accepted).
    pub fn rate(&self) -> Rate {
        self.rovers.rate().to_rate()
    }

    /// The most tokens the bucket holds.
    pub fn limit(&self) -> u64 {
        self.rovers.limit()
    }

    /// The replenish threshold.
    pub fn threshold(&self) -> u64 {
        self.rovers.threshold()
    }

    /// The bucket's configuration, with the current rate.
    pub fn config(&self) -> BucketConfig {
        BucketConfig::new(self.rate(), self.limit()).with_threshold(self.threshold())
    }

    /// The bucket's clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// When the last replenish happened on the bucket's clock; `None` before the first.
    pub fn last_replenish(&self) -> Option<Duration> {
        self.rovers.last_replenish().map(Duration::from_nanos)
    }

    /// The rovers' positions, read one after the other (tail first). Other threads may move
    /// them meanwhile; each value is one the rover really had. Because `head` is read after
    /// `tail`, a snapshot taken while others grab and replenish may show `head - tail` above
    /// the limit (a replenish that followed a grab); with quiescent threads it is exact.
    pub fn snapshot(&self) -> BucketState {
        let (tail, head, ceil) = self.rovers.positions();
        BucketState { tail, head, ceil }
    }
}

/// A [`SharedTokenBucket`] in shared memory on the [`SystemMonotonicClock`], as
/// [`open`](SharedTokenBucket::open) makes it (feature `shm`, Unix):
/// `SharedMemoryBucket::<Uncapped>::open(path, config)`.
///
#[doc = include_str!("../../docs/shared-memory.md")]
#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
pub type SharedMemoryBucket<M = Uncapped> = SharedTokenBucket<M, SystemMonotonicClock>;

#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
impl<M: Mode> SharedTokenBucket<M, SystemMonotonicClock> {
    /// [`open_with_clock`](SharedTokenBucket::open_with_clock) on the
    /// [`SystemMonotonicClock`]: the bucket at `path`, shared by every process that opens it.
    pub fn open(path: impl AsRef<std::path::Path>, config: BucketConfig) -> Result<Self, ShmError> {
        Self::open_with_clock(path, config, SystemMonotonicClock)
    }
}

impl<C: Clock> SharedTokenBucket<Capped, C> {
    /// Reports `n` tokens' worth of completed work: `ceil` advances, and the next replenish may
    /// fill up to it. Only a capped bucket has this method.
    pub fn release(&self, n: u64) {
        self.rovers.release(n)
    }
}

impl<M: Mode, C: Clock> fmt::Debug for SharedTokenBucket<M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.snapshot();
        f.debug_struct("SharedTokenBucket")
            .field("capped", &M::CAPPED)
            .field("rate", &self.rate())
            .field("limit", &self.limit())
            .field("threshold", &self.threshold())
            .field("state", &state)
            .finish()
    }
}

/// A clock reading in the bucket's nanoseconds (time stops about 292 years after the origin).
fn timestamp(now: Duration) -> u64 {
    u64::try_from(now.as_nanos())
        .unwrap_or(u64::MAX)
        .min(MAX_TIMESTAMP)
}

#[cfg(test)]
mod tests;
