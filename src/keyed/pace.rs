//! The per-key arithmetic: a key's whole state is two words, and a check is a few integer
//! operations on them at a time the caller read once.
//!
//! Tokens are counted on a virtual scale shared by every key of the throttle:
//! `V(t) = floor(tokens × t / period)` (modulo 2^64), the tokens the rate has issued from the
//! clock's origin to `t`. A key keeps `empty`, the point of that scale at which its bucket is
//! empty, and `last`, when it was last checked. Its tokens at `t` are
//! `min(limit, V(t) − empty)`, and a grant of `n` moves `empty` up by `n`. Because the count is
//! taken from one origin, consecutive intervals telescope: over any window the key earns exactly
//! `V(t₁) − V(t₀) = floor(rate × t₁) − floor(rate × t₀)`, with no remainder carried and none lost.
//!
//! # Invariant
//!
//! After every update, `0 ≤ V(last) − empty ≤ limit` (wrapping difference): the tokens the key
//! held when it was last checked. A key unused for at least the refill time is full whatever its
//! `empty`, so the wrapping difference is only ever taken over at most `limit` plus one refill
//! of tokens, below 2^64 for any valid limit (≤ 2^62).

use std::time::Duration;

use crate::bucket::Rate;

/// One key's state: 16 bytes, no padding, no atomics (it is only touched under its shard's lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyState {
    /// When the key was last checked, in nanoseconds on the throttle's clock.
    pub(super) last: u64,
    /// The point of the virtual scale `V` at which this key's bucket is empty (wrapping).
    empty: u64,
}

/// What a refused take reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shortfall {
    /// Tokens missing now.
    pub(super) missing: u64,
    /// How long until they accrue.
    pub(super) retry_after: Duration,
}

/// The throttle's rate and limit, with what a check needs precomputed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pace {
    tokens: u64,
    period: u64,
    limit: u64,
    /// `duration_for(limit)` in nanoseconds (saturated): unused this long, a key is full.
    refill: u64,
    /// `tokens × period < 2^64`: `V` is computed in 64-bit arithmetic.
    narrow: bool,
    /// Divides by `period` without a division instruction.
    by_period: Divisor,
}

/// Division of any `u64` by a fixed divisor `d ≥ 1` with two multiplications: with
/// `c = ceil(2^128 / d)`, `x / d = (c × x) >> 128` exactly for every `x < 2^64` (Lemire, Kaser
/// and Kurz, "Faster Remainder by Direct Computation", 2019, Theorem 1 with F = 2N = 128).
#[derive(Debug, Clone, Copy)]
struct Divisor {
    d: u64,
    /// `ceil(2^128 / d)`, or 0 for `d = 1` (whose `c` is 2^128).
    c: u128,
}

impl Divisor {
    fn new(d: u64) -> Self {
        let c = if d == 1 { 0 } else { u128::MAX / d as u128 + 1 };
        Divisor { d, c }
    }

    /// `(x / d, x % d)`.
    #[inline]
    fn div_rem(&self, x: u64) -> (u64, u64) {
        if self.c == 0 {
            return (x, 0);
        }
        let (c_lo, c_hi) = (self.c as u64 as u128, self.c >> 64);
        let x = x as u128;
        // (c × x) >> 128, the 192-bit product taken in two halves.
        let q = ((c_hi * x + ((c_lo * x) >> 64)) >> 64) as u64;
        (q, x as u64 - q * self.d)
    }
}

impl Pace {
    /// `rate` (validated: tokens and period positive, period within `u64` nanoseconds) and
    /// `limit` (at least 1).
    pub(super) fn new(rate: Rate, limit: u64) -> Self {
        let period = u64::try_from(rate.period().as_nanos()).unwrap_or(u64::MAX);
        // The rate in lowest terms: the same count, and more rates take the 64-bit path.
        let g = gcd(rate.tokens(), period);
        let (tokens, period) = (rate.tokens() / g, period / g);
        let refill = u64::try_from(rate.duration_for(limit).as_nanos()).unwrap_or(u64::MAX);
        Pace {
            tokens,
            period,
            limit,
            refill,
            narrow: tokens.checked_mul(period).is_some(),
            by_period: Divisor::new(period),
        }
    }

    /// `(V(now) mod 2^64, (tokens × now) mod period)`: the tokens issued up to `now` and the
    /// fraction of the next one, as a numerator over `period`.
    #[inline]
    pub(super) fn count(&self, now: u64) -> (u64, u64) {
        if self.narrow {
            // tokens × now = tokens × (q × period + r): the whole part is q × tokens plus
            // floor(r × tokens / period), and r × tokens < tokens × period < 2^64.
            let (q, r) = self.by_period.div_rem(now);
            let (whole, frac) = self.by_period.div_rem(r * self.tokens);
            (q.wrapping_mul(self.tokens).wrapping_add(whole), frac)
        } else {
            let x = self.tokens as u128 * now as u128;
            let p = self.period as u128;
            // Truncating the quotient keeps it modulo 2^64, which is all the differences need.
            ((x / p) as u64, (x % p) as u64)
        }
    }

    /// The state of a key first seen at `now`: a full bucket.
    #[inline]
    pub(super) fn fresh(&self, now: u64) -> KeyState {
        KeyState {
            last: now,
            empty: self.count(now).0.wrapping_sub(self.limit),
        }
    }

