//! [`Rate`]: tokens per period, and the exact integer arithmetic on it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::error::{ConfigError, ParseRateError};

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

    /// `n` bytes per second, for a bucket whose tokens are bytes (the same as
    /// [`per_second`](Self::per_second); displayed in binary units when it is a whole number of
    /// MiB or GiB).
    ///
    /// ```
    /// use iothrottle::Rate;
    ///
    /// assert_eq!(Rate::bytes_per_second(50 << 20), Rate::mib_per_second(50));
    /// assert_eq!(Rate::mib_per_second(50).to_string(), "50 MiB/s");
    /// assert_eq!("50MiB/s".parse::<Rate>().unwrap(), Rate::mib_per_second(50));
    /// assert_eq!("100MB/s".parse::<Rate>().unwrap(), Rate::bytes_per_second(100_000_000));
    /// ```
    pub const fn bytes_per_second(n: u64) -> Rate {
        Rate::per_second(n)
    }

    /// `n` KiB (1024 bytes) per second. `u32` keeps the byte count within `u64`.
    pub const fn kib_per_second(n: u32) -> Rate {
        Rate::per_second((n as u64) << 10)
    }

    /// `n` MiB (2^20 bytes) per second. `u32` keeps the byte count within `u64`.
    pub const fn mib_per_second(n: u32) -> Rate {
        Rate::per_second((n as u64) << 20)
    }

    /// `n` GiB (2^30 bytes) per second. `u32` keeps the byte count within `u64`.
    pub const fn gib_per_second(n: u32) -> Rate {
        Rate::per_second((n as u64) << 30)
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
    /// `==`, comparing the fields as given, does not say). Exact for every `Rate`, including
    /// periods beyond `u64` nanoseconds. A zero period counts as an infinite rate (two of them
    /// compare by tokens, and zero tokens per zero time as zero).
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
        let (p, q) = (self.period.as_nanos(), other.period.as_nanos());
        let (a, b) = (self.tokens as u128, other.tokens as u128);
        let infinite = |t: u128, p: u128| p == 0 && t > 0;
        match (infinite(a, p), infinite(b, q)) {
            (true, true) => a.cmp(&b),
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            // a/p vs b/q  <=>  a·q vs b·p (a zero rate with a zero period has a = 0).
            (false, false) => mul_wide(a, q).cmp(&mul_wide(b, p)),
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

    /// Whole tokens that accumulate in `elapsed`: `floor(tokens × elapsed / period)`, exact
    /// whenever it fits `u128`, and `u128::MAX` (more than any bucket can hold) when it does
    /// not. Total: any `Rate`, any `Duration`, no panic, no wrap.
    ///
    /// A zero-token rate earns 0; a zero period with tokens (an infinite rate) earns
    /// `u128::MAX` in any positive time.
    ///
    /// ```
    /// use std::time::Duration;
    /// use iothrottle::Rate;
    ///
    /// let max = Rate::per_second(Rate::MAX_PER_SECOND);
    /// assert_eq!(max.tokens_in(Duration::from_secs(1 << 40)), (Rate::MAX_PER_SECOND as u128) << 40);
    /// let per_ns = Rate::new(u64::MAX, Duration::from_nanos(1));
    /// assert_eq!(per_ns.tokens_in(Duration::MAX), u128::MAX); // beyond u128: saturated
    /// ```
    pub fn tokens_in(&self, elapsed: Duration) -> u128 {
        let (t, p, e) = (
            self.tokens as u128,
            self.period.as_nanos(),
            elapsed.as_nanos(),
        );
        if t == 0 || e == 0 {
            return 0;
        }
        if p == 0 {
            return u128::MAX;
        }
        mul_div(t, e, p, false).unwrap_or(u128::MAX)
    }

    /// How long until `n` more tokens accumulate: `ceil(n × period / tokens)`.
    ///
    /// Rounds up, so a positive `n` never gets a zero duration (the busy loop of seastar PR
    /// #1722), except at an infinite rate (zero period). Total: saturates at
    /// [`Duration::MAX`] (about 5.8 × 10^11 years) when the time does not fit a `Duration`,
    /// and a zero-token rate, which never earns anything, also gives `Duration::MAX` for any
    /// `n > 0`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use iothrottle::Rate;
    ///
    /// assert_eq!(Rate::new(1, Duration::MAX).duration_for(2), Duration::MAX);
    /// assert_eq!(Rate::per_second(1).duration_for(u64::MAX), Duration::from_secs(u64::MAX));
    /// ```
    pub fn duration_for(&self, n: u64) -> Duration {
        let (t, p) = (self.tokens as u128, self.period.as_nanos());
        if n == 0 || p == 0 {
            return Duration::ZERO;
        }
        if t == 0 {
            return Duration::MAX;
        }
        mul_div(n as u128, p, t, true).map_or(Duration::MAX, duration_from_nanos)
    }

    /// The rate in the integer form the bucket stores, if it is valid.
    pub(crate) fn raw(&self) -> Result<RawRate, ConfigError> {
        self.validate()?;
        Ok(RawRate {
            tokens: self.tokens,
            period_ns: self.period.as_nanos() as u64,
        })
    }
}

/// `floor(a × b / d)` (or the ceiling when `up`), `None` when it exceeds `u128::MAX`. `d > 0`.
fn mul_div(a: u128, b: u128, d: u128, up: bool) -> Option<u128> {
    if let Some(prod) = a.checked_mul(b) {
        return Some(if up { prod.div_ceil(d) } else { prod / d });
    }
    // a × b = a × q × d + a × r with r < d: the first term gives a × q exactly (or overflows,
    // and then so does the result), the second `floor(a × r / d) < a` by long division.
    let (q, r) = (b / d, b % d);
    let whole = a.checked_mul(q)?;
    let (mut quot, mut rem) = (0u128, 0u128);
    for bit in (0..128).rev() {
        // (quot, rem) = 2 × (quot, rem), keeping rem < d without overflowing.
        quot <<= 1;
        if rem >= d - rem {
            quot += 1;
            rem -= d - rem;
        } else {
            rem <<= 1;
        }
        if (a >> bit) & 1 == 1 {
            if rem >= d - r {
                quot += 1;
                rem -= d - r;
            } else {
                rem += r;
            }
        }
    }
    let exact = whole.checked_add(quot)?;
    if up && rem != 0 {
        exact.checked_add(1)
    } else {
        Some(exact)
    }
}

/// The full 256-bit product `a × b`, as `(high, low)` halves (compares as the number).
fn mul_wide(a: u128, b: u128) -> (u128, u128) {
    const LO: u128 = u64::MAX as u128;
    let (a1, a0, b1, b0) = (a >> 64, a & LO, b >> 64, b & LO);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    // Middle column: at most three 64-bit halves, fits u128.
    let mid = (p00 >> 64) + (p01 & LO) + (p10 & LO);
    let low = (mid << 64) | (p00 & LO);
    let high = p11 + (p01 >> 64) + (p10 >> 64) + (mid >> 64);
    (high, low)
}

/// `ns` nanoseconds, or `Duration::MAX` when it does not fit.
fn duration_from_nanos(ns: u128) -> Duration {
    match u64::try_from(ns / NANOS_PER_SEC) {
        Ok(secs) => Duration::new(secs, (ns % NANOS_PER_SEC) as u32),
        Err(_) => Duration::MAX,
    }
}

impl fmt::Debug for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tokens per {:?}", self.tokens, self.period)
    }
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Human units, exact and round-trippable through [`FromStr`] for every valid rate:
///
/// | rate | shown |
/// |---|---|
/// | a whole number of GiB or MiB per second | `"2 GiB/s"`, `"50 MiB/s"` |
/// | other rates per second | `"1000/s"` |
/// | per one ms, µs or ns | `"5/ms"`, `"5/µs"`, `"5/ns"` |
/// | any other period | `"7 per 3s"`, `"1 per 1500ms"`, `"3 per 2500ns"` (the largest exact unit) |
///
/// ```
/// use std::time::Duration;
/// use iothrottle::Rate;
///
/// for r in [Rate::gib_per_second(2), Rate::per_second(1000), Rate::new(7, Duration::from_secs(3))] {
///     assert_eq!(r.to_string().parse::<Rate>().unwrap(), r);
/// }
/// assert_eq!(Rate::new(7, Duration::from_secs(3)).to_string(), "7 per 3s");
/// ```
impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.tokens;
        let ns = self.period.as_nanos();
        let unit = match ns {
            1_000_000_000 => "s",
            1_000_000 => "ms",
            1_000 => "µs",
            1 => "ns",
            _ => "",
        };
        if unit == "s" && t > 0 && t.is_multiple_of(GIB) {
            write!(f, "{} GiB/s", t / GIB)
        } else if unit == "s" && t > 0 && t.is_multiple_of(MIB) {
            write!(f, "{} MiB/s", t / MIB)
        } else if !unit.is_empty() {
            write!(f, "{t}/{unit}")
        } else if ns.is_multiple_of(NANOS_PER_SEC) {
            write!(f, "{t} per {}s", ns / NANOS_PER_SEC)
        } else if ns.is_multiple_of(1_000_000) {
            write!(f, "{t} per {}ms", ns / 1_000_000)
        } else if ns.is_multiple_of(1_000) {
            write!(f, "{t} per {}µs", ns / 1_000)
        } else {
            write!(f, "{t} per {ns}ns")
        }
    }
}

