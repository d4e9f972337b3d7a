//! Where the I/O runs: io_uring (a ring per thread), or a small blocking pool where io_uring is
//! unavailable. On a dispatcher shard the ring's completions are reaped by a task on the shard's
//! own runtime, woken by its I/O driver through the ring's eventfd; elsewhere by a helper thread
//! sleeping on that eventfd. The caller's future waits on a oneshot channel, so a shard's
//! current-thread runtime never blocks.
//!
//! On a shard, submissions are batched: an operation's entry is queued on the ring, and a
//! flush task on the shard's runtime hands every queued entry to the kernel with one
//! `io_uring_enter`. Woken by the first entry queued since its last run, it runs after the
//! tasks already scheduled, so the requests the shard dispatched in one round (each a task) go
//! to the device together, as a program driving its own ring would submit them. Elsewhere each
//! operation is submitted at once.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, OnceLock};
use std::task::{Poll, Waker};

use io_uring::{opcode, types, IoUring};
use slab::Slab;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use super::buf::AlignedBuf;
use crate::dispatcher::{
    boxed_task, result_channel, BoxTask, Completion, IoHandle, ResultTx, Task,
};
use crate::error::DispatchError;
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
            // SAFETY: pointer arithmetic only; `start + len <= buf.len()` (type invariant), so
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
    /// In flight, keyed by `user_data`: where the completion goes and what must outlive the
    /// kernel's use of it (the file, the buffer). An entry leaves only when its completion is
    /// reaped, so a dropped (cancelled) future leaves its buffer here until the kernel is done
    /// with it. A key is used again only once its completion was reaped: no two operations in
    /// flight share a `user_data`.
    pending: Slab<(Target, RawIo)>,
    /// The owning thread has exited: the reaper stops once `pending` is empty.
    closing: bool,
    /// Who reaps. Invariant: `pending` is empty or `reaper` is not [`Reaper::None`] (a reaper
    /// is started before an entry is added, and a reaper gives up its role only once `pending`
    /// is empty, or hands it to a thread).
    reaper: Reaper,
    /// The flush task's waker, once it has run (only when `reaper` is [`Reaper::Task`]).
    flusher: Option<Waker>,
    /// Counts the reaper tasks started on this ring: a flush task serves the one it was
    /// started with, and ends once that one has given up the ring.
    tasks: u64,
    /// Entries are queued for the flush task and it has been woken (or not yet run): the next
    /// deferred submission need not wake it again.
    flush_due: bool,
    /// `io_uring_enter` calls made to submit entries (a statistic; tests check the batching).
    enters: u64,
    /// Completions handed over by the last reap that found any.
    last_batch: usize,
}

impl Ring {
    /// Hands every queued entry to the kernel (one `io_uring_enter`).
    fn submit(&mut self) -> io::Result<usize> {
        self.enters += 1;
        self.ring.submit()
    }
}

/// Where a completion goes.
enum Target {
    /// A oneshot, awaited by [`run`]'s future (on any thread).
    Remote(oneshot::Sender<i32>),
    /// The owning shard's [`LOCAL_DONE`] entry of the same key: a request that the shard
    /// submitted when it dispatched it ([`io_task`]), with no future and no task of its own.
    Local,
}

/// A reaped completion's owner, taken out of the tables under the ring's lock.
enum Done {
    Remote(oneshot::Sender<i32>),
    /// `None` when the shard's table no longer holds it (reaped on another thread after the
    /// shard's runtime went: its tokens were released then).
    Local(Option<LocalIo>),
}

/// Who reaps a ring's completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reaper {
    /// Nobody (nothing is in flight).
    None,
    /// A task on the owning thread's runtime, woken by the runtime's I/O driver through the
    /// eventfd (on the dispatcher's shards): a completion never leaves the thread.
    Task,
    /// A helper thread sleeping on the eventfd (threads without a tokio I/O driver).
    Thread,
}

/// A ring shared by the thread that submits on it and its reaper.
struct Driver {
    inner: Mutex<Ring>,
    /// Registered with the ring: the kernel adds to it for every completion. Non-blocking (the
    /// task reaper reads it after readiness; the thread reaper polls before reading).
    eventfd: OwnedFd,
}

