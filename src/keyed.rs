//! Per-key limits in memory: [`KeyedThrottle`], one [`SharedTokenBucket`] per key (per tenant,
//! per table, per client), with bounded memory.
//!
//! The long-form description (when a key may be evicted and why that grants no free burst, the
//! cap, the costs) is `docs/keyed.md`, included below.
//!
//! # Orderings
//!
//! - The per-key buckets keep their own orderings (see [`crate::bucket`]).
//! - `last_used` (per key): **Relaxed**. It is written while the map's shard is read-locked and
//!   read by eviction while the same shard is write-locked: the lock orders the two, the atomic
//!   only lets several checkers of one key write it at once.
//! - `keys` (the count): **Relaxed** read-modify-writes. It is a counter of reservations, checked
//!   and bumped in one `fetch_update`, so the cap holds whatever the interleaving; it publishes
//!   no other data.
#![doc = include_str!("../docs/keyed.md")]

use std::fmt;
use std::hash::Hash;
use std::time::Duration;

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;

use crate::bucket::{BucketConfig, SharedTokenBucket, Uncapped};
use crate::clock::{Clock, MonotonicClock};
use crate::error::ConfigError;
use crate::sync::{AtomicU64, Ordering};

/// Why a [`KeyedThrottle`] cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyedConfigError {
    /// The per-key bucket configuration is rejected.
    #[error("invalid per-key bucket")]
    Bucket(#[from] ConfigError),
    /// A map that can hold no key.
    #[error("max_keys must be at least 1")]
    ZeroMaxKeys,
}

/// Why [`KeyedThrottle::check`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyedError {
    /// The key's bucket has too few tokens now; a retry after `retry_after` can succeed.
    #[error("{missing} tokens missing for this key; retry in {retry_after:?}")]
    Insufficient {
        /// Tokens missing.
        missing: u64,
        /// How long until they accrue (at the current time and rate).
        retry_after: Duration,
    },
    /// The cost is more than a key's bucket can ever hold.
    #[error("a cost of {cost} tokens can never be met: a key's bucket holds at most {limit}")]
    CostExceedsLimit {
        /// The cost asked for.
        cost: u64,
        /// The per-key limit.
        limit: u64,
    },
    /// A new key, and `max_keys` keys are tracked, none of them idle: the new key is refused
    /// (keys already tracked keep working). Retry later, or raise the cap.
    #[error("{max_keys} keys are tracked and none is idle: new key refused")]
    TooManyKeys {
        /// The cap.
        max_keys: usize,
    },
}

