//! Leased mode: the global rate at local speed.
//!
//! Each process keeps, per hot key, a local token count that is **never refilled by time**:
//! its only source of tokens is leases, batches taken from the key's Postgres row by the
//! strict-mode statement in its "take up to N" form. A call takes its tokens from the local
//! count (one compare-and-swap when uncontended, no round trip); the database sees one
//! statement per batch of leases.
//!
//! - **One statement for many keys**: the leases of all keys of one session that are waiting
//!   go out as one statement (the strict upsert over `unnest` arrays, rows locked in key
//!   order): one commit and one WAL flush per batch instead of per lease.
//! - **Leases are never cancelled**: a lease runs on a task of its own, under the key's lease
//!   mutex; a caller dropped mid-lease leaves it to land in the key.
//! - **Refill before running dry**: when a grant leaves fewer than half a lease locally, a
//!   background task leases the next batch while calls keep being served.
//! - **Leases follow consumption**: a lease covers the key's local consumption rate (measured
//!   while the key had tokens) for `lease_period`, or for twice the lease's round trip when
//!   longer, between `min_lease` and `max_lease`.
//! - **Trickle, not lump**: when the global bucket cannot fill a lease (it is empty), the key
//!   asks again at most every `trickle_interval`, and each time gets what has accrued since
//!   (at most `rate × max(trickle_interval, round trip)`): grants arrive spread over time at
//!   the global rate, and calls in between are refused locally without a round trip.
//! - **Unused tokens go back** on [`shutdown`](PgLeasedLimiter::shutdown) and when a key is
//!   evicted. An evicted key is closed and emptied while it leaves the key map, before any
//!   call can re-create it, so its old state (still reachable through a [`LeasedKey`]) grants
//!   nothing more; a lease of the old state that lands after that gives its tokens back.
//!   Dropping a limiter without `shutdown` loses the tokens it held (the keys are under-used
//!   for a moment; never over-used).
//! - **Bounded memory**: at most `max_keys` keys are kept; keys idle for `idle_timeout` are
//!   evicted first, then the least recently used.
//!
//! # The bound
//!
//! Across `K` processes on one key, the tokens granted to callers during any window of
//! length `W` are at most
//!
//! ```text
//! rate × W + burst + K × max_lease
//! ```
//!
//! Proof sketch: a process never holds more than `max_lease` usable tokens of a key (a lease
//! asks for at most `max_lease - held`, one lease per key state at a time, and `held` counts
//! exactly the tokens that can still be taken: a failing take moves nothing; and a key state
//! leaves the map closed, so the state that replaces it is the only one holding usable
//! tokens: tests `leased_eviction_never_holds_more_than_max_lease` and
//! `failing_fast_path_take_makes_no_refund_vanish`). Tokens granted in
//! the window were either held locally at its start (at most `K × max_lease`) or leased in it,
//! net of those given back; and what can be leased net of returns is at most what the global
//! bucket held at the start (at most `burst`) plus its refill (`rate × W`, exact in
//! micro-tokens). A server crash with `synchronous_commit = off` can forget recent leases
//! and break this bound by what it forgot.
//!
//! # Orderings
//!
//! The per-key `last_used` and `low` and the statistics are `Relaxed`: they feed estimates
//! (idle eviction, when to refill) and counts, never a decision that other memory depends on.
//! The consumption estimate lives under the key's lease mutex. The local tokens and the
//! refill flag are the crate's `lease_core`, model-checked by loom (`loom-tests/leased.rs`).
//! The fast path does one successful compare-and-swap on the key's token count and nothing
//! else shared.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime};

use super::conn::Conn;
use super::keyed::{take_sql, Grant, PgKeyedLimiter};
use super::retry::PgStats;
use super::{check_bucket, check_key, PgOptions, MAX_CAPACITY};
use crate::clock::{Clock, MonotonicClock};
use crate::error::PgLimitError;
use crate::lease_core::{LocalTokens, RefillFlag};
use crate::sync::{Arc, AtomicU64, Ordering};

/// Where the database statements of a leased limiter take their time from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbTime {
    /// The server's `clock_timestamp()` (production).
    Server,
    /// `origin + clock.now()` from the limiter's [`Clock`]: tests and simulations drive the
    /// database's time with a [`ManualClock`](crate::ManualClock).
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
    rate: i64,
    burst: i64,
    max_lease: u64,
    min_lease: u64,
    lease_period: Duration,
    trickle_interval: Duration,
    max_keys: usize,
    idle_timeout: Duration,
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
    /// [`evict_idle`](PgLeasedLimiter::evict_idle)).
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

