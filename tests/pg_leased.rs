//! Leased mode against a real throwaway PostgreSQL. Time is a shared `ManualClock` that
//! drives both the local buckets and the database statements (`with_simulated_time`, feature
//! `test-util`), so nothing sleeps and every figure is deterministic up to task scheduling.
//!
//! "Processes" here are independent limiter instances, each with its own connection and its
//! own local buckets, in one test process: they share nothing but the database row, which is
//! all that the bound depends on.

mod common;

use std::time::{Duration, SystemTime};

use common::pg::{cluster_or_skip, PgCluster};
use common::pg_children::granted_by_children;
use common::pg_session::t0;
use iothrottle::pg::{LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions};
use iothrottle::{ManualClock, PgLimitError};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn leased(
    pg: &PgCluster,
    opts: LeaseOptions,
    clock: &ManualClock,
) -> PgLeasedLimiter<ManualClock> {
    let l = PgLeasedLimiter::with_simulated_time(
        &pg.connection_string(),
        PgOptions::new(),
        opts,
        clock.clone(),
        t0(),
    )
    .await
    .expect("connect");
    l.install().await.expect("install");
    l
}

/// Tokens in the key's global bucket at `clock`'s time, as strict mode sees them.
async fn global_micro(pg: &PgCluster, key: &str) -> i64 {
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.query_one(
        "SELECT micro FROM iothrottle.token_bucket WHERE id = $1",
        &[&key],
    )
    .await
    .unwrap()
    .get(0)
}

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
async fn postgres_restart_while_leases_are_out() {
    let Some(mut pg) = cluster_or_skip("postgres_restart_while_leases_are_out") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(100, 100, 50).unwrap().with_min_lease(50);
    let l = leased(&pg, opts, &clock).await;
    assert!(l.try_acquire("k", 1).await.unwrap());
    assert_eq!(l.local_tokens("k"), 49);
    pg.stop();
    // The lease keeps serving while the server is down.
    for _ in 0..49 {
        assert!(l.try_acquire("k", 1).await.unwrap());
    }
    // Dry: leasing needs the server. The session is found lost (`Connection`), or a
    // background lease found it lost first and reconnecting now backs off (`Unavailable`).
    let dry = l.try_acquire("k", 1).await;
    assert!(
        matches!(
            dry,
            Err(PgLimitError::Connection { .. }
                | PgLimitError::Connect { .. }
                | PgLimitError::Unavailable { .. })
        ),
        "{dry:?}"
    );
    pg.start_again().unwrap();
    clock.advance(ms(1_000));
    // Reconnected: leasing works again (a background refill may already have leased). A
    // background lease that failed while the server was down started the reconnect back-off:
    // the first call may still be told `Unavailable` with how long to wait.
    let mut first = l.try_acquire("k", 1).await;
    for _ in 0..100 {
        match first {
            Err(PgLimitError::Unavailable { retry_in, .. }) => {
                tokio::time::sleep(retry_in).await;
                first = l.try_acquire("k", 1).await;
            }
            _ => break,
        }
    }
    assert!(first.unwrap(), "reconnected and leased again");
    for _ in 1..60 {
        assert!(
            l.try_acquire("k", 1).await.unwrap(),
            "reconnected and leased again"
        );
    }
    let s = l.stats();
    assert_eq!(s.granted, 110);
    assert_eq!(s.leased, s.granted + l.local_tokens("k"));
    // The row survived the restart: nothing was leased twice. Over the 1 s since the first
    // lease at most burst + rate × 1 s = 200 can have been leased, and the row (as of its
    // last statement) accounts for exactly what was not.
    assert!(s.leased <= 200, "{s:?}");
    let row = global_micro(&pg, "k").await;
    assert!(row >= 0 && (s.leased as i64 * 1_000_000 + row) <= 200_000_000);
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

/// Lets the runtime run until `leases` leases have been asked for: a lease runs on a task of
/// its own, so a caller polled once has only spawned it.
async fn lease_asked(l: &PgLeasedLimiter<ManualClock>, leases: u64) {
    while l.stats().leases < leases {
        tokio::task::yield_now().await;
    }
}

/// Polls `fut` once: `Some` if it finished.
async fn poll_once<F: std::future::Future>(mut fut: std::pin::Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
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

/// Reads the server's clock.
async fn server_now(pg: &PgCluster) -> SystemTime {
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

const HOSTILE_KEYS: usize = 32;

fn hostile_options() -> LeaseOptions {
    LeaseOptions::new(1_000, 100, 20)
        .unwrap()
        .with_trickle_interval(ms(5))
}

/// Calls on `HOSTILE_KEYS` keys from 8 tasks until `stop`; per key the grants, and the
/// errors seen (each must be a typed connection or server error).
fn hammer(
    l: std::sync::Arc<PgLeasedLimiter>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    granted: std::sync::Arc<Vec<std::sync::atomic::AtomicU64>>,
    errors: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    use std::sync::atomic::Ordering::Relaxed;
    (0..8)
        .map(|t| {
            let (l, stop, granted, errors) =
                (l.clone(), stop.clone(), granted.clone(), errors.clone());
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    for k in (t..HOSTILE_KEYS).step_by(8) {
                        match l.try_acquire(&format!("h{k}"), 1).await {
                            Ok(true) => {
                                granted[k].fetch_add(1, Relaxed);
                            }
                            Ok(false) => {}
                            Err(
                                PgLimitError::Connection { .. }
                                | PgLimitError::Connect { .. }
                                | PgLimitError::Unavailable { .. }
                                | PgLimitError::Db { .. },
                            ) => {
                                errors.fetch_add(1, Relaxed);
                            }
                            Err(e) => panic!("untyped failure: {e:?}"),
                        }
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect()
}

/// Waits (yielding, with a generous guard against a hang) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let guard = std::time::Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(
            std::time::Instant::now() < guard,
            "hung waiting for: {what}"
        );
        tokio::time::sleep(ms(5)).await;
    }
}

fn counts(v: &[std::sync::atomic::AtomicU64]) -> Vec<u64> {
    v.iter()
        .map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
        .collect()
}

/// A new current-thread runtime with every driver (the tests drop one mid-lease).
fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every key has been granted more than it had at `then`.
fn every_key_advanced(v: &[std::sync::atomic::AtomicU64], then: &[u64]) -> bool {
    counts(v).iter().zip(then).all(|(now, then)| now > then)
}

/// Server stopped (fast shutdown) while batches of leases are in flight on 32 hot keys, then
/// started again: every failing call fails with a typed error, none hangs, leasing resumes
/// on every key after the restart, and no key is granted more than
/// `rate × W + burst + max_lease` (one process) over the whole run on the server's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stopped_under_batched_load() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    let Some(pg) = cluster_or_skip("server_stopped_under_batched_load") else {
        return;
    };
    let start = server_now(&pg).await;
    let opts = hostile_options();
    let l = Arc::new(
        PgLeasedLimiter::connect(
            &pg.connection_string(),
            PgOptions::new().with_connections(2),
            opts,
        )
        .await
        .unwrap(),
    );
    l.install().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let granted: Arc<Vec<AtomicU64>> =
        Arc::new((0..HOSTILE_KEYS).map(|_| AtomicU64::new(0)).collect());
    let errors = Arc::new(AtomicU64::new(0));
    let tasks = hammer(l.clone(), stop.clone(), granted.clone(), errors.clone());
    until("every key granted", || {
        counts(&granted).iter().all(|&g| g > 0)
    })
    .await;
    let pg = tokio::task::spawn_blocking(move || {
        let mut pg = pg;
        pg.stop();
        pg
    })
    .await
    .unwrap();
    until("calls fail while the server is down", || {
        errors.load(Relaxed) > 0
    })
    .await;
    let mut pg = pg;
    pg.start_again().unwrap();
    let at_restart = counts(&granted);
    until("every key leases again after the restart", || {
        every_key_advanced(&granted, &at_restart)
    })
    .await;
    stop.store(true, Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let end = server_now(&pg).await;
    let bound = opts.bound(1, end.duration_since(start).unwrap());
    let s = l.stats();
    eprintln!(
        "granted {:?}, {} errors, {} leases in {} statements, bound {bound} per key",
        counts(&granted),
        errors.load(Relaxed),
        s.leases,
        s.lease_statements
    );
    for (k, g) in counts(&granted).into_iter().enumerate() {
        assert!(g as u128 <= bound, "key h{k}: {g} > {bound}");
    }
}

/// The child of `kill_9_of_a_process_holding_leases`: leases on the hostile keys until it is
/// killed; prints `LEASING` once every key has been granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by kill_9_of_a_process_holding_leases"]
async fn leased_kill_child() {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;
    let Ok(conn) = std::env::var("IOTHROTTLE_KILL_CHILD") else {
        return;
    };
    let l = Arc::new(
        PgLeasedLimiter::connect(
            &conn,
            PgOptions::new().with_connections(2),
            hostile_options(),
        )
        .await
        .unwrap(),
    );
    let granted: Arc<Vec<AtomicU64>> =
        Arc::new((0..HOSTILE_KEYS).map(|_| AtomicU64::new(0)).collect());
    let _tasks = hammer(
        l,
        Arc::new(AtomicBool::new(false)),
        granted.clone(),
        Arc::new(AtomicU64::new(0)),
    );
    until("every key granted", || {
        counts(&granted).iter().all(|&g| g > 0)
    })
    .await;
    println!("LEASING");
    std::future::pending::<()>().await;
}

/// `kill -9` of a process that holds leases on 32 hot keys and has batches in flight, while
/// this process leases the same keys: the survivor keeps leasing every key (the killed
/// backend's row locks go with its session) and never grants more than the bound for one
/// process, `rate × W + burst + max_lease` on the server's clock; the killed process's
/// tokens are lost (under-use), not granted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_process_holding_leases() {
    use std::io::BufRead;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    let Some(pg) = cluster_or_skip("kill_9_of_a_process_holding_leases") else {
        return;
    };
    let setup = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    setup.install().await.unwrap();
    let start = server_now(&pg).await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["leased_kill_child", "--exact", "--ignored", "--nocapture"])
        .env("IOTHROTTLE_KILL_CHILD", pg.connection_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let ready = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            if line.contains("LEASING") {
                return true;
            }
            line.clear();
        }
        false
    })
    .await
    .unwrap();
    assert!(ready, "the child leased");
    let opts = hostile_options();
    let l = Arc::new(
        PgLeasedLimiter::connect(
            &pg.connection_string(),
            PgOptions::new().with_connections(2),
            opts,
        )
        .await
        .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let granted: Arc<Vec<AtomicU64>> =
        Arc::new((0..HOSTILE_KEYS).map(|_| AtomicU64::new(0)).collect());
    let errors = Arc::new(AtomicU64::new(0));
    let tasks = hammer(l.clone(), stop.clone(), granted.clone(), errors.clone());
    until("both processes lease every key", || {
        counts(&granted).iter().all(|&g| g > 0)
    })
    .await;
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let at_kill = counts(&granted);
    until("the survivor leases every key after the kill", || {
        every_key_advanced(&granted, &at_kill)
    })
    .await;
    stop.store(true, Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let end = server_now(&pg).await;
    let bound = opts.bound(1, end.duration_since(start).unwrap());
    eprintln!(
        "survivor granted {:?}; bound {bound} per key",
        counts(&granted)
    );
    assert_eq!(errors.load(Relaxed), 0, "the survivor saw no error");
    for (k, g) in counts(&granted).into_iter().enumerate() {
        assert!(g as u128 <= bound, "key h{k}: {g} > {bound}");
    }
}

/// A runtime shut down while a lease's batch is under way drops the task that runs the
/// session's batches. The session must not stay marked as having one running (its next
/// lease would wait forever): used from a new runtime, the limiter reconnects and leases.
#[test]
fn runtime_shut_down_mid_lease_leaves_no_batch_stuck() {
    let Some(pg) = cluster_or_skip("runtime_shut_down_mid_lease_leaves_no_batch_stuck") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 100, 10).unwrap().with_min_lease(10);
    let first = current_thread_runtime();
    let l = first.block_on(async {
        let l = leased(&pg, opts, &clock).await;
        assert!(l.try_acquire("warm", 1).await.unwrap());
        {
            let mut call = std::pin::pin!(l.try_acquire("k", 1));
            assert!(poll_once(call.as_mut()).await.is_none());
            lease_asked(&l, 2).await; // queued in its session's batch
        }
        l
    });
    drop(first);
    current_thread_runtime().block_on(async {
        let next = tokio::time::timeout(Duration::from_secs(30), l.try_acquire("k", 1)).await;
        assert!(
            matches!(next, Ok(Ok(true))),
            "the next lease failed or hung: {next:?}"
        );
    });
}

