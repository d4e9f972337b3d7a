#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! Strict and periodic checkpoints are a layer of `Throttle`
//! (`Throttle::with_checkpoint`): cancel safe, threshold-aware, a cost above the limit is a
//! typed error, and a grab past the durable mark sleeps until the mark is saved. Under tokio's
//! paused time with an in-memory store that the test can stall.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Context;
use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, Snapshot,
};
use iothrottle::{
    AcquireError, BucketConfig, Capped, CheckpointError, Mode, Rate, SharedTokenBucket, Throttle,
    TokioClock, Uncapped,
};

use common::polls::count_polls;

/// A store in memory whose saves can be stalled (they wait until un-stalled).
#[derive(Clone, Default)]
struct Mem(Arc<MemInner>);

#[derive(Default)]
struct MemInner {
    snap: Mutex<Option<Snapshot>>,
    stalled: AtomicBool,
    resumed: tokio::sync::Notify,
}

impl Mem {
    fn stall(&self, on: bool) {
        self.0.stalled.store(on, Ordering::SeqCst);
        if !on {
            self.0.resumed.notify_waiters();
        }
    }
}

impl Checkpoint for Mem {
    async fn save(&self, snapshot: Snapshot) -> Result<(), CheckpointError> {
        loop {
            let resumed = self.0.resumed.notified();
            if !self.0.stalled.load(Ordering::SeqCst) {
                break;
            }
            resumed.await;
        }
        *self.0.snap.lock().unwrap() = Some(snapshot);
        Ok(())
    }
    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        Ok(*self.0.snap.lock().unwrap())
    }
}

fn checkpointed<M: Mode>(
    cfg: BucketConfig,
    durability: Durability,
) -> Arc<CheckpointedBucket<M, TokioClock>> {
    let b = SharedTokenBucket::with_clock(cfg, TokioClock::new()).unwrap();
    Arc::new(CheckpointedBucket::new(b, durability).unwrap())
}

fn every(ms: u64) -> CheckpointConfig {
    CheckpointConfig::default().with_interval(Duration::from_millis(ms))
}

/// Polls `f` once with a no-op waker; true if it completed.
fn poll_once<F: Future + Unpin>(f: &mut F) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    Pin::new(f).poll(&mut cx).is_ready()
}

/// In strict capped mode, cancel an acquire at every await it can be parked on —
/// before its tokens accrue, while its tokens are there but past the durable mark (storage
/// stalled), right after the mark moved — and check that nothing leaks: once everything is
/// cancelled and granted permits are dropped, `ceil - tail` is the limit again and the full
/// throughput is there (a fresh acquire of the whole limit is served).
#[tokio::test(start_paused = true)]
async fn cancel_at_every_await_in_strict_capped_mode_lowers_nothing() {
    const LIMIT: u64 = 100;
    let cfg = BucketConfig::new(Rate::per_second(1_000), LIMIT);
    let b = checkpointed::<Capped>(cfg, Durability::strict(40));
    let store = Mem::default();
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    let th = Throttle::with_checkpoint(&b);
    // Every await point, as "poll the acquire k times, with time moving 1 ms between polls".
    for k in 0..6u64 {
        for stalled in [false, true] {
            store.stall(stalled);
            let mut f = Box::pin(th.acquire(30));
            for _ in 0..k {
                if poll_once(&mut f) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            drop(f); // cancelled (or a granted permit dropped: capped release)
            store.stall(false);
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    // Nothing in flight: the bucket may fill to its limit again.
    let s = b.bucket().snapshot();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        LIMIT,
        "ceil lowered: {s:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let full = th.acquire(LIMIT).await.unwrap();
    assert_eq!(full.tokens(), LIMIT);
    drop(full);
    let s = th.stats();
    assert!(s.cancelled >= 6, "{s:?}");
    assert_eq!(s.waiting, 0);
    cp.shutdown().await.unwrap();
}

/// A 1-token wait on a threshold-100 bucket is woken O(1) times, not ~100.
#[tokio::test(start_paused = true)]
async fn a_threshold_100_wait_is_woken_a_bounded_number_of_times() {
    let cfg = BucketConfig::new(Rate::per_second(1_000), 1_000).with_threshold(100);
    let b = checkpointed::<Uncapped>(cfg, Durability::Periodic);
    let cp = Checkpointer::start(b.clone(), Mem::default(), every(1_000)).unwrap();
    let th = Throttle::with_checkpoint(&b);
    drop(th.acquire(1_000).await.unwrap()); // fills and empties the bucket
    let start = tokio::time::Instant::now();
    let (f, polls) = count_polls(th.acquire(1));
    drop(f.await.unwrap());
    assert_eq!(start.elapsed(), Duration::from_millis(100), "threshold");
    let polls = polls.load(Ordering::Relaxed);
    assert!(polls <= 3, "polled {polls} times");
    cp.shutdown().await.unwrap();
}

/// A cost above the limit is a typed error at once (accepted, it would never be met in capped
/// mode, and would block every later claim).
#[tokio::test(start_paused = true)]
async fn a_cost_above_the_limit_is_a_typed_error() {
    let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
    let b = checkpointed::<Capped>(cfg, Durability::strict(50));
    let cp = Checkpointer::start(b.clone(), Mem::default(), every(1_000)).unwrap();
    let th = Throttle::with_checkpoint(&b);
    assert_eq!(
        th.acquire(101).await.unwrap_err(),
        AcquireError::CostExceedsLimit {
            cost: 101,
            limit: 100
        }
    );
    // Nothing was claimed: later claims are served.
    assert_eq!(th.acquire(100).await.unwrap().tokens(), 100);
    cp.shutdown().await.unwrap();
}

/// A grab past the durable mark sleeps (no polling) while storage stalls, and is served once
/// the mark is saved; every granted position is under the mark.
#[tokio::test(start_paused = true)]
async fn strict_waits_for_the_mark_without_polling() {
    let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
    let b = checkpointed::<Uncapped>(cfg, Durability::strict(50));
    let store = Mem::default();
    store.stall(true);
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    let th = Throttle::with_checkpoint(&b);
    let (f, polls) = count_polls({
        let th = th.clone();
        async move { th.acquire(10).await }
    });
    let waiter = tokio::spawn(f);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!waiter.is_finished(), "no grant without a durable mark");
    let before = polls.load(Ordering::Relaxed);
    assert!(before <= 4, "polled {before} times while storage stalled");
    store.stall(false);
    let permit = waiter.await.unwrap().unwrap();
    let tail = permit.tail().unwrap();
    assert!(b.stats().mark.wrapping_sub(tail) as i64 >= 0);
    cp.shutdown().await.unwrap();
}
