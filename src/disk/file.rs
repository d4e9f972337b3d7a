//! [`ThrottledFile`]: positional O_DIRECT reads and writes through a [`Dispatcher`] class.

use std::any::Any;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::dispatcher::{ClassId, Dispatcher, IoKind, IoRequest};
use crate::sync::Arc;
use crate::{DiskError, SubmitError};

use super::backend::{self, Backend, OpKind, RawIo, Resolved};
use super::buf::{check_addr, check_len, AlignedBuf, IoBuf, IoBufMut, ALIGN};
use super::caller_ring::{self, PieceHandle};
use super::fs::{fs_name, memory_fs};
use super::uring;

/// A result and the buffer that went into the call, handed back whatever the outcome (the
/// tokio-uring / glommio convention: a block cache keeps its buffer on an error too).
pub type BufResult<T, B> = (Result<T, DiskError>, B);

/// How a [`ThrottledFile`] is opened and how it issues I/O.
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// Open for writing too (reads are always allowed).
    pub write: bool,
    /// Create the file if it does not exist (needs `write`).
    pub create: bool,
    /// The largest piece one dispatcher request carries, a positive multiple of [`ALIGN`], or
    /// `None` (the default) to derive it per class and per direction: the largest 4 KiB-aligned
    /// piece whose cost stays within both the dispatcher's
    /// [`max_piece`](Dispatcher::max_piece) and the class's
    /// [in-flight bound](crate::dispatcher::ClassConfig::with_max_in_flight) (at least one
    /// 4 KiB block). A larger read or write is split into pieces of at most this size, each its
    /// own request with its own cost.
    pub max_piece: Option<usize>,
    /// io_uring, the blocking pool, or automatic (default).
    pub backend: Backend,
    /// Reserve each write's range (`fallocate`) before writing it (default `true`): a full disk
    /// then fails the write before any byte of it is written. Off, a write into a hole can stop
    /// half-way on `ENOSPC`. The reservation is not charged to any class: it allocates blocks
    /// and moves no data (on ext4 and xfs it writes only metadata, through the journal).
    pub reserve_writes: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            write: false,
            create: false,
            max_piece: None,
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

/// A file opened with `O_DIRECT` whose reads and writes are dispatcher requests.
///
/// The file has a default class, used by [`read_at`](Self::read_at) and
/// [`write_at`](Self::write_at); [`read_at_in`](Self::read_at_in) and
/// [`write_at_in`](Self::write_at_in) name the class per request, so one open SST serves a
/// query's reads as foreground and a compaction's as background.
///
/// Each transfer is split into pieces (see [`FileOptions::max_piece`]: by default as large as
/// the dispatcher and the class's in-flight bound allow); each piece is submitted with
/// [`Dispatcher::submit`] and an [`IoRequest`] of its own size, all pieces of a transfer to
/// one shard (the calling shard, on a shard), and its future *is* the I/O: it
/// completes when the kernel completes the piece, so in capped mode the piece's tokens return
/// to the bucket when the disk has done the work. The I/O runs on io_uring (or the blocking
/// pool): the shard's runtime is never blocked by a read or a write. A
/// [background](crate::dispatcher::ClassConfig::background) class's transfer from outside the
/// shards runs on one of [`background_shards`](Self::background_shards) as one task, its caller
/// woken once when it ends.
///
/// Buffers are any [`IoBuf`] / [`IoBufMut`] (an [`AlignedBuf`] is the easy choice), moved in
/// and handed back with the result ([`BufResult`]), on success and on error alike, so the
/// kernel never writes memory the caller can see. If the call's future is dropped while pieces
/// are in flight, the buffer stays alive until the last of them completes and is then dropped
/// (a background transfer handed to a shard runs to its end there).
///
/// Cloning is cheap: the clones share the open file, its class and its piece sizes.
/// Addresses, lengths and offsets must be multiples of [`ALIGN`]; that and every other check
/// is made before anything is submitted.
///
/// Opening and the `fallocate` reservation of a write are not throttled (they move no data).
#[derive(Debug, Clone)]
pub struct ThrottledFile {
    file: Arc<File>,
    path: std::sync::Arc<Path>,
    dispatcher: Arc<Dispatcher>,
    class: ClassId,
    backend: Resolved,
    /// The piece size of each class, `[read, write]`; 0 where not even one aligned block fits.
    pieces: std::sync::Arc<[[usize; 2]]>,
    reserve: bool,
    /// Where a background class's transfers from outside the shards run
    /// ([`background_shards`](Self::background_shards)).
    background: std::sync::Arc<[usize]>,
}

