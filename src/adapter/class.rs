//! [`ClassIo`]: `AsyncRead` / `AsyncWrite` / `AsyncSeek` through a dispatcher class.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};

use crate::dispatcher::{ClassId, Dispatcher, IoHandle, IoKind, IoRequest};

use super::DEFAULT_MAX_CHUNK;

/// One direction's tickets.
///
/// # Invariants
///
/// - `credit` bytes were paid for by a dispatched ticket and not moved yet. A dispatcher cannot
///   take dispatched tokens back, so credit left by a short operation is kept for the next one
///   (never paid twice); at most one chunk of it is unused when the adapter is dropped.
/// - `wait` is a ticket not yet dispatched; dropping it cancels it and the dispatcher gives its
///   tokens back.
struct Tickets {
    kind: IoKind,
    credit: u64,
    wait: Option<(u64, IoHandle<()>)>,
}

impl Tickets {
    fn poll_grant(
        &mut self,
        cx: &mut Context<'_>,
        dispatcher: &Dispatcher,
        class: ClassId,
        want: u64,
    ) -> Poll<io::Result<u64>> {
        if self.credit > 0 {
            return Poll::Ready(Ok(self.credit));
        }
        if self.wait.is_none() {
            let request = match self.kind {
                IoKind::Read => IoRequest::read(want),
                IoKind::Write => IoRequest::write(want),
            };
            let handle = dispatcher
                .submit(class, request, async {})
                .map_err(io::Error::other)?;
            self.wait = Some((want, handle));
        }
        let (bytes, handle) = self.wait.as_mut().expect("set above");
        let res = ready!(Pin::new(handle).poll(cx));
        let bytes = *bytes;
        self.wait = None;
        res.map_err(io::Error::other)?;
        self.credit = bytes;
        Poll::Ready(Ok(bytes))
    }
}

/// An I/O object whose reads and writes are scheduled by a [`Dispatcher`] class: before each
/// operation a ticket (an empty request of the operation's size and kind, costed by the
/// dispatcher's disk model) is dispatched in the class's turn, then the bytes move. Classes
/// share the disk by their shares, so wrapping the compaction's files in one class and the
/// reads in another is the dispatcher's fairness with one line per file.
///
/// - Each operation moves at most `max_chunk` bytes: by default the most one request of that
///   kind may carry ([`Dispatcher::max_cost`] through the disk model), at most 1 MiB.
/// - Cancel-safe: dropping the adapter while a ticket waits cancels the ticket (its tokens go
///   back). Bytes paid for and not moved by a short operation are kept for the next operation
///   of the same direction; at most one chunk per direction is left unused at drop (a dispatched
///   ticket cannot be refunded).
/// - `AsyncSeek`, `poll_flush` and `poll_shutdown` pass through. The inner object must be `Unpin`.
///
/// # Small operations: wrap it in a buffer
///
/// Every operation that needs new credit is one ticket: a round trip through a shard (about
/// 10 µs), charged one operation of the disk model. A stream of small writes (a log, a
/// serializer writing field by field) would pay that per write and fall well short of the
/// class's share. Put a `tokio::io::BufWriter` (reads: `tokio::io::BufReader`) *outside*
/// the `ClassIo`, with a capacity of [`max_chunks`](Self::max_chunks): the buffer gathers the
/// small writes, and each full buffer is one ticket for one chunk, which is also the one
/// operation the disk model charges for it. Flush (or shut down) the buffer at the end, as with
/// any `BufWriter`.
///
/// ```
/// use std::sync::Arc;
/// use tokio::io::{AsyncWriteExt, BufWriter};
/// use iothrottle::adapter::ClassIo;
/// use iothrottle::dispatcher::{ClassConfig, DiskModel, Figures, Dispatcher};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut b = Dispatcher::builder()
///     .shards(1)
///     .pin_threads(false)
///     .disk(DiskModel::symmetric(Figures { iops: 100_000, bandwidth: 1 << 30 }));
/// let log_class = b.add_class(ClassConfig::new("log", 100))?;
/// let dispatcher = Arc::new(b.build()?);
///
/// let file = ClassIo::new(Vec::new(), dispatcher.clone(), log_class)?; // a file in real life
/// let (_, max_write) = file.max_chunks();
/// let mut log = BufWriter::with_capacity(max_write as usize, file);
/// for i in 0..10_000u32 {
///     log.write_all(&i.to_le_bytes()).await?; // 4 bytes at a time, but not a ticket each
/// }
/// log.flush().await?;
/// let tickets = dispatcher.stats().await.classes[log_class.index()].requests;
/// assert!(tickets <= 40_000u64.div_ceil(max_write) + 1, "{tickets} tickets");
/// # dispatcher.shutdown();
/// # Ok(())
/// # }
/// ```
pub struct ClassIo<T> {
    inner: T,
    dispatcher: Arc<Dispatcher>,
    class: ClassId,
    read: Tickets,
    write: Tickets,
    max_read: u64,
    max_write: u64,
}

