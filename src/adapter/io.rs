//! [`ThrottledIo`]: `AsyncRead` / `AsyncWrite` / `AsyncSeek` through a [`Throttle`].

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};
use tracing::Instrument;

use crate::bucket::{Mode, Uncapped};
use crate::clock::{Clock, MonotonicClock};
use crate::throttle::{Permit, Throttle};
use crate::{AcquireError, TryAcquireError};

use super::DEFAULT_MAX_CHUNK;

type Wait<M, C> = Pin<Box<dyn Future<Output = Result<Permit<M, C>, AcquireError>> + Send>>;

/// One direction's (read or write) tokens.
///
/// # Invariants
///
/// - `credit` tokens were granted by the throttle and not yet spent or given back. It is
///   non-zero only while an inner operation returned `Pending` (the next poll reuses it); every
///   `Ready` from the inner object settles it: the bytes moved are completed, the rest refunded.
/// - `wait` is the wait for the next grant: first a sleep without a claim, then a claim in line
///   ([`Throttle::acquire_unclaimed_first`]); dropping it gives any claim back (the throttle's
///   cancellation guarantee), so dropping the adapter at any point loses nothing.
struct Gate<M: Mode, C: Clock + 'static> {
    throttle: Throttle<M, C>,
    credit: u64,
    wait: Option<Wait<M, C>>,
}

impl<M: Mode, C: Clock + 'static> Gate<M, C> {
    fn new(throttle: Throttle<M, C>) -> Self {
        Gate {
            throttle,
            credit: 0,
            wait: None,
        }
    }

    /// Tokens for the next operation, asking for `want` (≥ 1, ≤ the limit) if none are held.
    /// Returns the credit held (may differ from `want` when it was granted for an earlier poll).
    fn poll_grant(&mut self, cx: &mut Context<'_>, want: u64) -> Poll<io::Result<u64>> {
        if self.credit > 0 {
            return Poll::Ready(Ok(self.credit));
        }
        if self.wait.is_none() {
            // Fast path without an allocation: tokens there and nobody in line.
            match self.throttle.try_acquire(want) {
                Ok(permit) => {
                    self.credit = permit.into_tokens();
                    return Poll::Ready(Ok(self.credit));
                }
                Err(TryAcquireError::Closed) => return Poll::Ready(Err(closed())),
                Err(_) => {
                    // The slow path only: a span around the wait (the fast path has none).
                    let throttle = self.throttle.clone();
                    let span = tracing::debug_span!("iothrottle.adapter.wait", tokens = want);
                    // No claim in line until the tokens are near: this future may be
                    // dropped with the operation polling it while the adapter lives on.
                    self.wait = Some(Box::pin(
                        async move { throttle.acquire_unclaimed_first(want).await }
                            .instrument(span),
                    ));
                }
            }
        }
        let wait = self.wait.as_mut().expect("set above");
        let res = ready!(wait.as_mut().poll(cx));
        self.wait = None;
        match res {
            Ok(permit) => {
                self.credit = permit.into_tokens();
                Poll::Ready(Ok(self.credit))
            }
            Err(AcquireError::Closed) => Poll::Ready(Err(closed())),
            Err(e) => Poll::Ready(Err(io::Error::other(e))),
        }
    }

    /// The inner operation is done and moved `used` bytes (≤ the credit): they are completed
    /// (capped mode: released), the rest of the credit is refunded.
    fn settle(&mut self, used: u64) {
        let credit = std::mem::take(&mut self.credit);
        debug_assert!(used <= credit);
        let used = used.min(credit);
        if used > 0 {
            self.throttle.bucket().complete(used);
        }
        // Through the throttle: the waiters behind are woken for the tokens that came back.
        self.throttle.refund_unused(credit - used);
    }
}

impl<M: Mode, C: Clock + 'static> Drop for Gate<M, C> {
    fn drop(&mut self) {
        // Granted for an operation that never finished: nothing moved, all of it goes back.
        self.settle(0);
    }
}

fn closed() -> io::Error {
    io::Error::other(AcquireError::Closed)
}

