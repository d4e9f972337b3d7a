//! One key's local state: its tokens (the loom-checked [`LocalTokens`] and [`RefillFlag`]),
//! the estimates the fast path reads, and the lease control kept under the key's mutex.
//!
//! # Orderings
//!
//! `last_used`, `low`, `trickle_until` and `dry_since` are `Relaxed`: they feed estimates
//! (idle eviction, when to refill, when to refuse at once), never a decision that other
//! memory depends on. The tokens and the refill flag document their own.

use std::time::Duration;

use crate::lease_core::{LocalTokens, RefillFlag};
use crate::sync::{AtomicU64, Ordering};

/// Lease control of one key; only touched under the key's lease mutex.
#[derive(Debug)]
pub(super) struct LeaseCtl {
    /// Estimated local consumption, tokens per second.
    pub(super) rate_est: f64,
    /// Tokens leased into this key's bucket so far (consumed = this - held).
    pub(super) leased_total: u64,
    /// When the estimate was last updated (when the last lease landed), and the tokens
    /// consumed then.
    pub(super) sampled_at: Duration,
    pub(super) consumed_then: u64,
    /// Trickling: no lease before this time.
    pub(super) not_before: Option<Duration>,
    /// The size of the last lease asked for.
    pub(super) last_ask: u64,
    /// Estimated time a lease takes (statement, batch wait, commit), on the limiter's clock.
    pub(super) latency_est: Duration,
}

#[derive(Debug)]
pub(super) struct KeyState {
    /// Local tokens: filled only by leases, never by time; closed (and emptied) when the key
    /// leaves the map, before anything else can lease for the key.
    pub(super) tokens: LocalTokens,
    /// Nanoseconds on the limiter's clock of the last call (updated at most every ms).
    pub(super) last_used: AtomicU64,
    /// Refill when fewer tokens than this are left: half the current lease size.
    pub(super) low: AtomicU64,
    /// Held while a background refill is spawned or running.
    pub(super) refilling: RefillFlag,
    /// Trickling: nanoseconds on the limiter's clock before which no lease will be asked
    /// for (0: not trickling). A copy of `LeaseCtl::not_before` that calls can read without
    /// the mutex, to refuse at once.
    pub(super) trickle_until: AtomicU64,
    /// Nanoseconds (+1, so that 0 means "no") on the limiter's clock since a caller found no
    /// local token and waits for a lease; cleared when a lease lands. Time spent dry is not
    /// consumption time: the consumption estimate leaves it out (a key whose lease is gone
    /// in a moment and then waits for the next wants far more than it got).
    pub(super) dry_since: AtomicU64,
    pub(super) ctl: tokio::sync::Mutex<LeaseCtl>,
}

impl KeyState {
    pub(super) fn new(now: Duration) -> KeyState {
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

    /// Records a use at `now`; writes at most once per millisecond so that a hot key's
    /// callers do not all write one cache line.
    pub(super) fn touch(&self, now: Duration) {
        let now = now.as_nanos() as u64;
        // Relaxed: an estimate for idle eviction.
        if now > self.last_used.load(Ordering::Relaxed) + 1_000_000 {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }

    /// Takes `n` local tokens or none; a failure moves nothing.
    pub(super) fn try_take(&self, n: u64) -> bool {
        let ok = self.tokens.try_take(n);
        #[cfg(test)]
        if !ok {
            tests::after_failed_take(self);
        }
        ok
    }

    /// Room for a lease: `max_lease − held`. Exact, as no failing take is ever counted in
    /// `held` (else a failing fast-path `try_take` could make a later refund vanish).
    pub(super) fn room(&self, max_lease: u64) -> u64 {
        max_lease.saturating_sub(self.tokens.held())
    }

    /// Whether a refill is due: open and below the low-water line.
    pub(super) fn low(&self) -> bool {
        // Relaxed: an estimate (see the field).
        !self.tokens.is_closed() && self.tokens.held() < self.low.load(Ordering::Relaxed)
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