impl<T> ClassIo<T> {
    /// Wraps `inner`; its operations are tickets of `class` on `dispatcher`. Fails with
    /// [`io::ErrorKind::InvalidInput`] when the class is unknown or when even one byte costs
    /// more than one request may (a disk model whose per-operation cost is above the dispatcher's
    /// `max_cost`).
    pub fn new(inner: T, dispatcher: Arc<Dispatcher>, class: ClassId) -> io::Result<Self> {
        if class.index() >= dispatcher.classes() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "class {} is unknown: the dispatcher has {}",
                    class.index(),
                    dispatcher.classes()
                ),
            ));
        }
        let max = |kind| {
            dispatcher
                .disk()
                .max_bytes_within(kind, dispatcher.max_cost())
                .map(|b| b.min(DEFAULT_MAX_CHUNK))
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("one {kind:?} costs more than the dispatcher's max_cost"),
                    )
                })
        };
        let (max_read, max_write) = (max(IoKind::Read)?, max(IoKind::Write)?);
        Ok(ClassIo {
            inner,
            class,
            read: Tickets {
                kind: IoKind::Read,
                credit: 0,
                wait: None,
            },
            write: Tickets {
                kind: IoKind::Write,
                credit: 0,
                wait: None,
            },
            max_read,
            max_write,
            dispatcher,
        })
    }

    /// The largest read and write one operation moves.
    pub fn max_chunks(&self) -> (u64, u64) {
        (self.max_read, self.max_write)
    }

    /// The wrapped object.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// The wrapped object, mutably (I/O done through it is not scheduled).
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// The wrapped object.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: fmt::Debug> fmt::Debug for ClassIo<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassIo")
            .field("inner", &self.inner)
            .field("class", &self.class)
            .field("read_credit", &self.read.credit)
            .field("write_credit", &self.write.credit)
            .finish_non_exhaustive()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ClassIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let want = (buf.remaining() as u64).min(this.max_read);
        let credit = ready!(this.read.poll_grant(cx, &this.dispatcher, this.class, want))?;
        let n = (credit as usize).min(buf.remaining());
        let mut part = buf.take(n);
        let before = part.filled().as_ptr();
        let res = ready!(Pin::new(&mut this.inner).poll_read(cx, &mut part));
        let got = part.filled().len();
        assert!(
            std::ptr::eq(before, part.filled().as_ptr()),
            "the inner reader replaced the ReadBuf"
        );
        if res.is_ok() {
            // SAFETY: the inner reader initialised and filled `got` bytes of `part`, which
            // starts at `buf`'s unfilled part (checked by the pointer above).
            unsafe { buf.assume_init(got) };
            buf.advance(got);
            this.read.credit -= got as u64;
        }
        Poll::Ready(res)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ClassIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        let want = (buf.len() as u64).min(this.max_write);
        let credit = ready!(this
            .write
            .poll_grant(cx, &this.dispatcher, this.class, want))?;
        let n = (credit as usize).min(buf.len());
        let written = ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..n]))?;
        this.write.credit -= written.min(n) as u64;
        Poll::Ready(Ok(written))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: AsyncSeek + Unpin> AsyncSeek for ClassIo<T> {
    fn start_seek(self: Pin<&mut Self>, position: io::SeekFrom) -> io::Result<()> {
        Pin::new(&mut self.get_mut().inner).start_seek(position)
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        Pin::new(&mut self.get_mut().inner).poll_complete(cx)
    }
}
