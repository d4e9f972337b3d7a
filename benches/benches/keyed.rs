//! Per-key limits: iothrottle's `KeyedThrottle` against governor's keyed limiter
//! (`RateLimiter::keyed`, its default dashmap state store), in one group.
//!
//! Ids (`keyed/<case>/<keys>`, cases `iothrottle_check_{1t,2t}` and
//! `governor_check_key_{1t,2t}`): one op is one check of cost 1 on a key drawn at random (a
//! per-thread xorshift) among `<keys>` distinct `u64` keys, all tracked before measuring. Both
//! sides get the same quota (10^9 per second, a burst no check exhausts): each measures the
//! path of a tracked key that is granted. `2t` runs two threads (pinned to distinct cores
//! where possible) on one shared limiter and reports the time per op of one thread.
//!
//! Memory: before the group runs, each limiter is filled with `<keys>` keys while a counting
//! global allocator tallies the live heap bytes; bytes per key are printed
//! (`keyed/<keys>: iothrottle … B/key, governor … B/key`). The counter is off outside that
//! window (one relaxed load per allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion};

use iothrottle::keyed::KeyedThrottle;
use iothrottle::{BucketConfig, Rate};

use crate::threads::two_threads;

/// Counts live heap bytes while `COUNTING` is set.
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

fn count(delta: isize) {
    // Relaxed: a statistic read by the same thread after the window.
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Builds a limiter with `make` and returns it with the heap bytes it holds.
fn measured<T>(make: impl FnOnce() -> T) -> (T, isize) {
    LIVE.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let t = make();
    COUNTING.store(false, Ordering::Relaxed);
    (t, LIVE.load(Ordering::Relaxed))
}

const RATE: u64 = 1_000_000_000;

fn iothrottle_keyed(keys: u64) -> KeyedThrottle<u64> {
    let cfg = BucketConfig::new(Rate::per_second(RATE), u32::MAX as u64);
    let k = KeyedThrottle::new(cfg, keys as usize).expect("valid config");
    for key in 0..keys {
        k.check(&key, 1).expect("never throttles");
    }
    k
}

fn governor_keyed(keys: u64) -> governor::DefaultKeyedRateLimiter<u64> {
    let quota = governor::Quota::per_second(NonZeroU32::new(RATE as u32).unwrap())
        .allow_burst(NonZeroU32::MAX);
    let l = governor::RateLimiter::keyed(quota);
    for key in 0..keys {
        l.check_key(&key).expect("never throttles");
    }
    l
}

/// A key in `0..n` from a xorshift state (multiply-shift range reduction: no division).
#[inline]
fn next_key(state: &mut u64, n: u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    ((*state as u128 * n as u128) >> 64) as u64
}

fn ours_op(k: &KeyedThrottle<u64>, key: u64) {
    let _ = black_box(k.check(&key, 1));
}

fn theirs_op(l: &governor::DefaultKeyedRateLimiter<u64>, key: u64) {
    let _ = black_box(l.check_key(&key));
}

/// Both limiters for `keys`, one and two threads.
fn case<L: Send + Sync + 'static>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    keys: u64,
    limiter: L,
    op: fn(&L, u64),
) {
    let limiter = Arc::new(limiter);
    g.bench_function(BenchmarkId::new(format!("{name}_1t"), keys), |b| {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        b.iter(|| op(&limiter, next_key(&mut state, keys)))
    });
    g.bench_function(BenchmarkId::new(format!("{name}_2t"), keys), |b| {
        b.iter_custom(|iters| {
            two_threads(true, |t| {
                let limiter = Arc::clone(&limiter);
                let mut state = 0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1);
                move || {
                    for _ in 0..iters {
                        op(&limiter, next_key(&mut state, keys));
                    }
                }
            })
        })
    });
}

/// The `keyed` group: both limiters side by side at 1,000, 100,000 and 1,000,000 keys.
pub fn keyed(c: &mut Criterion) {
    let mut g = c.benchmark_group("keyed");
    for keys in [1_000u64, 100_000, 1_000_000] {
        let (ours, ours_bytes) = measured(|| iothrottle_keyed(keys));
        let (theirs, theirs_bytes) = measured(|| governor_keyed(keys));
        let per = |b: isize| b as f64 / keys as f64;
        println!(
            "keyed/{keys}: iothrottle {:.1} B/key, governor {:.1} B/key ({:.2}x)",
            per(ours_bytes),
            per(theirs_bytes),
            per(ours_bytes) / per(theirs_bytes)
        );
        case(&mut g, "iothrottle_check", keys, ours, ours_op);
        case(&mut g, "governor_check_key", keys, theirs, theirs_op);
    }
    g.finish();
}

criterion::criterion_group!(benches, keyed);
