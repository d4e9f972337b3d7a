//! [`Rate`]: tokens per period, and the exact integer arithmetic on it.

use std::fmt;
use std::time::Duration;

use crate::error::ConfigError;

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// A rate of `tokens` per `period`, kept as given (never rounded to a per-second figure).
///
/// Any rational rate can be written, such as 7 tokens per 3 s. A `Rate` is only checked when it
/// reaches a bucket ([`BucketConfig`](crate::BucketConfig) or
/// [`set_rate`](crate::SharedTokenBucket::set_rate)); [`Rate::validate`] runs the same checks.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::Rate;
///
/// let r = Rate::new(7, Duration::from_secs(3));
/// assert_eq!(r.tokens_in(Duration::from_secs(1)), 2); // floor(7/3)
/// assert_eq!(r.duration_for(7), Duration::from_secs(3));
/// assert!(Rate::per_second(0).validate().is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    tokens: u64,
    period: Duration,
}

impl Rate {
    /// The largest rate a bucket accepts, in tokens per second: `2^63 / 3600`, so that one hour
    /// of tokens stays below 2^63 (the same bound as Seastar's bucket). About 2.56 × 10^15/s.
    pub const MAX_PER_SECOND: u64 = (1u64 << 63) / 3600;

    /// `tokens` per `period`.
    pub const fn new(tokens: u64, period: Duration) -> Rate {
        Rate { tokens, period }
    }

    /// `tokens` per second.
    pub const fn per_second(tokens: u64) -> Rate {
        Rate::new(tokens, Duration::from_secs(1))
    }

    /// `tokens` per millisecond.
    pub const fn per_millisecond(tokens: u64) -> Rate {
        Rate::new(tokens, Duration::from_millis(1))
    }

    /// Tokens per period, as given.
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The period, as given.
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The rate as a (rounded) number of tokens per second, for display and plotting.
    pub fn per_second_f64(&self) -> f64 {
        self.tokens as f64 / self.period.as_secs_f64()
    }

    /// Compares two rates as the rational numbers they are: 7 per 3 s equals 14 per 6 s (which
    /// `==`, comparing the fields as given, does not say). Exact for every rate a bucket accepts
    /// (a period of at most `u64::MAX` nanoseconds); longer periods compare in floating point.
    ///
    /// ```
    /// use std::cmp::Ordering;
    /// use std::time::Duration;
    /// use iothrottle::Rate;
    ///
    /// let r = Rate::new(7, Duration::from_secs(3));
    /// assert_eq!(r.cmp_rate(&Rate::new(14, Duration::from_secs(6))), Ordering::Equal);
    /// assert_eq!(r.cmp_rate(&Rate::per_second(3)), Ordering::Less);
    /// ```
    pub fn cmp_rate(&self, other: &Rate) -> std::cmp::Ordering {
        // a/p < b/q  <=>  a·q < b·p. With p, q < 2^64 ns and a, b < 2^64 both products fit u128.
        let lhs = (self.tokens as u128).checked_mul(other.period.as_nanos());
        let rhs = (other.tokens as u128).checked_mul(self.period.as_nanos());
        match (lhs, rhs) {
            (Some(l), Some(r)) => l.cmp(&r),
            _ => self.per_second_f64().total_cmp(&other.per_second_f64()),
        }
    }

    /// Checks the rate: positive, a period that fits `u64` nanoseconds, at most
    /// [`MAX_PER_SECOND`](Self::MAX_PER_SECOND).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let period_ns = self.period.as_nanos();
        if self.tokens == 0 || period_ns == 0 {
            return Err(ConfigError::ZeroRate {
                tokens: self.tokens,
                period: self.period,
            });
        }
        if period_ns > u64::MAX as u128 {
            return Err(ConfigError::PeriodTooLong {
                period: self.period,
            });
        }
        // tokens / period_s <= MAX  <=>  tokens * 1e9 <= MAX * period_ns; both sides fit u128.
        if self.tokens as u128 * NANOS_PER_SEC > Self::MAX_PER_SECOND as u128 * period_ns {
            return Err(ConfigError::RateTooHigh {
                tokens: self.tokens,
                period: self.period,
                max_per_second: Self::MAX_PER_SECOND,
            });
        }
        Ok(())
    }

    /// Whole tokens that accumulate in `elapsed`: `floor(tokens × elapsed / period)`, exact.
    ///
    /// Returns 0 for an invalid (zero) rate.
    pub fn tokens_in(&self, elapsed: Duration) -> u128 {
        match self.raw() {
            Some(raw) => raw.tokens_in(elapsed.as_nanos()).0,
            None => 0,
        }
    }

    /// How long until `n` more tokens accumulate: `ceil(n × period / tokens)`.
    ///
    /// Rounds up, so a positive `n` never gets a zero duration (the busy loop of seastar PR
    /// #1722). Saturates at [`Duration::MAX`]; an invalid (zero) rate also gives `Duration::MAX`.
    pub fn duration_for(&self, n: u64) -> Duration {
        match self.raw() {
            Some(raw) => raw.duration_for(n),
            None => Duration::MAX,
        }
    }

    /// The rate in the integer form the bucket stores, if it is valid.
    pub(crate) fn raw(&self) -> Option<RawRate> {
        self.validate().ok()?;
        Some(RawRate {
            tokens: self.tokens,
            period_ns: self.period.as_nanos() as u64,
        })
    }
}

