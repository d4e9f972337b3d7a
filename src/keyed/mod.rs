//! Per-key limits in memory: [`KeyedThrottle`], a token bucket per key (per tenant, per table,
//! per client) in two words, with bounded memory.
//!
//! The long-form description (when a key may be evicted and why that grants no free burst, the
//! cap, the costs) is `docs/keyed.md`, included below.
//!
//! # Orderings
//!
//! - A key's state is plain data behind its shard's mutex: the lock orders every check, eviction
//!   and removal of a key.
//! - `keys` (the count): **Relaxed** read-modify-writes. It is checked and bumped in one
//!   `fetch_update` under the shard's lock just before an insertion (and lowered just after a
//!   removal), so it never exceeds the cap whatever the interleaving; it publishes no other data.
//! - `next_any` (the map's eviction bound): **Relaxed**. A hint that lets a new key at the cap
//!   skip a sweep that could evict nothing; the shards' own bounds sit under their locks.
#![doc = include_str!("../../docs/keyed.md")]

use std::fmt;
use std::hash::Hash;
use std::time::Duration;

pub(crate) mod error;
mod map;
mod pace;

use crate::bucket::BucketConfig;
use crate::clock::{Clock, FastClock};
use crate::{KeyedConfigError, KeyedError};
use map::Map;
use pace::{Pace, Shortfall};

use crate::sync::MutexGuard;

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A rate limit per key: each key gets its own token bucket of the same configuration (two words:
/// when it was last checked and where on the rate's exact count its bucket runs empty), created
/// on first use (full, as a fresh bucket is) and evicted once idle.
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
/// use iothrottle::keyed::KeyedThrottle;
/// use iothrottle::{BucketConfig, KeyedError, ManualClock, Rate};
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
pub struct KeyedThrottle<K, C: Clock + Clone = FastClock>
where
    K: Eq + Hash,
{
    map: Map<K>,
    pace: Pace,
    config: BucketConfig,
    clock: C,
    max_keys: usize,
    /// Unused for this long, a key may be evicted; never shorter than a full refill.
    idle: Duration,
}

impl<K: Eq + Hash + Clone> KeyedThrottle<K, FastClock> {
    /// Per-key buckets of `config`, at most `max_keys` keys, on a [`FastClock`] (one reading
    /// per check, a few nanoseconds).
    pub fn new(config: BucketConfig, max_keys: usize) -> Result<Self, KeyedConfigError> {
        Self::with_clock(config, max_keys, FastClock::new())
    }
}

impl<K: Eq + Hash + Clone, C: Clock + Clone> KeyedThrottle<K, C> {
    /// Per-key buckets of `config`, at most `max_keys` keys, reading time from `clock`.
    ///
    /// A key's tokens accrue continuously at the exact rate; the configuration's replenish
    /// threshold (which saves a shared bucket's CAS) has no use here and is ignored.
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
            map: Map::new(max_keys),
            pace: Pace::new(config.rate(), config.limit()),
            config,
            clock,
            max_keys,
            idle: refill,
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
        let now = nanos(self.clock.now());
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        if let Some((_, state)) = shard.table.find_mut(hash, |(k, _)| k == key) {
            return self.pace.take(state, now, cost).map_err(insufficient);
        }
        let idle = nanos(self.idle);
        let max = self.max_keys as u64;
        let fresh = self.pace.fresh(now);
        let idle_at = now.saturating_add(idle);
        if let Some(state) = self
            .map
            .insert(&mut shard, hash, key.clone(), fresh, idle_at, max)
        {
            return self.pace.take(state, now, cost).map_err(insufficient);
        }
        self.new_key_at_the_cap(shard, hash, key, cost, now)
    }

    /// A new key while `max_keys` are tracked: evicts every idle key of every shard whose
    /// eviction bound has come; refused at once when the map's bound says no key can be idle.
    #[cold]
    fn new_key_at_the_cap<'a>(
        &'a self,
        shard: MutexGuard<'a, map::Shard<K>>,
        hash: u64,
        key: &K,
        cost: u64,
        now: u64,
    ) -> Result<(), KeyedError> {
        let idle = nanos(self.idle);
        let max = self.max_keys as u64;
        let fresh = self.pace.fresh(now);
        let idle_at = now.saturating_add(idle);
        // Shards are locked one at a time: never while holding ours.
        drop(shard);
        let evicted = self.map.sweep_all(now, idle, false);
        let mut shard = self.map.lock(hash);
        if let Some((_, state)) = shard.table.find_mut(hash, |(k, _)| k == key) {
            // Inserted by another thread meanwhile.
            return self.pace.take(state, now, cost).map_err(insufficient);
        }
        tracing::debug!(
            evicted,
            max_keys = self.max_keys,
            "keyed throttle at its cap"
        );
        match self
            .map
            .insert(&mut shard, hash, key.clone(), fresh, idle_at, max)
        {
            Some(state) => self.pace.take(state, now, cost).map_err(insufficient),
            None => Err(KeyedError::TooManyKeys {
                max_keys: self.max_keys,
            }),
        }
    }

    /// Evicts every key unused for the idle time; returns how many. Call it periodically to keep
    /// memory low before the cap is reached (a new key at the cap evicts as needed anyway).
    pub fn evict_idle(&self) -> usize {
        let now = nanos(self.clock.now());
        self.map.sweep_all(now, nanos(self.idle), true) as usize
    }

    /// Forgets `key` at once (its next check gets a full bucket). Returns whether it was tracked.
    pub fn remove(&self, key: &K) -> bool {
        let hash = self.map.hash(key);
        let mut shard = self.map.lock(hash);
        self.map.remove(&mut shard, hash, key)
    }

    /// Keys tracked now; never more than [`max_keys`](Self::max_keys).
    pub fn len(&self) -> usize {
        self.map.len() as usize
    }

    /// No key tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    /// bucket). Does not count as a use.
    pub fn available(&self, key: &K) -> Option<u64> {
        let now = nanos(self.clock.now());
        let hash = self.map.hash(key);
        let shard = self.map.lock(hash);
        let (_, state) = shard.table.find(hash, |(k, _)| k == key)?;
        Some(self.pace.available(state, now))
    }

    /// The bytes of one slot of the map: the key and its 16-byte state. A tracked key costs
    /// this plus one control byte, and the table's spare capacity (a `hashbrown` table is
    /// between 7/16 and 7/8 full).
    pub fn state_bytes_per_key() -> usize {
        Map::<K>::slot_bytes()
    }
}

