//! [`Throttle`]: the async front of a [`SharedTokenBucket`], for any tokio runtime.
//!
//! The long-form description (waiting protocol, cancellation, capped permits) is
//! `docs/throttle.md`, included below; its examples run as doctests.
//!
//! # Orderings
//!
//! The rovers' own orderings are the bucket's (see [`crate::bucket`]). This module adds:
//!
//! - `closed`: stored **SeqCst** by [`Throttle::close`] before `notify_waiters`, loaded **SeqCst**
//!   by a waiter *after* it registered its `Notified`. Either the waiter sees the flag, or its
//!   registration precedes the close in the single SeqCst order and `notify_waiters` wakes it:
//!   no waiter can sleep through a close.
//! - Give-backs of claims that `head` has not reached yet are the bucket's
//!   ([`SharedTokenBucket::give_back`]), shared by every user of the bucket; their handshake
//!   with whoever moves `head` is described (and loom-modelled) there. After each of its
//!   replenishes the throttle calls [`SharedTokenBucket::settle_give_backs`].
//! - `given_back`, `waiting_tokens` and `cancelled` (the [`stats`](Throttle::stats) counters,
//!   slow path only): **Relaxed**, statistics that order nothing.
//! - `waiters`: **Relaxed**. It only decides whether a give-back bothers to call
//!   `notify_waiters`. A missed notification costs latency, never a hang: every sleeping waiter
//!   also has a timer for the time its tokens accrue at the current rate.
#![doc = include_str!("../docs/throttle.md")]

pub(crate) mod error;

use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use tokio::sync::Notify;

use crate::bucket::{ahead, BucketConfig, Mode, Rate, SharedTokenBucket, Uncapped};
use crate::checkpoint::{CheckpointedBucket, MarkGate};
use crate::clock::{Clock, MonotonicClock};
use crate::sync::{AtomicU64, Ordering};
use crate::ConfigError;
use error::{AcquireError, TryAcquireError};

/// An async throttle over a [`SharedTokenBucket`]: `acquire(cost).await` waits, in line, until
/// `cost` tokens are there.
///
/// Cheap to clone (clones share the bucket, the close flag and the waiters). Works on any tokio
/// runtime, multi-thread or current-thread; the futures are `Send`.
///
/// # Invariants
///
/// - **FIFO**: `acquire` claims its place with one `grab` on the bucket; the bucket's `head`
///   only moves forward, so a claim is met only after every earlier claim is met.
/// - **Nothing leaks**: every grabbed token ends either in a [`Permit`] (capped mode: released
///   on drop) or back in the bucket (refunded when the claim is dropped, cancelled, closed or
///   lost a race). A refund never lets anyone ahead of the claim be served early.
/// - **No spinning**: a waiter sleeps on a tokio timer set for the moment its tokens accrue, and
///   is woken early only by [`set_rate`](Self::set_rate), [`close`](Self::close) or a give-back
///   ahead of it.
///
/// ```
/// use iothrottle::throttle::Throttle;
/// use iothrottle::{BucketConfig, Rate, TokioClock, Uncapped};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
/// let throttle = Throttle::<Uncapped, _>::with_clock(cfg, TokioClock::new())?;
/// let start = tokio::time::Instant::now();
/// let _first = throttle.acquire(100).await?; // the full bucket: at once
/// let _second = throttle.acquire(50).await?; // 50 more tokens: 50 ms
/// assert_eq!(start.elapsed(), std::time::Duration::from_millis(50));
/// # Ok(())
/// # }
/// ```
pub struct Throttle<M: Mode = Uncapped, C: Clock = MonotonicClock> {
    shared: Arc<Shared<M, C>>,
}

