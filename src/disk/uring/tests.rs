//! The io_uring driver, its reapers and the blocking pool, on real files.

use std::future::Future;
use std::io::Read;
use std::os::fd::FromRawFd;
use std::time::Duration;

use std::fs::File;

use super::*;
use crate::disk::AlignedBuf;
use crate::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures, IoRequest};

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
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1 << 30,
        }));
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
    // SAFETY: plain fcntl on our own descriptor.
    assert!(unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, super::super::ALIGN as i32) } >= 0);
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
            // The shard's polling rounds drive this ring too.
            crate::dispatcher::shard_io::register(reap_here);
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
