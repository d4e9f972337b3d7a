//! Leased mode against a real throwaway PostgreSQL. Time is a shared `ManualClock` that
//! drives both the local buckets and the database statements (`with_simulated_time`, feature
//! `test-util`), so nothing sleeps and every figure is deterministic up to task scheduling.
//!
//! "Processes" here are independent limiter instances, each with its own connection and its
//! own local buckets, in one test process: they share nothing but the database row, which is
//! all that the bound depends on. Leased mode when the server, a process or the runtime fails
//! is tested in `tests/pg_leased_faults.rs`.

mod common;

use std::time::Duration;

use common::pg::cluster_or_skip;
use common::pg_children::granted_by_children;
use common::pg_leased::{global_micro, lease_asked, leased, ms, poll_once};
use common::pg_session::t0;
use iothrottle::pg::{LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions};
use iothrottle::{ManualClock, PgLimitError};

/// A small deterministic generator (no dependency, reproducible runs).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

#[tokio::test]
async fn bound_holds_across_four_processes() {
    let Some(pg) = cluster_or_skip("bound_holds_across_four_processes") else {
        return;
    };
    const K: u64 = 4;
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(1_000, 200, 100)
        .unwrap()
        .with_lease_period(ms(50))
        .with_trickle_interval(ms(10));
    let mut procs = Vec::new();
    for _ in 0..K {
        procs.push(leased(&pg, opts, &clock).await);
    }
    let mut rng = Lcg(42);
    // (time in µs, tokens granted at that time)
    let mut events: Vec<(u64, u64)> = Vec::new();
    let mut calls = 0u64;
    for _ in 0..3_000 {
        clock.advance(Duration::from_micros(rng.next(4_000)));
        let now = clock_us(&clock);
        let mut granted = 0;
        for p in &procs {
            for _ in 0..rng.next(6) {
                let n = 1 + rng.next(3);
                calls += 1;
                if p.try_acquire("hot", n).await.unwrap() {
                    granted += n;
                }
            }
        }
        events.push((now, granted));
    }
    let total: u64 = events.iter().map(|e| e.1).sum();
    let span = Duration::from_micros(events.last().unwrap().0 - events[0].0);
    // Every window [events[i], events[j]].
    let mut worst = 0f64;
    for i in 0..events.len() {
        let mut sum = 0u64;
        for j in i..events.len() {
            sum += events[j].1;
            let w = Duration::from_micros(events[j].0 - events[i].0);
            let bound = opts.bound(K, w);
            assert!(
                sum as u128 <= bound,
                "{sum} tokens granted in a window of {w:?}, bound {bound}"
            );
            worst = worst.max(sum as f64 / bound as f64);
        }
    }
    let leases: u64 = procs.iter().map(|p| p.stats().leases).sum();
    let ideal = opts.bound(0, span);
    eprintln!(
        "{calls} calls, {total} granted over {span:?} (rate × span + burst = {ideal}), \
         {leases} lease statements, worst window at {:.1}% of the bound",
        worst * 100.0
    );
    // Demand (~2 tokens × 2.5 calls × 4 processes per 2 ms) is far above the rate, so the
    // global rate is used: at least 95% of rate × span + burst (minus what is held locally).
    assert!(
        total as f64 >= 0.95 * ideal as f64 - (K * opts.max_lease()) as f64,
        "{total} of {ideal}"
    );
    // While the global bucket is empty each process asks at most once per trickle interval.
    let span_ms = span.as_millis() as u64;
    assert!(
        leases <= K * (span_ms / 10 + 50),
        "{leases} lease statements"
    );
}

fn clock_us(clock: &ManualClock) -> u64 {
    use iothrottle::Clock;
    clock.now().as_micros() as u64
}

