//! The first replenish (the bucket was never filled) racing with another replenish and a grab:
//! one fill to the limit, never two, and `head` never passes `tail + limit`.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{BucketConfig, ManualClock, Rate, SharedTokenBucket, Uncapped};

use super::common::{ahead, check_bounds, replenish_at};

#[test]
fn first_replenish_fills_once() {
    loom::model(|| {
        let cfg = BucketConfig::new(Rate::new(1, Duration::from_nanos(1)), 10);
        let b = Arc::new(
            SharedTokenBucket::<Uncapped, _>::with_clock(cfg, ManualClock::new()).unwrap(),
        );
        assert_eq!(b.last_replenish(), None);
        let spawn = |ns: u64| {
            let b = b.clone();
            thread::spawn(move || {
                let added = replenish_at(&*b, ns);
                check_bounds(&*b);
                added
            })
        };
        let (r5, r9) = (spawn(5), spawn(9));
        let tail = b.grab(4);
        check_bounds(&*b);
        let (a5, a9) = (r5.join().unwrap(), r9.join().unwrap());
        // Exactly one of them was the first replenish and filled up to the limit (10). The
        // other added nothing (its time was covered), or it claimed the 4 ns after the first
        // one's 5 and added what fitted: even while the first fill was still on its way (it
        // then adds only the rest of the limit, so the two never fill twice).
        let total = a5 + a9;
        assert!(total == 10 || (a5 == 10 && a9 == 4), "{a5} {a9}");
        assert!(a5 <= 10 && a9 <= 10);
        let s = b.snapshot();
        assert_eq!(s.head, total, "head moved by what was reported");
        assert!(ahead(s.head, s.tail.wrapping_add(10)) <= 0);
        assert_eq!(b.deficiency(tail), 0);
        let last = b.last_replenish().unwrap();
        assert!(last == Duration::from_nanos(5) || last == Duration::from_nanos(9));
    });
}
