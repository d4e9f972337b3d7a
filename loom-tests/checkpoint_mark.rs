//! Strict checkpoint's mark/request protocol (`MarkCore`): two grabs race with one
//! checkpointer round (clear the request, read the tail, save, publish the mark). Afterwards,
//! either the published mark leaves more than the low-water line for the last tail, or a
//! request is pending and some grab woke the checkpointer: a reservation request is never lost.

use std::time::Duration;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

use crate::checkpoint::gate::MarkCore;
use crate::{Rate, Uncapped};

use super::common::{ahead, at, restored, START};

const RESERVE: u64 = 4;

#[test]
fn mark_request_vs_publish_vs_grab_never_loses_a_request() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            10,
            None,
        ));
        let core = Arc::new(MarkCore::new(START, RESERVE));
        // The first reservation: mark = START + 4.
        core.clear_request();
        assert!(core.publish(at(RESERVE)));
        let wakes = Arc::new(AtomicU64::new(0));
        let grabber = |n: u64| {
            let (b, core, wakes) = (b.clone(), core.clone(), wakes.clone());
            thread::spawn(move || {
                let tail = b.grab(n);
                if core.on_grab(tail).wake_checkpointer {
                    wakes.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let g1 = grabber(2);
        let g2 = grabber(1);
        // One checkpointer round.
        core.clear_request();
        let tail = b.snapshot().tail;
        let mark = tail.wrapping_add(RESERVE);
        let before = core.mark();
        core.publish(mark);
        assert!(ahead(core.mark(), before) >= 0, "the mark went back");
        g1.join().unwrap();
        g2.join().unwrap();
        let last = b.snapshot().tail;
        assert_eq!(last, at(3));
        if core.low(last) {
            assert!(core.is_requested(), "a low mark and no pending request");
            assert!(
                wakes.load(Ordering::SeqCst) >= 1,
                "nobody woke the checkpointer"
            );
        }
    });
}