/// A runtime shut down while a key's background refill is under way must not leave the key's
/// refill flag held: used from a new runtime, a take that leaves the key low starts a
/// background lease again (before, the flag stayed claimed by the dropped task and the key
/// only ever leased from its callers' slow path, after running dry).
#[test]
fn runtime_shut_down_mid_refill_leaves_the_refill_flag_free() {
    let Some(pg) = cluster_or_skip("runtime_shut_down_mid_refill_leaves_the_refill_flag_free")
    else {
        return;
    };
    let clock = ManualClock::new();
    // Leases of 10; the low-water line is half a lease.
    let opts = LeaseOptions::new(10, 100, 10).unwrap().with_min_lease(10);
    let first = current_thread_runtime();
    let l = first.block_on(async {
        let l = leased(&pg, opts, &clock).await;
        assert!(l.try_acquire("k", 1).await.unwrap()); // leased 10 (slow path), 9 left
        assert!(l.try_acquire("k", 5).await.unwrap()); // fast path: 4 left, low
        lease_asked(&l, 2).await; // the background refill's lease is under way
        l
    });
    drop(first);
    current_thread_runtime().block_on(async {
        let before = l.stats().leases;
        assert_eq!(l.local_tokens("k"), 4);
        assert!(l.try_acquire("k", 1).await.unwrap()); // fast path, 3 left: still low
        until("a background refill leases again", || {
            l.stats().leases > before
        })
        .await;
        until("its tokens land", || l.local_tokens("k") > 3).await;
    });
}
