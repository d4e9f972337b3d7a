//! The restore math and the file format, against hand-computed cases and a u128 model.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proptest::prelude::*;

use super::file::{decode, encode, FILE_LEN, FILE_LEN_V1};
use super::*;
use crate::bucket::{BucketConfig, BucketState, Capped, Rate, Uncapped};
use crate::clock::ManualClock;

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

fn snap(tail: u64, head: u64, rate: Rate, limit: u64) -> Snapshot {
    Snapshot {
        state: BucketState {
            tail,
            head,
            ceil: None,
        },
        reserved: None,
        wall: at(0),
        rate,
        limit,
        seq: 0,
    }
}

const R: Rate = Rate::per_second(1_000);

fn cfg() -> BucketConfig {
    BucketConfig::new(R, 500)
}

#[test]
fn downtime_refills_up_to_the_limit_exactly() {
    let s = snap(1_000, 1_030, R, 500); // 30 tokens
    let later = at(0) + Duration::from_millis(50);
    let (state, report) = restore_state(&s, &cfg(), false, later).unwrap();
    assert_eq!(report.tokens, 80);
    assert_eq!(state.tail, 1_000, "the absolute tail is kept");
    assert_eq!(state.head, 1_080);
    assert_eq!(report.downtime, Duration::from_millis(50));
    assert!(!report.clock_went_backwards && !report.rate_changed && !report.limit_changed);
    // A long downtime never gives more than the limit.
    let (state, report) = restore_state(&s, &cfg(), false, at(3_600)).unwrap();
    assert_eq!((report.tokens, state.tokens()), (500, 500));
}

#[test]
fn a_saved_deficit_is_still_owed() {
    let s = snap(5_000, 4_800, R, 500); // 200 owed
    let (state, report) =
        restore_state(&s, &cfg(), false, at(0) + Duration::from_millis(150)).unwrap();
    assert_eq!(report.saved_tokens, -200);
    assert_eq!(report.tokens, -50);
    assert_eq!(state.tokens(), -50);
}

#[test]
fn a_clock_that_went_back_counts_zero_downtime() {
    let s = snap(0, 10, R, 500);
    let earlier = at(0) - Duration::from_secs(30);
    let (state, report) = restore_state(&s, &cfg(), false, earlier).unwrap();
    assert!(report.clock_went_backwards);
    assert_eq!(report.downtime, Duration::ZERO);
    assert_eq!(state.tokens(), 10, "no credit for a clock going backwards");
}

#[test]
fn another_rate_or_limit_is_adapted_and_reported() {
    // Saved under 1000/s with limit 2000 and 1500 tokens; now 250/s with limit 500.
    let s = snap(0, 1_500, R, 2_000);
    let now_cfg = BucketConfig::new(Rate::per_second(250), 500);
    let (_, report) = restore_state(&s, &now_cfg, false, at(1)).unwrap();
    assert!(report.rate_changed && report.limit_changed);
    assert_eq!(
        report.credit_rate,
        Rate::per_second(250),
        "the slower rate credits"
    );
    assert_eq!(report.tokens, 500, "cut to the new limit");
    // Deficit + downtime: the slower (saved) rate credits when the new one is faster.
    let s = snap(1_000, 0, Rate::per_second(100), 500);
    let fast = BucketConfig::new(Rate::per_second(10_000), 500);
    let (_, report) = restore_state(&s, &fast, false, at(2)).unwrap();
    assert_eq!(report.credit_rate, Rate::per_second(100));
    assert_eq!(report.tokens, -800);
    // The same rational rate written differently is not a change.
    let s = snap(0, 0, Rate::new(2_000, Duration::from_secs(2)), 500);
    let (_, report) = restore_state(&s, &cfg(), false, at(1)).unwrap();
    assert!(!report.rate_changed);
}

#[test]
fn strict_reservation_counts_as_spent() {
    let mut s = snap(100, 400, R, 500); // 300 tokens, but reserved up to 350
    s.reserved = Some(350);
    let (state, report) = restore_state(&s, &cfg(), false, at(0)).unwrap();
    assert_eq!(state.tail, 350);
    assert_eq!(report.reserved_spent, 250);
    assert_eq!(report.tokens, 50);
    // A mark past the head: a deficit.
    s.reserved = Some(1_000);
    let (state, _) = restore_state(&s, &cfg(), false, at(0)).unwrap();
    assert_eq!(state.tokens(), -600);
}

#[test]
fn capped_restore_has_nothing_in_flight() {
    let mut s = snap(10, 60, R, 500);
    s.state.ceil = Some(70);
    let (state, _) = restore_state(&s, &cfg(), true, at(0)).unwrap();
    assert_eq!(state.ceil, Some(510));
    let clock = ManualClock::new();
    let (bucket, _) = restore_bucket::<Capped, _>(&s, cfg(), clock, at(0)).unwrap();
    assert_eq!(bucket.available(), 50);
    let (state, _) = restore_state(&s, &cfg(), false, at(0)).unwrap();
    assert_eq!(state.ceil, None);
}

#[test]
fn restored_bucket_accrues_from_the_restore_on() {
    let s = snap(0, 100, R, 500);
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(7));
    let (bucket, _) = restore_bucket::<Uncapped, _>(&s, cfg(), clock.clone(), at(0)).unwrap();
    assert_eq!(
        bucket.replenish(),
        0,
        "no free burst at the first replenish"
    );
    assert_eq!(bucket.available(), 100);
    clock.advance(Duration::from_millis(10));
    assert_eq!(bucket.replenish(), 10);
}

