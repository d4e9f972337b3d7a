//! Where the I/O runs: io_uring (a ring per thread, completions reaped by a helper thread), or a
//! small blocking pool where io_uring is unavailable. Both are runtime-agnostic: the caller's
//! future waits on a oneshot channel, so a shard's current-thread runtime never blocks.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, OnceLock};

use io_uring::{opcode, types, IoUring};
use tokio::sync::oneshot;

use super::buf::AlignedBuf;
use crate::sync::Arc;

/// The environment variable that chooses the I/O backend when [`Backend::Auto`] is asked for:
/// `blocking` forces the blocking pool, `io_uring` insists on io_uring, anything else (or
/// unset) means automatic.
pub const BACKEND_ENV: &str = "IOTHROTTLE_IO_BACKEND";

/// Which mechanism runs a [`ThrottledFile`](super::ThrottledFile)'s reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// io_uring when the kernel allows it, else the blocking pool; the environment variable
    /// [`BACKEND_ENV`] can force either.
    #[default]
    Auto,
    /// io_uring only: opening fails when the kernel refuses it.
    IoUring,
    /// The blocking pool (`pread`/`pwrite` on a few helper threads), never io_uring.
    Blocking,
}

/// The backend actually used, once [`Backend::Auto`] is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// io_uring.
    IoUring,
    /// The blocking pool.
    Blocking,
}

impl Backend {
    /// Resolves the choice: reads [`BACKEND_ENV`] for `Auto`, and checks that io_uring works
    /// (once per process) when it is wanted.
    pub fn resolve(self) -> io::Result<Resolved> {
        let wanted = match self {
            Backend::Auto => match std::env::var(BACKEND_ENV).as_deref() {
                Ok("blocking") => Backend::Blocking,
                Ok("io_uring") => Backend::IoUring,
                _ => Backend::Auto,
            },
            b => b,
        };
        match wanted {
            Backend::Blocking => Ok(Resolved::Blocking),
            Backend::IoUring => uring_available().map(|()| Resolved::IoUring),
            Backend::Auto => Ok(match uring_available() {
                Ok(()) => Resolved::IoUring,
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); using the blocking pool");
                    Resolved::Blocking
                }
            }),
        }
    }
}

/// Whether a ring can be set up here (probed once: `io_uring_disabled`, seccomp, old kernels).
fn uring_available() -> io::Result<()> {
    static PROBE: OnceLock<Result<(), (io::ErrorKind, String)>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            IoUring::new(2)
                .map(drop)
                .map_err(|e| (e.kind(), e.to_string()))
        })
        .clone()
        .map_err(|(kind, msg)| io::Error::new(kind, msg))
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Read,
    Write,
    /// Reserve `len` bytes at `offset` (`fallocate` with `FALLOC_FL_KEEP_SIZE`: blocks are
    /// allocated, the size is left to the write, so a failed reservation changes nothing the
    /// file's readers can see).
    Fallocate,
}

/// One positional operation and everything it needs kept alive while the kernel works.
///
/// Invariant: `buf`, when present, covers `start..start + len`, and no other operation nor any
/// reference to the buffer's bytes exists for that range while this one is in flight (the
/// callers split one buffer into disjoint ranges and do not look at it until every operation
/// has completed).
pub(crate) struct RawIo {
    pub(crate) kind: OpKind,
    pub(crate) file: Arc<File>,
    pub(crate) buf: Option<Arc<AlignedBuf>>,
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) offset: u64,
}

impl RawIo {
    fn ptr(&self) -> *mut u8 {
        match &self.buf {
            // SAFETY (pointer arithmetic only): `start + len <= buf.len()` (type invariant), so
            // the result stays inside the allocation.
            Some(b) => unsafe { b.raw().add(self.start) },
            None => std::ptr::null_mut(),
        }
    }
}

