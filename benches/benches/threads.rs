//! Two threads timed from a common start, for the groups' `2t` cases.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Runs the closure `setup(t)` returns on thread `t` of two, after a common start; with `pin`,
/// each thread is pinned to a core of its own where the machine has two. `setup` runs on the
/// calling thread, before either thread starts, so that only the returned closure is timed.
/// Returns the slower thread's time: one thread's time per operation when divided by the
/// operations each ran.
pub(crate) fn two_threads<S, R>(pin: bool, setup: S) -> Duration
where
    S: Fn(usize) -> R,
    R: FnOnce() + Send + 'static,
{
    let cores = if pin {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let run = setup(t);
            let barrier = Arc::clone(&barrier);
            let core = (cores.len() >= 2).then(|| cores[t]);
            std::thread::spawn(move || {
                if let Some(core) = core {
                    // Pinning is best-effort: unpinned threads still measure the sharing.
                    let _ = core_affinity::set_for_current(core);
                }
                barrier.wait();
                let start = Instant::now();
                run();
                start.elapsed()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("bench thread panicked"))
        .max()
        .unwrap_or_default()
}
