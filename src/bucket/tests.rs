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
    // 7 tokens per 3 s, replenished every 100 ms for 10 minutes: whole tokens only,
    // counted from the epoch. Seastar rounds each replenish and drifts; we must land on 1400.
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

/// An empty bucket restored at time 0 on a manual clock, with a large limit.
fn empty<M: Mode>(rate: Rate, threshold: u64) -> (SharedTokenBucket<M, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let limit = BucketConfig::MAX_LIMIT;
    let cfg = BucketConfig::new(rate, limit).with_threshold(threshold);
    let state = BucketState {
        tail: 0,
        head: 0,
        ceil: M::CAPPED.then_some(limit),
    };
    (
        SharedTokenBucket::from_state(cfg, clock.clone(), state).unwrap(),
        clock,
    )
}

/// Replenishes and grabs what came (so the bucket never caps); returns what was added.
fn drain<M: Mode>(b: &SharedTokenBucket<M, ManualClock>) -> u64 {
    let n = b.replenish();
    let t = b.grab(n);
    assert_eq!(b.deficiency(t), 0);
    n
}

#[test]
fn set_rate_prices_the_past_at_the_old_rate() {
    // 1/s with a large threshold; after 0.9 s (0.9 tokens earned, none issued) the rate goes to
    // 10^6/s. At 0.9 s + d the rates allow floor(0.9) + floor(10^6 × d) = 10^6 × d tokens, not
    // the whole 0.9 s + d at the new rate (900,000 + ...).
    let (b, clock) = empty::<Uncapped>(Rate::per_second(1), 1_000);
    clock.advance(Duration::from_millis(900));
    assert_eq!(drain(&b), 0, "0.9 tokens: below the threshold");
    b.set_rate(Rate::per_second(1_000_000)).unwrap();
    let mut issued = 0u64;
    for (ms, want) in [
        (901, 1_000u64),
        (903, 3_000),
        (1_900, 1_000_000),
        (2_900, 2_000_000),
    ] {
        clock.advance(Duration::from_millis(ms) - clock.now());
        issued += drain(&b);
        assert_eq!(issued, want, "issued by {ms} ms");
        // The bound: old × 0.9 s + new × (t − 0.9 s).
        assert!(issued as f64 <= 0.9 + 1e6 * (ms as f64 / 1e3 - 0.9) + 1e-6);
    }
}

#[test]
fn set_rate_closes_a_below_threshold_interval_at_the_old_rate() {
    // 10/s, threshold 100: at 0.95 s 9 tokens are earned (below the threshold). They are
    // neither lost nor re-priced: set_rate adds them, and the new rate counts from 0.95 s.
    let (b, clock) = empty::<Uncapped>(Rate::per_second(10), 100);
    clock.advance(Duration::from_millis(950));
    assert_eq!(drain(&b), 0);
    b.set_rate(Rate::per_second(1_000_000)).unwrap();
    assert_eq!(
        b.available(),
        9,
        "the old rate's 9 tokens, added at the change"
    );
    assert_eq!(b.last_replenish(), Some(Duration::from_millis(950)));
    b.grab(9);
    clock.advance(Duration::from_micros(150));
    assert_eq!(drain(&b), 150);
    // And back down: the 10^6/s interval below the threshold is closed at 10^6/s.
    clock.advance(Duration::from_micros(50));
    assert_eq!(drain(&b), 0, "50 < threshold 100");
    b.set_rate(Rate::new(7, Duration::from_secs(3))).unwrap();
    assert_eq!(b.available(), 50);
    b.grab(50);
    clock.advance(Duration::from_secs(300));
    assert_eq!(drain(&b), 700, "exactly floor(7/3 × 300) after the change");
}

#[test]
fn set_rate_sequences_are_piecewise_exact() {
    // Many changes, each at an awkward rate, with replenishes of awkward lengths between:
    // the total is the sum over the pieces of floor(rate × piece), exactly.
    let rates = [
        Rate::new(7, Duration::from_secs(3)),
        Rate::new(1, Duration::from_nanos(3)),
        Rate::per_second(Rate::MAX_PER_SECOND),
        Rate::new(5, Duration::from_millis(7)),
    ];
    let (b, clock) = empty::<Uncapped>(rates[0], 1);
    let mut want: u128 = 0;
    let mut issued: u128 = 0;
    for (i, step) in (1..40u64).map(|i| (i, i * 7_919_111)) {
        let rate = rates[i as usize % rates.len()];
        let before = b.rate();
        clock.advance(Duration::from_nanos(step));
        want += before.tokens_in(Duration::from_nanos(step));
        issued += drain(&b) as u128;
        b.set_rate(rate).unwrap();
        issued += b.available() as u128;
        b.grab(b.available());
        assert_eq!(issued, want, "after change {i}");
    }
}

#[test]
fn clock_going_backwards_changes_nothing() {
    let (b, _) = empty::<Uncapped>(Rate::per_second(1_000), 1);
    assert_eq!(b.replenish_at(Duration::from_millis(10)), 10);
    assert_eq!(b.replenish_at(Duration::from_millis(5)), 0);
    assert_eq!(b.replenish_at(Duration::from_millis(10)), 0);
    assert_eq!(b.last_replenish(), Some(Duration::from_millis(10)));
    assert_eq!(
        b.replenish_at(Duration::from_millis(12)),
        2,
        "nothing counted twice"
    );
}

#[test]
fn replenish_before_the_epoch_and_far_in_the_future_is_total() {
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(100));
    let cfg = BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    );
    let b = SharedTokenBucket::<Uncapped, _>::from_state(
        cfg,
        clock.clone(),
        BucketState {
            tail: 0,
            head: 0,
            ceil: None,
        },
    )
    .unwrap();
    // Before the epoch (the restore at 100 s): nothing.
    assert_eq!(b.replenish_at(Duration::from_secs(1)), 0);
    // The end of time: the largest rate over ~292 years fills the bucket without overflow.
    assert_eq!(b.replenish_at(Duration::MAX), BucketConfig::MAX_LIMIT);
    assert_eq!(b.replenish_at(Duration::MAX), 0);
}

#[test]
fn set_rate_before_the_first_replenish_keeps_the_first_fill() {
    let (b, clock) = bucket::<Uncapped>(Rate::per_second(1), 100, 1);
    clock.advance(Duration::from_secs(5));
    b.set_rate(Rate::per_second(1_000)).unwrap();
    assert_eq!(b.last_replenish(), None);
    assert_eq!(b.replenish(), 100, "the first replenish still fills");
    b.grab(100);
    clock.advance(Duration::from_millis(20));
    assert_eq!(b.replenish(), 20);
}

#[test]
fn first_replenish_before_the_creation_time_does_not_wedge_the_bucket() {
    // Created at 100 s; the first replenish reads an earlier time (a stale `replenish_at`).
    let clock = ManualClock::new();
    clock.advance(Duration::from_secs(100));
    let cfg = BucketConfig::new(Rate::per_second(1_000), 1_000);
    let b = SharedTokenBucket::<Uncapped, _>::with_clock(cfg, clock.clone()).unwrap();
    assert_eq!(
        b.replenish_at(Duration::from_secs(10)),
        1_000,
        "the first fill"
    );
    b.grab(1_000);
    assert_eq!(b.replenish_at(Duration::from_millis(10_001)), 1);
    assert_eq!(b.replenish_at(Duration::from_secs(100)), 999);
    b.grab(1_000);
    b.set_rate(Rate::per_second(2_000)).unwrap();
    assert_eq!(b.replenish_at(Duration::from_millis(100_001)), 2);
}