impl ThrottledFile {
    /// Opens `path` with `O_DIRECT` for requests of `class` (the default class) on
    /// `dispatcher`.
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
        check_max_piece(&options)?;
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
        check_max_piece(&options)?;
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
        let pieces = (0..dispatcher.classes())
            .map(|c| {
                [IoKind::Read, IoKind::Write]
                    .map(|kind| piece_size(&dispatcher, ClassId(c), kind, options.max_piece))
            })
            .collect();
        let background = background_shards(&dispatcher, &super::irq::completion_cpus_of(&file));
        Ok(ThrottledFile {
            background,
            file: Arc::new(file),
            path: path.into(),
            dispatcher,
            class,
            backend,
            pieces,
            reserve: options.reserve_writes,
        })
    }

    /// The shards a [background](crate::dispatcher::ClassConfig::background) class's
    /// transfers run on when they come from outside the shards: those pinned away from the
    /// CPUs that take this file's disk's completion interrupts ([`completion_cpus`], looked up
    /// at open), so that the transfers' own work there does not fall where the reads complete;
    /// every shard when that leaves none or the interrupts cannot be told.
    ///
    /// [`completion_cpus`]: super::completion_cpus
    pub fn background_shards(&self) -> &[usize] {
        &self.background
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

    /// The default class (of [`read_at`](Self::read_at) and [`write_at`](Self::write_at)).
    pub fn class(&self) -> ClassId {
        self.class
    }

    /// The largest piece a transfer of `kind` in `class` is cut into, in bytes, or `None` for
    /// an unknown class or when not even one 4 KiB block fits the dispatcher's
    /// [`max_cost`](Dispatcher::max_cost).
    pub fn piece_size(&self, class: ClassId, kind: IoKind) -> Option<usize> {
        let p = self.pieces.get(class.0)?[kind_index(kind)];
        (p > 0).then_some(p)
    }

    /// Reads `buf.bytes_total()` bytes at `offset` (a multiple of [`ALIGN`]) into `buf`, in the
    /// file's default class; hands back the buffer with the bytes read, fewer than asked only
    /// at the end of the file (the count of the leading pieces read in full, plus the first
    /// short one), or with the error.
    pub async fn read_at<B: IoBufMut>(&self, buf: B, offset: u64) -> BufResult<usize, B> {
        self.read_at_in(self.class, buf, offset).await
    }

    /// [`read_at`](Self::read_at) as a request of `class`.
    pub async fn read_at_in<B: IoBufMut>(
        &self,
        class: ClassId,
        mut buf: B,
        offset: u64,
    ) -> BufResult<usize, B> {
        let len = buf.bytes_total();
        let ptr = buf.stable_mut_ptr();
        if let Err(e) = check_buf(ptr, len) {
            return (Err(e), buf);
        }
        // SAFETY: `ptr` is `buf`'s stable memory of `bytes_total()` bytes (the `IoBuf`
        // contract), kept alive by the view until `into_caller` takes `buf` back.
        let view = unsafe { into_view(buf, ptr, len) };
        let (res, view) = self.transfer(class, IoKind::Read, view, offset).await;
        let mut buf = into_caller::<B>(view);
        if let Ok(n) = res {
            // SAFETY: the kernel wrote the first `n` bytes (the leading pieces in full).
            unsafe { buf.set_init(n) };
        }
        (res, buf)
    }

    /// Writes all of `buf`'s `bytes_init()` bytes at `offset` (a multiple of [`ALIGN`]) in the
    /// file's default class; hands back the buffer with the outcome.
    ///
    /// With [`FileOptions::reserve_writes`] (the default) the whole range is reserved first, so
    /// a full disk or a file-size limit is [`DiskError::NoSpace`] with nothing written. A piece
    /// the kernel completes only in part is [`DiskError::ShortWrite`].
    ///
    /// One case can still leave a write half-done: the dispatcher shutting down between the
    /// submissions of two pieces (the pieces already dispatched run; the rest are refused).
    pub async fn write_at<B: IoBuf>(&self, buf: B, offset: u64) -> BufResult<(), B> {
        self.write_at_in(self.class, buf, offset).await
    }

    /// [`write_at`](Self::write_at) as a request of `class`.
    pub async fn write_at_in<B: IoBuf>(
        &self,
        class: ClassId,
        buf: B,
        offset: u64,
    ) -> BufResult<(), B> {
        let len = buf.bytes_init();
        let ptr = buf.stable_ptr().cast_mut();
        if let Err(e) = check_buf(ptr, len) {
            return (Err(e), buf);
        }
        // SAFETY: as in `read_at_in`; the kernel only reads the memory of a write.
        let view = unsafe { into_view(buf, ptr, len) };
        let (res, view) = self.transfer(class, IoKind::Write, view, offset).await;
        let res = res.and_then(|done| {
            if done == len {
                Ok(())
            } else {
                Err(DiskError::ShortWrite {
                    offset,
                    done: done as u64,
                    len: len as u64,
                })
            }
        });
        (res, into_caller::<B>(view))
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
                path: self.path.to_path_buf(),
                source,
            },
        }
    }

    /// Checks what can be checked before any I/O: the offset, the range, the class and the
    /// first piece's cost.
    fn precheck(
        &self,
        class: ClassId,
        kind: IoKind,
        len: usize,
        offset: u64,
    ) -> Result<usize, DiskError> {
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
        let Some(classes) = self.pieces.get(class.0) else {
            return Err(DiskError::Submit(SubmitError::UnknownClass {
                class: class.0,
                classes: self.pieces.len(),
            }));
        };
        let piece = classes[kind_index(kind)];
        // The first piece is the largest and the cost grows with the bytes: if it fits a
        // request, every piece does. Checked before anything is submitted, as a refusal
        // half-way would leave a write half-done.
        let first = request(kind, len.min(piece.max(ALIGN)));
        let cost = self.dispatcher.cost(&first);
        if piece == 0 || cost > self.dispatcher.max_cost() {
            return Err(DiskError::Submit(SubmitError::TooLarge {
                cost,
                max_cost: self.dispatcher.max_cost(),
                max_bytes: self
                    .dispatcher
                    .disk()
                    .max_bytes_within(kind, self.dispatcher.max_cost()),
            }));
        }
        Ok(piece)
    }

    async fn transfer(
        &self,
        class: ClassId,
        kind: IoKind,
        buf: AlignedBuf,
        offset: u64,
    ) -> (Result<usize, DiskError>, AlignedBuf) {
        let len = buf.len();
        let piece = match self.precheck(class, kind, len, offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), buf),
        };
        let shared = Arc::new(buf);
        let t = Transfer {
            class,
            kind,
            piece,
            offset,
        };
        // Every piece of one transfer goes to one shard: a piece's completion frees its class's
        // in-flight room where the next piece waits, and the shard that reaped it dispatches
        // that one itself instead of waking another. On a shard, that shard.
        let res = match self.dispatcher.current_shard() {
            Some(here) => self.pieces(here, t, &shared).await,
            None if self.dispatcher.is_background(class) => self.hand_over(t, &shared).await,
            None => {
                let shard = self.dispatcher.next_shard();
                self.pieces(shard, t, &shared).await
            }
        };
        (res, reclaim(shared).await)
    }

    /// A background class's transfer from outside the shards: run on one shard as one task,
    /// so that the caller's runtime issues none of its pieces and reaps none of their
    /// completions; its caller is woken once, when the transfer ends. Dropping the caller's
    /// future leaves the transfer to run to its end there (a shutdown waits for it); the
    /// buffer comes back once no piece holds it.
    async fn hand_over(&self, t: Transfer, shared: &Arc<AlignedBuf>) -> Result<usize, DiskError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (file, held) = (self.clone(), shared.clone());
        let shard = self.dispatcher.pick_among(&self.background);
        let run: crate::dispatcher::task::BoxFuture = Box::pin(async move {
            let res = file.pieces(shard, t, &held).await;
            // Let go of the buffer before the caller hears: it takes it back without a copy.
            drop(held);
            let _ = tx.send(res);
        });
        if let Err(run) = self.dispatcher.run_on(shard, run) {
            // Shutting down: run here, where the pieces are refused as any submission is.
            run.await;
        }
        // Dropped unanswered only with its shard's thread gone.
        rx.await
            .unwrap_or(Err(DiskError::Submit(SubmitError::ShutDown)))
    }

    /// Issues the transfer's pieces for `shard` (the caller's own, on a shard) and waits for
    /// them all.
    async fn pieces(
        &self,
        shard: usize,
        t: Transfer,
        shared: &Arc<AlignedBuf>,
    ) -> Result<usize, DiskError> {
        let Transfer {
            class,
            kind,
            piece,
            offset,
        } = t;
        let len = shared.len();
        let (op, opkind) = match kind {
            IoKind::Read => ("read", OpKind::Read),
            IoKind::Write => ("write", OpKind::Write),
        };
        if kind == IoKind::Write && self.reserve {
            let reserve = RawIo {
                kind: OpKind::Fallocate,
                file: self.file.clone(),
                buf: None,
                start: 0,
                len,
                offset,
            };
            if let Err(e) = backend::run(self.backend, reserve).await {
                return Err(self.io_error("reserve (fallocate)", offset, len, e));
            }
        }
        let submit = |start: usize, plen: usize| {
            let req = request(kind, plen);
            let cost = self.dispatcher.cost(&req);
            let io = RawIo {
                kind: opkind,
                file: self.file.clone(),
                buf: Some(shared.clone()),
                start,
                len: plen,
                offset: offset + start as u64,
            };
            let io = match caller_ring::try_issue(
                &self.dispatcher,
                self.backend,
                (shard, class),
                &req,
                cost,
                io,
            ) {
                Ok(handle) => return Ok(handle),
                Err(io) => io,
            };
            // On a shard: from the submitting task, when it may go at once.
            let io = match uring::try_issue_here(
                &self.dispatcher,
                self.backend,
                class,
                &req,
                cost,
                io,
            ) {
                Ok(handle) => return Ok(handle),
                Err(io) => io,
            };
            let (task, handle) = backend::io_task(self.backend, io);
            self.dispatcher
                .submit_costed_to(shard, class, req, cost, task)
                .map(|()| handle)
        };
        if len <= piece {
            // One piece (a 4 KiB read): no list of handles.
            match submit(0, len) {
                Ok(handle) => {
                    let mut tally = Tally::default();
                    self.tally(&mut tally, op, offset, handle.await, (0, len));
                    tally.finish()
                }
                Err(e) => Err(DiskError::Submit(e)),
            }
        } else {
            let pieces = (0..len).step_by(piece).map(|s| (s, piece.min(len - s)));
            let mut handles: Vec<(PieceHandle, (usize, usize))> =
                Vec::with_capacity(len.div_ceil(piece));
            let mut refused = None;
            for (start, plen) in pieces {
                match submit(start, plen) {
                    Ok(h) => handles.push((h, (start, plen))),
                    Err(e) => {
                        refused = Some(DiskError::Submit(e));
                        break;
                    }
                }
            }
            // Even after a refusal, wait for the pieces already submitted: the buffer comes
            // back only once nothing is in flight on it.
            let settled = self.settle(op, offset, handles).await;
            match refused {
                Some(e) => Err(e),
                None => settled,
            }
        }
    }

    /// Waits for every piece, even after a failure, so that no piece is still in flight when
    /// this returns; returns the bytes done by the leading pieces done in full, plus the first
    /// short one, or the first error.
    ///
    /// The last piece is awaited first: pieces end about in the order they were issued, so the
    /// caller is woken once for the whole transfer instead of once per piece (each a wake-up
    /// from another thread when the pieces ran on a shard); the rest are then done, or nearly.
    /// Their outcomes are still added in order, so the count of leading bytes is the same.
    async fn settle(
        &self,
        op: &'static str,
        offset: u64,
        mut pieces: Vec<(PieceHandle, (usize, usize))>,
    ) -> Result<usize, DiskError> {
        let last = match pieces.pop() {
            Some((handle, range)) => Some((handle.await, range)),
            None => None,
        };
        let mut tally = Tally::default();
        for (handle, range) in pieces {
            let outcome = handle.await;
            self.tally(&mut tally, op, offset, outcome, range);
        }
        if let Some((outcome, range)) = last {
            self.tally(&mut tally, op, offset, outcome, range);
        }
        tally.finish()
    }

    /// Adds the outcome of the piece at `start..start + plen` of a transfer at `offset` to
    /// `tally`; pieces are added in their order in the transfer.
    fn tally(
        &self,
        tally: &mut Tally,
        op: &'static str,
        offset: u64,
        outcome: PieceOutcome,
        (start, plen): (usize, usize),
    ) {
        match outcome {
            Ok(Ok(n)) => {
                if tally.contiguous {
                    tally.done += n;
                    tally.contiguous = n == plen;
                }
            }
            Ok(Err(e)) => {
                tally
                    .first_err
                    .get_or_insert_with(|| self.io_error(op, offset + start as u64, plen, e));
            }
            Err(e) => {
                tally.first_err.get_or_insert(DiskError::Dispatch(e));
            }
        }
    }
}

