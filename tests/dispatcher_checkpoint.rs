#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `DispatcherBuilder::checkpoint`: the dispatcher over a checkpointed bucket. The bucket runs
//! on a frozen `ManualClock`, so no token accrues during a test: every token is accounted for
//! exactly. The shards run in real time; the tests wait for states
//! (a held save, a grab past the mark), never for durations.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, Snapshot,
};
use iothrottle::dispatcher::{ClassConfig, ClassId, Dispatcher, IoHandle, IoRequest};
use iothrottle::{
    BucketConfig, Capped, CheckpointError, Clock, ManualClock, Rate, SharedTokenBucket, Uncapped,
};
use tokio::sync::watch;

use common::disk::NVME;

/// A store in memory whose saves can be held (they wait, as a stalled disk would).
#[derive(Clone)]
struct Held(Arc<HeldInner>);

struct HeldInner {
    snap: Mutex<Option<Snapshot>>,
    hold: watch::Sender<bool>,
    /// Saves waiting in `save` right now.
    pending: AtomicU64,
}

impl Held {
    fn new() -> Self {
        Held(Arc::new(HeldInner {
            snap: Mutex::new(None),
            hold: watch::Sender::new(false),
            pending: AtomicU64::new(0),
        }))
    }
    fn hold(&self, on: bool) {
        self.0.hold.send_replace(on);
    }
    fn pending(&self) -> u64 {
        self.0.pending.load(Ordering::SeqCst)
    }
}

impl Checkpoint for Held {
    async fn save(&self, snapshot: Snapshot) -> Result<(), CheckpointError> {
        self.0.pending.fetch_add(1, Ordering::SeqCst);
        let mut rx = self.0.hold.subscribe();
        let _ = rx.wait_for(|held| !*held).await;
        *self.0.snap.lock().unwrap() = Some(snapshot);
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        Ok(*self.0.snap.lock().unwrap())
    }
}

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 10_000).with_threshold(1)
}

/// A full bucket (10,000 tokens) on a frozen clock.
fn full<M: iothrottle::Mode>() -> SharedTokenBucket<M, Arc<dyn Clock>> {
    let manual = ManualClock::new();
    let clock: Arc<dyn Clock> = Arc::new(manual.clone());
    let b = SharedTokenBucket::with_clock(cfg(), clock).unwrap();
    manual.advance(Duration::from_secs(100));
    b.replenish();
    b
}