/// Parses `"50MiB/s"`, `"50 MiB/s"`, `"1.5 MiB/s"`, `"2GiB/s"`, `"100MB/s"`, `"1000/s"`,
/// `"5/ms"` and `"7 per 3s"`, and checks the result like a bucket would ([`Rate::validate`]).
///
/// Grammar: `N [UNIT]/TIME` or `N per M TIME`, spaces optional around the unit, where `N` is a
/// decimal number with an optional fraction (`1.5`) and `M` a decimal integer, `UNIT` is one of
/// `B`, `KiB`, `MiB`, `GiB`, `TiB` (binary) or `kB`, `MB`, `GB`, `TB` (decimal), and `TIME` is
/// `s`, `ms`, `us`/`µs` or `ns`. Units and `per` are matched without regard to case, as people
/// write them (`"50 mib/s"`, `"1 GB/S"`; `MB` is always bytes, never bits).
///
/// A fraction is kept exactly, never rounded: `"1.5 MiB/s"` is 1,572,864 tokens per second, and
/// a fraction of a token is a longer period (`"1.5/s"` is 3 per 2 s, `"0.1/ms"` 1 per 10 ms).
/// Every problem is a [`ParseRateError`]: an amount or period too large for `u64` (tokens, or
/// nanoseconds of the period) is [`ParseRateError::Overflow`].
///
/// ```
/// use std::time::Duration;
/// use iothrottle::Rate;
///
/// assert_eq!("1.5 MiB/s".parse::<Rate>()?, Rate::per_second(3 << 19));
/// assert_eq!("50 mib/s".parse::<Rate>()?, Rate::mib_per_second(50));
/// assert_eq!("1.5/s".parse::<Rate>()?, Rate::new(3, Duration::from_secs(2)));
/// # Ok::<(), iothrottle::ParseRateError>(())
/// ```
impl FromStr for Rate {
    type Err = ParseRateError;

