//! Unit tests of the bucket against hand-computed values.

use std::time::Duration;

use super::*;
use crate::clock::ManualClock;

fn bucket<M: Mode>(
    rate: Rate,
    limit: u64,
    threshold: u64,
) -> (SharedTokenBucket<M, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let cfg = BucketConfig::new(rate, limit).with_threshold(threshold);
    (
        SharedTokenBucket::with_clock(cfg, clock.clone()).unwrap(),
        clock,
    )
}

#[test]
fn contract_from_the_issue() {
    let (b, clock) = bucket::<Uncapped>(Rate::per_second(1_000), 100, 10);
    assert_eq!(b.available(), 0, "empty before the first replenish");
    assert_eq!(b.replenish(), 100);
    let tail = b.grab(30);
    assert_eq!(b.deficiency(tail), 0);
    assert_eq!(b.available(), 70);
    clock.advance(Duration::from_millis(5));
    assert_eq!(b.replenish(), 0, "5 tokens < threshold 10");
    clock.advance(Duration::from_millis(5));
    assert_eq!(b.replenish(), 10, "the deferred time was kept");
    assert_eq!(b.available(), 80);
    assert_eq!(b.refund(5), 5);
    assert_eq!(b.available(), 85);
    assert_eq!(b.duration_for(500), Duration::from_millis(500));
    b.set_rate(Rate::per_second(2_000)).unwrap();
    clock.advance(Duration::from_millis(5));
    assert_eq!(b.replenish(), 10, "5 ms at the new rate");
    assert_eq!(b.rate(), Rate::per_second(2_000));
    assert_eq!(b.limit(), 100);
}

#[test]
fn tokens_over_the_limit_are_discarded_not_stored() {
    let (b, clock) = bucket::<Uncapped>(Rate::per_second(1_000), 100, 1);
    b.replenish();
    clock.advance(Duration::from_secs(10));
    assert_eq!(b.replenish(), 0);
    assert_eq!(b.available(), 100);
    let t = b.grab(100);
    assert_eq!(b.deficiency(t), 0);
    assert_eq!(b.available(), 0);
    // The 10 s above were spent on a full bucket: nothing was banked.
    clock.advance(Duration::from_millis(1));
    assert_eq!(b.replenish(), 1);
}

#[test]
fn deficit_is_a_queue() {
    let (b, clock) = bucket::<Uncapped>(Rate::per_second(1_000), 10, 1);
    b.replenish();
    let first = b.grab(15);
    let second = b.grab(10);
    assert_eq!(b.deficiency(first), 5);
    assert_eq!(b.deficiency(second), 15);
    assert_eq!(b.available(), 0);
    clock.advance(Duration::from_millis(5));
    assert_eq!(b.replenish(), 5);
    assert_eq!(b.deficiency(first), 0);
    assert_eq!(b.deficiency(second), 10);
    // A long pause pays the whole queue and refills up to the limit, no more.
    clock.advance(Duration::from_secs(1));
    assert_eq!(b.replenish(), 20);
    assert_eq!(b.deficiency(second), 0);
    assert_eq!(b.available(), 10);
}

#[test]
fn refund_never_overfills() {
    let (b, _clock) = bucket::<Uncapped>(Rate::per_second(1_000), 100, 1);
    b.replenish();
    assert_eq!(b.refund(50), 0, "a full bucket takes no refund");
    let t = b.grab(40);
    assert_eq!(b.deficiency(t), 0);
    assert_eq!(b.refund(60), 40);
    assert_eq!(b.available(), 100);
}

#[test]
fn capped_bucket_fills_only_up_to_ceil() {
    let (b, clock) = bucket::<Capped>(Rate::per_second(1_000), 100, 1);
    assert_eq!(b.replenish(), 100);
    let t = b.grab(100);
    assert_eq!(b.deficiency(t), 0);
    clock.advance(Duration::from_secs(1));
    assert_eq!(b.replenish(), 0, "nothing completed: no room");
    b.release(30);
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        b.replenish(),
        1,
        "the capped second was discarded, not banked"
    );
    clock.advance(Duration::from_millis(100));
    assert_eq!(b.replenish(), 29, "completions make room for 30, no more");
    assert_eq!(b.snapshot().ceil, Some(130));
}

#[test]
fn capped_refund_advances_ceil_too() {
    let (b, _clock) = bucket::<Capped>(Rate::per_second(1_000), 100, 1);
    b.replenish();
    let t = b.grab(100);
    assert_eq!(b.deficiency(t), 0);
    // Unused tokens come back and are not held against the cap.
    assert_eq!(b.refund(40), 40);
    let s = b.snapshot();
    assert_eq!((s.tail, s.head, s.ceil), (100, 140, Some(140)));
}

