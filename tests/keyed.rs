//! The keyed throttle: rate per key, independence of keys, idle eviction without a free burst,
//! the hard cap, concurrent checks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use iothrottle::keyed::KeyedThrottle;
use iothrottle::{BucketConfig, ManualClock, Rate};
use iothrottle::{KeyedConfigError, KeyedError};

fn keyed(max_keys: usize) -> (KeyedThrottle<String, ManualClock>, ManualClock) {
    let clock = ManualClock::new();
    let k = KeyedThrottle::with_clock(
        BucketConfig::new(Rate::per_second(1_000), 100),
        max_keys,
        clock.clone(),
    )
    .unwrap();
    (k, clock)
}

#[test]
fn each_key_gets_its_rate_and_burst_and_no_more() {
    let (k, clock) = keyed(10);
    let keys = ["a".to_owned(), "b".to_owned()];
    let mut granted = [0u64; 2];
    let step = Duration::from_micros(700);
    let mut t = Duration::ZERO;
    while t < Duration::from_secs(5) {
        for (i, key) in keys.iter().enumerate() {
            // Key a asks for 3 tokens at a time, key b for 1: both saturate.
            let cost = if i == 0 { 3 } else { 1 };
            while k.check(key, cost).is_ok() {
                granted[i] += cost;
            }
            let allowed = Rate::per_second(1_000).tokens_in(t) as u64 + 100;
            assert!(
                granted[i] <= allowed,
                "key {key}: {} > {allowed} at {t:?}",
                granted[i]
            );
        }
        clock.advance(step);
        t += step;
    }
    for g in granted {
        let ideal = 5_000 + 100;
        assert!(g as f64 >= 0.99 * ideal as f64, "{g} of {ideal}");
    }
}

#[test]
fn a_refusal_says_when_to_retry_and_that_is_exact() {
    let (k, clock) = keyed(10);
    let key = "t".to_owned();
    k.check(&key, 100).unwrap();
    let err = k.check(&key, 30).unwrap_err();
    assert_eq!(
        err,
        KeyedError::Insufficient {
            missing: 30,
            retry_after: Duration::from_millis(30)
        }
    );
    clock.advance(Duration::from_millis(29));
    assert!(k.check(&key, 30).is_err());
    clock.advance(Duration::from_millis(1));
    k.check(&key, 30).unwrap();
}

#[test]
fn bad_costs_and_configs_are_typed_errors() {
    let (k, _) = keyed(1);
    assert_eq!(
        k.check(&"x".to_owned(), 101),
        Err(KeyedError::CostExceedsLimit {
            cost: 101,
            limit: 100
        })
    );
    assert_eq!(k.check(&"x".to_owned(), 0), Ok(()));
    assert!(
        k.is_empty(),
        "neither a refused nor a free check tracks the key"
    );
    assert!(matches!(
        KeyedThrottle::<u32>::new(BucketConfig::new(Rate::per_second(1), 1), 0),
        Err(KeyedConfigError::ZeroMaxKeys)
    ));
    assert!(matches!(
        KeyedThrottle::<u32>::new(BucketConfig::new(Rate::per_second(0), 1), 5),
        Err(KeyedConfigError::Bucket(_))
    ));
}

#[test]
fn a_key_is_evicted_only_once_its_bucket_would_be_full_again() {
    let (k, clock) = keyed(10);
    let key = "t".to_owned();
    k.check(&key, 100).unwrap(); // drained
    assert_eq!(k.idle_time(), Duration::from_millis(100));
    clock.advance(Duration::from_millis(99));
    assert_eq!(
        k.evict_idle(),
        0,
        "not refilled yet: evicting would grant a free burst"
    );
    assert_eq!(k.available(&key), Some(99));
    clock.advance(Duration::from_millis(1));
    // available() does not count as a use.
    assert_eq!(k.evict_idle(), 1);
    assert!(k.is_empty());
    // Re-created full: exactly what it would have had.
    k.check(&key, 100).unwrap();
    assert!(k.check(&key, 1).is_err());
}

