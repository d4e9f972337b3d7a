#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `ThrottledFile` I/O from the engine's own tasks on a shard ([`Dispatcher::spawn_on`]): a
//! piece that may go at once is issued on the shard's ring by the task itself (no message to
//! the shard's loop, no queue wait), is counted once, keeps FIFO behind what its class has
//! queued, and holds a shutdown until the kernel is done with it.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use iothrottle::disk::{AlignedBuf, Backend, FileOptions, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures, IoRequest};

mod common;

/// A liveness bound only: a test that would hang fails after it instead.
const GUARD: Duration = Duration::from_secs(60);

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn options(piece: usize) -> FileOptions {
    FileOptions {
        backend: Backend::IoUring,
        max_piece: Some(piece),
        ..FileOptions::read_write()
    }
}

fn in_time<F: Future>(rt: &tokio::runtime::Runtime, f: F) -> F::Output {
    rt.block_on(async {
        tokio::time::timeout(GUARD, f)
            .await
            .expect("the shard's I/O never ended")
    })
}

/// Writes 8 blocks and reads each back, from a task on the only shard; returns the class's
/// stats once the task is done.
fn round_trip_on_the_shard(
    d: &Arc<Dispatcher>,
    class: ClassId,
    rt: &tokio::runtime::Runtime,
) -> iothrottle::dispatcher::ClassStats {
    let dir = scratch();
    let f = Arc::new(
        ThrottledFile::open(d.clone(), class, dir.path().join("data"), options(16 << 10)).unwrap(),
    );
    let task = d
        .spawn_on(0, move || async move {
            for i in 0..8 {
                common::disk::write_and_read_back(&f, i).await;
            }
        })
        .unwrap();
    in_time(rt, task).unwrap();
    let stats = rt.block_on(d.stats());
    let s = d.bucket_state();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        d.limit(),
        "every token back"
    );
    stats.classes[0].clone()
}

/// The first piece included (the shard's ring is made for it), every piece a shard's task
/// submits while the bucket holds its tokens goes without the shard's queue: no queue wait is
/// recorded (the histogram's least value, 1 ns, stands for none), and each is counted once. With caller dispatch off the same pieces take the
/// queue, which the loop empties a hop later.
#[test]
fn a_shard_tasks_pieces_that_may_go_are_issued_by_the_task_and_counted_once() {
    let rt = common::disk::rt_io();
    let (d, class) = common::disk::dispatcher(true);
    let c = round_trip_on_the_shard(&d, class, &rt);
    assert_eq!((c.requests, c.completed, c.in_flight), (16, 16, 0));
    // No wait is recorded as the histogram's least value.
    assert!(
        c.queue_wait_max() <= Duration::from_nanos(1),
        "a piece waited {:?} in the shard's queue",
        c.queue_wait_max()
    );
    d.shutdown();

    let (off, class) = common::disk::build(common::disk::builder(true).caller_dispatch(false));
    let c = round_trip_on_the_shard(&off, class, &rt);
    assert_eq!((c.requests, c.completed, c.in_flight), (16, 16, 0));
    assert!(
        c.queue_wait_max() > Duration::from_nanos(1),
        "with caller dispatch off every piece goes through the queue"
    );
    off.shutdown();
}

/// A 4 KiB read a shard's task submits after a write whose 64 pieces wait for tokens (a
/// 20 MB/s disk: about 14 ms of them) is dispatched after all of them.
#[test]
fn a_shard_tasks_read_never_overtakes_pieces_waiting_for_tokens() {
    let mut b = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 20_000_000,
        }));
    let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let dir = scratch();
    let f = Arc::new(
        ThrottledFile::open(d.clone(), class, dir.path().join("data"), options(ALIGN)).unwrap(),
    );
    let rt = common::disk::rt_io();
    let dd = d.clone();
    let task = d
        .spawn_on(0, move || async move {
            let g = f.clone();
            let len = 64 * ALIGN;
            let write = tokio::task::spawn_local(async move {
                g.write_at(AlignedBuf::zeroed(len).unwrap(), 0).await.0
            });
            // The write submits its pieces when it first runs; the shard queues those the
            // tokens do not cover yet.
            let ahead = loop {
                // Dispatched and waiting: every piece is in once they make 64.
                let c = &dd.stats().await.classes[0];
                if c.requests + c.queued >= 64 {
                    break c.queued;
                }
                tokio::task::yield_now().await;
            };
            let (n, _) = f.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0).await;
            assert_eq!(n.unwrap(), ALIGN);
            let left = dd.stats().await.classes[0].queued;
            write.await.unwrap().unwrap();
            (ahead, left)
        })
        .unwrap();
    let (ahead, left) = in_time(&rt, task).unwrap();
    // Only a shard descheduled for most of those 14 ms leaves none queued.
    assert!(ahead > 0, "no piece was still waiting when the read came");
    assert_eq!(
        left, 0,
        "the read overtook {left} of the {ahead} pieces queued before it"
    );
    let c = &rt.block_on(d.stats()).classes[0];
    assert_eq!((c.requests, c.completed), (65, 65));
    d.shutdown();
}

