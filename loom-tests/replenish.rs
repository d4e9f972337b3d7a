//! The lock-free replenish: replenishers claim intervals of time with one CAS on `last`, the
//! intervals telescope (no time lost or counted twice, nothing carried), a loser returns at
//! once, a winner stalled between its CAS and its `head` update holds back only its own
//! interval, and `head` never passes `tail + limit`.

use std::time::Duration;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use crate::{ManualClock, Rate, SharedTokenBucket, Uncapped};

use super::common::{at, check_bounds, replenish_at, restored};

/// 7 tokens per 3 ns: no replenish ends on a whole token, so the count must telescope.
fn seven_per_three() -> Rate {
    Rate::new(7, Duration::from_nanos(3))
}

/// `floor(7 × ns / 3)`: the tokens earned from the epoch (0 ns) to `ns`.
fn c(ns: u64) -> u64 {
    7 * ns / 3
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

/// Waits (yielding to loom's scheduler) until `flag` is set.
fn wait_for(flag: &AtomicBool) {
    // Acquire: pairs with the Release store that set the flag.
    while !flag.load(Ordering::Acquire) {
        thread::yield_now();
    }
}

#[test]
fn same_instant_exactly_one_wins() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 100, 1, 0, None));
        let (r1, r2) = (replenisher(&b, 10), replenisher(&b, 10));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        // C(10) = 23: one replenisher adds it all, the other nothing.
        assert!((a1, a2) == (23, 0) || (a1, a2) == (0, 23), "{a1} {a2}");
        assert_eq!(b.snapshot().head, at(23));
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(10)));
        // Counted from the epoch: C(13) − C(10) = 30 − 23 = 7 (7 × 3 / 3 alone would also be
        // 7, but the fraction of 10 ns, 1/3 token, is not lost).
        assert_eq!(replenish_at(&*b, 13), c(13) - c(10));
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
        let (r1, r2) = (replenisher(&b, 11), replenisher(&b, 16));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        // 11 first: C(11) = 25, then 16 adds C(16) − C(11) = 12. 16 first: C(16) = 37 and 11
        // adds nothing (its time is covered). Or one loses its CAS to the other.
        assert!(a1 == 0 || a1 == c(11), "{a1}");
        assert!([0, c(16), c(16) - c(11)].contains(&a2), "{a2}");
        // Whatever the order, a final replenish at 19 completes the count to C(19) = 44,
        // exactly: the intervals telescope.
        let a3 = replenish_at(&*b, 19);
        assert_eq!(a1 + a2 + a3, c(19), "{a1} + {a2} + {a3}");
        assert_eq!(b.snapshot().head, at(c(19)));
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(19)));
    });
}

#[test]
fn below_threshold_replenish_takes_nothing() {
    loom::model(|| {
        // 1 token per 10 ns, threshold 2. At 15 ns a replenish earns 1 token: below the
        // threshold, it does not touch `last`, so the replenish at 25 ns always succeeds (the
        // try-lock design could make it lose against the attempt at 15).
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(10)),
            100,
            2,
            0,
            None,
        ));
        let (r1, r2) = (replenisher(&b, 15), replenisher(&b, 25));
        let (a1, a2) = (r1.join().unwrap(), r2.join().unwrap());
        assert_eq!((a1, a2), (0, 2));
        assert_eq!(b.snapshot().head, at(2));
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(25)));
    });
}

#[test]
fn stalled_winner_delays_only_its_own_interval() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 100, 1, 0, None));
        // Release/Acquire flags: they order the two threads' steps, nothing else.
        let claimed = Arc::new(AtomicBool::new(false));
        let others_done = Arc::new(AtomicBool::new(false));
        let stalled = {
            let (b, claimed, others_done) = (b.clone(), claimed.clone(), others_done.clone());
            thread::spawn(move || {
                // Wins [0, 10) (nobody else claims before the flag), then stalls before its
                // `head` update until the other replenisher has finished.
                let extra = b.loom_claim_at(Duration::from_nanos(10));
                assert_eq!(extra, Some(c(10) as u128));
                claimed.store(true, Ordering::Release);
                wait_for(&others_done);
                let added = b.loom_fill(extra.unwrap());
                check_bounds(&*b);
                added
            })
        };
        let other = {
            let (b, claimed, others_done) = (b.clone(), claimed.clone(), others_done.clone());
            thread::spawn(move || {
                wait_for(&claimed);
                // The stalled winner holds no lock: this replenish claims [10, 20) and adds
                // its tokens at once.
                let added = replenish_at(&*b, 20);
                assert_eq!(added, c(20) - c(10));
                assert_eq!(b.snapshot().head, at(c(20) - c(10)));
                check_bounds(&*b);
                others_done.store(true, Ordering::Release);
                added
            })
        };
        let a2 = other.join().unwrap();
        let a1 = stalled.join().unwrap();
        // When the winner resumes, the total is exact: C(20), nothing lost or doubled.
        assert_eq!(a1 + a2, c(20));
        assert_eq!(b.snapshot().head, at(c(20)));
    });
}

#[test]
fn stalled_winner_with_a_racing_refund_and_grab_near_wrap() {
    loom::model(|| {
        // Rovers start a few tokens before u64::MAX; limit 30 with 20 in the bucket. A winner
        // claims [0, 10) (23 tokens) and stalls; meanwhile another thread grabs and refunds.
        // The bounds hold at every step and the winner adds only what fits when it resumes.
        let b = Arc::new(restored::<Uncapped>(seven_per_three(), 30, 1, 20, None));
        let stalled = {
            let b = b.clone();
            thread::spawn(move || {
                let extra = b.loom_claim_at(Duration::from_nanos(10)).unwrap();
                assert_eq!(extra, c(10) as u128);
                check_bounds(&*b);
                let added = b.loom_fill(extra);
                check_bounds(&*b);
                added
            })
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || {
                let tail = b.grab(15);
                check_bounds(&*b);
                let refunded = b.refund(5);
                check_bounds(&*b);
                (tail, refunded)
            })
        };
        let added = stalled.join().unwrap();
        let (tail, refunded) = other.join().unwrap();
        assert_eq!(tail, at(15));
        let s = b.snapshot();
        // Tokens are conserved: head moved by exactly what was reported.
        assert_eq!(s.head, at(20 + added + refunded));
        assert!(s.head.wrapping_sub(s.tail) as i64 <= 30);
        assert_eq!(b.deficiency(tail), 0);
    });
}
