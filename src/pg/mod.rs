//! Per-key rate limiting on PostgreSQL (feature `postgres`).
//!
//! When a service outgrows one process, the shared state moves to the database it already
//! has. Four pieces, all sharing one installed schema ([`install`]):
//!
//! - [`PgKeyedLimiter`] — **strict mode**: one round trip per call, one
//!   `INSERT … ON CONFLICT DO UPDATE … RETURNING` statement, compatible with the classic
//!   `rate_limiting_request(text, int, int)` function (which it can install), but keeping
//!   fractional tokens exactly (micro-tokens) and reading one clock per statement.
//! - [`PgLeasedLimiter`] — **leased mode**: a local [`SharedTokenBucket`](crate::SharedTokenBucket)
//!   per hot key, filled by leasing batches from the same row; the global rate at local speed.
//! - [`PgWindowLimiter`] — the **sliding-window log**: every attempt recorded, an exact moving
//!   window, for unforgiving audited limits.
//! - [`RetryPolicy`] — bounded, jittered retries of serialization failures and deadlocks.
//!
//! The long-form guide, with the load generator's figures, is `docs/postgres.md`, included
//! below.
//!
//! Connections are plain TCP or Unix sockets without TLS (`tokio_postgres::NoTls`) unless
//! [`PgOptions::with_tls`] (feature `postgres-tls`) gives a rustls configuration.
#![doc = include_str!("../../docs/postgres.md")]

mod conn;
pub(crate) mod error;
pub(crate) use conn::SessionEnd;
mod keyed;
mod leased;
mod retry;
mod schema;
mod sql;
pub(crate) mod tls;
mod window;

pub use keyed::{Grant, PgKeyedLimiter};
pub use leased::{LeaseOptions, LeaseStats, LeasedKey, PgLeasedLimiter};
pub use retry::{PgStats, RetryPolicy};
pub use schema::{install, install_classic_function, installed_version, Schema, SCHEMA_VERSION};
pub use window::{Decision, PgWindowLimiter, Zone};

use std::time::{SystemTime, UNIX_EPOCH};

use crate::PgLimitError;

/// The longest key accepted, in bytes of UTF-8. Longer keys are
/// [`PgLimitError::KeyTooLong`]; the tables enforce the same limit with a `CHECK`.
pub const MAX_KEY_BYTES: usize = 256;

/// The most server sessions one limiter opens ([`PgOptions::with_connections`]).
pub const MAX_CONNECTIONS: usize = 64;

/// The largest bucket, in tokens: `window × rate` (or the burst) must not exceed it, so that
/// the micro-token arithmetic (`tokens × 10^6` in a `bigint`) never overflows.
pub const MAX_CAPACITY: i64 = (1 << 61) / 1_000_000;

/// Micro-tokens per token: the row keeps `tokens × 10^6`, so a refill of `rate` tokens per
/// second adds exactly `rate` micro-tokens per microsecond (the resolution of `timestamptz`).
pub(crate) const MICRO: i64 = 1_000_000;

/// The isolation level of the limiter's own statements (set on its session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// The recommended level: the upsert locks the row and re-reads its newest version, so
    /// concurrent calls on one key queue on the row lock and never fail.
    #[default]
    ReadCommitted,
    /// Also correct, but concurrent calls on one key fail with `40001` and are retried
    /// (see [`RetryPolicy`]); use it only when the server's default must be serializable.
    Serializable,
}

/// How a limiter talks to the server: schema, isolation, durability, retries.
///
/// ```
/// use iothrottle::pg::{Isolation, PgOptions, RetryPolicy};
///
/// let opts = PgOptions::new()
///     .with_schema("limits")
///     .with_isolation(Isolation::ReadCommitted)
///     .with_synchronous_commit(false)
///     .with_retry(RetryPolicy::default());
/// assert_eq!(opts.schema(), "limits");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgOptions {
    schema: String,
    isolation: Isolation,
    synchronous_commit: bool,
    retry: RetryPolicy,
    connections: usize,
    call_timeout: Option<std::time::Duration>,
    tls: tls::Tls,
}

impl Default for PgOptions {
    fn default() -> Self {
        PgOptions {
            schema: "iothrottle".into(),
            isolation: Isolation::ReadCommitted,
            synchronous_commit: true,
            retry: RetryPolicy::default(),
            connections: 4,
            call_timeout: Some(std::time::Duration::from_secs(30)),
            tls: tls::Tls::Off,
        }
    }
}

