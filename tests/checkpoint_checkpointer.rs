#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! The background checkpointer under tokio's paused time, with an in-memory store whose
//! failures the test switches on and off (the real stores have their own tests).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, Snapshot,
};
use iothrottle::{
    BucketConfig, CheckpointError, Rate, SharedTokenBucket, Throttle, TokioClock, Uncapped,
};

/// A store in memory that can be told to fail.
#[derive(Clone, Default)]
struct Mem(Arc<MemInner>);

#[derive(Default)]
struct MemInner {
    snap: Mutex<Option<Snapshot>>,
    failing: AtomicBool,
    attempts: AtomicU64,
}

impl Mem {
    fn fail(&self, on: bool) {
        self.0.failing.store(on, Ordering::SeqCst);
    }
    fn attempts(&self) -> u64 {
        self.0.attempts.load(Ordering::SeqCst)
    }
    fn stored(&self) -> Option<Snapshot> {
        *self.0.snap.lock().unwrap()
    }
}

impl Checkpoint for Mem {
    async fn save(&self, snapshot: Snapshot) -> Result<(), CheckpointError> {
        self.0.attempts.fetch_add(1, Ordering::SeqCst);
        if self.0.failing.load(Ordering::SeqCst) {
            return Err(CheckpointError::Postgres {
                op: "upsert",
                message: "connection refused (test)".into(),
            });
        }
        *self.0.snap.lock().unwrap() = Some(snapshot);
        Ok(())
    }
    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        Ok(self.stored())
    }
}

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 500)
}

fn bucket(durability: Durability) -> Arc<CheckpointedBucket<Uncapped, TokioClock>> {
    let b = SharedTokenBucket::with_clock(cfg(), TokioClock::new()).unwrap();
    b.replenish();
    Arc::new(CheckpointedBucket::new(b, durability).unwrap())
}

fn every(ms: u64) -> CheckpointConfig {
    CheckpointConfig::default().with_interval(Duration::from_millis(ms))
}

#[tokio::test(start_paused = true)]
async fn saves_every_interval_and_once_more_on_shutdown() {
    let store = Mem::default();
    let b = bucket(Durability::Periodic);
    let cp = Checkpointer::start(b.clone(), store.clone(), CheckpointConfig::default()).unwrap();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(store.attempts(), 4, "at 0, 1, 2 and 3 s");
    assert_eq!(b.stats().saves, 4);
    b.grab(123);
    cp.shutdown().await.unwrap();
    assert_eq!(store.attempts(), 5);
    let saved = store.stored().unwrap();
    assert_eq!(
        saved.state,
        b.bucket().snapshot(),
        "the final save has the last state"
    );
    assert!(b.stats().last_save_unix_nanos > 0);
}

