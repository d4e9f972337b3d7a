//! [`ThrottledFile`]: positional O_DIRECT reads and writes through a [`Dispatcher`] class.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::dispatcher::{ClassId, Dispatcher, IoHandle, IoKind, IoRequest};
use crate::error::{DiskError, SubmitError};
use crate::sync::Arc;

use super::backend::{self, Backend, OpKind, RawIo, Resolved};
use super::buf::{check_len, AlignedBuf, ALIGN};
use super::fs::{fs_name, memory_fs};

/// How a [`ThrottledFile`] is opened and how it issues I/O.
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// Open for writing too (reads are always allowed).
    pub write: bool,
    /// Create the file if it does not exist (needs `write`).
    pub create: bool,
    /// The largest piece one dispatcher request carries, a positive multiple of [`ALIGN`]
    /// (default 128 KiB). A larger read or write is split into pieces of at most this size, each
    /// its own request with its own cost.
    pub max_piece: usize,
    /// io_uring, the blocking pool, or automatic (default).
    pub backend: Backend,
    /// Reserve each write's range (`fallocate`) before writing it (default `true`): a full disk
    /// then fails the write before any byte of it is written. Off, a write into a hole can stop
    /// half-way on `ENOSPC`.
    pub reserve_writes: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            write: false,
            create: false,
            max_piece: 128 * 1024,
            backend: Backend::Auto,
            reserve_writes: true,
        }
    }
}

impl FileOptions {
    /// Read-write, creating the file if needed.
    pub fn read_write() -> Self {
        FileOptions {
            write: true,
            create: true,
            ..FileOptions::default()
        }
    }
}

/// A file opened with `O_DIRECT` whose reads and writes are dispatcher requests of one class.
///
/// Each [`read_at`](Self::read_at) / [`write_at`](Self::write_at) is split into pieces of at most
/// [`FileOptions::max_piece`] bytes; each piece is submitted with
/// [`Dispatcher::submit`] and an [`IoRequest`] of its own size, and its future *is* the I/O: it
/// completes when the kernel completes the piece, so in capped mode the piece's tokens return
/// to the bucket when the disk has done the work. The I/O runs on io_uring (or the blocking
/// pool): the shard's runtime is never blocked by a read or a write.
///
/// Buffers are [`AlignedBuf`]s, moved in and handed back, so the kernel never writes memory
/// the caller can see. Offsets must be multiples of [`ALIGN`]; that and every other check is
/// made before anything is submitted.
///
/// Opening and the `fallocate` reservation of a write are not throttled (they move no data).
#[derive(Debug)]
pub struct ThrottledFile {
    file: Arc<File>,
    path: PathBuf,
    dispatcher: Arc<Dispatcher>,
    class: ClassId,
    backend: Resolved,
    max_piece: usize,
    reserve: bool,
}

impl ThrottledFile {
    /// Opens `path` with `O_DIRECT` for requests of `class` on `dispatcher`.
    ///
    /// Errors: [`DiskError::NotADisk`] on tmpfs/ramfs, [`DiskError::DirectIoUnsupported`] when
    /// the file system refuses O_DIRECT (a file this call created is removed again),
    /// [`DiskError::Unaligned`] for a bad `max_piece`, [`DiskError::Io`] otherwise.
    pub fn open(
        dispatcher: Arc<Dispatcher>,
        class: ClassId,
        path: impl AsRef<Path>,
        options: FileOptions,
    ) -> Result<Self, DiskError> {
        let path = path.as_ref().to_owned();
        if options.max_piece == 0 || !options.max_piece.is_multiple_of(ALIGN) {
            return Err(DiskError::Unaligned {
                what: "max piece size",
                value: options.max_piece as u64,
                align: ALIGN as u64,
            });
        }
        let file = open_direct(&path, options.write, options.create)?;
        Self::from_file(dispatcher, class, file, path, options)
    }