impl<M: Mode, C: Clock> Clone for Throttle<M, C> {
    fn clone(&self) -> Self {
        Throttle {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// What all clones of one throttle share.
struct Shared<M: Mode, C: Clock> {
    bucket: Arc<SharedTokenBucket<M, C>>,
    /// Woken on close, on a rate change and on give-backs: sleeping waiters recompute.
    changed: Notify,
    /// Claims that entered the slow path and are not finished (decides whether a give-back
    /// notifies).
    waiters: AtomicU64,
    /// 1 once closed.
    closed: AtomicU64,
    /// The checkpoint layer: grabs past its durable mark wait for it.
    gate: Option<Arc<MarkGate>>,
    /// Statistics.
    counters: CachePadded<ThrottleCounters>,
}

/// Statistics, all off the fast path: the granted tokens are derived from the bucket's `tail`.
#[derive(Debug)]
struct ThrottleCounters {
    /// The bucket's `tail` when the throttle was made.
    tail0: u64,
    /// Tokens of claims given back unserved.
    given_back: AtomicU64,
    /// Tokens of claims in the slow path now.
    waiting_tokens: AtomicU64,
    /// Claims given back unserved.
    cancelled: AtomicU64,
}

/// A snapshot of a [`Throttle`]'s counters ([`Throttle::stats`]). Each field is read on its own
/// (relaxed): they are consistent one by one, not with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ThrottleStats {
    /// Tokens granted since the throttle was made: tokens claimed on its bucket since then,
    /// minus those given back unserved and those still waiting. Derived from the bucket's
    /// `tail`, so that the fast path counts nothing: it includes grabs on the same bucket by
    /// others (a shared bucket), and is exact when no `acquire` is between its grab and its
    /// return.
    pub granted_tokens: u64,
    /// `acquire` calls waiting now (past the fast path, not finished).
    pub waiting: u64,
    /// Claims given back unserved: cancelled or failed `acquire`s (dropped, closed) and
    /// `try_acquire`s that lost a race.
    pub cancelled: u64,
}

impl<M: Mode, C: Clock> Shared<M, C> {
    fn is_closed(&self) -> bool {
        // SeqCst: see the module doc (close vs. a waiter registering).
        self.closed.load(Ordering::SeqCst) != 0
    }

    /// Replenishes at `now`, then applies the deferred give-backs that `head` has reached.
    fn replenish_at(&self, now: Duration) {
        self.bucket.replenish_at(now);
        self.after_head_moved();
    }

    /// To be called after `head` may have moved: applies reached give-backs (and wakes the
    /// waiters when it did).
    fn after_head_moved(&self) {
        if self.bucket.settle_give_backs() {
            self.wake_waiters();
        }
    }

    /// Gives back the claim `(start, start + tokens]`, never served (see
    /// [`SharedTokenBucket::give_back`]).
    fn give_back(&self, start: u64, tokens: u64) {
        if tokens == 0 {
            return;
        }
        // Relaxed: statistics.
        self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        self.counters
            .given_back
            .fetch_add(tokens, Ordering::Relaxed);
        if self.bucket.give_back(start.wrapping_add(tokens), tokens) {
            self.wake_waiters();
        }
    }

    /// Refunds `tokens` that were granted and not used: `head` moves, so the waiters behind
    /// may be served now.
    fn refund_unused(&self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        self.bucket.refund(tokens);
        self.wake_waiters();
    }

    fn wake_waiters(&self) {
        // Relaxed: a hint only; see the module doc.
        if self.waiters.load(Ordering::Relaxed) != 0 {
            self.changed.notify_waiters();
        }
    }

    /// How far back a late waiter may replenish: the lateness forgiven, at most
    /// [`MAX_CATCH_UP`] and at most the time a full bucket takes (so the catch-up never adds
    /// more than one more bucketful to a burst).
    fn catch_up(&self) -> Duration {
        self.bucket
            .duration_for(self.bucket.limit())
            .min(MAX_CATCH_UP)
    }

    /// How long from `now` until `missing` more tokens can be added by a replenish: the time
    /// they accrue since the last replenish, and never fewer than the threshold (a replenish
    /// adds nothing below it).
    fn delay_for(&self, missing: u64, now: Duration) -> Duration {
        let need = missing.max(self.bucket.threshold());
        let last = self.bucket.last_replenish().unwrap_or(now);
        let due = last
            .checked_add(self.bucket.duration_for(need))
            .unwrap_or(Duration::MAX);
        due.saturating_sub(now)
    }
}

impl<M: Mode> Throttle<M, MonotonicClock> {
    /// A throttle over a new bucket of mode `M` on a [`MonotonicClock`]. The mode defaults to
    /// [`Uncapped`] where the type is written out (`Throttle` is `Throttle<Uncapped>`); in an
    /// expression name it: `Throttle::<Uncapped>::new(config)` or
    /// `Throttle::<Capped>::new(config)`. For another clock see
    /// [`with_clock`](Throttle::with_clock); over an existing bucket,
    /// [`from_bucket`](Throttle::from_bucket).
    ///
    /// ```
    /// use iothrottle::{BucketConfig, Capped, ManualClock, Rate, Throttle, Uncapped};
    ///
    /// let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
    /// let plain = Throttle::<Uncapped>::new(cfg)?;
    /// let manual = Throttle::<Uncapped, _>::with_clock(cfg, ManualClock::new())?;
    /// let capped: Throttle<Capped> = Throttle::new(cfg)?;
    /// let capped_manual = Throttle::<Capped, _>::with_clock(cfg, ManualClock::new())?;
    /// let is_capped = |state: iothrottle::BucketState| state.ceil.is_some();
    /// assert!(!is_capped(plain.bucket().snapshot()) && !is_capped(manual.bucket().snapshot()));
    /// assert!(is_capped(capped.bucket().snapshot()));
    /// assert!(is_capped(capped_manual.bucket().snapshot()));
    /// # Ok::<(), iothrottle::ConfigError>(())
    /// ```
    pub fn new(config: BucketConfig) -> Result<Self, ConfigError> {
        Self::with_clock(config, MonotonicClock::new())
    }
}

impl<M: Mode, C: Clock> Throttle<M, C> {
    /// A throttle over a new bucket of mode `M` reading time from `clock`:
    /// `Throttle::<Uncapped, _>::with_clock(config, clock)`. Use [`TokioClock`] with tokio's
    /// paused time in tests: the waiters sleep on tokio timers, so they assume that `clock`
    /// runs with tokio's time.
    ///
    /// [`TokioClock`]: crate::TokioClock
    pub fn with_clock(config: BucketConfig, clock: C) -> Result<Self, ConfigError> {
        Ok(Self::from_bucket(Arc::new(SharedTokenBucket::with_clock(
            config, clock,
        )?)))
    }

    /// A throttle over an existing bucket, which others (other throttles, a dispatcher) may
    /// share. The waiters' timers assume that the bucket's clock runs with tokio's time.
    pub fn from_bucket(bucket: Arc<SharedTokenBucket<M, C>>) -> Self {
        Self::from_parts(bucket, None)
    }

    /// A throttle over a checkpointed bucket: besides waiting for tokens, a claim past the
    /// durable reservation mark ([`Durability::Strict`](crate::checkpoint::Durability)) waits,
    /// without polling, until the [`Checkpointer`](crate::checkpoint::Checkpointer) has saved
    /// a mark that covers it. Everything else is the throttle's own protocol: cancel safe (a
    /// dropped `acquire` gives back exactly what it grabbed), FIFO, a cost above the limit is
    /// [`AcquireError::CostExceedsLimit`]. In periodic mode it is a plain throttle over the
    /// bucket.
    ///
    /// Each call makes a new throttle (its own waiters and close flag): make one and
    /// clone it.
    pub fn with_checkpoint(checkpointed: &CheckpointedBucket<M, C>) -> Self {
        Self::from_parts(
            Arc::clone(checkpointed.shared_bucket()),
            Some(Arc::clone(checkpointed.gate())),
        )
    }

    fn from_parts(bucket: Arc<SharedTokenBucket<M, C>>, gate: Option<Arc<MarkGate>>) -> Self {
        let tail0 = bucket.snapshot().tail;
        Throttle {
            shared: Arc::new(Shared {
                bucket,
                changed: Notify::new(),
                waiters: AtomicU64::new(0),
                closed: AtomicU64::new(0),
                gate,
                counters: CachePadded::new(ThrottleCounters {
                    tail0,
                    given_back: AtomicU64::new(0),
                    waiting_tokens: AtomicU64::new(0),
                    cancelled: AtomicU64::new(0),
                }),
            }),
        }
    }

    /// The throttle's counters, read with relaxed loads (cheap; nothing is reset).
    pub fn stats(&self) -> ThrottleStats {
        let c = &self.shared.counters;
        // Relaxed: statistics.
        let waiting_tokens = c.waiting_tokens.load(Ordering::Relaxed);
        let given_back = c.given_back.load(Ordering::Relaxed);
        let claimed = self.shared.bucket.snapshot().tail.wrapping_sub(c.tail0);
        ThrottleStats {
            granted_tokens: claimed.saturating_sub(given_back.saturating_add(waiting_tokens)),
            waiting: self.shared.waiters.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
        }
    }

    /// The bucket.
    pub fn bucket(&self) -> &Arc<SharedTokenBucket<M, C>> {
        &self.shared.bucket
    }

    /// Changes the rate, at once: waiters already asleep wake and recompute their wake-up time.
    ///
    /// Tokens earned at the old rate up to now are added first (if they reach the replenish
    /// threshold); the new rate applies from then on.
    pub fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        rate.validate()?;
        self.shared.replenish_at(self.shared.bucket.clock().now());
        self.shared.bucket.set_rate(rate)?;
        self.shared.changed.notify_waiters();
        Ok(())
    }

    /// Closes the throttle: every waiter returns [`AcquireError::Closed`] (and gives its tokens
    /// back), and every later `acquire`/`try_acquire` fails. Permits already granted stay valid.
    ///
    /// The claims of the leaving waiters go back as cancelled claims do: at once where `head`
    /// has reached them, otherwise when it does (on a shared bucket, claims of other users may
    /// be waiting in front of them, and are not served early).
    pub fn close(&self) {
        // SeqCst: see the module doc (close vs. a waiter registering).
        self.shared.closed.store(1, Ordering::SeqCst);
        self.shared.changed.notify_waiters();
    }

    /// Refunds `tokens` granted by this throttle and not used (a short read, a write that
    /// failed), and wakes the waiters: those behind may now be served.
    pub(crate) fn refund_unused(&self, tokens: u64) {
        self.shared.refund_unused(tokens);
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    fn check(&self, cost: u64) -> Result<(), AcquireError> {
        if self.shared.is_closed() {
            return Err(AcquireError::Closed);
        }
        let limit = self.shared.bucket.limit();
        if cost > limit {
            return Err(AcquireError::CostExceedsLimit { cost, limit });
        }
        Ok(())
    }
}

impl<M: Mode, C: Clock + 'static> Throttle<M, C> {
    /// Waits until `cost` tokens are there, in line behind every earlier claim, and returns
    /// them as a [`Permit`].
    ///
    /// - A cost of 0 is granted at once (unless closed).
    /// - A cost above the bucket's limit is [`AcquireError::CostExceedsLimit`], at once.
    /// - Closing the throttle ends the wait with [`AcquireError::Closed`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes gives its tokens back; waiters behind it move
    /// up, waiters in front of it are not served any earlier.
    pub async fn acquire(&self, cost: u64) -> Result<Permit<M, C>, AcquireError> {
        self.check(cost)?;
        if cost == 0 {
            return Ok(Permit::empty());
        }
        let shared = &*self.shared;
        let bucket = &*shared.bucket;
        let gate = shared.gate.as_deref();
        let tail = bucket.grab(cost);
        let mut claim = Claim {
            shared,
            start: tail.wrapping_sub(cost),
            cost,
            tokens: cost,
            waiting: false,
        };
        if let Some(gate) = gate {
            gate.on_grab(tail);
        }
        let gated = |tail| gate.is_some_and(|g| g.blocks(tail));
        // Fast path: one fetch_add and one load (and the mark's load, checkpointed).
        if bucket.deficiency(tail) == 0 && !gated(tail) {
            return Ok(claim.grant(&shared.bucket));
        }
        // Slow path.
        claim.waiting = true;
        // Relaxed: see the module doc.
        shared.waiters.fetch_add(1, Ordering::Relaxed);
        // Relaxed: a statistic.
        shared
            .counters
            .waiting_tokens
            .fetch_add(cost, Ordering::Relaxed);
        let mut sleep = pin!(tokio::time::sleep(Duration::ZERO));
        let mut yielded = false;
        // When the timer we slept on said our tokens would be there.
        let mut due: Option<Duration> = None;
        loop {
            let mut notified = pin!(shared.changed.notified());
            notified.as_mut().enable();
            if shared.is_closed() {
                return Err(AcquireError::Closed);
            }
            if let Some(gate) = gate.filter(|g| g.blocks(tail)) {
                // Past the durable mark: sleep until the checkpointer publishes a new one
                // (registered before the check, so a publish in between still wakes us).
                let mut moved = pin!(gate.mark_moved());
                moved.as_mut().enable();
                if gate.blocks(tail) {
                    gate.request();
                    tokio::select! {
                        biased;
                        _ = &mut notified => {}
                        _ = moved => {}
                    }
                    continue;
                }
            }
            let now = bucket.clock().now();
            // Waiters replenish for themselves: nobody else has to.
            if let Some(due) = due.take().filter(|&due| due < now) {
                // The timer woke us late. Replenish as of when our tokens were due (at most
                // `catch_up` back), as an on-time timer would have: the time since then stays
                // in the bucket's clock for the next replenish instead of overflowing a small
                // bucket. See "Timer precision and late wake-ups" in docs/throttle.md.
                shared.replenish_at(due.max(now.saturating_sub(shared.catch_up())));
                if bucket.deficiency(tail) == 0 {
                    if gated(tail) {
                        continue;
                    }
                    return Ok(claim.grant(&shared.bucket));
                }
            }
            shared.replenish_at(now);
            let missing = bucket.deficiency(tail);
            if missing == 0 {
                if gated(tail) {
                    continue;
                }
                return Ok(claim.grant(&shared.bucket));
            }
            let delay = shared.delay_for(missing, now);
            if delay.is_zero() {
                // The tokens are due but this replenish added none: another thread holds the
                // replenish right this instant. Let it finish; if that happens twice, nap for one
                // timer tick rather than spin.
                if !yielded {
                    yielded = true;
                    tokio::task::yield_now().await;
                    continue;
                }
                yielded = false;
                sleep
                    .as_mut()
                    .reset(tokio::time::Instant::now() + timer_offset(Duration::from_millis(1)));
            } else {
                yielded = false;
                sleep
                    .as_mut()
                    .reset(tokio::time::Instant::now() + timer_offset(delay));
            }
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = sleep.as_mut() => due = now.checked_add(delay),
            }
        }
    }