#[derive(Debug, Default)]
struct Counters {
    refused: AtomicU64,
    leases: AtomicU64,
    leased: AtomicU64,
    short_leases: AtomicU64,
    returned: AtomicU64,
    evictions: AtomicU64,
    largest_lease: AtomicU64,
    lease_statements: AtomicU64,
}

/// The most leases one batch statement takes.
const MAX_BATCH: usize = 1_024;

/// The lease statement for many keys at once: the strict-mode upsert ([`take_sql`], "up to
/// N" form) over `unnest($1 keys, $2 tokens wanted, $3 times)` with `$4` the rate and `$5`
/// the capacity in micro-tokens, returning each row's key too. One statement, one commit
/// (one WAL flush) for the whole batch; the rows are locked in key order, so two batches
/// from different processes cannot deadlock on each other.
///
/// In the `DO UPDATE` arm the wanted count is `excluded.granted`, the first-call grant
/// `least(n, cap)`: since the available amount never exceeds `cap`, `least(least(n, cap),
/// available) = least(n, available)`, the very grant of the single-key statement.
fn batch_take_sql() -> Option<String> {
    const N: &str = "\u{1}n";
    let one = take_sql("r.id", "$4::bigint", "$5::bigint", N, "true", "r.at");
    let (head, tail) = one.split_once("\nON CONFLICT")?;
    let (insert, values) = head.split_once("\nVALUES (")?;
    let values = values.strip_suffix(')')?;
    let tail = tail.strip_suffix("RETURNING b.micro, b.granted, b.ts")?;
    Some(format!(
        "{insert}\nSELECT {}\nFROM unnest($1::text[], $2::bigint[], $3::timestamptz[]) AS r(id, n, at)\n\
         ORDER BY r.id\nON CONFLICT{}RETURNING b.micro, b.granted, b.ts, b.id",
        values.replace(N, "r.n"),
        tail.replace(N, "excluded.granted")
    ))
}

/// The leases waiting for one session's next statement.
#[derive(Debug, Default)]
struct Batcher {
    q: Mutex<BatchQueue>,
}

#[derive(Debug, Default)]
struct BatchQueue {
    pending: Vec<Pending>,
    /// A task is running this session's statements (and will take what is pending).
    running: bool,
}

/// One key's lease, waiting for its batch.
#[derive(Debug)]
struct Pending {
    key: String,
    ask: i64,
    at: Option<SystemTime>,
    tx: tokio::sync::oneshot::Sender<Result<Grant, PgLimitError>>,
}

/// What a detached lease found or did (see `Inner::lease_detached`).
enum Leased {
    /// The key was closed (evicted or shut down): look it up again.
    Closed,
    /// Enough tokens were there already; no lease was taken.
    Ready,
    /// A lease was taken: this many tokens (0: none to be had, or trickling).
    Got(u64),
}

/// Lease control of one key; only touched under the key's lease mutex.
#[derive(Debug)]
struct LeaseCtl {
    /// Estimated local consumption, tokens per second.
    rate_est: f64,
    /// Tokens leased into this key's bucket so far (consumed = this - held).
    leased_total: u64,
    /// When the estimate was last updated (when the last lease landed), and the tokens
    /// consumed then.
    sampled_at: Duration,
    consumed_then: u64,
    /// Trickling: no lease before this time.
    not_before: Option<Duration>,
    /// The size of the last lease asked for.
    last_ask: u64,
    /// Estimated time a lease takes (statement, batch wait, commit), on the limiter's clock.
    latency_est: Duration,
}

#[derive(Debug)]
struct KeyState {
    /// Local tokens: filled only by leases, never by time; closed (and emptied) when the key
    /// leaves the map, before anything else can lease for the key.
    tokens: LocalTokens,
    /// Nanoseconds on the limiter's clock of the last call (updated at most every ms).
    last_used: AtomicU64,
    /// Refill when fewer tokens than this are left: half the current lease size.
    low: AtomicU64,
    /// Held while a background refill is spawned or running.
    refilling: RefillFlag,
    /// Trickling: nanoseconds on the limiter's clock before which no lease will be asked
    /// for (0: not trickling). A copy of `LeaseCtl::not_before` that calls can read without
    /// the mutex, to refuse at once.
    trickle_until: AtomicU64,
    /// Nanoseconds (+1, so that 0 means "no") on the limiter's clock since a caller found no
    /// local token and waits for a lease; cleared when a lease lands. Time spent dry is not
    /// consumption time: the consumption estimate leaves it out (a key whose lease is gone
    /// in a moment and then waits for the next wants far more than it got).
    dry_since: AtomicU64,
    ctl: tokio::sync::Mutex<LeaseCtl>,
}

