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
//! - `last` doubles as the replenish right. Taking it (CAS to `last | BUSY`) is **Acquire**, and
//!   giving it back (`store`) is **Release**: the remainder and its rate generation, written
//!   under the right with Relaxed stores, pass from one replenisher to the next through this
//!   pair. Losers do not wait: like the CAS losers in Seastar, they return at once and the
//!   winner's replenish covers their time.

use crossbeam_utils::CachePadded;

use crate::bucket::mode::private::{CeilRover, Sealed};
use crate::bucket::mode::Mode;
use crate::bucket::rate::RawRate;
use crate::bucket::rate_cell::RateCell;
use crate::sync::{AtomicU64, Ordering};

/// Top bit of `last`: a replenish is in progress.
const BUSY: u64 = 1 << 63;
/// `last` before the first replenish: the first replenish fills the bucket.
const FRESH: u64 = BUSY - 1;
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

/// The replenish state: who may replenish, since when, and the carried remainder.
#[derive(Debug)]
struct Replenisher {
    /// Time of the last replenish (nanoseconds on the bucket's clock), `FRESH` before the first,
    /// with `BUSY` set while a replenish is in progress.
    last: AtomicU64,
    /// Token-nanoseconds carried from the last replenish, below the rate's period: the fraction
    /// of a token already earned. Written only by the holder of the replenish right.
    rem: AtomicU64,
    /// The rate generation `rem` was earned at; a new rate starts from zero remainder.
    rem_gen: AtomicU64,
    rate: RateCell,
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
    /// Rovers at `tail = head = start`, `ceil = start + limit`, before the first replenish.
    pub(crate) fn new(rate: RawRate, limit: u64, threshold: u64, start: u64) -> Self {
        Self::at(
            rate,
            limit,
            threshold,
            start,
            start,
            start.wrapping_add(limit),
            FRESH,
        )
    }

    /// Rovers restored at the given positions, as if replenished at `now` (checked by the caller).
    pub(crate) fn restored(
        rate: RawRate,
        limit: u64,
        threshold: u64,
        (tail, head, ceil): (u64, u64, u64),
        now: u64,
    ) -> Self {
        Self::at(
            rate,
            limit,
            threshold,
            tail,
            head,
            ceil,
            now.min(MAX_TIMESTAMP),
        )
    }

    fn at(
        rate: RawRate,
        limit: u64,
        threshold: u64,
        tail: u64,
        head: u64,
        ceil: u64,
        last: u64,
    ) -> Self {
        Rovers {
            tail: CachePadded::new(AtomicU64::new(tail)),
            head: CachePadded::new(AtomicU64::new(head)),
            ceil: <M::Ceil as CeilRover>::new(ceil),
            repl: CachePadded::new(Replenisher {
                last: AtomicU64::new(last),
                rem: AtomicU64::new(0),
                rem_gen: AtomicU64::new(0),
                rate: RateCell::new(rate),
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
    fn fill(&self, extra: u128) -> u64 {
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

    /// Replenishes for the time up to `now` (nanoseconds on the bucket's clock). Returns the
    /// tokens added.
    ///
    /// Does nothing when `now` is not after the last replenish, when fewer than `threshold`
    /// tokens would be added (the time keeps accruing), or when another thread is replenishing
    /// right now (its replenish covers this time).
    pub(crate) fn replenish(&self, now: u64) -> u64 {
        let now = now.min(MAX_TIMESTAMP);
        // Acquire: pairs with the Release that ended the previous replenish (see module doc).
        let last = self.repl.last.load(Ordering::Acquire);
        if last & BUSY != 0 {
            return 0;
        }
        let fresh = last == FRESH;
        if !fresh && now <= last {
            return 0;
        }
        let (rate, gen) = self.repl.rate.load();
        if !fresh {
            // An estimate without the right: the remainder may be stale or from another rate
            // generation, which at worst skips a replenish that a later call then makes (the
            // time keeps accruing). It saves the CAS when nothing is due, e.g. a threshold-1
            // bucket replenished on every grab.
            // Relaxed: an estimate; the exact figure is recomputed under the right.
            let carried = self.repl.rem.load(Ordering::Relaxed);
            if Self::earned(rate, now - last, carried).0 < self.threshold as u128 {
                return 0;
            }
        }
        // Acquire on success: we see the remainder of the previous holder. Relaxed on failure:
        // someone else is replenishing or has replenished; we leave.
        if self
            .repl
            .last
            .compare_exchange(last, last | BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return 0;
        }
        let (extra, rem) = if fresh {
            (self.limit as u128, 0)
        } else {
            // Relaxed: we hold the replenish right; the Acquire above ordered us after its
            // previous holder's writes.
            let carried = if self.repl.rem_gen.load(Ordering::Relaxed) == gen {
                self.repl.rem.load(Ordering::Relaxed)
            } else {
                0
            };
            Self::earned(rate, now - last, carried)
        };
        if extra < self.threshold as u128 {
            // Release: gives the right back unchanged.
            self.repl.last.store(last, Ordering::Release);
            return 0;
        }
        let added = self.fill(extra);
        // Relaxed: published by the Release store of `last` below.
        self.repl.rem.store(rem, Ordering::Relaxed);
        self.repl.rem_gen.store(gen, Ordering::Relaxed);
        // Release: ends the replenish and publishes the remainder to the next holder.
        self.repl.last.store(now, Ordering::Release);
        added
    }

    /// Whole tokens earned in `elapsed_ns` with `carried` token-nanoseconds from before, and the
    /// token-nanoseconds to carry on.
    fn earned(rate: RawRate, elapsed_ns: u64, carried: u64) -> (u128, u64) {
        let (whole, rem) = rate.tokens_in(elapsed_ns as u128);
        // Both below the period (a carried value from another rate may not be: it is only
        // used for the estimate, so `frac / period` is still a small number).
        let frac = rem as u128 + carried as u128;
        let period = rate.period_ns as u128;
        (whole + frac / period, (frac % period) as u64)
    }

    pub(crate) fn rate(&self) -> RawRate {
        self.repl.rate.load().0
    }

    pub(crate) fn set_rate(&self, rate: RawRate) {
        self.repl.rate.store(rate);
    }

    /// The time of the last replenish, `None` before the first.
    pub(crate) fn last_replenish(&self) -> Option<u64> {
        // Acquire: as in `replenish`; the value is a snapshot.
        let last = self.repl.last.load(Ordering::Acquire) & !BUSY;
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
