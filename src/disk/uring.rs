//! io_uring: a ring per thread. On a dispatcher shard the ring's completions are reaped by a
//! task on the shard's own runtime, woken by its I/O driver through the ring's eventfd (and by
//! the shard's polling rounds, through the dispatcher's per-shard I/O hook); elsewhere by a
//! helper thread sleeping on that eventfd.
//!
//! On a shard, submissions are batched: an operation's entry is queued on the ring, and a
//! flush task on the shard's runtime hands every queued entry to the kernel with one
//! `io_uring_enter`. Woken by the first entry queued since its last run, it runs after the
//! tasks already scheduled, so the requests the shard dispatched in one round (each a task) go
//! to the device together, as a program driving its own ring would submit them. A piece that a
//! task on the shard issues itself ([`try_issue_here`]: it may go at once) is submitted at once,
//! with whatever else is queued. Elsewhere each operation is submitted at once.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Mutex, OnceLock};
use std::task::{Poll, Waker};

use io_uring::{opcode, squeue, types, IoUring};
use slab::Slab;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use super::backend::{run, OpKind, RawIo, Resolved};
use super::eventfd::RingEventFd;
use crate::dispatcher::task::{self, BoxTask, Completion, ResultTx, Task};
use crate::dispatcher::{ClassId, Dispatcher, IoHandle, IoRequest, ShardHere};
use crate::sync::Arc;
use crate::DispatchError;

pub(super) fn uring_available() -> io::Result<()> {
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
    eventfd: RingEventFd,
}

impl Driver {
    fn new() -> io::Result<Arc<Driver>> {
        let (ring, eventfd) = RingEventFd::ring(SQ_ENTRIES, CQ_ENTRIES)?;
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
                // The shard's polling rounds drive this ring too.
                crate::dispatcher::shard_io::register(reap_here);
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
        driver.eventfd.drain();
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
                driver.eventfd.notify();
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
        driver.eventfd.drain();
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
        driver.eventfd.wait();
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
fn reap_here(max_in_flight: usize) -> usize {
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
            d.eventfd.notify();
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

pub(super) fn uring_submit(io: RawIo) -> Result<oneshot::Receiver<i32>, SubmitFailure> {
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

/// The submission entry of `io`, whose length is `len` (`io.len`, checked to fit).
pub(super) fn sqe(io: &RawIo, len: u32) -> squeue::Entry {
    let fd = types::Fd(io.file.as_raw_fd());
    match io.kind {
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
}

/// [`uring_push`] on `driver`, the calling thread's ring.
fn push_on(
    driver: &Arc<Driver>,
    io: RawIo,
    local: bool,
    target: impl FnOnce(usize) -> Target,
) -> Result<(), SubmitFailure> {
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
    let entry = sqe(&io, len).user_data(id as u64);
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
        driver.eventfd.notify();
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
    let (tx, handle) = task::channel();
    (Box::new(IoTask { backend, io, tx }), handle)
}

impl Task for IoTask {
    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    fn poll_cancelled(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        self.tx.poll_closed(cx)
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
                    store_local(id, l);
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
                    return task::boxed(fut, tx).spawn_local(done);
                }
            }
        } else {
            io
        };
        task::boxed(run(backend, io), tx).spawn_local(done);
    }
}

/// Issues `io` (a request of `class` costing `cost`, submitted by a task running on one of
/// `dispatcher`'s shards) on the shard's ring from that task itself when it may go at once
/// ([`Dispatcher::try_fast_here`]), and hands it to the kernel at once; otherwise gives it
/// back, untouched and with nothing charged, for the shard's queue. The completion is reaped
/// as the shard's own operations are, and ends the request as the loop's dispatch would have.
pub(super) fn try_issue_here(
    dispatcher: &Dispatcher,
    backend: Resolved,
    class: ClassId,
    request: &IoRequest,
    cost: u64,
    io: RawIo,
) -> Result<IoHandle<io::Result<usize>>, RawIo> {
    if backend != Resolved::IoUring || io.kind == OpKind::Fallocate || !dispatcher.caller_files() {
        return Err(io);
    }
    let Some(here) = dispatcher.shard_here() else {
        return Err(io);
    };
    let Ok(len) = u32::try_from(io.len) else {
        return Err(io);
    };
    with_local_driver(|driver| {
        let Ok(driver) = driver else {
            return Err(io);
        };
        issue_here(driver, dispatcher, here, (class, request, cost), io, len)
    })
}

/// [`try_issue_here`] on `driver`, the calling shard's ring.
fn issue_here(
    driver: &Arc<Driver>,
    dispatcher: &Dispatcher,
    here: ShardHere,
    (class, request, cost): (ClassId, &IoRequest, u64),
    io: RawIo,
    len: u32,
) -> Result<IoHandle<io::Result<usize>>, RawIo> {
    let mut g = driver.lock();
    if g.pending.len() >= CQ_ENTRIES as usize {
        return Err(io);
    }
    if g.reaper == Reaper::None && start_reaper(driver, &mut g).is_err() {
        return Err(io);
    }
    // Only a ring reaped by a task on this thread (a shard's): its completions end the
    // request on the shard.
    if g.reaper != Reaper::Task {
        return Err(io);
    }
    if g.ring.submission().is_full() && (g.submit().is_err() || g.ring.submission().is_full()) {
        return Err(io);
    }
    // From here the entry is sure to be queued: the tokens are taken only now.
    let Some(done) = dispatcher.try_fast_here(here, class, request, cost) else {
        return Err(io);
    };
    let id = g.pending.vacant_key();
    let entry = sqe(&io, len).user_data(id as u64);
    // SAFETY: the entry's buffer (`io.buf`, range `start..start+len`, exclusive to this
    // operation by `RawIo`'s invariant) and file stay alive until the reaper takes the
    // completion: `io` goes into `pending` below, under the same lock, before the entry is
    // submitted, and only the reaper removes it, after the kernel posted the completion.
    let pushed = unsafe { g.ring.submission().push(&entry) };
    debug_assert!(pushed.is_ok(), "room was checked under the lock");
    let (tx, handle) = task::channel();
    store_local(id, LocalIo { tx, done });
    let key = g.pending.insert((Target::Local, io));
    debug_assert_eq!(key, id);
    // Handed to the kernel now, with whatever else is queued: the flush task then finds
    // nothing to do.
    if let Err(e) = g.submit() {
        // The entry stays queued (its buffer held in `pending`); the reaper submits it.
        tracing::warn!("io_uring submit failed ({e}); the reaper retries");
        drop(g);
        driver.eventfd.notify();
    }
    Ok(handle)
}

/// Keeps `local` in [`LOCAL_DONE`] under the key `id` its entry has on the ring (a thread that
/// is exiting has no table: its runtime is gone, and `local` with it).
fn store_local(id: usize, local: LocalIo) {
    let _ = LOCAL_DONE.try_with(|t| {
        let mut t = t.borrow_mut();
        if t.len() <= id {
            t.resize_with(id + 1, || None);
        }
        t[id] = Some(local);
    });
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

#[cfg(test)]
mod tests;
