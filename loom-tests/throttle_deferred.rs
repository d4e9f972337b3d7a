//! The throttle's deferred give-back handshake (`DeferredGiveBacks`): a cancelled claim
//! behind a waiter, a replenish that moves `head` past it, and a close, racing. A give-back is
//! never stranded behind a `head` that passed it, nor after a close, and never refunded before
//! `head` reaches it.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::throttle::DeferredGiveBacks;
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
        let d = Arc::new(DeferredGiveBacks::new());
        assert_eq!(b.grab(2), at(2)); // A, waiting
        assert_eq!(b.grab(2), at(4)); // B
        let canceller = {
            let (b, d) = (b.clone(), d.clone());
            thread::spawn(move || {
                d.give_back(&*b, at(2), 2);
                // Never early: B's tokens are back only if head had reached B's start.
                let head = b.snapshot().head;
                assert!(head == at(0) || head == at(2) || head == at(4), "{head}");
            })
        };
        let mover = {
            let (b, d) = (b.clone(), d.clone());
            thread::spawn(move || {
                b.replenish_at(Duration::from_nanos(2));
                d.after_head_moved(&*b);
            })
        };
        canceller.join().unwrap();
        mover.join().unwrap();
        assert_eq!(d.len(), 0, "a give-back was stranded");
        assert_eq!(b.snapshot().head, at(4), "2 replenished + B's 2 refunded");
    });
}

/// B is cancelled while the throttle closes: after both, nothing is deferred any more (a
/// closed throttle has nobody to wait for) and B's tokens are back exactly once.
#[test]
fn deferred_give_back_vs_close_is_never_stranded() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            0,
            None,
        ));
        let d = Arc::new(DeferredGiveBacks::new());
        b.grab(2); // A, waiting
        b.grab(2); // B
        let canceller = {
            let (b, d) = (b.clone(), d.clone());
            thread::spawn(move || {
                d.give_back(&*b, at(2), 2);
            })
        };
        d.close(&*b);
        canceller.join().unwrap();
        assert!(d.is_closed());
        assert_eq!(d.len(), 0, "a give-back was stranded after close");
        assert_eq!(b.snapshot().head, at(2), "B's 2 tokens refunded once");
    });
}
