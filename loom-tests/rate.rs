//! Rate changes: `set_rate` racing replenishes (the time before the change is counted at the
//! old rate and the time after it at the new one; the change takes effect at a clock reading
//! inside the racing calls), and the lock-free cell of the regime (no torn rate for a
//! reader, against one writer or two).

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{Rate, Uncapped};

use super::common::{at, check_bounds, replenish_at, restored};

/// 7 per 3 ns.
fn old() -> Rate {
    Rate::new(7, Duration::from_nanos(3))
}

/// 5 per 2 ns: tokens and period both differ from `old`, so a torn read (7 per 2, 5 per 3)
/// would show.
fn new() -> Rate {
    Rate::new(5, Duration::from_nanos(2))
}

/// 11 per 13 ns.
fn other() -> Rate {
    Rate::new(11, Duration::from_nanos(13))
}

/// Tokens of the old rate from 0 to `ns`.
fn c_old(ns: u64) -> u64 {
    7 * ns / 3
}

/// Tokens of the new rate from its epoch (10 ns in these models) to `ns`.
fn c_new(ns: u64) -> u64 {
    5 * (ns - 10) / 2
}

/// What a final count at `end` must be if the change took effect at `c` (≥ 10).
fn total(c: u64, end: u64) -> u64 {
    c_old(c) + c_new(end) - c_new(c)
}

#[test]
fn set_rate_vs_replenish_prices_each_side_at_its_rate() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        let setter = {
            let b = b.clone();
            thread::spawn(move || {
                let added = b.loom_set_rate_at(new(), Duration::from_nanos(10));
                // A writer sees its own rate (there is no other writer).
                assert_eq!(b.rate(), new());
                check_bounds(&*b);
                added
            })
        };
        let replenisher = {
            let b = b.clone();
            thread::spawn(move || {
                let added = replenish_at(&*b, 16);
                check_bounds(&*b);
                added
            })
        };
        let seen = b.rate();
        assert!(seen == old() || seen == new(), "torn rate {seen:?}");
        let s = setter.join().unwrap();
        let r = replenisher.join().unwrap();
        // The change closed [0, 10) at the old rate (23) and the replenish priced [10, 16) at
        // the new one (15); or the replenish came first and counted [0, 16) at the old rate
        // (37) or, seeing the published change, [0, 10) old + [10, 16) new (38); or it lost
        // its CAS to the change (0).
        let ok = [
            (c_old(10), c_new(16)),
            (c_old(10), 0),
            (0, c_old(16)),
            (0, c_old(10) + c_new(16)),
        ];
        assert!(ok.contains(&(s, r)), "set_rate added {s}, replenish {r}");
        assert_eq!(b.rate(), new());
        // A final count at 19: the change took effect at 10, or at the replenish's 16 when it
        // counted its whole interval at the old rate. Nothing is re-priced beyond that.
        let f = replenish_at(&*b, 19);
        let change_at = if r == c_old(16) { 16 } else { 10 };
        assert_eq!(s + r + f, total(change_at, 19), "{s} + {r} + {f}");
        assert_eq!(b.snapshot().head, at(s + r + f));
    });
}

#[test]
fn regime_passes_from_replenisher_to_replenisher() {
    loom::model(|| {
        // set_rate at 10 ‖ replenish at 16 ‖ replenish at 20. A replenish that read the new
        // regime and claimed up to 16 must hand it on: the one that then claims [16, 20) must
        // price it at the new rate (c_new(20) − c_new(16) = 10), never at the old (9).
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        let r16 = {
            let b = b.clone();
            thread::spawn(move || replenish_at(&*b, 16))
        };
        let r20 = {
            let b = b.clone();
            thread::spawn(move || replenish_at(&*b, 20))
        };
        let s = b.loom_set_rate_at(new(), Duration::from_nanos(10));
        let (a16, a20) = (r16.join().unwrap(), r20.join().unwrap());
        let saw_new_16 = a16 == c_new(16) || a16 == c_old(10) + c_new(16);
        if saw_new_16 {
            assert!(a20 == 0 || a20 == c_new(20) - c_new(16), "{a16} then {a20}");
        }
        let f = replenish_at(&*b, 23);
        let sum = s + a16 + a20 + f;
        // The change took effect at 10, 16 or 20 (a replenish that counted its whole interval
        // at the old rate moves it to its own reading), never elsewhere.
        assert!(
            [10, 16, 20].iter().any(|&c| sum == total(c, 23)),
            "{s} + {a16} + {a20} + {f} = {sum}"
        );
        check_bounds(&*b);
    });
}

#[test]
fn rate_reader_vs_writer_never_torn() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 10, 1, 0, None));
        // Two rate changes in a row: the second one rewrites the slot readers used first, which
        // is where a reader could tear (one change alone never touches the slot being read).
        let writer = {
            let b = b.clone();
            thread::spawn(move || {
                b.set_rate(new()).unwrap();
                b.set_rate(other()).unwrap();
            })
        };
        let order = |r: Rate| [old(), new(), other()].iter().position(|x| *x == r);
        let first = b.rate();
        let second = b.rate();
        let (Some(i), Some(j)) = (order(first), order(second)) else {
            panic!("torn rate: {first:?} then {second:?}");
        };
        // Rates are seen in the order they were set, never going back.
        assert!(i <= j, "{first:?} then {second:?}");
        writer.join().unwrap();
        assert_eq!(b.rate(), other());
    });
}

#[test]
fn rate_two_writers_never_torn() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 10, 1, 0, None));
        let w1 = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(new()).unwrap())
        };
        let w2 = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(other()).unwrap())
        };
        let seen = b.rate();
        assert!(
            seen == old() || seen == new() || seen == other(),
            "torn rate {seen:?}"
        );
        w1.join().unwrap();
        w2.join().unwrap();
        let last = b.rate();
        assert!(last == new() || last == other(), "torn rate {last:?}");
    });
}

#[test]
fn set_rate_closes_a_stalled_set_rate_for_it() {
    loom::model(|| {
        // set_rate(new) at 10 ‖ { set_rate(other) at 20; replenish at 30 }. If the first
        // change stalls after publishing its regime, the second must close it (the regime keeps
        // one old rate only), or every later replenish would wait for the stalled writer.
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        let second = {
            let b = b.clone();
            thread::spawn(move || {
                let s = b.loom_set_rate_at(other(), Duration::from_nanos(20));
                let r = replenish_at(&*b, 30);
                // [20, 30) is priced at `other` (8), or at `new` if the first change came after
                // the second (it then starts at 20: 25). Never 0: nothing waits for the first
                // writer.
                assert!(r == 8 || r == 25, "replenish at 30 added {r}");
                check_bounds(&*b);
                s + r
            })
        };
        let first = b.loom_set_rate_at(new(), Duration::from_nanos(10));
        let total = first + second.join().unwrap() + replenish_at(&*b, 40);
        // In order: old [0, 10) 23, new [10, 20) 25, other [20, 40) 16 = 64. The first change
        // last: old [0, 20) 46, then other [20, 30) 8 and new [30, 40) 25 = 79, or new
        // [20, 40) 50 = 96.
        assert!([64, 79, 96].contains(&total), "{total}");
    });
}
