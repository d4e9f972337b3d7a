//! Two replenishers: one wins per instant, the winner adds what it computed (up to the room),
//! no time is lost or counted twice, and `head` never passes `tail + limit`.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use iothrottle::{ManualClock, Rate, SharedTokenBucket, Uncapped};

use crate::common::{at, check_bounds, replenish_at, restored};

/// 7 tokens per 3 ns: every replenish leaves a remainder to carry.
fn seven_per_three() -> Rate {
    Rate::new(7, Duration::from_nanos(3))
}

/// Spawns a thread that replenishes at `ns` and checks the bounds while the others run.
fn replenisher(
    b: &Arc<SharedTokenBucket<Uncapped, ManualClock>>,
    ns: u64,
) -> thread::JoinHandle<u64> {
    let b = b.clone();
    thread::spawn(move || {
        let added = replenish_at(&*b, ns);
        check_bounds(&*b);
        added
    })
}

#[test]
fn same_instant_exactly_one_wins() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 100, 1, 0, None));
        let (r1, r2) = (replenisher(&b, 10), replenisher(&b, 10));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        // floor(7 × 10 / 3) = 23: one replenisher adds it all, the other nothing.
        assert!((a1, a2) == (23, 0) || (a1, a2) == (0, 23), "{a1} {a2}");
        assert_eq!(b.snapshot().head, at(23));
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(10)));
        // The remainder (1 token-ns of 3) was carried: at 13 ns, floor(7 × 13 / 3) = 30 in all.
        assert_eq!(replenish_at(&*b, 13), 7);
    });
}

#[test]
fn same_instant_capped_by_the_limit() {
    loom::model(|| {
        // Room for 20 only: the winner computes 23 and adds 20; the rest is discarded.
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 20, 1, 0, None));
        let (r1, r2) = (replenisher(&b, 10), replenisher(&b, 10));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        assert!((a1, a2) == (20, 0) || (a1, a2) == (0, 20), "{a1} {a2}");
        assert_eq!(b.snapshot().head, at(20));
        assert_eq!(b.available(), 20);
    });
}

#[test]
fn different_instants_count_time_exactly_once() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 100, 1, 0, None));
        // At 11 ns: 25 tokens and 2 token-ns carried; 11 → 16 adds 35 + 2 = 37 token-ns: 12.
        let (r1, r2) = (replenisher(&b, 11), replenisher(&b, 16));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        assert!(a1 == 0 || a1 == 25, "{a1}");
        // Whatever the order (11 then 16, 16 alone, 11 alone when 16 lost the race), a final
        // replenish at 19 completes the count to floor(7 × 19 / 3) = 44, exactly: no time is
        // counted twice and no carried remainder is lost (which needs the remainder to pass
        // from one replenisher to the next).
        let a3 = replenish_at(&*b, 19);
        assert_eq!(a1 + a2 + a3, 44, "{a1} + {a2} + {a3}");
        assert_eq!(b.snapshot().head, at(44));
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(19)));
    });
}

#[test]
fn below_threshold_attempt_loses_no_time() {
    loom::model(|| {
        // 1 token per 10 ns, threshold 2. At 15 ns a replenish earns 1 whole token: enough to
        // try (1 + 1 ≥ 2), not enough to add, so it takes the right and gives it back. The
        // replenish at 25 ns may lose against it; a final one at 25 ns must then add 2.
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(10)),
            100,
            2,
            0,
            None,
        ));
        let (r1, r2) = (replenisher(&b, 15), replenisher(&b, 25));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        assert_eq!(a1, 0);
        assert!(a2 == 0 || a2 == 2, "{a2}");
        let a3 = replenish_at(&*b, 25);
        assert_eq!(a1 + a2 + a3, 2);
        assert_eq!(b.snapshot().head, at(2));
    });
}