#[test]
fn first_replenish_fills_even_at_time_zero() {
    let (b, _clock) = bucket::<Uncapped>(Rate::per_second(1), 7, 7);
    assert_eq!(b.last_replenish(), None);
    assert_eq!(b.replenish(), 7);
    assert_eq!(b.last_replenish(), Some(Duration::ZERO));
    assert_eq!(b.replenish(), 0);
}

#[test]
fn awkward_rate_issues_exactly_floor_of_rate_times_elapsed() {
    // 7 tokens per 3 s, replenished every 100 ms for 10 minutes: whole tokens only, the
    // fraction carried. Seastar rounds each replenish and drifts; we must land on 1400.
    let (b, clock) = bucket::<Uncapped>(Rate::new(7, Duration::from_secs(3)), 1_000_000, 1);
    b.replenish();
    let start = b.grab(1_000_000); // empty the bucket so nothing is capped
    assert_eq!(b.deficiency(start), 0);
    let mut added = 0;
    for _ in 0..6000 {
        clock.advance(Duration::from_millis(100));
        added += b.replenish();
    }
    assert_eq!(added, 1400);
}

#[test]
fn huge_rate_is_exact_per_nanosecond() {
    // 10^12 tokens per second = 1000 per ns: 1 ns steps must not lose anything.
    let limit = BucketConfig::MAX_LIMIT;
    let (b, clock) = bucket::<Uncapped>(Rate::per_second(1_000_000_000_000), limit, 1);
    b.replenish();
    b.grab(limit);
    let mut added = 0u64;
    for _ in 0..10_000 {
        clock.advance(Duration::from_nanos(1));
        added += b.replenish();
    }
    assert_eq!(added, 10_000_000);
}

#[test]
fn config_errors_are_typed() {
    let c = ManualClock::new();
    let make = |cfg: BucketConfig| {
        SharedTokenBucket::<Uncapped, _>::with_clock(cfg, c.clone()).map(|_| ())
    };
    assert!(matches!(
        make(BucketConfig::new(Rate::per_second(0), 10)),
        Err(ConfigError::ZeroRate { .. })
    ));
    assert_eq!(
        make(BucketConfig::new(Rate::per_second(1), 0)),
        Err(ConfigError::ZeroLimit)
    );
    assert!(matches!(
        make(BucketConfig::new(
            Rate::per_second(1),
            BucketConfig::MAX_LIMIT + 1
        )),
        Err(ConfigError::LimitTooLarge { .. })
    ));
    assert!(matches!(
        make(BucketConfig::new(Rate::per_second(1), 10).with_threshold(0)),
        Err(ConfigError::ThresholdOutOfRange { .. })
    ));
    assert!(matches!(
        make(BucketConfig::new(Rate::per_second(u64::MAX), 10)),
        Err(ConfigError::RateTooHigh { .. })
    ));
    let (b, _) = bucket::<Uncapped>(Rate::per_second(10), 10, 1);
    assert!(b.set_rate(Rate::per_second(0)).is_err());
    assert_eq!(
        b.rate(),
        Rate::per_second(10),
        "a refused rate changes nothing"
    );
}

#[test]
fn from_state_checks_invariants() {
    let cfg = BucketConfig::new(Rate::per_second(10), 10);
    let c = ManualClock::new();
    let bad = |s| SharedTokenBucket::<Capped, _>::from_state(cfg, c.clone(), s).err();
    assert!(bad(BucketState {
        tail: 0,
        head: 11,
        ceil: Some(20)
    })
    .is_some());
    assert!(bad(BucketState {
        tail: 0,
        head: 5,
        ceil: Some(4)
    })
    .is_some());
    assert!(bad(BucketState {
        tail: 0,
        head: 5,
        ceil: None
    })
    .is_some());
    let ok = SharedTokenBucket::<Capped, _>::from_state(
        cfg,
        c.clone(),
        BucketState {
            tail: u64::MAX - 2,
            head: 3,
            ceil: Some(7),
        },
    )
    .unwrap();
    assert_eq!(ok.available(), 6, "positions wrap");
    assert!(SharedTokenBucket::<Uncapped, _>::from_state(
        cfg,
        c,
        BucketState {
            tail: 0,
            head: 0,
            ceil: Some(0)
        }
    )
    .is_err());
}

#[test]
fn wraps_around_u64_max() {
    let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
    let clock = ManualClock::new();
    let start = u64::MAX - 10;
    let b = SharedTokenBucket::<Uncapped, _>::from_state(
        cfg,
        clock.clone(),
        BucketState {
            tail: start,
            head: start,
            ceil: None,
        },
    )
    .unwrap();
    let t = b.grab(50);
    assert!(t < start, "tail wrapped");
    assert_eq!(b.deficiency(t), 50);
    clock.advance(Duration::from_millis(50));
    assert_eq!(b.replenish(), 50);
    assert_eq!(b.deficiency(t), 0);
    assert_eq!(b.available(), 0);
}

#[test]
fn is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SharedTokenBucket<Uncapped>>();
    check::<SharedTokenBucket<Capped, ManualClock>>();
}