    /// Takes `cost` tokens if they are there now and nobody is waiting for tokens; never
    /// waits, never jumps the queue.
    ///
    /// A rejection for lack of tokens, [`TryAcquireError::Insufficient`], says how long until a
    /// retry could succeed (like governor's `NotUntil`).
    pub fn try_acquire(&self, cost: u64) -> Result<Permit<M, C>, TryAcquireError> {
        self.check(cost).map_err(|e| match e {
            AcquireError::Closed => TryAcquireError::Closed,
            AcquireError::CostExceedsLimit { cost, limit } => {
                TryAcquireError::CostExceedsLimit { cost, limit }
            }
        })?;
        if cost == 0 {
            return Ok(Permit::empty());
        }
        let shared = &*self.shared;
        let bucket = &*shared.bucket;
        let now = bucket.clock().now();
        shared.replenish_at(now);
        // `available() > 0` means head is in front of tail: nobody is queued.
        if bucket.available() >= cost {
            let tail = bucket.grab(cost);
            let gate = shared.gate.as_deref();
            if let Some(gate) = gate {
                gate.on_grab(tail);
            }
            if bucket.deficiency(tail) == 0 && !gate.is_some_and(|g| g.blocks(tail)) {
                let claim = Claim {
                    shared,
                    start: tail.wrapping_sub(cost),
                    cost,
                    tokens: cost,
                    waiting: false,
                };
                return Ok(claim.grant(&shared.bucket));
            }
            // Another thread grabbed between our check and our grab, or the tokens are past the
            // durable mark: give ours back (deferred if someone is waiting in front of us).
            shared.give_back(tail.wrapping_sub(cost), cost);
        }
        let state = bucket.snapshot();
        // Tokens missing for a claim made now: the queue ahead plus our cost, minus what sits
        // in the bucket. The rovers are within 2^63 of each other: the difference is exact.
        let missing = ahead(state.tail.wrapping_add(cost), state.head);
        let missing = missing.max(1) as u64;
        Err(TryAcquireError::Insufficient {
            missing,
            retry_after: shared.delay_for(missing, now),
        })
    }

