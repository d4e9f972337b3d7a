//! The bucket's deferred give-backs: claims given back before `head` reached them.
//!
//! # Orderings
//!
//! - `len` (the number of deferred give-backs): a give-back stores it (**SeqCst**), issues a
//!   **SeqCst fence** and then reads `head`; whoever moves `head` (a refund, or a replenish
//!   followed by [`SharedTokenBucket::settle_give_backs`]) issues a **SeqCst fence** and then
//!   loads `len`. This is the store-buffer (Dekker) pattern: with the two fences, at least one
//!   side sees the other's write, so a deferred give-back is never stranded behind a `head` that
//!   already passed it. The list itself is behind a mutex (cancellation is the rare path).
//!   Loom-modelled in `loom-tests/throttle_deferred.rs`.

use std::collections::BTreeMap;
use std::fmt;

use super::{Mode, SharedTokenBucket};
use crate::clock::Clock;
use crate::sync::{fence, AtomicU64, Mutex, Ordering};

/// The deferred give-backs of one bucket, whoever made the claims (every throttle, blocking
/// throttle or other user of the bucket shares them).
///
/// Refunding a claim at once while claims in front of it are still waiting would serve those
/// claims early; it is refunded when `head` reaches its start, exactly as if it had never been
/// made. The list belongs to the bucket, not to whoever made the claim: a claim given back by one
/// throttle is applied when `head` gets there, whichever user moves it, and stays correct when
/// that throttle is closed or dropped (the claims in front of it may be another user's).
///
/// # Invariants
///
/// - `len` equals the number of entries (changed only under the lock).
/// - Entries are keyed by `start - base` (wrapping); `base` is a `head` value read under the
///   lock when the map was empty, so `base ≤ head` from then on and every entry's start is at
///   or after `base`: keys order starts correctly across the wrap of the rovers (for 2^63
///   tokens after `base`). A give-back whose start is behind `base` is already reached and is
///   refunded at once.
/// - An entry is refunded only when `head` has reached its start; starts are distinct, so the
///   smallest key is the first due.
pub(crate) struct GiveBacks {
    inner: Mutex<Inner>,
    /// The number of entries, readable without the lock.
    len: AtomicU64,
}

struct Inner {
    base: u64,
    /// `start - base` → tokens.
    map: BTreeMap<u64, u64>,
}

impl GiveBacks {
    /// No give-backs.
    pub(crate) fn new() -> Self {
        GiveBacks {
            inner: Mutex::new(Inner {
                base: 0,
                map: BTreeMap::new(),
            }),
            len: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the map inconsistent with `len` (each
        // change of one is followed by the other's before any call that can panic).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Entries waiting.
    pub(crate) fn len(&self) -> u64 {
        // Relaxed: a snapshot for display.
        self.len.load(Ordering::Relaxed)
    }

    /// Gives back the claim `(start, start + tokens]` of `bucket`, never served: refunded now
    /// if `head` has reached `start`, otherwise when it gets there. Returns whether anything
    /// was refunded now.
    pub(crate) fn give_back<M: Mode, C: Clock>(
        &self,
        bucket: &SharedTokenBucket<M, C>,
        start: u64,
        tokens: u64,
    ) -> bool {
        if tokens == 0 {
            return false;
        }
        if bucket.deficiency(start) == 0 {
            bucket.rovers.refund(tokens);
            self.after_head_moved(bucket);
            return true;
        }
        {
            let mut inner = self.lock();
            if inner.map.is_empty() {
                inner.base = bucket.snapshot().head;
            }
            let off = start.wrapping_sub(inner.base);
            if (off as i64) < 0 {
                // Behind `base`, which `head` has passed: reached already.
                drop(inner);
                bucket.rovers.refund(tokens);
                self.after_head_moved(bucket);
                return true;
            }
            *inner.map.entry(off).or_insert(0) += tokens;
            // SeqCst: the store of the store-buffer pattern (see the module doc).
            self.len.store(inner.map.len() as u64, Ordering::SeqCst);
        }
        // SeqCst fence, then read head (in `drain`): head may have passed `start` while we
        // inserted, and its mover may have missed our entry.
        fence(Ordering::SeqCst);
        self.drain(bucket)
    }

    /// To be called after `head` moved: refunds the entries it reached. Returns whether it did.
    pub(crate) fn after_head_moved<M: Mode, C: Clock>(
        &self,
        bucket: &SharedTokenBucket<M, C>,
    ) -> bool {
        // SeqCst fence: the store-buffer pattern with `give_back` (see the module doc).
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence above.
        self.len.load(Ordering::Relaxed) != 0 && self.drain(bucket)
    }

    /// Refunds every entry that `head` has reached, smallest start first: a refund moves
    /// `head`, which may reach the next one. Returns whether anything was refunded.
    fn drain<M: Mode, C: Clock>(&self, bucket: &SharedTokenBucket<M, C>) -> bool {
        let mut inner = self.lock();
        let mut refunded = false;
        while let Some((&off, _)) = inner.map.first_key_value() {
            let start = inner.base.wrapping_add(off);
            if bucket.deficiency(start) != 0 {
                break;
            }
            let tokens = inner.map.remove(&off).unwrap_or(0);
            // SeqCst: as the store in `give_back` (the count only changes under the lock).
            self.len.store(inner.map.len() as u64, Ordering::SeqCst);
            bucket.rovers.refund(tokens);
            refunded = true;
        }
        refunded
    }
}

impl fmt::Debug for GiveBacks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GiveBacks")
            .field("len", &self.len())
            .finish()
    }
}
