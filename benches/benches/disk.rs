//! Real I/O: 4 KiB O_DIRECT random reads through `ThrottledFile` (io_uring backend, an
//! unthrottled dispatcher) against the same reads issued directly on an io_uring, at queue
//! depth 1 and 32. The ratio is the dispatch overhead per request.
//! (One file over the usual size: every case is read beside the hand-written baselines, direct
//! io_uring and relay threads, that it is compared with.)
//!
//! ```text
//! cargo bench --bench benches -- disk
//! ```
//!
//! What each case does (the thread counts are those a user has):
//!
//! - `direct_io_uring`: the baseline, the cheapest way to issue the reads: the benchmark thread
//!   pushes them on its own ring and sleeps in `io_uring_enter` (`submit_and_wait`) for the
//!   completions. One thread, no runtime, no wake-up but the kernel's.
//! - `uring_relay_thread` (in `disk/ratios` only): no dispatcher and no busy polling: the
//!   simplest thread a user might write to do the reads for callers on another thread. It sleeps
//!   in `io_uring_enter` until a read completes or a caller wakes it (an eventfd whose read is
//!   always pending on the ring, written only when the thread said it sleeps), submits every
//!   request queued with one system call, and answers through oneshot channels. Its ratio to
//!   `direct_io_uring` is what crossing to another thread and back costs by itself.
//! - `uring_relay_tokio` (in `disk/ratios` only): the same relay run as a shard runs, on a tokio
//!   current-thread runtime: it waits in the runtime's `epoll_wait` for a request or for the
//!   ring's eventfd, and reads the eventfd to reset it. Between it and `uring_relay_thread` is
//!   what the runtime costs; between it and `throttled_file`, what the dispatcher does.
//! - `throttled_file`: a task on a tokio current-thread runtime on the benchmark thread (an
//!   ordinary caller, not on a shard) calls `ThrottledFile::read_at`: the request goes to the
//!   dispatcher's one shard thread (the dispatcher is built with
//!   `caller_dispatch(false)`), which submits it to its ring, reaps the completion on its
//!   reactor and wakes the caller's task. Two threads: the caller's and the shard's, with the
//!   shard's default [idle poll] (it polls for 1 ms after its last activity instead of
//!   parking).
//! - `throttled_file_mt_caller`: the same reads, their tasks (and the loop that starts them)
//!   on a multi-thread runtime with one worker. tokio's current-thread scheduler unparks its
//!   driver (an eventfd write) on every wake from another thread, so the shard pays one system
//!   call per completed read for a current-thread caller; the multi-thread scheduler wakes a
//!   worker only when none is awake.
//! - `throttled_file_caller` (in `disk/ratios` only): `throttled_file` on a dispatcher with the
//!   default [`DispatcherBuilder::caller_dispatch`]: a read that may go at once (here: every read, the
//!   dispatcher is unthrottled) is issued on the caller's own io_uring and reaped by the
//!   caller's runtime; no shard thread wakes. Its ratio to `direct_io_uring` is what the
//!   dispatcher's bookkeeping and a ring reaped through tokio's reactor cost.
//! - `throttled_file_caller_ring_wait` (in `disk/ratios` only): `throttled_file_caller` with
//!   the runtime parking on the caller's ring: its `on_thread_park` hook calls
//!   [`wait_for_completions`] (up to 500 µs), so a thread with a read in flight sleeps in the
//!   ring's own wait, woken by the completion, instead of in `epoll_wait`.
//! - `throttled_file_sched_batch` (in `disk/ratios` only): `throttled_file` with the shard
//!   thread on Linux's `SCHED_BATCH` policy, set by a
//!   [`DispatcherBuilder::on_shard_start`] hook. A woken batch thread does not preempt the thread
//!   that woke it: the caller, sharing a core with the shard (the scheduler puts them together
//!   on the vCPU that takes the disk's interrupts), sends a whole batch of requests before the
//!   shard takes them, instead of being preempted after the first few.
//! - `throttled_file_parked`: the same as `throttled_file` with `idle_poll(Duration::ZERO)`: the shard
//!   parks as soon as it is idle, so the request and the completion each pay a thread wake-up.
//! - `busy_poll_thread` (in `disk/ratios` only): no dispatcher, the design a user might write
//!   by hand: a thread that busy-polls for requests and for its ring's completions, handed each
//!   read by a task on the benchmark thread's runtime through a channel, submitting every
//!   request waiting with one system call and answering through a oneshot. It pays the same
//!   hop to another thread and back as `throttled_file`, without a dispatcher, and it never
//!   yields its core. It is no floor: on a 2-core machine the spinning takes the core the
//!   caller's thread and the kernel's completions need.
//! - `throttled_file_on_shard`: the reads are issued from tasks running *on* the shard
//!   (thread-per-core use: the engine's code runs on the shards, started with
//!   [`Dispatcher::spawn_on`]), so only the completion is a hop, inside the shard.
//! - `throttled_file_on_shard_caller` (in `disk/ratios` only): the same on the dispatcher of
//!   `throttled_file_caller` (the default caller dispatch): a read that may go at once is
//!   issued by its task on the shard's ring and submitted there and then, without the shard's
//!   queue, loop or flush task.
//!
//! Before the criterion groups, `disk/ratios` runs every case in interleaved rounds (each case
//! once per round, in a fresh random order), so that the noise of a shared machine hits all alike, and prints the median
//! time per read of each case, its ratio to `direct_io_uring` at the same depth, the CPU
//! the shard threads used per second of each case (from `/proc/self/task/*/schedstat`), and
//! while idle, and the CPU the whole process used per read (`getrusage`: the caller's side, the
//! I/O thread's, and the kernel's work for both). It runs when no filter is given, or the filter names `disk` but not one `read_4k` case, or
//! names `ratios`.
//!
//! Each read's own latency is recorded too, from its submission (the push on the ring for
//! `direct_io_uring`, the call to `read_at` or the hand-off for the others) to its completion
//! seen by the caller (the ring's wait returning; the read's task resumed), and `disk/ratios`
//! prints per case its p50 and p99 and the ratio of its p99 to `direct_io_uring`'s at the same
//! depth (`p99 ratio`). The quantiles are pooled over all rounds (every read of the case in one
//! sample), and the interleaving spreads the machine's drift over all cases alike. A pooled p99
//! is the tail a user sees, but one stall of the disk during one case's turn lands in that case
//! alone; `p99 r/rnd`, the median over the rounds of the ratio of the round's p99s, is the
//! figure such a stall cannot move (a round holds 1,500 reads at either depth, fifteen of them
//! above its p99). Read them together: where they disagree, a few rounds decided the pooled
//! one.
//!
//! At depth 1 a case's reads run one after another in one task (a request handler's point
//! reads); deeper, each read is a task of its own. Either way the task that issues them is
//! spawned on the case's runtime, as a server's handlers are: a current-thread runtime's
//! `block_on` future looks at the I/O driver once more each time a task wakes it (one more
//! `epoll_wait` a read), which no spawned task pays.
//!
//! For focused comparisons, `IOTHROTTLE_RATIOS_CASES` keeps only the named cases (commas; a
//! name, or `name/depth`; `direct_io_uring` always stays), `IOTHROTTLE_RATIOS_DEPTH` only one
//! depth, and `IOTHROTTLE_RATIOS_ROUNDS` sets the number of rounds (31 by default), e.g.
//!
//! ```text
//! IOTHROTTLE_RATIOS_CASES=uring_relay_tokio,throttled_file IOTHROTTLE_RATIOS_DEPTH=32 \
//!   IOTHROTTLE_RATIOS_ROUNDS=101 cargo bench --bench benches -- disk/ratios
//! ```
//!
//! The scratch file (64 MiB) lives under the target directory, which must be on a real disk.
//!
//! [idle poll]: iothrottle::dispatcher::DispatcherBuilder::idle_poll
//! [`Dispatcher::spawn_on`]: iothrottle::dispatcher::Dispatcher::spawn_on
//! [`wait_for_completions`]: iothrottle::disk::wait_for_completions
//! [`DispatcherBuilder::on_shard_start`]: iothrottle::dispatcher::DispatcherBuilder::on_shard_start
//! [`DispatcherBuilder::caller_dispatch`]: iothrottle::dispatcher::DispatcherBuilder::caller_dispatch

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use io_uring::{opcode, types, IoUring};
use iothrottle::disk::{AlignedBuf, Backend, FileOptions, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures};
use iothrottle::Rate;
use tokio::task::JoinSet;

