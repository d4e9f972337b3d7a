//! [`PgCheckpoint`]: snapshots in PostgreSQL, one row per named bucket, one upsert per save.
//!
//! Table (created by [`PgCheckpoint::install`], which needs `CREATE` on the schema; a
//! connection also creates it when it is missing and the role may):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS iothrottle_checkpoint (
//!     name           text PRIMARY KEY,
//!     version        integer NOT NULL,
//!     tail           bigint NOT NULL,   -- u64 positions, stored bit for bit
//!     head           bigint NOT NULL,
//!     ceil           bigint,            -- capped buckets only
//!     reserved       bigint,            -- strict mode's reservation mark
//!     wall_unix_ns   bigint NOT NULL,   -- the snapshot's wall time (the client's clock)
//!     rate_tokens    bigint NOT NULL,
//!     rate_period_ns bigint NOT NULL,
//!     bucket_limit   bigint NOT NULL,
//!     saved_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
//!     seq            bigint NOT NULL DEFAULT 0  -- the save's sequence number (format 2)
//! )
//! ```
//!
//! The upsert is a single `INSERT … ON CONFLICT (name) DO UPDATE … WHERE stored seq <= new seq`:
//! a save never replaces a newer one, even a timed-out upsert that commits after a newer one
//! on another connection ([`CheckpointError::Superseded`]). A save returns once the row is
//! durable, which strict mode relies on: every session of the store reads its
//! `synchronous_commit` and, when the server (or the role, or the database) has it `off`, sets
//! it `on` for itself, so the guarantee does not depend on the server's configuration.
//!
//! Privileges: after [`install`](PgCheckpoint::install), loading and saving need only
//! `SELECT, INSERT, UPDATE` on the table and `USAGE` on its schema (no `CREATE`).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, UNIX_EPOCH};

use tokio::sync::Mutex;
use tokio_postgres::{Client, Config, Statement};

use crate::bucket::{BucketState, Rate};
use crate::checkpoint::{Checkpoint, Snapshot, FORMAT_VERSION};
use crate::pg::tls::{SessionWatch, Tls};
use crate::pg::SessionEnd;
use crate::sync::Arc;
use crate::CheckpointError;

const CREATE: &str = "CREATE TABLE IF NOT EXISTS iothrottle_checkpoint (
    name text PRIMARY KEY,
    version integer NOT NULL,
    tail bigint NOT NULL,
    head bigint NOT NULL,
    ceil bigint,
    reserved bigint,
    wall_unix_ns bigint NOT NULL,
    rate_tokens bigint NOT NULL,
    rate_period_ns bigint NOT NULL,
    bucket_limit bigint NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    seq bigint NOT NULL DEFAULT 0
);
ALTER TABLE iothrottle_checkpoint ADD COLUMN IF NOT EXISTS seq bigint NOT NULL DEFAULT 0";

const UPSERT: &str = "INSERT INTO iothrottle_checkpoint
    (name, version, tail, head, ceil, reserved, wall_unix_ns, rate_tokens, rate_period_ns,
     bucket_limit, saved_at, seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, clock_timestamp(), $11)
ON CONFLICT (name) DO UPDATE SET
    version = EXCLUDED.version, tail = EXCLUDED.tail, head = EXCLUDED.head,
    ceil = EXCLUDED.ceil, reserved = EXCLUDED.reserved, wall_unix_ns = EXCLUDED.wall_unix_ns,
    rate_tokens = EXCLUDED.rate_tokens, rate_period_ns = EXCLUDED.rate_period_ns,
    bucket_limit = EXCLUDED.bucket_limit, saved_at = EXCLUDED.saved_at, seq = EXCLUDED.seq
WHERE iothrottle_checkpoint.seq <= EXCLUDED.seq";

const STORED_SEQ: &str = "SELECT seq FROM iothrottle_checkpoint WHERE name = $1";

const SELECT: &str = "SELECT version, tail, head, ceil, reserved, wall_unix_ns, rate_tokens,
    rate_period_ns, bucket_limit, seq FROM iothrottle_checkpoint WHERE name = $1";

/// A bucket's snapshot in PostgreSQL (feature `postgres`): one row per bucket name in the
/// table [`TABLE`](Self::TABLE), one upsert per save.
///
/// Settings come from a standard connection string (`host=… port=… user=… dbname=…` or a
/// `postgresql://` URL). The connection is opened lazily and reopened after any failure, so
/// a database that is down or restarts costs failed saves (counted and logged by the
/// [`Checkpointer`](crate::checkpoint::Checkpointer), which retries with back-off), never a
/// panic. Every operation has a timeout (default 10 s): a stalled server is a failure too.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub struct PgCheckpoint {
    config: Config,
    name: String,
    timeout: Duration,
    tls: Tls,
    conn: Mutex<Option<(Client, Statement, Arc<SessionEnd>)>>,
}

/// The longest bucket name, in bytes.
const MAX_NAME_BYTES: usize = 200;