impl PgOptions {
    /// Schema `iothrottle`, READ COMMITTED, durable commits (`synchronous_commit` at least
    /// `local`), the default [`RetryPolicy`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The schema holding the tables (checked by [`Schema::new`] when connecting).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The isolation level of the limiter's statements.
    pub fn with_isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// `false` sets `synchronous_commit = off` on the limiter's session: a grant is not worth
    /// a disk flush; a server crash may forget the last few hundred milliseconds of grants
    /// (callers may then be granted up to that many tokens again). `true` (the default) sets
    /// it `on` when the server, database or role has it `off`, so that a grant the server
    /// acknowledged survives a server crash; a stronger `remote_*` setting is kept.
    pub fn with_synchronous_commit(mut self, on: bool) -> Self {
        self.synchronous_commit = on;
        self
    }

    /// How serialization failures and deadlocks are retried.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Server sessions per strict or leased limiter (default 4; 1 to
    /// [`MAX_CONNECTIONS`]): each key always uses the same one, so different keys' statements
    /// and their commits run in parallel. Opened on first use (the first one at connect).
    /// Values outside the range, and (with `from_pool`) a pool whose `max_size` is smaller,
    /// are refused at construction with [`InvalidOption`](PgLimitError::InvalidOption).
    pub fn with_connections(mut self, n: usize) -> Self {
        self.connections = n;
        self
    }

    /// Fails a call that takes longer than `timeout` (retries and reconnecting included) with
    /// [`TimedOut`](PgLimitError::TimedOut) and drops its connection; `None`: no limit.
    /// Default 30 s.
    pub fn with_call_timeout(mut self, timeout: Option<std::time::Duration>) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Connects over TLS with `config` (feature `postgres-tls`): its root store decides which
    /// server certificates are trusted, and the host name of the connection string (or its IP
    /// address) must match the certificate. `sslmode=prefer`, the default, then acts as
    /// `require`: a server that declines TLS is a connection error, never a plaintext
    /// session; `sslmode=disable` in the connection string still turns TLS off. A certificate
    /// the configuration does not trust fails the connect with
    /// [`Tls`](PgLimitError::Tls), whose causes name the handshake failure
    /// (`error performing TLS handshake: invalid peer certificate: UnknownIssuer`).
    ///
    /// Without this option connections use no TLS. (`PgOptions` equality compares the TLS
    /// configuration by identity: clones of one `PgOptions` are equal, two `with_tls` calls
    /// are not.)
    #[cfg(feature = "postgres-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
    pub fn with_tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = tls::Tls::rustls(config);
        self
    }

    /// Server sessions per limiter.
    pub fn connections(&self) -> usize {
        self.connections
    }

    /// Checks the options that can be wrong.
    pub fn validate(&self) -> Result<(), PgLimitError> {
        Schema::new(&self.schema)?;
        if self.connections == 0 || self.connections > MAX_CONNECTIONS {
            return Err(PgLimitError::InvalidOption {
                name: "connections",
                reason: "must be in 1..=MAX_CONNECTIONS",
            });
        }
        if self.call_timeout.is_some_and(|t| t.is_zero()) {
            return Err(PgLimitError::InvalidOption {
                name: "call_timeout",
                reason: "must be positive (or None for no limit)",
            });
        }
        Ok(())
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The isolation level.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// The retry policy.
    pub fn retry(&self) -> RetryPolicy {
        self.retry
    }
}

/// Checks a key: not empty, at most [`MAX_KEY_BYTES`], no NUL.
pub(crate) fn check_key(key: &str) -> Result<(), PgLimitError> {
    if key.is_empty() {
        return Err(PgLimitError::EmptyKey);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(PgLimitError::KeyTooLong {
            len: key.len(),
            max: MAX_KEY_BYTES,
        });
    }
    if key.contains('\0') {
        return Err(PgLimitError::KeyHasNul);
    }
    Ok(())
}

/// Checks `rate` tokens per second and a capacity of `tokens`; returns the capacity in
/// micro-tokens.
pub(crate) fn check_bucket(rate: i64, tokens: i128) -> Result<i64, PgLimitError> {
    if rate <= 0 {
        return Err(PgLimitError::InvalidRate { rate });
    }
    if tokens <= 0 {
        return Err(PgLimitError::InvalidBurst {
            burst: tokens.clamp(i64::MIN as i128, 0) as i64,
        });
    }
    if tokens > MAX_CAPACITY as i128 || rate > MAX_CAPACITY {
        return Err(PgLimitError::CapacityTooLarge {
            tokens: tokens.max(rate as i128),
            max: MAX_CAPACITY,
        });
    }
    Ok(tokens as i64 * MICRO)
}