const FILE: u64 = 64 << 20;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn offset(&mut self) -> u64 {
        (self.next() % (FILE / ALIGN as u64)) * ALIGN as u64
    }
}

/// `iters` reads kept `depth` deep on a raw ring; returns the elapsed time. Each read's latency
/// (from its push on the submission queue to its completion seen) goes to `lat`.
fn direct(
    ring: &mut IoUring,
    fd: i32,
    bufs: &mut [AlignedBuf],
    depth: usize,
    iters: u64,
    rng: &mut Rng,
    lat: &mut Vec<f64>,
) -> Duration {
    let start = Instant::now();
    let mut issued = 0u64;
    let mut done = 0u64;
    let mut pushed_at = vec![start; depth];
    let mut push = |ring: &mut IoUring, slot: usize, rng: &mut Rng, at: &mut [Instant]| {
        at[slot] = Instant::now();
        let e = opcode::Read::new(types::Fd(fd), bufs[slot].as_mut_ptr(), ALIGN as u32)
            .offset(rng.offset())
            .build()
            .user_data(slot as u64);
        // SAFETY: buffer `slot` serves one read at a time and outlives it (we wait for all).
        unsafe { ring.submission().push(&e).unwrap() };
    };
    while issued < iters.min(depth as u64) {
        push(ring, issued as usize, rng, &mut pushed_at);
        issued += 1;
    }
    while done < issued {
        ring.submit_and_wait(1).unwrap();
        let seen = Instant::now();
        let slots: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in slots {
            assert_eq!(res, ALIGN as i32);
            lat.push(micros(seen - pushed_at[slot as usize]));
            done += 1;
            if issued < iters {
                push(ring, slot as usize, rng, &mut pushed_at);
                issued += 1;
            }
        }
    }
    start.elapsed()
}