    fn from_str(s: &str) -> Result<Rate, ParseRateError> {
        let input = s;
        let syntax = || ParseRateError::Syntax {
            input: input.to_owned(),
        };
        let overflow = || ParseRateError::Overflow {
            input: input.to_owned(),
        };
        let (n, rest) = split_decimal(s.trim()).ok_or_else(syntax)?;
        let rest = rest.trim_start();
        let per = rest
            .get(..4)
            .filter(|p| p.eq_ignore_ascii_case("per "))
            .map(|_| &rest[4..]);
        // The amount as `tokens / 10^scale` tokens per `period_ns` nanoseconds.
        let (tokens, period_ns) = if let Some(period) = per {
            let (m, unit) = split_number(period.trim_start()).ok_or_else(syntax)?;
            let m = m.parse::<u128>().map_err(|_| overflow())?;
            let ns = m
                .checked_mul(time_unit(unit.trim(), input)?)
                .ok_or_else(overflow)?;
            (n.value(1).ok_or_else(overflow)?, ns)
        } else {
            let (unit, time) = rest.split_once('/').ok_or_else(syntax)?;
            let mult = match unit.trim().to_ascii_lowercase().as_str() {
                "" | "b" => 1,
                "kib" => KIB,
                "mib" => MIB,
                "gib" => GIB,
                "tib" => 1 << 40,
                "kb" => 1_000,
                "mb" => 1_000_000,
                "gb" => 1_000_000_000,
                "tb" => 1_000_000_000_000,
                _ => {
                    return Err(ParseRateError::UnknownUnit {
                        input: input.to_owned(),
                        unit: unit.trim().to_owned(),
                    })
                }
            };
            let ns = time_unit(time.trim(), input)?;
            (n.value(mult).ok_or_else(overflow)?, ns)
        };
        // tokens / 10^scale per period_ns, in lowest terms: exact.
        let den = 10u128.pow(n.scale);
        let g = gcd(tokens, den).max(1);
        let tokens = u64::try_from(tokens / g).map_err(|_| overflow())?;
        let ns = period_ns.checked_mul(den / g).ok_or_else(overflow)?;
        let secs = u64::try_from(ns / NANOS_PER_SEC).map_err(|_| overflow())?;
        let rate = Rate::new(tokens, Duration::new(secs, (ns % NANOS_PER_SEC) as u32));
        rate.validate().map_err(|source| ParseRateError::Invalid {
            input: input.to_owned(),
            source,
        })?;
        Ok(rate)
    }
}

