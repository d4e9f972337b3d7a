//! A fine-grained timer for the shards' short sleeps.
//!
//! tokio's timer has a resolution of 1 ms; a shard waiting for 70 µs of tokens would sleep a
//! whole millisecond. Sleeps shorter than [`FINE_BELOW`] go to this timer instead: one thread
//! per dispatcher that parks until the earliest shard deadline (`park_timeout`, a futex wait
//! with the kernel's ~50 µs timer slack) and wakes the shard through its `Notify`.
//!
//! # Orderings
//!
//! Each shard has one deadline word (nanoseconds since the timer's origin, 0 = none).
//! - The shard stores its deadline with **Release** and then unparks the timer thread; the
//!   timer thread loads deadlines with **Acquire**. No other data is published: the word is the
//!   whole message, and `unpark`/`park` order the wake-up itself (an unpark before the park
//!   makes the park return at once).
//! - The timer thread takes an expired deadline with a **AcqRel** compare-exchange to 0 (so a
//!   deadline the shard replaced meanwhile is not lost), then calls `notify_one`.
//! - The shard clears its deadline (**Release** store of 0) when it wakes for another reason;
//!   a notification that raced with that is stored as a `Notify` permit and only causes one
//!   early, harmless poll.
//! - `stop` is a flag: **Release** store by the dispatcher, **Acquire** load by the thread.

use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::sync::{Arc, AtomicU64, Ordering};

/// Sleeps shorter than this use the fine timer; longer ones tokio's.
pub(crate) const FINE_BELOW: Duration = Duration::from_millis(2);

/// What a shard shares with the timer thread.
#[derive(Debug)]
pub(crate) struct Alarm {
    deadline: AtomicU64,
    pub(crate) notify: Notify,
}

/// The timer: the shards' alarms and the thread that rings them.
#[derive(Debug)]
pub(crate) struct FineTimer {
    origin: Instant,
    alarms: Box<[Alarm]>,
    stop: AtomicU64,
}

/// The timer thread's handle, to wake it and join it.
#[derive(Debug)]
pub(crate) struct TimerThread {
    thread: Thread,
    join: Option<JoinHandle<()>>,
}

impl FineTimer {
    /// A timer for `shards` shards, and its running thread.
    pub(crate) fn start(shards: usize) -> std::io::Result<(Arc<FineTimer>, TimerThread)> {
        let timer = Arc::new(FineTimer {
            origin: Instant::now(),
            alarms: (0..shards)
                .map(|_| Alarm {
                    deadline: AtomicU64::new(0),
                    notify: Notify::new(),
                })
                .collect(),
            stop: AtomicU64::new(0),
        });
        let t = timer.clone();
        let join = std::thread::Builder::new()
            .name("iothrottle-timer".into())
            .spawn(move || t.run())?;
        Ok((
            timer,
            TimerThread {
                thread: join.thread().clone(),
                join: Some(join),
            },
        ))
    }

    pub(crate) fn alarm(&self, shard: usize) -> &Alarm {
        &self.alarms[shard]
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Arms `shard`'s alarm for `after` from now; the caller then unparks the timer thread.
    pub(crate) fn arm(&self, shard: usize, after: Duration) {
        let at = self.nanos(Instant::now() + after);
        // Release: see the module's `# Orderings`.
        self.alarms[shard].deadline.store(at, Ordering::Release);
    }

    /// Disarms `shard`'s alarm (it woke for another reason).
    pub(crate) fn disarm(&self, shard: usize) {
        // Release: see the module's `# Orderings`.
        self.alarms[shard].deadline.store(0, Ordering::Release);
    }

    fn run(&self) {
        // Acquire: see the module's `# Orderings`.
        while self.stop.load(Ordering::Acquire) == 0 {
            let now = self.nanos(Instant::now());
            let mut next: Option<u64> = None;
            for alarm in self.alarms.iter() {
                // Acquire: see the module's `# Orderings`.
                let d = alarm.deadline.load(Ordering::Acquire);
                if d == 0 {
                    continue;
                }
                if d <= now {
                    // AcqRel on success / Acquire on failure: see the module's `# Orderings`.
                    if alarm
                        .deadline
                        .compare_exchange(d, 0, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        alarm.notify.notify_one();
                    }
                } else {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
            }
            match next {
                Some(d) => std::thread::park_timeout(Duration::from_nanos(d - now)),
                None => std::thread::park(),
            }
        }
    }
}

impl TimerThread {
    /// The thread, to unpark it when a deadline changes.
    pub(crate) fn thread(&self) -> &Thread {
        &self.thread
    }

    /// Asks the thread to stop, without waiting.
    pub(crate) fn signal_stop(self, timer: &FineTimer) {
        // Release: see the module's `# Orderings`.
        timer.stop.store(1, Ordering::Release);
        self.thread.unpark();
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&mut self, timer: &FineTimer) {
        // Release: see the module's `# Orderings`.
        timer.stop.store(1, Ordering::Release);
        self.thread.unpark();
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
