#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `ThrottledFile` under caller dispatch: a piece that may go at once is issued on the caller's
//! own io_uring and completes with the only shard's thread blocked; what does not qualify keeps
//! the shard's path.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use iothrottle::disk::{
    wait_for_completions, AlignedBuf, Backend, FileOptions, ThrottledFile, ALIGN,
};
use iothrottle::dispatcher::{ClassId, Dispatcher};

mod common;

use common::disk::{block_shard, stamp};

/// A liveness bound only: a test that would hang fails after it instead.
const GUARD: Duration = Duration::from_secs(60);

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// One unpinned shard over a fast modelled disk, one class, caller dispatch on.
fn dispatcher() -> (Arc<Dispatcher>, ClassId) {
    common::disk::build(common::disk::builder(true).caller_dispatch(true))
}

fn options(backend: Backend) -> FileOptions {
    FileOptions {
        backend,
        max_piece: Some(16 * 1024),
        ..FileOptions::read_write()
    }
}

/// A scratch directory (bound first by the caller, so dropped after the file), a dispatcher of
/// [`dispatcher`], and a file in the directory on the io_uring backend.
fn data_file() -> (tempfile::TempDir, Arc<Dispatcher>, Arc<ThrottledFile>) {
    let dir = scratch();
    let (d, class) = dispatcher();
    let path = dir.path().join("data");
    let f =
        Arc::new(ThrottledFile::open(d.clone(), class, path, options(Backend::IoUring)).unwrap());
    (dir, d, f)
}

/// The pieces one [`round_trip`] submits: 8 × (1 write + 2 reads) of one piece, then 64 + 64.
const ROUND_TRIP_PIECES: u64 = 8 * 3 + 128;

/// Writes and reads back blocks one piece at a time (each goes at once) while the shard is
/// blocked, then a large transfer (more pieces than the bucket holds at once: some queue on the
/// shard) once it is free again.
async fn round_trip(d: Arc<Dispatcher>, f: Arc<ThrottledFile>) {
    let blocked = block_shard(&d);
    for i in 0..8 {
        let at = (i * 4 * ALIGN) as u64;
        common::disk::write_and_read_back(&f, i).await;
        // A future that moves: read again from a task of its own (another worker on a
        // multi-thread runtime).
        let g = f.clone();
        let (n, back) =
            tokio::spawn(
                async move { g.read_at(AlignedBuf::zeroed(4 * ALIGN).unwrap(), at).await },
            )
            .await
            .unwrap();
        assert_eq!(n.unwrap(), 4 * ALIGN);
        assert!(back[..] == stamp(i)[..], "block {i} read back from a task");
    }
    drop(blocked);
    let len = 1 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    let (res, _) = f.write_at(AlignedBuf::from_slice(&data).unwrap(), 0).await;
    res.unwrap();
    let (n, back) = f.read_at(AlignedBuf::zeroed(len).unwrap(), 0).await;
    assert_eq!(n.unwrap(), len);
    assert!(back[..] == data[..], "1 MiB read back");
}

fn check_accounted(d: &Dispatcher, rt: &tokio::runtime::Runtime, requests: u64) {
    let stats = rt.block_on(d.stats());
    let c = &stats.classes[0];
    assert_eq!(c.requests, requests, "every piece counted once");
    assert_eq!(c.completed, requests);
    assert_eq!(c.in_flight, 0);
    let s = d.bucket_state();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        d.limit(),
        "every token back"
    );
}

fn in_time<F: Future>(rt: &tokio::runtime::Runtime, f: F) -> F::Output {
    rt.block_on(async {
        tokio::time::timeout(GUARD, f)
            .await
            .expect("an I/O waited for the blocked shard")
    })
}

#[test]
fn caller_dispatched_io_round_trips_on_a_current_thread_runtime_with_the_shard_blocked() {
    let (_dir, d, f) = data_file();
    let rt = common::disk::rt_io();
    in_time(&rt, round_trip(d.clone(), f));
    check_accounted(&d, &rt, ROUND_TRIP_PIECES);
    d.shutdown();
}