#[tokio::test]
async fn shutdown_gives_unused_tokens_back() {
    let Some(pg) = cluster_or_skip("shutdown_gives_unused_tokens_back") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 1_000, 500)
        .unwrap()
        .with_min_lease(100);
    let l = leased(&pg, opts, &clock).await;
    assert!(l.try_acquire("k", 3).await.unwrap());
    assert_eq!(l.local_tokens("k"), 97);
    assert_eq!(global_micro(&pg, "k").await, 900_000_000);
    assert_eq!(l.shutdown().await.unwrap(), 97);
    assert_eq!(global_micro(&pg, "k").await, 997_000_000);
    assert_eq!(l.local_keys(), 0);
    let s = l.stats();
    assert_eq!((s.leased, s.returned, s.granted), (100, 97, 3));
    // Usable again afterwards.
    assert!(l.try_acquire("k", 1).await.unwrap());
}

#[tokio::test]
async fn local_keys_are_bounded_and_idle_keys_evicted() {
    let Some(pg) = cluster_or_skip("local_keys_are_bounded_and_idle_keys_evicted") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 1_000, 500)
        .unwrap()
        .with_min_lease(10)
        .with_max_keys(2)
        .with_idle_timeout(Duration::from_secs(10));
    let l = leased(&pg, opts, &clock).await;
    assert!(l.try_acquire("a", 1).await.unwrap());
    clock.advance(ms(5));
    assert!(l.try_acquire("b", 1).await.unwrap());
    clock.advance(ms(5));
    assert!(l.try_acquire("c", 1).await.unwrap());
    // "a" was the least recently used: evicted, its 9 tokens given back.
    assert_eq!(l.local_keys(), 2);
    assert_eq!(l.local_tokens("a"), 0);
    // 1000 − 10 leased at 0 ms, + 0.1 refilled by 10 ms, + 9 given back.
    assert_eq!(global_micro(&pg, "a").await, 999_100_000);
    clock.advance(Duration::from_secs(10));
    assert!(l.try_acquire("c", 1).await.unwrap()); // "c" is not idle
    assert_eq!(l.evict_idle().await.unwrap(), 1);
    assert_eq!(l.local_keys(), 1);
    let s = l.stats();
    assert_eq!(s.evictions, 2);
    assert_eq!(s.returned, 18);
}

#[tokio::test]
async fn key_handles_follow_evictions() {
    let Some(pg) = cluster_or_skip("key_handles_follow_evictions") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 1_000, 500)
        .unwrap()
        .with_min_lease(10)
        .with_max_keys(1);
    let l = leased(&pg, opts, &clock).await;
    let mut a = l.key("a").await.unwrap();
    assert_eq!(a.key(), "a");
    assert!(a.try_acquire(2).await.unwrap());
    assert_eq!(l.local_tokens("a"), 8);
    assert!(matches!(
        a.try_acquire(0).await,
        Err(PgLimitError::InvalidCount { n: 0 })
    ));
    assert!(matches!(
        a.try_acquire(501).await,
        Err(PgLimitError::TooManyTokens { n: 501, max: 500 })
    ));
    // "b" evicts "a" (max_keys 1): its 8 tokens go back.
    assert!(l.try_acquire("b", 1).await.unwrap());
    assert_eq!(l.stats().returned, 8);
    // The handle's stale state has no tokens; its next call re-resolves "a" and leases.
    assert!(a.try_acquire(1).await.unwrap());
    assert_eq!(l.local_tokens("a"), 9);
    let s = l.stats();
    assert_eq!(s.granted, 2 + 1 + 1);
    assert_eq!(s.leased, 30);
}

#[tokio::test]
async fn lease_size_follows_local_consumption() {
    let Some(pg) = cluster_or_skip("lease_size_follows_local_consumption") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(1_000_000, 1_000_000, 10_000)
        .unwrap()
        .with_lease_period(ms(100));
    let l = leased(&pg, opts, &clock).await;
    // 100 tokens per second: leases of about 10 (100/s × 100 ms).
    for _ in 0..200 {
        clock.advance(ms(10));
        assert!(l.try_acquire("slow", 1).await.unwrap());
    }
    let slow = l.stats().largest_lease;
    assert!(slow <= 20, "slow key leased {slow} at once");
    // 100 000 per second: leases grow to about 10 000 (the cap).
    let before = l.stats().leases;
    for _ in 0..200 {
        clock.advance(ms(1));
        for _ in 0..100 {
            assert!(l.try_acquire("fast", 1).await.unwrap());
        }
        tokio::task::yield_now().await; // let a background refill run
    }
    let fast = l.stats().largest_lease;
    let leases = l.stats().leases - before;
    eprintln!("slow key: largest lease {slow}; fast key: largest {fast}, {leases} leases for 20 000 tokens");
    assert!(fast >= 5_000, "fast key leased at most {fast} at once");
    assert!(leases <= 30, "{leases} leases for 20 000 tokens");
}

