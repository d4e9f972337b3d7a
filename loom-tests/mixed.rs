//! Grab vs replenish vs refund: tokens are conserved (`head` moves by exactly what replenish and
//! refund report), `head` never passes `tail + limit`, and `deficiency` agrees with the rovers.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{Rate, Uncapped};

use super::common::{ahead, at, check_bounds, replenish_at, restored};

/// Runs grab(6) ‖ refund(3) ‖ replenish at 5 ns (1 token/ns) on a bucket holding 4 tokens;
/// returns (tail, refunded, replenished).
fn race(
    limit: u64,
) -> (
    u64,
    u64,
    u64,
    Arc<crate::SharedTokenBucket<Uncapped, crate::ManualClock>>,
) {
    let b = Arc::new(restored::<Uncapped>(
        Rate::new(1, Duration::from_nanos(1)),
        limit,
        1,
        4,
        None,
    ));
    let grabber = {
        let b = b.clone();
        thread::spawn(move || {
            let tail = b.grab(6);
            assert_eq!(tail, at(6));
            // head ≥ START + 4: at most 2 tokens owed, and fewer later, never more.
            let d1 = b.deficiency(tail);
            check_bounds(&*b);
            let d2 = b.deficiency(tail);
            assert!(d2 <= d1 && d1 <= 2, "{d1} then {d2}");
            tail
        })
    };
    let refunder = {
        let b = b.clone();
        thread::spawn(move || {
            let r = b.refund(3);
            check_bounds(&*b);
            r
        })
    };
    let replenished = replenish_at(&*b, 5);
    check_bounds(&*b);
    let tail = grabber.join().unwrap();
    let refunded = refunder.join().unwrap();
    (tail, refunded, replenished, b)
}

#[test]
fn roomy_bucket_adds_everything() {
    loom::model(|| {
        // limit 100: neither the refund (3) nor the replenish (5) can hit the cap.
        let (tail, refunded, replenished, b) = race(100);
        assert_eq!((refunded, replenished), (3, 5));
        let s = b.snapshot();
        assert_eq!(s.head, at(4 + 3 + 5));
        assert_eq!(s.tail, tail);
        assert_eq!(b.deficiency(tail), 0);
        assert_eq!(b.available(), 6);
    });
}

#[test]
fn tight_bucket_conserves_tokens() {
    loom::model(|| {
        // limit 10: room is 6 before the grab, 12 after; what fits depends on the order, but
        // head moves by exactly what was reported and never past tail + limit.
        let (tail, refunded, replenished, b) = race(10);
        assert!(refunded <= 3 && replenished <= 5);
        // Room is at least 6 at all times, so together they add at least 6.
        assert!(refunded + replenished >= 6, "{refunded} + {replenished}");
        let s = b.snapshot();
        assert_eq!(
            s.head,
            at(4 + refunded + replenished),
            "head moved by what was reported"
        );
        assert!(ahead(s.head, s.tail.wrapping_add(10)) <= 0);
        assert_eq!(b.deficiency(tail), ahead(tail, s.head).max(0) as u64);
        // The replenish's lost tokens (if any) were discarded, not banked: time is spent.
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(5)));
    });
}
