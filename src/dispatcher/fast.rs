//! Dispatch from the caller's thread: a request submitted from outside the shards that can go
//! at once ([`Shared::try_fast`]) is not sent to a shard; its future runs inside its
//! [`IoHandle`], on the thread that awaits it, so no shard thread has to wake for it. See
//! `docs/dispatcher.md`, "No hop when none is needed".

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::sync::Arc;
use crate::DispatchError;

use super::handle::IoHandle;
use super::runner::Msg;
use super::state::Shared;
use super::task::{self, add_panics, BoxFuture, Guarded};

/// Held by a request dispatched on its caller's thread: when dropped (its future ended, or was
/// torn down, or its operation completed on the caller's ring), its tokens are released as a
/// shard's request's are, and its completion is recorded in the stats of the shard it was
/// dispatched for.
pub(crate) struct FastDone {
    shared: Arc<Shared>,
    shard: usize,
    class: usize,
    cost: u64,
    /// When it was submitted (and dispatched: the same instant), on the dispatcher's clock.
    at: Duration,
}

impl FastDone {
    /// A request that [`Shared::try_fast`] let go at `now` for `shard`: its dispatch is recorded
    /// (a queue wait of zero; for the metrics it entered and left its queue at once).
    pub(crate) fn start(
        shared: &Arc<Shared>,
        shard: usize,
        class: usize,
        (cost, bytes): (u64, u64),
        now: Duration,
    ) -> Self {
        shared
            .fast_recorder(shard, class)
            .dispatched(bytes, cost, Duration::ZERO);
        metrics_at_once(shared, class, (cost, bytes));
        FastDone {
            shared: shared.clone(),
            shard,
            class,
            cost,
            at: now,
        }
    }
}

/// The metrics of a request of `class` dispatched at once, without a shard's queue: it entered
/// its queue and left it in the same instant.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn metrics_at_once(shared: &Shared, class: usize, (cost, bytes): (u64, u64)) {
    #[cfg(feature = "metrics")]
    {
        let name = shared.classes.get(class).config.name();
        crate::metrics::class_queued(name);
        crate::metrics::class_dispatched(name, bytes, cost, Duration::ZERO);
    }
}

impl Drop for FastDone {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.budget.release(self.cost);
        let bounded = shared.classes.finish(self.class, self.cost);
        if shared.budget.is_capped() || bounded {
            for n in &shared.released {
                n.notify_one();
            }
        }
        let now = shared.clock.now();
        let took = now.saturating_sub(self.at);
        shared
            .fast_recorder(self.shard, self.class)
            .completed(self.cost, took, took);
        #[cfg(feature = "metrics")]
        crate::metrics::class_completed(shared.classes.get(self.class).config.name(), took);
    }
}

/// The handle of a request that [`Shared::try_fast`] let go at `now`: `fut` runs when the
/// handle is polled; should the handle be dropped before the future ended, the future is sent
/// to `shard`'s thread (`tx`) and runs to its end there, as a dispatched request does.
#[allow(clippy::too_many_arguments)] // one call site, each argument a different fact
pub(crate) fn dispatch<F>(
    shared: &Arc<Shared>,
    tx: &UnboundedSender<Msg>,
    shard: usize,
    class: usize,
    (cost, bytes): (u64, u64),
    now: Duration,
    fut: F,
) -> IoHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let done = FastDone::start(shared, shard, class, (cost, bytes), now);
    let (result, rx) = oneshot::channel();
    let guarded = Guarded::new(fut);
    let run: BoxFuture = Box::pin(async move {
        let done = done;
        let out = task::run_guarded(guarded)
            .await
            .map_err(|message| DispatchError::Panicked { message });
        add_panics(&done.shared);
        // The result first, then the tokens back (the order a shard's request ends in).
        let _ = result.send(out);
        drop(done);
    });
    let tx = tx.clone();
    let adopt = Box::new(move |run: BoxFuture| {
        // A shard that stopped drops it: its `FastDone` releases the tokens.
        let _ = tx.send(Msg::Run(run));
    });
    IoHandle::inline(rx, run, adopt)
}