/// Microseconds in `d`.
fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A read's task: the buffer back, and the read's latency in µs (from the call that submits it
/// to its completion seen by the task).
type Read = (AlignedBuf, f64);

/// Runs `read` and times it (see [`Read`]).
async fn timed(read: impl std::future::Future<Output = AlignedBuf>) -> Read {
    let start = Instant::now();
    let buf = read.await;
    (buf, micros(start.elapsed()))
}

/// Runs a read (`read`, given a buffer and the offset) for each offset, keeping `depth` of them
/// in flight; returns their latencies. At depth 1 the reads run one after another in the
/// calling task (a request handler's point reads); deeper, each read is a task of its own,
/// started by `spawn`, and each new one gets the buffer the last one to finish returned.
async fn keep_deep<Fut: std::future::Future<Output = AlignedBuf>>(
    depth: usize,
    offsets: &[u64],
    mut read: impl FnMut(AlignedBuf, u64) -> Fut,
    mut spawn: impl FnMut(&mut JoinSet<Read>, Fut),
) -> Vec<f64> {
    let mut lat = Vec::with_capacity(offsets.len());
    if depth == 1 {
        let mut buf = AlignedBuf::zeroed(ALIGN).unwrap();
        for &off in offsets {
            let (b, took) = timed(read(buf, off)).await;
            lat.push(took);
            buf = b;
        }
        return lat;
    }
    let mut set = JoinSet::new();
    let mut next = 0;
    while next < depth.min(offsets.len()) {
        spawn(
            &mut set,
            read(AlignedBuf::zeroed(ALIGN).unwrap(), offsets[next]),
        );
        next += 1;
    }
    while let Some(done) = set.join_next().await {
        let (buf, took) = done.unwrap();
        lat.push(took);
        if next < offsets.len() {
            spawn(&mut set, read(buf, offsets[next]));
            next += 1;
        }
    }
    lat
}

/// One 4 KiB read of `file` at `off` into `buf`; the buffer back.
async fn read_4k(file: Arc<ThrottledFile>, buf: AlignedBuf, off: u64) -> AlignedBuf {
    let (n, buf) = file.read_at(buf, off).await;
    assert_eq!(n.unwrap(), ALIGN);
    buf
}

/// `iters` reads kept `depth` deep through the dispatcher, from a task of their own on `rt` (its
/// worker on a multi-thread runtime, the benchmark thread on a current-thread one), as a
/// server's request handlers run.
fn throttled(
    rt: &tokio::runtime::Runtime,
    file: &Arc<ThrottledFile>,
    depth: usize,
    iters: u64,
    rng: &mut Rng,
    lat: &mut Vec<f64>,
) -> Duration {
    let offsets: Vec<u64> = (0..iters).map(|_| rng.offset()).collect();
    let start = Instant::now();
    let file = file.clone();
    let reads = async move {
        keep_deep(
            depth,
            &offsets,
            |buf, off| read_4k(file.clone(), buf, off),
            |set, read| drop(set.spawn(timed(read))),
        )
        .await
    };
    // A task of its own on either runtime, as a server's request handlers are (on a
    // current-thread runtime the `block_on` future would pay the scheduler's extra look at the
    // driver each time a task wakes it).
    let took = rt.block_on(rt.spawn(reads)).unwrap();
    let elapsed = start.elapsed();
    lat.extend(took);
    elapsed
}

/// A read asked of a hand-written I/O thread: its offset, and where to say it is done.
type FloorReq = (u64, tokio::sync::oneshot::Sender<i32>);

/// A hand-written alternative to the dispatcher for a caller that is not on the I/O thread: a
/// thread that does nothing but busy-poll for requests (then parks after 1 ms with nothing to
/// do), take every request waiting, submit them on its own ring with one system call, busy-poll
/// the completion queue (no system call but the submission), and answer through oneshot
/// channels, which wake the callers' tasks as the dispatcher's shard does. No queue, no tokens.
fn spawn_floor(fd: i32) -> Served {
    serve("bench-io-busy", move |mut rx| {
        let mut ring = IoUring::new(SLOTS as u32).unwrap();
        let mut slots = Slots::new(fd, SLOTS);
        let mut idle_since = Instant::now();
        loop {
            let mut pushed = 0;
            while slots.has_room() {
                match rx.try_recv() {
                    Ok(req) => slots.take(&mut ring, req),
                    // Every caller waits for its reads, so none is in flight by now.
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) if slots.idle() => {
                        return
                    }
                    Err(_) => break,
                }
                pushed += 1;
            }
            if pushed > 0 {
                ring.submit().unwrap();
            }
            let done = slots.reap(&mut ring);
            if pushed > 0 || done > 0 || !slots.idle() {
                idle_since = Instant::now();
            } else if idle_since.elapsed() > Duration::from_millis(1) {
                let Some(req) = rx.blocking_recv() else {
                    return;
                };
                // Handled as if it had come in with the next round.
                slots.take(&mut ring, req);
                ring.submit().unwrap();
                idle_since = Instant::now();
            } else {
                std::hint::spin_loop();
            }
        }
    })
}

/// A new eventfd (`flags` as `eventfd(2)` takes them), owned by the `File`.
fn eventfd(flags: i32) -> std::fs::File {
    // SAFETY: no pointers; the new fd is owned by the `File` at once.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | flags) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh fd that nothing else owns.
    unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
}

/// Adds one to an eventfd's count (wakes whoever waits on it).
fn signal(event: &std::fs::File) {
    std::io::Write::write_all(&mut &*event, &1u64.to_ne_bytes()).unwrap();
}

/// Reads one hand-written I/O thread may have in flight.
const SLOTS: usize = 64;

/// Where callers queue their reads for a hand-written I/O thread, and the thread.
type Served = (
    tokio::sync::mpsc::UnboundedSender<FloorReq>,
    std::thread::JoinHandle<()>,
);

