//! Plain sessions on a throwaway cluster, beside the limiters under test: for setting up rows,
//! holding locks, and watching the limiters' sessions from outside.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::{Client, NoTls};

use super::pg::PgCluster;

/// A fixed wall-clock time for the statements that take one (`*_at`).
pub fn t0() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_900_000_000)
}

/// A plaintext session on `pg`, its connection driven on the runtime.
pub async fn client(pg: &PgCluster) -> Client {
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    c
}

/// The call timeout of the tests whose call is stuck on a row lock ([`hold_row_lock`]): the
/// stuck call waits for ever, so any timeout shows that it ends. The call after it reconnects
/// (a new backend, its start-up, TLS where asked, the statements prepared again) within the
/// same timeout, which a loaded machine running other clusters' `initdb` must also fit.
pub const STUCK_AFTER: Duration = Duration::from_secs(3);

/// Holds the row lock of `id` in a transaction of a session of its own, until the returned
/// client commits or rolls back.
pub async fn hold_row_lock(pg: &PgCluster, id: &str) -> Client {
    let c = client(pg).await;
    c.batch_execute(&format!(
        "BEGIN; UPDATE iothrottle.token_bucket SET granted = 0 WHERE id = '{id}'"
    ))
    .await
    .unwrap();
    c
}

/// The limiters' sessions (`application_name = 'iothrottle'`) waiting for a lock.
const WAITING: &str = "FROM pg_stat_activity WHERE application_name = 'iothrottle' \
                       AND wait_event_type = 'Lock'";

/// Inside the blocker's transaction the activity view is a snapshot taken once per
/// transaction: dropped before each look, or a first look taken too early is seen forever.
async fn clear_snapshot(c: &Client) {
    c.execute("SELECT pg_stat_clear_snapshot()", &[])
        .await
        .unwrap();
}

/// Waits until a session of the limiter waits for a lock; returns its pid (an error if more
/// than one waits).
pub async fn waiting_backend(c: &Client) -> i32 {
    loop {
        clear_snapshot(c).await;
        let row = c
            .query_opt(&format!("SELECT pid {WAITING}"), &[])
            .await
            .unwrap();
        if let Some(r) = row {
            return r.get(0);
        }
        tokio::task::yield_now().await;
    }
}

/// Waits until no session of the limiter waits for a lock.
pub async fn no_backend_waiting(c: &Client) {
    loop {
        clear_snapshot(c).await;
        let waiting: i64 = c
            .query_one(&format!("SELECT count(*) {WAITING}"), &[])
            .await
            .unwrap()
            .get(0);
        if waiting == 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
}