/// Runs `io` on `backend`; resolves to the kernel's byte count (or 0 for a reservation).
pub(crate) async fn run(backend: Resolved, io: RawIo) -> io::Result<usize> {
    let rx = match backend {
        Resolved::IoUring => match uring_submit(io) {
            Ok(rx) => rx,
            Err((e, Some(io))) => {
                tracing::warn!("io_uring submission failed ({e}); running on the blocking pool");
                pool_submit(io)?
            }
            Err((e, None)) => return Err(e),
        },
        Resolved::Blocking => pool_submit(io)?,
    };
    let res = rx
        .await
        .map_err(|_| io::Error::other("the I/O backend dropped the operation"))?;
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

// ---- io_uring -----------------------------------------------------------------------------------

/// Submission queue entries per ring.
const SQ_ENTRIES: u32 = 256;
/// Completion queue entries per ring; also the most operations one ring keeps in flight.
const CQ_ENTRIES: u32 = 4096;

/// A ring and the operations in flight on it.
struct Ring {
    ring: IoUring,
    /// In flight, by `user_data`: the completion's receiver and what must outlive the kernel's
    /// use of it (the file, the buffer).
    pending: HashMap<u64, (oneshot::Sender<i32>, RawIo)>,
    next: u64,
    /// The owning thread has exited: the reaper stops once `pending` is empty.
    closing: bool,
}

/// A ring shared by the thread that submits on it and its reaper thread.
struct Driver {
    inner: Mutex<Ring>,
    /// Registered with the ring: the kernel adds to it for every completion.
    eventfd: OwnedFd,
}

impl Driver {
    fn new() -> io::Result<Arc<Driver>> {
        let ring = IoUring::builder()
            .setup_cqsize(CQ_ENTRIES)
            .build(SQ_ENTRIES)?;
        // SAFETY: plain syscall with no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        let driver = Arc::new(Driver {
            inner: Mutex::new(Ring {
                ring,
                pending: HashMap::new(),
                next: 0,
                closing: false,
            }),
            eventfd,
        });
        let reaper = driver.clone();
        std::thread::Builder::new()
            .name("iothrottle-uring-reaper".into())
            .spawn(move || reap(reaper))?;
        Ok(driver)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic while holding the lock cannot leave the ring inconsistent in a way that
        // matters more than losing the I/O: carry on with the data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to our own eventfd.
        let _ = unsafe {
            libc::write(
                self.eventfd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// The reaper: sleeps on the eventfd, hands completions to their futures, and drops what the
/// kernel no longer uses. It exits once the owning thread is gone and nothing is in flight, so
/// no buffer is ever freed under the kernel.
fn reap(driver: Arc<Driver>) {
    let mut count = [0u8; 8];
    loop {
        // SAFETY: reads at most 8 bytes into a live local buffer of 8 bytes.
        let n = unsafe {
            libc::read(
                driver.eventfd.as_raw_fd(),
                count.as_mut_ptr().cast(),
                count.len(),
            )
        };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        let mut done = Vec::new();
        let exit = {
            let mut g = driver.lock();
            // Entries left queued by a failed submit, or completions the kernel holds back
            // after an overflow: one more enter hands them over (skipped otherwise: it is a
            // syscall per wake).
            let stalled = {
                let sq = g.ring.submission();
                !sq.is_empty() || sq.cq_overflow()
            };
            if stalled {
                let _ = g.ring.submit();
            }
            let Ring { ring, pending, .. } = &mut *g;
            for cqe in ring.completion() {
                if let Some(p) = pending.remove(&cqe.user_data()) {
                    done.push((p, cqe.result()));
                }
            }
            g.closing && g.pending.is_empty()
        };
        for ((tx, io), res) in done {
            // The kernel is done with the buffer: drop our hold on it before waking the owner,
            // so that the owner finds it unshared.
            drop(io);
            let _ = tx.send(res);
        }
        if exit {
            return;
        }
    }
}

/// The calling thread's ring, closed when the thread exits.
struct Local(Option<Arc<Driver>>);

impl Drop for Local {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            d.lock().closing = true;
            d.notify();
        }
    }
}

thread_local! {
    static LOCAL: std::cell::RefCell<Local> = const { std::cell::RefCell::new(Local(None)) };
}

type SubmitFailure = (io::Error, Option<RawIo>);

fn local_driver() -> io::Result<Arc<Driver>> {
    LOCAL
        .try_with(|l| {
            let mut l = l.borrow_mut();
            if let Some(d) = &l.0 {
                return Ok(d.clone());
            }
            let d = Driver::new()?;
            l.0 = Some(d.clone());
            Ok(d)
        })
        .unwrap_or_else(|_| Err(io::Error::other("thread is exiting")))
}

fn uring_submit(io: RawIo) -> Result<oneshot::Receiver<i32>, SubmitFailure> {
    let driver = match local_driver() {
        Ok(d) => d,
        Err(e) => return Err((e, Some(io))),
    };
    let fd = types::Fd(io.file.as_raw_fd());
    let len = match u32::try_from(io.len) {
        Ok(l) => l,
        Err(_) => return Err((io::Error::from_raw_os_error(libc::EINVAL), None)),
    };
    let mut g = driver.lock();
    if g.pending.len() >= CQ_ENTRIES as usize {
        return Err((io::Error::from_raw_os_error(libc::EBUSY), Some(io)));
    }
    let id = g.next;
    g.next = g.next.wrapping_add(1);
    let entry = match io.kind {
        OpKind::Read => opcode::Read::new(fd, io.ptr(), len)
            .offset(io.offset)
            .build(),
        OpKind::Write => opcode::Write::new(fd, io.ptr(), len)
            .offset(io.offset)
            .build(),
        OpKind::Fallocate => opcode::Fallocate::new(fd, io.len as u64)
            .offset(io.offset)
            .mode(libc::FALLOC_FL_KEEP_SIZE)
            .build(),
    }
    .user_data(id);
    // SAFETY: the entry's buffer (`io.buf`, range `start..start+len`) and file stay alive until
    // the reaper takes the completion: `io` goes into `pending` below, before the entry can be
    // submitted, and only the reaper removes it, after the kernel posted the completion.
    if unsafe { g.ring.submission().push(&entry) }.is_err() {
        // The submission queue is full: hand its entries to the kernel, then there is room.
        if let Err(e) = g.ring.submit() {
            return Err((e, Some(io)));
        }
        // SAFETY: as above.
        if unsafe { g.ring.submission().push(&entry) }.is_err() {
            return Err((io::Error::from_raw_os_error(libc::EBUSY), Some(io)));
        }
    }
    let (tx, rx) = oneshot::channel();
    g.pending.insert(id, (tx, io));
    if let Err(e) = g.ring.submit() {
        // The entry stays queued (its buffer held in `pending`); the reaper submits it on its
        // next wake. Wake it now.
        tracing::warn!("io_uring submit failed ({e}); the reaper retries");
        drop(g);
        driver.notify();
    }
    Ok(rx)
}

// ---- the blocking pool --------------------------------------------------------------------------

/// Threads of the blocking pool.
const POOL_THREADS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

fn pool() -> io::Result<&'static Mutex<std::sync::mpsc::Sender<Job>>> {
    static POOL: OnceLock<Result<Mutex<std::sync::mpsc::Sender<Job>>, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..POOL_THREADS {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("iothrottle-io-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        Ok(Mutex::new(tx))
    })
    .as_ref()
    .map_err(|e| io::Error::other(e.clone()))
}

