//! The engine's own tasks on the shards: [`Dispatcher::spawn_on`](super::Dispatcher::spawn_on),
//! [`Dispatcher::spawn`](super::Dispatcher::spawn), and, for code already running on a shard,
//! [`current_shard`] and its [`ShardHandle`].
//!
//! A spawned task runs on the shard's `LocalSet`, beside the requests the shard dispatches: its
//! future may be `!Send` (it never leaves the thread), it is not charged tokens, a panic in it
//! is caught and counted in [`Dispatcher::panics`](super::Dispatcher::panics), and I/O it
//! submits goes to its own shard's queue.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context, Poll};

use slab::Slab;
use tokio::sync::mpsc::WeakUnboundedSender;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::sync::{Arc, Ordering};
use crate::{JoinError, SpawnError, SubmitError};

use super::class::ClassId;
use super::cost::IoRequest;
use super::handle::IoHandle;
use super::queue::Entry;
use super::runner::Msg;
use super::state::Shared;
use super::task::{self, add_panics, count_panic, panic_message, Guarded, InFlight};

/// The output of a spawned task: a future resolving to the task's output, or why there is
/// none. Dropping it detaches the task (it keeps running), as with tokio's `JoinHandle`.
#[must_use = "dropping the handle detaches the task; await it for its output"]
pub struct ShardJoinHandle<T> {
    rx: oneshot::Receiver<Result<T, JoinError>>,
}

impl<T> fmt::Debug for ShardJoinHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardJoinHandle").finish_non_exhaustive()
    }
}

impl<T> Future for ShardJoinHandle<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(out)) => Poll::Ready(out),
            // Dropped unanswered: the task (or the closure making it) was dropped.
            Poll::Ready(Err(_)) => Poll::Ready(Err(JoinError::Cancelled)),
            Poll::Pending => Poll::Pending,
        }
    }
}

type JoinTx<T> = oneshot::Sender<Result<T, JoinError>>;

/// What reaches a shard to start a task: run on the shard's thread, it makes the future and
/// spawns it there (dropped unrun, its handle resolves to [`JoinError::Cancelled`]).
pub(crate) type SpawnJob = Box<dyn FnOnce() + Send>;

/// Counts a shard's live spawned tasks ([`Shared::spawned`]) from the spawn until the task
/// ends or is dropped unstarted, for [`Dispatcher::spawn`](super::Dispatcher::spawn)'s choice.
pub(crate) struct Live {
    shared: Arc<Shared>,
    shard: usize,
}