#[test]
fn a_longer_idle_time_is_kept_and_a_shorter_one_raised() {
    let (k, _) = keyed(10);
    assert_eq!(
        k.with_idle_time(Duration::from_millis(1)).idle_time(),
        Duration::from_millis(100)
    );
    let (k, clock) = keyed(10);
    let k = k.with_idle_time(Duration::from_secs(60));
    k.check(&"a".to_owned(), 1).unwrap();
    clock.advance(Duration::from_secs(59));
    assert_eq!(k.evict_idle(), 0);
    clock.advance(Duration::from_secs(1));
    assert_eq!(k.evict_idle(), 1);
}

#[test]
fn the_cap_refuses_a_new_key_when_none_is_idle_and_evicts_idle_ones_otherwise() {
    let (k, clock) = keyed(3);
    for key in ["a", "b", "c"] {
        k.check(&key.to_owned(), 1).unwrap();
    }
    assert_eq!(
        k.check(&"d".to_owned(), 1),
        Err(KeyedError::TooManyKeys { max_keys: 3 })
    );
    assert_eq!(k.len(), 3);
    // Tracked keys still work at the cap.
    k.check(&"a".to_owned(), 1).unwrap();
    clock.advance(Duration::from_millis(60));
    k.check(&"a".to_owned(), 1).unwrap(); // a stays busy
    clock.advance(Duration::from_millis(60));
    // b and c are idle (120 ms ≥ 100 ms), a is not (60 ms): d evicts b and c.
    k.check(&"d".to_owned(), 1).unwrap();
    assert_eq!(k.len(), 2);
    assert!(k.available(&"a".to_owned()).is_some());
    assert!(k.available(&"b".to_owned()).is_none());
    assert!(k.remove(&"a".to_owned()));
    assert!(!k.remove(&"a".to_owned()));
    assert_eq!(k.len(), 1);
}