/// A decimal number as written: `digits / 10^scale`.
struct Decimal {
    digits: u128,
    scale: u32,
}

impl Decimal {
    /// `digits × mult` (the amount times 10^scale), `None` on overflow.
    fn value(&self, mult: u64) -> Option<u128> {
        self.digits.checked_mul(mult as u128)
    }
}

/// The leading decimal number of `s` (`12`, `1.5`; at least one digit before the point and one
/// after it, at most 18 after it) and the rest.
fn split_decimal(s: &str) -> Option<(Decimal, &str)> {
    let (int, rest) = split_number(s)?;
    let (frac, rest) = match rest.strip_prefix('.') {
        Some(after) => split_number(after)?,
        None => ("", rest),
    };
    if frac.len() > 18 {
        return None;
    }
    let digits = format!("{int}{frac}").parse::<u128>().unwrap_or(u128::MAX);
    Some((
        Decimal {
            digits,
            scale: frac.len() as u32,
        },
        rest,
    ))
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The leading decimal digits of `s` (at least one) and the rest.
fn split_number(s: &str) -> Option<(&str, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    (end > 0).then(|| s.split_at(end))
}

/// Nanoseconds in one `unit` of time (any case).
fn time_unit(unit: &str, input: &str) -> Result<u128, ParseRateError> {
    match unit.to_lowercase().as_str() {
        "s" => Ok(NANOS_PER_SEC),
        "ms" => Ok(1_000_000),
        "us" | "µs" | "μs" => Ok(1_000),
        "ns" => Ok(1),
        _ => Err(ParseRateError::UnknownUnit {
            input: input.to_owned(),
            unit: unit.to_owned(),
        }),
    }
}

/// A validated rate: `tokens ≥ 1` per `period_ns ≥ 1` nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawRate {
    pub(crate) tokens: u64,
    pub(crate) period_ns: u64,
}