impl Driver {
    fn new() -> io::Result<Arc<Driver>> {
        let ring = IoUring::builder()
            .setup_cqsize(CQ_ENTRIES)
            .build(SQ_ENTRIES)?;
        // SAFETY: plain syscall with no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        Ok(Arc::new(Driver {
            inner: Mutex::new(Ring {
                ring,
                pending: Slab::new(),
                closing: false,
                reaper: Reaper::None,
                flusher: None,
                tasks: 0,
                flush_due: false,
                enters: 0,
                last_batch: 0,
            }),
            eventfd,
        }))
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

    /// Resets the eventfd's count (non-blocking; a zero count is left as it is).
    fn drain_eventfd(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer of 8 bytes.
        let _ = unsafe {
            libc::read(
                self.eventfd.as_raw_fd(),
                count.as_mut_ptr().cast(),
                count.len(),
            )
        };
    }

    /// Sleeps until the eventfd's count is non-zero (or a signal interrupts).
    fn wait_eventfd(&self) {
        let mut pfd = libc::pollfd {
            fd: self.eventfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live `pollfd`, count 1, no timeout.
        let _ = unsafe { libc::poll(&mut pfd, 1, -1) };
    }

    /// Hands every completion posted so far to its future; `stop` decides, under the same lock,
    /// whether the calling reaper gives up its role.
    fn reap(&self, stop: impl FnOnce(&mut Ring) -> bool) -> bool {
        let mut done;
        let exit = {
            let mut g = self.lock();
            // Entries left queued by a failed submit, or completions the kernel holds back
            // after an overflow: one more enter hands them over (skipped otherwise: it is a
            // syscall per wake).
            let stalled = {
                let sq = g.ring.submission();
                !sq.is_empty() || sq.cq_overflow()
            };
            if stalled {
                let _ = g.submit();
            }
            let Ring { ring, pending, .. } = &mut *g;
            let cq = ring.completion();
            // Sized once for the whole batch (a virtio disk posts 32 at a time): growing it
            // one push at a time cost a fifth of the shard's allocation and copying time.
            done = Vec::with_capacity(cq.len());
            for cqe in cq {
                let Some((target, io)) = usize::try_from(cqe.user_data())
                    .ok()
                    .and_then(|key| pending.try_remove(key).map(|p| (key, p)))
                    .map(|(key, (target, io))| (take_target(key, target), io))
                else {
                    continue;
                };
                done.push((target, io, cqe.result()));
            }
            if !done.is_empty() {
                g.last_batch = done.len();
            }
            stop(&mut g)
        };
        for (target, io, res) in done {
            // The kernel is done with the buffer: drop our hold on it before waking the owner,
            // so that the owner finds it unshared.
            drop(io);
            match target {
                Done::Remote(tx) => {
                    let _ = tx.send(res);
                }
                Done::Local(Some(local)) => local.finish(res),
                Done::Local(None) => {}
            }
        }
        exit
    }
}

/// Where the completion of the operation reaped under `key` goes. A shard's own operation is
/// taken out of [`LOCAL_DONE`] at once, under the ring's lock, so that the key is free in both
/// tables before another operation can take it. On any other thread (a reaper thread, after the
/// shard's runtime went) the table holds nothing: the shard dropped its entries with the
/// runtime.
fn take_target(key: usize, target: Target) -> Done {
    match target {
        Target::Remote(tx) => Done::Remote(tx),
        Target::Local => Done::Local(
            LOCAL_DONE
                .try_with(|t| t.borrow_mut().get_mut(key).and_then(Option::take))
                .ok()
                .flatten(),
        ),
    }
}

/// Starts a reaper for `driver` (whose lock the caller holds as `g`): a task on this thread's
/// runtime when this thread is a dispatcher shard (a current-thread runtime with an I/O
/// driver), else a thread.
fn start_reaper(driver: &Arc<Driver>, g: &mut Ring) -> io::Result<()> {
    if crate::dispatcher::on_any_shard() {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
                let _enter = handle.enter();
                // SAFETY: `EventFd` returns the driver's eventfd, which the `Arc` it holds keeps
                // open (the `OwnedFd` is closed only when the last `Arc<Driver>` goes, and the
                // `AsyncFd` owns one) and which is never replaced.
                let afd = unsafe {
                    AsyncFd::register_with_interest(EventFd(driver.clone()), Interest::READABLE)
                }?;
                g.tasks += 1;
                handle.spawn(reap_task(afd));
                handle.spawn(flush_task(driver.clone(), g.tasks));
                g.reaper = Reaper::Task;
                // Until the flush task first runs (it then submits what is queued) there is no
                // waker to call.
                g.flush_due = true;
                return Ok(());
            }
        }
    }
    spawn_reaper_thread(driver.clone(), false)?;
    g.reaper = Reaper::Thread;
    Ok(())
}

/// The eventfd of a driver, kept open by the `Arc` for as long as the registration lives.
struct EventFd(Arc<Driver>);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.eventfd.as_raw_fd()
    }
}

/// Gives the ring to a thread if the task stops (its runtime shut down) with operations still
/// in flight, so that their buffers live until their completions.
struct TaskGuard(Arc<Driver>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        // The shard's runtime is going: the operations it submitted itself will be reaped
        // elsewhere, if at all. Their handles resolve to `ShutDown` and their tokens are
        // released here, on the shard, as a dropped task's would be.
        let locals = LOCAL_DONE
            .try_with(|t| std::mem::take(&mut *t.borrow_mut()))
            .unwrap_or_default();
        drop(locals);
        let mut g = self.0.lock();
        if g.reaper != Reaper::Task {
            return;
        }
        // The flush task goes with the runtime, or ends when woken should the runtime live on
        // (this task stopped on an error): whoever reaps next submits what is queued.
        let flusher = g.flusher.take();
        g.flush_due = false;
        if g.pending.is_empty() {
            g.reaper = Reaper::None;
            drop(g);
            if let Some(w) = flusher {
                w.wake();
            }
            return;
        }
        match spawn_reaper_thread(self.0.clone(), true) {
            Ok(()) => g.reaper = Reaper::Thread,
            Err(e) => {
                // Nobody can reap: never free a buffer the kernel may still write. Leak the
                // ring and what it holds instead.
                tracing::error!("cannot start an io_uring reaper thread ({e}); leaking the ring");
                std::mem::forget(self.0.clone());
            }
        }
        drop(g);
        if let Some(w) = flusher {
            w.wake();
        }
    }
}

