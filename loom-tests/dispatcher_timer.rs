//! The dispatcher's fine timer (`dispatcher::alarm::Alarms`): a shard arms a deadline and
//! unparks the timer thread, which scans and parks. At most three threads.

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

use crate::dispatcher::alarm::Alarms;

/// The timer thread's loop, as the real one runs it, with the clock at `now`: scan, and park
/// until unparked when nothing rang. Returns how many alarms it rang.
fn timer_loop(alarms: &Alarms, now: u64, rung: &AtomicU64) {
    while !alarms.stopped() {
        alarms.scan(now, |_| {
            rung.fetch_add(1, Ordering::Relaxed);
        });
        if rung.load(Ordering::Relaxed) > 0 {
            return;
        }
        thread::park();
    }
}

/// No lost wake-up: a shard that arms an (already expired) deadline while the timer thread is
/// between a scan and its park is rung. With the store after the unpark, the timer could scan,
/// see nothing, use up the unpark and park for ever (loom reports the deadlock).
#[test]
fn an_armed_alarm_is_rung() {
    loom::model(|| {
        let alarms = Arc::new(Alarms::new(2));
        let rung = Arc::new(AtomicU64::new(0));
        let timer = {
            let (alarms, rung) = (alarms.clone(), rung.clone());
            thread::spawn(move || timer_loop(&alarms, 10, &rung))
        };
        alarms.arm(1, 5, timer.thread());
        timer.join().unwrap();
        assert_eq!(rung.load(Ordering::Relaxed), 1);
        assert_eq!(alarms.deadline(1), 0, "a rung alarm is taken");
    });
}

/// A shard re-arms (a later deadline) while the timer takes its expired one: the new deadline
/// is never erased by the timer (it takes a deadline with a compare-exchange, not a store).
#[test]
fn a_rearmed_alarm_is_kept() {
    loom::model(|| {
        let alarms = Arc::new(Alarms::new(1));
        let me = thread::current();
        alarms.arm(0, 5, &me);
        let timer = {
            let alarms = alarms.clone();
            thread::spawn(move || {
                let mut rung = 0;
                let next = alarms.scan(10, |_| rung += 1);
                (rung, next)
            })
        };
        alarms.arm(0, 20, &me);
        let (rung, next) = timer.join().unwrap();
        assert_eq!(alarms.deadline(0), 20, "rung {rung}, next {next:?}");
        // Rang the old deadline, saw the new one pending, or lost the take to the re-arm
        // (then the re-arm's unpark makes it scan again).
        assert!(
            [(1, None), (0, Some(20)), (0, None)].contains(&(rung, next)),
            "{rung} {next:?}"
        );
    });
}

/// Stopping wakes a parked timer thread.
#[test]
fn stop_wakes_the_timer() {
    loom::model(|| {
        let alarms = Arc::new(Alarms::new(1));
        let rung = Arc::new(AtomicU64::new(0));
        let timer = {
            let (alarms, rung) = (alarms.clone(), rung.clone());
            thread::spawn(move || timer_loop(&alarms, 10, &rung))
        };
        alarms.stop(timer.thread());
        timer.join().unwrap();
        assert_eq!(rung.load(Ordering::Relaxed), 0);
    });
}
