//! Strict mode ([`PgKeyedLimiter`]): one statement, one round trip, per call.

use std::time::SystemTime;

use super::conn::Pool;
use super::retry::PgStats;
use super::schema::{self, Schema};
use super::sql;
use super::{check_classic, check_count, check_key, check_opt_time, PgOptions, MICRO};
use crate::PgLimitError;

/// What one statement did to a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens granted by this call.
    pub granted: i64,
    /// Micro-tokens (tokens × 10^6) left in the bucket after the call.
    pub micro_left: i64,
    /// The bucket's time after the call (the statement's clock, or later).
    pub at: SystemTime,
}

impl Grant {
    /// Whole tokens left.
    pub fn tokens_left(&self) -> i64 {
        self.micro_left / MICRO
    }
}

/// Strict mode: every call is one round trip running one upsert on the key's row.
///
/// The row keeps `micro` = tokens × 10^6 at time `ts`. A rate of `r` tokens per second adds
/// exactly `r` micro-tokens per microsecond, the resolution of `timestamptz`, so refill is
/// exact integer arithmetic: a busy key never loses its refill to rounding (as the classic
/// function's integer count does), and a drained key called every 0.3 s gets its 0.6 tokens per call.
///
/// Every call is a single `INSERT … ON CONFLICT (id) DO UPDATE … RETURNING`:
/// - no first-call race: two first calls for a new key cannot both insert;
/// - **one clock per statement**: the time is `clock_timestamp()` read *once*, in the
///   `VALUES` row, and the update uses that same value through `excluded.ts`. `now()` would be
///   the transaction start, which under a long transaction lags the commit order; a statement
///   that read its clock before another committed a later `ts` refills nothing (never
///   negative), and `ts` only moves forward (`greatest(ts, excluded.ts)`).
///
/// Compatible with the classic `rate_limiting_request(id, refill_per_sec, window_seconds)`:
/// a new key starts with `window_seconds × refill_per_sec` tokens, refills at
/// `refill_per_sec`, never holds more than the window's worth; a call returns the whole
/// tokens left after taking one, or `-1` when there was none. Unlike the classic function,
/// a refused call takes nothing (the classic one can leave a debt of one token), and
/// fractions of a token are kept exactly.
///
/// One limiter holds [`PgOptions::with_connections`] server sessions (default 4), opened on
/// first use; a key always uses the same one (statements from concurrent tasks are pipelined
/// on it), different keys run in parallel on the server. A lost connection makes the call in
/// flight fail with [`PgLimitError::Connection`] (it may or may not have taken its token) and the
/// next call reconnects.
#[derive(Debug)]
pub struct PgKeyedLimiter {
    pool: Pool,
    schema: Schema,
    /// The take statement by `[partial as usize * 2 + at.is_some() as usize]`.
    take_sql: [String; 4],
    peek_sql: String,
    give_back_sql: String,
}

impl PgKeyedLimiter {
    /// Connects to `config` (`"host=… user=…"` or `postgresql://…`), without TLS unless
    /// [`PgOptions::with_tls`](super::PgOptions::with_tls) (feature `postgres-tls`) says otherwise.
    pub async fn connect(config: &str, options: PgOptions) -> Result<Self, PgLimitError> {
        let schema = Schema::new(options.schema())?;
        let pool = Pool::connect(config, options).await?;
        Ok(Self::with_sessions(pool, schema))
    }

    /// Takes its sessions from the caller's `deadpool_postgres::Pool` (feature
    /// `postgres-pool`) instead of connecting itself: the pool opens them (with its own
    /// configuration and TLS) and health-checks them when they are checked out; the limiter
    /// keeps up to [`PgOptions::with_connections`] of them checked out (so the pool's
    /// `max_size` must leave room for them), applies its session settings, keeps a key's
    /// calls in flight on one of them, and never gives one back: a session that was lost,
    /// timed out, or outlived the limiter is detached from the pool and closed (it carries
    /// the limiter's settings, and a timed-out statement may still run on it). Reconnecting
    /// backs off as with [`connect`](Self::connect); the TLS option is used only for cancel
    /// requests, so give the pool's TLS configuration there too.
    #[cfg(feature = "postgres-pool")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-pool")))]
    pub async fn from_pool(
        pool: deadpool_postgres::Pool,
        options: PgOptions,
    ) -> Result<Self, PgLimitError> {
        let schema = Schema::new(options.schema())?;
        let pool = Pool::from_pool(pool, options).await?;
        Ok(Self::with_sessions(pool, schema))
    }

    fn with_sessions(pool: Pool, schema: Schema) -> Self {
        PgKeyedLimiter {
            take_sql: [
                schema.sql(&sql::take_statement(false, false)),
                schema.sql(&sql::take_statement(false, true)),
                schema.sql(&sql::take_statement(true, false)),
                schema.sql(&sql::take_statement(true, true)),
            ],
            peek_sql: schema.sql(sql::PEEK),
            give_back_sql: schema.sql(sql::GIVE_BACK),
            pool,
            schema,
        }
    }

    /// The schema this limiter uses.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// The limiter's sessions (leased mode batches its leases per session).
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Creates or upgrades the tables in the limiter's schema ([`install`](super::install)).
    pub async fn install(&self) -> Result<(), PgLimitError> {
        let live = self.pool.first().live().await?;
        schema::install(&live.client, &self.schema).await
    }

    /// Installs the classic SQL function ([`install_classic_function`](super::install_classic_function)).
    pub async fn install_classic_function(&self) -> Result<(), PgLimitError> {
        let live = self.pool.first().live().await?;
        schema::install_classic_function(&live.client, &self.schema).await
    }

