//! [`Rovers`]: the lock-free core of the bucket. It takes `now` as an argument and does the
//! arithmetic; [`SharedTokenBucket`](crate::SharedTokenBucket) adds the clock.
//!
//! # Orderings
//!
//! - The rovers' read-modify-writes (`tail.fetch_add` in grab, the `head` CAS in replenish and
//!   refund, `ceil.fetch_add` in release and refund) are **AcqRel** and their loads **Acquire**,
//!   as strong as Seastar's and free on x86 (every locked RMW is a full barrier there). No data
//!   is published through the rovers: what matters is that each rover has one modification
//!   order (atomicity) and that bounds are read no later than the values they bound.
//! - Every bound (`tail + limit`, `ceil`) only grows, so reading a stale one can only make a
//!   replenish or refund add *less*; `head` itself moves by CAS against the value the room was
//!   computed from. Hence `head ≤ tail + limit` and `head ≤ ceil` hold at every instant, under
//!   any interleaving; loom checks it in `loom-tests/`.
//! - `last` is the end of the last counted interval. A replenish loads it (**Relaxed**), prices
//!   `[last, now)` with the rate regime it then reads, and claims the interval with one CAS
//!   from `last` to `now` (**Release** on success, **Relaxed** on failure). The regime read
//!   begins with an Acquire fence, and a fence after a load that read a Release CAS
//!   synchronises with it: a thread that read `last = t` also reads a regime at least as new as the one `t`
//!   was priced with (or closed with, by `set_rate`), so an interval is never priced at a rate
//!   older than the one in force when it started. Loom shows both Releases are needed.
//!   Losers return at once: the winner's interval covers their time. A winner stalled between
//!   its CAS and its `head` CAS holds back only the tokens of its own interval; the next
//!   replenish starts from its `now` and proceeds.
//! - The regime read is, in the common case, only the published ticket (the same Acquire
//!   fence, then an Acquire load of the cell's `ctl`): the process's price cache
//!   ([`PriceCache`], its own protocol in `price`) prices the interval when it holds the regime
//!   of that ticket and `last` is at or after that regime's epoch; otherwise the record is read
//!   as before (and cached). Both price with the regime the record holds at that point, so
//!   the argument above is unchanged.
//! - `set_rate` publishes a new regime (old rate up to the epoch, new rate after) and then
//!   closes the old rate's interval with the same CAS on `last`; the regime is published before
//!   `last` passes the epoch, and the regime's writer observed `last ≥ prev_epoch` before
//!   publishing, so a replenisher that read an older `last` fails its CAS. Publishing is
//!   lock-free (see `rate_cell`): a writer stopped forever after publishing leaves its
//!   interval open, and the next `set_rate` closes it first.
//!
//! Every type here is `#[repr(C)]` and made only of atomics and integers fixed at creation,
//! so the rovers can also live in a file mapped by several processes (`shm`).

use crossbeam_utils::CachePadded;

use crate::bucket::mode::private::{CeilRover, Sealed};
use crate::bucket::mode::Mode;
use crate::bucket::price::{Price, PriceCache};
use crate::bucket::rate::RawRate;
use crate::bucket::rate_cell::{RateCell, Regime, Step};
use crate::sync::{AtomicU64, Ordering};

/// `last` before the first replenish: the first replenish fills the bucket.
const FRESH: u64 = (1 << 63) - 1;
/// The largest timestamp, in nanoseconds (about 292 years after the clock's origin).
pub(crate) const MAX_TIMESTAMP: u64 = FRESH - 1;