/// What a transfer is, once checked: its class and direction, its piece size and where in the
/// file it starts.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    class: ClassId,
    kind: IoKind,
    piece: usize,
    offset: u64,
}

/// A transfer's result, its pieces' outcomes added in order: the bytes of the leading pieces
/// done in full plus the first short one, or the first error.
struct Tally {
    done: usize,
    /// Every piece so far was done in full.
    contiguous: bool,
    first_err: Option<DiskError>,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            done: 0,
            contiguous: true,
            first_err: None,
        }
    }
}

impl Tally {
    fn finish(self) -> Result<usize, DiskError> {
        match self.first_err {
            Some(e) => Err(e),
            None => Ok(self.done),
        }
    }
}

/// What a piece's handle resolves to.
type PieceOutcome = Result<std::io::Result<usize>, crate::DispatchError>;

/// The shards pinned away from `irq_cpus` (see [`ThrottledFile::background_shards`]); every
/// shard when that leaves none, or none is pinned to them.
fn background_shards(d: &Dispatcher, irq_cpus: &[usize]) -> std::sync::Arc<[usize]> {
    let near = d.shards_on(irq_cpus);
    let away: Vec<usize> = (0..d.shards()).filter(|s| !near.contains(s)).collect();
    if near.is_empty() || away.is_empty() {
        (0..d.shards()).collect()
    } else {
        away.into()
    }
}

