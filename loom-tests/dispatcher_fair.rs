//! The dispatcher's cross-shard fairness counters (`dispatcher::fair::Fairness`), each model
//! with the main thread and at most two more. Window and idle credit are 10 tokens; classes
//! have 1 share (10 tokens = 10,000 virtual units).

use loom::sync::Arc;
use loom::thread;

use crate::dispatcher::fair::{Fairness, SCALE};

fn fair(classes: &[(u32, bool)]) -> Arc<Fairness> {
    Arc::new(Fairness::new(classes, 2, 10, 10))
}

fn ahead(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

/// A class waking on one shard (its virtual time lifted to the busy class's minus the idle
/// credit) while another shard charges it: neither the charge nor the lift is lost, and the
/// tier's front stays at or above every virtual time.
#[test]
fn a_charge_is_not_lost_to_a_concurrent_lift() {
    loom::model(|| {
        let f = fair(&[(1, false), (1, false)]);
        // Class 0 is busy (V = 10^6); class 1 was idle 2 tokens below the lift target.
        f.activate(0, 0);
        f.charge(0, 0, 1000);
        f.charge(1, 1, 988);
        let lift = f.vtime(0) - 10 * SCALE;
        assert_eq!(f.vtime(1) + 2 * SCALE, lift);
        let charger = {
            let f = f.clone();
            thread::spawn(move || f.charge(1, 1, 5))
        };
        f.activate(1, 0);
        charger.join().unwrap();
        let v = f.vtime(1);
        // Charge then lift: the charge is already past the target; lift then charge: both.
        assert!(
            v == lift + 3 * SCALE || v == lift + 5 * SCALE,
            "{v} (lift {lift})"
        );
        assert!(ahead(f.front(0), v) >= 0, "front behind a class");
        assert_eq!(f.backlogged(1), 1);
        f.deactivate(0, 0);
        f.deactivate(1, 0);
    });
}

/// Two shards charge two classes at once: the front ends at the larger virtual time (a plain
/// store of the front could keep the smaller).
#[test]
fn the_front_is_the_largest_virtual_time() {
    loom::model(|| {
        let f = fair(&[(1, false), (1, false)]);
        let spawn = |class: usize, tokens: u64| {
            let f = f.clone();
            thread::spawn(move || f.charge(class, class, tokens))
        };
        let (a, b) = (spawn(0, 7), spawn(1, 3));
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(f.vtime(0), 7 * SCALE);
        assert_eq!(f.vtime(1), 3 * SCALE);
        assert_eq!(f.front(0), 7 * SCALE);
    });
}

/// Backlog counting: two shards activate and deactivate one class at once while the main
/// thread asks whether the other class may reserve. The count ends at 0, and the answer is
/// one that some interleaving gives.
#[test]
fn backlog_counts_return_to_zero() {
    loom::model(|| {
        // Class 0 has 1 share, class 1 1,000: class 1 (1,000 units ahead, window 10 units)
        // may reserve only while class 0 does not compete.
        let f = fair(&[(1, false), (1000, false)]);
        f.charge(1, 1, 1000);
        let spawn = |shard: usize| {
            let f = f.clone();
            thread::spawn(move || {
                f.activate(0, shard);
                f.deactivate(0, shard);
            })
        };
        let (a, b) = (spawn(0), spawn(1));
        let answer = f.may_reserve(1, 1);
        a.join().unwrap();
        b.join().unwrap();
        assert_eq!(f.backlogged(0), 0);
        assert_eq!(f.may_reserve(1, 1), Ok(()));
        // While class 0 competed, class 1 had to wait for it: 990 units at 1 share, 1 token.
        if let Err(e) = answer {
            assert_eq!(e.tokens, 1);
        }
    });
}

/// A charge that moves the front across a renormalisation step lifts the long-idle class
/// while another shard charges that class: the idle class ends at least `2^61` behind the
/// front, never more (the wrap-safety invariant), and its charge counts when it came after
/// the lift.
#[test]
fn renormalisation_lifts_an_idle_class_under_a_concurrent_charge() {
    loom::model(|| {
        let f = fair(&[(1, false), (1, false)]);
        // About 2^59 virtual units per charge at 1 share (488 less). Seven charges of class 0
        // and a small one (~3.5 × 2^60) cross the step at 3 × 2^60, which lifts class 1 to
        // 2^61 behind the front.
        let big = (1u64 << 59) / SCALE;
        for _ in 0..7 {
            f.charge(0, 0, big);
        }
        f.charge(0, 0, 1000);
        assert_eq!(f.vtime(1), f.front(0) - 1000 * SCALE - (1 << 61));
        let crossing = {
            let f = f.clone();
            // To ~4.5 × 2^60: across the step at 4 × 2^60, lifting class 1 again.
            thread::spawn(move || f.charge(0, 0, big))
        };
        f.charge(1, 1, 2);
        crossing.join().unwrap();
        let (front, v) = (f.front(0), f.vtime(1));
        let floor = front - (1 << 61);
        assert!(v == floor || v == floor + 2 * SCALE, "{v} vs floor {floor}");
        assert!((0..1 << 62).contains(&ahead(front, v)));
    });
}

/// A high-priority class keeps a normal one out while it competes on another shard.
#[test]
fn a_competing_high_class_holds_back_normal_ones() {
    loom::model(|| {
        let f = fair(&[(1, false), (1, true)]);
        f.activate(0, 0);
        let high = {
            let f = f.clone();
            thread::spawn(move || {
                f.activate(1, 1);
                f.charge(1, 1, 10);
                f.deactivate(1, 1);
            })
        };
        let answer = f.may_reserve(0, 0);
        high.join().unwrap();
        // Either before or after the high class competed; never a wrong amount.
        assert!(
            answer.is_ok() || answer.unwrap_err().tokens == 10,
            "{answer:?}"
        );
        assert_eq!(f.may_reserve(0, 0), Ok(()));
        f.deactivate(0, 0);
    });
}