    /// Wraps a file already opened with `O_DIRECT` (checked with `fcntl`; anything else is
    /// [`DiskError::NotDirect`]). `name` is used in errors. The file's type is not checked: a
    /// pipe made with `pipe2(O_DIRECT)` works too (positions are ignored there).
    pub fn from_file(
        dispatcher: Arc<Dispatcher>,
        class: ClassId,
        file: File,
        name: impl AsRef<Path>,
        options: FileOptions,
    ) -> Result<Self, DiskError> {
        let path = name.as_ref().to_owned();
        if options.max_piece == 0 || !options.max_piece.is_multiple_of(ALIGN) {
            return Err(DiskError::Unaligned {
                what: "max piece size",
                value: options.max_piece as u64,
                align: ALIGN as u64,
            });
        }
        // SAFETY: F_GETFL on an fd owned by `file`; no pointers.
        let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETFL) };
        if flags < 0 {
            return Err(DiskError::Io {
                op: "fcntl",
                path,
                source: io::Error::last_os_error(),
            });
        }
        if flags & libc::O_DIRECT == 0 {
            return Err(DiskError::NotDirect { path });
        }
        let backend = options.backend.resolve().map_err(|source| DiskError::Io {
            op: "set up io_uring for",
            path: path.clone(),
            source,
        })?;
        Ok(ThrottledFile {
            file: Arc::new(file),
            path,
            dispatcher,
            class,
            backend,
            max_piece: options.max_piece,
            reserve: options.reserve_writes,
        })
    }

    /// The backend in use (after [`Backend::Auto`] was resolved).
    pub fn backend(&self) -> Resolved {
        self.backend
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (for `metadata`, `sync_all`…; do not do blocking I/O with it on a shard).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Reads `buf.len()` bytes at `offset` (a multiple of [`ALIGN`]) into `buf`; returns the
    /// buffer and the bytes read, fewer than asked only at the end of the file (the count of
    /// the leading pieces read in full, plus the first short one).
    ///
    /// On error the buffer is dropped.
    pub async fn read_at(
        &self,
        buf: AlignedBuf,
        offset: u64,
    ) -> Result<(AlignedBuf, usize), DiskError> {
        let (buf, done) = self.transfer(IoKind::Read, buf, offset).await?;
        Ok((buf, done))
    }

    /// Writes all of `buf` at `offset` (a multiple of [`ALIGN`]); returns the buffer.
    ///
    /// With [`FileOptions::reserve_writes`] (the default) the whole range is reserved first, so
    /// a full disk or a file-size limit is [`DiskError::NoSpace`] with nothing written. A piece
    /// the kernel completes only in part is [`DiskError::ShortWrite`]. On error the buffer is
    /// dropped.
    ///
    /// One case can still leave a write half-done: the dispatcher shutting down between the
    /// submissions of two pieces (the pieces already dispatched run; the rest are refused).
    pub async fn write_at(&self, buf: AlignedBuf, offset: u64) -> Result<AlignedBuf, DiskError> {
        let len = buf.len();
        let (buf, done) = self.transfer(IoKind::Write, buf, offset).await?;
        if done != len {
            return Err(DiskError::ShortWrite {
                offset,
                done: done as u64,
                len: len as u64,
            });
        }
        Ok(buf)
    }

    /// The pieces of a `len`-byte transfer: `(start, len)`, each at most `max_piece`.
    fn pieces(&self, len: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
        let max = self.max_piece;
        (0..len).step_by(max).map(move |s| (s, max.min(len - s)))
    }

    fn io_error(&self, op: &'static str, offset: u64, len: usize, source: io::Error) -> DiskError {
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::EDQUOT) => DiskError::NoSpace {
                offset,
                len: len as u64,
                source,
            },
            _ => DiskError::Io {
                op,
                path: self.path.clone(),
                source,
            },
        }
    }

    async fn transfer(
        &self,
        kind: IoKind,
        buf: AlignedBuf,
        offset: u64,
    ) -> Result<(AlignedBuf, usize), DiskError> {
        let len = buf.len();
        check_len(len)?;
        if !offset.is_multiple_of(ALIGN as u64) {
            return Err(DiskError::Unaligned {
                what: "offset",
                value: offset,
                align: ALIGN as u64,
            });
        }
        // The kernel takes offsets as `off_t`: the range must end within `i64::MAX`.
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return Err(DiskError::OffsetOverflow {
                offset,
                len: len as u64,
            });
        }
        let (op, opkind, request): (_, _, fn(u64) -> IoRequest) = match kind {
            IoKind::Read => ("read", OpKind::Read, IoRequest::read),
            IoKind::Write => ("write", OpKind::Write, IoRequest::write),
        };
        // The first piece is the largest and the cost grows with the bytes: if it fits a
        // request, every piece does. Checked before anything is submitted, as a refusal
        // half-way would leave a write half-done.
        let costed = |plen: usize| {
            let req = request(plen as u64);
            (req, self.dispatcher.cost(&req))
        };
        let (first, first_cost) = costed(len.min(self.max_piece));
        if first_cost > self.dispatcher.max_cost() {
            return Err(DiskError::Submit(SubmitError::TooLarge {
                cost: first_cost,
                max_cost: self.dispatcher.max_cost(),
                max_bytes: self
                    .dispatcher
                    .disk()
                    .max_bytes_within(kind, self.dispatcher.max_cost()),
            }));
        }
        if kind == IoKind::Write && self.reserve {
            let reserve = RawIo {
                kind: OpKind::Fallocate,
                file: self.file.clone(),
                buf: None,
                start: 0,
                len,
                offset,
            };
            backend::run(self.backend, reserve)
                .await
                .map_err(|e| self.io_error("reserve (fallocate)", offset, len, e))?;
        }
        let shared = Arc::new(buf);
        let submit = |start: usize, plen: usize, (req, cost): (IoRequest, u64)| {
            let io = RawIo {
                kind: opkind,
                file: self.file.clone(),
                buf: Some(shared.clone()),
                start,
                len: plen,
                offset: offset + start as u64,
            };
            let (task, handle) = backend::io_task(self.backend, io);
            self.dispatcher
                .submit_costed(self.class, req, cost, task)
                .map(|()| handle)
        };
        let done = if len <= self.max_piece {
            // One piece (a 4 KiB read): no list of handles.
            let handle = submit(0, len, (first, first_cost))?;
            self.settle(op, offset, std::iter::once((handle, (0, len))))
                .await?
        } else {
            let pieces = self.pieces(len);
            let mut handles: Vec<IoHandle<io::Result<usize>>> =
                Vec::with_capacity(len.div_ceil(self.max_piece));
            for (start, plen) in pieces.clone() {
                handles.push(submit(start, plen, costed(plen))?);
            }
            self.settle(op, offset, handles.into_iter().zip(pieces))
                .await?
        };
        Ok((reclaim(shared), done))
    }

    /// Waits for every piece, even after a failure, so that no piece is still in flight when
    /// this returns; returns the bytes done by the leading pieces done in full, plus the first
    /// short one, or the first error.
    async fn settle(
        &self,
        op: &'static str,
        offset: u64,
        pieces: impl Iterator<Item = (IoHandle<io::Result<usize>>, (usize, usize))>,
    ) -> Result<usize, DiskError> {
        let mut done = 0usize;
        let mut contiguous = true;
        let mut first_err = None;
        for (handle, (start, plen)) in pieces {
            match handle.await {
                Ok(Ok(n)) => {
                    if contiguous {
                        done += n;
                        contiguous = n == plen;
                    }
                }
                Ok(Err(e)) => {
                    first_err
                        .get_or_insert_with(|| self.io_error(op, offset + start as u64, plen, e));
                }
                Err(e) => {
                    first_err.get_or_insert(DiskError::Dispatch(e));
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }
}

/// The buffer back from the pieces. Every piece's hold was dropped before its completion was
/// reported (the backends drop it first), so the `Arc` is unique; should it not be, the bytes
/// are copied (no I/O is in flight any more, so reading them is sound).
fn reclaim(shared: Arc<AlignedBuf>) -> AlignedBuf {
    match Arc::try_unwrap(shared) {
        Ok(buf) => buf,
        Err(shared) => {
            let mut copy = AlignedBuf::zeroed(shared.len()).expect("same valid length");
            copy.copy_from_slice(&shared);
            copy
        }
    }
}

/// Opens with `O_DIRECT`, refusing memory file systems and mapping `EINVAL` to
/// [`DiskError::DirectIoUnsupported`].
pub(crate) fn open_direct(path: &Path, write: bool, create: bool) -> Result<File, DiskError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Some(fs) = memory_fs(if path.exists() { path } else { dir }) {
        return Err(DiskError::NotADisk {
            path: path.to_owned(),
            fs,
        });
    }
    let existed = path.exists();
    let mut o = OpenOptions::new();
    o.read(true)
        .write(write)
        .create(create && write)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC);
    match o.open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if !existed && path.exists() {
                // Linux creates the file before it checks O_DIRECT: leave nothing behind.
                let _ = std::fs::remove_file(path);
            }
            Err(DiskError::DirectIoUnsupported {
                path: path.to_owned(),
                fs: fs_name(dir),
            })
        }
        Err(source) => Err(DiskError::Io {
            op: "open",
            path: path.to_owned(),
            source,
        }),
    }
}