#[tokio::test(start_paused = true)]
async fn failures_are_visible_retried_with_backoff_and_the_bucket_keeps_working() {
    let store = Mem::default();
    store.fail(true);
    let b = bucket(Durability::Periodic);
    let cp = Checkpointer::start(
        b.clone(),
        store.clone(),
        every(1_000).with_backoff(Duration::from_millis(50), Duration::from_secs(2)),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    // Attempts at 0, 0.05, 0.15, 0.35, 0.75, 1.55, 3.15, 5.15, 7.15, 9.15 s: back-off doubling
    // to its 2 s maximum, not a hot loop.
    assert_eq!(store.attempts(), 10);
    let s = b.stats();
    assert_eq!(
        (s.saves, s.save_failures, s.consecutive_failures),
        (0, 10, 10)
    );
    let err = cp.save_now().await.unwrap_err();
    assert!(err.to_string().contains("connection refused"), "{err}");
    // The limiter keeps granting from memory.
    let tail = b.grab(400);
    b.bucket().replenish();
    assert_eq!(b.deficiency(tail), 0);
    store.fail(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = b.stats();
    assert!(s.saves >= 1, "{s:?}");
    assert_eq!(s.consecutive_failures, 0);
    assert_eq!(
        store.stored().unwrap().state.tail,
        b.bucket().snapshot().tail
    );
    cp.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn strict_grants_only_what_a_durable_reservation_covers() {
    let store = Mem::default();
    let b = bucket(Durability::strict(100));
    // Before any reservation, tokens in the bucket are not usable.
    let t = b.grab(10);
    assert_eq!(b.bucket().deficiency(t), 0);
    assert_eq!(b.deficiency(t), 10);
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    b.wait_durable(t).await;
    assert_eq!(b.deficiency(t), 0);
    let saved = store.stored().unwrap();
    let mark = saved.reserved.expect("strict saves a mark");
    assert_eq!(mark, b.stats().mark);
    assert!(mark.wrapping_sub(t) as i64 >= 0);
    // Use tokens quickly: the reservation is renewed ahead of use, without waiting a full
    // interval.
    let th = Throttle::with_checkpoint(&b);
    for _ in 0..40 {
        drop(th.acquire(10).await.unwrap());
    }
    let s = b.stats();
    assert!(s.saves >= 4, "{s:?}");
    let last = store.stored().unwrap();
    assert!(
        last.reserved
            .unwrap()
            .wrapping_sub(b.bucket().snapshot().tail) as i64
            >= 0,
        "every granted position is under the durable mark"
    );
    cp.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn strict_waits_while_storage_stalls_and_fail_open_proceeds_and_counts() {
    // Waits.
    let store = Mem::default();
    store.fail(true);
    let b = bucket(Durability::strict(100));
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    let waiter = {
        let th = Throttle::with_checkpoint(&b);
        tokio::spawn(async move { th.acquire(10).await.unwrap().tail().unwrap() })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !waiter.is_finished(),
        "no grant without a durable reservation"
    );
    assert!(b.stats().grabs_past_mark >= 1);
    assert!(b.stats().save_failures >= 1);
    store.fail(false);
    let tail = waiter.await.unwrap();
    assert!(b.stats().mark.wrapping_sub(tail) as i64 >= 0);
    cp.shutdown().await.unwrap();

    // Fail-open proceeds, and says so.
    let store = Mem::default();
    store.fail(true);
    let b = bucket(Durability::Strict {
        reserve_ahead: 100,
        fail_open: true,
    });
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    let tail = Throttle::with_checkpoint(&b)
        .acquire(10)
        .await
        .unwrap()
        .tail()
        .unwrap();
    assert_eq!(b.deficiency(tail), 0);
    assert_eq!(b.stats().grabs_past_mark, 1);
    drop(cp);
}

#[tokio::test(start_paused = true)]
async fn a_strict_restore_counts_the_reservation_as_spent() {
    let store = Mem::default();
    let b = bucket(Durability::strict(200));
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(b.stats().mark, 200, "the first reservation, from tail 0");
    drop(Throttle::with_checkpoint(&b).acquire(50).await.unwrap()); // 450 left in the bucket, reserved up to 200
    drop(cp); // a crash: no final save
    let (restored, report) = CheckpointedBucket::<Uncapped, _>::restore(
        &store,
        cfg(),
        TokioClock::new(),
        Durability::strict(200),
    )
    .await
    .unwrap();
    let report = report.unwrap();
    assert_eq!(report.reserved_spent, 200);
    assert_eq!(report.saved_tokens, 300, "500 - the 200 reserved");
    assert_eq!(restored.bucket().snapshot().tail, 200);
}

#[test]
fn bad_settings_are_typed_errors() {
    let outside = Checkpointer::start(bucket(Durability::Periodic), Mem::default(), every(10));
    assert!(matches!(
        outside,
        Err(CheckpointError::InvalidConfig { .. })
    ));
    assert!(matches!(
        Durability::strict(0).validate(),
        Err(CheckpointError::InvalidConfig { .. })
    ));
    assert!(matches!(
        CheckpointConfig::default()
            .with_backoff(Duration::from_secs(2), Duration::from_secs(1))
            .validate(),
        Err(CheckpointError::InvalidConfig { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn an_idle_strict_shutdown_gives_the_unused_reservation_back() {
    let store = Mem::default();
    let b = bucket(Durability::strict(200));
    let cp = Checkpointer::start(b.clone(), store.clone(), every(1_000)).unwrap();
    drop(Throttle::with_checkpoint(&b).acquire(50).await.unwrap());
    cp.shutdown_idle().await.unwrap();
    let saved = store.stored().unwrap();
    assert_eq!(
        saved.reserved,
        Some(50),
        "the mark is the tail: nothing left reserved"
    );
    let (restored, report) = CheckpointedBucket::<Uncapped, _>::restore(
        &store,
        cfg(),
        TokioClock::new(),
        Durability::strict(200),
    )
    .await
    .unwrap();
    assert_eq!(report.unwrap().reserved_spent, 0);
    assert_eq!(restored.bucket().available(), 450);
}