fn dispatcher<M: iothrottle::Mode>(cb: &CheckpointedBucket<M, Arc<dyn Clock>>) -> Dispatcher {
    Dispatcher::builder()
        .disk(NVME)
        .shards(2)
        .pin_threads(false)
        .class(ClassConfig::new("c", 100))
        .checkpoint(cb)
        .build()
        .unwrap()
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn never() -> CheckpointConfig {
    CheckpointConfig::default().with_interval(Duration::from_secs(3600))
}

/// A strict bucket (a reservation of 100 tokens at a time) whose store is held after its
/// first save, under a dispatcher with 40 requests of 10 tokens submitted: run until one grab
/// went past the durable mark and a save of it is pending.
struct Stalled {
    cb: Arc<CheckpointedBucket<Uncapped, Arc<dyn Clock>>>,
    /// The bucket's tokens before any request.
    tokens0: i64,
    store: Held,
    cp: Checkpointer<Held, Uncapped, Arc<dyn Clock>>,
    d: Dispatcher,
    c: ClassId,
    handles: Vec<IoHandle<()>>,
}

impl Stalled {
    async fn start() -> Self {
        let cb =
            Arc::new(CheckpointedBucket::new(full::<Uncapped>(), Durability::strict(100)).unwrap());
        let tokens0 = cb.bucket().snapshot().tokens();
        let store = Held::new();
        let cp = Checkpointer::start(cb.clone(), store.clone(), never()).unwrap();
        cp.save_now().await.unwrap();
        store.hold(true);
        let d = dispatcher(&cb);
        let c = d.class_id("c").unwrap();
        let handles: Vec<_> = (0..40)
            .map(|_| d.submit(c, IoRequest::tokens(10), async {}).unwrap())
            .collect();
        until(|| cb.stats().grabs_past_mark >= 1 && store.pending() >= 1).await;
        Stalled {
            cb,
            tokens0,
            store,
            cp,
            d,
            c,
            handles,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_strict_checkpoint_grants_only_up_to_the_durable_mark() {
    let cb =
        Arc::new(CheckpointedBucket::new(full::<Uncapped>(), Durability::strict(100)).unwrap());
    let tail0 = cb.bucket().snapshot().tail;
    let store = Held::new();
    let cp = Checkpointer::start(cb.clone(), store.clone(), never()).unwrap();
    cp.save_now().await.unwrap();
    let mark0 = cb.stats().mark;
    assert_eq!(mark0.wrapping_sub(tail0), 100, "one reservation is durable");
    store.hold(true);

    let d = dispatcher(&cb);
    let c = d.class_id("c").unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..50)
        .map(|_| {
            let ran = ran.clone();
            d.submit(c, IoRequest::tokens(10), async move {
                ran.fetch_add(10, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    // A shard grabbed past the mark and the checkpointer's save for more is held.
    until(|| cb.stats().grabs_past_mark >= 1 && store.pending() >= 1).await;
    for _ in 0..20 {
        assert_eq!(cb.stats().mark, mark0, "the save is held: the mark stays");
        let dispatched = d.stats().await.tokens();
        assert!(
            dispatched <= 100,
            "dispatched {dispatched} tokens past the durable mark (100)"
        );
        assert!(ran.load(Ordering::SeqCst) <= 100);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        ran.load(Ordering::SeqCst) < 500,
        "everything ran while the save was held"
    );
    // The save lands: the shards resume (woken by the mark, not by a timer).
    store.hold(false);
    for h in handles {
        h.await.unwrap();
    }
    assert_eq!(ran.load(Ordering::SeqCst), 500);
    let tail = cb.bucket().snapshot().tail;
    assert!(
        cb.stats().mark.wrapping_sub(tail) as i64 >= 0,
        "every dispatched token is under the durable mark"
    );
    d.shutdown_async().await;
    cp.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_strict_checkpoint_cancelled_requests_give_their_tokens_back() {
    let Stalled {
        cb,
        tokens0,
        store,
        cp,
        d,
        c,
        handles,
    } = Stalled::start().await;
    // Give up on every request: those reserved past the mark and those still queued.
    drop(handles);
    store.hold(false);
    // One more request, to see the shards past the cancelled ones.
    d.submit(c, IoRequest::tokens(10), async {})
        .unwrap()
        .await
        .unwrap();
    d.shutdown_async().await;
    let stats = d.stats().await;
    let spent = tokens0 - cb.bucket().snapshot().tokens();
    assert_eq!(
        spent as u64,
        stats.tokens(),
        "only dispatched requests spent tokens (the clock is frozen: nothing accrued)"
    );
    assert!(stats.classes[0].cancelled > 0, "{stats:?}");
    assert!(stats.tokens() < 410);
    cp.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_checkpoint_restart_restores_the_rovers_without_a_free_burst() {
    let store = Held::new();
    // First run: periodic mode, capped; spend 9,000 of the 10,000 tokens.
    let cb = Arc::new(CheckpointedBucket::new(full::<Capped>(), Durability::Periodic).unwrap());
    let cp = Checkpointer::start(cb.clone(), store.clone(), never()).unwrap();
    let d = dispatcher(&cb);
    let c = d.class_id("c").unwrap();
    let hs: Vec<_> = (0..90)
        .map(|_| d.submit(c, IoRequest::tokens(100), async {}).unwrap())
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    d.shutdown_async().await;
    let before = cb.bucket().snapshot();
    assert_eq!(before.tokens(), 1_000);
    cp.shutdown().await.unwrap();
    drop(cb);

    // Restart from the checkpoint.
    let (cb, report) = CheckpointedBucket::<Capped, Arc<dyn Clock>>::restore(
        &store,
        cfg(),
        Arc::new(ManualClock::new()),
        Durability::Periodic,
    )
    .await
    .unwrap();
    let report = report.expect("a checkpoint was saved");
    let d = dispatcher(&cb);
    let after = d.bucket_state();
    assert_eq!(after.tail, before.tail, "the tail rover is restored");
    assert_eq!(after.tokens(), report.tokens);
    assert_eq!(report.saved_tokens, 1_000);
    // Only the downtime (at 1,000 tokens/s) adds to what was left: not a full bucket.
    assert!(
        u128::try_from(after.tokens() - 1_000).unwrap() <= report.earned,
        "{report:?}"
    );
    d.shutdown_async().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_strict_checkpoint_shutdown_now_does_not_wait_for_a_stalled_store() {
    let Stalled {
        cb,
        tokens0,
        store,
        cp,
        d,
        handles,
        ..
    } = Stalled::start().await;
    // The store is still held: the shards stop anyway, failing what is not dispatched.
    let d = tokio::task::spawn_blocking(move || {
        d.shutdown_now();
        d
    })
    .await
    .unwrap();
    let mut failed = 0;
    for h in handles {
        if h.await.is_err() {
            failed += 1;
        }
    }
    assert!(failed > 0);
    let stats = d.stats().await;
    let spent = tokens0 - cb.bucket().snapshot().tokens();
    assert_eq!(
        spent as u64,
        stats.tokens(),
        "the undispatched reservations went back"
    );
    assert!(stats.tokens() <= 100, "nothing past the durable mark");
    store.hold(false);
    cp.shutdown().await.unwrap();
}
