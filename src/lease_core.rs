//! The atomic core of leased mode ([`PgLeasedLimiter`](crate::pg::PgLeasedLimiter)): a key's
//! local tokens and its refill flag, with no tokio and no database, so that the loom model
//! `loom-tests/leased.rs` (compiled inside the crate under `cfg(all(test, iothrottle_loom))`)
//! checks the code that leased mode runs. Crate-private.
//!
//! # Local tokens ([`LocalTokens`])
//!
//! One word: bit 63 is "closed" (the key was evicted or shut down), the low bits count the
//! tokens held. Invariants:
//!
//! - a take never moves the word unless it succeeds (a compare-and-swap from `held ≥ n` to
//!   `held − n`), so a failing take leaves no transient claim behind for a concurrent lease to
//!   misread;
//! - only one lease deposits at a time (the caller's lease mutex) and it asks for at most
//!   `max − held()`; takes only lower `held`, so `held ≤ max` at every moment;
//! - once closed, no take succeeds: [`close`](LocalTokens::close) removes the tokens that were
//!   there, and a deposit that lands after the close removes its own, so every token is given
//!   back by exactly one party and none is ever granted from a closed key.
//!
//! Every operation is `Relaxed`: the word is one location, whose modification order alone
//! decides every outcome (the tokens guard no other memory).
//!
//! # The refill flag ([`RefillFlag`])
//!
//! At most one refiller per key at a time, and no lost wake-up: a take that leaves the key
//! low and finds the flag held is covered by the holder, which re-checks after letting go.

use crate::sync::{AtomicU64, Ordering};

const CLOSED: u64 = 1 << 63;

/// A key's local tokens (see the [module docs](self)).
#[derive(Debug, Default)]
pub(crate) struct LocalTokens(AtomicU64);

impl LocalTokens {
    /// No tokens, open.
    pub(crate) fn new() -> Self {
        LocalTokens(AtomicU64::new(0))
    }

    /// Takes `n` tokens if they are all there (and the key is open): all or nothing, and
    /// nothing moves when it fails.
    #[inline]
    pub(crate) fn try_take(&self, n: u64) -> bool {
        // Relaxed: the count is one location; its modification order decides (module doc).
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            if cur & CLOSED != 0 || cur < n {
                return false;
            }
            // Relaxed on both sides: as above; a failure retries from the fresh value.
            match self
                .0
                .compare_exchange_weak(cur, cur - n, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Tokens held now (0 once closed and emptied). A snapshot.
    #[inline]
    pub(crate) fn held(&self) -> u64 {
        // Relaxed: a snapshot of one location.
        self.0.load(Ordering::Relaxed) & !CLOSED
    }

    /// Whether [`close`](Self::close) ran.
    pub(crate) fn is_closed(&self) -> bool {
        // Relaxed: a snapshot; a stale "open" only sends the caller to a take that fails.
        self.0.load(Ordering::Relaxed) & CLOSED != 0
    }

    /// Adds `n` leased tokens. `Err(n)`: the key was closed first; the tokens were not kept
    /// and the caller must give them back. Only one deposit at a time (the lease mutex), and
    /// `n ≤ max − held()` read under it.
    pub(crate) fn deposit(&self, n: u64) -> Result<(), u64> {
        // Relaxed: one location (module doc).
        let before = self.0.fetch_add(n, Ordering::Relaxed);
        if before & CLOSED == 0 {
            return Ok(());
        }
        // Closed first: no take can succeed on a closed word, so these n are still there;
        // remove exactly them (close removed only what preceded it).
        // Relaxed: as above.
        self.0.fetch_sub(n, Ordering::Relaxed);
        Err(n)
    }

    /// Closes the key and takes every token it held; returns how many (0 if already closed).
    /// After it, no take succeeds.
    pub(crate) fn close(&self) -> u64 {
        // Relaxed: one location (module doc).
        let before = self.0.fetch_or(CLOSED, Ordering::Relaxed);
        if before & CLOSED != 0 {
            return 0;
        }
        let n = before & !CLOSED;
        if n > 0 {
            // Takes fail once closed, so the n are still there; a later deposit removes its own.
            // Relaxed: as above.
            self.0.fetch_sub(n, Ordering::Relaxed);
        }
        n
    }
}

/// "A refill of this key is spawned or running" (see the [module docs](self)).
///
/// A taker that leaves the key low calls [`claim`](Self::claim); the winner refills, then
/// calls [`release`](Self::release) with a fresh "still low?" check, and refills again while
/// it returns `true`.
#[derive(Debug, Default)]
pub(crate) struct RefillFlag(AtomicU64);

impl RefillFlag {
    /// Not held.
    pub(crate) fn new() -> Self {
        RefillFlag(AtomicU64::new(0))
    }

    /// Tries to become the key's refiller; `false`: a refiller is running and will see this
    /// caller's take when it lets go.
    #[inline]
    pub(crate) fn claim(&self) -> bool {
        // Release: a loser's take (sequenced before) must be visible to the holder's re-check
        // after its `release` reads this write; the winner needs no Acquire (the lease
        // itself is ordered by the key's mutex).
        self.0.swap(1, Ordering::Release) == 0
    }

    /// Lets go of the flag, then re-checks with `still_low`: `true` when the caller holds
    /// the flag again and must refill again (a take left the key low while it held it).
    pub(crate) fn release(&self, still_low: impl Fn() -> bool) -> bool {
        // Acquire: reads the last claim's write (an RMW), so every take that lost the flag
        // before this point happens-before the re-check below.
        self.0.swap(0, Ordering::Acquire);
        still_low() && self.claim()
    }

    /// Whether a refiller holds the flag (a snapshot, for tests).
    #[cfg(test)]
    pub(crate) fn is_held(&self) -> bool {
        // Relaxed: a snapshot.
        self.0.load(Ordering::Relaxed) == 1
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_conserved_through_close_and_late_deposit() {
        let t = LocalTokens::new();
        assert!(t.deposit(10).is_ok());
        assert!(!t.try_take(11));
        assert_eq!(t.held(), 10);
        assert!(t.try_take(4));
        assert_eq!(t.close(), 6);
        assert_eq!(t.close(), 0);
        assert!(t.is_closed());
        assert!(!t.try_take(1));
        assert_eq!(t.deposit(5), Err(5));
        assert_eq!(t.held(), 0);
    }

    #[test]
    fn the_flag_is_exclusive_and_rechecks() {
        let f = RefillFlag::new();
        assert!(f.claim());
        assert!(!f.claim());
        assert!(f.is_held());
        assert!(f.release(|| true)); // still low: held again
        assert!(!f.release(|| false));
        assert!(!f.is_held());
    }
}