/// How far `a` is in front of `b`, as a wrapping signed difference. Correct while the two are
/// less than 2^63 apart.
#[inline]
pub(crate) fn ahead(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

/// The rover that is behind (wrapping order).
#[inline]
fn earlier(a: u64, b: u64) -> u64 {
    if ahead(a, b) <= 0 {
        a
    } else {
        b
    }
}

/// The replenish state: the end of the last counted interval, and the rate regime.
///
/// | state | meaning |
/// |---|---|
/// | `last == FRESH` | never replenished: the first replenish fills the bucket to the limit |
/// | `last < regime.epoch` | a rate change is not closed yet: `[last, epoch)` is owed at `prev` |
/// | `last ≥ regime.epoch` | every interval up to `last` has been counted (and claimed) |
/// | always (but `FRESH`) | `last ≥ regime.prev_epoch` |
///
/// `last` only moves forward, by CAS, and every move claims the interval it skips: the tokens
/// the regime prices for it are added by the thread whose CAS succeeded.
#[derive(Debug)]
#[repr(C)]
struct Replenisher {
    /// End of the last counted interval (nanoseconds on the bucket's clock), `FRESH` before the
    /// first replenish.
    last: AtomicU64,
    regime: RateCell,
}

/// The three rovers and the replenish state.
///
/// | state | meaning |
/// |---|---|
/// | `ahead(head, tail) > 0` | `head - tail` tokens sit in the bucket |
/// | `ahead(head, tail) < 0` | `tail - head` tokens are claimed but not there yet (a queue) |
/// | always | `ahead(head, tail + limit) ≤ 0`: never more than `limit` tokens |
/// | capped | `ahead(head, ceil) ≤ 0`: never past what completions allow |
///
/// All rovers only move forward and may wrap: every comparison is a wrapping signed difference,
/// correct while any two rovers are less than 2^63 apart (the limit is at most 2^62, so a queue
/// of up to 2^62 claimed tokens is safe).
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Rovers<M: Mode> {
    /// Advanced by `grab`. On its own cache line: every core writes it.
    tail: CachePadded<AtomicU64>,
    /// Advanced by replenish and refund; read by every `deficiency`.
    head: CachePadded<AtomicU64>,
    /// Capped mode: advanced by release and refund; start `limit`.
    ceil: <M as Sealed>::Ceil,
    repl: CachePadded<Replenisher>,
    limit: u64,
    threshold: u64,
}

impl<M: Mode> Rovers<M> {
    /// Rovers at `tail = head = start`, `ceil = start + limit`, before the first replenish,
    /// counting tokens from `now`.
    pub(crate) fn new(rate: RawRate, limit: u64, threshold: u64, start: u64, now: u64) -> Self {
        // The same rate before `now`, from 0: a first replenish at a reading before `now` (a
        // stale `replenish_at`) leaves `last` there, and every `last` must be priceable.
        let now = now.min(MAX_TIMESTAMP);
        let regime = Regime {
            rate,
            epoch: now,
            prev: rate,
            prev_epoch: 0,
        };
        Self::at(
            regime,
            limit,
            threshold,
            (start, start, start.wrapping_add(limit)),
            FRESH,
        )
    }

    /// Rovers restored at the given positions, as if replenished at `now` (checked by the caller).
    pub(crate) fn restored(
        rate: RawRate,
        limit: u64,
        threshold: u64,
        rovers: (u64, u64, u64),
        now: u64,
    ) -> Self {
        let now = now.min(MAX_TIMESTAMP);
        Self::at(Regime::new(rate, now), limit, threshold, rovers, now)
    }

    fn at(
        regime: Regime,
        limit: u64,
        threshold: u64,
        (tail, head, ceil): (u64, u64, u64),
        last: u64,
    ) -> Self {
        Rovers {
            tail: CachePadded::new(AtomicU64::new(tail)),
            head: CachePadded::new(AtomicU64::new(head)),
            ceil: <M::Ceil as CeilRover>::new(ceil),
            repl: CachePadded::new(Replenisher {
                last: AtomicU64::new(last),
                regime: RateCell::new(regime),
            }),
            limit,
            threshold,
        }
    }

    #[inline]
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    #[inline]
    pub(crate) fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Claims `n` tokens; returns the new tail (the position to wait for).
    #[inline]
    pub(crate) fn grab(&self, n: u64) -> u64 {
        // AcqRel: a rover RMW (see the module doc); atomicity gives every grab its own range.
        self.tail.fetch_add(n, Ordering::AcqRel).wrapping_add(n)
    }

    /// How many of the tokens up to `tail` are not there yet.
    #[inline]
    pub(crate) fn deficiency(&self, tail: u64) -> u64 {
        // Acquire: pairs with the AcqRel CAS that moved head; a grabber that sees its tokens
        // comes after the replenish (or refund) that made them.
        let head = self.head.load(Ordering::Acquire);
        ahead(tail, head).max(0) as u64
    }

    /// Tokens in the bucket now (0 when in deficit). A snapshot: other threads move on.
    pub(crate) fn available(&self) -> u64 {
        // Acquire, tail first: head read later may include a replenish that happened in
        // between, so the difference is clamped to the limit, which the bucket never exceeds.
        let tail = self.tail.load(Ordering::Acquire);
        let head = self.head.load(Ordering::Acquire);
        ahead(head, tail).clamp(0, self.limit as i64) as u64
    }

    /// Adds up to `extra` tokens to `head`, never past `tail + limit` (nor `ceil` when capped).
    /// Returns how many were added; the rest is discarded.
    #[inline]
    pub(crate) fn fill(&self, extra: u128) -> u64 {
        // Acquire: as in `deficiency`.
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            // Acquire: a bound read no later than the CAS below; stale means smaller (safe).
            let tail = self.tail.load(Ordering::Acquire);
            let mut cap = tail.wrapping_add(self.limit);
            if let Some(ceil) = self.ceil.get() {
                cap = earlier(cap, ceil);
            }
            let room = ahead(cap, head);
            if room <= 0 {
                return 0;
            }
            let add = extra.min(room as u128) as u64;
            if add == 0 {
                return 0;
            }
            // AcqRel on success: a rover RMW; Acquire on failure: we recompute from the new head.
            match self.head.compare_exchange_weak(
                head,
                head.wrapping_add(add),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return add,
                Err(actual) => head = actual,
            }
        }
    }

    /// Gives back `n` grabbed-but-unused tokens; returns how many fitted under the cap.
    pub(crate) fn refund(&self, n: u64) -> u64 {
        // Capped: ceil moves first, so `head ≤ ceil` holds throughout.
        self.ceil.advance(n);
        self.fill(n as u128)
    }

    /// Capped release: `ceil += n`.
    pub(crate) fn release(&self, n: u64) {
        self.ceil.advance(n);
    }

    /// Replenishes for the time up to `now` (nanoseconds on the bucket's clock), pricing with
    /// `cache` when it holds the current regime (no record decode, no division) and filling
    /// it when it does not. Returns the tokens added.
    ///
    /// Does nothing when `now` is not after the last replenish, when fewer than `threshold`
    /// tokens would be added (the time keeps accruing), or when another thread moved `last`
    /// since we read it (its replenish covers that time). Lock-free: no step waits for another
    /// thread, and a thread stalled anywhere in here holds back only the tokens of the interval
    /// it claimed.
    #[inline]
    pub(crate) fn replenish(&self, now: u64, cache: &PriceCache) -> u64 {
        match self.claim(now, cache) {
            Some(extra) => self.fill(extra),
            None => 0,
        }
    }

    /// The first half of a replenish: moves `last` to `now` by CAS and returns the tokens of
    /// the interval claimed (the bucket's limit for the first replenish), or `None` when there
    /// is nothing to claim. The caller must [`fill`](Self::fill) them.
    ///
    /// The common case (a replenish after the first, priced from the cache) is inlined into
    /// the caller; the others go through [`claim_priced`](Self::claim_priced), which prices
    /// any interval.
    #[inline(always)]
    pub(crate) fn claim(&self, now: u64, cache: &PriceCache) -> Option<u128> {
        let now = now.min(MAX_TIMESTAMP);
        // Relaxed: the regime read below (`published`, or the record in `claim_priced`) begins
        // with an Acquire fence, which synchronises with the Release CAS that stored this
        // value (a fence after a load that read a release store), so that regime is at least
        // the one in force then. Loom checks it.
        let last = self.repl.last.load(Ordering::Relaxed);
        if last == FRESH {
            return self.claim_priced(now, last, cache);
        }
        if now <= last {
            return None;
        }
        let ticket = self.repl.regime.published();
        let extra = match cache.get(ticket) {
            Some(price) if last >= price.epoch => price.earned(last, now),
            _ => return self.claim_priced(now, last, cache),
        };
        if extra < self.threshold as u128 {
            return None;
        }
        self.take(last, now, extra)
    }

    /// [`claim`](Self::claim) when the cache cannot price the interval from `last` (read
    /// Relaxed from `repl.last`, not before `now` unless [`FRESH`]) to `now`: the first
    /// replenish, a cache that holds another regime (refreshed here), or an interval that
    /// begins before the current regime's epoch (priced from the record).
    #[cold]
    #[inline(never)]
    fn claim_priced(&self, now: u64, last: u64, cache: &PriceCache) -> Option<u128> {
        let extra = if last == FRESH {
            self.limit as u128
        } else {
            // The record, read with its leading Acquire fence as in `claim`.
            let (ticket, regime) = self.repl.regime.load_ticketed();
            if cache.get(ticket).is_none() {
                cache.put(ticket, Price::new(regime.rate, regime.epoch));
            }
            let extra = regime.earned(last, now)?;
            if extra < self.threshold as u128 {
                return None;
            }
            extra
        };
        self.take(last, now, extra)
    }

    /// Moves `last` from `last` to `now` by CAS; `Some(extra)` if it did.
    #[inline(always)]
    fn take(&self, last: u64, now: u64, extra: u128) -> Option<u128> {
        // Release on success: a replenisher that reads `now` from here also sees the regime
        // we priced with (through the Acquire fence of its own regime read). Relaxed on
        // failure: another thread moved `last` and covers the time; we leave.
        self.repl
            .last
            .compare_exchange(last, now, Ordering::Release, Ordering::Relaxed)
            .ok()
            .map(|_| extra)
    }

    /// Moves `last` up to `regime.epoch` if it is behind, adding what the old rate earned
    /// there whatever the threshold. Returns the tokens added.
    fn close(&self, regime: &Regime) -> u64 {
        loop {
            // Relaxed: the regime is given, and the CAS below checks the value.
            let last = self.repl.last.load(Ordering::Relaxed);
            if last == FRESH || last >= regime.epoch {
                return 0;
            }
            let Some(extra) = regime.earned(last, regime.epoch) else {
                // Unreachable while `last ≥ prev_epoch` (see `Replenisher`); nothing to add.
                return 0;
            };
            // Release / Relaxed: as in `claim`; on failure someone moved `last`: look again.
            if self
                .repl
                .last
                .compare_exchange(last, regime.epoch, Ordering::Release, Ordering::Relaxed)
                .is_ok()
            {
                return self.fill(extra);
            }
        }
    }

    /// The current rate.
    pub(crate) fn rate(&self) -> RawRate {
        self.repl.regime.load().rate
    }

    /// Changes the rate at `now`: the time up to `now` is counted at the old rate (added now,
    /// even below the threshold), the time after it at the new one. Returns the tokens added.
    ///
    /// If another thread already counted past `now`, the change starts at that point instead.
    #[inline]
    pub(crate) fn set_rate(&self, rate: RawRate, now: u64) -> u64 {
        self.set_rate_stopping(rate, now, &|_| false).unwrap_or(0)
    }

    /// [`set_rate`](Self::set_rate), asking `stop` at each step whether to stop there for
    /// ever (a participant killed mid-change); `None` if it stopped.
    pub(crate) fn set_rate_stopping(
        &self,
        rate: RawRate,
        now: u64,
        stop: &impl Fn(Step) -> bool,
    ) -> Option<u64> {
        let now = now.min(MAX_TIMESTAMP);
        let mut added = 0;
        let next = self.repl.regime.update(
            |current| {
                // An earlier change may not be closed yet (its writer stopped after publishing);
                // close it, so that the one old rate our regime keeps is enough.
                added += self.close(&current);
                // Relaxed: only its value matters (`last` only grows, so the epoch is not behind
                // it); `close` above made it reach the old epoch, and our regime is published
                // only if no other writer published since `current`.
                let last = self.repl.last.load(Ordering::Relaxed);
                if last == FRESH {
                    // Nothing was counted yet (the first replenish fills the bucket): the new
                    // rate prices everything, and from 0 any `last` a racing first fill stores.
                    Regime {
                        rate,
                        epoch: now,
                        prev: rate,
                        prev_epoch: 0,
                    }
                } else {
                    Regime {
                        rate,
                        epoch: now.max(last),
                        prev: current.rate,
                        prev_epoch: current.epoch,
                    }
                }
            },
            stop,
        )?;
        Some(added + self.close(&next))
    }

    /// The time of the last replenish, `None` before the first.
    pub(crate) fn last_replenish(&self) -> Option<u64> {
        // Relaxed: a snapshot of the value; nothing is read through it.
        let last = self.repl.last.load(Ordering::Relaxed);
        (last != FRESH).then_some(last)
    }

    /// `(tail, head, ceil)`, read in that order. Each is exact; together they are a snapshot
    /// that other threads may already have moved past.
    pub(crate) fn positions(&self) -> (u64, u64, Option<u64>) {
        // Acquire: as in `available`.
        let tail = self.tail.load(Ordering::Acquire);
        let head = self.head.load(Ordering::Acquire);
        (tail, head, self.ceil.get())
    }
}