#[test]
fn empty_fallback_is_empty() {
    let clock = ManualClock::new();
    let b = empty_bucket::<Uncapped, _>(cfg(), clock.clone()).unwrap();
    assert_eq!(b.replenish(), 0);
    assert_eq!(b.available(), 0);
    clock.advance(Duration::from_millis(3));
    assert_eq!(b.replenish(), 3);
    let b = empty_bucket::<Capped, _>(cfg(), clock).unwrap();
    assert_eq!(b.available(), 0);
}

#[test]
fn invalid_snapshots_are_typed_errors() {
    let bad = |s: Snapshot| {
        matches!(
            restore_state(&s, &cfg(), false, at(0)),
            Err(CheckpointError::InvalidSnapshot { .. })
        )
    };
    assert!(bad(snap(0, 0, Rate::per_second(0), 10)));
    assert!(bad(snap(0, 0, R, 0)));
    assert!(bad(snap(1 << 62, 0, R, 10)));
    let mut s = snap(100, 100, R, 10);
    s.reserved = Some(50); // behind the tail
    assert!(bad(s));
}

#[test]
fn file_format_round_trips() {
    let mut s = snap(u64::MAX - 5, 3, Rate::new(7, Duration::from_secs(3)), 500);
    s.state.ceil = Some(100);
    s.reserved = Some(10);
    s.wall = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
    s.seq = u64::MAX - 1;
    let bytes = encode(&s);
    assert_eq!(bytes.len(), FILE_LEN);
    assert_eq!(decode(&bytes).unwrap(), s);
}

/// A version-1 file (before `seq` existed), built byte by byte from its documented layout,
/// still loads, with `seq` 0.
#[test]
fn file_format_version_1_still_loads() {
    let mut s = snap(40, 90, R, 500);
    s.reserved = Some(70);
    s.seq = 9;
    let v2 = encode(&s);
    let mut v1 = [0u8; FILE_LEN_V1];
    v1[..78].copy_from_slice(&v2[..78]);
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32fast::hash(&v1[..82]);
    v1[82..86].copy_from_slice(&crc.to_le_bytes());
    let got = decode(&v1).unwrap();
    assert_eq!(got, Snapshot { seq: 0, ..s });
    assert!(matches!(
        decode(&v1[..FILE_LEN_V1 - 1]),
        Err(CheckpointError::Truncated { .. })
    ));
}

#[test]
fn file_format_rejects_damage() {
    let bytes = encode(&snap(0, 10, R, 500));
    for len in [0, 5, 11, 12, 50, FILE_LEN - 1] {
        assert!(
            matches!(
                decode(&bytes[..len]),
                Err(CheckpointError::Truncated { .. })
            ),
            "{len} bytes"
        );
    }
    let mut longer = bytes.to_vec();
    longer.push(0);
    assert!(matches!(
        decode(&longer),
        Err(CheckpointError::Truncated { .. })
    ));
    for i in 12..FILE_LEN {
        let mut b = bytes;
        b[i] ^= 0x40;
        assert!(
            matches!(decode(&b), Err(CheckpointError::ChecksumMismatch { .. })),
            "byte {i}"
        );
    }
    let mut b = bytes;
    b[0] = b'X';
    assert!(matches!(decode(&b), Err(CheckpointError::BadMagic)));
    let mut b = bytes;
    b[8] = 3;
    assert!(matches!(
        decode(&b),
        Err(CheckpointError::UnsupportedVersion {
            found: 3,
            supported: 2
        })
    ));
}

proptest! {
    /// The restore against a u128/i128 model: never more than the limit, never more than the
    /// saved tokens plus what the downtime earned at the slower rate.
    #[test]
    fn restore_matches_the_model(
        tail in any::<u64>(),
        saved in -1_000_000i64..1_000_000,
        mark_ahead in proptest::option::of(0u64..1_000_000),
        saved_rate in 1u64..1_000_000,
        rate in 1u64..1_000_000,
        saved_limit in 1u64..1_000_000,
        limit in 1u64..1_000_000,
        down_ms in -10_000i64..100_000,
    ) {
        let mut s = snap(tail, tail.wrapping_add(saved as u64), Rate::per_second(saved_rate), saved_limit);
        s.reserved = mark_ahead.map(|m| tail.wrapping_add(m));
        let now = if down_ms >= 0 {
            at(100) + Duration::from_millis(down_ms as u64)
        } else {
            at(100) - Duration::from_millis((-down_ms) as u64)
        };
        s.wall = at(100);
        let config = BucketConfig::new(Rate::per_second(rate), limit);
        let (state, report) = restore_state(&s, &config, false, now).unwrap();
        let base = saved as i128 - mark_ahead.unwrap_or(0) as i128;
        let down_ns = down_ms.max(0) as i128 * 1_000_000;
        let earned = saved_rate.min(rate) as i128 * down_ns / 1_000_000_000;
        let model = (base.min(limit as i128) + earned).min(limit as i128);
        prop_assert_eq!(report.tokens as i128, model);
        prop_assert_eq!(state.tokens() as i128, model);
        prop_assert!(model <= limit as i128 && model <= base + earned);
        prop_assert_eq!(state.tail, s.effective_tail());
        let clock = ManualClock::new();
        prop_assert!(SharedTokenBucket::<Uncapped, _>::from_state(config, clock, state).is_ok());
    }
}
