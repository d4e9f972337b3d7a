//! Handles to submitted requests: [`IoHandle`], [`SplitHandle`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::DispatchError;

/// The result of a submitted request: a future that resolves once the request's future has run
/// on a shard.
///
/// Dropping the handle before the request is dispatched cancels it: its future is never polled
/// and its tokens go back to the bucket. Once dispatched, the future runs to completion even if
/// the handle is dropped.
#[must_use = "dropping the handle cancels the request unless it was already dispatched"]
pub struct IoHandle<T> {
    rx: oneshot::Receiver<Result<T, DispatchError>>,
    /// A request dispatched on the caller's thread: its future, run by polling the handle.
    inline: Option<Inline>,
}

/// A request's future run by its handle, and where it goes should the handle be dropped first.
struct Inline {
    run: BoxFuture,
    /// Sends `run` to a shard, where it runs to its end.
    adopt: Box<dyn FnOnce(BoxFuture) + Send>,
}

/// A request's future, erased, sending its result itself.
type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

impl<T> IoHandle<T> {
    /// The handle of the result `rx` receives.
    pub(crate) fn new(rx: oneshot::Receiver<Result<T, DispatchError>>) -> Self {
        IoHandle { rx, inline: None }
    }

    /// The handle of a request whose future `run` (which sends its result to `rx`) runs when
    /// the handle is polled; `adopt` takes it should the handle be dropped before it ended.
    pub(crate) fn inline(
        rx: oneshot::Receiver<Result<T, DispatchError>>,
        run: BoxFuture,
        adopt: Box<dyn FnOnce(BoxFuture) + Send>,
    ) -> Self {
        IoHandle {
            rx,
            inline: Some(Inline { run, adopt }),
        }
    }
}

impl<T> Drop for IoHandle<T> {
    fn drop(&mut self) {
        if let Some(Inline { run, adopt }) = self.inline.take() {
            // Dispatched: it runs to its end even without its handle.
            adopt(run);
        }
    }
}

impl<T> fmt::Debug for IoHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoHandle").finish_non_exhaustive()
    }
}

impl<T> Future for IoHandle<T> {
    type Output = Result<T, DispatchError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(inline) = &mut this.inline {
            if inline.run.as_mut().poll(cx).is_ready() {
                this.inline = None;
            }
        }
        match Pin::new(&mut this.rx).poll(cx) {
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
