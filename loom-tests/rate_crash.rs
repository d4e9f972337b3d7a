//! A participant of a rate change that stops for ever (a process killed while it shares the
//! bucket through memory, modelled as a thread that returns mid-protocol): after every step
//! where it can stop (holding a ticket, after each word of its record, published but not
//! closed), another `set_rate` and a replenish still complete, and the tokens stay exact.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{Rate, Uncapped};

use super::common::{at, replenish_at, restored};

/// 7 per 3 ns.
fn old() -> Rate {
    Rate::new(7, Duration::from_nanos(3))
}

/// 5 per 2 ns.
fn new() -> Rate {
    Rate::new(5, Duration::from_nanos(2))
}

/// 11 per 13 ns: the rate the stopped participant was setting.
fn dead() -> Rate {
    Rate::new(11, Duration::from_nanos(13))
}

/// The steps a writer can stop at that leave its record unpublished (0: ticket; k: k words).
const UNPUBLISHED: [u32; 5] = [0, 1, 2, 11, 12];

/// Published but not closed.
const PUBLISHED: u32 = 13;

#[test]
fn a_writer_stopped_before_publishing_holds_back_no_rate_change() {
    for stop_at in UNPUBLISHED {
        loom::model(move || {
            let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
            let dead_writer = {
                let b = b.clone();
                thread::spawn(move || {
                    b.loom_set_rate_stopping_at(dead(), Duration::from_nanos(10), stop_at)
                })
            };
            let setter = {
                let b = b.clone();
                thread::spawn(move || b.loom_set_rate_at(new(), Duration::from_nanos(12)))
            };
            // A replenish racing both: it completes whatever the stopped writer left.
            let r = replenish_at(&*b, 20);
            assert_eq!(dead_writer.join().unwrap(), None, "stopped at {stop_at}");
            let s = setter.join().unwrap();
            // The stopped writer never published: only our change is in force.
            assert_eq!(b.rate(), new());
            let f = replenish_at(&*b, 30);
            // The change took effect at 12, or at 20 if the replenish counted [0, 20) at the
            // old rate first; either way each side at its own rate, nothing lost.
            let at_12 = 7 * 12 / 3 + 5 * (30 - 12) / 2;
            let at_20 = 7 * 20 / 3 + 5 * (30 - 20) / 2;
            // The stopped writer may have closed our change's interval for us before it
            // stopped (its tokens are in `head`, not in our return values): count `head`.
            let total = super::common::ahead(b.snapshot().head, at(0)) as u64;
            assert!(total == at_12 || total == at_20, "{s} + {r} + {f}: {total}");
            assert!(s + r + f <= total);
        });
    }
}

#[test]
fn a_writer_stopped_after_publishing_is_closed_by_the_next_change() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        let dead_writer = {
            let b = b.clone();
            thread::spawn(move || {
                b.loom_set_rate_stopping_at(dead(), Duration::from_nanos(10), PUBLISHED)
            })
        };
        let s = b.loom_set_rate_at(new(), Duration::from_nanos(12));
        assert_eq!(dead_writer.join().unwrap(), None);
        let f = replenish_at(&*b, 30);
        // As above: the stopped writer may have closed our interval for us.
        let total = super::common::ahead(b.snapshot().head, at(0)) as u64;
        assert!(s + f <= total);
        // Stopped writer first: [0, 10) old (closed by our change), [10, 12) at its rate,
        // then ours. Ours first: [0, 12) old, then its rate from 12 (it published last).
        let dead_first = 7 * 10 / 3 + 11 * 2 / 13 + 5 * (30 - 12) / 2;
        let ours_first = 7 * 12 / 3 + 11 * (30 - 12) / 13;
        if b.rate() == new() {
            assert_eq!(total, dead_first, "{s} + {f}: {total}");
        } else {
            assert_eq!(b.rate(), dead());
            assert_eq!(total, ours_first, "{s} + {f}: {total}");
        }
    });
}