impl KeyState {
    /// Records a use at `now`; writes at most once per millisecond so that a hot key's
    /// callers do not all write one cache line.
    fn touch(&self, now: Duration) {
        let now = now.as_nanos() as u64;
        // Relaxed: an estimate for idle eviction.
        if now > self.last_used.load(Ordering::Relaxed) + 1_000_000 {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }

    /// Takes `n` local tokens or none; a failure moves nothing.
    fn try_take(&self, n: u64) -> bool {
        let ok = self.tokens.try_take(n);
        #[cfg(test)]
        if !ok {
            tests::after_failed_take(self);
        }
        ok
    }

    /// Room for a lease: `max_lease − held`. Exact, as no failing take is ever counted in
    /// `held` (else a failing fast-path `try_take` could make a later refund vanish).
    fn room(&self, max_lease: u64) -> u64 {
        max_lease.saturating_sub(self.tokens.held())
    }

    /// Whether a refill is due: open and below the low-water line.
    fn low(&self) -> bool {
        // Relaxed: an estimate (see the field).
        !self.tokens.is_closed() && self.tokens.held() < self.low.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct Inner<C: Clock> {
    db: PgKeyedLimiter,
    opts: LeaseOptions,
    cap_micro: i64,
    clock: C,
    db_time: DbTime,
    keys: RwLock<HashMap<String, Arc<KeyState>>>,
    /// Serialises inserts that may evict, so two of them do not both evict.
    admit: Mutex<()>,
    counters: Counters,
    /// The batch lease statement, with the schema filled in.
    batch_sql: String,
    /// One batcher per session, by the session's address in the pool (which lives as long
    /// as `db`).
    batchers: Mutex<Vec<(usize, Arc<Batcher>)>>,
}

/// Leased mode: a local token count per hot key, filled by leasing batches from the key's row.
/// See the [module docs](self) for the algorithm and the bound it keeps.
///
/// Uses the same table and statement as [`PgKeyedLimiter`], so strict-mode callers and
/// leased processes can share a key (strict callers see the tokens the leases left).
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
        Self::with_clock(
            config,
            options,
            lease,
            MonotonicClock::new(),
            DbTime::Server,
        )
        .await
    }
}

impl<C: Clock + Clone + std::fmt::Debug + 'static> PgLeasedLimiter<C> {
    /// Connects with a clock of the caller's choice; with [`DbTime::Clock`] the database
    /// statements use that clock too.
    pub async fn with_clock(
        config: &str,
        options: PgOptions,
        lease: LeaseOptions,
        clock: C,
        db_time: DbTime,
    ) -> Result<Self, PgLimitError> {
        lease.validate()?;
        let cap_micro = check_bucket(lease.rate, lease.burst as i128)?;
        let db = PgKeyedLimiter::connect(config, options).await?;
        let batch_sql = db
            .schema()
            .sql(&batch_take_sql().expect("the lease statement has the upsert's shape"));
        Ok(PgLeasedLimiter {
            inner: Arc::new(Inner {
                db,
                opts: lease,
                cap_micro,
                clock,
                db_time,
                keys: RwLock::new(HashMap::new()),
                admit: Mutex::new(()),
                counters: Counters::default(),
                batch_sql,
                batchers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Creates or upgrades the tables ([`install`](super::install)).
    pub async fn install(&self) -> Result<(), PgLimitError> {
        self.inner.db.install().await
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
            lease_statements: c.lease_statements.load(Ordering::Relaxed),
        }
    }

    /// The database connection's counters (statements, retries, reconnects).
    pub fn db_stats(&self) -> PgStats {
        self.inner.db.stats()
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

impl<C: Clock + Clone + std::fmt::Debug + 'static> Inner<C> {
    /// Takes `n` local tokens if they are there, and starts a background lease when few are
    /// left. No round trip, no lock. `Some(false)`: refused at once (trickling, nothing
    /// local); `None`: go to the slow path.
    fn fast_take(self: &Arc<Self>, key: &str, ks: &Arc<KeyState>, n: u64) -> Option<bool> {
        let now = self.clock.now();
        ks.touch(now);
        if !ks.try_take(n) {
            // Relaxed: a hint (see the field).
            let until = ks.trickle_until.load(Ordering::Relaxed);
            return ((now.as_nanos() as u64) < until).then_some(false);
        }
        if ks.low() {
            self.refill_in_background(key, ks);
        }
        Some(true)
    }

    /// The slow path: lease under the key's mutex (or wait for the lease in flight), then
    /// try again. Returns the outcome and the key's current state (a new one if `ks` was
    /// evicted meanwhile).
    async fn slow_take(
        self: &Arc<Self>,
        key: &str,
        mut ks: Arc<KeyState>,
        n: u64,
    ) -> Result<(bool, Arc<KeyState>), PgLimitError> {
        for _ in 0..4 {
            ks.touch(self.clock.now());
            if ks.try_take(n) {
                return Ok((true, ks));
            }
            let dry = self.clock.now().as_nanos() as u64 + 1;
            // Relaxed: an estimate (see the field); the first caller to find the key dry wins.
            let _ = ks
                .dry_since
                .compare_exchange(0, dry, Ordering::Relaxed, Ordering::Relaxed);
            let leased = match self.lease_detached(key, &ks, n).await? {
                Leased::Closed => {
                    ks = self.key_state(key).await; // evicted meanwhile: look the key up again
                    continue;
                }
                Leased::Ready => continue, // tokens were there: take them (or race again)
                Leased::Got(got) => got,
            };
            if ks.tokens.is_closed() {
                continue; // evicted during the lease (which gave its tokens back): look up again
            }
            if ks.try_take(n) {
                return Ok((true, ks));
            }
            if leased > 0 {
                continue; // other callers took this lease first
            }
            // Relaxed: statistics.
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Ok((false, ks));
        }
        // Relaxed: statistics.
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        Ok((false, ks))
    }

    /// Leases for `key` on a task of its own, under the key's mutex, and waits for it. The
    /// lease is never cancelled with its caller: a caller dropped mid-lease leaves the lease to
    /// finish and deposit its tokens (under the mutex, so `held ≤ max_lease` still holds and
    /// no tokens are taken from the row without landing in the key): a cancelled acquire never
    /// loses the tokens of its lease in flight.
    async fn lease_detached(
        self: &Arc<Self>,
        key: &str,
        ks: &Arc<KeyState>,
        n: u64,
    ) -> Result<Leased, PgLimitError> {
        let (me, ks, key) = (self.clone(), ks.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            let mut ctl = ks.ctl.lock().await;
            if ks.tokens.is_closed() {
                return Ok(Leased::Closed);
            }
            if ks.tokens.held() >= n {
                return Ok(Leased::Ready);
            }
            me.lease(&key, &ks, &mut ctl, n, true)
                .await
                .map(Leased::Got)
        });
        match task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: no lease.
            Err(_) => Ok(Leased::Got(0)),
        }
    }

    /// Takes up to `ask` tokens of `key` from its row, in the next batch statement of the
    /// key's session (see [`batch_take_sql`]).
    async fn batched_take(
        self: &Arc<Self>,
        key: &str,
        ask: u64,
        at: Option<SystemTime>,
    ) -> Result<Grant, PgLimitError> {
        // The batcher of the session the pool gives this key now (the address identifies it;
        // the pool lives as long as `db`). Any session can run any key's lease: this only
        // groups the leases that go out together.
        let id = {
            let conn = self.db.pool().for_key(key);
            &*conn as *const Conn as usize
        };
        let b = {
            let mut all = self.batchers.lock().expect("batchers");
            match all.iter().find(|(c, _)| *c == id) {
                Some((_, b)) => b.clone(),
                None => {
                    let b = Arc::new(Batcher::default());
                    all.push((id, b.clone()));
                    b
                }
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start = {
            let mut q = b.q.lock().expect("lease batch");
            q.pending.push(Pending {
                key: key.to_owned(),
                ask: ask as i64,
                at,
                tx,
            });
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            tokio::spawn(self.clone().run_batches(b));
        }
        rx.await.unwrap_or_else(|_| {
            Err(PgLimitError::Unavailable {
                retry_in: Duration::ZERO,
                why: "the lease batch was dropped (runtime shutting down)".into(),
            })
        })
    }

    /// Runs one session's batch statements while leases are waiting: each takes every
    /// pending key once (a key's second lease, from an evicted state, waits for the next).
    async fn run_batches(self: Arc<Self>, b: Arc<Batcher>) {
        /// If this task ends early (a panic, or its runtime shutting down), lets the next
        /// lease start a new one, and fails the leases queued meanwhile (their senders are
        /// dropped) instead of leaving them waiting forever.
        struct Stopped(Arc<Batcher>, bool);
        impl Drop for Stopped {
            fn drop(&mut self) {
                if self.1 {
                    return; // ended normally, with `running` reset under the queue's lock
                }
                if let Ok(mut q) = self.0.q.lock() {
                    q.running = false;
                    q.pending.clear();
                }
            }
        }
        let mut stopped = Stopped(b.clone(), false);
        loop {
            // Let the leases that are ready to ask (a wave of keys running dry together)
            // join this batch rather than wait a whole statement for the next one.
            tokio::task::yield_now().await;
            let mut batch = {
                let mut q = b.q.lock().expect("lease batch");
                if q.pending.is_empty() {
                    q.running = false;
                    stopped.1 = true;
                    return;
                }
                let mut seen = HashSet::new();
                let (mut now, mut later) = (Vec::new(), Vec::new());
                for p in q.pending.drain(..) {
                    if now.len() < MAX_BATCH && seen.insert(p.key.clone()) {
                        now.push(p);
                    } else {
                        later.push(p);
                    }
                }
                q.pending = later;
                now
            };
            // Relaxed: statistics.
            self.counters
                .lease_statements
                .fetch_add(1, Ordering::Relaxed);
            let mut alone = Vec::new();
            if batch.len() == 1 {
                alone = batch;
            } else {
                match self.run_batch(&batch).await {
                    Ok(mut rows) => {
                        for p in batch.drain(..) {
                            match rows.remove(&p.key) {
                                Some(g) => {
                                    let _ = p.tx.send(Ok(g));
                                }
                                None => alone.push(p),
                            }
                        }
                    }
                    // Each lease on its own, so that each caller gets its own error (a lost
                    // connection may have committed the batch: those tokens are then lost,
                    // under-use, never a second grant).
                    Err(_) => alone = batch,
                }
            }
            for p in alone {
                let r = self
                    .db
                    .take_raw(&p.key, self.opts.rate, self.cap_micro, p.ask, true, p.at)
                    .await;
                let _ = p.tx.send(r);
            }
        }
    }

    async fn run_batch(&self, batch: &[Pending]) -> Result<HashMap<String, Grant>, PgLimitError> {
        let ids: Vec<&str> = batch.iter().map(|p| p.key.as_str()).collect();
        let asks: Vec<i64> = batch.iter().map(|p| p.ask).collect();
        let ats: Vec<Option<SystemTime>> = batch.iter().map(|p| p.at).collect();
        let (ids, asks, ats) = (&ids, &asks, &ats);
        let (rate, cap) = (&self.opts.rate, &self.cap_micro);
        let sql = self.batch_sql.as_str();
        self.db
            .pool()
            .for_key(ids[0])
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                let rows = live.client.query(&st, &[ids, asks, ats, rate, cap]).await?;
                Ok(rows
                    .into_iter()
                    .map(|r| {
                        (
                            r.get::<_, String>(3),
                            Grant {
                                micro_left: r.get(0),
                                granted: r.get(1),
                                at: r.get(2),
                            },
                        )
                    })
                    .collect())
            })
            .await
    }

    /// How long a key whose lease came back short waits before asking again: the trickle
    /// interval, or a quarter of `burst / rate` if sooner (waiting longer would let the
    /// global bucket overflow its burst and discard refill).
    fn trickle_every(&self) -> Duration {
        let burst_time = Duration::from_secs_f64(self.opts.burst as f64 / self.opts.rate as f64);
        self.opts.trickle_interval.min(burst_time / 4)
    }

    fn at(&self) -> Option<SystemTime> {
        match self.db_time {
            DbTime::Server => None,
            DbTime::Clock { origin } => Some(origin + self.clock.now()),
        }
    }

    /// A lease covers the key's consumption for `lease_period`, or for twice the time a lease
    /// takes when that is longer: the next lease starts when half is left (the low-water
    /// line), so what is left must last a lease's round trip or the key runs dry and its row
    /// accumulates what the process could not lease in time. (A lease that waits longer than
    /// it takes to consume is also why the measured consumption lags the demand.)
    fn lease_size(&self, ctl: &LeaseCtl) -> u64 {
        let cover = self.opts.lease_period.max(ctl.latency_est * 2);
        let want = (ctl.rate_est * cover.as_secs_f64()).ceil();
        (want as u64).clamp(self.opts.min_lease, self.opts.max_lease)
    }

    /// The key's state, created (evicting if full) when missing.
    async fn key_state(&self, key: &str) -> Arc<KeyState> {
        if let Some(k) = self.keys.read().expect("key map").get(key) {
            return k.clone();
        }
        let evicted = {
            let _one = self.admit.lock().expect("admit");
            if let Some(k) = self.keys.read().expect("key map").get(key) {
                return k.clone();
            }
            let mut keys = self.keys.write().expect("key map");
            let mut evicted = Vec::new();
            if keys.len() >= self.opts.max_keys {
                let now = self.clock.now().as_nanos() as u64;
                let idle = self.opts.idle_timeout.as_nanos() as u64;
                // Relaxed: estimates (see module doc).
                let idle_keys: Vec<String> = keys
                    .iter()
                    .filter(|(_, k)| {
                        now.saturating_sub(k.last_used.load(Ordering::Relaxed)) >= idle
                    })
                    .map(|(n, _)| n.clone())
                    .collect();
                for n in idle_keys {
                    evicted.extend(keys.remove(&n).map(|k| (n, k.tokens.close())));
                }
                if keys.len() >= self.opts.max_keys {
                    let lru = keys
                        .iter()
                        // Relaxed: an estimate (see module doc).
                        .min_by_key(|(_, k)| k.last_used.load(Ordering::Relaxed))
                        .map(|(n, _)| n.clone())
                        .expect("the map is full, so not empty");
                    evicted.extend(keys.remove(&lru).map(|k| (lru, k.tokens.close())));
                }
            }
            let ks = Arc::new(self.new_key_state());
            keys.insert(key.to_owned(), ks.clone());
            (ks, evicted)
        };
        let (ks, evicted) = evicted;
        // Relaxed: statistics.
        self.counters
            .evictions
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        for (name, n) in evicted {
            if let Err(e) = self.give_back(&name, n).await {
                tracing::warn!(key = %name, error = %e, "giving back an evicted key's tokens failed");
            }
        }
        ks
    }

    fn new_key_state(&self) -> KeyState {
        KeyState::new(self.clock.now())
    }
}

impl KeyState {
    fn new(now: Duration) -> KeyState {
        KeyState {
            tokens: LocalTokens::new(),
            last_used: AtomicU64::new(now.as_nanos() as u64),
            low: AtomicU64::new(0),
            refilling: RefillFlag::new(),
            trickle_until: AtomicU64::new(0),
            dry_since: AtomicU64::new(0),
            ctl: tokio::sync::Mutex::new(LeaseCtl {
                rate_est: 0.0,
                leased_total: 0,
                sampled_at: now,
                consumed_then: 0,
                not_before: None,
                last_ask: 0,
                latency_est: Duration::ZERO,
            }),
        }
    }
}

impl<C: Clock + Clone + std::fmt::Debug + 'static> Inner<C> {
    /// Takes a lease for `key` (the caller holds `ctl`); returns the tokens leased. `dry`:
    /// a caller found no local token, so the last lease was too small.
    async fn lease(
        self: &Arc<Self>,
        key: &str,
        ks: &KeyState,
        ctl: &mut LeaseCtl,
        at_least: u64,
        dry: bool,
    ) -> Result<u64, PgLimitError> {
        let now = self.clock.now();
        if let Some(t) = ctl.not_before {
            if now < t {
                return Ok(0); // trickling: the global bucket was empty a moment ago
            }
        }
        // Update the consumption estimate (tokens per second since the last lease landed),
        // over the time the key had tokens: up to when a caller found it dry, if one did.
        // At least 1 ms (so that a key that is hot from its first call ramps up within a
        // few leases instead of leasing min_lease per call until a millisecond has passed).
        // Relaxed: an estimate (see the field).
        let dry_at = ks.dry_since.load(Ordering::Relaxed);
        let active_until = match dry_at {
            0 => now,
            d => Duration::from_nanos(d - 1).min(now),
        };
        let elapsed = active_until
            .saturating_sub(ctl.sampled_at)
            .max(Duration::from_millis(1));
        let consumed = ctl.leased_total - ks.tokens.held().min(ctl.leased_total);
        if consumed > ctl.consumed_then || now >= ctl.sampled_at + Duration::from_millis(1) {
            let rate = (consumed - ctl.consumed_then) as f64 / elapsed.as_secs_f64();
            ctl.rate_est = if ctl.rate_est == 0.0 {
                rate
            } else {
                0.5 * ctl.rate_est + 0.5 * rate
            };
            ctl.sampled_at = now;
            ctl.consumed_then = consumed;
        }
        let room = ks.room(self.opts.max_lease);
        let mut want = self.lease_size(ctl).max(at_least);
        if dry && ctl.not_before.is_none() {
            // Running dry while the global bucket is not short: the consumption estimate is
            // held down by the leases themselves (a key cannot consume faster than it is
            // leased to), so grow geometrically, like a slow start.
            want = want.max(ctl.last_ask.saturating_mul(2));
        }
        if ctl.not_before.is_some() {
            // The last lease was short: the global bucket is the limit (other processes, or
            // demand above the rate). Ask for at most one asking interval of the global
            // rate: after a stall the row holds a lump, and a process that took it all would
            // hold what the others are waiting for (and give it back unspent at shutdown); a
            // remainder left in the row makes the next lease full, and full leases follow
            // each other without waiting.
            let every = self.trickle_every().max(ctl.latency_est);
            let share = (self.opts.rate as f64 * every.as_secs_f64()).ceil() as u64;
            want = want.min(share.max(self.opts.min_lease).max(at_least));
        }
        let ask = want.min(self.opts.max_lease).min(room);
        if ask == 0 {
            return Ok(0);
        }
        // Relaxed: statistics.
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        self.counters
            .largest_lease
            .fetch_max(ask, Ordering::Relaxed);
        let g = self.batched_take(key, ask, self.at()).await?;
        let landed = self.clock.now();
        let took = landed.saturating_sub(now);
        ctl.latency_est = if ctl.latency_est.is_zero() {
            took
        } else {
            (ctl.latency_est + took) / 2
        };
        let got = g.granted.max(0) as u64;
        if got > 0 {
            // Relaxed: statistics.
            self.counters.leased.fetch_add(got, Ordering::Relaxed);
            // Only this lease adds (the caller holds `ctl`) and takes only lower `held`, so
            // `held + got ≤ max_lease`.
            if let Err(back) = ks.tokens.deposit(got) {
                // The key was evicted meanwhile: these tokens were never usable here.
                self.give_back(key, back).await?;
                return Ok(0);
            }
            ctl.leased_total += got;
            // The estimate's next interval starts now, with tokens in hand.
            ctl.sampled_at = landed;
            ctl.consumed_then = ctl.leased_total - ks.tokens.held().min(ctl.leased_total);
            // Relaxed: an estimate (see the field).
            ks.dry_since.store(0, Ordering::Relaxed);
        }
        if got < ask {
            // Relaxed: statistics.
            self.counters.short_leases.fetch_add(1, Ordering::Relaxed);
            // Ask again when about a quarter of the burst has accrued, or after the trickle
            // interval if sooner: waiting longer would let the global bucket overflow its
            // burst and discard refill (the rate would not be held).
            let until = now + self.trickle_every();
            ctl.not_before = Some(until);
            // Relaxed: a hint for refusing without the mutex; the mutex-held copy decides.
            ks.trickle_until
                .store(until.as_nanos() as u64, Ordering::Relaxed);
        } else {
            ctl.not_before = None;
            // Relaxed: as above.
            ks.trickle_until.store(0, Ordering::Relaxed);
        }
        ctl.last_ask = ask;
        // Relaxed: an estimate read by the fast path.
        ks.low
            .store(ask.max(self.lease_size(ctl)) / 2, Ordering::Relaxed);
        Ok(got)
    }

    /// Leases for `key` on a background task, unless a refill is already running (which
    /// re-checks after it lets go of the flag, so this call's take is not forgotten).
    fn refill_in_background(self: &Arc<Self>, key: &str, ks: &Arc<KeyState>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !ks.refilling.claim() {
            return;
        }
        let (me, ks, key) = (self.clone(), ks.clone(), key.to_owned());
        /// Lets go of the flag if the refill task ends while holding it (its runtime shut
        /// down): otherwise no take could ever start a background refill of the key again.
        struct Holding(Arc<KeyState>, bool);
        impl Drop for Holding {
            fn drop(&mut self) {
                if self.1 {
                    self.0.refilling.release(|| false);
                }
            }
        }
        rt.spawn(async move {
            let mut holding = Holding(ks.clone(), true);
            loop {
                let mut ctl = ks.ctl.lock().await;
                let mut got = 0;
                if ks.low() {
                    match me.lease(&key, &ks, &mut ctl, 1, false).await {
                        Ok(n) => got = n,
                        Err(e) => {
                            tracing::debug!(key = %key, error = %e, "background lease failed")
                        }
                    }
                }
                drop(ctl);
                // A refill that got nothing (trickling, an error, closed) stops: the next take
                // that finds the key low claims the flag again.
                holding.1 = false;
                if !ks.refilling.release(|| got > 0 && ks.low()) {
                    break;
                }
                holding.1 = true; // claimed again by the re-check
            }
        });
    }

    /// Gives `n` tokens of `key` back to the database; returns `n`.
    async fn give_back(&self, key: &str, n: u64) -> Result<u64, PgLimitError> {
        if n == 0 {
            return Ok(0);
        }
        self.db
            .give_back_raw(key, self.opts.rate, self.cap_micro, n as i64, self.at())
            .await?;
        // Relaxed: statistics.
        self.counters.returned.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    type Hook = Box<dyn FnMut(&KeyState)>;

    thread_local! {
        static AFTER_FAILED_TAKE: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Runs the test's hook, once, where a failing take has decided to fail (where a claim
    /// counted until refunded would sit between the claim and its refund).
    pub(super) fn after_failed_take(ks: &KeyState) {
        if let Some(mut hook) = AFTER_FAILED_TAKE.with(|h| h.borrow_mut().take()) {
            hook(ks);
        }
    }

    /// The batch statement is the single-key upsert over `unnest`, with the wanted count in
    /// the update arm read through `excluded.granted` (the update arm cannot see `r`).
    #[test]
    fn batch_statement_has_the_upserts_shape() {
        let sql = batch_take_sql().expect("shape");
        assert!(sql.contains("FROM unnest($1::text[], $2::bigint[], $3::timestamptz[])"));
        assert!(sql.contains("ORDER BY r.id\nON CONFLICT (id) DO UPDATE"));
        assert!(sql.ends_with("RETURNING b.micro, b.granted, b.ts, b.id"));
        let (insert, update) = sql.split_once("ON CONFLICT").unwrap();
        assert!(insert.contains("r.n") && !insert.contains("excluded."));
        assert!(update.contains("excluded.granted") && !update.contains("r.n"));
        assert!(!sql.contains('\u{1}'), "a placeholder was left");
    }

    /// A failing fast-path `try_take` in leased mode does not make a later refund vanish: were
    /// a failing take's claim counted until it refunded it, a lease landing in between would
    /// see `held = 0` and ask for `max_lease`, and the failing take's refund would then
    /// overflow the bucket, losing the tokens held before.
    #[test]
    fn failing_fast_path_take_makes_no_refund_vanish() {
        const MAX_LEASE: u64 = 10;
        let ks = KeyState::new(Duration::ZERO);
        assert!(ks.tokens.deposit(3).is_ok());
        let leased = std::rc::Rc::new(std::cell::Cell::new(0));
        let l = leased.clone();
        // A lease lands while the take is failing: it asks for the room and deposits it.
        AFTER_FAILED_TAKE.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |ks: &KeyState| {
                let room = ks.room(MAX_LEASE);
                assert!(ks.tokens.deposit(room).is_ok());
                l.set(room);
            }))
        });
        assert!(!ks.try_take(5));
        assert_eq!(leased.get(), 7, "the lease saw every token held");
        assert_eq!(ks.tokens.held(), 3 + leased.get(), "a token vanished");
        assert!(ks.try_take(10));
        assert_eq!(ks.tokens.held(), 0);
    }
}
