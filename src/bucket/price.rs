//! [`PriceCache`]: the current rate in the form a replenish prices with fastest (reduced to
//! lowest terms, with the reciprocal of its period), kept by each process next to its bucket,
//! so that the common replenish neither decodes the rate record nor divides.
//!
//! A replenish whose interval lies wholly after the current regime's epoch is priced by
//! [`Price::earned`], which equals `RawRate::count` of the regime's rate exactly (a proptest
//! checks it): `floor(t × b / p) − floor(t × a / p)` with each quotient taken by one 128-bit
//! multiplication by `ceil(2^128 / p)` while `t × b` fits 64 bits (exact for every 64-bit
//! dividend and divisor, see [`Price::quot`]); long after the epoch, from the remainder of
//! `t × a` the same way while `t × p` fits 64 bits; by `count` otherwise. Any other interval
//! (before the first replenish, across an unclosed rate change) goes the way it always did,
//! through the rate record.
//!
//! The cache names the regime it holds by the ticket under which the rate cell published it;
//! a replenish uses it only when that is the ticket the cell publishes now, read exactly where
//! the record itself would have been read. So the cache never prices with another regime than
//! the record would, and a stale, empty or half-written cache only sends the replenish the
//! long way. Tickets are 32 bits and wrap: a cache is refreshed by the first replenish that
//! finds it stale, so it could only be taken for current again after 2^32 rate changes with
//! no replenish of this process in between.
//!
//! # Orderings
//!
//! A sequence lock whose readers never wait: `seq` is even when the words hold one whole
//! price, odd while a writer replaces them; a reader that sees it odd, or changed across its
//! reads, does without the cache.
//!
//! - A writer takes `seq` from even to odd by CAS, **Acquire** on success: the previous
//!   writer's words (published by its Release store of that even value) happen before ours,
//!   so no word of ours can be overwritten by theirs. It then issues a **Release fence**, so
//!   that a reader whose load reads one of our words also sees the odd `seq` (through its
//!   Acquire fence), stores the words **Relaxed**, and publishes with a **Release** store of
//!   the next even value.
//! - A reader loads `seq` **Acquire** (pairs with the publishing Release: the words it then
//!   reads are at least those of that publication), the words **Relaxed**, then an **Acquire
//!   fence** and `seq` again **Relaxed**: if a word came from a later writer, that writer's
//!   Release fence synchronises with our fence and `seq` reads its odd value or later, so
//!   the reader sees the change and leaves.
//! - A writer stopped for ever with `seq` odd leaves the cache unused (every replenish goes
//!   the long way, as it would without a cache); nobody waits for it.
//!
//! `loom-tests/price_cache.rs` checks that no reader takes a torn price, and the bucket's
//! replenish and rate models run through the cache.

use crate::bucket::rate::RawRate;
use crate::sync::{fence, AtomicU64, Ordering};

/// A rate from an epoch on, as the fast replenish prices with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Price {
    /// Where the rate's count starts (nanoseconds on the bucket's clock).
    pub(crate) epoch: u64,
    /// The rate's tokens, divided by `gcd(tokens, period_ns)`.
    tokens: u64,
    /// The rate's period, divided by the same.
    period_ns: u64,
    /// `ceil(2^128 / period_ns)`; 0 when `period_ns` is 1 (a quotient by 1 is the dividend).
    magic: u128,
}

impl Price {
    /// `rate` counted from `epoch`. Divides: built once per rate change, not per replenish.
    pub(crate) fn new(rate: RawRate, epoch: u64) -> Self {
        let g = gcd(rate.tokens, rate.period_ns);
        let (tokens, period_ns) = (rate.tokens / g, rate.period_ns / g);
        Price {
            epoch,
            tokens,
            period_ns,
            magic: magic(period_ns),
        }
    }

    /// Tokens earned from `from` to `to`, both at or after the epoch and `from ≤ to`: the
    /// same as `rate.count(from − epoch, to − epoch)` of the rate the price was built from.
    #[inline(always)]
    pub(crate) fn earned(&self, from: u64, to: u64) -> u128 {
        debug_assert!(self.epoch <= from && from <= to);
        let (a, b) = (from - self.epoch, to - self.epoch);
        let t = self.tokens;
        if let Some(tb) = t.checked_mul(b) {
            // t × a ≤ t × b fits too; floor is monotone, so the difference is not negative.
            return (self.quot(tb) - self.quot(t * a)) as u128;
        }
        self.earned_long_after(a, b)
    }

    /// [`earned`](Self::earned) from `a` to `b` after the epoch when `tokens × b` does not fit
    /// 64 bits.
    #[inline(never)]
    fn earned_long_after(&self, a: u64, b: u64) -> u128 {
        let t = self.tokens;
        // With t × a = Q × p + R, the count is floor((t × (b − a) + R) / p), and
        // R = (t × (a mod p)) mod p, which stays in 64 bits while t × p does (any practical
        // rate), so a short interval still prices without a division however far the epoch
        // lies behind.
        if t.checked_mul(self.period_ns).is_some() {
            let r = self.rem(t * self.rem(a));
            if let Some(n) = t.checked_mul(b - a).and_then(|n| n.checked_add(r)) {
                return self.quot(n) as u128;
            }
        }
        RawRate {
            tokens: t,
            period_ns: self.period_ns,
        }
        .count(a, b)
    }