    /// Tokens `state` holds at `now` (no earlier than its `last`) on the scale point `v = V(now)`.
    #[inline]
    fn held(&self, state: &KeyState, now: u64, v: u64) -> u64 {
        if now - state.last >= self.refill {
            return self.limit;
        }
        // `now ≥ last`, so V(now) − empty ≥ V(last) − empty ≥ 0, and it is below
        // limit + one refill of tokens ≤ 2 × 2^62 + 1 < 2^64: the unsigned difference is exact.
        v.wrapping_sub(state.empty).min(self.limit)
    }

    /// Tokens the key holds at `now`, without counting a use.
    pub(super) fn available(&self, state: &KeyState, now: u64) -> u64 {
        let now = now.max(state.last);
        self.held(state, now, self.count(now).0)
    }

    /// Takes `cost` (in `1..=limit`) tokens at `now` if they are there, and counts a use either
    /// way. A `now` before the key's last check (two threads whose clock readings reach the
    /// shard's lock out of order) counts as that check's time.
    #[inline]
    pub(super) fn take(&self, state: &mut KeyState, now: u64, cost: u64) -> Result<(), Shortfall> {
        let now = now.max(state.last);
        let (v, frac) = self.count(now);
        let held = self.held(state, now, v);
        state.last = now;
        if held >= cost {
            state.empty = v.wrapping_sub(held - cost);
            return Ok(());
        }
        // Normalised (a full bucket's surplus dropped) so the invariant holds for the next check.
        state.empty = v.wrapping_sub(held);
        let missing = cost - held;
        // The next `missing` tokens are issued once tokens × elapsed + frac ≥ missing × period.
        let num = (missing as u128 * self.period as u128).saturating_sub(frac as u128);
        let ns = num.div_ceil(self.tokens as u128);
        let retry_after = u64::try_from(ns).map_or(Duration::MAX, Duration::from_nanos);
        Err(Shortfall {
            missing,
            retry_after,
        })
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_narrow_count_agrees_with_the_wide_one() {
        for (tokens, period) in [(7u64, 3_000_000_000u64), (1, 1_000_000), (3, 7)] {
            let narrow = Pace::new(Rate::new(tokens, Duration::from_nanos(period)), 10);
            assert_eq!((narrow.tokens, narrow.period), (tokens, period));
            assert!(narrow.narrow);
            let wide = Pace {
                narrow: false,
                ..narrow
            };
            for now in [
                0,
                1,
                6,
                7,
                999_999_999,
                3_000_000_001,
                u64::MAX / 3,
                u64::MAX,
            ] {
                assert_eq!(
                    narrow.count(now),
                    wide.count(now),
                    "{tokens}/{period} at {now}"
                );
            }
        }
    }

    #[test]
    fn the_largest_bucket_taken_from_refills_to_its_limit_within_the_refill_time() {
        // The widest difference the state ever takes: a full bucket of 2^62 less one token,
        // plus all but a nanosecond of a refill's tokens.
        let limit = crate::BucketConfig::MAX_LIMIT;
        let pace = Pace::new(Rate::per_second(Rate::MAX_PER_SECOND), limit);
        let mut s = pace.fresh(1_000);
        pace.take(&mut s, 1_000, 1).unwrap();
        let now = 1_000 + pace.refill - 1;
        assert_eq!(pace.available(&s, now), limit);
        pace.take(&mut s, now, limit).unwrap();
        assert_eq!(pace.available(&s, now), 0);
    }

    #[test]
    fn the_divisor_divides_exactly() {
        let xs = [
            0,
            1,
            2,
            3,
            999_999_999,
            1 << 32,
            (1 << 63) + 1,
            u64::MAX - 1,
            u64::MAX,
        ];
        for d in [
            1,
            2,
            3,
            7,
            390_625,
            1_000_000_000,
            (1 << 32) + 1,
            u64::MAX / 3,
            u64::MAX,
        ] {
            let div = Divisor::new(d);
            for x in xs
                .iter()
                .copied()
                .chain((0..1_000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            {
                assert_eq!(div.div_rem(x), (x / d, x % d), "{x} / {d}");
            }
        }
    }

    #[test]
    fn the_rate_is_kept_in_lowest_terms() {
        let p = Pace::new(Rate::per_second(10 << 20), 1);
        assert_eq!((p.tokens, p.period), (4096, 390_625));
        let max = Pace::new(Rate::per_second(Rate::MAX_PER_SECOND), 1);
        assert_eq!(gcd(max.tokens, max.period), 1);
    }

    #[test]
    fn a_take_that_falls_short_says_exactly_when_the_tokens_are_there() {
        // 7 tokens per 3 s: the 8th token after t = 0 is issued at ceil(8 × 3 / 7 s).
        let pace = Pace::new(Rate::new(7, Duration::from_secs(3)), 7);
        let mut s = pace.fresh(0);
        pace.take(&mut s, 0, 7).unwrap();
        let short = pace.take(&mut s, 1, 1).unwrap_err();
        assert_eq!(short.missing, 1);
        let at = 1 + short.retry_after.as_nanos() as u64;
        assert!(pace.take(&mut s, at - 1, 1).is_err());
        pace.take(&mut s, at, 1).unwrap();
    }
}