#[test]
fn concurrent_new_keys_never_overshoot_the_cap() {
    let (k, _) = keyed(50);
    let k = Arc::new(k);
    let accepted = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let k = Arc::clone(&k);
            let accepted = Arc::clone(&accepted);
            std::thread::spawn(move || {
                for i in 0..100 {
                    match k.check(&format!("{t}-{i}"), 1) {
                        Ok(()) => {
                            accepted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(KeyedError::TooManyKeys { max_keys: 50 }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    assert!(k.len() <= 50);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(accepted.load(Ordering::Relaxed), 50);
    assert_eq!(k.len(), 50);
}

#[test]
fn concurrent_checks_on_one_key_grant_exactly_the_bucket() {
    // Time stands still: 4 threads race for one key's 100 tokens; exactly 100 are granted.
    let (k, _) = keyed(10);
    let k = Arc::new(k);
    let granted = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let k = Arc::clone(&k);
            let granted = Arc::clone(&granted);
            std::thread::spawn(move || {
                for _ in 0..1_000 {
                    if k.check(&"hot".to_owned(), 1).is_ok() {
                        granted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(granted.load(Ordering::Relaxed), 100);
    assert_eq!(k.available(&"hot".to_owned()), Some(0));
}

#[cfg(feature = "rt")]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn until_ready_waits_for_the_key_on_tokio_time() {
    let k = KeyedThrottle::<u32, _>::with_clock(
        BucketConfig::new(Rate::per_second(1_000), 100),
        4,
        iothrottle::TokioClock::new(),
    )
    .unwrap();
    let start = tokio::time::Instant::now();
    k.until_ready(&7, 100).await.unwrap();
    k.until_ready(&7, 50).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(50));
    k.until_ready(&8, 100).await.unwrap(); // another key: at once
    assert_eq!(start.elapsed(), Duration::from_millis(50));
    assert!(matches!(
        k.until_ready(&8, 101).await,
        Err(KeyedError::CostExceedsLimit { .. })
    ));
}

/// The keyed throttle against a sequential model in unbounded integers: each key a bucket whose
/// level at `t` is `min(limit, level₀ + C(t) − C(t₀))` with `C(t) = floor(rate × t)`, the cap
/// evicting every key unused for the idle time when a new key needs room, `evict_idle` the same.
mod model {
    use std::collections::HashMap;
    use std::time::Duration;

    use proptest::prelude::*;

    use iothrottle::keyed::KeyedThrottle;
    use iothrottle::KeyedError;
    use iothrottle::{BucketConfig, ManualClock, Rate};

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Check(u8, u64),
        EvictIdle,
    }

    struct Model {
        tokens: u128,
        period: u128,
        limit: u128,
        idle: u128,
        max_keys: usize,
        /// key → (level at `at`, `at`).
        keys: HashMap<u8, (u128, u128)>,
    }

    impl Model {
        fn count(&self, t: u128) -> u128 {
            self.tokens * t / self.period
        }

        fn level(&self, key: u8, now: u128) -> u128 {
            let (level, at) = self.keys[&key];
            (level + self.count(now) - self.count(at)).min(self.limit)
        }

        fn evict_idle(&mut self, now: u128) -> usize {
            let idle = self.idle;
            let before = self.keys.len();
            self.keys.retain(|_, (_, at)| now - *at < idle);
            before - self.keys.len()
        }

        fn check(&mut self, key: u8, cost: u64, now: u128) -> Result<(), KeyedError> {
            if !self.keys.contains_key(&key) {
                if self.keys.len() == self.max_keys {
                    self.evict_idle(now);
                }
                if self.keys.len() == self.max_keys {
                    return Err(KeyedError::TooManyKeys {
                        max_keys: self.max_keys,
                    });
                }
                self.keys.insert(key, (self.limit, now));
            }
            let level = self.level(key, now);
            let cost = cost as u128;
            if level >= cost {
                self.keys.insert(key, (level - cost, now));
                return Ok(());
            }
            self.keys.insert(key, (level, now));
            let missing = cost - level;
            // The first t with C(t) ≥ C(now) + missing.
            let target = self.count(now) + missing;
            let at = (target * self.period).div_ceil(self.tokens);
            Err(KeyedError::Insufficient {
                missing: missing as u64,
                retry_after: Duration::from_nanos((at - now) as u64),
            })
        }
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..3_000_000).prop_map(Op::Advance),
            8 => (0u8..5, 1u64..=20).prop_map(|(k, c)| Op::Check(k, c)),
            1 => Just(Op::EvictIdle),
        ]
    }

    proptest! {
        #[test]
        fn the_keyed_throttle_matches_the_model_and_never_grants_more_than_the_rate(
            tokens in 1u64..=1_000,
            period_us in 1u64..=2_000,
            limit in 1u64..=20,
            max_keys in 1usize..=3,
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let rate = Rate::new(tokens, Duration::from_micros(period_us));
            let clock = ManualClock::new();
            let k = KeyedThrottle::<u8, _>::with_clock(BucketConfig::new(rate, limit), max_keys, clock.clone()).unwrap();
            let mut m = Model {
                tokens: tokens as u128,
                period: period_us as u128 * 1_000,
                limit: limit as u128,
                idle: k.idle_time().as_nanos(),
                max_keys,
                keys: HashMap::new(),
            };
            let mut now = 0u128;
            // Per key: (time, tokens granted) of every grant.
            let mut grants: HashMap<u8, Vec<(u128, u128)>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Advance(ns) => {
                        clock.advance(Duration::from_nanos(ns));
                        now += ns as u128;
                    }
                    Op::EvictIdle => prop_assert_eq!(k.evict_idle(), m.evict_idle(now)),
                    Op::Check(key, cost) => {
                        let cost = cost.min(limit);
                        let got = k.check(&key, cost);
                        prop_assert_eq!(got, m.check(key, cost, now), "key {} cost {} at {}", key, cost, now);
                        if got.is_ok() {
                            grants.entry(key).or_default().push((now, cost as u128));
                        }
                    }
                }
                prop_assert_eq!(k.len(), m.keys.len());
                prop_assert!(k.len() <= max_keys);
            }
            // Over every window [a, b] of the schedule, evictions and re-admissions included, a
            // key was granted at most limit + C(b) − C(a): no free burst, the exact long-run rate.
            for list in grants.values() {
                for i in 0..list.len() {
                    let mut sum = 0;
                    for &(b, n) in &list[i..] {
                        sum += n;
                        let a = list[i].0;
                        prop_assert!(sum <= m.limit + m.count(b) - m.count(a), "{} granted in [{}, {}]", sum, a, b);
                    }
                }
            }
        }
    }
}