fn kind_index(kind: IoKind) -> usize {
    match kind {
        IoKind::Read => 0,
        IoKind::Write => 1,
    }
}

fn request(kind: IoKind, len: usize) -> IoRequest {
    IoRequest::new(kind, len as u64)
}

fn check_max_piece(options: &FileOptions) -> Result<(), DiskError> {
    match options.max_piece {
        Some(p) if p == 0 || !p.is_multiple_of(ALIGN) => Err(DiskError::Unaligned {
            what: "max piece size",
            value: p as u64,
            align: ALIGN as u64,
        }),
        _ => Ok(()),
    }
}

/// Checks a caller's buffer for O_DIRECT: a positive multiple of [`ALIGN`] long, at an aligned
/// address.
fn check_buf(ptr: *const u8, len: usize) -> Result<(), DiskError> {
    check_len(len)?;
    check_addr(ptr)
}

/// The piece size of `kind` in `class`: `explicit`, or the largest aligned piece within both the
/// dispatcher's `max_cost` and the class's in-flight bound (one aligned block when the bound is
/// below even that: the bound then serialises the class's pieces); 0 when not even one aligned
/// block fits `max_cost`.
fn piece_size(d: &Dispatcher, class: ClassId, kind: IoKind, explicit: Option<usize>) -> usize {
    if let Some(p) = explicit {
        return p;
    }
    let Some(max) = d.max_piece(kind) else {
        return 0;
    };
    let bound = d
        .class_config(class)
        .and_then(|c| c.max_in_flight())
        .map(|t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
    let within = match bound {
        Some(b) if b < d.max_cost() => d
            .disk()
            .max_aligned_bytes_within(kind, b)
            .unwrap_or(ALIGN as u64),
        _ => max,
    };
    usize::try_from(within.min(max)).unwrap_or(usize::MAX & !(ALIGN - 1))
}

/// `buf` as the crate's buffer: itself when it is an [`AlignedBuf`], else a view of `len` bytes
/// at `ptr` that keeps `buf` alive.
///
/// # Safety
/// `ptr` is `buf`'s stable memory, valid for `len` bytes while `buf` lives.
unsafe fn into_view<B: IoBuf>(buf: B, ptr: *mut u8, len: usize) -> AlignedBuf {
    let mut slot = Some(buf);
    if let Some(own) = (&mut slot as &mut dyn Any).downcast_mut::<Option<AlignedBuf>>() {
        return own.take().expect("just filled");
    }
    let buf = slot.take().expect("just filled");
    // SAFETY: the caller's guarantee.
    unsafe { AlignedBuf::lend(buf, ptr, len) }
}

/// The caller's buffer back from [`into_view`].
fn into_caller<B: 'static>(view: AlignedBuf) -> B {
    match view.unlend::<B>() {
        Ok(b) => b,
        Err(own) => {
            let mut slot = Some(own);
            (&mut slot as &mut dyn Any)
                .downcast_mut::<Option<B>>()
                .expect("an owned buffer went in as an AlignedBuf")
                .take()
                .expect("just filled")
        }
    }
}