fn pool_submit(io: RawIo) -> io::Result<oneshot::Receiver<i32>> {
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let res = blocking(&io);
        // Drop our hold on the buffer before waking the owner.
        drop(io);
        let _ = tx.send(res);
    });
    pool()?
        .lock()
        .map_err(|_| io::Error::other("the blocking pool is poisoned"))?
        .send(job)
        .map_err(|_| io::Error::other("the blocking pool is gone"))?;
    Ok(rx)
}

/// Runs one operation with a blocking syscall; the result as io_uring reports it (`-errno` on
/// failure).
fn blocking(io: &RawIo) -> i32 {
    let fd: RawFd = io.file.as_raw_fd();
    let Ok(offset) = libc::off_t::try_from(io.offset) else {
        return -libc::EINVAL;
    };
    let Ok(len) = libc::off_t::try_from(io.len) else {
        return -libc::EINVAL;
    };
    loop {
        // SAFETY: `ptr()` is valid for `len` bytes of this operation's exclusive range of a live
        // buffer (`RawIo` invariant); the file descriptor is kept open by `io.file`.
        let r = unsafe {
            match io.kind {
                OpKind::Read => libc::pread(fd, io.ptr().cast(), io.len, offset) as i64,
                OpKind::Write => libc::pwrite(fd, io.ptr().cast(), io.len, offset) as i64,
                OpKind::Fallocate => {
                    match libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, offset, len) {
                        0 => 0,
                        _ => -1,
                    }
                }
            }
        };
        if r >= 0 {
            return i32::try_from(r).unwrap_or(i32::MAX);
        }
        let errno = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -errno;
        }
    }
}
