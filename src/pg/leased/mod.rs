//! Leased mode (see [`PgLeasedLimiter`] for the algorithm and the bound it keeps): the
//! limiter and its key handles here; the key map and the take paths in `inner`, one key's
//! state in `key`, the batched lease statements in `batch`, the options and counters in
//! `options`.
//!
//! # Orderings
//!
//! The per-key `last_used` and `low` and the statistics are `Relaxed`: they feed estimates
//! (idle eviction, when to refill) and counts, never a decision that other memory depends on.
//! The consumption estimate lives under the key's lease mutex. The local tokens and the
//! refill flag are the crate's `lease_core`, model-checked by loom (`loom-tests/leased.rs`).
//! The fast path does one successful compare-and-swap on the key's token count and nothing
//! else shared.

mod batch;
mod inner;
mod key;
mod options;

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

use self::batch::Leaser;
use self::inner::Inner;
use self::key::KeyState;
use self::options::Counters;
use self::options::DbTime;
pub use self::options::{LeaseOptions, LeaseStats};
use super::keyed::PgKeyedLimiter;
use super::retry::PgStats;
use super::{check_bucket, check_key, check_time, PgOptions};
use crate::clock::{Clock, MonotonicClock};
use crate::sync::{Arc, Ordering};
use crate::PgLimitError;

/// Leased mode: a local token count per hot key, filled by leasing batches from the key's
/// row; the global rate at local speed.
///
/// Uses the same table and statement as [`PgKeyedLimiter`], so strict-mode callers and
/// leased processes can share a key (strict callers see the tokens the leases left).
///
/// # Algorithm
///
/// Each process keeps, per hot key, a local token count that is **never refilled by time**:
/// its only source of tokens is leases, batches taken from the key's Postgres row by the
/// strict-mode statement in its "take up to N" form. A call takes its tokens from the local
/// count (one compare-and-swap when uncontended, no round trip); the database sees one
/// statement per batch of leases.
///
/// - **One statement for many keys**: the leases of all keys of one session that are waiting
///   go out as one statement (the strict upsert over `unnest` arrays, rows locked in key
///   order): one commit and one WAL flush per batch instead of per lease.
/// - **Leases are never cancelled**: a lease runs on a task of its own, under the key's lease
///   mutex; a caller dropped mid-lease leaves it to land in the key.
/// - **Refill before running dry**: when a grant leaves fewer than half a lease locally, a
///   background task leases the next batch while calls keep being served.
/// - **Leases follow consumption**: a lease covers the key's local consumption rate (measured
///   while the key had tokens) for `lease_period`, or for twice the lease's round trip when
///   longer, between `min_lease` and `max_lease`.
/// - **Trickle, not lump**: when the global bucket cannot fill a lease (it is empty), the key
///   asks again at most every `trickle_interval`, and each time gets what has accrued since
///   (at most `rate × max(trickle_interval, round trip)`): grants arrive spread over time at
///   the global rate, and calls in between are refused locally without a round trip.
/// - **Unused tokens go back** on [`shutdown`](Self::shutdown) and when a key is
///   evicted. An evicted key is closed and emptied while it leaves the key map, before any
///   call can re-create it, so its old state (still reachable through a [`LeasedKey`]) grants
///   nothing more; a lease of the old state that lands after that gives its tokens back.
///   Dropping a limiter without `shutdown` loses the tokens it held (the keys are under-used
///   for a moment; never over-used).
/// - **Bounded memory**: at most `max_keys` keys are kept; keys idle for `idle_timeout` are
///   evicted first, then the least recently used.
///
/// # The bound
///
/// Across `K` processes on one key, the tokens granted to callers during any window of
/// length `W` are at most
///
/// ```text
/// rate × W + burst + K × max_lease
/// ```
///
/// Proof sketch: a process never holds more than `max_lease` usable tokens of a key (a lease
/// asks for at most `max_lease - held`, one lease per key state at a time, and `held` counts
/// exactly the tokens that can still be taken: a failing take moves nothing; and a key state
/// leaves the map closed, so the state that replaces it is the only one holding usable
/// tokens: tests `leased_eviction_never_holds_more_than_max_lease` and
/// `failing_fast_path_take_makes_no_refund_vanish`). Tokens granted in
/// the window were either held locally at its start (at most `K × max_lease`) or leased in it,
/// net of those given back; and what can be leased net of returns is at most what the global
/// bucket held at the start (at most `burst`) plus its refill (`rate × W`, exact in
/// micro-tokens). A server crash with `synchronous_commit = off` can forget recent leases
/// and break this bound by what it forgot.
#[derive(Debug)]
pub struct PgLeasedLimiter<C: Clock + Clone + 'static = MonotonicClock> {
    inner: Arc<Inner<C>>,
}

