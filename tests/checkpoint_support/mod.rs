//! Shared by the checkpoint tests: a store wrapper that holds a save's write in flight after
//! its caller was cancelled, and the cancelled-save scenario run against any store.
#![allow(dead_code)]

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, Snapshot,
};
use iothrottle::{
    BucketConfig, CheckpointError, MonotonicClock, Rate, SharedTokenBucket, Uncapped,
};
use tokio::sync::{Notify, Semaphore};

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 500)
}

/// A store whose next save, once armed, parks *after* it started, in a spawned task, until the
/// test opens the gate: the shape of `FileCheckpoint::save`'s blocking write, which runs on
/// after its caller was cancelled. The parked save's outcome is kept for the test.
pub struct Gated<S> {
    inner: Arc<S>,
    armed: AtomicBool,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
    held: Mutex<Option<tokio::task::JoinHandle<Result<(), CheckpointError>>>>,
}

impl<S: Checkpoint> Gated<S> {
    fn new(inner: S) -> Self {
        Gated {
            inner: Arc::new(inner),
            armed: AtomicBool::new(false),
            entered: Arc::new(Notify::new()),
            gate: Arc::new(Semaphore::new(0)),
            held: Mutex::new(None),
        }
    }

    /// Opens the gate and returns the parked save's outcome.
    async fn release_held(&self) -> Result<(), CheckpointError> {
        self.gate.add_permits(1);
        let task = self.held.lock().unwrap().take().expect("a save was held");
        task.await.unwrap()
    }
}

impl<S: Checkpoint> Checkpoint for Gated<S> {
    async fn save(&self, snapshot: Snapshot) -> Result<(), CheckpointError> {
        if !self.armed.swap(false, SeqCst) {
            return self.inner.save(snapshot).await;
        }
        let (inner, entered, gate) = (self.inner.clone(), self.entered.clone(), self.gate.clone());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            entered.notify_one();
            let _open = gate.acquire().await.unwrap();
            let outcome = inner.save(snapshot).await;
            let _ = tx.send(outcome.as_ref().map_err(|e| e.to_string()).copied());
            outcome
        });
        *self.held.lock().unwrap() = Some(task);
        match rx.await {
            Ok(Ok(())) => Ok(()),
            _ => Err(CheckpointError::Stopped),
        }
    }

    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        self.inner.load().await
    }
}

/// A `save_now` cancelled while its write is in flight, then a newer save that
/// publishes a higher strict mark, then the old write lands: the store must keep the newer
/// snapshot (its mark covers what was granted), else a restart regrants the difference.
pub async fn a_cancelled_save_never_lands_over_a_newer_one<S: Checkpoint>(store: S) {
    let store = Arc::new(Gated::new(store));
    let b = SharedTokenBucket::<Uncapped, _>::with_clock(cfg(), MonotonicClock::new()).unwrap();
    b.replenish();
    let b = Arc::new(CheckpointedBucket::new(b, Durability::strict(100)).unwrap());
    let config = CheckpointConfig::default().with_interval(Duration::from_secs(3600));
    let cp = Checkpointer::start(b.clone(), store.clone(), config).unwrap();
    cp.save_now().await.unwrap();
    // And the background task's first save (at start): after it, the task sleeps for an hour
    // and only our saves run.
    while b.stats().saves < 2 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(b.stats().mark, 100);
    // Grab on the bare bucket: no reservation request wakes the background task.
    b.bucket().grab(50);
    store.armed.store(true, SeqCst);
    {
        let old = cp.save_now();
        tokio::pin!(old);
        tokio::select! {
            biased;
            r = &mut old => panic!("the held save completed: {r:?}"),
            _ = store.entered.notified() => {}
        }
        // Dropped here: cancelled while its write is parked (mark 150 in flight).
    }
    b.bucket().grab(100);
    cp.save_now().await.unwrap();
    let published = b.stats().mark;
    assert_eq!(published, 250);
    let late = store.release_held().await;
    assert!(
        matches!(late, Err(CheckpointError::Superseded { .. })),
        "the late write must be refused, got {late:?}"
    );
    let stored = store.load().await.unwrap().unwrap();
    assert_eq!(stored.reserved, Some(published), "the store went backwards");
    // A restart counts everything up to the published mark as spent.
    let (restored, _) = CheckpointedBucket::<Uncapped, _>::restore(
        &*store,
        cfg(),
        MonotonicClock::new(),
        Durability::strict(100),
    )
    .await
    .unwrap();
    assert_eq!(restored.bucket().snapshot().tail, published);
    drop(cp);
}
