//! The type-erased task a shard carries for each request ([`Task`]), what ends it
//! ([`Completion`]: the tokens go back, the shard's in-flight count drops) and the counting of
//! the panics caught in user futures.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::Poll;
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::sync::{oneshot, Notify};

use crate::sync::Arc;
use crate::DispatchError;

use super::handle::IoHandle;
use super::queue::Payload;
use super::shard::ShardCore;
use super::state::Shared;

/// A request's future and where its result goes, with the types erased.
pub(crate) trait Task: Send {
    /// The handle was dropped: nobody waits for the result.
    fn is_cancelled(&self) -> bool;
    /// Ready once the handle was dropped; otherwise `cx` is woken when it is.
    fn poll_cancelled(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()>;
    /// The request will not run: the handle gets `err`.
    fn fail(self: Box<Self>, err: DispatchError);
    /// Starts the request on the current shard: a future runs as a task on its `LocalSet`; an
    /// operation the disk module submits itself goes on the shard's ring. `done` is dropped
    /// when the request ends (completes, panics, or is torn down with the runtime), which
    /// releases its tokens; not inside this call, which runs within the shard's dispatch (the
    /// one exception: a thread already destroying its thread-locals, where the disk module's
    /// table is gone and the operation's `done` drops at once).
    fn spawn_local(self: Box<Self>, done: Completion);
}

pub(crate) type BoxTask = Box<dyn Task>;

impl Payload for BoxTask {
    fn is_cancelled(&self) -> bool {
        (**self).is_cancelled()
    }

    fn poll_cancelled(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        (**self).poll_cancelled(cx)
    }
}

thread_local! {
    /// User futures whose `poll` or `drop` panicked on this thread and were caught, not yet
    /// added to their dispatcher's count (see [`take_panics`]).
    static PANICS: Cell<u64> = const { Cell::new(0) };
}

pub(crate) fn count_panic() {
    PANICS.with(|p| p.set(p.get() + 1));
}

/// The panics caught on this thread since the last call (a shard adds them to its
/// dispatcher's count after each step).
pub(crate) fn take_panics() -> u64 {
    PANICS.with(|p| p.replace(0))
}

pin_project! {
    /// A user future whose `Drop` may panic: dropping it (cancelled in a queue, failed at
    /// shutdown, torn down with the runtime, or after it completed) catches the panic and
    /// counts it, so that the shard thread survives.
    pub(crate) struct Guarded<F> {
        #[pin]
        fut: Option<F>,
    }

    impl<F> PinnedDrop for Guarded<F> {
        fn drop(this: Pin<&mut Self>) {
            let mut fut = this.project().fut;
            if catch_unwind(AssertUnwindSafe(|| fut.set(None))).is_err() {
                count_panic();
            }
        }
    }
}

impl<F> Guarded<F> {
    /// Guards `fut`.
    pub(crate) fn new(fut: F) -> Self {
        Guarded { fut: Some(fut) }
    }
}

/// A request's future, erased, with its result's destination inside.
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where a request's result goes: its [`IoHandle`] receives it.
pub(crate) type ResultTx<T> = oneshot::Sender<Result<T, DispatchError>>;

struct TaskImpl<F: Future> {
    fut: Guarded<F>,
    tx: ResultTx<F::Output>,
}

/// A handle and the sender of its result, for a [`Task`] that delivers the result itself.
pub(crate) fn channel<T>() -> (ResultTx<T>, IoHandle<T>) {
    let (tx, rx) = oneshot::channel();
    (tx, IoHandle::new(rx))
}

/// A task that runs `fut` on the shard and sends its output to `tx`.
pub(crate) fn boxed<F>(fut: F, tx: ResultTx<F::Output>) -> BoxTask
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let fut = Guarded { fut: Some(fut) };
    Box::new(TaskImpl { fut, tx })
}

/// A task for `fut` and the handle to its result.
pub(crate) fn task<F>(fut: F) -> (BoxTask, IoHandle<F::Output>)
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, handle) = channel();
    (boxed(fut, tx), handle)
}

impl<F> Task for TaskImpl<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    fn poll_cancelled(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        self.tx.poll_closed(cx)
    }

    fn fail(self: Box<Self>, err: DispatchError) {
        let _ = self.tx.send(Err(err));
    }

    fn spawn_local(self: Box<Self>, done: Completion) {
        let TaskImpl { fut, tx } = *self;
        tokio::task::spawn_local(async move {
            let _done = done;
            let out = run_guarded(fut)
                .await
                .map_err(|message| DispatchError::Panicked { message });
            _done.count_panics();
            let _ = tx.send(out);
        });
    }
}

/// Runs a guarded future to its end and drops it, catching a panic in its `poll` or its `drop`
/// (each counted, see [`count_panic`]): its output, or the panic's message (prefixed
/// `in drop: ` for a panic in `drop` after it completed).
pub(crate) async fn run_guarded<F: Future>(fut: Guarded<F>) -> Result<F::Output, String> {
    let mut guarded = std::pin::pin!(fut);
    let mut out = std::future::poll_fn(|cx| {
        let Some(fut) = guarded.as_mut().project().fut.as_pin_mut() else {
            return Poll::Ready(Err("(polled after it ended)".to_owned()));
        };
        match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => {
                count_panic();
                Poll::Ready(Err(panic_message(&*panic)))
            }
        }
    })
    .await;
    // Drop the future before answering, so a panic in its `Drop` reaches the handle.
    let mut slot = guarded.as_mut().project().fut;
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| slot.set(None))) {
        count_panic();
        if out.is_ok() {
            out = Err(format!("in drop: {}", panic_message(&*panic)));
        }
    }
    out
}