/// An I/O object whose reads and writes are throttled by a [`Throttle`], one token per byte.
///
/// - **Writes** wait for `min(buf.len(), max_chunk)` tokens, then write at most that many bytes;
///   tokens the inner writer did not take (a short write, an error) are refunded at once.
/// - **Reads** wait for `min(buf.remaining(), max_chunk)` tokens, read at most that many bytes,
///   then refund what the read did not fill (a short read, end of file, an error). Tokens
///   are charged *before* the bytes move, so the bytes that pass never exceed the tokens issued:
///   over any time `t`, bytes ≤ `rate × t + limit`.
/// - `max_chunk` is at most the bucket's limit, so a large buffer is split into several
///   operations: never an error, never a wait that cannot end.
/// - Dropping the adapter (or the future polling it) at any point loses no token: an operation
///   waiting for its tokens sleeps without a claim until they are near, so a cancelled one holds
///   nobody up; a claim in line is given back in order when the adapter is dropped; credit held
///   across an inner `Pending` is refunded. Unused tokens go back through the throttle, which
///   wakes the waiters behind them.
/// - `AsyncSeek`, `poll_flush` and `poll_shutdown` pass straight through, unthrottled.
/// - The inner object must be `Unpin` (files, sockets, `tokio::io::duplex` are); wrap others in
///   `Box::pin(inner)`.
///
/// In [`Capped`](crate::Capped) mode the bytes of an operation count as in flight from the grant
/// until the inner poll returns `Ready`.
///
/// ```
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// use iothrottle::adapter::ThrottleExt;
/// use iothrottle::{BucketConfig, Rate, Throttle, TokioClock, Uncapped};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // 1 MiB/s, bursts of 64 KiB.
/// let throttle: Throttle<Uncapped, TokioClock> = Throttle::with_clock(
///     BucketConfig::new(Rate::per_second(1 << 20), 64 << 10),
///     TokioClock::new(),
/// )?;
/// let start = tokio::time::Instant::now();
/// let mut sink = tokio::io::sink().throttled(&throttle);
/// sink.write_all(&vec![0u8; (1 << 20) + (64 << 10)]).await?; // one burst, then one second
/// assert!(start.elapsed() >= std::time::Duration::from_secs(1));
/// # Ok(())
/// # }
/// ```
pub struct ThrottledIo<T, M: Mode = Uncapped, C: Clock + 'static = MonotonicClock> {
    inner: T,
    read: Gate<M, C>,
    write: Gate<M, C>,
    max_chunk: u64,
}

impl<T, M: Mode, C: Clock + 'static> ThrottledIo<T, M, C> {
    /// Wraps `inner`; reads and writes take their tokens from `throttle` (share it by cloning:
    /// clones draw on one bucket). Pieces of at most [`DEFAULT_MAX_CHUNK`] (or the limit).
    pub fn new(inner: T, throttle: Throttle<M, C>) -> Self {
        let max_chunk = DEFAULT_MAX_CHUNK.min(throttle.bucket().limit());
        ThrottledIo {
            inner,
            read: Gate::new(throttle.clone()),
            write: Gate::new(throttle),
            max_chunk,
        }
    }

    /// Sets the largest piece granted to one operation: `bytes` clamped to `1..=limit` (a
    /// larger piece could never be granted; a zero piece could never move a byte). Smaller
    /// pieces interleave readers and writers more finely at the price of more operations.
    pub fn with_max_chunk(mut self, bytes: u64) -> Self {
        self.max_chunk = bytes.clamp(1, self.read.throttle.bucket().limit());
        self
    }

    /// The largest piece one operation is granted.
    pub fn max_chunk(&self) -> u64 {
        self.max_chunk
    }

    /// The throttle.
    pub fn throttle(&self) -> &Throttle<M, C> {
        &self.read.throttle
    }

    /// The wrapped object.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// The wrapped object, mutably (I/O done through it is not throttled).
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// The wrapped object; tokens held are given back.
    pub fn into_inner(self) -> T {
        self.inner
    }

    fn want(&self, len: usize) -> u64 {
        (len as u64).min(self.max_chunk)
    }
}

impl<T: fmt::Debug, M: Mode, C: Clock + 'static> fmt::Debug for ThrottledIo<T, M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottledIo")
            .field("inner", &self.inner)
            .field("max_chunk", &self.max_chunk)
            .field("read_credit", &self.read.credit)
            .field("write_credit", &self.write.credit)
            .finish_non_exhaustive()
    }
}

