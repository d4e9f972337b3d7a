//! The bucket's deferred give-back handshake (`SharedTokenBucket::give_back`): a cancelled
//! claim behind a waiter, a replenish that moves `head` past it, and the claim in front given
//! back too, racing. A give-back is never stranded behind a `head` that passed it, and never
//! refunded before `head` reaches it.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{Rate, Uncapped};

use super::common::{at, restored};

/// Claim A = `(START, START+2]` waits; claim B = `(START+2, START+4]` is cancelled while a
/// replenish brings `head` to `START+2` (B's start): B's tokens must come back, exactly once.
#[test]
fn deferred_give_back_vs_replenish_is_never_stranded() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            0,
            None,
        ));
        assert_eq!(b.grab(2), at(2)); // A, waiting
        assert_eq!(b.grab(2), at(4)); // B
        let canceller = {
            let b = b.clone();
            thread::spawn(move || {
                b.give_back(at(4), 2);
                // Never early: B's tokens are back only if head had reached B's start.
                let head = b.snapshot().head;
                assert!(head == at(0) || head == at(2) || head == at(4), "{head}");
            })
        };
        let mover = {
            let b = b.clone();
            thread::spawn(move || {
                b.replenish_at(Duration::from_nanos(2));
                b.settle_give_backs();
            })
        };
        canceller.join().unwrap();
        mover.join().unwrap();
        assert_eq!(b.deferred_give_backs(), 0, "a give-back was stranded");
        assert_eq!(b.snapshot().head, at(4), "2 replenished + B's 2 refunded");
    });
}

/// A (in front) and B (behind it) are both given back, by two threads (two throttles leaving a
/// shared bucket): whichever comes first, both end up refunded, exactly once, and B never
/// before A.
#[test]
fn give_backs_in_front_and_behind_are_never_stranded() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            0,
            None,
        ));
        assert_eq!(b.grab(2), at(2)); // A
        assert_eq!(b.grab(2), at(4)); // B
        let behind = {
            let b = b.clone();
            thread::spawn(move || {
                b.give_back(at(4), 2);
            })
        };
        b.give_back(at(2), 2);
        behind.join().unwrap();
        assert_eq!(b.deferred_give_backs(), 0, "a give-back was stranded");
        assert_eq!(b.snapshot().head, at(4), "A's 2 and B's 2 refunded once");
    });
}
