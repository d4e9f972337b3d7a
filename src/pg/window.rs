//! The sliding-window log ([`PgWindowLimiter`]).

use std::time::{Duration, SystemTime};

use tokio_postgres::error::SqlState;

use super::conn::Conn;
use super::retry::{PgStats, RunError};
use super::schema::{self, Schema};
use super::sql;
use super::{check_key, check_opt_time, PgOptions};
use crate::sync::Arc;
use crate::PgLimitError;

/// A use case of the sliding-window limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zone {
    /// The zone's name (1 to 63 bytes).
    pub id: String,
    /// Free text for humans.
    pub description: String,
    /// Allowed attempts per window (at least 1).
    pub rate: i32,
    /// The window, in whole seconds (at least 1).
    pub window_seconds: i32,
}

impl Zone {
    fn check(&self) -> Result<(), PgLimitError> {
        check_zone_id(&self.id)?;
        if self.rate <= 0 {
            return Err(PgLimitError::InvalidRate {
                rate: self.rate.into(),
            });
        }
        if self.window_seconds <= 0 {
            return Err(PgLimitError::InvalidWindow {
                window: self.window_seconds.into(),
            });
        }
        Ok(())
    }
}

fn check_zone_id(id: &str) -> Result<(), PgLimitError> {
    let bad = |reason| PgLimitError::InvalidName {
        what: "zone",
        name: id.to_owned(),
        reason,
    };
    if id.is_empty() {
        return Err(bad("empty"));
    }
    if id.len() > 63 {
        return Err(bad("longer than 63 bytes"));
    }
    if id.contains('\0') {
        return Err(bad("contains a NUL character"));
    }
    Ok(())
}

/// The outcome of one [`check`](PgWindowLimiter::check), as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The attempt is over the limit (it is logged, but does not count).
    pub blocked: bool,
    /// The attempt's row in the log.
    pub attempt_id: i64,
    /// The zone.
    pub zone: String,
    /// The key.
    pub key: String,
    /// The zone's allowed attempts per window.
    pub rate: i32,
    /// The zone's window.
    pub window: Duration,
}

/// The sliding-window log limiter, on one connection.
///
/// A *zone* is a use case (`login`: 5 allowed attempts per 60 s). A check, in one round trip
/// (the installed function `window_check`):
/// 1. locks the key's row in `window_key` (creating it), so checks of one key are serialised;
/// 2. reads the clock (after the lock, so attempts of one key are logged in lock order);
/// 3. counts the key's *allowed* attempts with `created_at` in `(now - window, now]`;
/// 4. logs this attempt, blocked when that count has reached the zone's rate.
///
/// The window is exact: an attempt is allowed if and only if fewer than `rate` allowed
/// attempts were logged in the `window` before it. Blocked attempts are logged (for audit)
/// but do not count against the limit.
///
/// Old log rows are deleted by [`purge`](Self::purge) in batches, off the hot path (a
/// check never deletes); [`spawn_retention`](Self::spawn_retention) runs it periodically.
#[derive(Debug)]
pub struct PgWindowLimiter {
    conn: Conn,
    schema: Schema,
    check_sql: String,
    zone_sql: String,
    purge_log_sql: String,
    purge_keys_sql: String,
}

impl PgWindowLimiter {
    /// Connects to `config`, without TLS unless [`PgOptions::with_tls`] (feature
    /// `postgres-tls`) says otherwise.
    pub async fn connect(config: &str, options: PgOptions) -> Result<Self, PgLimitError> {
        let schema = Schema::new(options.schema())?;
        let conn = Conn::connect(config, options).await?;
        Ok(Self::with_conn(conn, schema))
    }

    /// Takes its session from the caller's `deadpool_postgres::Pool` (feature
    /// `postgres-pool`), as [`PgKeyedLimiter::from_pool`](super::PgKeyedLimiter::from_pool)
    /// does: one session checked out and kept, never given back.
    #[cfg(feature = "postgres-pool")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-pool")))]
    pub async fn from_pool(
        pool: deadpool_postgres::Pool,
        options: PgOptions,
    ) -> Result<Self, PgLimitError> {
        let schema = Schema::new(options.schema())?;
        let conn = Conn::pooled(pool, options)?;
        conn.live().await?;
        Ok(Self::with_conn(conn, schema))
    }

