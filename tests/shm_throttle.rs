//! The async `Throttle` and the `Dispatcher` on a bucket in shared memory: two of each over
//! one file draw from one set of rovers (standing in for two processes, which
//! `shm_processes` runs for real).
#![cfg(all(feature = "shm", feature = "rt", target_os = "linux"))]

use std::sync::Arc;

use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures, IoRequest};
use iothrottle::{
    BucketConfig, Clock, Rate, SharedMemoryBucket, SharedTokenBucket, SystemMonotonicClock,
    Throttle, Uncapped,
};

#[test]
fn two_throttles_on_one_file_take_from_one_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.bucket");
    // A rate so low that nothing accrues while the test runs: only the first fill is there.
    let cfg = BucketConfig::new(Rate::new(1, std::time::Duration::from_secs(3600)), 100);
    let a = Throttle::from_bucket(Arc::new(
        SharedMemoryBucket::<Uncapped>::open(&path, cfg).unwrap(),
    ));
    let b = Throttle::from_bucket(Arc::new(
        SharedMemoryBucket::<Uncapped>::open(&path, cfg).unwrap(),
    ));
    let p = a.try_acquire(60).expect("the first fill is there");
    // The other throttle sees what the first one took: 40 left, not 100.
    assert!(b.try_acquire(41).is_err());
    let q = b.try_acquire(40).expect("40 are left");
    assert_eq!(a.bucket().snapshot().tail, b.bucket().snapshot().tail);
    drop((p, q));
}

#[test]
fn two_dispatchers_on_one_file_share_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.bucket");
    let disk = DiskModel::symmetric(Figures {
        iops: 20_000,
        bandwidth: 200_000_000,
    });
    let cfg = BucketConfig::new(Rate::per_second(DiskModel::TOKENS_PER_SECOND), 750_000)
        .with_threshold(20_000);
    let open = || {
        let clock: Arc<dyn Clock> = Arc::new(SystemMonotonicClock);
        Arc::new(SharedTokenBucket::<Uncapped, _>::open_with_clock(&path, cfg, clock).unwrap())
    };
    let build = |bucket| {
        let mut b = Dispatcher::builder()
            .disk(disk)
            .shards(1)
            .pin_threads(false)
            .shared_bucket(bucket);
        let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
        (b.build().unwrap(), c)
    };
    let (d1, c1) = build(open());
    let (d2, c2) = build(open());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let req = IoRequest::read(4096);
    let cost = disk.cost(&req);
    rt.block_on(d1.submit(c1, req, async {}).unwrap()).unwrap();
    rt.block_on(d2.submit(c2, req, async {}).unwrap()).unwrap();
    // Both dispatchers' grabs are on the one tail (reservations may be larger than a
    // request; both saw at least their own request's cost claimed).
    let s1 = d1.bucket_state();
    let s2 = d2.bucket_state();
    assert!(s1.tail >= 2 * cost && s2.tail >= 2 * cost, "{s1:?} {s2:?}");
    assert_eq!(open().snapshot().tail, d2.bucket_state().tail);
    d1.shutdown();
    d2.shutdown();
}