    /// Takes one token: the whole tokens left, or `-1` when none was available.
    pub async fn request(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
    ) -> Result<i64, PgLimitError> {
        self.request_n(id, refill_per_sec, window_seconds, 1).await
    }

    /// Takes `n` tokens, all or nothing: the whole tokens left, or `-1` when fewer than `n`
    /// were available (then nothing is taken).
    pub async fn request_n(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        n: i64,
    ) -> Result<i64, PgLimitError> {
        let g = self
            .take(id, refill_per_sec, window_seconds, n, false, None)
            .await?;
        Ok(if g.granted == n { g.tokens_left() } else { -1 })
    }

    /// [`request_n`](Self::request_n) at a time given by the caller instead of the server's
    /// clock: for tests and replays. Times earlier than the bucket's refill nothing.
    pub async fn request_n_at(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        n: i64,
        at: SystemTime,
    ) -> Result<i64, PgLimitError> {
        let g = self
            .take(id, refill_per_sec, window_seconds, n, false, Some(at))
            .await?;
        Ok(if g.granted == n { g.tokens_left() } else { -1 })
    }

    /// Tokens available now (whole tokens, the window's worth for an unknown key), without
    /// taking any or writing anything.
    pub async fn peek(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
    ) -> Result<i64, PgLimitError> {
        self.peek_inner(id, refill_per_sec, window_seconds, None)
            .await
    }

    /// [`peek`](Self::peek) at a time given by the caller.
    pub async fn peek_at(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        at: SystemTime,
    ) -> Result<i64, PgLimitError> {
        self.peek_inner(id, refill_per_sec, window_seconds, Some(at))
            .await
    }

    async fn peek_inner(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        at: Option<SystemTime>,
    ) -> Result<i64, PgLimitError> {
        check_key(id)?;
        let cap = check_classic(refill_per_sec.into(), window_seconds.into())?;
        check_opt_time(at)?;
        let rate = i64::from(refill_per_sec);
        let sql = self.peek_sql.as_str();
        let micro: Option<i64> = self
            .pool
            .for_key(id)
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                let row = live.client.query_opt(&st, &[&id, &rate, &cap, &at]).await?;
                Ok(row.map(|r| r.get(0)))
            })
            .await?;
        Ok(micro.unwrap_or(cap) / MICRO)
    }

    /// The general statement behind every mode: take `n` tokens (all or nothing, or up to `n`
    /// when `partial`) from a bucket of `refill_per_sec` and `window_seconds`.
    pub async fn take(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        n: i64,
        partial: bool,
        at: Option<SystemTime>,
    ) -> Result<Grant, PgLimitError> {
        let cap = check_classic(refill_per_sec.into(), window_seconds.into())?;
        self.take_raw(id, refill_per_sec.into(), cap, n, partial, at)
            .await
    }

    /// [`take`](Self::take) with the rate in tokens per second and the capacity in
    /// micro-tokens, both already checked.
    pub(crate) async fn take_raw(
        &self,
        id: &str,
        rate: i64,
        cap_micro: i64,
        n: i64,
        partial: bool,
        at: Option<SystemTime>,
    ) -> Result<Grant, PgLimitError> {
        check_key(id)?;
        check_count(n)?;
        check_opt_time(at)?;
        let sql = self.take_sql[usize::from(partial) * 2 + usize::from(at.is_some())].as_str();
        self.pool
            .for_key(id)
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                let row = match &at {
                    None => {
                        live.client
                            .query_one(&st, &[&id, &rate, &cap_micro, &n])
                            .await?
                    }
                    Some(at) => {
                        live.client
                            .query_one(&st, &[&id, &rate, &cap_micro, &n, at])
                            .await?
                    }
                };
                Ok(Grant {
                    micro_left: row.get(0),
                    granted: row.get(1),
                    at: row.get(2),
                })
            })
            .await
    }

    /// Gives `n` tokens taken earlier but not used back to the key's bucket (never above its
    /// capacity).
    pub async fn give_back(
        &self,
        id: &str,
        refill_per_sec: i32,
        window_seconds: i32,
        n: i64,
    ) -> Result<(), PgLimitError> {
        let cap = check_classic(refill_per_sec.into(), window_seconds.into())?;
        self.give_back_raw(id, refill_per_sec.into(), cap, n, None)
            .await
    }

    /// [`give_back`](Self::give_back) with the rate and capacity already checked.
    pub(crate) async fn give_back_raw(
        &self,
        id: &str,
        rate: i64,
        cap_micro: i64,
        n: i64,
        at: Option<SystemTime>,
    ) -> Result<(), PgLimitError> {
        check_key(id)?;
        check_count(n)?;
        check_opt_time(at)?;
        let sql = self.give_back_sql.as_str();
        self.pool
            .for_key(id)
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                live.client
                    .execute(&st, &[&id, &rate, &cap_micro, &n, &at])
                    .await?;
                Ok(())
            })
            .await
    }

    /// The value of a setting in the limiter's own session (`current_setting(name)`), e.g.
    /// `"synchronous_commit"`: what its statements actually run with.
    pub async fn session_setting(&self, name: &str) -> Result<String, PgLimitError> {
        self.pool
            .first()
            .run(|live| async move {
                let row = live
                    .client
                    .query_one(sql::CURRENT_SETTING, &[&name])
                    .await?;
                Ok(row.get(0))
            })
            .await
    }

    /// The counters: calls, retries, connections.
    pub fn stats(&self) -> PgStats {
        self.pool.stats()
    }
}
