//! The shared token bucket against the floor (a bare atomic) and the competitors, in one group.
//!
//! Ids (`bucket/<case>/<threads>`):
//!
//! | case | what one op is |
//! |---|---|
//! | `iothrottle_grab_deficiency` | `grab(1)` + `deficiency`, a `replenish()` every 64 grabs (bucket on a `FastClock`, at the dispatcher's rate: 10^9 tokens/s) |
//! | `iothrottle_grab_deficiency_max_rate` (1t) | the same at `Rate::MAX_PER_SECOND`, where each replenish divides in 128 bits |
//! | `iothrottle_grab_deficiency_monotonic` (1t) | the same on a `MonotonicClock` (`Instant::now()`): what the clock costs |
//! | `iothrottle_grab_deficiency_threshold` (1t) | the same with the replenish threshold the dispatcher sets (20 µs of tokens): most replenishes find fewer and stop before any CAS |
//! | `iothrottle_grab_deficiency_only` (1t) | `grab(1)` + `deficiency`, never a replenish: the fast path alone |
//! | `atomic_fetch_add_floor` | `AtomicU64::fetch_add` + `load`: the floor |
//! | `governor_check` | governor direct `RateLimiter::check()` |
//! | `tokio_semaphore_try_acquire` | `Semaphore::try_acquire()` + `forget`, permits added back every 64 |
//! | `leaky_bucket_try_acquire` | leaky-bucket `try_acquire(1)` |
//! | `layout_padded` / `layout_packed` | a replica of grab + deficiency on two rovers, padded apart or in one cache line |
//! | `replenish_epoch_lockfree` | `replenish_at(t)` of the bucket, `t` one nanosecond later each call |
//!
//! `1t` runs on the bench thread; `2t` runs two threads (pinned to distinct cores where
//! possible) on one shared instance, and reports the time per op of one thread: the aggregate
//! throughput is two ops per reported time. No rate ever throttles: every case measures the
//! fast path. Ratios are what matter (targets: 1t ≤ 1.15× the floor and ≥ 3× faster than
//! governor; 2t at least tokio's `Semaphore` and ≥ 3× governor).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};
use crossbeam_utils::CachePadded;

use iothrottle::{
    BucketConfig, BucketState, Clock, FastClock, ManualClock, MonotonicClock, Rate,
    SharedTokenBucket, Uncapped,
};

use crate::threads::two_threads;

/// Replenish (or add permits back) once every this many ops, as Seastar's I/O queue roughly does.
const REPLENISH_EVERY: u64 = 64;

/// The dispatcher's rate: one token per nanosecond of disk time. With the largest limit it
/// never throttles here (one grab of one token takes longer than a nanosecond).
const DISK_RATE: u64 = 1_000_000_000;

/// A bucket that never throttles in a benchmark: `per_second` tokens a second and the largest
/// limit.
fn iothrottle_bucket<C: Clock>(clock: C, per_second: u64) -> SharedTokenBucket<Uncapped, C> {
    iothrottle_bucket_with(
        clock,
        BucketConfig::new(Rate::per_second(per_second), BucketConfig::MAX_LIMIT),
    )
}

/// A bucket of `cfg` on `clock`, filled.
fn iothrottle_bucket_with<C: Clock>(clock: C, cfg: BucketConfig) -> SharedTokenBucket<Uncapped, C> {
    let b = SharedTokenBucket::<Uncapped, C>::with_clock(cfg, clock).expect("valid config");
    b.replenish(); // the first replenish fills the bucket
    b
}

fn governor_limiter() -> governor::DefaultDirectRateLimiter {
    // 10^9 cells per second (one per ns) and the largest burst: never throttles here.
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap())
        .allow_burst(NonZeroU32::MAX);
    governor::RateLimiter::direct(quota)
}

fn semaphore() -> tokio::sync::Semaphore {
    tokio::sync::Semaphore::new(tokio::sync::Semaphore::MAX_PERMITS / 2)
}

fn leaky_bucket() -> leaky_bucket::RateLimiter {
    let max = usize::MAX >> 2;
    leaky_bucket::RateLimiter::builder()
        .max(max)
        .initial(max)
        .refill(max)
        .interval(Duration::from_millis(1))
        .fair(false)
        .build()
}

