//! The fine timer's deadline protocol, [`Alarms`]: one deadline word per shard, armed by the
//! shard and rung by the timer thread. It uses only `crate::sync` (atomics and the thread
//! handle), so the loom build compiles it and `loom-tests/dispatcher_timer.rs` checks it; the
//! timer thread around it is in [`timer`](super::timer).
//!
//! # Orderings
//!
//! Each shard has one deadline word (nanoseconds since the timer's origin, 0 = none).
//! - [`arm`](Alarms::arm) stores (swaps in) the deadline with **Release** and *then* unparks the timer
//!   thread; the timer thread loads deadlines with **Acquire** in [`scan`](Alarms::scan) and
//!   parks only after a scan. An unpark that comes before the park makes the park return at
//!   once, and one that comes after the scan's load wakes the parked thread: either way the
//!   timer scans again after the store and sees the deadline. (Store after unpark would lose
//!   the wake-up: the timer could scan, see nothing, and park for ever.)
//! - The timer takes an expired deadline with an **AcqRel** compare-exchange to 0, so a
//!   deadline the shard replaced meanwhile (a new `arm`) is kept, not erased.
//! - A shard clears its deadline (**Release** store of 0) when it wakes for another reason; a
//!   ring that raced with that only causes one early, harmless poll.
//! - `stop` is a flag: **Release** store then unpark, **Acquire** load by the thread.

use crate::sync::thread::Thread;
use crate::sync::{AtomicU64, Ordering};

/// The shards' deadline words and the timer's stop flag.
#[derive(Debug)]
pub(crate) struct Alarms {
    deadlines: Box<[AtomicU64]>,
    stop: AtomicU64,
}

impl Alarms {
    /// Alarms for `shards` shards, none armed.
    pub(crate) fn new(shards: usize) -> Self {
        Alarms {
            deadlines: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            stop: AtomicU64::new(0),
        }
    }

    /// Arms `shard`'s alarm for `at` (nanoseconds since the timer's origin, at least 1) and
    /// wakes the timer thread to take it into account.
    pub(crate) fn arm(&self, shard: usize, at: u64, timer: &Thread) {
        // Release: see the module's `# Orderings` (before the unpark). A swap rather than a
        // store: loom orders a plain store after a concurrent compare-exchange that read the
        // value before it (a modelling limit it reports as a lost re-arm); a swap is an RMW
        // and totally ordered with the timer's. Once per short sleep, not per request.
        self.deadlines[shard].swap(at.max(1), Ordering::Release);
        timer.unpark();
    }

    /// Disarms `shard`'s alarm (it woke for another reason).
    pub(crate) fn disarm(&self, shard: usize) {
        // Release: see the module's `# Orderings`; a swap for the reason given in `arm`.
        self.deadlines[shard].swap(0, Ordering::Release);
    }

    /// `shard`'s deadline, 0 when none.
    #[cfg(test)]
    pub(crate) fn deadline(&self, shard: usize) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.deadlines[shard].load(Ordering::Acquire)
    }

    /// One pass of the timer thread at `now`: takes every deadline at or before `now` and
    /// calls `ring` with its shard; returns the earliest deadline still pending. The caller
    /// then parks (until that deadline, or until an `arm` unparks it).
    pub(crate) fn scan(&self, now: u64, mut ring: impl FnMut(usize)) -> Option<u64> {
        let mut next: Option<u64> = None;
        for (shard, word) in self.deadlines.iter().enumerate() {
            // Acquire: see the module's `# Orderings`.
            let d = word.load(Ordering::Acquire);
            if d == 0 {
                continue;
            }
            if d <= now {
                // AcqRel on success / Acquire on failure: see the module's `# Orderings`.
                if word
                    .compare_exchange(d, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    ring(shard);
                }
            } else {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        next
    }

    /// Asks the timer thread to stop, and wakes it.
    pub(crate) fn stop(&self, timer: &Thread) {
        // Release: see the module's `# Orderings`.
        self.stop.store(1, Ordering::Release);
        timer.unpark();
    }

    /// `true` once [`stop`](Self::stop) was called.
    pub(crate) fn stopped(&self) -> bool {
        // Acquire: see the module's `# Orderings`.
        self.stop.load(Ordering::Acquire) != 0
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;

    #[test]
    fn scan_rings_expired_alarms_once_and_reports_the_next() {
        let a = Alarms::new(3);
        let me = std::thread::current();
        a.arm(0, 5, &me);
        a.arm(1, 50, &me);
        a.arm(2, 7, &me);
        let mut rung = Vec::new();
        assert_eq!(a.scan(10, |s| rung.push(s)), Some(50));
        assert_eq!(rung, vec![0, 2]);
        assert_eq!((a.deadline(0), a.deadline(1)), (0, 50));
        assert_eq!(a.scan(10, |s| rung.push(s)), Some(50));
        assert_eq!(rung.len(), 2);
        a.disarm(1);
        assert_eq!(a.scan(100, |s| rung.push(s)), None);
        assert!(!a.stopped());
        a.stop(&me);
        assert!(a.stopped());
    }
}
