//! Rate changes: `set_rate` vs replenish (the replenish uses the old or the new rate, never a
//! mix), and the two-slot seqlock of the rate (no torn rate for a reader, against one writer or
//! two).

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use iothrottle::{Rate, Uncapped};

use crate::common::{at, check_bounds, replenish_at, restored};

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

#[test]
fn set_rate_vs_replenish_uses_old_or_new() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        let setter = {
            let b = b.clone();
            thread::spawn(move || {
                b.set_rate(new()).unwrap();
                // A writer sees its own rate (there is no other writer).
                assert_eq!(b.rate(), new());
            })
        };
        let replenisher = {
            let b = b.clone();
            thread::spawn(move || {
                let added = replenish_at(&*b, 10);
                check_bounds(&*b);
                added
            })
        };
        let seen = b.rate();
        assert!(seen == old() || seen == new(), "torn rate {seen:?}");
        setter.join().unwrap();
        let added = replenisher.join().unwrap();
        // 10 ns at 7/3 is 23 (remainder 1 of 3); at 5/2 it is 25 exactly. A torn rate would
        // give 35 (7/2) or 16 (5/3).
        assert!(added == 23 || added == 25, "{added}");
        assert_eq!(b.rate(), new());
        // 3 more ns at the new rate: 7 (7.5 rounded down). The old rate's remainder is dropped
        // (documented), and the new rate's zero remainder adds nothing either.
        assert_eq!(replenish_at(&*b, 13), 7);
        assert_eq!(b.snapshot().head, at(added + 7));
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