impl KeyedError {
    /// How long to wait before retrying, if waiting can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            KeyedError::Insufficient { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}

/// One key's state.
struct KeyState<C: Clock> {
    bucket: SharedTokenBucket<Uncapped, C>,
    /// When the key was last checked, in nanoseconds on the throttle's clock.
    last_used: AtomicU64,
}

impl<C: Clock> KeyState<C> {
    /// Takes `cost` (in `1..=limit`) tokens if they are there; never waits.
    fn take(&self, cost: u64, now: Duration) -> Result<(), KeyedError> {
        // Relaxed: see the module doc (the shard lock orders it against eviction).
        self.last_used.store(nanos(now), Ordering::Relaxed);
        let b = &self.bucket;
        b.replenish_at(now);
        if b.available() >= cost {
            let tail = b.grab(cost);
            if b.deficiency(tail) == 0 {
                return Ok(());
            }
            // Another checker took the tokens between our look and our grab. Checkers never
            // wait, so nobody queues behind us: giving ours back at once is exact.
            b.refund(cost);
        }
        let missing = cost.saturating_sub(b.available()).max(1);
        let need = missing.max(b.threshold());
        let last = b.last_replenish().unwrap_or(now);
        let retry_after = last
            .checked_add(b.duration_for(need))
            .unwrap_or(Duration::MAX)
            .saturating_sub(now);
        Err(KeyedError::Insufficient {
            missing,
            retry_after,
        })
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A rate limit per key: each key gets its own lock-free [`SharedTokenBucket`] with the same
/// configuration, created on first use (full, as a fresh bucket is) and evicted once idle.
///
/// # Invariants
///
/// - **Per-key rate**: over any interval `t`, the tokens granted to one key are at most
///   `rate × t + limit`, whatever the evictions (a key is evicted only once its bucket would be
///   full anyway, so re-creating it grants nothing extra; see `docs/keyed.md`).
/// - **Bounded memory**: at most `max_keys` keys are tracked at any instant. A new key beyond the
///   cap first evicts idle keys; if none is idle it is refused with
///   [`KeyedError::TooManyKeys`]. Keys already tracked are never refused for the cap.
/// - **Never waits**: [`check`](Self::check) answers at once, with how long to wait on refusal.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::keyed::{KeyedError, KeyedThrottle};
/// use iothrottle::{BucketConfig, ManualClock, Rate};
///
/// let clock = ManualClock::new();
/// // Each tenant: 100 requests/s, bursts of 10; at most 10,000 tenants in memory.
/// let limits = KeyedThrottle::with_clock(
///     BucketConfig::new(Rate::per_second(100), 10),
///     10_000,
///     clock.clone(),
/// )?;
/// for _ in 0..10 {
///     limits.check(&"tenant-a", 1)?;
/// }
/// assert!(matches!(limits.check(&"tenant-a", 1), Err(KeyedError::Insufficient { .. })));
/// limits.check(&"tenant-b", 1)?; // another tenant has its own bucket
/// clock.advance(Duration::from_millis(10));
/// limits.check(&"tenant-a", 1)?; // one more token accrued
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct KeyedThrottle<K, C: Clock + Clone = MonotonicClock>
where
    K: Eq + Hash,
{
    map: DashMap<K, Box<KeyState<C>>>,
    config: BucketConfig,
    clock: C,
    max_keys: usize,
    /// Unused for this long, a key may be evicted; never shorter than a full refill.
    idle: Duration,
    /// Keys tracked or reserved for insertion; at most `max_keys`.
    keys: AtomicU64,
}

impl<K: Eq + Hash + Clone> KeyedThrottle<K, MonotonicClock> {
    /// Per-key buckets of `config`, at most `max_keys` keys, on a [`MonotonicClock`].
    pub fn new(config: BucketConfig, max_keys: usize) -> Result<Self, KeyedConfigError> {
        Self::with_clock(config, max_keys, MonotonicClock::new())
    }
}

impl<K: Eq + Hash + Clone, C: Clock + Clone> KeyedThrottle<K, C> {
    /// Per-key buckets of `config`, at most `max_keys` keys, reading time from `clock` (every
    /// key's bucket gets a clone).
    pub fn with_clock(
        config: BucketConfig,
        max_keys: usize,
        clock: C,
    ) -> Result<Self, KeyedConfigError> {
        config.validate()?;
        if max_keys == 0 {
            return Err(KeyedConfigError::ZeroMaxKeys);
        }
        let refill = config.rate().duration_for(config.limit());
        Ok(KeyedThrottle {
            map: DashMap::new(),
            config,
            clock,
            max_keys,
            idle: refill,
            keys: AtomicU64::new(0),
        })
    }

    /// Keeps keys at least `idle` after their last use before they may be evicted. Values below
    /// the time a bucket takes to refill from empty (`duration_for(limit)`, the default) are
    /// raised to it: evicting earlier would hand the key a free burst.
    pub fn with_idle_time(mut self, idle: Duration) -> Self {
        self.idle = idle.max(self.config.rate().duration_for(self.config.limit()));
        self
    }

    /// Takes `cost` tokens from `key`'s bucket if they are there now; never waits. A key seen for
    /// the first time gets a full bucket.
    pub fn check(&self, key: &K, cost: u64) -> Result<(), KeyedError> {
        let limit = self.config.limit();
        if cost > limit {
            return Err(KeyedError::CostExceedsLimit { cost, limit });
        }
        if cost == 0 {
            return Ok(());
        }
        let now = self.clock.now();
        // The shard stays read-locked while we take: eviction (write lock) cannot remove the
        // state under us.
        if let Some(state) = self.map.get(key) {
            return state.take(cost, now);
        }
        self.insert_and_take(key, cost, now)
    }

    #[cold]
    fn insert_and_take(&self, key: &K, cost: u64, now: Duration) -> Result<(), KeyedError> {
        if !self.reserve() {
            let evicted = self.evict_idle_at(now);
            tracing::debug!(
                evicted,
                max_keys = self.max_keys,
                "keyed throttle at its cap"
            );
            if !self.reserve() {
                return Err(KeyedError::TooManyKeys {
                    max_keys: self.max_keys,
                });
            }
        }
        match self.map.entry(key.clone()) {
            Entry::Occupied(state) => {
                // Inserted by another thread meanwhile: our reservation is not needed.
                self.unreserve(1);
                state.get().take(cost, now)
            }
            Entry::Vacant(slot) => {
                let bucket = SharedTokenBucket::with_clock(self.config, self.clock.clone())
                    .expect("validated in the constructor");
                let state = slot.insert(Box::new(KeyState {
                    bucket,
                    last_used: AtomicU64::new(nanos(now)),
                }));
                state.take(cost, now)
            }
        }
    }

    fn reserve(&self) -> bool {
        let max = self.max_keys as u64;
        // Relaxed: see the module doc.
        self.keys
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn unreserve(&self, n: u64) {
        // Relaxed: see the module doc.
        self.keys.fetch_sub(n, Ordering::Relaxed);
    }

    /// Evicts every key unused for the idle time; returns how many. Call it periodically to keep
    /// memory low before the cap is reached (a new key at the cap calls it anyway).
    pub fn evict_idle(&self) -> usize {
        self.evict_idle_at(self.clock.now())
    }

    fn evict_idle_at(&self, now: Duration) -> usize {
        let now = nanos(now);
        let idle = nanos(self.idle);
        let mut evicted = 0u64;
        self.map.retain(|_, state| {
            // Relaxed: the shard's write lock orders this read after every take on the key.
            let last = state.last_used.load(Ordering::Relaxed);
            let keep = now.saturating_sub(last) < idle;
            if !keep {
                evicted += 1;
            }
            keep
        });
        if evicted > 0 {
            self.unreserve(evicted);
        }
        evicted as usize
    }

    /// Forgets `key` at once (its next check gets a full bucket). Returns whether it was tracked.
    pub fn remove(&self, key: &K) -> bool {
        let removed = self.map.remove(key).is_some();
        if removed {
            self.unreserve(1);
        }
        removed
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No key tracked.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The cap on keys.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// How long a key must stay unused before it may be evicted.
    pub fn idle_time(&self) -> Duration {
        self.idle
    }

    /// The per-key bucket configuration.
    pub fn config(&self) -> BucketConfig {
        self.config
    }

    /// Tokens in `key`'s bucket now (`None` if the key is not tracked: it would get a full
    /// bucket).
    pub fn available(&self, key: &K) -> Option<u64> {
        let state = self.map.get(key)?;
        state.bucket.replenish_at(self.clock.now());
        Some(state.bucket.available())
    }

    /// The heap bytes one tracked key costs, not counting the map's own slot (the key and a
    /// pointer) and the allocator's rounding: the per-key bucket with its cache-line padding.
    pub fn state_bytes_per_key() -> usize {
        std::mem::size_of::<KeyState<C>>()
    }
}

#[cfg(feature = "rt")]
impl<K: Eq + Hash + Clone, C: Clock + Clone> KeyedThrottle<K, C> {
    /// Waits (on tokio's timer) until `check(key, cost)` succeeds. Not FIFO between tasks of one
    /// key: each retries after the time its tokens need (like governor's `until_key_ready`).
    /// Fails only for [`KeyedError::CostExceedsLimit`] and [`KeyedError::TooManyKeys`].
    /// Cancel-safe: a waiter holds no tokens while it sleeps.
    #[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
    pub async fn until_ready(&self, key: &K, cost: u64) -> Result<(), KeyedError> {
        loop {
            match self.check(key, cost) {
                Err(KeyedError::Insufficient { retry_after, .. }) => {
                    tokio::time::sleep(retry_after.max(Duration::from_nanos(1))).await
                }
                other => return other,
            }
        }
    }
}

impl<K: Eq + Hash, C: Clock + Clone> fmt::Debug for KeyedThrottle<K, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedThrottle")
            .field("config", &self.config)
            .field("keys", &self.map.len())
            .field("max_keys", &self.max_keys)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}