/// The rovers `tail` and `head` as the core lays them out: each on its own cache line.
#[derive(Default)]
struct Padded {
    tail: CachePadded<AtomicU64>,
    head: CachePadded<AtomicU64>,
}

/// The same two rovers in one cache line (as Seastar lays them out).
#[derive(Default)]
#[repr(C, align(64))]
struct Packed {
    tail: AtomicU64,
    head: AtomicU64,
}

/// What a layout replica needs: its two rovers.
trait Rovers: Send + Sync + Default + 'static {
    fn tail(&self) -> &AtomicU64;
    fn head(&self) -> &AtomicU64;
}

impl Rovers for Padded {
    fn tail(&self) -> &AtomicU64 {
        &self.tail
    }
    fn head(&self) -> &AtomicU64 {
        &self.head
    }
}

impl Rovers for Packed {
    fn tail(&self) -> &AtomicU64 {
        &self.tail
    }
    fn head(&self) -> &AtomicU64 {
        &self.head
    }
}

/// grab(1) + deficiency on a layout replica, with `head` advanced every 64 ops like a
/// replenish. Orderings as in the core.
#[inline]
fn replica_op<R: Rovers>(r: &R, i: u64) -> u64 {
    let tail = r.tail().fetch_add(1, Ordering::AcqRel) + 1;
    if i.is_multiple_of(REPLENISH_EVERY) {
        r.head().fetch_add(REPLENISH_EVERY, Ordering::AcqRel);
    }
    let head = r.head().load(Ordering::Acquire);
    (tail.wrapping_sub(head) as i64).max(0) as u64
}

fn iothrottle_op<C: Clock>(b: &SharedTokenBucket<Uncapped, C>, i: u64) {
    if i.is_multiple_of(REPLENISH_EVERY) {
        b.replenish();
    }
    let tail = b.grab(1);
    black_box(b.deficiency(tail));
}

fn iothrottle_fast_path_op(b: &SharedTokenBucket<Uncapped, FastClock>, _i: u64) {
    let tail = b.grab(1);
    black_box(b.deficiency(tail));
}

fn floor_op(a: &AtomicU64, _i: u64) {
    let v = a.fetch_add(1, Ordering::AcqRel);
    black_box(v);
    black_box(a.load(Ordering::Acquire));
}

fn governor_op(l: &governor::DefaultDirectRateLimiter, _i: u64) {
    let _ = black_box(l.check());
}

fn semaphore_op(s: &tokio::sync::Semaphore, i: u64) {
    if let Ok(p) = s.try_acquire() {
        p.forget();
    }
    if i % REPLENISH_EVERY == REPLENISH_EVERY - 1 {
        s.add_permits(REPLENISH_EVERY as usize);
    }
}

fn leaky_op(l: &leaky_bucket::RateLimiter, _i: u64) {
    black_box(l.try_acquire(1));
}

fn padded_op(r: &Padded, i: u64) {
    black_box(replica_op(r, i));
}

fn packed_op(r: &Packed, i: u64) {
    black_box(replica_op(r, i));
}

/// A replenish target and the fake clock its calls read: each call is one nanosecond later, so
/// that every call earns tokens at the highest rate (2.56 × 10^6 per ns) and, the bucket being
/// empty with the largest limit, goes all the way to the `head` CAS.
struct Repl<T> {
    now: AtomicU64,
    target: T,
}

fn repl_new() -> Repl<SharedTokenBucket<Uncapped, ManualClock>> {
    let cfg = BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    );
    let state = BucketState {
        tail: 0,
        head: 0,
        ceil: None,
    };
    let b = SharedTokenBucket::from_state(cfg, ManualClock::new(), state).expect("valid");
    Repl {
        now: AtomicU64::new(0),
        target: b,
    }
}

fn repl_new_op(r: &Repl<SharedTokenBucket<Uncapped, ManualClock>>, _i: u64) {
    let now = r.now.fetch_add(1, Ordering::Relaxed) + 1;
    black_box(r.target.replenish_at(Duration::from_nanos(now)));
}

