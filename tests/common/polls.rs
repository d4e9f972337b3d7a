//! A future wrapper that counts its polls, for the tests that a waiter is woken once.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Counts how often the inner future is polled.
pub struct CountPolls<F> {
    inner: Pin<Box<F>>,
    polls: Arc<AtomicU64>,
}

impl<F: Future> Future for CountPolls<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Relaxed: a lone counter, read after the future is done.
        self.polls.fetch_add(1, Ordering::Relaxed);
        self.inner.as_mut().poll(cx)
    }
}

/// `f` wrapped, and the count of its polls.
pub fn count_polls<F: Future>(f: F) -> (CountPolls<F>, Arc<AtomicU64>) {
    let polls = Arc::new(AtomicU64::new(0));
    (
        CountPolls {
            inner: Box::pin(f),
            polls: polls.clone(),
        },
        polls,
    )
}