    /// [`acquire`](Self::acquire) for callers that cannot see their own cancellation (a
    /// poll-based adapter, whose operation's future may be dropped while the adapter lives on):
    /// no claim is made while the tokens are far. It first sleeps, claiming nothing, until the
    /// tokens a claim made now would need have accrued (woken earlier by a rate change, a close
    /// or tokens given back); then it claims and waits in line as `acquire` does, for the
    /// tokens claimed by others meanwhile. Dropped while asleep, it leaves nothing in line.
    pub(crate) async fn acquire_unclaimed_first(
        &self,
        cost: u64,
    ) -> Result<Permit<M, C>, AcquireError> {
        let shared = &*self.shared;
        let mut sleep = pin!(tokio::time::sleep(Duration::ZERO));
        let mut deadline: Option<tokio::time::Instant> = None;
        // Counted as a waiter, so that give-backs and closes notify it.
        let waiting = WaiterCount::new(shared);
        loop {
            let mut notified = pin!(shared.changed.notified());
            notified.as_mut().enable();
            let retry_after = match self.try_acquire(cost) {
                Ok(permit) => return Ok(permit),
                Err(TryAcquireError::Closed) => return Err(AcquireError::Closed),
                Err(TryAcquireError::CostExceedsLimit { cost, limit }) => {
                    return Err(AcquireError::CostExceedsLimit { cost, limit })
                }
                Err(TryAcquireError::Insufficient { retry_after, .. }) => retry_after,
            };
            // Only ever earlier: a stream of notifications cannot keep it from its turn.
            let at = tokio::time::Instant::now() + timer_offset(retry_after);
            let at = deadline.map_or(at, |d| d.min(at));
            deadline = Some(at);
            sleep.as_mut().reset(at);
            tokio::select! {
                biased;
                _ = &mut notified => {}
                _ = sleep.as_mut() => break,
            }
        }
        drop(waiting);
        self.acquire(cost).await
    }
}