/// The classic parameters: `refill_per_sec` and `window_seconds`, capacity their product.
pub(crate) fn check_classic(refill_per_sec: i64, window_seconds: i64) -> Result<i64, PgLimitError> {
    if refill_per_sec <= 0 {
        return Err(PgLimitError::InvalidRate {
            rate: refill_per_sec,
        });
    }
    if window_seconds <= 0 {
        return Err(PgLimitError::InvalidWindow {
            window: window_seconds,
        });
    }
    check_bucket(
        refill_per_sec,
        refill_per_sec as i128 * window_seconds as i128,
    )
}

/// PostgreSQL's `timestamptz` range in microseconds since 2000-01-01 UTC: `[MIN, END)`
/// (4713 BC to 294276 AD; the server's `MIN_TIMESTAMP` and `END_TIMESTAMP`).
const PG_MIN_MICROS: i128 = -211_813_488_000_000_000;
const PG_END_MICROS: i128 = 9_223_371_331_200_000_000;
/// 2000-01-01 UTC in seconds since the Unix epoch.
const PG_EPOCH_UNIX_SECS: i128 = 946_684_800;

/// Checks that `at` is a `timestamptz` the server accepts, so that the driver's conversion
/// (which does not check) neither overflows nor wraps.
pub(crate) fn check_time(at: SystemTime) -> Result<(), PgLimitError> {
    let unix_micros = match at.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_micros() as i128,
        Err(e) => -(e.duration().as_micros() as i128),
    };
    let micros = unix_micros - PG_EPOCH_UNIX_SECS * 1_000_000;
    if (PG_MIN_MICROS..PG_END_MICROS).contains(&micros) {
        Ok(())
    } else {
        Err(PgLimitError::TimeOutOfRange { at })
    }
}

/// [`check_time`] for an optional time (`None`: the server's clock).
pub(crate) fn check_opt_time(at: Option<SystemTime>) -> Result<(), PgLimitError> {
    at.map_or(Ok(()), check_time)
}

pub(crate) fn check_count(n: i64) -> Result<(), PgLimitError> {
    if n <= 0 {
        return Err(PgLimitError::InvalidCount { n });
    }
    if n > MAX_CAPACITY {
        return Err(PgLimitError::CapacityTooLarge {
            tokens: n as i128,
            max: MAX_CAPACITY,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(matches!(check_key(""), Err(PgLimitError::EmptyKey)));
        assert!(check_key(&"k".repeat(MAX_KEY_BYTES)).is_ok());
        assert!(matches!(
            check_key(&"k".repeat(MAX_KEY_BYTES + 1)),
            Err(PgLimitError::KeyTooLong { len: 257, max: 256 })
        ));
        // Length is in bytes: 129 two-byte characters are 258 bytes.
        assert!(matches!(
            check_key(&"é".repeat(129)),
            Err(PgLimitError::KeyTooLong { len: 258, .. })
        ));
        assert!(matches!(check_key("a\0b"), Err(PgLimitError::KeyHasNul)));
    }

    #[test]
    fn classic_parameters_are_checked() {
        assert_eq!(check_classic(2, 60).unwrap(), 120 * MICRO);
        assert!(matches!(
            check_classic(0, 60),
            Err(PgLimitError::InvalidRate { rate: 0 })
        ));
        assert!(matches!(
            check_classic(-3, 60),
            Err(PgLimitError::InvalidRate { rate: -3 })
        ));
        assert!(matches!(
            check_classic(2, 0),
            Err(PgLimitError::InvalidWindow { window: 0 })
        ));
        assert!(matches!(
            check_classic(i32::MAX as i64, i32::MAX as i64),
            Err(PgLimitError::CapacityTooLarge { .. })
        ));
        assert!(matches!(
            check_count(0),
            Err(PgLimitError::InvalidCount { n: 0 })
        ));
        assert!(matches!(
            check_bucket(5, 0),
            Err(PgLimitError::InvalidBurst { burst: 0 })
        ));
    }

    #[test]
    fn times_outside_timestamptz_are_refused() {
        use std::time::Duration;
        let far = UNIX_EPOCH + Duration::from_secs(20_000_000_000_000);
        assert!(matches!(
            check_time(far),
            Err(PgLimitError::TimeOutOfRange { at }) if at == far
        ));
        // 294276-12-31 23:59:59 UTC is the last second the server accepts; a second later
        // is out.
        let last = UNIX_EPOCH + Duration::from_secs(9_224_318_015_999);
        assert!(check_time(last).is_ok());
        assert!(check_time(last + Duration::from_secs(1)).is_err());
        // 4713-11-24 BC 00:00:00 UTC (Julian day 0) is the first.
        let first = UNIX_EPOCH - Duration::from_secs(210_866_803_200);
        assert!(check_time(first).is_ok());
        assert!(check_time(first - Duration::from_micros(1)).is_err());
        assert!(check_time(UNIX_EPOCH).is_ok());
        assert!(check_opt_time(None).is_ok());
    }
}