/// Checks a bucket name as the limiters check keys: not empty, at most
/// [`MAX_NAME_BYTES`], no NUL (which `text` cannot store: the server would refuse every save).
fn check_name(name: &str) -> Result<(), CheckpointError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME_BYTES {
        "longer than 200 bytes"
    } else if name.contains('\0') {
        "contains a NUL character, which PostgreSQL text cannot store"
    } else {
        return Ok(());
    };
    Err(CheckpointError::InvalidName {
        name: name.into(),
        reason,
    })
}

impl PgCheckpoint {
    /// The table every `PgCheckpoint` uses.
    pub const TABLE: &'static str = "iothrottle_checkpoint";

    /// A store for the bucket `name` in the database of `connection_string`. Only parses:
    /// nothing is connected until the first save or load.
    pub fn new(connection_string: &str, name: &str) -> Result<Self, CheckpointError> {
        let mut config =
            Config::from_str(connection_string).map_err(|e| CheckpointError::ConnectionString {
                message: e.to_string(),
            })?;
        check_name(name)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        Ok(PgCheckpoint {
            config,
            name: name.into(),
            timeout: Duration::from_secs(10),
            tls: Tls::Off,
            conn: Mutex::new(None),
        })
    }

    /// Fails an operation that takes longer than `timeout` (and drops the connection).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects over TLS with `config` (feature `postgres-tls`), as
    /// [`PgOptions::with_tls`](crate::pg::PgOptions::with_tls) does for the limiters:
    /// `sslmode=prefer` (the default) acts as `require`, and a server certificate `config`
    /// does not trust fails every operation with [`CheckpointError::Postgres`] whose message
    /// names the handshake failure. Without it the store uses no TLS.
    #[cfg(feature = "postgres-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
    pub fn with_tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Tls::rustls(config);
        self.tls.apply(&mut self.config);
        self
    }

    /// The bucket's name (the row key).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates the table if it is missing: run once, by a role with `CREATE` on the schema
    /// the table resolves to (the first schema of the role's `search_path`, usually `public`).
    /// Idempotent. Least-privilege roles then need only `USAGE` on that schema and `SELECT,
    /// INSERT, UPDATE` on the table (see `docs/postgres.md`, "Least-privilege roles").
    pub async fn install(&self) -> Result<(), CheckpointError> {
        // A connection of its own, with nothing prepared: the statements of this version may
        // not parse against an older table until it is upgraded.
        let result = tokio::time::timeout(self.timeout, async {
            let client = self.open(None).await?;
            create_table(&client).await
        })
        .await
        .unwrap_or_else(|_| {
            Err(CheckpointError::Postgres {
                op: "create table",
                message: format!("timed out after {:?}", self.timeout),
            })
        });
        // The cached connection's statements were prepared against the old table.
        *self.conn.lock().await = None;
        result
    }

    /// The `synchronous_commit` of the store's own session (`SHOW synchronous_commit` on the
    /// connection saves use): never `off`, whatever the server's configuration.
    pub async fn synchronous_commit(&self) -> Result<String, CheckpointError> {
        self.with_conn("show", async move |client, _| {
            let row = client
                .query_one("SHOW synchronous_commit", &[])
                .await
                .map_err(pg_err("show"))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Opens a connection, makes its commits durable, and prepares the upsert. Creates the
    /// table only when it is missing (so a role without `CREATE` works once it exists).
    async fn connect(&self) -> Result<(Client, Statement, Arc<SessionEnd>), CheckpointError> {
        let end = Arc::new(SessionEnd::default());
        let client = self.open(Some(end.clone())).await?;
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&Self::TABLE])
            .await
            .map_err(pg_err("connect"))?
            .get(0);
        if !exists {
            create_table(&client).await?;
        }
        let upsert = client.prepare(UPSERT).await.map_err(pg_err("prepare"))?;
        Ok((client, upsert, end))
    }

    /// Opens a connection whose commits are durable.
    async fn open(&self, watch: Option<Arc<SessionEnd>>) -> Result<Client, CheckpointError> {
        let watch = watch.map(|w| w as Arc<dyn SessionWatch>);
        let client = self
            .tls
            .connect_watched(&self.config, "postgres checkpoint", watch)
            .await
            .map_err(pg_err("connect"))?;
        // Durable commits whatever the server, role or database says: any value but `off`
        // waits for the local WAL flush (the stronger `remote_*` settings are kept).
        let sync: String = client
            .query_one("SHOW synchronous_commit", &[])
            .await
            .map_err(pg_err("connect"))?
            .get(0);
        if sync == "off" {
            client
                .batch_execute("SET synchronous_commit TO on")
                .await
                .map_err(pg_err("connect"))?;
        }
        Ok(client)
    }

    /// Runs `op` on the (re)opened connection under the timeout; any failure drops the
    /// connection so that the next call reconnects.
    async fn with_conn<T>(
        &self,
        what: &'static str,
        op: impl AsyncFnOnce(&Client, &Statement) -> Result<T, CheckpointError>,
    ) -> Result<T, CheckpointError> {
        let mut guard = self.conn.lock().await;
        let result = tokio::time::timeout(self.timeout, async {
            if guard.as_ref().is_none_or(|(c, _, _)| c.is_closed()) {
                *guard = Some(self.connect().await?);
            }
            let (client, stmt, end) = guard.as_ref().expect("connected above");
            match op(client, stmt).await {
                // The server closed the session and told its connection's task why, not this
                // statement ("connection closed"): carry the server's reason.
                Err(CheckpointError::Postgres { op, message }) if client.is_closed() => {
                    let message = match end.reason_after_loss().await {
                        Some(reason) if !message.contains(&reason) => {
                            format!("{message} (the server closed the session: {reason})")
                        }
                        _ => message,
                    };
                    Err(CheckpointError::Postgres { op, message })
                }
                other => other,
            }
        })
        .await
        .unwrap_or_else(|_| {
            Err(CheckpointError::Postgres {
                op: what,
                message: format!("timed out after {:?}", self.timeout),
            })
        });
        if result.is_err() {
            *guard = None;
        }
        result
    }
}