/// FIFO within a class holds for the shard's own tasks even with tokens there: a request of
/// the class still in the shard's channel (submitted by the same task, the loop has not taken
/// it yet) holds back a read that could otherwise go at once, so both take the queue.
#[test]
fn a_shard_tasks_read_queues_behind_a_request_of_its_class_not_yet_dispatched() {
    let rt = common::disk::rt_io();
    let (d, class) = common::disk::dispatcher(true);
    let dir = scratch();
    let f = Arc::new(
        ThrottledFile::open(d.clone(), class, dir.path().join("data"), options(ALIGN)).unwrap(),
    );
    let dd = d.clone();
    let task = d
        .spawn_on(0, move || async move {
            let (res, _) = f.write_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0).await;
            res.unwrap();
            let before = dd.stats().await.classes[0].requests;
            // Queued through the channel; the read follows without a yield in between.
            let earlier = dd
                .submit(class, IoRequest::read(ALIGN as u64), async {})
                .unwrap();
            let (n, _) = f.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 0).await;
            assert_eq!(n.unwrap(), ALIGN);
            earlier.await.unwrap();
            before
        })
        .unwrap();
    assert_eq!(in_time(&rt, task).unwrap(), 1, "the write went first");
    let c = &rt.block_on(d.stats()).classes[0];
    assert_eq!((c.requests, c.completed), (3, 3));
    // The write went at once (1 ns, no wait); the other two waited for the loop.
    assert!(
        c.queue_wait_quantile(0.5) > Duration::from_nanos(1),
        "the read went ahead of a request of its class: median wait {:?}",
        c.queue_wait_quantile(0.5)
    );
    d.shutdown();
}

/// A shutdown cancels the shard's tasks, but a write one of them issued on the shard's ring
/// is still in the kernel (an O_DIRECT pipe whose one page is full): the shard does not stop,
/// nor free the buffer, nor give the tokens back, until the kernel completes it.
#[test]
fn a_shutdown_waits_for_a_shard_tasks_write_still_in_the_kernel() {
    let (d, class) = common::disk::dispatcher(true);
    let (mut rd, f) = common::disk::full_pipe_file(&d, class);
    let (buf, dropped) = common::disk::Watched::page(9);
    let (issued_tx, issued) = std::sync::mpsc::channel();
    let task = d
        .spawn_on(0, move || async move {
            let mut write = Box::pin(f.write_at(buf, 0));
            std::future::poll_fn(|cx| {
                assert!(write.as_mut().poll(cx).is_pending(), "the pipe is full");
                std::task::Poll::Ready(())
            })
            .await;
            issued_tx.send(()).unwrap();
            write.await.0
        })
        .unwrap();
    issued.recv().unwrap();
    let rt = common::disk::rt_io();
    let c = &rt.block_on(d.stats()).classes[0];
    assert_eq!(
        (c.requests, c.queued, c.in_flight),
        (1, 0, 1),
        "dispatched by the task itself"
    );
    // The task is cancelled; the write is not: it is the kernel's.
    let stopped = d.shutdown_timeout(Duration::from_millis(100));
    assert!(stopped.is_err(), "the shard stopped with a write in flight");
    assert!(
        in_time(&rt, task).is_err(),
        "a shutdown cancels the shard's tasks"
    );
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the kernel still holds the buffer"
    );
    common::disk::assert_tokens_held(&d);
    common::disk::drain_full_pipe(&mut rd, 9);
    d.shutdown();
    assert!(
        dropped.load(Ordering::SeqCst),
        "the buffer went with the write"
    );
    let s = d.bucket_state();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        d.limit(),
        "every token back"
    );
    let c = &d.stats_blocking().classes[0];
    assert_eq!((c.requests, c.completed, c.in_flight), (1, 1, 0));
}
