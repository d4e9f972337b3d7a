//! Helpers shared by the models.

use std::time::Duration;

use crate::{BucketConfig, BucketState, Clock, ManualClock, Mode, Rate, SharedTokenBucket};

/// Rovers start here, a few tokens before `u64::MAX`, so every model also wraps.
pub(crate) const START: u64 = u64::MAX - 4;

/// `START + n`, wrapping.
pub(crate) fn at(n: u64) -> u64 {
    START.wrapping_add(n)
}

/// How far `a` is in front of `b` (wrapping).
pub(crate) fn ahead(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

/// A bucket restored at `state` (relative to [`START`]) on a new manual clock at time zero, so
/// its last replenish is at 0 ns. Must be called inside `loom::model`.
pub(crate) fn restored<M: Mode>(
    rate: Rate,
    limit: u64,
    threshold: u64,
    tokens: u64,
    ceil: Option<u64>,
) -> SharedTokenBucket<M, ManualClock> {
    let cfg = BucketConfig::new(rate, limit).with_threshold(threshold);
    let state = BucketState {
        tail: START,
        head: at(tokens),
        ceil: ceil.map(at),
    };
    let b = SharedTokenBucket::from_state(cfg, ManualClock::new(), state).unwrap();
    assert_eq!(b.last_replenish(), Some(Duration::ZERO));
    b
}

/// `replenish_at(ns)`.
pub(crate) fn replenish_at<M: Mode, C: Clock>(b: &SharedTokenBucket<M, C>, ns: u64) -> u64 {
    b.replenish_at(Duration::from_nanos(ns))
}

/// The bounds that hold at every instant, checked from two snapshots (see the crate doc):
/// `head ≤ tail + limit`, and in capped mode `head ≤ ceil`.
pub(crate) fn check_bounds<M: Mode, C: Clock>(b: &SharedTokenBucket<M, C>) {
    let s1 = b.snapshot();
    let s2 = b.snapshot();
    let over = ahead(s1.head, s2.tail.wrapping_add(b.limit()));
    assert!(
        over <= 0,
        "head {} passed tail {} + limit by {over}",
        s1.head,
        s2.tail
    );
    // `positions` reads ceil after head, and ceil only grows: one snapshot is enough.
    if let Some(ceil) = s1.ceil {
        assert!(
            ahead(s1.head, ceil) <= 0,
            "head {} passed ceil {ceil}",
            s1.head
        );
    }
    // Every rover only moves forward.
    assert!(ahead(s2.tail, s1.tail) >= 0 && ahead(s2.head, s1.head) >= 0);
    assert!(b.available() <= b.limit());
}
