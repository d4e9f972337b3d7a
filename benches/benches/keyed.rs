//! Per-key limits: iothrottle's `KeyedThrottle` against governor's keyed limiter
//! (`RateLimiter::keyed`, its default dashmap state store), in one group.
//!
//! Ids (`keyed/<case>/<keys>`): one op is one check of one key, the keys taken round-robin from
//! a set of `<keys>` distinct `u64` keys (all inserted before measuring). No rate ever throttles:
//! both sides measure the fast path of a key already tracked. Memory per key is measured by
//! `cargo run --release --example keyed_memory`.

use std::hint::black_box;
use std::num::NonZeroU32;

use criterion::{BenchmarkId, Criterion};

use iothrottle::keyed::KeyedThrottle;
use iothrottle::{BucketConfig, Rate};

fn iothrottle_keyed(keys: u64) -> KeyedThrottle<u64> {
    let cfg = BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    );
    let k = KeyedThrottle::new(cfg, keys as usize).expect("valid config");
    for key in 0..keys {
        k.check(&key, 1).expect("never throttles");
    }
    k
}

fn governor_keyed(keys: u64) -> governor::DefaultKeyedRateLimiter<u64> {
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap())
        .allow_burst(NonZeroU32::MAX);
    let l = governor::RateLimiter::keyed(quota);
    for key in 0..keys {
        l.check_key(&key).expect("never throttles");
    }
    l
}

/// The `keyed` group: both limiters, side by side, for a small and a large key set.
pub fn keyed(c: &mut Criterion) {
    let mut g = c.benchmark_group("keyed");
    for keys in [1_000u64, 100_000] {
        let ours = iothrottle_keyed(keys);
        g.bench_function(BenchmarkId::new("iothrottle_check", keys), |b| {
            let mut i = 0u64;
            b.iter(|| {
                let _ = black_box(ours.check(&(i % keys), 1));
                i = i.wrapping_add(1);
            })
        });
        drop(ours);
        let theirs = governor_keyed(keys);
        g.bench_function(BenchmarkId::new("governor_check_key", keys), |b| {
            let mut i = 0u64;
            b.iter(|| {
                let _ = black_box(theirs.check_key(&(i % keys)));
                i = i.wrapping_add(1);
            })
        });
    }
    g.finish();
}

criterion::criterion_group!(benches, keyed);