fn insufficient(s: Shortfall) -> KeyedError {
    KeyedError::Insufficient {
        missing: s.missing,
        retry_after: s.retry_after,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::sync::Ordering;
    use crate::Rate;

    fn scans<K: Eq + Hash>(k: &KeyedThrottle<K, ManualClock>) -> u64 {
        k.map.scans.load(Ordering::Relaxed)
    }

    #[test]
    fn a_new_key_at_the_cap_scans_no_shard_until_a_key_may_be_idle() {
        let clock = ManualClock::new();
        let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
        let k = KeyedThrottle::with_clock(cfg, 10_000, clock.clone()).unwrap();
        for key in 0..10_000u64 {
            k.check(&key, 1).unwrap();
        }
        // Every key busy: 10,000 new keys are refused without looking at a single shard.
        for key in 10_000..20_000u64 {
            assert_eq!(
                k.check(&key, 1),
                Err(KeyedError::TooManyKeys { max_keys: 10_000 })
            );
        }
        assert_eq!(scans(&k), 0);
        assert_eq!(k.len(), 10_000);
        // Half the keys used again 50 ms later; at 100 ms the other half is idle: one pass over
        // the shards evicts all 5,000 of them, and the next 5,000 new keys scan nothing.
        clock.advance(Duration::from_millis(50));
        for key in 0..5_000u64 {
            k.check(&key, 1).unwrap();
        }
        clock.advance(Duration::from_millis(50));
        for key in 20_000..25_000u64 {
            k.check(&key, 1).unwrap();
        }
        let shards = k.map.shard_count() as u64;
        assert_eq!(scans(&k), shards, "one pass over the shards");
        assert_eq!(k.len(), 10_000);
        assert_eq!(
            k.check(&25_000, 1),
            Err(KeyedError::TooManyKeys { max_keys: 10_000 })
        );
        assert_eq!(scans(&k), shards, "refused in O(1) again");
    }
}