#[test]
fn caller_dispatched_io_round_trips_on_a_multi_thread_runtime_with_the_shard_blocked() {
    let (_dir, d, f) = data_file();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(3)
        .enable_all()
        .build()
        .unwrap();
    let task = rt.spawn(round_trip(d.clone(), f));
    in_time(&rt, task).unwrap();
    check_accounted(&d, &rt, ROUND_TRIP_PIECES);
    d.shutdown();
}

/// A `ThrottledFile` on the write end of an O_DIRECT pipe whose one-page buffer is full (the
/// next write stays in flight until the read end is read), the read end, and its dispatcher.
fn full_pipe_file() -> (std::fs::File, ThrottledFile, Arc<Dispatcher>) {
    let (d, class) = dispatcher();
    let (rd, f) = common::disk::full_pipe_file(&d, class);
    (rd, f, d)
}

/// A write into a full pipe stays in flight on the caller's ring; its future is dropped. The
/// buffer lives and the tokens stay taken until the kernel completes the write; then both go,
/// and shutdown does not wait for anything.
#[test]
fn a_dropped_caller_dispatched_write_keeps_its_buffer_and_tokens_until_the_kernel_is_done() {
    let (mut rd, f, d) = full_pipe_file();
    let rt = common::disk::rt_io();
    let (buf, dropped) = common::disk::Watched::page(9);
    let blocked = block_shard(&d);
    rt.block_on(async {
        let mut write = Box::pin(f.write_at(buf, 0));
        std::future::poll_fn(|cx| {
            assert!(write.as_mut().poll(cx).is_pending(), "the pipe is full");
            std::task::Poll::Ready(())
        })
        .await;
        drop(write);
    });
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the kernel still holds the buffer"
    );
    common::disk::assert_tokens_held(&d);
    // Issued without the shard (it is blocked): make room, the kernel completes it, and the
    // caller's runtime reaps it.
    common::disk::drain_full_pipe(&mut rd, 9);
    in_time(&rt, async {
        while !dropped.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
    });
    drop(blocked);
    check_accounted(&d, &rt, 1);
    drop(rt);
    d.shutdown();
}

/// Runs `f` to its end on the calling thread, outside any tokio runtime (parks between polls).
fn park_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// Blocks the shard, starts one 4 KiB read on `rt`, and checks that it does not complete until
/// the shard is free again: it took the shard's path.
fn takes_the_shard_path(d: &Dispatcher, f: Arc<ThrottledFile>, rt: &tokio::runtime::Runtime) {
    let blocked = block_shard(d);
    let read = rt.spawn(async move { f.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0).await.0 });
    rt.block_on(async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    });
    assert!(!read.is_finished(), "it cannot complete without the shard");
    drop(blocked);
    assert_eq!(in_time(rt, read).unwrap().unwrap(), ALIGN);
}

#[test]
fn caller_dispatch_falls_back_to_the_shard_without_an_io_driver_or_on_the_blocking_pool() {
    let dir = scratch();
    let path = dir.path().join("data");
    let (d, class) = dispatcher();
    let f =
        Arc::new(ThrottledFile::open(d.clone(), class, &path, options(Backend::IoUring)).unwrap());
    let io = common::disk::rt_io();
    let (res, _) = io.block_on(f.write_at(AlignedBuf::from_slice(&stamp(1)).unwrap(), 0));
    res.unwrap();
    // A runtime without its I/O driver: nothing could reap a caller's ring.
    let no_io = common::disk::rt();
    takes_the_shard_path(&d, f.clone(), &no_io);
    takes_the_shard_path(&d, f.clone(), &no_io);
    // The blocking pool.
    let pool =
        Arc::new(ThrottledFile::open(d.clone(), class, &path, options(Backend::Blocking)).unwrap());
    takes_the_shard_path(&d, pool, &io);
    // Outside any runtime: the future is polled by another executor.
    let blocked = block_shard(&d);
    let (tx, rx) = mpsc::channel();
    let g = f.clone();
    let reader = std::thread::spawn(move || {
        let out = park_on(g.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0));
        tx.send(out.0.unwrap()).unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "it cannot complete without the shard"
    );
    drop(blocked);
    assert_eq!(rx.recv_timeout(GUARD).unwrap(), ALIGN);
    reader.join().unwrap();
    // The same file, on a runtime with its driver, goes from the caller again.
    let blocked = block_shard(&d);
    let (n, _) = in_time(&io, f.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0));
    assert_eq!(n.unwrap(), ALIGN);
    drop(blocked);
    check_accounted(&d, &io, 1 + 2 + 1 + 1 + 1);
    d.shutdown();
}

