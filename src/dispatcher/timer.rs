//! A fine-grained timer for the shards' short sleeps.
//!
//! tokio's timer has a resolution of 1 ms; a shard waiting for 70 µs of tokens would sleep a
//! whole millisecond. Sleeps shorter than [`FINE_BELOW`] wake on the shard's own timerfd
//! (`shard_timer`, Linux) or, where there is none, on this timer: one thread per dispatcher
//! that parks until the earliest shard deadline (`park_timeout`, a futex wait with the
//! kernel's ~50 µs timer slack) and wakes the shard through its `Notify`.
//!
//! The deadline protocol itself (arming, ringing, stopping, and its orderings) is the
//! loom-checked core [`Alarms`].

use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::alarm::Alarms;
use crate::sync::Arc;

/// Sleeps shorter than this use the fine timer; longer ones tokio's.
pub(crate) const FINE_BELOW: Duration = Duration::from_millis(2);

/// The timer: the shards' deadlines, how each shard is woken, and the thread that rings them.
#[derive(Debug)]
pub(crate) struct FineTimer {
    origin: Instant,
    alarms: Alarms,
    notify: Box<[Notify]>,
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
            alarms: Alarms::new(shards),
            notify: (0..shards).map(|_| Notify::new()).collect(),
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

    /// What wakes `shard` when its alarm rings.
    pub(crate) fn notify(&self, shard: usize) -> &Notify {
        &self.notify[shard]
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Arms `shard`'s alarm for `after` from now and wakes the timer thread.
    pub(crate) fn arm(&self, shard: usize, after: Duration, timer: &Thread) {
        self.alarms
            .arm(shard, self.nanos(Instant::now() + after), timer);
    }

    /// Disarms `shard`'s alarm (it woke for another reason).
    pub(crate) fn disarm(&self, shard: usize) {
        self.alarms.disarm(shard);
    }

    fn run(&self) {
        while !self.alarms.stopped() {
            let now = self.nanos(Instant::now());
            match self.alarms.scan(now, |s| self.notify[s].notify_one()) {
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
        timer.alarms.stop(&self.thread);
    }

    /// Stops the thread and waits for it.
    pub(crate) fn stop(&mut self, timer: &FineTimer) {
        timer.alarms.stop(&self.thread);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
