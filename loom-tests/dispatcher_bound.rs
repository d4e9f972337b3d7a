//! A class's in-flight bound (`dispatcher::bound::InFlightBound`), shared by two shards.

use loom::sync::Arc;
use loom::thread;

use crate::dispatcher::bound::InFlightBound;

/// Two shards start a 60-token request each under a 100-token bound, from nothing in flight:
/// exactly one goes (the first always may; the second would make 120), whatever the
/// interleaving, and finishing it leaves nothing counted.
#[test]
fn two_shards_cannot_both_pass_the_bound() {
    loom::model(|| {
        let b = Arc::new(InFlightBound::new(100));
        let other = {
            let b = b.clone();
            thread::spawn(move || b.try_start(60))
        };
        let mine = b.try_start(60);
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs, "mine {mine}, theirs {theirs}");
        assert_eq!(b.in_flight(), 60);
        b.finish(60);
        assert_eq!(b.in_flight(), 0);
    });
}

/// A completion racing a start: the start goes either way (40 + 50 or 0 + 50 fit), and neither
/// update is lost: 50 stays counted.
#[test]
fn a_completion_racing_a_start_loses_no_update() {
    loom::model(|| {
        let b = Arc::new(InFlightBound::new(100));
        assert!(b.try_start(40));
        let done = {
            let b = b.clone();
            thread::spawn(move || b.finish(40))
        };
        assert!(b.try_start(50));
        done.join().unwrap();
        assert_eq!(b.in_flight(), 50);
    });
}
