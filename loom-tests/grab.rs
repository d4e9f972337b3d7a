//! Two grabbers: each gets its own range of the tail, and the tail ends at the sum.

use loom::sync::Arc;
use loom::thread;

use crate::{Rate, Uncapped};

use super::common::{ahead, at, check_bounds, replenish_at, restored};

#[test]
fn two_grabbers_get_distinct_adjacent_ranges() {
    loom::model(|| {
        // 2 tokens in the bucket, no replenish: head stays at START + 2.
        let b = Arc::new(restored::<Uncapped>(Rate::per_second(1), 10, 1, 2, None));
        let head = at(2);
        let spawn = |n: u64| {
            let b = b.clone();
            thread::spawn(move || {
                let tail = b.grab(n);
                // deficiency is the wrapping distance to the (fixed) head.
                assert_eq!(b.deficiency(tail), ahead(tail, head).max(0) as u64);
                check_bounds(&*b);
                tail
            })
        };
        let (g3, g5) = (spawn(3), spawn(5));
        let (t3, t5) = (g3.join().unwrap(), g5.join().unwrap());
        // Either 3 went first ([START, START+3) then [START+3, START+8)) or 5 did.
        assert!(
            (t3 == at(3) && t5 == at(8)) || (t5 == at(5) && t3 == at(8)),
            "overlapping ranges: {t3} {t5}"
        );
        let s = b.snapshot();
        assert_eq!(s.tail, at(8));
        assert_eq!(s.head, head);
        assert_eq!(b.available(), 0);
        assert_eq!(b.deficiency(s.tail), 6);
    });
}

#[test]
fn grabbers_queue_while_replenished() {
    loom::model(|| {
        // Empty bucket, 1 token/ns, limit 4. Two grabbers of 3 queue up behind head; a
        // replenish at 4 ns pays the first in line and part of the second.
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, std::time::Duration::from_nanos(1)),
            4,
            1,
            0,
            None,
        ));
        let spawn = || {
            let b = b.clone();
            thread::spawn(move || {
                let tail = b.grab(3);
                let d1 = b.deficiency(tail);
                check_bounds(&*b);
                let d2 = b.deficiency(tail);
                // Owed tokens only go down, and never more than what is queued up to us.
                assert!(
                    d2 <= d1 && d1 <= ahead(tail, at(0)) as u64,
                    "{d1} then {d2}"
                );
                tail
            })
        };
        let (g1, g2) = (spawn(), spawn());
        let added = replenish_at(&*b, 4);
        check_bounds(&*b);
        let (t1, t2) = (g1.join().unwrap(), g2.join().unwrap());
        let (first, second) = if ahead(t1, t2) < 0 {
            (t1, t2)
        } else {
            (t2, t1)
        };
        assert_eq!((first, second), (at(3), at(6)));
        // The room was at least 4 (the limit) and at most 4 were earned.
        assert_eq!(added, 4);
        let head = b.snapshot().head;
        assert_eq!(head, at(4));
        // First in line is served first: FIFO by position.
        assert_eq!(b.deficiency(first), 0);
        assert_eq!(b.deficiency(second), 2);
        assert_eq!(b.available(), 0);
    });
}