impl Checkpoint for PgCheckpoint {
    async fn save(&self, s: Snapshot) -> Result<(), CheckpointError> {
        let name = self.name.clone();
        self.with_conn("upsert", async move |client, upsert| {
            let period = u64::try_from(s.rate.period().as_nanos()).unwrap_or(u64::MAX);
            let pg = |op| {
                move |e| CheckpointError::Postgres {
                    op,
                    message: message(&e),
                }
            };
            let updated = client
                .execute(
                    upsert,
                    &[
                        &name,
                        &(FORMAT_VERSION as i32),
                        &(s.state.tail as i64),
                        &(s.state.head as i64),
                        &s.state.ceil.map(|c| c as i64),
                        &s.reserved.map(|r| r as i64),
                        &(s.wall_nanos() as i64),
                        &(s.rate.tokens() as i64),
                        &(period as i64),
                        &(s.limit as i64),
                        &(s.seq as i64),
                    ],
                )
                .await
                .map_err(pg("upsert"))?;
            if updated == 0 {
                // The row holds a higher seq: a newer save landed first.
                let row = client
                    .query_one(STORED_SEQ, &[&name])
                    .await
                    .map_err(pg("select"))?;
                return Err(CheckpointError::Superseded {
                    seq: s.seq,
                    stored: row.get::<_, i64>(0) as u64,
                });
            }
            Ok(())
        })
        .await
    }

    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        let name = self.name.clone();
        self.with_conn("select", async move |client, _| {
            let row = client.query_opt(SELECT, &[&name]).await.map_err(|e| {
                CheckpointError::Postgres {
                    op: "select",
                    message: message(&e),
                }
            })?;
            let Some(row) = row else { return Ok(None) };
            let version: i32 = row.get(0);
            if !(1..=FORMAT_VERSION as i32).contains(&version) {
                return Err(CheckpointError::UnsupportedVersion {
                    found: version as u32,
                    supported: FORMAT_VERSION,
                });
            }
            let u = |i: usize| row.get::<_, i64>(i) as u64;
            let opt = |i: usize| row.get::<_, Option<i64>>(i).map(|v| v as u64);
            let snapshot = Snapshot {
                state: BucketState {
                    tail: u(1),
                    head: u(2),
                    ceil: opt(3),
                },
                reserved: opt(4),
                wall: UNIX_EPOCH + Duration::from_nanos(u(5)),
                rate: Rate::new(u(6), Duration::from_nanos(u(7))),
                limit: u(8),
                seq: u(9),
            };
            snapshot.validate()?;
            Ok(Some(snapshot))
        })
        .await
    }
}

/// `CREATE TABLE IF NOT EXISTS` (needs `CREATE` on the schema, even when the table exists).
async fn create_table(client: &Client) -> Result<(), CheckpointError> {
    if let Err(e) = client.batch_execute(CREATE).await {
        // Two processes creating the table at once: one loses on the catalog's unique
        // index; the table is there either way.
        let raced = e.code().is_some_and(|c| {
            *c == tokio_postgres::error::SqlState::UNIQUE_VIOLATION
                || *c == tokio_postgres::error::SqlState::DUPLICATE_TABLE
        });
        if !raced {
            return Err(pg_err("create table")(e));
        }
    }
    Ok(())
}

fn pg_err(op: &'static str) -> impl Fn(tokio_postgres::Error) -> CheckpointError {
    move |e| CheckpointError::Postgres {
        op,
        message: message(&e),
    }
}

/// The server's SQLSTATE and message when it sent one ("57P01 FATAL: terminating connection
/// due to administrator command"), else the driver's message with its causes ("error
/// connecting to server: Connection refused").
fn message(e: &tokio_postgres::Error) -> String {
    crate::pg::error::pg_error_text(e)
}

impl fmt::Debug for PgCheckpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No password in logs: only where and what.
        f.debug_struct("PgCheckpoint")
            .field("hosts", &self.config.get_hosts())
            .field("ports", &self.config.get_ports())
            .field("dbname", &self.config.get_dbname())
            .field("name", &self.name)
            .field("tls", &self.tls)
            .finish()
    }
}