/// The caller's runtime shuts down with a write in flight on its ring: a thread takes over the
/// reaping, so the buffer lives until the kernel completes the write and the tokens come back
/// then; nothing hangs.
#[test]
fn a_runtime_shut_down_mid_io_leaves_the_write_to_a_reaper_thread() {
    let (mut rd, f, d) = full_pipe_file();
    let rt = common::disk::rt_io();
    let (buf, dropped) = common::disk::Watched::page(5);
    let blocked = block_shard(&d);
    let f = Arc::new(f);
    let writer = f.clone();
    let write = rt.spawn(async move { writer.write_at(buf, 0).await.0 });
    rt.block_on(async {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    });
    assert!(!write.is_finished(), "the pipe is full");
    drop(rt);
    assert!(!dropped.load(Ordering::SeqCst), "the kernel still holds it");
    // Written from the caller's ring.
    common::disk::drain_full_pipe(&mut rd, 5);
    let waited = std::time::Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(waited.elapsed() < GUARD, "the completion was never reaped");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(blocked);
    let rt = common::disk::rt_io();
    check_accounted(&d, &rt, 1);
    d.shutdown();
}

/// A thread that leaves one runtime for another (the first still alive, but no longer driven)
/// gets a ring reaped by the second: its I/O completes with the shard blocked.
#[test]
fn a_thread_moving_to_another_runtime_gets_a_ring_reaped_there() {
    let (_dir, d, f) = data_file();
    let first = common::disk::rt_io();
    let second = common::disk::rt_io();
    let blocked = block_shard(&d);
    let (res, _) = in_time(
        &first,
        f.write_at(AlignedBuf::from_slice(&stamp(3)).unwrap(), 0),
    );
    res.unwrap();
    let (n, back) = in_time(
        &second,
        f.read_at(AlignedBuf::zeroed(4 * ALIGN).unwrap(), 0),
    );
    assert_eq!(n.unwrap(), 4 * ALIGN);
    assert!(back[..] == stamp(3)[..]);
    drop(blocked);
    check_accounted(&d, &second, 2);
    drop(first);
    d.shutdown();
}

/// The defaults: a `ThrottledFile` piece that may go at once goes from the caller's ring (it
/// completes with the shard blocked) while a future given to `submit` runs on the shard (it
/// waits for the shard); `caller_dispatch(false)` sends the file's pieces through the shard.
#[test]
fn by_default_file_pieces_go_from_the_callers_ring_and_submitted_futures_run_on_the_shard() {
    let dir = scratch();
    let path = dir.path().join("data");
    let rt = common::disk::rt_io();
    let (d, class) = common::disk::build(common::disk::builder(true));
    let f =
        Arc::new(ThrottledFile::open(d.clone(), class, &path, options(Backend::IoUring)).unwrap());
    let blocked = block_shard(&d);
    let (res, _) = in_time(
        &rt,
        f.write_at(AlignedBuf::from_slice(&stamp(2)).unwrap(), 0),
    );
    res.unwrap();
    let (n, back) = in_time(&rt, f.read_at(AlignedBuf::zeroed(4 * ALIGN).unwrap(), 0));
    assert_eq!(n.unwrap(), 4 * ALIGN);
    assert!(back[..] == stamp(2)[..], "read back with the shard blocked");
    let ran = Arc::new(AtomicBool::new(false));
    let flag = ran.clone();
    let handle = d
        .submit(
            class,
            iothrottle::dispatcher::IoRequest::tokens(1),
            async move {
                flag.store(true, Ordering::SeqCst);
            },
        )
        .unwrap();
    let job = rt.spawn(handle);
    rt.block_on(async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    });
    assert!(
        !job.is_finished() && !ran.load(Ordering::SeqCst),
        "a submitted future waits for its shard"
    );
    drop(blocked);
    in_time(&rt, job).unwrap().unwrap();
    assert!(ran.load(Ordering::SeqCst));
    check_accounted(&d, &rt, 1 + 1 + 1);
    d.shutdown();

    let (off, class) = common::disk::build(common::disk::builder(true).caller_dispatch(false));
    let g = Arc::new(
        ThrottledFile::open(off.clone(), class, &path, options(Backend::IoUring)).unwrap(),
    );
    takes_the_shard_path(&off, g, &rt);
    off.shutdown();
}