/// Starts a hand-written I/O thread named `name` (its CPU is counted with the shards') that
/// serves the reads queued on the channel it is given.
fn serve(
    name: &str,
    f: impl FnOnce(tokio::sync::mpsc::UnboundedReceiver<FloorReq>) + Send + 'static,
) -> Served {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<FloorReq>();
    let t = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || f(rx))
        .unwrap();
    (tx, t)
}

/// The least a thread that does I/O for callers on other threads can do, with no busy polling:
/// the [`spawn_relay`] thread's handle. Callers queue a read and write the eventfd when the
/// thread said it sleeps.
struct Relay {
    /// Taken by `drop`, which then wakes the thread to see the channel closed.
    tx: Option<tokio::sync::mpsc::UnboundedSender<FloorReq>>,
    /// Set by the thread before it sleeps; the caller that clears it writes the eventfd.
    sleeping: Arc<std::sync::atomic::AtomicBool>,
    event: Arc<std::fs::File>,
}

impl Relay {
    fn send(&self, req: FloorReq) {
        use std::sync::atomic::Ordering::SeqCst;
        self.tx
            .as_ref()
            .expect("open until dropped")
            .send(req)
            .unwrap();
        // SeqCst: the queue push above and the thread's flag-then-recheck form a Dekker pair;
        // one of the two sees the other.
        if self.sleeping.swap(false, SeqCst) {
            signal(&self.event);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.tx = None;
        signal(&self.event);
    }
}

/// No dispatcher, no busy polling: the design with the fewest moving parts for callers that are
/// not on the I/O thread. One thread owns a ring on which a read of an eventfd is always
/// pending, and sleeps in `io_uring_enter` until a read completes or a caller writes the
/// eventfd; it then submits every request queued with one system call and answers through
/// oneshot channels (which wake the callers' tasks as the dispatcher's shard does). Its ratio to
/// `direct_io_uring` is the cost of crossing threads alone.
fn spawn_relay(fd: i32) -> (Relay, std::thread::JoinHandle<()>) {
    use std::sync::atomic::Ordering::SeqCst;
    const EVENT: u64 = u64::MAX;
    let sleeping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let event = Arc::new(eventfd(0));
    let (flag, ev) = (sleeping.clone(), event.clone());
    let (tx, t) = serve("bench-io-relay", move |mut rx| {
        let mut ring = IoUring::new(SLOTS as u32 * 2).unwrap();
        let mut slots = Slots::new(fd, SLOTS);
        let mut counter = Box::new([0u8; 8]);
        let arm = |ring: &mut IoUring, counter: &mut [u8; 8]| {
            let e = opcode::Read::new(types::Fd(ev.as_raw_fd()), counter.as_mut_ptr(), 8)
                .build()
                .user_data(EVENT);
            // SAFETY: `counter` is boxed and outlives the ring's use of it (the thread ends
            // only once this read completed: see below).
            unsafe { ring.submission().push(&e).unwrap() };
        };
        arm(&mut ring, &mut counter);
        let mut closed = false;
        loop {
            while slots.has_room() {
                match rx.try_recv() {
                    Ok(req) => slots.take(&mut ring, req),
                    Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if closed && slots.idle() {
                // Nothing in flight but the eventfd read: wake it so that it completes before
                // `counter` is dropped.
                signal(&ev);
                ring.submit_and_wait(1).unwrap();
                return;
            }
            // About to sleep: say so, then look again (a caller that queued before the flag
            // was set did not write the eventfd). What was pushed is submitted either way.
            flag.store(true, SeqCst);
            if !closed && slots.has_room() && !rx.is_empty() {
                flag.store(false, SeqCst);
                continue;
            }
            ring.submit_and_wait(1).unwrap();
            flag.store(false, SeqCst);
            let mut rearm = false;
            slots.reap_with(&mut ring, |user_data| {
                rearm |= user_data == EVENT;
                user_data != EVENT
            });
            if rearm {
                arm(&mut ring, &mut counter);
            }
        }
    });
    (
        Relay {
            tx: Some(tx),
            sleeping,
            event,
        },
        t,
    )
}

/// A ring's read slots: a buffer and a reply each.
struct Slots {
    fd: i32,
    bufs: Vec<AlignedBuf>,
    replies: Vec<Option<tokio::sync::oneshot::Sender<i32>>>,
    free: Vec<usize>,
}

impl Slots {
    fn new(fd: i32, n: usize) -> Self {
        Slots {
            fd,
            bufs: (0..n).map(|_| AlignedBuf::zeroed(ALIGN).unwrap()).collect(),
            replies: (0..n).map(|_| None).collect(),
            free: (0..n).collect(),
        }
    }

    /// Queues the read on the ring (not submitted yet).
    fn take(&mut self, ring: &mut IoUring, (offset, reply): FloorReq) {
        let slot = self.free.pop().expect("no more reads in flight than slots");
        let e = opcode::Read::new(
            types::Fd(self.fd),
            self.bufs[slot].as_mut_ptr(),
            ALIGN as u32,
        )
        .offset(offset)
        .build()
        .user_data(slot as u64);
        // SAFETY: buffer `slot` serves one read at a time (it is off the free list until its
        // completion) and outlives it (the owner ends only with nothing in flight).
        unsafe { ring.submission().push(&e).unwrap() };
        self.replies[slot] = Some(reply);
    }

    /// Answers every completion posted; returns how many.
    fn reap(&mut self, ring: &mut IoUring) -> usize {
        self.reap_with(ring, |_| true)
    }

    /// [`reap`](Self::reap), skipping the completions whose user data `ours` refuses.
    fn reap_with(&mut self, ring: &mut IoUring, mut ours: impl FnMut(u64) -> bool) -> usize {
        let mut n = 0;
        for c in ring.completion() {
            if !ours(c.user_data()) {
                continue;
            }
            let slot = c.user_data() as usize;
            let _ = self.replies[slot].take().unwrap().send(c.result());
            self.free.push(slot);
            n += 1;
        }
        n
    }

    fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    fn idle(&self) -> bool {
        self.free.len() == self.bufs.len()
    }
}

/// The relay on a tokio current-thread runtime, as a shard runs: one task takes the queued
/// requests, submits them with one system call, reaps the ring and answers, and waits for either
/// a request (the channel's waker) or a completion (the ring's eventfd, registered with the
/// runtime's epoll, and read to reset it). No queue, no tokens: its distance to
/// `uring_relay_thread` is what the runtime costs, its distance to `throttled_file` what the
/// dispatcher does.
fn spawn_tokio_relay(fd: i32) -> Served {
    serve("bench-io-tokio", move |mut rx| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut ring = IoUring::new(SLOTS as u32).unwrap();
            let event = eventfd(libc::EFD_NONBLOCK);
            ring.submitter()
                .register_eventfd(event.as_raw_fd())
                .unwrap();
            // SAFETY: the `AsyncFd` owns the `File`, which owns the fd: it stays open while
            // registered.
            let event = unsafe { tokio::io::unix::AsyncFd::register(event) }.unwrap();
            let mut slots = Slots::new(fd, SLOTS);
            let mut open = true;
            loop {
                while let Ok(req) = rx.try_recv() {
                    slots.take(&mut ring, req);
                }
                if !ring.submission().is_empty() {
                    ring.submit().unwrap();
                }
                slots.reap(&mut ring);
                if !open && slots.idle() {
                    return;
                }
                tokio::select! {
                    biased;
                    req = rx.recv(), if open => match req {
                        Some(req) => slots.take(&mut ring, req),
                        None => open = false,
                    },
                    ready = event.readable() => {
                        let mut ready = ready.unwrap();
                        ready.clear_ready();
                        let mut count = [0u8; 8];
                        let _ = std::io::Read::read(&mut event.get_ref(), &mut count);
                    }
                }
            }
        })
    })
}

