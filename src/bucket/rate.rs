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
mod tests;
