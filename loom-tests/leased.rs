//! Leased mode's atomic core (`crate::lease_core`): a key's local tokens and its refill
//! flag, as `pg::leased` uses them.
//!
//! - `refill_flag_*`: one refiller at a time, and a take that leaves the key low while the
//!   flag is held is never forgotten (the holder re-checks after letting go).
//! - `tokens_*`: a failing take, a lease's deposit and an eviction's close race; every token
//!   is taken, given back by the close, or given back by the late deposit, exactly once, and
//!   nothing is taken from a closed key.

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

use crate::lease_core::{LocalTokens, RefillFlag};

const LOW: u64 = 2;
const MAX: u64 = 4;

struct Key {
    tokens: LocalTokens,
    flag: RefillFlag,
    /// Refillers inside their lease right now (must never exceed 1).
    inside: AtomicU64,
}

/// The refill loop of `refill_in_background`, for a caller that holds the flag: lease the
/// room while low, let go, and go again while the re-check says so.
fn refill(k: &Key) {
    loop {
        // SeqCst: test bookkeeping only.
        assert_eq!(k.inside.fetch_add(1, Ordering::SeqCst), 0, "two refillers");
        if k.tokens.held() < LOW {
            let room = MAX - k.tokens.held();
            k.tokens.deposit(room).unwrap();
        }
        k.inside.fetch_sub(1, Ordering::SeqCst);
        if !k.flag.release(|| k.tokens.held() < LOW) {
            break;
        }
    }
}

/// The fast path: take one token; if that left the key low, become the refiller or leave it
/// to the one running.
fn take_one(k: &Key) {
    if k.tokens.try_take(1) && k.tokens.held() < LOW && k.flag.claim() {
        refill(k);
    }
}

/// Three tokens, low-water 2. The main thread is a refiller already running (it holds the
/// flag, spawned by an earlier take); two callers take one token each. Whatever the
/// interleaving, only one refills at a time, and afterwards the key is not left low.
#[test]
fn refill_flag_is_exclusive_and_never_loses_a_wake_up() {
    loom::model(|| {
        let k = Arc::new(Key {
            tokens: LocalTokens::new(),
            flag: RefillFlag::new(),
            inside: AtomicU64::new(0),
        });
        k.tokens.deposit(3).unwrap();
        assert!(k.flag.claim());
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let k = k.clone();
                thread::spawn(move || take_one(&k))
            })
            .collect();
        refill(&k);
        for c in callers {
            c.join().unwrap();
        }
        assert!(!k.flag.is_held(), "the flag was left held");
        assert!(
            k.tokens.held() >= LOW,
            "a take left the key low and nobody refilled: {} held",
            k.tokens.held()
        );
        assert!(k.tokens.held() <= MAX, "held more than max_lease");
    });
}

/// Three tokens held, a take of 5 (fails unless the lease landed first), a lease of the room
/// up to 10, and an eviction's close, all racing. Tokens are conserved: what was held or
/// leased is taken, returned by the close, or returned by the late deposit, exactly once;
/// the closed key keeps nothing and nothing is taken from it.
#[test]
fn tokens_failing_take_vs_lease_vs_close_are_conserved() {
    loom::model(|| {
        let t = Arc::new(LocalTokens::new());
        t.deposit(3).unwrap();
        let taker = {
            let t = t.clone();
            thread::spawn(move || if t.try_take(5) { 5 } else { 0 })
        };
        let lease = {
            let t = t.clone();
            thread::spawn(move || {
                let room = 10 - t.held();
                let back = match t.deposit(room) {
                    Ok(()) => 0,
                    Err(back) => back,
                };
                (room, back)
            })
        };
        let closed = t.close();
        let taken = taker.join().unwrap();
        let (leased, back) = lease.join().unwrap();
        assert!(t.is_closed());
        assert_eq!(t.held(), 0, "tokens stranded in a closed key");
        assert!(!t.try_take(1), "a take succeeded on a closed key");
        assert_eq!(
            3 + leased,
            taken + closed + back,
            "a token was lost or created"
        );
    });
}