/// The most lateness of a timer that a waiter makes up for (two of tokio's timer ticks).
const MAX_CATCH_UP: Duration = Duration::from_millis(2);

/// The longest single nap: a waiter whose tokens are further away (a very slow rate) wakes up,
/// finds them missing and sleeps again. Keeps `Instant + delay` far from overflowing.
const MAX_NAP: Duration = Duration::from_secs(24 * 3600);

/// What to add to tokio's `now` so that the timer fires as soon as possible after `delay`.
///
/// tokio's timers tick in whole milliseconds: a deadline is rounded *up* to a tick, and the
/// driver then parks for whole milliseconds counted from the tick it is in. Asking for `delay`
/// itself therefore wakes up to 2 ms late (a deadline just past a tick boundary, parked late in
/// a tick). Asking for `(⌈delay⌉ms − 1 ms) + 1 ns` lands on the tick that ends ⌈delay⌉ ms after
/// now: the wake-up is never before `delay` and less than 1 ms (plus scheduling) after it. At
/// 1,000 tokens/s this is what keeps a burst-1 bucket from overflowing between replenishes (the
/// accuracy figure in `examples/throttle_accuracy.rs`). Should tokio's rounding change, the
/// cost is one extra wake-up at most (an early waiter finds its tokens missing and sleeps on).
fn timer_offset(delay: Duration) -> Duration {
    const TICK_NS: u128 = 1_000_000;
    let ticks = delay.min(MAX_NAP).as_nanos().div_ceil(TICK_NS).max(1);
    // ticks ≤ MAX_NAP in ms: fits u64.
    Duration::from_millis(ticks as u64 - 1) + Duration::from_nanos(1)
}