/// The task reaper: woken by the runtime's I/O driver when the eventfd is readable.
async fn reap_task(afd: AsyncFd<EventFd>) {
    let driver = afd.get_ref().0.clone();
    let _guard = TaskGuard(driver.clone());
    loop {
        let mut ready = match afd.readable().await {
            Ok(r) => r,
            Err(e) => {
                // The guard hands what is in flight to a thread.
                tracing::warn!("io_uring eventfd not pollable ({e}); reaping on a thread");
                return;
            }
        };
        // Cleared before the count is read: a completion posted after the read makes the fd
        // readable again, so none is missed.
        ready.clear_ready();
        driver.drain_eventfd();
        driver.reap(|_| false);
    }
}

/// The flush task of a shard's ring, started with the `task`-th reaper task: each time it is
/// woken, it submits every entry queued since its last run with one `io_uring_enter`. It ends
/// once that reaper task has given up the ring (its runtime went, or it stopped on an error and
/// the ring went to a thread); entries still queued are submitted by whoever reaps next (the
/// task reaper, or the thread the ring is handed to), which submits a non-empty queue before
/// reaping.
async fn flush_task(driver: Arc<Driver>, task: u64) {
    std::future::poll_fn(|cx| {
        let mut g = driver.lock();
        if g.reaper != Reaper::Task || g.tasks != task {
            return Poll::Ready(());
        }
        g.flush_due = false;
        if !g.ring.submission().is_empty() {
            if let Err(e) = g.submit() {
                // The entries stay queued (their buffers held in `pending`); the reaper submits
                // them on its next wake. Wake it now.
                tracing::warn!("io_uring submit failed ({e}); the reaper retries");
                drop(g);
                driver.notify();
                g = driver.lock();
            }
        }
        if !g.flusher.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            g.flusher = Some(cx.waker().clone());
        }
        Poll::Pending
    })
    .await
}

fn spawn_reaper_thread(driver: Arc<Driver>, until_idle: bool) -> io::Result<()> {
    std::thread::Builder::new()
        .name("iothrottle-uring-reaper".into())
        .spawn(move || reap_thread(driver, until_idle))
        .map(drop)
}

/// The thread reaper: sleeps on the eventfd, hands completions to their futures, and drops what
/// the kernel no longer uses. It exits once nothing is in flight and either the owning thread
/// is gone or (`until_idle`, a ring handed over by a stopped task) at once, so no buffer is
/// ever freed under the kernel.
fn reap_thread(driver: Arc<Driver>, until_idle: bool) {
    loop {
        // The count is reset before reaping: a completion posted after the reap finds it zero
        // and raises it, so the wait below returns.
        driver.drain_eventfd();
        let exit = driver.reap(|g| {
            let stop = g.pending.is_empty() && (until_idle || g.closing);
            if stop {
                g.reaper = Reaper::None;
            }
            stop
        });
        if exit {
            return;
        }
        driver.wait_eventfd();
    }
}