#[tokio::test]
async fn empty_global_bucket_trickles() {
    let Some(pg) = cluster_or_skip("empty_global_bucket_trickles") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(1_000, 100, 100)
        .unwrap()
        .with_min_lease(100)
        .with_trickle_interval(ms(10));
    let l = leased(&pg, opts, &clock).await;
    let mut granted = 0;
    while l.try_acquire("k", 1).await.unwrap() {
        granted += 1;
    }
    assert_eq!(granted, 100, "the burst");
    // Frozen clock: further calls are refused locally, without a statement.
    let statements = l.db_stats().calls;
    for _ in 0..1_000 {
        assert!(!l.try_acquire("k", 1).await.unwrap());
    }
    assert_eq!(
        l.db_stats().calls,
        statements,
        "no statement while trickling"
    );
    // Each trickle interval brings what accrued: 10 tokens per 10 ms, not a lump.
    for round in 0..20 {
        clock.advance(ms(10));
        let mut got = 0;
        while l.try_acquire("k", 1).await.unwrap() {
            got += 1;
        }
        assert_eq!(got, 10, "round {round}");
    }
    assert!(l.db_stats().calls <= statements + 20);
}

#[tokio::test]
async fn leased_bad_input_is_a_typed_error() {
    let Some(pg) = cluster_or_skip("leased_bad_input_is_a_typed_error") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 10, 5).unwrap();
    let l = leased(&pg, opts, &clock).await;
    assert!(matches!(
        l.try_acquire("", 1).await,
        Err(PgLimitError::EmptyKey)
    ));
    assert!(matches!(
        l.try_acquire(&"x".repeat(257), 1).await,
        Err(PgLimitError::KeyTooLong { .. })
    ));
    assert!(matches!(
        l.try_acquire("k", 0).await,
        Err(PgLimitError::InvalidCount { n: 0 })
    ));
    assert!(matches!(
        l.try_acquire("k", 6).await,
        Err(PgLimitError::TooManyTokens { n: 6, max: 5 })
    ));
    assert!(matches!(
        LeaseOptions::new(0, 10, 5),
        Err(PgLimitError::InvalidRate { rate: 0 })
    ));
    assert!(matches!(
        LeaseOptions::new(-1, 10, 5),
        Err(PgLimitError::InvalidRate { rate: -1 })
    ));
    assert!(matches!(
        LeaseOptions::new(10, 0, 5),
        Err(PgLimitError::InvalidBurst { burst: 0 })
    ));
    assert!(matches!(
        LeaseOptions::new(10, 10, 0),
        Err(PgLimitError::InvalidOption {
            name: "max_lease",
            ..
        })
    ));
    assert!(opts.with_min_lease(6).validate().is_err());
    assert!(opts.with_max_keys(0).validate().is_err());
    // Strict and leased callers share the row.
    let strict = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    assert!(l.try_acquire("shared", 5).await.unwrap());
    // The strict caller's classic view of a 10/s, 1 s bucket: 5 left in the row.
    assert_eq!(strict.peek_at("shared", 10, 1, t0()).await.unwrap(), 5);
}

/// The child side of `bound_holds_across_spawned_processes`: does nothing unless started by
/// it (the environment variable carries the server, the key and how long to run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by bound_holds_across_spawned_processes"]
async fn leased_child_process() {
    let Ok(spec) = std::env::var("IOTHROTTLE_LEASE_CHILD") else {
        return;
    };
    let mut parts = spec.split('|');
    let (conn, key, millis) = (
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().parse::<u64>().unwrap(),
    );
    let l = PgLeasedLimiter::connect(&conn, PgOptions::new(), child_options())
        .await
        .unwrap();
    let end = std::time::Instant::now() + ms(millis);
    let mut granted = 0u64;
    while std::time::Instant::now() < end {
        for _ in 0..64 {
            if l.try_acquire(&key, 1).await.unwrap() {
                granted += 1;
            }
        }
        tokio::task::yield_now().await;
    }
    let returned = l.shutdown().await.unwrap();
    println!("GRANTED={granted} RETURNED={returned}");
}