impl<M: Mode, C: Clock> fmt::Debug for Throttle<M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Throttle")
            .field("bucket", &self.shared.bucket)
            .field("closed", &self.shared.is_closed())
            // Relaxed: a snapshot for display.
            .field("waiters", &self.shared.waiters.load(Ordering::Relaxed))
            .field("deferred", &self.shared.bucket.deferred_give_backs())
            .finish()
    }
}

/// One count in `shared.waiters` for as long as it lives.
struct WaiterCount<'a, M: Mode, C: Clock> {
    shared: &'a Shared<M, C>,
}

impl<'a, M: Mode, C: Clock> WaiterCount<'a, M, C> {
    fn new(shared: &'a Shared<M, C>) -> Self {
        // Relaxed: see the module doc.
        shared.waiters.fetch_add(1, Ordering::Relaxed);
        WaiterCount { shared }
    }
}

impl<M: Mode, C: Clock> Drop for WaiterCount<'_, M, C> {
    fn drop(&mut self) {
        // Relaxed: see the module doc.
        self.shared.waiters.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A claim on the bucket that is not a permit yet: its drop gives the tokens back.
struct Claim<'a, M: Mode, C: Clock> {
    shared: &'a Shared<M, C>,
    start: u64,
    /// The claim's size (`tokens` becomes 0 once granted).
    cost: u64,
    tokens: u64,
    /// Counted in `shared.waiters`.
    waiting: bool,
}