/// A runtime that parks on the caller's ring ([`wait_for_completions`] as its park hook), and
/// how many times the hook waited (it had a read or write in flight).
fn rt_parking_on_the_ring(max: Duration) -> (tokio::runtime::Runtime, Arc<AtomicU64>) {
    let waits = Arc::new(AtomicU64::new(0));
    let counted = waits.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(move || {
            if wait_for_completions(max) {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        })
        .build()
        .unwrap();
    (rt, waits)
}

/// With the runtime parking on the ring, caller-dispatched I/O round-trips as it does without
/// (the shard blocked: nothing goes through it), and the hook did wait on the ring.
#[test]
fn caller_dispatched_io_round_trips_with_the_runtime_parking_on_the_ring() {
    let (_dir, d, f) = data_file();
    let (rt, waits) = rt_parking_on_the_ring(Duration::from_secs(1));
    in_time(&rt, round_trip(d.clone(), f));
    check_accounted(&d, &rt, ROUND_TRIP_PIECES);
    assert!(
        waits.load(Ordering::SeqCst) > 0,
        "the runtime parked on the ring with I/O in flight"
    );
    d.shutdown();
}

/// The wait is bounded: with a write stuck in flight (a full pipe), the hook waits on the ring,
/// gives up at its bound, and the runtime still takes a wake-up from another thread; the write
/// completes once the pipe is read. Without I/O in flight, or without a ring, it does not wait.
#[test]
fn parking_on_the_ring_lets_go_at_its_bound_and_for_the_completion() {
    assert!(
        !wait_for_completions(Duration::from_secs(1)),
        "no ring on this thread: no wait"
    );
    let (mut rd, f, d) = full_pipe_file();
    let (rt, waits) = rt_parking_on_the_ring(Duration::from_millis(2));
    let blocked = block_shard(&d);
    let (wake_tx, wake_rx) = tokio::sync::oneshot::channel();
    let (drained_tx, drained_rx) = mpsc::channel();
    let waited = waits.clone();
    let other = std::thread::spawn(move || {
        // The hook waited with the write in flight and returned without its completion (the
        // pipe is full until this thread reads it): the runtime went on to park as usual.
        let start = std::time::Instant::now();
        while waited.load(Ordering::SeqCst) == 0 {
            assert!(
                start.elapsed() < GUARD,
                "the runtime never parked on the ring"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        wake_tx.send(()).unwrap();
        drained_rx.recv().unwrap();
        common::disk::drain_full_pipe(&mut rd, 4);
    });
    let (written, woken_after) = in_time(&rt, async {
        let write = tokio::spawn(async move {
            f.write_at(AlignedBuf::from_slice(&[4; ALIGN]).unwrap(), 0)
                .await
                .0
        });
        wake_rx.await.expect("woken from another thread");
        let woken_after = waits.load(Ordering::SeqCst);
        assert!(!write.is_finished(), "the pipe is still full");
        drained_tx.send(()).unwrap();
        (write.await.unwrap(), woken_after)
    });
    written.unwrap();
    assert!(woken_after >= 1);
    other.join().unwrap();
    drop(blocked);
    check_accounted(&d, &rt, 1);
    // Nothing in flight any more: the hook returns at once.
    rt.block_on(async { assert!(!wait_for_completions(Duration::from_secs(1))) });
    d.shutdown();
}