fn child_options() -> LeaseOptions {
    LeaseOptions::new(5_000, 500, 200)
        .unwrap()
        .with_lease_period(ms(20))
}

/// Four real processes (this test binary, re-run as `leased_child_process`) hammer one key
/// with the server's clock. Whatever the machine's speed, the grants between two reads of
/// the server's clock taken before the first child starts and after the last one exits obey
/// `rate × W + burst + K × max_lease`: this asserts the bound, not a timing.
#[tokio::test]
async fn bound_holds_across_spawned_processes() {
    let Some(pg) = cluster_or_skip("bound_holds_across_spawned_processes") else {
        return;
    };
    const K: u64 = 4;
    let spec = format!("{}|spawned|1500", pg.connection_string());
    let env = ("IOTHROTTLE_LEASE_CHILD", spec.as_str());
    let (total, w) = granted_by_children(&pg, "leased_child_process", env, K).await;
    let opts = child_options();
    let bound = opts.bound(K, w);
    eprintln!("{K} processes granted {total} in {w:?}; bound {bound}");
    assert!(total as u128 <= bound, "{total} > {bound}");
    // They did use the key: at least the burst.
    assert!(total >= opts.burst() as u64);
}

/// Leased eviction never holds 2× `max_lease`: an evicted key state is closed at once, not
/// left usable until its give-back gets the key's lease mutex (with a lease of the old state
/// in flight, a re-created state for the same key would lease `max_lease` too, and both states
/// would serve calls locally). Driven step by step on a current-thread runtime with a frozen clock.
#[tokio::test]
async fn leased_eviction_never_holds_more_than_max_lease() {
    let Some(pg) = cluster_or_skip("leased_eviction_never_holds_more_than_max_lease") else {
        return;
    };
    let clock = ManualClock::new();
    // Every lease asks for all the room (min_lease = max_lease); one key at a time.
    let opts = LeaseOptions::new(1, 300, 100)
        .unwrap()
        .with_min_lease(100)
        .with_max_keys(1);
    let l = leased(&pg, opts, &clock).await;
    let mut a = l.key("a").await.unwrap();
    assert!(a.try_acquire(100).await.unwrap()); // leased 100, all taken
    let mut on_b = std::pin::pin!(l.try_acquire("b", 1));
    {
        // The handle runs dry: its slow path leases for "a" and waits for the server.
        let mut on_a = std::pin::pin!(a.try_acquire(1));
        assert!(poll_once(on_a.as_mut()).await.is_none());
        lease_asked(&l, 2).await;
        // "b" evicts "a" while that lease is in flight.
        assert!(poll_once(on_b.as_mut()).await.is_none());
        // "a" again, through the map: a new state, which leases.
        assert!(l.try_acquire("a", 1).await.unwrap());
        // The old lease lands.
        assert!(on_a.await.unwrap());
    }
    let leases = l.stats().leases;
    // What the process can still grant for "a" without a lease statement is at most
    // max_lease: the handle and the map must not both hold a lease's worth.
    // (One round: were the old state still usable, a second one would wait for its mutex
    // behind the eviction's give-back, which this test does not poll.)
    let mut local = 0;
    let before = l.stats().leases;
    if a.try_acquire(98).await.unwrap() && l.stats().leases == before {
        local += 98;
    }
    let before = l.stats().leases;
    if l.try_acquire("a", 98).await.unwrap() && l.stats().leases == before {
        local += 98;
    }
    assert!(
        local <= 100,
        "{local} tokens of \"a\" granted locally after {leases} leases: more than max_lease"
    );
    // "b"'s call finishes (it may have been evicted and re-created meanwhile).
    on_b.await.unwrap();
}