/// Submits the entries queued on the calling thread's ring and hands the completions already
/// posted to their futures, when a task on this thread is its reaper (a dispatcher shard);
/// returns how deep the ring runs: the operations still in flight, or as many as the last
/// completion batch held if that is more (0 off a shard). A polling shard calls it each round,
/// so a completion reaches its future without waiting for the eventfd to go through the
/// runtime's I/O driver (the reaper task then finds nothing left). When the ring runs deeper
/// than `max_in_flight` nothing is reaped here: the reaper task takes the completions in
/// batches, as the eventfd wakes it. The last batch counts because a deep queue drains to
/// nothing in flight between batches (the device completes them together), and then its
/// next batch is still coming.
pub(crate) fn reap_here(max_in_flight: usize) -> usize {
    let driver = match LOCAL.try_with(|l| l.borrow().0.clone()) {
        Ok(Some(d)) => d,
        _ => return 0,
    };
    {
        let mut g = driver.lock();
        if g.reaper != Reaper::Task {
            return 0;
        }
        if !g.ring.submission().is_empty() {
            // Queued for the flush task: submitted now, so a polling shard never waits on a
            // request it has not handed to the kernel. A failure leaves them to the flush task.
            let _ = g.submit();
        }
        let depth = g.pending.len().max(g.last_batch);
        if g.pending.is_empty() || depth > max_in_flight || g.ring.completion().is_empty() {
            return depth;
        }
    }
    let mut depth = 0;
    driver.reap(|g| {
        depth = g.pending.len().max(g.last_batch);
        false
    });
    depth
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

/// Runs `f` with the calling thread's ring, set up on first use (no reference count is taken:
/// an operation costs no atomic for it).
fn with_local_driver<R>(f: impl FnOnce(io::Result<&Arc<Driver>>) -> R) -> R {
    let mut f = Some(f);
    let outcome = LOCAL.try_with(|l| {
        let f = f.take().expect("called once");
        if let Some(d) = &l.borrow().0 {
            return f(Ok(d));
        }
        let made = Driver::new();
        let d = match made {
            Ok(d) => l.borrow_mut().0.insert(d).clone(),
            Err(e) => return f(Err(e)),
        };
        f(Ok(&d))
    });
    match outcome {
        Ok(r) => r,
        Err(_) => (f.take().expect("not called: the thread is exiting"))(Err(io::Error::other(
            "thread is exiting",
        ))),
    }
}

fn uring_submit(io: RawIo) -> Result<oneshot::Receiver<i32>, SubmitFailure> {
    let (tx, rx) = oneshot::channel();
    uring_push(io, false, |_| Target::Remote(tx))?;
    Ok(rx)
}

/// Queues `io` on this thread's ring; `target(id)` says where its completion goes, called
/// under the ring's lock once the entry is queued. With `local`, only a ring reaped by a task
/// on this thread (a shard's) will do: anything else is refused with the operation given back.
fn uring_push(
    io: RawIo,
    local: bool,
    target: impl FnOnce(usize) -> Target,
) -> Result<(), SubmitFailure> {
    with_local_driver(|driver| match driver {
        Ok(driver) => push_on(driver, io, local, target),
        Err(e) => Err((e, Some(io))),
    })
}

/// [`uring_push`] on `driver`, the calling thread's ring.
fn push_on(
    driver: &Arc<Driver>,
    io: RawIo,
    local: bool,
    target: impl FnOnce(usize) -> Target,
) -> Result<(), SubmitFailure> {
    let fd = types::Fd(io.file.as_raw_fd());
    let len = match u32::try_from(io.len) {
        Ok(l) => l,
        Err(_) => return Err((io::Error::from_raw_os_error(libc::EINVAL), None)),
    };
    let mut g = driver.lock();
    if g.pending.len() >= CQ_ENTRIES as usize {
        return Err((io::Error::from_raw_os_error(libc::EBUSY), Some(io)));
    }
    if g.reaper == Reaper::None {
        if let Err(e) = start_reaper(driver, &mut g) {
            return Err((e, Some(io)));
        }
    }
    if local && g.reaper != Reaper::Task {
        return Err((io::Error::other("not reaped on this thread"), Some(io)));
    }
    // The key the entry gets below (nothing is inserted or removed in between).
    let id = g.pending.vacant_key();
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
    .user_data(id as u64);
    // SAFETY: the entry's buffer (`io.buf`, range `start..start+len`) and file stay alive until
    // the reaper takes the completion: `io` goes into `pending` below, before the entry can be
    // submitted, and only the reaper removes it, after the kernel posted the completion.
    if unsafe { g.ring.submission().push(&entry) }.is_err() {
        // The submission queue is full: hand its entries to the kernel, then there is room.
        if let Err(e) = g.submit() {
            return Err((e, Some(io)));
        }
        // SAFETY: as above.
        if unsafe { g.ring.submission().push(&entry) }.is_err() {
            return Err((io::Error::from_raw_os_error(libc::EBUSY), Some(io)));
        }
    }
    let key = g.pending.insert((target(id), io));
    debug_assert_eq!(key, id);
    if g.reaper == Reaper::Task {
        // On a shard: the flush task submits it with whatever else this round queues.
        let wake = if g.flush_due {
            None
        } else {
            g.flush_due = true;
            g.flusher.clone()
        };
        drop(g);
        if let Some(w) = wake {
            w.wake();
        }
        return Ok(());
    }
    if let Err(e) = g.submit() {
        // The entry stays queued (its buffer held in `pending`); the reaper submits it on its
        // next wake. Wake it now.
        tracing::warn!("io_uring submit failed ({e}); the reaper retries");
        drop(g);
        driver.notify();
    }
    Ok(())
}

// ---- operations a shard submits itself -----------------------------------------------------------

/// A request whose operation the shard submits when it dispatches it: on io_uring, from the
/// dispatch itself, with no future and no task per request (a task's cell, its scheduling and
/// a second channel were most of what a read cost the shard beyond the kernel's own work); the
/// reaper hands the completion to the handle and releases the tokens. Anywhere else (the
/// blocking pool, a ring that cannot take it) it runs as [`run`]'s future, as any request does.
struct IoTask {
    backend: Resolved,
    io: RawIo,
    tx: ResultTx<io::Result<usize>>,
}

/// A dispatcher task for `io` and the handle to its result (the kernel's byte count).
pub(crate) fn io_task(backend: Resolved, io: RawIo) -> (BoxTask, IoHandle<io::Result<usize>>) {
    let (tx, handle) = result_channel();
    (Box::new(IoTask { backend, io, tx }), handle)
}

impl Task for IoTask {
    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    fn fail(self: Box<Self>, err: DispatchError) {
        let _ = self.tx.send(Err(err));
    }

    fn spawn_local(self: Box<Self>, done: Completion) {
        let IoTask { backend, io, tx } = *self;
        let io = if backend == Resolved::IoUring {
            // Given to the table under the ring's lock, once the entry is queued; left here
            // (and run as a future below) if the ring refuses it.
            let mut local = Some(LocalIo { tx, done });
            match uring_push(io, true, |id| {
                if let Some(l) = local.take() {
                    let _ = LOCAL_DONE.try_with(|t| {
                        let mut t = t.borrow_mut();
                        if t.len() <= id {
                            t.resize_with(id + 1, || None);
                        }
                        t[id] = Some(l);
                    });
                }
                Target::Local
            }) {
                Ok(()) => return,
                Err((e, io)) => {
                    let LocalIo { tx, done } = local.take().expect("not taken on failure");
                    // Dropping `done` here would release the tokens inside the shard's
                    // dispatch: the future does it later, as for any request.
                    let fut = async move {
                        match io {
                            Some(io) => run(backend, io).await,
                            None => Err(e),
                        }
                    };
                    return boxed_task(fut, tx).spawn_local(done);
                }
            }
        } else {
            io
        };
        boxed_task(run(backend, io), tx).spawn_local(done);
    }
}

/// What a shard keeps of an operation it submitted itself, until its completion is reaped.
struct LocalIo {
    tx: ResultTx<io::Result<usize>>,
    done: Completion,
}

impl LocalIo {
    /// The kernel's result to the handle, then the tokens back (the order a task's end has).
    fn finish(self, res: i32) {
        let out = if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res as usize)
        };
        let _ = self.tx.send(Ok(out));
        drop(self.done);
    }
}

