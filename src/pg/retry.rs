//! Retrying serialization failures and deadlocks, and counting what happened.
//!
//! Only SQLSTATE `40001` (serialization failure) and `40P01` (deadlock detected) are retried:
//! the server rolled the statement back, so running it again cannot take a token twice.
//! Everything else is returned at once as a typed [`PgLimitError`]; a lost connection is
//! [`PgLimitError::Connection`] and is *not* retried, because the statement in flight may
//! have committed.
//!
//! # Orderings
//!
//! The counters in [`Stats`] are statistics: every operation is `Relaxed`. Nothing is
//! published through them, readers only want an eventually-exact count, and each counter is
//! read-modify-written atomically so no increment is lost.

use std::hash::BuildHasher;
use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::sync::{AtomicU64, Ordering};
use crate::PgLimitError;

/// How serialization failures (`40001`) and deadlocks (`40P01`) are retried.
///
/// Attempt `k` (counting from 1) that fails is followed by a sleep drawn uniformly from
/// `0..=min(max_delay, base_delay × 2^(k-1))` ("full jitter": clients that collided do not
/// collide again in lock step), until `max_attempts` attempts have been made.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::pg::RetryPolicy;
///
/// let p = RetryPolicy::new(5, Duration::from_millis(2), Duration::from_millis(50))?;
/// assert_eq!(p.max_attempts(), 5);
/// assert!(RetryPolicy::new(0, Duration::ZERO, Duration::ZERO).is_err());
/// # Ok::<(), iothrottle::PgLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 8 attempts, 2 ms base, 100 ms cap.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            base_delay: Duration::from_millis(2),
            max_delay: Duration::from_millis(100),
        }
    }
}

impl RetryPolicy {
    /// At most `max_attempts` attempts (1 means no retry), back-off from `base_delay` doubling
    /// up to `max_delay`.
    ///
    /// Errors: `max_attempts == 0`, or `base_delay > max_delay`.
    pub fn new(
        max_attempts: u32,
        base_delay: Duration,
        max_delay: Duration,
    ) -> Result<Self, PgLimitError> {
        if max_attempts == 0 {
            return Err(PgLimitError::InvalidOption {
                name: "max_attempts",
                reason: "at least one attempt is needed",
            });
        }
        if base_delay > max_delay {
            return Err(PgLimitError::InvalidOption {
                name: "base_delay",
                reason: "the base delay is longer than the maximum delay",
            });
        }
        Ok(RetryPolicy {
            max_attempts,
            base_delay,
            max_delay,
        })
    }

    /// No retries: the first serialization failure is returned.
    pub fn none() -> Self {
        RetryPolicy {
            max_attempts: 1,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
        }
    }

    /// The most attempts made for one call.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The upper bound of the sleep after failed attempt `attempt` (from 1).
    pub fn delay_bound(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(30);
        self.base_delay
            .saturating_mul(1u32 << shift)
            .min(self.max_delay)
    }

    /// A jittered sleep in `0..=delay_bound(attempt)`.
    fn delay(&self, attempt: u32) -> Duration {
        let bound = self.delay_bound(attempt).as_nanos() as u64;
        if bound == 0 {
            return Duration::ZERO;
        }
        // A fresh RandomState is randomly keyed per thread and bumped per call: good enough
        // to de-synchronise clients, and no extra dependency.
        let r = std::collections::hash_map::RandomState::new().hash_one(attempt);
        Duration::from_nanos(r % (bound + 1))
    }
}

/// A snapshot of a limiter's counters, from [`stats`](crate::pg::PgKeyedLimiter::stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PgStats {
    /// Statements run (each counted once, however many attempts it took).
    pub calls: u64,
    /// Attempts repeated after a serialization failure or deadlock.
    pub retries: u64,
    /// Calls that failed after `max_attempts` attempts.
    pub gave_up: u64,
    /// The most retries one call needed.
    pub max_retries: u64,
    /// Connections opened (the first one included).
    pub connects: u64,
    /// Calls that failed because the connection was lost.
    pub connection_errors: u64,
}

impl PgStats {
    /// The counters of two connections together (`max_retries`: the larger).
    pub(crate) fn merge(self, o: PgStats) -> PgStats {
        PgStats {
            calls: self.calls + o.calls,
            retries: self.retries + o.retries,
            gave_up: self.gave_up + o.gave_up,
            max_retries: self.max_retries.max(o.max_retries),
            connects: self.connects + o.connects,
            connection_errors: self.connection_errors + o.connection_errors,
        }
    }
}

/// The live counters behind [`PgStats`].
#[derive(Debug, Default)]
pub(crate) struct Stats {
    calls: AtomicU64,
    retries: AtomicU64,
    gave_up: AtomicU64,
    max_retries: AtomicU64,
    pub(crate) connects: AtomicU64,
    connection_errors: AtomicU64,
}