impl<M: Mode, C: Clock + 'static> Claim<'_, M, C> {
    /// The tokens are there: they become a permit.
    fn grant(mut self, bucket: &Arc<SharedTokenBucket<M, C>>) -> Permit<M, C> {
        let tokens = std::mem::take(&mut self.tokens);

        Permit {
            tokens,
            tail: self.start.wrapping_add(tokens),
            bucket: M::CAPPED.then(|| Arc::clone(bucket)),
        }
    }
}

impl<M: Mode, C: Clock> Drop for Claim<'_, M, C> {
    fn drop(&mut self) {
        if self.waiting {
            // Relaxed: see the module doc.
            self.shared.waiters.fetch_sub(1, Ordering::Relaxed);
            // Relaxed: a statistic.
            self.shared
                .counters
                .waiting_tokens
                .fetch_sub(self.cost, Ordering::Relaxed);
        }
        // `grant` took the tokens; anything left was never served.
        self.shared.give_back(self.start, self.tokens);
    }
}

/// Tokens granted by a [`Throttle`].
///
/// In [`Capped`](crate::Capped) mode the permit stands for work in flight: dropping it (or calling
/// [`complete`](Self::complete)) releases exactly its tokens to the bucket's `ceil`, so that the
/// bucket may fill again. Every permit is released exactly once, whatever happens to the work:
/// the capped-release leak (tokens grabbed but never released) cannot happen. In [`Uncapped`]
/// mode the drop does nothing, so the permit is not `#[must_use]`: `throttle.acquire(n).await?;`
/// is the whole call when only the wait matters. In capped mode, hold the permit for as long as
/// the work runs (`let permit = …; …; permit.complete();`).
pub struct Permit<M: Mode = Uncapped, C: Clock + 'static = MonotonicClock> {
    tokens: u64,
    /// The bucket position the claim ends at (0 for an empty permit).
    tail: u64,
    /// Capped mode only: where to release the tokens.
    bucket: Option<Arc<SharedTokenBucket<M, C>>>,
}

impl<M: Mode, C: Clock + 'static> Permit<M, C> {
    fn empty() -> Self {
        Permit {
            tokens: 0,
            tail: 0,
            bucket: None,
        }
    }

    /// The tokens, now the caller's to complete or refund (`adapter`); the drop does nothing.
    pub(crate) fn into_tokens(mut self) -> u64 {
        self.bucket = None;
        self.tokens
    }

    /// How many tokens this permit holds.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The bucket position this permit's claim ends at (positions wrap: compare them with
    /// wrapping differences); `None` for a permit of 0 tokens, which claimed nothing. With a
    /// strict checkpoint every position up to it is under the durable reservation mark.
    pub fn tail(&self) -> Option<u64> {
        (self.tokens > 0).then_some(self.tail)
    }

    /// Reports the work as completed (capped mode: releases the tokens). Same as dropping the
    /// permit; spelled out where that reads better.
    pub fn complete(self) {
        drop(self)
    }
}

impl<M: Mode, C: Clock + 'static> Drop for Permit<M, C> {
    fn drop(&mut self) {
        if let Some(bucket) = self.bucket.take() {
            bucket.complete(self.tokens);
        }
    }
}

impl<M: Mode, C: Clock + 'static> fmt::Debug for Permit<M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("tokens", &self.tokens)
            .field("capped", &M::CAPPED)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_offset_lands_on_the_tick_that_ends_after_the_delay() {
        let ns = Duration::from_nanos;
        let ms = Duration::from_millis;
        assert_eq!(timer_offset(Duration::ZERO), ns(1));
        assert_eq!(timer_offset(ns(1)), ns(1));
        assert_eq!(timer_offset(ms(1)), ns(1));
        assert_eq!(timer_offset(ms(1) + ns(1)), ms(1) + ns(1));
        assert_eq!(timer_offset(ms(10)), ms(9) + ns(1));
        assert_eq!(timer_offset(Duration::MAX), MAX_NAP - ms(1) + ns(1));
    }
}
