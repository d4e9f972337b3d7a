//! A watch on the machine itself: one thread per CPU sleeps [`PERIOD`] over and over and keeps
//! how late it woke. Readers that lag by about as much as the watch in the same slice were held
//! up by the machine (a virtual CPU the host did not run, say), not by the route they took:
//! the watch's threads do no I/O and use no dispatcher. Run only with `--stall-watch`: the
//! wake-ups preempt whatever runs on the CPU, the shards and the runtime's workers included.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long each watch thread sleeps between looks (200 short wake-ups a second per CPU).
pub(crate) const PERIOD: Duration = Duration::from_millis(5);

/// A slice whose watch woke at least this late is called stalled in the report.
pub(crate) const STALLED: Duration = Duration::from_millis(5);

/// The watch threads, stopped and joined on drop.
pub(crate) struct StallWatch {
    /// Per CPU: how late its thread woke at worst (ns past `PERIOD`) since the last
    /// [`StallWatch::take`].
    late: Arc<[AtomicU64]>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl StallWatch {
    /// A thread pinned to each CPU this process may use; none where they cannot be listed.
    pub(crate) fn start() -> Self {
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let late: Arc<[AtomicU64]> = cores.iter().map(|_| AtomicU64::new(0)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let threads = cores
            .into_iter()
            .enumerate()
            .filter_map(|(i, core)| {
                let (late, stop) = (late.clone(), stop.clone());
                std::thread::Builder::new()
                    .name(format!("stall-watch-{}", core.id))
                    .spawn(move || {
                        core_affinity::set_for_current(core);
                        let mut last = Instant::now();
                        // Relaxed: a flag read once a period; the join orders the rest.
                        while !stop.load(Ordering::Relaxed) {
                            std::thread::sleep(PERIOD);
                            let now = Instant::now();
                            note(&late, i, now.duration_since(last).saturating_sub(PERIOD));
                            last = now;
                        }
                    })
                    .ok()
            })
            .collect();
        StallWatch {
            late,
            stop,
            threads,
        }
    }

    /// A watch with a slot for each of `cpus` CPUs and no threads: what is noted by hand.
    #[cfg(test)]
    pub(crate) fn by_hand(cpus: usize) -> Self {
        StallWatch {
            late: (0..cpus).map(|_| AtomicU64::new(0)).collect(),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        }
    }

    /// Notes that the thread of CPU slot `i` woke `over` late.
    #[cfg(test)]
    pub(crate) fn note(&self, i: usize, over: Duration) {
        note(&self.late, i, over);
    }

    /// How many CPUs are watched.
    #[cfg(test)]
    pub(crate) fn cpus(&self) -> usize {
        self.late.len()
    }

    /// How late a watch thread woke at worst, on any CPU, since the last call (`None` without
    /// CPUs to watch).
    pub(crate) fn take(&self) -> Option<Duration> {
        self.late
            .iter()
            // Relaxed: see the watch thread.
            .map(|l| Duration::from_nanos(l.swap(0, Ordering::Relaxed)))
            .max()
    }
}

/// Keeps the worst lateness of CPU slot `i`.
fn note(late: &[AtomicU64], i: usize, over: Duration) {
    // Relaxed: a statistic, read whole by `take`'s swap.
    late[i].fetch_max(over.as_nanos() as u64, Ordering::Relaxed);
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        // Relaxed: see the watch thread.
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