impl Live {
    pub(crate) fn new(shared: Arc<Shared>, shard: usize) -> Self {
        // Relaxed: a load figure for choosing a shard; nothing is published with it.
        shared.spawned[shard].fetch_add(1, Ordering::Relaxed);
        // Relaxed: a statistic.
        shared.tasks_spawned[shard].fetch_add(1, Ordering::Relaxed);
        Live { shared, shard }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        // Relaxed: see `new`.
        self.shared.spawned[self.shard].fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a shard thread knows about itself: set when it starts, for [`current_shard`].
pub(crate) struct ShardContext {
    /// The dispatcher's identity (its shared state's address).
    id: usize,
    index: usize,
    shared: Arc<Shared>,
    /// The shard's own channel (weak: the shard must see it close when the dispatcher goes).
    tx: WeakUnboundedSender<Msg>,
    /// The spawned tasks still running, to cancel them at shutdown.
    tasks: RefCell<Slab<AbortHandle>>,
    /// Shutdown started: the spawned tasks were cancelled and no new one starts.
    closing: Cell<bool>,
    /// The shard's running requests, once its loop has started: a request its own tasks
    /// dispatch at once ([`inflight_here`]) is counted there as the loop's are.
    inflight: RefCell<Option<Rc<InFlight>>>,
}

thread_local! {
    /// On a shard thread: its context.
    static CONTEXT: RefCell<Option<Rc<ShardContext>>> = const { RefCell::new(None) };
}

/// Makes the calling thread shard `index` of dispatcher `id`.
pub(crate) fn enter(id: usize, index: usize, shared: Arc<Shared>, tx: WeakUnboundedSender<Msg>) {
    let ctx = ShardContext {
        id,
        index,
        shared,
        tx,
        tasks: RefCell::new(Slab::new()),
        closing: Cell::new(false),
        inflight: RefCell::new(None),
    };
    CONTEXT.with(|c| *c.borrow_mut() = Some(Rc::new(ctx)));
}

/// The calling shard's loop has started: its running requests are counted in `inflight`.
pub(crate) fn set_inflight(inflight: Rc<InFlight>) {
    if let Some(ctx) = context() {
        *ctx.inflight.borrow_mut() = Some(inflight);
    }
}

/// The shard of dispatcher `id` that the calling thread runs, and its running requests: `None`
/// off that dispatcher's shards, before the shard's loop started and once shutdown started
/// there (requests then take the shard's queue, which fails or drains them as the shutdown
/// says).
pub(crate) fn inflight_here(id: usize) -> Option<(usize, Rc<InFlight>)> {
    let ctx = context()?;
    if ctx.id != id || ctx.closing.get() {
        return None;
    }
    let inflight = ctx.inflight.borrow().clone()?;
    Some((ctx.index, inflight))
}

/// The calling thread stops being a shard.
pub(crate) fn leave() {
    let _ = CONTEXT.try_with(|c| c.borrow_mut().take());
}

fn context() -> Option<Rc<ShardContext>> {
    CONTEXT.try_with(|c| c.borrow().clone()).ok().flatten()
}

/// Whether the calling thread is a shard of some dispatcher (its runtime is current-thread,
/// with an I/O driver).
pub(crate) fn on_any_shard() -> bool {
    CONTEXT.try_with(|c| c.borrow().is_some()).unwrap_or(false)
}

/// The shard of dispatcher `id` that the calling thread runs, if any.
pub(crate) fn current_index(id: usize) -> Option<usize> {
    CONTEXT
        .try_with(|c| {
            c.borrow()
                .as_ref()
                .and_then(|ctx| (ctx.id == id).then_some(ctx.index))
        })
        .ok()
        .flatten()
}

/// Shutdown started on the calling shard: cancels its spawned tasks (each is dropped at its
/// next turn on the `LocalSet`, or with it) and refuses new ones. Idempotent.
pub(crate) fn close_current() {
    let Some(ctx) = context() else { return };
    ctx.closing.set(true);
    let tasks: Vec<AbortHandle> = ctx.tasks.borrow_mut().drain().collect();
    for t in tasks {
        t.abort();
    }
}

/// Starts `f`'s task on the calling shard (run there by a [`SpawnJob`]).
pub(crate) fn start<F, Fut>(f: F, tx: JoinTx<Fut::Output>, live: Live)
where
    F: FnOnce() -> Fut,
    Fut: Future + 'static,
{
    let Some(ctx) = context() else { return };
    if ctx.closing.get() {
        return;
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(fut) => ctx.spawn_tracked(fut, tx, Some(live)),
        Err(panic) => {
            count_panic();
            add_panics(&ctx.shared);
            let _ = tx.send(Err(JoinError::Panicked {
                message: panic_message(&*panic),
            }));
        }
    }
}

/// Removes a finished task from its shard's table.
struct Untrack {
    ctx: Weak<ShardContext>,
    key: usize,
    _live: Option<Live>,
}

impl Drop for Untrack {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx.upgrade() {
            // Never borrowed across a task's poll or drop; should it be, the entry stays
            // (an abort of an ended task is a no-op).
            if let Ok(mut tasks) = ctx.tasks.try_borrow_mut() {
                tasks.try_remove(self.key);
            }
        }
    }
}

impl ShardContext {
    /// Spawns `fut` on this (the calling) shard's `LocalSet`, tracked for shutdown.
    fn spawn_tracked<Fut>(self: &Rc<Self>, fut: Fut, tx: JoinTx<Fut::Output>, live: Option<Live>)
    where
        Fut: Future + 'static,
    {
        let guarded = Guarded::new(fut);
        let shared = self.shared.clone();
        let mut tasks = self.tasks.borrow_mut();
        let entry = tasks.vacant_entry();
        let untrack = Untrack {
            ctx: Rc::downgrade(self),
            key: entry.key(),
            _live: live,
        };
        // `spawn_local` only queues the task: the table's borrow ends before it first runs.
        let handle = tokio::task::spawn_local(async move {
            let untrack = untrack;
            let out = task::run_guarded(guarded)
                .await
                .map_err(|message| JoinError::Panicked { message });
            add_panics(&shared);
            // Counted out before the output arrives: whoever awaited it sees the shard's load
            // without this task.
            drop(untrack);
            let _ = tx.send(out);
        });
        entry.insert(handle.abort_handle());
    }
}

/// The shard the calling code runs on, when it runs on a dispatcher's shard (a task spawned
/// with [`Dispatcher::spawn_on`](super::Dispatcher::spawn_on), or a request's future); `None`
/// elsewhere.
pub fn current_shard() -> Option<ShardHandle> {
    context().map(|ctx| ShardHandle { ctx })
}

/// The shard the calling code runs on ([`current_shard`]): spawn more tasks there, and submit
/// I/O to its own queue, with no other thread involved. Not `Send`: it belongs to its shard's
/// thread.
#[derive(Clone)]
pub struct ShardHandle {
    ctx: Rc<ShardContext>,
}

impl fmt::Debug for ShardHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardHandle")
            .field("index", &self.ctx.index)
            .finish_non_exhaustive()
    }
}

