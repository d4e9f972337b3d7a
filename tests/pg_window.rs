//! The sliding-window log against a real throwaway PostgreSQL.

mod common;

use std::time::Duration;

use common::pg::{cluster_or_skip, PgCluster};
use common::pg_session::t0;
use iothrottle::pg::{PgOptions, PgWindowLimiter, Zone};
use iothrottle::PgLimitError;
use tokio_postgres::NoTls;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn limiter(pg: &PgCluster) -> PgWindowLimiter {
    let l = PgWindowLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .expect("connect");
    l.install().await.expect("install");
    l
}

fn zone(id: &str, rate: i32, window_seconds: i32) -> Zone {
    Zone {
        id: id.into(),
        description: format!("{rate} per {window_seconds} s"),
        rate,
        window_seconds,
    }
}

async fn count(pg: &PgCluster, sql: &str) -> i64 {
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn exact_moving_window() {
    let Some(pg) = cluster_or_skip("exact_moving_window") else {
        return;
    };
    let l = limiter(&pg).await;
    l.upsert_zone(&zone("login", 3, 60)).await.unwrap();
    let t = t0();
    let mut ids = Vec::new();
    for (at, blocked) in [
        (0, false),
        (1_000, false),
        (2_000, false),
        (3_000, true),   // 3 allowed in the last 60 s
        (59_999, true),  // the attempt at 0 is still inside (59.999 s ago)
        (60_000, false), // ... and now it is out: exactly one slot frees
        (60_001, true),  // 1, 2 and 60 s are inside
        (61_000, false), // 1 s left the window
        (62_000, false), // 2 s left; blocked attempts never counted
        (62_000, true),
        (200_000, false),
    ] {
        let d = l.check_at("login", "alice", t + ms(at)).await.unwrap();
        assert_eq!(d.blocked, blocked, "attempt at {at} ms");
        assert_eq!(d.zone, "login");
        assert_eq!(d.key, "alice");
        assert_eq!(d.rate, 3);
        assert_eq!(d.window, Duration::from_secs(60));
        ids.push(d.attempt_id);
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "attempt ids increase");
    // Keys are independent; every attempt is logged.
    assert!(
        !l.check_at("login", "bob", t + ms(3_000))
            .await
            .unwrap()
            .blocked
    );
    assert_eq!(
        count(&pg, "SELECT count(*) FROM iothrottle.window_log").await,
        12
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM iothrottle.window_log WHERE blocked"
        )
        .await,
        4
    );
    // Changing the zone takes effect at once.
    l.upsert_zone(&zone("login", 1, 60)).await.unwrap();
    assert!(
        l.check_at("login", "bob", t + ms(4_000))
            .await
            .unwrap()
            .blocked
    );
}

#[tokio::test]
async fn concurrent_checks_of_one_key_allow_exactly_the_rate() {
    let Some(pg) = cluster_or_skip("concurrent_checks_of_one_key_allow_exactly_the_rate") else {
        return;
    };
    let first = limiter(&pg).await;
    first.upsert_zone(&zone("api", 25, 10)).await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let l = limiter(&pg).await;
        tasks.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..10 {
                if !l.check_at("api", "k", t0()).await.unwrap().blocked {
                    allowed += 1;
                }
            }
            allowed
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += t.await.unwrap();
    }
    assert_eq!(allowed, 25);
}

#[tokio::test]
async fn retention_deletes_old_rows_in_batches() {
    let Some(pg) = cluster_or_skip("retention_deletes_old_rows_in_batches") else {
        return;
    };
    let l = limiter(&pg).await;
    l.upsert_zone(&zone("short", 100, 10)).await.unwrap();
    l.upsert_zone(&zone("long", 100, 1000)).await.unwrap();
    let t = t0();
    for i in 0..30u64 {
        l.check_at("short", &format!("k{}", i % 3), t + ms(i * 1000))
            .await
            .unwrap();
        l.check_at("long", "k", t + ms(i * 1000)).await.unwrap();
    }
    // At t + 30 s, "short" keeps attempts after t + 20 s (20..=29 s are inside; 20 s is
    // exactly the edge and goes); "long" keeps all.
    let deleted = l.purge(7, Some(t + ms(30_000))).await.unwrap();
    assert_eq!(deleted, 21);
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM iothrottle.window_log WHERE zone = 'short'"
        )
        .await,
        9
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM iothrottle.window_log WHERE zone = 'long'"
        )
        .await,
        30
    );
    // The window's decisions are unchanged by the purge.
    assert_eq!(l.purge(7, Some(t + ms(30_000))).await.unwrap(), 0);
    // Later everything of "short" goes, and its key rows too.
    assert_eq!(l.purge(1000, Some(t + ms(100_000))).await.unwrap(), 9);
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM iothrottle.window_key WHERE zone = 'short'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM iothrottle.window_key WHERE zone = 'long'"
        )
        .await,
        1
    );
    assert!(matches!(
        l.purge(0, None).await,
        Err(PgLimitError::InvalidOption { name: "batch", .. })
    ));
}

#[tokio::test]
async fn window_bad_input_is_a_typed_error() {
    let Some(pg) = cluster_or_skip("window_bad_input_is_a_typed_error") else {
        return;
    };
    let l = limiter(&pg).await;
    assert!(matches!(
        l.check("nope", "k").await,
        Err(PgLimitError::UnknownZone { zone }) if zone == "nope"
    ));
    l.upsert_zone(&zone("z", 1, 1)).await.unwrap();
    assert!(matches!(
        l.check("z", "").await,
        Err(PgLimitError::EmptyKey)
    ));
    assert!(matches!(
        l.check("z", &"x".repeat(300)).await,
        Err(PgLimitError::KeyTooLong { len: 300, .. })
    ));
    assert!(matches!(
        l.check("", "k").await,
        Err(PgLimitError::InvalidName { what: "zone", .. })
    ));
    assert!(matches!(
        l.upsert_zone(&zone("z", 0, 1)).await,
        Err(PgLimitError::InvalidRate { rate: 0 })
    ));
    assert!(matches!(
        l.upsert_zone(&zone("z", 1, 0)).await,
        Err(PgLimitError::InvalidWindow { window: 0 })
    ));
    assert!(matches!(
        l.upsert_zone(&zone("z", -2, 1)).await,
        Err(PgLimitError::InvalidRate { rate: -2 })
    ));
    // With the server's clock.
    assert!(!l.check("z", "k").await.unwrap().blocked);
}
