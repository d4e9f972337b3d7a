//! What a leased limiter is configured with and what it reports.

use std::time::{Duration, SystemTime};

use crate::pg::{check_bucket, MAX_CAPACITY};
use crate::sync::AtomicU64;
use crate::PgLimitError;

/// Where the database statements of a leased limiter take their time from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DbTime {
    /// The server's `clock_timestamp()`.
    Server,
    /// `origin + clock.now()` from the limiter's clock
    /// ([`PgLeasedLimiter::with_simulated_time`](super::PgLeasedLimiter::with_simulated_time),
    /// feature `test-util`).
    #[cfg_attr(not(feature = "test-util"), allow(dead_code))]
    Clock {
        /// The wall-clock time of the clock's zero.
        origin: SystemTime,
    },
}

/// The global bucket of a leased key and how leases are sized.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::pg::LeaseOptions;
///
/// let o = LeaseOptions::new(10_000, 1_000, 500)?
///     .with_lease_period(Duration::from_millis(50))
///     .with_max_keys(1_000);
/// assert_eq!(o.max_lease(), 500);
/// assert!(LeaseOptions::new(0, 1_000, 500).is_err());
/// # Ok::<(), iothrottle::PgLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseOptions {
    pub(super) rate: i64,
    pub(super) burst: i64,
    pub(super) max_lease: u64,
    pub(super) min_lease: u64,
    pub(super) lease_period: Duration,
    pub(super) trickle_interval: Duration,
    pub(super) max_keys: usize,
    pub(super) idle_timeout: Duration,
}

impl LeaseOptions {
    /// Every key's global bucket refills at `rate` tokens per second up to `burst` tokens; a
    /// process holds at most `max_lease` tokens of a key (also the largest lease, and the
    /// largest single request). Defaults: leases of 50 ms of consumption, at least 1 token,
    /// trickle every 10 ms, 10 000 keys, idle after 60 s.
    pub fn new(rate: i64, burst: i64, max_lease: u64) -> Result<Self, PgLimitError> {
        let o = LeaseOptions {
            rate,
            burst,
            max_lease,
            min_lease: 1,
            lease_period: Duration::from_millis(50),
            trickle_interval: Duration::from_millis(10),
            max_keys: 10_000,
            idle_timeout: Duration::from_secs(60),
        };
        o.validate()?;
        Ok(o)
    }

    /// Leases cover this much of the key's local consumption.
    pub fn with_lease_period(mut self, period: Duration) -> Self {
        self.lease_period = period;
        self
    }

    /// The smallest lease asked for outside trickling.
    pub fn with_min_lease(mut self, min_lease: u64) -> Self {
        self.min_lease = min_lease;
        self
    }

    /// When the global bucket is empty, ask at most this often.
    pub fn with_trickle_interval(mut self, every: Duration) -> Self {
        self.trickle_interval = every;
        self
    }

    /// At most this many keys are kept locally.
    pub fn with_max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Keys unused for this long are evicted first (and by
    /// [`evict_idle`](super::PgLeasedLimiter::evict_idle)).
    pub fn with_idle_timeout(mut self, idle: Duration) -> Self {
        self.idle_timeout = idle;
        self
    }

    /// The global rate, tokens per second.
    pub fn rate(&self) -> i64 {
        self.rate
    }

    /// The global burst, tokens.
    pub fn burst(&self) -> i64 {
        self.burst
    }

    /// The largest lease (and local holding) per key and process.
    pub fn max_lease(&self) -> u64 {
        self.max_lease
    }

    /// The stated bound: the most tokens `processes` processes can grant on one key during
    /// any window of length `window`: `rate × window + burst + processes × max_lease`.
    pub fn bound(&self, processes: u64, window: Duration) -> u128 {
        self.rate as u128 * window.as_micros() / 1_000_000
            + self.burst as u128
            + processes as u128 * self.max_lease as u128
    }

    /// Checks every option.
    pub fn validate(&self) -> Result<(), PgLimitError> {
        check_bucket(self.rate, self.burst as i128)?;
        if self.max_lease == 0 || self.max_lease > MAX_CAPACITY as u64 {
            return Err(PgLimitError::InvalidOption {
                name: "max_lease",
                reason: "must be in 1..=MAX_CAPACITY",
            });
        }
        if self.min_lease == 0 || self.min_lease > self.max_lease {
            return Err(PgLimitError::InvalidOption {
                name: "min_lease",
                reason: "must be in 1..=max_lease",
            });
        }
        if self.lease_period.is_zero() {
            return Err(PgLimitError::InvalidOption {
                name: "lease_period",
                reason: "must be positive",
            });
        }
        if self.max_keys == 0 {
            return Err(PgLimitError::InvalidOption {
                name: "max_keys",
                reason: "must be at least 1",
            });
        }
        Ok(())
    }
}

/// A snapshot of a leased limiter's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Tokens granted to callers.
    pub granted: u64,
    /// Calls refused after trying to lease (calls refused at once while trickling are not
    /// counted: counting them would cost the fast path a shared write).
    pub refused: u64,
    /// Lease statements run.
    pub leases: u64,
    /// Tokens leased from the database.
    pub leased: u64,
    /// Leases that got less than they asked for (the global bucket was short).
    pub short_leases: u64,
    /// Tokens given back to the database.
    pub returned: u64,
    /// Keys evicted (idle or to make room).
    pub evictions: u64,
    /// The largest lease asked for.
    pub largest_lease: u64,
    /// Statements that took leases: a statement takes the leases of every key of one
    /// session that were waiting for it (so `leases / lease_statements` is the mean batch).
    pub lease_statements: u64,
}

/// The live counters behind [`LeaseStats`] (`Relaxed`: statistics).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) refused: AtomicU64,
    pub(super) leases: AtomicU64,
    pub(super) leased: AtomicU64,
    pub(super) short_leases: AtomicU64,
    pub(super) returned: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) largest_lease: AtomicU64,
}