impl ShardHandle {
    /// The shard's index.
    pub fn index(&self) -> usize {
        self.ctx.index
    }

    /// Spawns `fut` on this shard: like [`Dispatcher::spawn_on`](super::Dispatcher::spawn_on)
    /// with a future made here (it may be `!Send`, and so may its output).
    pub fn spawn_local<Fut>(&self, fut: Fut) -> Result<ShardJoinHandle<Fut::Output>, SpawnError>
    where
        Fut: Future + 'static,
    {
        // Acquire: pairs with the Release store that starts shutdown.
        if self.ctx.closing.get() || self.ctx.shared.closed.load(Ordering::Acquire) != 0 {
            return Err(SpawnError::ShutDown);
        }
        let (tx, rx) = oneshot::channel();
        let live = Live::new(self.ctx.shared.clone(), self.ctx.index);
        self.ctx.spawn_tracked(fut, tx, Some(live));
        Ok(ShardJoinHandle { rx })
    }

    /// Submits `request` of `class` to this shard's own queue: `fut` runs here once the
    /// request's tokens are there (as [`Dispatcher::submit_to`](super::Dispatcher::submit_to)
    /// this shard, without naming the dispatcher).
    pub fn submit<F>(
        &self,
        class: ClassId,
        request: IoRequest,
        fut: F,
    ) -> Result<IoHandle<F::Output>, SubmitError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let shared = &self.ctx.shared;
        let cost = shared.admit(class, &request)?;
        let (task, handle) = task::task(fut);
        let entry = Entry {
            class: class.0,
            cost,
            bytes: request.bytes(),
            submitted: shared.clock.now(),
            payload: task,
        };
        let tx = self.ctx.tx.upgrade().ok_or(SubmitError::ShutDown)?;
        // Counted while in the channel, as `Dispatcher::submit` counts it.
        shared.classes.queued_add(class.0);
        tx.send(Msg::Submit(entry)).map_err(|_| {
            shared.classes.queued_sub(class.0);
            SubmitError::ShutDown
        })?;
        Ok(handle)
    }
}

/// A spawn job for `f` and the handle to its task's output.
pub(crate) fn job<F, Fut>(f: F, live: Live) -> (SpawnJob, ShardJoinHandle<Fut::Output>)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future + 'static,
    Fut::Output: Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    let job: SpawnJob = Box::new(move || start(f, tx, live));
    (job, ShardJoinHandle { rx })
}