impl PgLeasedLimiter<MonotonicClock> {
    /// Connects to `config`, with the monotonic clock and the server's time.
    pub async fn connect(
        config: &str,
        options: PgOptions,
        lease: LeaseOptions,
    ) -> Result<Self, PgLimitError> {
        Self::with_clock(config, options, lease, MonotonicClock::new()).await
    }
}

impl<C: Clock + Clone + std::fmt::Debug + 'static> PgLeasedLimiter<C> {
    /// Connects with a clock of the caller's choice for the local side (consumption
    /// estimates, trickling, idle eviction); statements use the server's time.
    pub async fn with_clock(
        config: &str,
        options: PgOptions,
        lease: LeaseOptions,
        clock: C,
    ) -> Result<Self, PgLimitError> {
        Self::build(config, options, lease, clock, DbTime::Server).await
    }

    /// A test utility (feature `test-util`, like tokio's paused time): every database
    /// statement is dated `origin + clock.now()` instead of the server's clock, so a test or a
    /// simulation drives the local buckets and the rows with one
    /// [`ManualClock`](crate::ManualClock). Times outside `timestamptz` are
    /// [`TimeOutOfRange`](PgLimitError::TimeOutOfRange).
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub async fn with_simulated_time(
        config: &str,
        options: PgOptions,
        lease: LeaseOptions,
        clock: C,
        origin: std::time::SystemTime,
    ) -> Result<Self, PgLimitError> {
        Self::build(config, options, lease, clock, DbTime::Clock { origin }).await
    }

    async fn build(
        config: &str,
        options: PgOptions,
        lease: LeaseOptions,
        clock: C,
        db_time: DbTime,
    ) -> Result<Self, PgLimitError> {
        lease.validate()?;
        if let DbTime::Clock { origin } = db_time {
            check_time(origin)?;
        }
        let cap_micro = check_bucket(lease.rate, lease.burst as i128)?;
        let db = PgKeyedLimiter::connect(config, options).await?;
        Ok(PgLeasedLimiter {
            inner: Arc::new(Inner {
                leaser: Arc::new(Leaser::new(db, lease.rate, cap_micro)),
                opts: lease,
                clock,
                db_time,
                keys: RwLock::new(HashMap::new()),
                admit: Mutex::new(()),
                counters: Counters::default(),
            }),
        })
    }

    /// Creates or upgrades the tables ([`install`](super::install)).
    pub async fn install(&self) -> Result<(), PgLimitError> {
        self.inner.leaser.db.install().await
    }

    /// The options.
    pub fn options(&self) -> &LeaseOptions {
        &self.inner.opts
    }

    /// Takes one token of `key`.
    pub async fn try_acquire_one(&self, key: &str) -> Result<bool, PgLimitError> {
        self.try_acquire(key, 1).await
    }

    /// Takes `n` tokens of `key`, all or none. `Ok(false)`: refused (the global bucket is
    /// short). Errors: bad input; [`PgLimitError::Connection`] or a server error when the
    /// local tokens ran out and no lease could be taken.
    pub async fn try_acquire(&self, key: &str, n: u64) -> Result<bool, PgLimitError> {
        self.check_request(key, n)?;
        // Fast path: under the map's read lock, no reference count touched.
        {
            let keys = self.inner.keys.read().expect("key map");
            if let Some(ks) = keys.get(key) {
                if let Some(ok) = self.inner.fast_take(key, ks, n) {
                    return Ok(ok);
                }
            }
        }
        let ks = self.inner.key_state(key).await;
        self.inner.slow_take(key, ks, n).await.map(|(ok, _)| ok)
    }

    /// A handle on one key, for a caller that uses it repeatedly: its calls skip the key
    /// lookup. The handle follows the key across evictions.
    pub async fn key(&self, key: &str) -> Result<LeasedKey<C>, PgLimitError> {
        check_key(key)?;
        let state = self.inner.key_state(key).await;
        Ok(LeasedKey {
            inner: self.inner.clone(),
            key: key.to_owned(),
            state,
        })
    }

    fn check_request(&self, key: &str, n: u64) -> Result<(), PgLimitError> {
        check_key(key)?;
        if n == 0 {
            return Err(PgLimitError::InvalidCount { n: 0 });
        }
        if n > self.inner.opts.max_lease {
            return Err(PgLimitError::TooManyTokens {
                n,
                max: self.inner.opts.max_lease,
            });
        }
        Ok(())
    }

    /// Tokens of `key` held locally now.
    pub fn local_tokens(&self, key: &str) -> u64 {
        let keys = self.inner.keys.read().expect("key map");
        keys.get(key).map_or(0, |k| k.tokens.held())
    }

    /// Keys held locally now.
    pub fn local_keys(&self) -> usize {
        self.inner.keys.read().expect("key map").len()
    }

    /// Evicts the keys idle for `idle_timeout`, giving their tokens back. Returns how many.
    pub async fn evict_idle(&self) -> Result<usize, PgLimitError> {
        let now = self.inner.clock.now().as_nanos() as u64;
        let idle = self.inner.opts.idle_timeout.as_nanos() as u64;
        let doomed: Vec<(String, u64)> = {
            let mut keys = self.inner.keys.write().expect("key map");
            let names: Vec<String> = keys
                .iter()
                // Relaxed: an estimate (see module doc).
                .filter(|(_, k)| now.saturating_sub(k.last_used.load(Ordering::Relaxed)) >= idle)
                .map(|(name, _)| name.clone())
                .collect();
            names
                .into_iter()
                .filter_map(|n| keys.remove(&n).map(|k| (n, k.tokens.close())))
                .collect()
        };
        let count = doomed.len();
        // Relaxed: statistics.
        self.inner
            .counters
            .evictions
            .fetch_add(count as u64, Ordering::Relaxed);
        let mut first_err = None;
        for (name, n) in doomed {
            if let Err(e) = self.inner.give_back(&name, n).await {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(count),
        }
    }

    /// Gives every local token back to the database and forgets all keys. Returns the
    /// tokens given back. The limiter stays usable (keys lease again on the next call).
    pub async fn shutdown(&self) -> Result<u64, PgLimitError> {
        // Closed while the map's write lock is held: no call can take from them or lease
        // for them any more, and a lease in flight gives its tokens back itself.
        let all: Vec<(String, u64)> = self
            .inner
            .keys
            .write()
            .expect("key map")
            .drain()
            .map(|(name, k)| {
                let n = k.tokens.close();
                (name, n)
            })
            .collect();
        let mut total = 0;
        let mut first_err = None;
        for (name, n) in all {
            match self.inner.give_back(&name, n).await {
                Ok(n) => total += n,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    /// The leasing counters. `granted` is derived (leased − returned − held locally), so it
    /// is exact when no call is in flight.
    pub fn stats(&self) -> LeaseStats {
        let c = &self.inner.counters;
        let held: u64 = self
            .inner
            .keys
            .read()
            .expect("key map")
            .values()
            .map(|k| k.tokens.held())
            .sum();
        // Relaxed: statistics.
        let leased = c.leased.load(Ordering::Relaxed);
        let returned = c.returned.load(Ordering::Relaxed);
        LeaseStats {
            granted: leased.saturating_sub(returned).saturating_sub(held),
            refused: c.refused.load(Ordering::Relaxed),
            leases: c.leases.load(Ordering::Relaxed),
            leased: c.leased.load(Ordering::Relaxed),
            short_leases: c.short_leases.load(Ordering::Relaxed),
            returned: c.returned.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            largest_lease: c.largest_lease.load(Ordering::Relaxed),
            lease_statements: self.inner.leaser.statements.load(Ordering::Relaxed),
        }
    }

    /// The database connection's counters (statements, retries, reconnects).
    pub fn db_stats(&self) -> PgStats {
        self.inner.leaser.db.stats()
    }
}

/// One key of a [`PgLeasedLimiter`], from [`PgLeasedLimiter::key`]: the same calls without
/// the key lookup. Meant to be owned by one task (calls take `&mut self`); make one per task.
#[derive(Debug)]
pub struct LeasedKey<C: Clock + Clone + 'static = MonotonicClock> {
    inner: Arc<Inner<C>>,
    key: String,
    state: Arc<KeyState>,
}

impl<C: Clock + Clone + std::fmt::Debug + 'static> LeasedKey<C> {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// [`PgLeasedLimiter::try_acquire`] on this key.
    pub async fn try_acquire(&mut self, n: u64) -> Result<bool, PgLimitError> {
        if n == 0 {
            return Err(PgLimitError::InvalidCount { n: 0 });
        }
        if n > self.inner.opts.max_lease {
            return Err(PgLimitError::TooManyTokens {
                n,
                max: self.inner.opts.max_lease,
            });
        }
        if let Some(ok) = self.inner.fast_take(&self.key, &self.state, n) {
            return Ok(ok);
        }
        let (ok, state) = self
            .inner
            .slow_take(&self.key, self.state.clone(), n)
            .await?;
        self.state = state;
        Ok(ok)
    }
}
