//! The contenders the PostgreSQL benchmarks compare, set up alike by the `pg` group
//! (`benches/benches/pg.rs`) and the load generator's `--mode compare` (`benches/pg_load.rs`):
//! the classic SQL function on a plain session, and strict mode.

use std::sync::Arc;

use iothrottle::pg::{PgKeyedLimiter, PgOptions};
use tokio_postgres::{Client, Statement};

/// A plain session with the classic function's call prepared on it.
pub type ClassicSession = Arc<(Client, Statement)>;

/// Installs the schema and the classic function, through a limiter opened with `options`.
pub async fn install_both(url: &str, options: PgOptions) {
    let setup = PgKeyedLimiter::connect(url, options)
        .await
        .expect("connect");
    setup.install().await.expect("install");
    setup
        .install_classic_function()
        .await
        .expect("install the classic function");
}

/// One worker's contenders: `client` with the classic function's call `sql` prepared on it,
/// and a strict limiter (`options`) with one session of its own.
pub async fn worker(
    url: &str,
    client: Client,
    sql: &str,
    options: PgOptions,
) -> (ClassicSession, Arc<PgKeyedLimiter>) {
    let st = client.prepare(sql).await.expect("prepare");
    let strict = PgKeyedLimiter::connect(url, options.with_connections(1))
        .await
        .expect("connect");
    (Arc::new((client, st)), Arc::new(strict))
}