impl RawRate {
    /// Tokens earned between `a` and `b` nanoseconds after an epoch (`a ≤ b`):
    /// `floor(tokens × b / period) − floor(tokens × a / period)`. Consecutive intervals
    /// telescope, so their sum is the count over the union, exactly.
    ///
    /// One remainder and one quotient instead of two quotients: with `tokens × a = Q × period + R`,
    /// the count is `floor((tokens × (b − a) + R) / period)`; in 64-bit arithmetic (no `u128`
    /// division call) when `tokens × b` fits. [`count_exact`](Self::count_exact) is the
    /// definition it must equal (a proptest checks it).
    #[inline]
    pub(crate) fn count(self, a: u64, b: u64) -> u128 {
        debug_assert!(a <= b);
        let (t, p) = (self.tokens, self.period_ns);
        if t.checked_mul(b).is_some() {
            // t × a ≤ t × b fits too, and R + t × (b − a) ≤ t × b.
            let r = t * a % p;
            return ((t * (b - a) + r) / p) as u128;
        }
        // tokens < 2^64 and a, b < 2^64: the products fit u128, and R + tokens × (b − a) ≤
        // tokens × b does too.
        let (t, p) = (t as u128, p as u128);
        let r = t * a as u128 % p;
        (t * (b - a) as u128 + r) / p
    }

    /// `floor(tokens × b / period) − floor(tokens × a / period)` as written.
    #[cfg(test)]
    pub(crate) fn count_exact(self, a: u64, b: u64) -> u128 {
        let p = self.period_ns as u128;
        let t = self.tokens as u128;
        t * b as u128 / p - t * a as u128 / p
    }

    /// `ceil(n × period / tokens)`, saturating at `Duration::MAX`.
    pub(crate) fn duration_for(self, n: u64) -> Duration {
        // n < 2^64 and period_ns < 2^64: the product fits u128.
        let num = n as u128 * self.period_ns as u128;
        duration_from_nanos(num.div_ceil(self.tokens as u128))
    }

