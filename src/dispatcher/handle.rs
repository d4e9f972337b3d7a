//! Handles to submitted requests ([`IoHandle`], [`SplitHandle`]) and the type-erased task a
//! shard carries for each request.

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::oneshot;

use crate::error::DispatchError;

use super::queue::Payload;
use super::runner::Completion;

/// A request's future and where its result goes, with the types erased.
pub(crate) trait Task: Send {
    /// The handle was dropped: nobody waits for the result.
    fn is_cancelled(&self) -> bool;
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
    struct Guarded<F> {
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

/// Where a request's result goes: its [`IoHandle`] receives it.
pub(crate) type ResultTx<T> = oneshot::Sender<Result<T, DispatchError>>;

struct TaskImpl<F: Future> {
    fut: Guarded<F>,
    tx: ResultTx<F::Output>,
}

/// A handle and the sender of its result, for a [`Task`] that delivers the result itself.
pub(crate) fn channel<T>() -> (ResultTx<T>, IoHandle<T>) {
    let (tx, rx) = oneshot::channel();
    (tx, IoHandle { rx })
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

    fn fail(self: Box<Self>, err: DispatchError) {
        let _ = self.tx.send(Err(err));
    }

    fn spawn_local(self: Box<Self>, done: Completion) {
        let TaskImpl { fut, tx } = *self;
        tokio::task::spawn_local(async move {
            let _done = done;
            let mut guarded = std::pin::pin!(fut);
            let mut out = std::future::poll_fn(|cx| {
                let Some(fut) = guarded.as_mut().project().fut.as_pin_mut() else {
                    return Poll::Ready(Err(DispatchError::Panicked {
                        message: "(polled after it ended)".to_owned(),
                    }));
                };
                match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
                    Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
                    Ok(Poll::Pending) => Poll::Pending,
                    Err(panic) => {
                        count_panic();
                        Poll::Ready(Err(DispatchError::Panicked {
                            message: panic_message(&*panic),
                        }))
                    }
                }
            })
            .await;
            // Drop the future before answering, so a panic in its `Drop` reaches the handle.
            let mut slot = guarded.as_mut().project().fut;
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| slot.set(None))) {
                count_panic();
                if out.is_ok() {
                    out = Err(DispatchError::Panicked {
                        message: format!("in drop: {}", panic_message(&*panic)),
                    });
                }
            }
            _done.count_panics();
            let _ = tx.send(out);
        });
    }
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

/// The result of a submitted request: a future that resolves once the request's future has run
/// on a shard.
///
/// Dropping the handle before the request is dispatched cancels it: its future is never polled
/// and its tokens go back to the bucket. Once dispatched, the future runs to completion even if
/// the handle is dropped.
#[must_use = "dropping the handle cancels the request unless it was already dispatched"]
pub struct IoHandle<T> {
    rx: oneshot::Receiver<Result<T, DispatchError>>,
}

impl<T> fmt::Debug for IoHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoHandle").finish_non_exhaustive()
    }
}

impl<T> Future for IoHandle<T> {
    type Output = Result<T, DispatchError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(out)) => Poll::Ready(out),
            // The sender was dropped unsent: the shard went away with the request still queued.
            Poll::Ready(Err(_)) => Poll::Ready(Err(DispatchError::ShutDown)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The results of a split request, in piece order. Resolves to the first error if a piece
/// failed. Dropping it cancels the pieces not yet dispatched.
#[must_use = "dropping the handle cancels the pieces not yet dispatched"]
pub struct SplitHandle<T> {
    pieces: Vec<IoHandle<T>>,
    done: Vec<T>,
}

impl<T> SplitHandle<T> {
    pub(crate) fn new(pieces: Vec<IoHandle<T>>) -> Self {
        let done = Vec::with_capacity(pieces.len());
        SplitHandle { pieces, done }
    }

    /// How many pieces the request was split into.
    pub fn pieces(&self) -> usize {
        self.pieces.len()
    }
}

impl<T> fmt::Debug for SplitHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SplitHandle")
            .field("pieces", &self.pieces.len())
            .field("done", &self.done.len())
            .finish()
    }
}

impl<T> Unpin for SplitHandle<T> {}

impl<T> Future for SplitHandle<T> {
    type Output = Result<Vec<T>, DispatchError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        while this.done.len() < this.pieces.len() {
            let i = this.done.len();
            match Pin::new(&mut this.pieces[i]).poll(cx) {
                Poll::Ready(Ok(v)) => this.done.push(v),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(std::mem::take(&mut this.done)))
    }
}