/// The buffer back from the pieces, once no piece holds it. A piece's hold is dropped when its
/// operation completes or its request is refused, at most moments after its handle resolved:
/// an owned buffer still shared is copied (no I/O is in flight any more, so reading it is
/// sound); a caller's buffer is waited for (it cannot be copied), yielding in between.
async fn reclaim(mut shared: Arc<AlignedBuf>) -> AlignedBuf {
    loop {
        match Arc::try_unwrap(shared) {
            Ok(buf) => return buf,
            Err(still) if !still.is_lent() => {
                let mut copy = AlignedBuf::zeroed(still.len()).expect("same valid length");
                copy.copy_from_slice(&still);
                return copy;
            }
            Err(still) => {
                shared = still;
                tokio::task::yield_now().await;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatcher::{ClassConfig, DiskModel, Figures};

    #[test]
    fn background_transfers_go_to_the_shards_away_from_the_interrupts() {
        let d = Dispatcher::builder()
            .shards(2)
            .pin_threads(true)
            .disk(DiskModel::symmetric(Figures {
                iops: 100_000,
                bandwidth: 1_000_000_000,
            }))
            .class(ClassConfig::new("io", 1))
            .build()
            .unwrap();
        let (Some(c0), Some(c1)) = (d.shard_cpu(0), d.shard_cpu(1)) else {
            eprintln!("cannot pin threads: skipped");
            return;
        };
        if c0 == c1 {
            // One core: both shards take the interrupts, so every shard is used.
            assert_eq!(&*background_shards(&d, &[c0]), &[0, 1]);
            eprintln!("one core: the split was not checked");
            return;
        }
        assert_eq!(
            &*background_shards(&d, &[c1]),
            &[0],
            "away from shard 1's CPU"
        );
        assert_eq!(
            &*background_shards(&d, &[c0]),
            &[1],
            "away from shard 0's CPU"
        );
        // Every shard takes interrupts, none is known, or none is pinned where they arrive.
        assert_eq!(&*background_shards(&d, &[c0, c1]), &[0, 1]);
        assert_eq!(&*background_shards(&d, &[]), &[0, 1]);
        assert_eq!(&*background_shards(&d, &[usize::MAX]), &[0, 1]);
        d.shutdown();
    }
}