/// `iters` reads kept `depth` deep through a hand-written I/O thread (`send` queues one), each
/// from its own task on `rt` (as [`throttled`] issues them).
fn handed_off(
    rt: &tokio::runtime::Runtime,
    send: impl Fn(FloorReq) + Clone + Send + Sync + 'static,
    depth: usize,
    iters: u64,
    rng: &mut Rng,
    lat: &mut Vec<f64>,
) -> Duration {
    let offsets: Vec<u64> = (0..iters).map(|_| rng.offset()).collect();
    let start = Instant::now();
    let reads = async move {
        keep_deep(
            depth,
            &offsets,
            |buf, off| {
                let send = send.clone();
                async move {
                    let (done, wait) = tokio::sync::oneshot::channel();
                    send((off, done));
                    assert_eq!(wait.await.unwrap(), ALIGN as i32);
                    // The thread reads into its own buffers: this one only keeps the helper's shape.
                    buf
                }
            },
            |set, read| drop(set.spawn(timed(read))),
        )
        .await
    };
    // A task of its own, as in `throttled`.
    let took = rt.block_on(rt.spawn(reads)).unwrap();
    let elapsed = start.elapsed();
    lat.extend(took);
    elapsed
}

/// `iters` reads kept `depth` deep, issued from tasks running *on* the shard (thread-per-core
/// use: the engine's code runs on the shards), so no request crosses threads: a task on the
/// shard issues them (at depth 1 itself, deeper one task per read on the shard's runtime).
fn on_shard(
    rt: &tokio::runtime::Runtime,
    d: &Dispatcher,
    file: &Arc<ThrottledFile>,
    depth: usize,
    iters: u64,
    rng: &mut Rng,
    lat: &mut Vec<f64>,
) -> Duration {
    let offsets: Vec<u64> = (0..iters).map(|_| rng.offset()).collect();
    let f = file.clone();
    // The engine's own task on the shard (`spawn_on`): charged no tokens, its reads issued
    // from the shard's thread.
    let job = d
        .spawn_on(0, move || async move {
            let start = Instant::now();
            let took = keep_deep(
                depth,
                &offsets,
                |buf, off| read_4k(f.clone(), buf, off),
                |set, read| drop(set.spawn_local(timed(read))),
            )
            .await;
            (start.elapsed(), took)
        })
        .unwrap();
    let (elapsed, took) = rt.block_on(job).unwrap();
    lat.extend(took);
    elapsed
}

/// Whether the benchmark runtime's park hook waits on the caller's ring
/// (`throttled_file_caller_ring_wait`).
static RING_WAIT: AtomicBool = AtomicBool::new(false);
/// The longest such wait.
const RING_WAIT_MAX: Duration = Duration::from_micros(500);