    /// `n mod period_ns` without a division.
    #[inline]
    fn rem(&self, n: u64) -> u64 {
        n - self.quot(n) * self.period_ns
    }

    /// `floor(n / period_ns)` without a division.
    ///
    /// With `m = ceil(2^128 / p) = (2^128 + e) / p` for some `0 ≤ e < p`:
    /// `m × n / 2^128 = n / p + e × n / (p × 2^128)`, and the second term is below
    /// `2^64 / 2^128 ≤ 1 / p` for `n < 2^64`, `p < 2^64`; `n / p` is at most `1 − 1/p` past
    /// its floor, so the floor of the sum is `floor(n / p)` (Lemire, Kaser and Kurz, "Faster
    /// remainder by direct computation", 2019).
    #[inline]
    fn quot(&self, n: u64) -> u64 {
        if self.magic == 0 {
            return n;
        }
        // The top 64 bits of the 192-bit product m × n: lo < 2^128, hi + (lo >> 64) < 2^128.
        let lo = (self.magic as u64 as u128) * n as u128;
        let hi = (self.magic >> 64) * n as u128;
        ((hi + (lo >> 64)) >> 64) as u64
    }
}

/// `ceil(2^128 / p)` for `p ≥ 2` (fits: at most 2^127); 0 for `p = 1`.
fn magic(p: u64) -> u128 {
    if p <= 1 {
        0
    } else {
        // floor((2^128 − 1) / p) + 1 = ceil(2^128 / p), also when p is a power of two.
        u128::MAX / p as u128 + 1
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// No ticket: a `u32` ticket never equals it.
const EMPTY: u64 = u64::MAX;

/// The price of one published regime, readable without waiting and replaced by whoever finds
/// it stale. One cache line; see the module doc for the protocol.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct PriceCache {
    /// Even: the words hold a whole price; odd: a writer is replacing them.
    seq: AtomicU64,
    /// The rate cell's ticket of the regime priced, or [`EMPTY`].
    ticket: AtomicU64,
    epoch: AtomicU64,
    tokens: AtomicU64,
    period_ns: AtomicU64,
    magic_lo: AtomicU64,
    magic_hi: AtomicU64,
}

impl PriceCache {
    /// An empty cache: the first replenish fills it.
    pub(crate) fn new() -> Self {
        PriceCache {
            seq: AtomicU64::new(0),
            ticket: AtomicU64::new(EMPTY),
            epoch: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            period_ns: AtomicU64::new(0),
            magic_lo: AtomicU64::new(0),
            magic_hi: AtomicU64::new(0),
        }
    }

    /// The price of the regime published under `ticket`, if the cache holds it whole.
    #[inline]
    pub(crate) fn get(&self, ticket: u32) -> Option<Price> {
        // Acquire: pairs with the publishing Release store; the words below are at least
        // that writer's.
        let s = self.seq.load(Ordering::Acquire);
        // Relaxed (all words): validated by `seq` below.
        if s & 1 == 1 || self.ticket.load(Ordering::Relaxed) != ticket as u64 {
            return None;
        }
        let price = Price {
            epoch: self.epoch.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            period_ns: self.period_ns.load(Ordering::Relaxed),
            magic: (self.magic_hi.load(Ordering::Relaxed) as u128) << 64
                | self.magic_lo.load(Ordering::Relaxed) as u128,
        };
        // Acquire fence: a word written by a later writer makes its odd `seq` visible to the
        // load below (its Release fence synchronises with this one).
        fence(Ordering::Acquire);
        // Relaxed: ordered by the fence above.
        (self.seq.load(Ordering::Relaxed) == s).then_some(price)
    }

    /// Stores `price` as the regime of `ticket`, unless another writer is storing now (then
    /// this one leaves it to them: a cache is an optimisation, never a wait).
    pub(crate) fn put(&self, ticket: u32, price: Price) {
        self.put_stopping(ticket, price, false);
    }

    /// [`put`](Self::put), stopping for ever halfway when `stop` (a writer descheduled or
    /// killed with `seq` odd). Returns whether it stored.
    pub(crate) fn put_stopping(&self, ticket: u32, price: Price, stop: bool) -> bool {
        // Relaxed: the CAS below checks the value.
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 1 {
            return false;
        }
        // Acquire on success: the previous writer's words happen before ours (see the module
        // doc). Relaxed on failure: another writer got there; we leave.
        if self
            .seq
            .compare_exchange(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        // Release fence: a reader that reads any word below also sees `seq` odd.
        fence(Ordering::Release);
        // Relaxed (all words): published by the Release store of `seq`.
        self.ticket.store(ticket as u64, Ordering::Relaxed);
        self.epoch.store(price.epoch, Ordering::Relaxed);
        self.tokens.store(price.tokens, Ordering::Relaxed);
        if stop {
            return false;
        }
        self.period_ns.store(price.period_ns, Ordering::Relaxed);
        self.magic_lo.store(price.magic as u64, Ordering::Relaxed);
        self.magic_hi
            .store((price.magic >> 64) as u64, Ordering::Relaxed);
        // Release: publishes the words to readers that Acquire this value.
        self.seq.store(s + 2, Ordering::Release);
        true
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;

    fn raw(tokens: u64, period_ns: u64) -> RawRate {
        RawRate { tokens, period_ns }
    }

    #[test]
    fn a_rate_of_whole_tokens_per_nanosecond_prices_without_a_quotient() {
        // 10^9 per second is 1 per ns: no overflow of t × b for 584 years.
        let p = Price::new(raw(1_000_000_000, 1_000_000_000), 5);
        assert_eq!((p.tokens, p.period_ns, p.magic), (1, 1, 0));
        assert_eq!(
            p.earned(5 + (1 << 40), 5 + (1 << 62)),
            (1 << 62) - (1 << 40)
        );
    }

    #[test]
    fn a_price_counts_as_the_rate_does_across_the_64_bit_edge() {
        let r = raw(7, 3);
        let p = Price::new(r, 100);
        let edge = u64::MAX / 7;
        for (a, b) in [
            (0, 1),
            (1, 2),
            (0, 3),
            (edge - 5, edge),
            (edge, edge + 1),
            (3, edge + 9),
        ] {
            assert_eq!(p.earned(100 + a, 100 + b), r.count_exact(a, b), "{a} {b}");
        }
    }

    #[test]
    fn a_price_counts_exactly_long_after_its_epoch() {
        // 50 MiB/s is 4096 per 78125 ns: t × b leaves 64 bits 52 days after the epoch.
        let r = raw(50 << 20, 1_000_000_000);
        let p = Price::new(r, 0);
        let day = 86_400_000_000_000u64;
        // Every offset within a period and a few lengths, so that the remainder of t × a
        // decides some of the counts.
        for start in [60 * day, 10_000 * day] {
            for off in (0..78_125).step_by(97) {
                for len in [1, 19, 78_124, 1 << 20] {
                    let a = start + off;
                    assert_eq!(p.earned(a, a + len), r.count_exact(a, a + len), "{a} {len}");
                }
            }
        }
    }

    #[test]
    fn the_reciprocal_divides_exactly_at_the_extremes() {
        for d in [2, 3, 7, 1 << 32, (1 << 63) + 1, u64::MAX - 1, u64::MAX] {
            let p = Price {
                epoch: 0,
                tokens: 1,
                period_ns: d,
                magic: magic(d),
            };
            for n in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX - 1, u64::MAX] {
                assert_eq!(p.quot(n), n / d, "{n} / {d}");
            }
        }
    }

    #[test]
    fn a_cache_returns_only_the_ticket_it_holds_and_a_stopped_writer_empties_it() {
        let c = PriceCache::new();
        let p = Price::new(raw(7, 3), 10);
        assert_eq!(c.get(0), None);
        c.put(4, p);
        assert_eq!(c.get(4), Some(p));
        assert_eq!(c.get(5), None);
        assert!(!c.put_stopping(5, Price::new(raw(1, 1), 20), true));
        assert_eq!(c.get(4), None);
        assert_eq!(c.get(5), None);
        // A writer stopped halfway blocks nobody: later writers leave, readers go without.
        assert!(!c.put_stopping(6, p, false));
        assert_eq!(c.get(6), None);
    }

    proptest::proptest! {
        /// A price counts exactly as the rate it was built from, on both paths.
        #[test]
        fn a_price_counts_as_its_rate(
            tokens in proptest::prop_oneof![1u64..=1_000, 1u64..=u32::MAX as u64, 1u64..],
            period_ns in proptest::prop_oneof![1u64..=1_000, 1u64..=1_000_000_000_000, 1u64..],
            scale in 1u64..=1_000,
            epoch in 0u64..(1 << 40),
            a in proptest::prop_oneof![0u64..=1_000_000, 0u64..(1 << 40), 0u64..(1 << 61)],
            len in proptest::prop_oneof![0u64..=1_000, 0u64..(1 << 40), 0u64..(1 << 61)],
        ) {
            // A common factor, so that the reduction matters.
            let tokens = tokens.saturating_mul(scale);
            let period_ns = period_ns.saturating_mul(scale);
            let r = raw(tokens, period_ns);
            let p = Price::new(r, epoch);
            let b = a.saturating_add(len);
            proptest::prop_assert_eq!(p.earned(epoch + a, epoch + b), r.count_exact(a, b));
        }

        /// The reciprocal's quotient is the quotient, for every 64-bit dividend and divisor.
        #[test]
        fn the_reciprocal_divides_exactly(d in 2u64.., n in proptest::prelude::any::<u64>()) {
            let p = Price { epoch: 0, tokens: 1, period_ns: d, magic: magic(d) };
            proptest::prop_assert_eq!(p.quot(n), n / d);
        }
    }
}