impl fmt::Debug for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tokens per {:?}", self.tokens, self.period)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A validated rate: `tokens ≥ 1` per `period_ns ≥ 1` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawRate {
    pub(crate) tokens: u64,
    pub(crate) period_ns: u64,
}

impl RawRate {
    /// `(floor(tokens × elapsed_ns / period), remainder)`, where the remainder (in units of
    /// token-nanoseconds, below `period_ns`) is what a later call must carry to stay exact.
    pub(crate) fn tokens_in(self, elapsed_ns: u128) -> (u128, u64) {
        // tokens < 2^64 and elapsed_ns < 2^64 in every caller: the product fits u128.
        let num = self.tokens as u128 * elapsed_ns;
        let p = self.period_ns as u128;
        (num / p, (num % p) as u64)
    }

    pub(crate) fn duration_for(self, n: u64) -> Duration {
        let num = n as u128 * self.period_ns as u128;
        let ns = num.div_ceil(self.tokens as u128);
        let secs = ns / NANOS_PER_SEC;
        match u64::try_from(secs) {
            Ok(secs) => Duration::new(secs, (ns % NANOS_PER_SEC) as u32),
            Err(_) => Duration::MAX,
        }
    }

    pub(crate) fn to_rate(self) -> Rate {
        Rate::new(self.tokens, Duration::from_nanos(self.period_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_for_rounds_up_never_zero() {
        let r = Rate::per_second(1_000_000_000_000);
        assert_eq!(r.duration_for(1), Duration::from_nanos(1));
        let r = Rate::new(7, Duration::from_secs(3));
        // 1 token takes 428_571_428.57 ns: rounded up.
        assert_eq!(r.duration_for(1), Duration::from_nanos(428_571_429));
        assert_eq!(r.duration_for(0), Duration::ZERO);
    }

    #[test]
    fn duration_for_saturates() {
        let r = Rate::new(1, Duration::from_nanos(u64::MAX));
        assert_eq!(r.duration_for(u64::MAX), Duration::MAX);
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(matches!(
            Rate::per_second(0).validate(),
            Err(ConfigError::ZeroRate { .. })
        ));
        assert!(matches!(
            Rate::new(5, Duration::ZERO).validate(),
            Err(ConfigError::ZeroRate { .. })
        ));
        assert!(matches!(
            Rate::per_second(Rate::MAX_PER_SECOND + 1).validate(),
            Err(ConfigError::RateTooHigh { .. })
        ));
        assert!(Rate::per_second(Rate::MAX_PER_SECOND).validate().is_ok());
        assert!(matches!(
            Rate::new(1, Duration::from_secs(u64::MAX)).validate(),
            Err(ConfigError::PeriodTooLong { .. })
        ));
        let msg = Rate::per_second(u64::MAX)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(msg.contains(&Rate::MAX_PER_SECOND.to_string()), "{msg}");
    }

    #[test]
    fn cmp_rate_is_exact_and_total() {
        use std::cmp::Ordering::*;
        let third = Rate::new(1, Duration::from_secs(3));
        assert_eq!(
            third.cmp_rate(&Rate::new(1_000, Duration::from_secs(3_000))),
            Equal
        );
        // 1/3 token per second vs 333_333_333 per 10^9 s: differ only in the 10th digit.
        assert_eq!(
            third.cmp_rate(&Rate::new(333_333_333, Duration::from_secs(1_000_000_000))),
            Greater
        );
        // Periods beyond u64 nanoseconds do not overflow.
        let slow = Rate::new(u64::MAX, Duration::from_secs(u64::MAX));
        assert_eq!(slow.cmp_rate(&Rate::per_second(2)), Less);
        assert_eq!(Rate::per_second(2).cmp_rate(&slow), Greater);
    }

    #[test]
    fn tokens_in_is_exact_for_awkward_rates() {
        let r = Rate::new(7, Duration::from_secs(3));
        assert_eq!(r.tokens_in(Duration::from_secs(3)), 7);
        assert_eq!(r.tokens_in(Duration::from_secs(300)), 700);
        assert_eq!(r.tokens_in(Duration::from_nanos(428_571_428)), 0);
        assert_eq!(r.tokens_in(Duration::from_nanos(428_571_429)), 1);
    }
}
