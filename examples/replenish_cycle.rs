//! The bucket's hot cycle, for instruction counts that do not depend on machine noise: what
//! `bucket/iothrottle_grab_deficiency/1t` measures (64 × `grab(1)` + `deficiency` and one
//! `replenish()` on a `FastClock`, at 10^9 tokens/s with the largest limit), next to the floor
//! (64 × `fetch_add` + `load`), the grabs alone and the replenish alone, each in its own
//! function so that a profiler attributes them.
//!
//! ```text
//! cargo build --release --example replenish_cycle
//! valgrind --tool=callgrind --callgrind-out-file=cg.out target/release/examples/replenish_cycle 10000
//! callgrind_annotate --inclusive=yes cg.out | grep replenish_cycle::
//! ```
//!
//! A second argument `max` runs the cycle at `Rate::MAX_PER_SECOND` instead.
//!
//! Divide each function's inclusive count by the number of cycles (the argument, 10,000 by
//! default); `replenish_only` is one replenish with its clock read, `replenish_at_max` one
//! replenish without a clock read at the highest rate (`bucket/replenish_epoch_lockfree`).

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;

use iothrottle::{
    BucketConfig, BucketState, Clock, FastClock, ManualClock, Rate, SharedTokenBucket, Uncapped,
};

/// Grabs per replenish, as in the criterion bench.
const EVERY: u64 = 64;

fn bucket(per_second: u64) -> SharedTokenBucket<Uncapped, FastClock> {
    let cfg = BucketConfig::new(Rate::per_second(per_second), BucketConfig::MAX_LIMIT);
    let b = SharedTokenBucket::with_clock(cfg, FastClock::new()).expect("valid config");
    b.replenish(); // the first replenish fills the bucket
    b
}

/// One replenish and 64 grabs: the bench's cycle.
#[inline(never)]
fn cycle<C: Clock>(b: &SharedTokenBucket<Uncapped, C>) {
    b.replenish();
    for _ in 0..EVERY {
        let tail = b.grab(1);
        black_box(b.deficiency(tail));
    }
}

/// 64 grabs, no replenish: the fast path alone.
#[inline(never)]
fn grabs_only<C: Clock>(b: &SharedTokenBucket<Uncapped, C>) {
    for _ in 0..EVERY {
        let tail = b.grab(1);
        black_box(b.deficiency(tail));
    }
}

/// One replenish, clock read included.
#[inline(never)]
fn replenish_only<C: Clock>(b: &SharedTokenBucket<Uncapped, C>) {
    black_box(b.replenish());
}

/// `replenish_at(t)` at the highest rate, `t` one nanosecond later each call, as
/// `bucket/replenish_epoch_lockfree` does: the replenish alone, no clock read.
#[inline(never)]
fn replenish_at_max(b: &SharedTokenBucket<Uncapped, ManualClock>, t: u64) {
    black_box(b.replenish_at(Duration::from_nanos(t)));
}

/// 64 × `fetch_add` + `load`: the floor.
#[inline(never)]
fn floor(a: &AtomicU64) {
    for _ in 0..EVERY {
        black_box(a.fetch_add(1, Ordering::AcqRel));
        black_box(a.load(Ordering::Acquire));
    }
}

fn main() {
    let cycles: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("a number of cycles"))
        .unwrap_or(10_000);
    // The cycle's rate: the dispatcher's 10^9 tokens/s, or the highest (`max`, as
    // `bucket/iothrottle_grab_deficiency_max_rate/1t`).
    let per_second = match std::env::args().nth(2).as_deref() {
        Some("max") => Rate::MAX_PER_SECOND,
        _ => 1_000_000_000,
    };
    let bucket_of_cycle = bucket(per_second);
    let fast = bucket(1_000_000_000);
    let alone = bucket(1_000_000_000);
    let a = AtomicU64::new(0);
    let at_max = SharedTokenBucket::from_state(
        BucketConfig::new(
            Rate::per_second(Rate::MAX_PER_SECOND),
            BucketConfig::MAX_LIMIT,
        ),
        ManualClock::new(),
        BucketState {
            tail: 0,
            head: 0,
            ceil: None,
        },
    )
    .expect("valid config");
    for i in 0..cycles {
        cycle(&bucket_of_cycle);
        grabs_only(&fast);
        replenish_only(&alone);
        floor(&a);
        replenish_at_max(&at_max, i + 1);
    }
    let added = bucket_of_cycle
        .snapshot()
        .head
        .wrapping_sub(BucketConfig::MAX_LIMIT);
    println!(
        "{cycles} cycles; the cycle's bucket added {added} tokens after its first fill ({} grabbed)",
        cycles * EVERY
    );
}