/// One-thread case: `op` on a fresh instance, counted per call.
fn one<S: 'static>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    s: S,
    op: fn(&S, u64),
) {
    c.bench_function(BenchmarkId::new(name, "1t"), |b| {
        let mut i = 0u64;
        b.iter(|| {
            op(&s, i);
            i = i.wrapping_add(1);
        })
    });
}

/// Two-thread case: `op` on one shared instance from two threads.
fn two<S: Send + Sync + 'static>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    s: S,
    op: fn(&S, u64),
) {
    let s = Arc::new(s);
    c.bench_function(BenchmarkId::new(name, "2t"), |b| {
        b.iter_custom(|iters| {
            two_threads(true, |_| {
                let s = Arc::clone(&s);
                move || {
                    for i in 0..iters {
                        op(&s, i);
                    }
                }
            })
        })
    });
}

/// The `bucket` group: every case side by side.
pub fn bucket(c: &mut Criterion) {
    let mut g = c.benchmark_group("bucket");
    one(
        &mut g,
        "iothrottle_grab_deficiency",
        iothrottle_bucket(FastClock::new(), DISK_RATE),
        iothrottle_op,
    );
    // The highest rate a bucket takes: its count no longer fits 64 bits, so each replenish
    // divides in 128 bits.
    one(
        &mut g,
        "iothrottle_grab_deficiency_max_rate",
        iothrottle_bucket(FastClock::new(), Rate::MAX_PER_SECOND),
        iothrottle_op,
    );
    // What the clock costs: the same on `Instant::now()`.
    one(
        &mut g,
        "iothrottle_grab_deficiency_monotonic",
        iothrottle_bucket(MonotonicClock::new(), DISK_RATE),
        iothrottle_op,
    );
    // The dispatcher's threshold (20 µs of tokens at its rate): a replenish that finds fewer
    // stops after the clock read and the pricing, before any CAS.
    one(
        &mut g,
        "iothrottle_grab_deficiency_threshold",
        iothrottle_bucket_with(
            FastClock::new(),
            BucketConfig::new(Rate::per_second(DISK_RATE), BucketConfig::MAX_LIMIT)
                .with_threshold(20_000),
        ),
        iothrottle_op,
    );
    // What the replenish every 64 grabs costs: the same ops without it.
    one(
        &mut g,
        "iothrottle_grab_deficiency_only",
        iothrottle_bucket(FastClock::new(), DISK_RATE),
        iothrottle_fast_path_op,
    );
    one(
        &mut g,
        "atomic_fetch_add_floor",
        AtomicU64::new(0),
        floor_op,
    );
    one(&mut g, "governor_check", governor_limiter(), governor_op);
    one(
        &mut g,
        "tokio_semaphore_try_acquire",
        semaphore(),
        semaphore_op,
    );
    one(&mut g, "leaky_bucket_try_acquire", leaky_bucket(), leaky_op);

    two(
        &mut g,
        "iothrottle_grab_deficiency",
        iothrottle_bucket(FastClock::new(), DISK_RATE),
        iothrottle_op,
    );
    two(
        &mut g,
        "atomic_fetch_add_floor",
        AtomicU64::new(0),
        floor_op,
    );
    two(&mut g, "governor_check", governor_limiter(), governor_op);
    two(
        &mut g,
        "tokio_semaphore_try_acquire",
        semaphore(),
        semaphore_op,
    );
    two(&mut g, "leaky_bucket_try_acquire", leaky_bucket(), leaky_op);

    // Does padding the rovers apart help under contention? (The core pads.)
    two(&mut g, "layout_padded", Padded::default(), padded_op);
    two(&mut g, "layout_packed", Packed::default(), packed_op);

    // The replenish path alone: claim (CAS on `last`) and fill (CAS on `head`) every call.
    one(&mut g, "replenish_epoch_lockfree", repl_new(), repl_new_op);
    two(&mut g, "replenish_epoch_lockfree", repl_new(), repl_new_op);
    g.finish();
}

criterion::criterion_group!(benches, bucket);