    fn with_conn(conn: Conn, schema: Schema) -> Self {
        PgWindowLimiter {
            check_sql: schema.sql(sql::WINDOW_CHECK),
            zone_sql: schema.sql(sql::WINDOW_ZONE),
            purge_log_sql: schema.sql(sql::WINDOW_PURGE_LOG),
            purge_keys_sql: schema.sql(sql::WINDOW_PURGE_KEYS),
            conn,
            schema,
        }
    }

    /// Creates or upgrades the tables ([`install`](super::install)).
    pub async fn install(&self) -> Result<(), PgLimitError> {
        let live = self.conn.live().await?;
        schema::install(&live.client, &self.schema).await
    }

    /// Creates the zone, or changes its description, rate and window.
    pub async fn upsert_zone(&self, zone: &Zone) -> Result<(), PgLimitError> {
        zone.check()?;
        let sql = self.zone_sql.as_str();
        self.conn
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                live.client
                    .execute(
                        &st,
                        &[
                            &zone.id,
                            &zone.description,
                            &zone.rate,
                            &zone.window_seconds,
                        ],
                    )
                    .await?;
                Ok(())
            })
            .await
    }

    /// Records an attempt for `key` in `zone` and says whether it is over the limit.
    pub async fn check(&self, zone: &str, key: &str) -> Result<Decision, PgLimitError> {
        self.check_inner(zone, key, None).await
    }

    /// [`check`](Self::check) at a time given by the caller (tests, replays). Attempts of one
    /// key must be given non-decreasing times for the window to be exact.
    pub async fn check_at(
        &self,
        zone: &str,
        key: &str,
        at: SystemTime,
    ) -> Result<Decision, PgLimitError> {
        self.check_inner(zone, key, Some(at)).await
    }

    async fn check_inner(
        &self,
        zone: &str,
        key: &str,
        at: Option<SystemTime>,
    ) -> Result<Decision, PgLimitError> {
        check_zone_id(zone)?;
        check_key(key)?;
        check_opt_time(at)?;
        let sql = self.check_sql.as_str();
        self.conn
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                let row = match live.client.query_one(&st, &[&zone, &key, &at]).await {
                    Ok(r) => r,
                    Err(e) if e.code() == Some(&SqlState::NO_DATA_FOUND) => {
                        return Err(RunError::Typed(PgLimitError::UnknownZone {
                            zone: zone.to_owned(),
                        }))
                    }
                    Err(e) => return Err(e.into()),
                };
                let window: i32 = row.get(3);
                Ok(Decision {
                    blocked: row.get(0),
                    attempt_id: row.get(1),
                    zone: zone.to_owned(),
                    key: key.to_owned(),
                    rate: row.get(2),
                    window: Duration::from_secs(window as u64),
                })
            })
            .await
    }

    /// Deletes log rows older than their zone's window (as of `at`, or the server's clock),
    /// `batch` rows per statement (each its own short transaction, so checks are not held
    /// up), then key rows left without log rows. Returns the log rows deleted.
    pub async fn purge(&self, batch: i64, at: Option<SystemTime>) -> Result<u64, PgLimitError> {
        if batch <= 0 {
            return Err(PgLimitError::InvalidOption {
                name: "batch",
                reason: "the purge batch size (log rows deleted per statement) must be at least 1",
            });
        }
        check_opt_time(at)?;
        let mut total = 0;
        loop {
            let sql = self.purge_log_sql.as_str();
            let n = self
                .conn
                .run(|live| async move {
                    let st = live.prepared(sql).await?;
                    Ok(live.client.execute(&st, &[&batch, &at]).await?)
                })
                .await?;
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        loop {
            let sql = self.purge_keys_sql.as_str();
            let n = self
                .conn
                .run(|live| async move {
                    let st = live.prepared(sql).await?;
                    Ok(live.client.execute(&st, &[&batch]).await?)
                })
                .await?;
            if n < batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    /// Runs [`purge`](Self::purge) every `every` on a tokio task, until the task is aborted
    /// or the limiter is dropped by everyone else. Errors are logged and retried next time.
    pub fn spawn_retention(
        self: &Arc<Self>,
        every: Duration,
        batch: i64,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                if let Err(e) = me.purge(batch, None).await {
                    tracing::warn!(error = %e, "sliding-window retention failed");
                }
            }
        })
    }

    /// The counters.
    pub fn stats(&self) -> PgStats {
        self.conn.stats.snapshot()
    }
}