impl Stats {
    pub(crate) fn snapshot(&self) -> PgStats {
        // Relaxed: statistics (see module doc).
        PgStats {
            calls: self.calls.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            gave_up: self.gave_up.load(Ordering::Relaxed),
            max_retries: self.max_retries.load(Ordering::Relaxed),
            connects: self.connects.load(Ordering::Relaxed),
            connection_errors: self.connection_errors.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn count_connection_error(&self) {
        // Relaxed: statistics.
        self.connection_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_connect(&self) {
        // Relaxed: statistics.
        self.connects.fetch_add(1, Ordering::Relaxed);
    }
}

/// What to do with a driver error.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// 40001 / 40P01: rolled back, safe to run again.
    Retry,
    /// The connection is gone (or being shut down); outcome unknown.
    Connection,
    /// Anything else.
    Other,
}

pub(crate) fn classify(e: &tokio_postgres::Error) -> Class {
    match e.code() {
        Some(c)
            if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED =>
        {
            Class::Retry
        }
        // 57P01 admin shutdown (pg_terminate_backend), 57P02 crash shutdown, 57P03 cannot
        // connect now, class 08: connection exceptions.
        Some(c)
            if *c == SqlState::ADMIN_SHUTDOWN
                || *c == SqlState::CRASH_SHUTDOWN
                || *c == SqlState::CANNOT_CONNECT_NOW
                || c.code().starts_with("08") =>
        {
            Class::Connection
        }
        Some(_) => Class::Other,
        // No SQLSTATE: an I/O error, a closed connection, a protocol error.
        None if e.is_closed() => Class::Connection,
        None => {
            // tokio-postgres reports socket errors without a code; treat any error whose
            // source is an io::Error as a connection loss.
            let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
            while let Some(s) = src {
                if s.is::<std::io::Error>() {
                    return Class::Connection;
                }
                src = s.source();
            }
            Class::Other
        }
    }
}

/// Turns a driver error into the typed error (no retry decision).
pub(crate) fn typed(e: tokio_postgres::Error) -> PgLimitError {
    match classify(&e) {
        Class::Connection => PgLimitError::Connection {
            source: e,
            closed_by: None,
        },
        _ => PgLimitError::Db {
            sqlstate: e
                .code()
                .map(|c| c.code().to_owned())
                .unwrap_or_else(|| "?????".into()),
            source: e,
        },
    }
}

/// Runs `attempt` until it succeeds, fails with a non-retryable error, or the policy's
/// attempts are used up.
pub(crate) async fn with_retries<T, F, Fut>(
    policy: &RetryPolicy,
    stats: &Stats,
    mut attempt: F,
) -> Result<T, RunError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RunError>>,
{
    // Relaxed: statistics.
    stats.calls.fetch_add(1, Ordering::Relaxed);
    let mut n = 1u32;
    loop {
        match attempt().await {
            Ok(v) => {
                // Relaxed: statistics.
                stats
                    .max_retries
                    .fetch_max(u64::from(n - 1), Ordering::Relaxed);
                return Ok(v);
            }
            Err(RunError::Pg(e)) if classify(&e) == Class::Retry => {
                if n >= policy.max_attempts {
                    // Relaxed: statistics.
                    stats.gave_up.fetch_add(1, Ordering::Relaxed);
                    stats
                        .max_retries
                        .fetch_max(u64::from(n - 1), Ordering::Relaxed);
                    let sqlstate = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
                    return Err(RunError::Typed(PgLimitError::RetriesExhausted {
                        attempts: n,
                        sqlstate,
                        source: e,
                    }));
                }
                // Relaxed: statistics.
                stats.retries.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(attempt = n, "serialization failure or deadlock, retrying");
                tokio::time::sleep(policy.delay(n)).await;
                n += 1;
            }
            Err(RunError::Pg(e)) => {
                if classify(&e) == Class::Connection {
                    // Relaxed: statistics.
                    stats.connection_errors.fetch_add(1, Ordering::Relaxed);
                }
                return Err(RunError::Pg(e));
            }
            Err(other) => return Err(other),
        }
    }
}

/// An attempt's failure: a raw driver error (classified by [`with_retries`]) or an error
/// that is already typed (bad input found late, missing installation).
#[derive(Debug)]
pub(crate) enum RunError {
    Pg(tokio_postgres::Error),
    Typed(PgLimitError),
}

impl From<tokio_postgres::Error> for RunError {
    fn from(e: tokio_postgres::Error) -> Self {
        RunError::Pg(e)
    }
}

impl From<RunError> for PgLimitError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Pg(e) => typed(e),
            RunError::Typed(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_bound_doubles_and_caps() {
        let p = RetryPolicy::new(10, Duration::from_millis(2), Duration::from_millis(50)).unwrap();
        assert_eq!(p.delay_bound(1), Duration::from_millis(2));
        assert_eq!(p.delay_bound(2), Duration::from_millis(4));
        assert_eq!(p.delay_bound(5), Duration::from_millis(32));
        assert_eq!(p.delay_bound(6), Duration::from_millis(50));
        assert_eq!(p.delay_bound(200), Duration::from_millis(50));
        for a in 1..12 {
            assert!(p.delay(a) <= p.delay_bound(a));
        }
    }

    #[test]
    fn bad_policies_are_typed_errors() {
        assert!(matches!(
            RetryPolicy::new(0, Duration::ZERO, Duration::ZERO),
            Err(PgLimitError::InvalidOption {
                name: "max_attempts",
                ..
            })
        ));
        assert!(matches!(
            RetryPolicy::new(3, Duration::from_secs(2), Duration::from_secs(1)),
            Err(PgLimitError::InvalidOption {
                name: "base_delay",
                ..
            })
        ));
        assert_eq!(RetryPolicy::none().max_attempts(), 1);
    }
}
