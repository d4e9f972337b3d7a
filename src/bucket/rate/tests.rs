//! `Rate`'s arithmetic, parsing and display, checked against exact models.

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