    pub(crate) fn to_rate(self) -> Rate {
        Rate::new(self.tokens, Duration::from_nanos(self.period_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy as _;

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

    #[test]
    fn tokens_in_is_total() {
        let max = Rate::per_second(Rate::MAX_PER_SECOND);
        // tokens × nanoseconds overflows u128 here (2^51 × 2^94): no panic.
        assert_eq!(
            max.tokens_in(Duration::from_secs(u64::MAX)),
            Rate::MAX_PER_SECOND as u128 * u64::MAX as u128
        );
        assert_eq!(max.tokens_in(Duration::MAX), {
            let secs = Rate::MAX_PER_SECOND as u128 * u64::MAX as u128;
            secs + Rate::MAX_PER_SECOND as u128 * 999_999_999 / 1_000_000_000
        });
        // Just below u128::MAX: still exact.
        assert_eq!(
            Rate::per_second(u64::MAX).tokens_in(Duration::MAX),
            u64::MAX as u128 * u64::MAX as u128 + u64::MAX as u128 * 999_999_999 / 1_000_000_000
        );
        // Beyond u128: saturated.
        assert_eq!(
            Rate::new(u64::MAX, Duration::from_nanos(1)).tokens_in(Duration::MAX),
            u128::MAX
        );
        // Periods beyond u64 nanoseconds are exact too.
        let slow = Rate::new(u64::MAX, Duration::from_secs(u64::MAX));
        assert_eq!(
            slow.tokens_in(Duration::from_secs(u64::MAX)),
            u64::MAX as u128
        );
        assert_eq!(slow.tokens_in(Duration::from_secs(1)), 1);
        assert_eq!(Rate::new(3, Duration::MAX).tokens_in(Duration::MAX), 3);
        // Invalid rates: defined, documented values.
        assert_eq!(Rate::per_second(0).tokens_in(Duration::MAX), 0);
        assert_eq!(
            Rate::new(1, Duration::ZERO).tokens_in(Duration::from_nanos(1)),
            u128::MAX
        );
        assert_eq!(Rate::new(1, Duration::ZERO).tokens_in(Duration::ZERO), 0);
    }

    #[test]
    fn duration_for_is_total() {
        assert_eq!(
            Rate::per_second(1).duration_for(u64::MAX),
            Duration::from_secs(u64::MAX)
        );
        assert_eq!(
            Rate::per_second(2).duration_for(u64::MAX),
            Duration::new(u64::MAX / 2, 500_000_000)
        );
        assert_eq!(
            Rate::new(1, Duration::from_secs(u64::MAX)).duration_for(2),
            Duration::MAX
        );
        assert_eq!(
            Rate::new(u64::MAX, Duration::MAX).duration_for(u64::MAX),
            Duration::MAX
        );
        assert_eq!(Rate::new(u64::MAX, Duration::MAX).duration_for(1), {
            // ceil(Duration::MAX in ns / u64::MAX)
            let ns = Duration::MAX.as_nanos().div_ceil(u64::MAX as u128);
            Duration::from_nanos(ns as u64)
        });
        assert_eq!(Rate::per_second(0).duration_for(1), Duration::MAX);
        assert_eq!(Rate::per_second(0).duration_for(0), Duration::ZERO);
        assert_eq!(Rate::new(1, Duration::ZERO).duration_for(5), Duration::ZERO);
        let max = Rate::per_second(Rate::MAX_PER_SECOND);
        assert_eq!(
            max.duration_for(u64::MAX),
            Duration::from_nanos(
                (u64::MAX as u128 * 1_000_000_000).div_ceil(Rate::MAX_PER_SECOND as u128) as u64
            )
        );
    }

    proptest::proptest! {
        /// `count` (one remainder and one quotient, 64-bit when `tokens × b` fits) equals the
        /// two-quotient definition, on both paths and across their boundary.
        #[test]
        fn the_fast_count_agrees_with_the_exact_one(
            tokens in proptest::prop_oneof![1u64..=1_000, 1u64..=u32::MAX as u64, 1u64..],
            period_ns in proptest::prop_oneof![1u64..=1_000, 1u64..=1_000_000_000_000, 1u64..],
            a in proptest::prop_oneof![0u64..=1_000_000, 0u64..(1 << 40), 0u64..(1 << 63)],
            len in proptest::prop_oneof![0u64..=1_000, 0u64..(1 << 40), 0u64..(1 << 62)],
        ) {
            let r = RawRate { tokens, period_ns };
            let b = a.saturating_add(len).min((1 << 63) - 2);
            let a = a.min(b);
            proptest::prop_assert_eq!(r.count(a, b), r.count_exact(a, b));
            // At the boundary of the 64-bit path: the largest b with tokens × b < 2^64.
            let edge = (u64::MAX / tokens).min((1 << 63) - 2);
            for b in [edge.saturating_sub(1), edge, edge.saturating_add(1).min((1 << 63) - 2)] {
                let a = a.min(b);
                proptest::prop_assert_eq!(r.count(a, b), r.count_exact(a, b));
            }
        }

        /// The slow path of `mul_div` against the 256-bit product: q × d ≤ a × b < (q + 1) × d.
        #[test]
        fn mul_div_is_exact(a in proptest::prelude::any::<u128>(), b in proptest::prelude::any::<u128>(), d in 1u128..) {
            match mul_div(a, b, d, false) {
                Some(q) => {
                    let ab = mul_wide(a, b);
                    proptest::prop_assert!(mul_wide(q, d) <= ab);
                    let (h, l) = mul_wide(q, d);
                    let (l2, carry) = l.overflowing_add(d);
                    proptest::prop_assert!((h + carry as u128, l2) > ab);
                    let up = mul_div(a, b, d, true);
                    let exact = mul_wide(q, d) == ab;
                    proptest::prop_assert_eq!(up, if exact { Some(q) } else { q.checked_add(1) });
                }
                None => {
                    // The quotient exceeds u128: a × b ≥ 2^128 × d.
                    let (h, _) = mul_wide(a, b);
                    proptest::prop_assert!(h >= d);
                }
            }
        }

        /// Display then FromStr gives the same rate back, for every valid rate.
        #[test]
        fn display_from_str_round_trips(
            tokens in proptest::prop_oneof![
                1u64..=10_000,
                proptest::prelude::any::<u64>(),
                (1u32..=4096).prop_map(|n| (n as u64) << 20),
                (1u32..=4096).prop_map(|n| (n as u64) << 30),
            ],
            ns in proptest::prop_oneof![
                proptest::strategy::Just(1_000_000_000u64),
                proptest::strategy::Just(1_000_000),
                proptest::strategy::Just(1_000),
                proptest::strategy::Just(1),
                (1u64..=1_000_000).prop_map(|s| s * 1_000_000_000),
                proptest::prelude::any::<u64>(),
            ],
        ) {
            let r = Rate::new(tokens, Duration::from_nanos(ns));
            proptest::prop_assume!(r.validate().is_ok());
            let shown = r.to_string();
            proptest::prop_assert_eq!(shown.parse::<Rate>(), Ok(r), "{}", shown);
        }
    }

    #[test]
    fn byte_units_display_and_parse() {
        assert_eq!(Rate::mib_per_second(50).to_string(), "50 MiB/s");
        assert_eq!(Rate::gib_per_second(2).to_string(), "2 GiB/s");
        assert_eq!(Rate::gib_per_second(1024).to_string(), "1024 GiB/s");
        assert_eq!(
            Rate::kib_per_second(1536).to_string(),
            "1536 MiB/s".replace("1536 MiB", "1572864")
        );
        assert_eq!(Rate::per_second(1000).to_string(), "1000/s");
        assert_eq!(Rate::per_millisecond(5).to_string(), "5/ms");
        assert_eq!(Rate::new(7, Duration::from_secs(3)).to_string(), "7 per 3s");
        assert_eq!(
            Rate::new(1, Duration::from_millis(1500)).to_string(),
            "1 per 1500ms"
        );
        assert_eq!(
            Rate::new(3, Duration::from_nanos(2500)).to_string(),
            "3 per 2500ns"
        );
        assert_eq!(
            Rate::new(3, Duration::from_micros(2)).to_string(),
            "3 per 2µs"
        );
        assert_eq!(Rate::bytes_per_second(7), Rate::per_second(7));
        assert_eq!(
            Rate::kib_per_second(u32::MAX).tokens(),
            (u32::MAX as u64) << 10
        );
        assert_eq!(
            Rate::gib_per_second(u32::MAX).tokens(),
            (u32::MAX as u64) << 30
        );
        let ok = |s: &str| s.parse::<Rate>().unwrap();
        assert_eq!(ok("50MiB/s"), Rate::mib_per_second(50));
        assert_eq!(ok("50 MiB/s"), Rate::mib_per_second(50));
        assert_eq!(ok(" 50 MiB / s "), Rate::mib_per_second(50));
        assert_eq!(ok("2GiB/s"), Rate::gib_per_second(2));
        assert_eq!(ok("1000/s"), Rate::per_second(1000));
        assert_eq!(ok("100MB/s"), Rate::per_second(100_000_000));
        assert_eq!(ok("64KiB/s"), Rate::kib_per_second(64));
        assert_eq!(ok("64kB/s"), Rate::per_second(64_000));
        assert_eq!(ok("1GB/s"), Rate::per_second(1_000_000_000));
        assert_eq!(ok("1TiB/s"), Rate::per_second(1 << 40));
        assert_eq!(ok("10B/ms"), Rate::per_millisecond(10));
        assert_eq!(ok("5/us"), Rate::new(5, Duration::from_micros(1)));
        assert_eq!(ok("5/µs"), Rate::new(5, Duration::from_micros(1)));
        assert_eq!(ok("7 per 3s"), Rate::new(7, Duration::from_secs(3)));
        assert_eq!(ok("7 per 3 s"), Rate::new(7, Duration::from_secs(3)));
    }

    #[test]
    fn parse_keeps_fractions_exact() {
        let ok = |s: &str| s.parse::<Rate>().unwrap();
        assert_eq!(ok("1.5 MiB/s"), Rate::per_second(3 << 19));
        assert_eq!(ok("1.5MiB/s"), Rate::per_second(1_572_864));
        assert_eq!(ok("2.50 KiB/s"), Rate::per_second(2_560));
        assert_eq!(ok("0.5 GB/s"), Rate::per_second(500_000_000));
        assert_eq!(ok("1.0/s"), Rate::per_second(1));
        // A fraction of a token per period is a longer period, exactly.
        assert_eq!(ok("1.5/s"), Rate::new(3, Duration::from_secs(2)));
        assert_eq!(ok("1.3/s"), Rate::new(13, Duration::from_secs(10)));
        assert_eq!(ok("0.1/ms"), Rate::new(1, Duration::from_millis(10)));
        assert_eq!(ok("2.5 per 3s"), Rate::new(5, Duration::from_secs(6)));
        // The rate is exactly the decimal written: 1.000001 B/s is 1,000,001 per 10^6 s.
        assert_eq!(
            ok("1.000001/s").cmp_rate(&Rate::new(1_000_001, Duration::from_secs(1_000_000))),
            std::cmp::Ordering::Equal
        );
        use crate::bucket::error::ParseRateError as E;
        let err = |s: &str| s.parse::<Rate>().unwrap_err();
        assert!(matches!(err("1./s"), E::Syntax { .. }));
        assert!(matches!(err(".5/s"), E::Syntax { .. }));
        assert!(matches!(err("1.5.5/s"), E::UnknownUnit { unit, .. } if unit == ".5"));
        assert!(matches!(err("1.0000000000000000001/s"), E::Syntax { .. }));
        assert!(matches!(err("0.0/s"), E::Invalid { .. }));
        assert!(matches!(err("16777216.5 TiB/s"), E::Overflow { .. }));
        assert!(matches!(
            err("0.000000000000000001 per 18446744073s"),
            E::Overflow { .. } | E::Invalid { .. }
        ));
    }

    #[test]
    fn parse_units_ignore_case() {
        let ok = |s: &str| s.parse::<Rate>().unwrap();
        assert_eq!(ok("50 mib/s"), Rate::mib_per_second(50));
        assert_eq!(ok("50 MIB/S"), Rate::mib_per_second(50));
        assert_eq!(ok("64 kib/s"), Rate::kib_per_second(64));
        assert_eq!(ok("64 kb/s"), Rate::per_second(64_000));
        assert_eq!(ok("1 Gb/s"), Rate::per_second(1_000_000_000));
        assert_eq!(ok("10 b/MS"), Rate::per_millisecond(10));
        assert_eq!(ok("5/US"), Rate::new(5, Duration::from_micros(1)));
        assert_eq!(ok("7 PER 3 S"), Rate::new(7, Duration::from_secs(3)));
    }

    #[test]
    fn parse_errors_are_typed() {
        use crate::bucket::error::ParseRateError as E;
        let err = |s: &str| s.parse::<Rate>().unwrap_err();
        assert!(matches!(err(""), E::Syntax { .. }));
        assert!(matches!(err("MiB/s"), E::Syntax { .. }));
        assert!(matches!(err("50 MiB"), E::Syntax { .. }));
        assert!(matches!(err("-5/s"), E::Syntax { .. }));
        assert!(matches!(err("7 per s"), E::Syntax { .. }));
        assert!(matches!(err("50 MiBs/s"), E::UnknownUnit { unit, .. } if unit == "MiBs"));
        assert!(matches!(err("50 MiB/h"), E::UnknownUnit { unit, .. } if unit == "h"));
        assert!(matches!(err("7 per 3h"), E::UnknownUnit { .. }));
        assert!(matches!(err("99999999999999999999/s"), E::Overflow { .. }));
        assert!(matches!(err("17592186044416 MiB/s"), E::Overflow { .. }));
        assert!(matches!(
            err("1 per 99999999999999999999s"),
            E::Overflow { .. }
        ));
        assert!(matches!(
            err("0/s"),
            E::Invalid {
                source: ConfigError::ZeroRate { .. },
                ..
            }
        ));
        assert!(matches!(
            err("1 per 0s"),
            E::Invalid {
                source: ConfigError::ZeroRate { .. },
                ..
            }
        ));
        assert!(matches!(
            err("10000 TB/s"),
            E::Invalid {
                source: ConfigError::RateTooHigh { .. },
                ..
            }
        ));
        let msg = err("50 MiB/h").to_string();
        assert!(msg.contains("\"h\"") && msg.contains("50 MiB/h"), "{msg}");
    }
}