pub fn disk(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("bench.dat");
    {
        // Write the file once (plain writes, synced): reads then read real blocks.
        let chunk = vec![0x5a_u8; 1 << 20];
        let mut f = std::fs::File::create(&path).unwrap();
        for _ in 0..FILE >> 20 {
            std::io::Write::write_all(&mut f, &chunk).unwrap();
        }
        f.sync_all().unwrap();
    }
    let (dispatcher, class) = unthrottled(None, false);
    let (parked_dispatcher, parked_class) = unthrottled(Some(Duration::ZERO), false);
    let opts = FileOptions {
        backend: Backend::IoUring,
        ..FileOptions::default()
    };
    let file =
        Arc::new(ThrottledFile::open(dispatcher.clone(), class, &path, opts.clone()).unwrap());
    let parked = Arc::new(
        ThrottledFile::open(parked_dispatcher.clone(), parked_class, &path, opts.clone()).unwrap(),
    );
    let raw = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    let mut ring = IoUring::new(64).unwrap();
    let mut bufs: Vec<AlignedBuf> = (0..32)
        .map(|_| AlignedBuf::zeroed(ALIGN).unwrap())
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(|| {
            // Relaxed: a flag the benchmark thread itself sets between cases.
            if RING_WAIT.load(Ordering::Relaxed) {
                iothrottle::disk::wait_for_completions(RING_WAIT_MAX);
            }
        })
        .build()
        .unwrap();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    // The caller's tasks on a multi-thread runtime (one worker: the machine has two cores and
    // the shard needs one).
    let mt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    if wants_ratios() {
        // A second ring and buffers for the deep case, so both direct cases live at once.
        let mut deep_ring = IoUring::new(64).unwrap();
        let mut deep_bufs: Vec<AlignedBuf> = (0..32)
            .map(|_| AlignedBuf::zeroed(ALIGN).unwrap())
            .collect();
        let (floor_tx, floor_thread) = spawn_floor(raw.as_raw_fd());
        let (relay, relay_thread) = spawn_relay(raw.as_raw_fd());
        let (tokio_tx, tokio_thread) = spawn_tokio_relay(raw.as_raw_fd());
        let relay = Arc::new(relay);
        let (batch_dispatcher, batch_class) = unthrottled(None, true);
        let batch_file = Arc::new(
            ThrottledFile::open(batch_dispatcher.clone(), batch_class, &path, opts.clone())
                .unwrap(),
        );

        let (caller_dispatcher, caller_class) = unthrottled_with(None, false, true);
        let caller_file = Arc::new(
            ThrottledFile::open(caller_dispatcher.clone(), caller_class, &path, opts.clone())
                .unwrap(),
        );

        let mut cases: Vec<(&str, usize, Case<'_>)> = Vec::new();
        let (direct_1, direct_32) = (RefCell::new(&mut ring), RefCell::new(&mut deep_ring));
        let (bufs_1, bufs_32) = (RefCell::new(&mut bufs), RefCell::new(&mut deep_bufs));
        for depth in [1usize, 32] {
            let (ring, bufs) = if depth == 1 {
                (&direct_1, &bufs_1)
            } else {
                (&direct_32, &bufs_32)
            };
            let fd = raw.as_raw_fd();
            let (relay, tokio_tx) = (&relay, &tokio_tx);
            let (rt, mt, file, parked, dispatcher, floor_tx, batch_file) = (
                &rt,
                &mt,
                &file,
                &parked,
                &dispatcher,
                &floor_tx,
                &batch_file,
            );
            let (caller_file, caller_dispatcher) = (&caller_file, &caller_dispatcher);
            cases.push((
                "direct_io_uring",
                depth,
                Box::new(move |n, rng, lat| {
                    direct(
                        &mut ring.borrow_mut(),
                        fd,
                        &mut bufs.borrow_mut(),
                        depth,
                        n,
                        rng,
                        lat,
                    )
                }),
            ));
            cases.push((
                "uring_relay_thread",
                depth,
                Box::new(move |n, rng, lat| {
                    let relay = relay.clone();
                    handed_off(rt, move |r| relay.send(r), depth, n, rng, lat)
                }),
            ));
            for (name, queue) in [
                ("busy_poll_thread", floor_tx),
                ("uring_relay_tokio", tokio_tx),
            ] {
                cases.push((
                    name,
                    depth,
                    Box::new(move |n, rng, lat| {
                        let tx = queue.clone();
                        handed_off(rt, move |r| tx.send(r).unwrap(), depth, n, rng, lat)
                    }),
                ));
            }
            cases.push((
                "throttled_file",
                depth,
                Box::new(move |n, rng, lat| throttled(rt, file, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_mt_caller",
                depth,
                Box::new(move |n, rng, lat| throttled(mt, file, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_caller",
                depth,
                Box::new(move |n, rng, lat| throttled(rt, caller_file, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_caller_ring_wait",
                depth,
                Box::new(move |n, rng, lat| {
                    RING_WAIT.store(true, Ordering::Relaxed);
                    let took = throttled(rt, caller_file, depth, n, rng, lat);
                    RING_WAIT.store(false, Ordering::Relaxed);
                    took
                }),
            ));
            cases.push((
                "throttled_file_sched_batch",
                depth,
                Box::new(move |n, rng, lat| throttled(rt, batch_file, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_parked",
                depth,
                Box::new(move |n, rng, lat| throttled(rt, parked, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_on_shard",
                depth,
                Box::new(move |n, rng, lat| on_shard(rt, dispatcher, file, depth, n, rng, lat)),
            ));
            cases.push((
                "throttled_file_on_shard_caller",
                depth,
                Box::new(move |n, rng, lat| {
                    on_shard(rt, caller_dispatcher, caller_file, depth, n, rng, lat)
                }),
            ));
        }
        if let Ok(keep) = std::env::var("IOTHROTTLE_RATIOS_CASES") {
            // The baseline stays: every ratio is to it.
            let keep: Vec<&str> = keep.split(',').map(str::trim).collect();
            cases.retain(|(name, depth, _)| {
                *name == "direct_io_uring"
                    || keep
                        .iter()
                        .any(|k| *k == *name || *k == format!("{name}/{depth}"))
            });
            if let Ok(d) = std::env::var("IOTHROTTLE_RATIOS_DEPTH") {
                cases.retain(|(_, depth, _)| d.parse() == Ok(*depth));
            }
        }
        let before = [
            dispatcher.stats_blocking(),
            parked_dispatcher.stats_blocking(),
            caller_dispatcher.stats_blocking(),
        ];
        ratios(&mut cases, &mut rng);
        // The dispatcher's own queue wait (submission to dispatch) over the rounds, per
        // dispatcher (the cases sharing one are pooled): the wake-up of a shard thread shows
        // here, not in the device's time.
        for ((name, d, c), before) in [
            ("polling shard", &dispatcher, class),
            ("parked shard", &parked_dispatcher, parked_class),
            ("caller dispatch", &caller_dispatcher, caller_class),
        ]
        .into_iter()
        .zip(&before)
        {
            let s = d.stats_blocking().since(before);
            let cs = &s.classes[c.index()];
            println!(
                "queue wait, {name}: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs ({} requests)",
                cs.queue_wait_p50().as_secs_f64() * 1e6,
                cs.queue_wait_p99().as_secs_f64() * 1e6,
                cs.queue_wait_max().as_secs_f64() * 1e6,
                cs.requests
            );
        }
        drop(cases);
        drop(floor_tx);
        floor_thread.join().unwrap();
        drop(Arc::into_inner(relay).expect("the cases are gone"));
        relay_thread.join().unwrap();
        drop(tokio_tx);
        tokio_thread.join().unwrap();
    }

    let mut g = c.benchmark_group("disk/read_4k");
    for depth in [1usize, 32] {
        g.bench_function(BenchmarkId::new("direct_io_uring", depth), |bch| {
            bch.iter_custom(|iters| {
                direct(
                    &mut ring,
                    raw.as_raw_fd(),
                    &mut bufs,
                    depth,
                    iters,
                    &mut rng,
                    &mut Vec::new(),
                )
            })
        });
        g.bench_function(BenchmarkId::new("throttled_file", depth), |bch| {
            bch.iter_custom(|iters| throttled(&rt, &file, depth, iters, &mut rng, &mut Vec::new()))
        });
        g.bench_function(BenchmarkId::new("throttled_file_mt_caller", depth), |bch| {
            bch.iter_custom(|iters| throttled(&mt, &file, depth, iters, &mut rng, &mut Vec::new()))
        });
        g.bench_function(BenchmarkId::new("throttled_file_parked", depth), |bch| {
            bch.iter_custom(|iters| {
                throttled(&rt, &parked, depth, iters, &mut rng, &mut Vec::new())
            })
        });
        g.bench_function(BenchmarkId::new("throttled_file_on_shard", depth), |bch| {
            bch.iter_custom(|iters| {
                on_shard(
                    &rt,
                    &dispatcher,
                    &file,
                    depth,
                    iters,
                    &mut rng,
                    &mut Vec::new(),
                )
            })
        });
    }
    g.finish();
}

/// An unthrottled one-shard dispatcher (the rate and limit far above the disk's) that sends
/// every read through its shard, with the given idle poll (`None`: the default), its shard on
/// `SCHED_BATCH` when `sched_batch`.
fn unthrottled(idle_poll: Option<Duration>, sched_batch: bool) -> (Arc<Dispatcher>, ClassId) {
    unthrottled_with(idle_poll, sched_batch, false)
}

/// [`unthrottled`], with caller dispatch (the default) when `caller`, every read through the
/// shard (`caller_dispatch(false)`) otherwise.
fn unthrottled_with(
    idle_poll: Option<Duration>,
    sched_batch: bool,
    caller: bool,
) -> (Arc<Dispatcher>, ClassId) {
    let mut b = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .rate(Rate::per_second(Rate::MAX_PER_SECOND))
        .limit(1 << 50)
        .threshold(1 << 20)
        .batch(1 << 30)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1_000_000_000,
        }));
    if let Some(t) = idle_poll {
        b = b.idle_poll(t);
    }
    if !caller {
        // The default issues `ThrottledFile`'s reads on the caller's ring.
        b = b.caller_dispatch(false);
    }
    if sched_batch {
        b = b.on_shard_start(|_| {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: the calling thread's policy, from a live `sched_param`.
            match unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let class = b.add_class(ClassConfig::new("c", 100)).unwrap();
    (Arc::new(b.build().unwrap()), class)
}

/// One case of the interleaved comparison: runs `n` reads, returns the elapsed time and adds
/// each read's latency (µs, from its submission to its completion seen by the caller) to the
/// vector.
type Case<'a> = Box<dyn FnMut(u64, &mut Rng, &mut Vec<f64>) -> Duration + 'a>;

/// Whether the command line selects the disk benchmarks (or none in particular).
fn wants_ratios() -> bool {
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-') && a.parse::<f64>().is_err())
        .collect();
    words.is_empty()
        || words
            .iter()
            .any(|w| w.contains("ratios") || (w.contains("disk") && !w.contains("read_4k")))
}

/// Nanoseconds the shard threads and the hand-written I/O threads of this process have run on a
/// CPU (schedstat's first field).
fn shard_cpu_ns() -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("iothrottle-shar") && !comm.starts_with("bench-io-") {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    total
}

/// Nanoseconds every thread of this process has run on a CPU, user and system time
/// (`getrusage(RUSAGE_SELF)`, microsecond resolution).
fn process_cpu_ns() -> u64 {
    // SAFETY: `rusage` is plain old data; all zeros is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: writes one `rusage` into a live local.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) }, 0);
    let ns = |t: libc::timeval| (t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64) * 1_000;
    ns(ru.ru_utime) + ns(ru.ru_stime)
}

/// Runs the cases in interleaved rounds (in a fresh random order each round) and prints, per
/// case, the median time per read, the CPU the whole process used per read (the caller's side,
/// the shard's, and the kernel's work on their behalf), the median of
/// its per-round ratios to the direct baseline of the same depth in the same round (robust to
/// drift: the machine's load changes between rounds, hardly within one), and the shard
/// threads' CPU use.
fn ratios(cases: &mut [(&str, usize, Case<'_>)], rng: &mut Rng) {
    const ROUNDS: usize = 31;
    // Reads per case and round, at either depth: fifteen above a round's p99.
    const READS: usize = 1_500;
    let rounds = std::env::var("IOTHROTTLE_RATIOS_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .filter(|&r: &usize| r > 0)
        .unwrap_or(ROUNDS);
    let k = cases.len();
    let mut per_read = vec![Vec::with_capacity(rounds); k];
    let mut cpu = vec![Vec::with_capacity(rounds); k];
    let mut process_cpu = vec![Vec::with_capacity(rounds); k];
    // Every read's latency, pooled over the rounds.
    let mut lat: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds * READS); k];
    // Each round's own p99.
    let mut round_p99 = vec![Vec::with_capacity(rounds); k];
    // Nearest rank of a sorted, non-empty sample.
    let quantile =
        |v: &[f64], q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    // One warm-up round, not counted.
    for (_, _, run) in cases.iter_mut() {
        run(READS as u64 / 2, rng, &mut Vec::new());
    }
    for _ in 0..rounds {
        // A fresh order each round, so that no case always follows the same one.
        let mut order: Vec<usize> = (0..k).collect();
        for j in (1..k).rev() {
            order.swap(j, (rng.next() % (j as u64 + 1)) as usize);
        }
        for i in order {
            let (_, _, run) = &mut cases[i];
            let n = READS as u64;
            let before = shard_cpu_ns();
            let process_before = process_cpu_ns();
            let from = lat[i].len();
            let took = run(n, rng, &mut lat[i]);
            let process_used = process_cpu_ns() - process_before;
            let used = shard_cpu_ns() - before;
            // Each case runs once a round: entry `r` is round `r`.
            per_read[i].push(took.as_secs_f64() * 1e6 / n as f64);
            cpu[i].push(used as f64 / took.as_nanos() as f64);
            process_cpu[i].push(process_used as f64 / 1e3 / n as f64);
            let mut round = lat[i][from..].to_vec();
            round.sort_by(f64::total_cmp);
            round_p99[i].push(quantile(&round, 0.99));
        }
    }
    let idle = {
        std::thread::sleep(Duration::from_millis(50));
        let before = shard_cpu_ns();
        let start = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        (shard_cpu_ns() - before) as f64 / start.elapsed().as_nanos() as f64
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for l in &mut lat {
        l.sort_by(f64::total_cmp);
    }
    println!("disk/ratios: 4 KiB O_DIRECT random reads, {rounds} interleaved rounds, medians");
    println!(
        "{:<28} {:>5} {:>10} {:>8} {:>12} {:>13} {:>9} {:>9} {:>9} {:>10}",
        "case",
        "depth",
        "µs/read",
        "ratio",
        "I/O thr CPU",
        "CPU µs/read",
        "p50 µs",
        "p99 µs",
        "p99 ratio",
        "p99 r/rnd"
    );
    for i in 0..k {
        let (name, depth, _) = &cases[i];
        let base = (0..k)
            .find(|&b| cases[b].0 == "direct_io_uring" && cases[b].1 == *depth)
            .unwrap_or(i);
        let ratio: Vec<f64> = (0..rounds)
            .map(|r| per_read[i][r] / per_read[base][r])
            .collect();
        let p99 = quantile(&lat[i], 0.99);
        let round_ratio: Vec<f64> = (0..rounds)
            .map(|r| round_p99[i][r] / round_p99[base][r])
            .collect();
        println!(
            "{:<28} {:>5} {:>10.1} {:>7.2}× {:>11.0}% {:>13.2} {:>9.1} {:>9.1} {:>8.2}× {:>9.2}×",
            name,
            depth,
            median(per_read[i].clone()),
            median(ratio),
            100.0 * median(cpu[i].clone()),
            median(process_cpu[i].clone()),
            quantile(&lat[i], 0.5),
            p99,
            p99 / quantile(&lat[base], 0.99),
            median(round_ratio)
        );
    }
    println!("shard threads while idle (0.5 s): {:.1}% CPU", 100.0 * idle);
}

criterion::criterion_group!(benches, disk);