thread_local! {
    /// A shard's operations in flight that it submitted itself, at the index of their key in
    /// the ring's `pending` slab (see [`Target::Local`]). Only the shard's own thread touches
    /// it: the completion holds the shard's state, which never leaves its thread.
    static LOCAL_DONE: std::cell::RefCell<Vec<Option<LocalIo>>> =
        const { std::cell::RefCell::new(Vec::new()) };
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

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::io::Read;
    use std::os::fd::FromRawFd;
    use std::time::Duration;

    use super::*;
    use crate::dispatcher::{ClassConfig, DiskModel, Dispatcher, IoRequest};

    /// Runs `fut` on a new current-thread runtime with a timer and no I/O driver (so nothing
    /// but the ring's own reaper can complete it); a minute without its completion fails the
    /// test instead of hanging it.
    fn reaped_within_a_minute<F: Future>(fut: F) -> F::Output {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), fut)
                .await
                .expect("the completion was never reaped")
        })
    }

    /// A dispatcher with one unpinned shard and one class, on a fast modelled disk: the tests
    /// run their I/O inside a request on that shard.
    fn one_shard() -> (Dispatcher, crate::dispatcher::ClassId) {
        let mut b = Dispatcher::builder()
            .shards(1)
            .pin_threads(false)
            .disk(DiskModel::new(1 << 30, 1 << 30, 100_000, 100_000));
        let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
        (b.build().unwrap(), class)
    }

    /// Who reaps the calling thread's ring, if it has one.
    fn reaper_here() -> Option<Reaper> {
        LOCAL.with(|l| l.borrow().0.as_ref().map(|d| d.lock().reaper))
    }

    /// A pipe whose one-page buffer is full of 1s: a write into it waits for a reader.
    fn full_pipe() -> (File, Arc<File>) {
        let mut fds = [0; 2];
        assert_eq!(
            // SAFETY: `fds` has room for the two descriptors.
            unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_DIRECT | libc::O_CLOEXEC) },
            0
        );
        // SAFETY: both descriptors were just made and are owned by nothing else.
        let (rd, mut wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        assert!(
            // SAFETY: plain fcntl on our own descriptor.
            unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, super::super::ALIGN as i32) } >= 0
        );
        std::io::Write::write_all(&mut wr, &[1u8; super::super::ALIGN]).unwrap();
        (rd, Arc::new(wr))
    }

    /// Submits a write into a full pipe, drops its future while the write is in flight, and
    /// checks that the in-flight table still holds the buffer; then lets the write complete and
    /// checks that the buffer is released after the kernel wrote it out whole.
    async fn cancel_while_in_flight(expect: Reaper) {
        let page = super::super::ALIGN;
        let (mut rd, wr) = full_pipe();
        let buf = Arc::new(AlignedBuf::from_slice(&vec![9u8; page]).unwrap());
        let io = RawIo {
            kind: OpKind::Write,
            file: wr,
            buf: Some(buf.clone()),
            start: 0,
            len: page,
            offset: 0,
        };
        let mut fut = Box::pin(run(Resolved::IoUring, io));
        // One poll submits the write; the pipe is full, so it cannot complete.
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "the pipe is full");
        assert_eq!(reaper_here(), Some(expect));
        drop(fut);
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the cancelled write's buffer is held by the in-flight table"
        );
        // Make room: the kernel writes the buffer out, the reaper drops the table's hold.
        let mut got = vec![0u8; page];
        rd.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 1));
        while Arc::strong_count(&buf) > 1 {
            tokio::task::yield_now().await;
        }
        rd.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 9), "the whole buffer was written");
    }

    /// The class's requests in flight and completed, on shard 0.
    fn in_flight_and_completed(d: &Dispatcher) -> (u64, u64) {
        let c = &d.stats_blocking().classes[0];
        (c.in_flight, c.completed)
    }

    /// How many operations shard 0 submitted itself and has not reaped yet (asked on the shard,
    /// whose table it is).
    fn local_ops(d: &Dispatcher, class: crate::dispatcher::ClassId) -> usize {
        let probe = d
            .submit(class, IoRequest::tokens(1), async {
                LOCAL_DONE.with(|t| t.borrow().iter().flatten().count())
            })
            .unwrap();
        reaped_within_a_minute(probe).unwrap()
    }

    /// An operation that a shard submits itself ([`io_task`]) has no task to hold its tokens:
    /// it must count as in flight until the kernel completes it, even with its handle dropped,
    /// then resolve its handle, release its tokens and leave the shard's table, with the
    /// buffer's only other hold dropped before the handle hears of it.
    #[test]
    fn an_operation_the_shard_submits_itself_is_in_flight_until_reaped() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        let page = super::super::ALIGN;
        let (d, class) = one_shard();
        let (mut rd, wr) = full_pipe();
        let kept = Arc::new(AlignedBuf::from_slice(&vec![7u8; page]).unwrap());
        let dropped = Arc::new(AlignedBuf::from_slice(&vec![8u8; page]).unwrap());
        let write = IoRequest::write(page as u64);
        let cost = d.cost(&write);
        let (task, handle) = io_task(Resolved::IoUring, page_write(&wr, &kept));
        d.submit_costed(class, write, cost, task).unwrap();
        let (task, handle_dropped) = io_task(Resolved::IoUring, page_write(&wr, &dropped));
        d.submit_costed(class, write, cost, task).unwrap();
        // Polled, not timed: the pipe is full, so both writes wait in the kernel.
        while in_flight_and_completed(&d).0 < 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(handle_dropped);
        assert_eq!(
            local_ops(&d, class),
            2,
            "both writes are the shard's own, unreaped"
        );
        assert_eq!(
            in_flight_and_completed(&d).0,
            2,
            "the dropped handle's write too"
        );
        assert_eq!(Arc::strong_count(&kept), 2, "the ring holds the buffer");
        // Make room: the page of 1s, then the two writes' pages, in either order.
        let mut got = vec![0u8; page];
        rd.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 1));
        let mut seen = Vec::new();
        for _ in 0..2 {
            rd.read_exact(&mut got).unwrap();
            assert!(got.iter().all(|&b| b == got[0]), "a whole page");
            seen.push(got[0]);
        }
        seen.sort_unstable();
        assert_eq!(seen, [7, 8]);
        let n = reaped_within_a_minute(handle).unwrap().unwrap();
        assert_eq!(n, page);
        assert_eq!(
            Arc::strong_count(&kept),
            1,
            "the ring let go of the buffer before the handle resolved"
        );
        // The dropped handle's write ends on the shard, after its buffer was let go of.
        while in_flight_and_completed(&d).0 > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(Arc::strong_count(&dropped), 1);
        // The two writes and the one probe so far.
        assert_eq!(in_flight_and_completed(&d), (0, 3));
        assert_eq!(local_ops(&d, class), 0, "the table keeps nothing reaped");
        d.shutdown();
    }

    #[test]
    fn on_a_shard_completions_are_reaped_by_a_task_and_cancellation_keeps_the_buffer() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        let (d, class) = one_shard();
        let job = d
            .submit(class, IoRequest::write(4096), async {
                cancel_while_in_flight(Reaper::Task).await;
                // And a second operation after the first, on the same ring and task.
                cancel_while_in_flight(Reaper::Task).await;
            })
            .unwrap();
        reaped_within_a_minute(job).unwrap();
    }

    /// The calling thread's ring: entries queued and not yet submitted, and `io_uring_enter`
    /// calls made so far.
    fn ring_here() -> (usize, u64) {
        LOCAL.with(|l| {
            let d = l.borrow().0.clone().expect("this thread has a ring");
            let mut g = d.lock();
            let queued = g.ring.submission().len();
            (queued, g.enters)
        })
    }

    /// A write of `buf` (whole) into `wr`.
    fn page_write(wr: &Arc<File>, buf: &Arc<AlignedBuf>) -> RawIo {
        RawIo {
            kind: OpKind::Write,
            file: wr.clone(),
            buf: Some(buf.clone()),
            start: 0,
            len: buf.len(),
            offset: 0,
        }
    }

    /// Polls each of `futs` once, from the calling task, and checks that none is done (each
    /// write waits for room in a full pipe, or for the flush task).
    async fn poll_pending_once<F: Future + Unpin>(futs: &mut [F]) {
        std::future::poll_fn(|cx| {
            for f in futs.iter_mut() {
                assert!(
                    std::pin::Pin::new(&mut *f).poll(cx).is_pending(),
                    "the pipe is full"
                );
            }
            std::task::Poll::Ready(())
        })
        .await
    }

    /// On a shard, the operations started in one round go to the kernel together: eight writes
    /// into eight full pipes, each future polled once by one task, wait in the submission
    /// queue, and the flush task submits all eight with a single `io_uring_enter`. Each then
    /// completes with its whole page once its pipe is read.
    #[test]
    fn on_a_shard_one_round_of_operations_is_submitted_with_one_enter() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        let page = super::super::ALIGN;
        let (d, class) = one_shard();
        let job = d
            .submit(class, IoRequest::write(4096), async move {
                let pipes: Vec<_> = (0..8).map(|_| full_pipe()).collect();
                let mut futs: Vec<_> = pipes
                    .iter()
                    .map(|(_, wr)| {
                        let buf = Arc::new(AlignedBuf::from_slice(&vec![7u8; page]).unwrap());
                        Box::pin(run(Resolved::IoUring, page_write(wr, &buf)))
                    })
                    .collect();
                poll_pending_once(&mut futs).await;
                assert_eq!(reaper_here(), Some(Reaper::Task));
                let (queued, enters_before) = ring_here();
                assert_eq!(queued, 8, "all eight wait for the flush task");
                let mut rounds = 0;
                while ring_here().0 > 0 {
                    rounds += 1;
                    assert!(rounds < 10_000, "the flush task never ran");
                    tokio::task::yield_now().await;
                }
                assert_eq!(ring_here().1, enters_before + 1, "one enter for the round");
                for ((mut rd, _), fut) in pipes.into_iter().zip(futs) {
                    let mut got = vec![0u8; page];
                    rd.read_exact(&mut got).unwrap();
                    assert_eq!(fut.await.unwrap(), page);
                    rd.read_exact(&mut got).unwrap();
                    assert!(got.iter().all(|&b| b == 7), "the whole page was written");
                }
            })
            .unwrap();
        reaped_within_a_minute(job).unwrap();
    }

    /// A shard that stops while one of its operations is in flight hands the ring to a thread,
    /// which reaps the last completion: the kernel cancels the requests of a thread that exits
    /// (`-ECANCELED`), or the write finished first; either way the buffer is released only by
    /// that completion, and the pipe holds either nothing more or the whole page.
    #[test]
    fn a_shard_stopping_with_io_in_flight_hands_the_ring_to_a_thread() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        let page = super::super::ALIGN;
        let (mut rd, wr) = full_pipe();
        let buf = Arc::new(AlignedBuf::from_slice(&vec![9u8; page]).unwrap());
        let (d, class) = one_shard();
        let held = buf.clone();
        let job = d
            .submit(class, IoRequest::write(4096), async move {
                let io = RawIo {
                    kind: OpKind::Write,
                    file: wr,
                    buf: Some(held),
                    start: 0,
                    len: page,
                    offset: 0,
                };
                let mut fut = Box::pin(run(Resolved::IoUring, io));
                let first =
                    std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await;
                assert!(first.is_pending(), "the pipe is full");
                reaper_here()
            })
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(job).unwrap(), Some(Reaper::Task));
        // Joins the shard thread: its runtime and the reaper task are gone; only a handed-over
        // reaper can reap what the thread left in flight.
        d.shutdown();
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the in-flight buffer outlives the shard's runtime"
        );
        // Make room: the kernel retries the write, and cancels it (`-ECANCELED`) if its
        // submitting thread is gone. Polled, not timed: the test runner's timeout catches a
        // completion nobody reaps.
        let mut got = vec![0u8; page];
        rd.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 1));
        while Arc::strong_count(&buf) > 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The write end is closed now (the table dropped the file with the buffer): the rest is
        // the whole page or nothing.
        let mut rest = Vec::new();
        rd.read_to_end(&mut rest).unwrap();
        assert!(
            rest.is_empty() || (rest.len() == page && rest.iter().all(|&b| b == 9)),
            "{} bytes left",
            rest.len()
        );
    }

    /// Completions posted on the calling thread's ring and not yet reaped.
    fn posted_here() -> usize {
        LOCAL.with(|l| {
            let d = l.borrow().0.clone().expect("this thread has a ring");
            let mut g = d.lock();
            let posted = g.ring.completion().len();
            posted
        })
    }

    /// Spins (without yielding to the runtime, so the reaper task cannot run) until `n`
    /// completions are posted. The kernel posts them on this thread's next return from a
    /// system call. Polled, not timed: the test runner's timeout catches a hang.
    fn wait_posted(n: usize) {
        while posted_here() < n {
            std::thread::yield_now();
        }
    }

    /// On a shard, `reap_here` submits what is queued and hands posted completions to their
    /// futures at once (a polling shard calls it each round), as long as the ring runs at most
    /// as deep as asked: in flight, or in its last completion batch. Off a shard it does
    /// nothing.
    #[test]
    fn on_a_shard_reap_here_hands_posted_completions_to_their_futures_while_the_ring_is_shallow() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        // Off a shard: the ring (if any) is a reaper thread's.
        assert_eq!(reap_here(1), 0);
        let (d, class) = one_shard();
        let job = d
            .submit(class, IoRequest::write(4096), async {
                let page = super::super::ALIGN;
                let pipes = [full_pipe(), full_pipe()];
                let bufs: Vec<_> = (0..2u8)
                    .map(|i| Arc::new(AlignedBuf::from_slice(&vec![i + 8; page]).unwrap()))
                    .collect();
                let mut futs: Vec<_> = pipes
                    .iter()
                    .zip(&bufs)
                    .map(|((_, wr), buf)| Box::pin(run(Resolved::IoUring, page_write(wr, buf))))
                    .collect();
                poll_pending_once(&mut futs).await;
                // Queued for the flush task, which cannot run before this task yields: the
                // call submits them.
                assert_eq!(ring_here().0, 2);
                assert_eq!(reap_here(2), 2, "submitted, nothing posted yet");
                assert_eq!(ring_here().0, 0);
                let mut got = vec![0u8; page];
                for (rd, _) in &pipes {
                    (&*rd).read_exact(&mut got).unwrap();
                }
                wait_posted(2);
                // Two in flight, more than allowed: left to the reaper task.
                assert_eq!(reap_here(1), 2, "left to the reaper task");
                assert!(bufs.iter().all(|b| Arc::strong_count(b) == 2));
                // Allowed: both reaped, in one batch.
                assert_eq!(
                    reap_here(2),
                    2,
                    "nothing in flight, the last batch held two"
                );
                assert!(
                    bufs.iter().all(|b| Arc::strong_count(b) == 1),
                    "the table let go"
                );
                for (((rd, _), fut), i) in pipes.iter().zip(futs).zip(8u8..) {
                    assert_eq!(fut.await.unwrap(), page);
                    (&*rd).read_exact(&mut got).unwrap();
                    assert!(got.iter().all(|&b| b == i));
                }
                // A deep batch keeps the ring deep until a shallow batch is reaped: a single
                // write into the now empty first pipe completes at once.
                let fut = run(Resolved::IoUring, page_write(&pipes[0].1, &bufs[0]));
                let mut fut = Box::pin(fut);
                let first =
                    std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx))).await;
                assert!(first.is_pending(), "queued for the flush task");
                // Submitted (it may complete inside the submission), not reaped: too deep.
                assert_eq!(reap_here(0), 2);
                wait_posted(1);
                assert_eq!(reap_here(1), 2, "still as deep as the last batch");
                assert_eq!(Arc::strong_count(&bufs[0]), 2);
                assert_eq!(reap_here(2), 1, "a batch of one");
                assert_eq!(Arc::strong_count(&bufs[0]), 1);
                assert_eq!(fut.await.unwrap(), page);
                assert_eq!(reap_here(1), 1, "as shallow as a polling shard wants");
            })
            .unwrap();
        reaped_within_a_minute(job).unwrap();
    }

    /// A reaper task that stops while its runtime lives on (its eventfd not pollable) hands the
    /// ring over; the flush task started with it must end too, not stay parked for ever. One
    /// started with an earlier reaper task ends as well, while the current one runs.
    #[test]
    fn a_flush_task_ends_once_its_reaper_task_gave_up_the_ring() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let driver = Driver::new().unwrap();
            // As `start_reaper` leaves a ring on a shard, with `n` reaper tasks started so far.
            let start = |n: u64| {
                let mut g = driver.lock();
                g.reaper = Reaper::Task;
                g.tasks = n;
                tokio::spawn(flush_task(driver.clone(), n))
            };
            let runs = |flush: &tokio::task::JoinHandle<()>| {
                let registered = driver.lock().flusher.is_some();
                registered && !flush.is_finished()
            };
            let flush = start(1);
            while !runs(&flush) {
                tokio::task::yield_now().await;
            }
            drop(TaskGuard(driver.clone()));
            assert_eq!(driver.lock().reaper, Reaper::None, "nothing was in flight");
            tokio::time::timeout(Duration::from_secs(60), flush)
                .await
                .expect("the flush task never ended")
                .unwrap();
            // A flush task of an earlier reaper task ends when it runs; the current one stays.
            let (old, current) = (start(1), start(2));
            tokio::time::timeout(Duration::from_secs(60), old)
                .await
                .expect("the earlier flush task never ended")
                .unwrap();
            while !runs(&current) {
                tokio::task::yield_now().await;
            }
            current.abort();
        });
    }

    #[test]
    fn without_an_io_driver_completions_are_reaped_by_a_thread_and_cancellation_keeps_the_buffer() {
        if uring_available().is_err() {
            eprintln!("io_uring unavailable: skipped");
            return;
        }
        // A fresh thread: its ring is new; its runtime has no I/O driver.
        std::thread::spawn(|| {
            reaped_within_a_minute(cancel_while_in_flight(Reaper::Thread));
        })
        .join()
        .unwrap();
    }
}