impl<T: AsyncRead + Unpin, M: Mode, C: Clock + 'static> AsyncRead for ThrottledIo<T, M, C> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let want = this.want(buf.remaining());
        let credit = ready!(this.read.poll_grant(cx, want))?;
        let n = (credit as usize).min(buf.remaining());
        let mut part = buf.take(n);
        let before = part.filled().as_ptr();
        let res = Pin::new(&mut this.inner).poll_read(cx, &mut part);
        let got = part.filled().len();
        // A reader that swapped the buffer out would make our count of its bytes meaningless.
        assert!(
            std::ptr::eq(before, part.filled().as_ptr()),
            "the inner reader replaced the ReadBuf"
        );
        match res {
            Poll::Pending => Poll::Pending,
            Poll::Ready(res) => {
                if res.is_ok() {
                    // SAFETY: the inner reader initialised and filled `got` bytes of `part`,
                    // which starts at `buf`'s unfilled part (checked by the pointer above).
                    unsafe { buf.assume_init(got) };
                    buf.advance(got);
                    this.read.settle(got as u64);
                } else {
                    this.read.settle(0);
                }
                Poll::Ready(res)
            }
        }
    }
}

impl<T: AsyncWrite + Unpin, M: Mode, C: Clock + 'static> AsyncWrite for ThrottledIo<T, M, C> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        let want = this.want(buf.len());
        let credit = ready!(this.write.poll_grant(cx, want))?;
        let n = (credit as usize).min(buf.len());
        match Pin::new(&mut this.inner).poll_write(cx, &buf[..n]) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(written)) => {
                this.write.settle(written.min(n) as u64);
                Poll::Ready(Ok(written))
            }
            Poll::Ready(Err(e)) => {
                this.write.settle(0);
                Poll::Ready(Err(e))
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: AsyncSeek + Unpin, M: Mode, C: Clock + 'static> AsyncSeek for ThrottledIo<T, M, C> {
    fn start_seek(self: Pin<&mut Self>, position: io::SeekFrom) -> io::Result<()> {
        Pin::new(&mut self.get_mut().inner).start_seek(position)
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        Pin::new(&mut self.get_mut().inner).poll_complete(cx)
    }
}

/// `.throttled(&throttle)` on any [`AsyncWrite`] (a file, a socket, a write half): the one-line
/// way to make a [`ThrottledIo`]. Its reads are throttled too when it also reads; for objects
/// that only read, see [`ThrottleReadExt::throttled_read`]. Implemented for the I/O traits only,
/// so the method appears on nothing else.
///
/// ```
/// use iothrottle::adapter::ThrottleExt;
/// use iothrottle::{BucketConfig, Rate, Throttle};
///
/// # fn main() -> Result<(), iothrottle::ConfigError> {
/// let throttle: Throttle = Throttle::new(BucketConfig::new(Rate::per_second(50 << 20), 1 << 20))?;
/// let (a, _b) = tokio::io::duplex(64); // reads and writes: both throttled
/// let _both = a.throttled(&throttle);
/// let _writer = tokio::io::sink().throttled(&throttle);
/// # Ok(())
/// # }
/// ```
pub trait ThrottleExt: AsyncWrite + Sized {
    /// Wraps `self` in a [`ThrottledIo`] drawing on `throttle`.
    fn throttled<M: Mode, C: Clock + 'static>(
        self,
        throttle: &Throttle<M, C>,
    ) -> ThrottledIo<Self, M, C> {
        ThrottledIo::new(self, throttle.clone())
    }
}

impl<T: AsyncWrite> ThrottleExt for T {}

/// `.throttled_read(&throttle)` on any [`AsyncRead`]: a [`ThrottledIo`] for objects that only
/// read (a read half, a child's stdout). Objects that also write have
/// [`ThrottleExt::throttled`], which throttles both directions (the two names keep the call
/// unambiguous on objects that do both, as `tokio_util`'s `compat` and `compat_write` do).
///
/// ```
/// use iothrottle::adapter::ThrottleReadExt;
/// use iothrottle::{BucketConfig, Rate, Throttle};
///
/// # fn main() -> Result<(), iothrottle::ConfigError> {
/// let throttle: Throttle = Throttle::new(BucketConfig::new(Rate::per_second(50 << 20), 1 << 20))?;
/// let _reader = tokio::io::empty().throttled_read(&throttle);
/// # Ok(())
/// # }
/// ```
pub trait ThrottleReadExt: AsyncRead + Sized {
    /// Wraps `self` in a [`ThrottledIo`] drawing on `throttle`.
    fn throttled_read<M: Mode, C: Clock + 'static>(
        self,
        throttle: &Throttle<M, C>,
    ) -> ThrottledIo<Self, M, C> {
        ThrottledIo::new(self, throttle.clone())
    }
}

impl<T: AsyncRead> ThrottleReadExt for T {}
