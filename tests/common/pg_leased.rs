//! Leased mode on simulated time: the limiter, the global row as strict mode sees it, and
//! stepping a call one poll at a time.

use std::time::Duration;

use iothrottle::pg::{LeaseOptions, PgLeasedLimiter, PgOptions};
use iothrottle::ManualClock;

use super::pg::PgCluster;
use super::pg_session::t0;

/// `n` milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A leased limiter on `pg` whose time is `clock` (from the wall-clock time [`t0`]), the
/// schema installed.
pub async fn leased(
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
pub async fn global_micro(pg: &PgCluster, key: &str) -> i64 {
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

/// Lets the runtime run until `leases` leases have been asked for: a lease runs on a task of
/// its own, so a caller polled once has only spawned it.
pub async fn lease_asked(l: &PgLeasedLimiter<ManualClock>, leases: u64) {
    while l.stats().leases < leases {
        tokio::task::yield_now().await;
    }
}

/// Polls `fut` once: `Some` if it finished.
pub async fn poll_once<F: std::future::Future>(
    mut fut: std::pin::Pin<&mut F>,
) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}