/// A lease in flight when `shutdown` closes its key: its tokens land on a closed state and
/// go back to the row; the call then leases for a fresh state. Nothing is lost or created:
/// the row ends with the burst minus exactly what was granted (the clock is frozen).
#[tokio::test]
async fn lease_landing_after_shutdown_gives_its_tokens_back() {
    let Some(pg) = cluster_or_skip("lease_landing_after_shutdown_gives_its_tokens_back") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(1, 300, 100).unwrap().with_min_lease(100);
    let l = leased(&pg, opts, &clock).await;
    let mut a = l.key("a").await.unwrap();
    assert!(a.try_acquire(100).await.unwrap());
    {
        let mut on_a = std::pin::pin!(a.try_acquire(1));
        assert!(poll_once(on_a.as_mut()).await.is_none()); // its lease is in flight
        lease_asked(&l, 2).await;
        assert_eq!(l.shutdown().await.unwrap(), 0); // nothing held yet
        assert!(on_a.await.unwrap());
    }
    assert_eq!(l.local_tokens("a"), 99);
    assert_eq!(l.shutdown().await.unwrap(), 99);
    let s = l.stats();
    assert_eq!((s.leased, s.returned), (300, 199));
    assert_eq!(global_micro(&pg, "a").await, (300 - 101) * 1_000_000);
}

/// The leases of all keys waiting for a session go out as one statement, not one statement
/// (one WAL flush) per lease, which with 1,000 hot keys would give them two thirds of their
/// rate. On a
/// current-thread runtime the 64 first calls all queue their leases before the first batch
/// runs; each row gives exactly its lease.
#[tokio::test]
async fn leases_of_many_keys_share_one_statement() {
    let Some(pg) = cluster_or_skip("leases_of_many_keys_share_one_statement") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 100, 50).unwrap().with_min_lease(50);
    let l = std::sync::Arc::new(
        PgLeasedLimiter::with_simulated_time(
            &pg.connection_string(),
            PgOptions::new().with_connections(1),
            opts,
            clock.clone(),
            t0(),
        )
        .await
        .unwrap(),
    );
    l.install().await.unwrap();
    assert!(l.try_acquire("warm", 1).await.unwrap());
    let before = l.db_stats().calls;
    let calls: Vec<_> = (0..64)
        .map(|k| {
            let l = l.clone();
            tokio::spawn(async move { l.try_acquire(&format!("k{k}"), 1).await.unwrap() })
        })
        .collect();
    for c in calls {
        assert!(c.await.unwrap());
    }
    let statements = l.db_stats().calls - before;
    assert!(statements <= 2, "{statements} statements for 64 leases");
    let s = l.stats();
    assert_eq!(s.leases, 65);
    for k in 0..64 {
        let key = format!("k{k}");
        assert_eq!(l.local_tokens(&key), 49, "{key}");
        assert_eq!(global_micro(&pg, &key).await, 50_000_000, "{key}");
    }
}

/// A cancelled acquire does not lose the tokens of its lease in flight: leases run on a task
/// of their own and always land (run in the caller's future, a caller dropped while its
/// statement was at the server would leave the tokens taken from the row and never
/// deposited, and the next call would lease again).
#[tokio::test]
async fn cancelled_acquire_mid_lease_loses_no_tokens() {
    let Some(pg) = cluster_or_skip("cancelled_acquire_mid_lease_loses_no_tokens") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(1, 300, 100).unwrap().with_min_lease(100);
    let l = leased(&pg, opts, &clock).await;
    // Sessions open, statements prepared.
    assert!(l.try_acquire("warm", 1).await.unwrap());
    {
        let mut call = std::pin::pin!(l.try_acquire("k", 1));
        assert!(poll_once(call.as_mut()).await.is_none());
        lease_asked(&l, 2).await; // the lease for "k" is under way
    } // the caller gives up
      // The next call is served by that lease: no second lease, nothing lost.
    assert!(l.try_acquire("k", 1).await.unwrap());
    let s = l.stats();
    assert_eq!(s.leases, 2, "{s:?}");
    assert_eq!(l.local_tokens("k"), 99);
    assert_eq!(global_micro(&pg, "k").await, 200_000_000);
}