/// A panic's message, when it carried a string.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(not a string)".to_owned()
    }
}

/// Futures running on a shard, and the shared state their completions release tokens to (kept
/// here so that a completion clones one `Rc`, not an `Arc`: no atomic per request).
pub(crate) struct InFlight {
    pub(crate) count: Cell<usize>,
    pub(crate) idle: Notify,
    pub(crate) shared: Arc<Shared>,
    /// The shard's core, to record completions in its stats (gone once the shard stopped).
    pub(crate) core: Weak<RefCell<ShardCore<BoxTask>>>,
    /// Counts the shard's activity (a message received, a request dispatched or ended): an
    /// idle shard polls until [`Shared::idle_poll`] after it last saw the count move.
    pub(crate) activity: Activity,
    /// Wakes a parked shard loop for a request one of its tasks dispatched itself
    /// ([`Completion::start_here`]): the loop then polls, as after a request it dispatched.
    pub(crate) kick: Notify,
}

/// A count of a shard's activity, for its idle poll. A count, not a time: recording activity
/// costs no clock read (a shard would otherwise read the clock several times per request);
/// the idle poll reads the clock once per round anyway and dates a change of the count to the
/// round that sees it, at most one round (a few microseconds) late.
#[derive(Debug, Default)]
pub(crate) struct Activity(Cell<u64>);

impl Activity {
    /// Records activity.
    pub(crate) fn touch(&self) {
        self.0.set(self.0.get().wrapping_add(1));
    }

    pub(crate) fn count(&self) -> u64 {
        self.0.get()
    }
}

impl InFlight {
    /// Records activity, for the idle poll.
    pub(crate) fn touch(&self) {
        self.activity.touch();
    }

    /// One more future running on the shard (a request dispatched, or a future sent to run
    /// there): the shard's end waits for it.
    pub(crate) fn enter(&self) {
        self.touch();
        self.count.set(self.count.get() + 1);
    }

    /// A future counted by [`enter`](Self::enter) ended; the last one wakes a shard waiting to
    /// end.
    pub(crate) fn leave(&self) {
        self.touch();
        let n = self.count.get() - 1;
        self.count.set(n);
        if n == 0 {
            self.idle.notify_one();
        }
    }
}

/// Held by a running request: when dropped (the future ended, or was torn down), its tokens are
/// released (capped mode) and the shard's in-flight count drops.
pub(crate) struct Completion {
    pub(crate) cost: u64,
    pub(crate) class: usize,
    /// When the request was submitted and dispatched, on the dispatcher's clock.
    pub(crate) times: (Duration, Duration),
    pub(crate) inflight: Rc<InFlight>,
}

impl Completion {
    /// A request of `class` (`cost` tokens, `bytes` bytes) that a task on the shard of
    /// `inflight` dispatched itself at `now`, its tokens already taken
    /// ([`Dispatcher::try_fast_here`](super::Dispatcher::try_fast_here)): recorded in the
    /// shard's stats as dispatched with no queue wait, and counted among the shard's running
    /// requests until the returned value is dropped, as a request the loop dispatched is.
    pub(crate) fn start_here(
        inflight: Rc<InFlight>,
        class: usize,
        (cost, bytes): (u64, u64),
        now: Duration,
    ) -> Completion {
        if let Some(core) = inflight.core.upgrade() {
            // Called from a shard's task, never inside the loop's own borrow; should one ever
            // overlap, the sample is skipped rather than panicking.
            if let Ok(mut core) = core.try_borrow_mut() {
                core.dispatched_here(class, bytes, cost);
            }
        }
        super::fast::metrics_at_once(&inflight.shared, class, (cost, bytes));
        inflight.enter();
        // A parked loop would not poll for the completion; one that runs takes the permit on
        // its next park and comes round once.
        inflight.kick.notify_one();
        Completion {
            cost,
            class,
            times: (now, now),
            inflight,
        }
    }

    /// Adds the panics caught on this shard so far to the dispatcher's count (before a
    /// result reaches its handle, so the count is up to date for whoever awaits it).
    pub(crate) fn count_panics(&self) {
        add_panics(&self.inflight.shared);
    }
}

/// Moves this thread's caught panics into the dispatcher's count.
pub(crate) fn add_panics(shared: &Shared) {
    let n = take_panics();
    if n > 0 {
        // Relaxed: a statistic.
        shared.panics.fetch_add(n, crate::sync::Ordering::Relaxed);
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let shared = &self.inflight.shared;
        if let Some(lc) = shared.classes.latency() {
            // Latency-target mode samples the end-to-end latency (submission → completion).
            let latency = shared.clock.now().saturating_sub(self.times.0);
            lc.record(self.class, latency);
        }
        shared.budget.release(self.cost);
        let bounded = shared.classes.finish(self.class, self.cost);
        if shared.budget.is_capped() || bounded {
            // Capacity came back (the bucket's, or the class's in-flight bound): wake the
            // shards that wait for it (every shard shares both).
            for n in &shared.released {
                n.notify_one();
            }
        }
        #[cfg(feature = "metrics")]
        crate::metrics::class_completed(
            shared.classes.get(self.class).config.name(),
            shared.clock.now().saturating_sub(self.times.1),
        );
        if let Some(core) = self.inflight.core.upgrade() {
            // Completions run in the shard's tasks, never inside the loop's own borrow; should
            // one ever overlap, the sample is skipped rather than panicking.
            if let Ok(mut core) = core.try_borrow_mut() {
                let now = self.inflight.shared.clock.now();
                core.completed(self.class, self.cost, self.times, now);
            }
        }
        self.inflight.leave();
    }
}
