//! Limiters over the caller's `deadpool_postgres::Pool` (feature `postgres-pool`), against a
//! real throwaway cluster: the pool opens the sessions, the limiter applies its settings,
//! keeps them checked out, and never gives one back (a lost, timed-out or outlived session is
//! detached from the pool and closed).

mod common;

use common::pg::{cluster_or_skip, PgCluster};
use common::pg_session::{hold_row_lock, t0, STUCK_AFTER};
use deadpool_postgres::{Manager, Pool};
use iothrottle::pg::{PgKeyedLimiter, PgOptions, PgWindowLimiter, Zone};
use iothrottle::PgLimitError;
use tokio_postgres::NoTls;

fn pool(pg: &PgCluster, max: usize) -> Pool {
    let config: tokio_postgres::Config = pg.connection_string().parse().unwrap();
    Pool::builder(Manager::new(config, NoTls))
        .max_size(max)
        .build()
        .unwrap()
}

async fn limiter_sessions(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'iothrottle'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test]
async fn limiters_over_a_deadpool_pool_never_give_sessions_back() {
    let Some(pg) = cluster_or_skip("limiters_over_a_deadpool_pool_never_give_sessions_back") else {
        return;
    };
    let p = pool(&pg, 8);
    let l = PgKeyedLimiter::from_pool(p.clone(), PgOptions::new().with_connections(2))
        .await
        .unwrap();
    l.install().await.unwrap();
    assert_eq!(l.request_n_at("k", 2, 60, 1, t0()).await.unwrap(), 119);
    assert_eq!(l.request_n_at("k", 2, 60, 1, t0()).await.unwrap(), 118);
    // The limiter's settings are on its pooled session.
    assert_eq!(
        l.session_setting("plan_cache_mode").await.unwrap(),
        "force_generic_plan"
    );
    let w = PgWindowLimiter::from_pool(p.clone(), PgOptions::new())
        .await
        .unwrap();
    w.upsert_zone(&Zone {
        id: "login".into(),
        description: String::new(),
        rate: 1,
        window_seconds: 60,
    })
    .await
    .unwrap();
    assert!(!w.check("login", "u").await.unwrap().blocked);
    assert!(w.check("login", "u").await.unwrap().blocked);
    let held = p.status();
    assert_eq!(held.size, 2, "{held:?}"); // one of the strict limiter's, the window's
    assert_eq!(held.available, 0, "{held:?}");
    drop((l, w));
    // Detached, not returned: the pool holds no session that carries the limiter's settings.
    let after = p.status();
    assert_eq!(after.size, 0, "{after:?}");
    let plain = p.get().await.unwrap();
    let mode: String = plain
        .query_one("SHOW plan_cache_mode", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(mode, "auto");
}

/// A timed-out call's pooled session is detached (its statement may still run), and the
/// next call runs on a new one from the pool.
#[tokio::test]
async fn a_timed_out_pooled_session_is_detached() {
    let Some(pg) = cluster_or_skip("a_timed_out_pooled_session_is_detached") else {
        return;
    };
    let p = pool(&pg, 4);
    let opts = PgOptions::new()
        .with_connections(1)
        .with_call_timeout(Some(STUCK_AFTER));
    let l = PgKeyedLimiter::from_pool(p.clone(), opts).await.unwrap();
    l.install().await.unwrap();
    l.request_n_at("k", 1, 100, 1, t0()).await.unwrap();
    let blocker = hold_row_lock(&pg, "k").await;
    let err = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap_err();
    assert!(matches!(err, PgLimitError::TimedOut { .. }), "{err:?}");
    assert_eq!(p.status().size, 0, "the stuck session left the pool");
    blocker.batch_execute("COMMIT").await.unwrap();
    // The timed-out statement's outcome is unknown, as documented: the limiter asks the
    // server to cancel it, and it either was cancelled (98 left after this call) or ran once
    // the blocker committed (97). Never both, never neither.
    let left = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap();
    assert!(left == 97 || left == 98, "tokens left {left}");
    assert_eq!(p.status().size, 1);
    assert_eq!(l.stats().connects, 2);
    assert!(limiter_sessions(&blocker).await <= 2);
}

/// While the server is down, checking out fails and calls fail at once with `Unavailable`
/// until the back-off has passed: the pool is not asked for a session by every call.
#[tokio::test]
async fn a_pool_with_the_server_down_is_not_hammered() {
    let Some(mut pg) = cluster_or_skip("a_pool_with_the_server_down_is_not_hammered") else {
        return;
    };
    let p = pool(&pg, 4);
    let l = PgKeyedLimiter::from_pool(p.clone(), PgOptions::new().with_connections(1))
        .await
        .unwrap();
    l.install().await.unwrap();
    pg.stop();
    // The session was lost with the server.
    let first = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap_err();
    assert!(
        matches!(first, PgLimitError::Connection { .. }),
        "{first:?}"
    );
    // The next checkout fails (connection refused) and starts the back-off.
    let second = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap_err();
    assert!(matches!(second, PgLimitError::Connect { .. }), "{second:?}");
    let connects = l.stats().connects;
    for _ in 0..20 {
        let e = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap_err();
        match e {
            PgLimitError::Unavailable { why, .. } => assert!(why.contains("refused"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(l.stats().connects, connects);
    pg.start_again().unwrap();
}

/// A pool that cannot give the limiter its sessions is refused when the limiter is made:
/// keys routed to a session the pool never opens would time out on every call.
#[tokio::test]
async fn a_pool_smaller_than_the_sessions_is_refused() {
    let Some(pg) = cluster_or_skip("a_pool_smaller_than_the_sessions_is_refused") else {
        return;
    };
    let err = PgKeyedLimiter::from_pool(pool(&pg, 2), PgOptions::new().with_connections(4))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PgLimitError::InvalidOption {
                name: "connections",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("max_size"), "{err}");
    // As many sessions as the pool holds is fine.
    let l = PgKeyedLimiter::from_pool(pool(&pg, 4), PgOptions::new().with_connections(4))
        .await
        .unwrap();
    l.install().await.unwrap();
    assert_eq!(l.request_n_at("k", 2, 60, 1, t0()).await.unwrap(), 119);
}
