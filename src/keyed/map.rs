//! The keyed throttle's map: keys hashed once into shards, each a `hashbrown` table of
//! `(key, state)` pairs behind its own lock, and the bookkeeping that keeps eviction at the cap
//! cheap.
//!
//! # Eviction bookkeeping
//!
//! Each shard keeps `next_sweep`, a time no later than the earliest moment any of its keys may
//! be evicted (`last + idle`), and the map keeps `next_any`, a time no later than every shard's.
//! Both stay lower bounds without being kept exact: a use only moves a key's moment later, an
//! eviction removes one, and a key inserted at `t` has its moment at `t + idle`, which each
//! insertion folds in. A new key at the cap sweeps (evicts every idle key of) every shard whose
//! moment has come if the map's has come, and is refused at once otherwise: a refusal costs
//! O(1), and a pass only runs when at least one key may be idle; it then evicts all of them, and
//! the keys that stay push the bound to the next moment one of them may be idle.

use std::hash::{BuildHasher, Hash};

use crossbeam_utils::CachePadded;
use hashbrown::{DefaultHashBuilder, HashTable};

use super::pace::KeyState;
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};

/// One shard: its keys and its sweep bound.
pub(super) struct Shard<K> {
    pub(super) table: HashTable<(K, KeyState)>,
    /// No key of this shard may be evicted before this time (ns; `u64::MAX`: no key).
    next_sweep: u64,
}

/// The sharded table and the count of keys.
pub(super) struct Map<K> {
    shards: Box<[CachePadded<Mutex<Shard<K>>>]>,
    hasher: DefaultHashBuilder,
    /// `log2(shards.len())`.
    bits: u32,
    /// Keys in the table; at most the cap. Incremented under the shard lock just before an
    /// insertion, decremented under it just after a removal.
    keys: AtomicU64,
    /// No key of the map may be evicted before this time (ns).
    next_any: AtomicU64,
    /// Shards visited by passes (tests count the work a new key at the cap does).
    #[cfg(test)]
    pub(super) scans: AtomicU64,
}

impl<K: Eq + Hash> Map<K> {
    /// A map sized for `max_keys`: at least 16 shards per hardware thread (two threads rarely
    /// meet on one lock), and about 512 keys per shard at the cap (at most 1024 shards), so a
    /// sweep stays short.
    pub(super) fn new(max_keys: usize) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shards = (max_keys / 512)
            .max(threads * 16)
            .clamp(1, 1024)
            .next_power_of_two();
        Map {
            shards: (0..shards)
                .map(|_| {
                    CachePadded::new(Mutex::new(Shard {
                        table: HashTable::new(),
                        next_sweep: u64::MAX,
                    }))
                })
                .collect(),
            hasher: DefaultHashBuilder::default(),
            bits: shards.trailing_zeros(),
            keys: AtomicU64::new(0),
            next_any: AtomicU64::new(u64::MAX),
            #[cfg(test)]
            scans: AtomicU64::new(0),
        }
    }

    pub(super) fn hash(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of `hash`, locked. The index is the top bits of the hash times a large odd
    /// constant (Fibonacci hashing): every bit of the hash moves them, so the shards fill
    /// evenly whichever bits the hasher varies most.
    pub(super) fn lock(&self, hash: u64) -> MutexGuard<'_, Shard<K>> {
        let i = if self.bits == 0 {
            0
        } else {
            (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - self.bits)) as usize
        };
        lock(&self.shards[i])
    }

    /// Keys tracked.
    pub(super) fn len(&self) -> u64 {
        // Relaxed: a count, publishing nothing (see the module doc of `keyed`).
        self.keys.load(Ordering::Relaxed)
    }

    /// Inserts `key` (absent from `shard`) with `state` if the cap allows; `idle_at` is when it
    /// may first be evicted. Returns the state's slot, or `None` at the cap.
    pub(super) fn insert<'s>(
        &self,
        shard: &'s mut Shard<K>,
        hash: u64,
        key: K,
        state: KeyState,
        idle_at: u64,
        max_keys: u64,
    ) -> Option<&'s mut KeyState> {
        // Relaxed: the count is checked and bumped in one read-modify-write, so the cap holds
        // whatever the interleaving; it publishes no other data.
        self.keys
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max_keys).then_some(n + 1)
            })
            .ok()?;
        shard.next_sweep = shard.next_sweep.min(idle_at);
        // Relaxed: a hint read and lowered by new keys only; see `next_any`'s doc.
        self.next_any.fetch_min(idle_at, Ordering::Relaxed);
        let hasher = &self.hasher;
        let entry = shard
            .table
            .insert_unique(hash, (key, state), |(k, _)| hasher.hash_one(k));
        Some(&mut entry.into_mut().1)
    }

    /// Removes `key` from its (locked) shard; returns whether it was there.
    pub(super) fn remove(&self, shard: &mut Shard<K>, hash: u64, key: &K) -> bool {
        match shard.table.find_entry(hash, |(k, _)| k == key) {
            Ok(entry) => {
                entry.remove();
                self.uncount(1);
                true
            }
            Err(_) => false,
        }
    }

    fn uncount(&self, n: u64) {
        // Relaxed: as in `insert`.
        self.keys.fetch_sub(n, Ordering::Relaxed);
    }

    /// Evicts every key of `shard` idle at `now` (unused for `idle`) if the shard's bound says
    /// one may be, and recomputes the bound. Returns how many were evicted.
    pub(super) fn sweep(&self, shard: &mut Shard<K>, now: u64, idle: u64) -> u64 {
        if now < shard.next_sweep {
            return 0;
        }
        let mut evicted = 0;
        let mut next = u64::MAX;
        shard.table.retain(|(_, state)| {
            let at = state.last.saturating_add(idle);
            if at <= now {
                evicted += 1;
                false
            } else {
                next = next.min(at);
                true
            }
        });
        shard.next_sweep = next;
        if evicted > 0 {
            self.uncount(evicted);
        }
        evicted
    }

    /// Sweeps every shard whose bound has come (all of them when `force`), skipping the whole
    /// pass when the map's bound says no key can be idle yet. Returns how many were evicted.
    pub(super) fn sweep_all(&self, now: u64, idle: u64, force: bool) -> u64 {
        // Relaxed: the bound is a hint; see the module doc.
        if !force && now < self.next_any.load(Ordering::Relaxed) {
            return 0;
        }
        let mut evicted = 0;
        // A key inserted after this point may be evicted no earlier than `now + idle`.
        let mut next = now.saturating_add(idle);
        for shard in self.shards.iter() {
            #[cfg(test)]
            // Relaxed: a test counter.
            self.scans.fetch_add(1, Ordering::Relaxed);
            let mut shard = lock(shard);
            evicted += self.sweep(&mut shard, now, idle);
            next = next.min(shard.next_sweep);
        }
        // Relaxed: as above. Every value stored is a lower bound (see the module doc).
        self.next_any.store(next, Ordering::Relaxed);
        evicted
    }

    /// How many shards.
    #[cfg(test)]
    pub(super) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Bytes of one slot of a shard's table.
    pub(super) fn slot_bytes() -> usize {
        std::mem::size_of::<(K, KeyState)>()
    }
}

/// Locks a shard. A panic under the lock (in a key's `Hash` or `Eq`) leaves the shard's table
/// consistent (hashbrown's operations are panic-safe and a key's state is two plain words), so a
/// poisoned lock is used as it is.
fn lock<K>(shard: &Mutex<Shard<K>>) -> MutexGuard<'_, Shard<K>> {
    shard
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
