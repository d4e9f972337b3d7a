//! The hot path (`grab(1)` + `deficiency`, a replenish every 64 grabs) with a checkpointer
//! saving in the background vs without: the checkpoint must cost the hot path nothing
//! measurable. The checkpointer saves to a real file every 10 ms (100× the default rate) on
//! its own runtime thread.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, Criterion};
use iothrottle::checkpoint::{
    CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, FileCheckpoint,
};
use iothrottle::{BucketConfig, Rate, SharedTokenBucket, Uncapped};

fn config() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000_000_000), 1 << 30)
}

fn hot_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("checkpoint");

    let bare: SharedTokenBucket<Uncapped> = SharedTokenBucket::new(config()).unwrap();
    bare.replenish();
    let mut i = 0u64;
    g.bench_function("grab+deficiency/no checkpoint", |b| {
        b.iter(|| {
            i += 1;
            if i.is_multiple_of(64) {
                bare.replenish();
            }
            let t = bare.grab(1);
            black_box(bare.deficiency(t))
        })
    });

    for (name, durability) in [
        ("periodic", Durability::Periodic),
        // Renewed every 500k grabs: each renewal is a file save (with fsync).
        ("strict", Durability::strict(1_000_000)),
    ] {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let bucket: SharedTokenBucket<Uncapped> = SharedTokenBucket::new(config()).unwrap();
        bucket.replenish();
        let cb = Arc::new(CheckpointedBucket::new(bucket, durability).unwrap());
        let cp = {
            let _guard = rt.enter();
            Checkpointer::start(
                cb.clone(),
                FileCheckpoint::new(dir.path().join("bench.ckpt")),
                CheckpointConfig::default().with_interval(Duration::from_millis(10)),
            )
            .unwrap()
        };
        let mut i = 0u64;
        // Whether criterion ran this benchmark (a name filter may skip it).
        let mut measured = false;
        g.bench_function(
            format!("grab+deficiency/{name} checkpointer running"),
            |b| {
                measured = true;
                b.iter(|| {
                    i += 1;
                    if i.is_multiple_of(64) {
                        cb.bucket().replenish();
                    }
                    let t = cb.grab(1);
                    black_box(cb.deficiency(t))
                })
            },
        );
        assert!(
            !measured || cb.stats().saves > 0,
            "the checkpointer ran during the measurement"
        );
        rt.block_on(cp.shutdown()).unwrap();
    }
    g.finish();
}

criterion_group!(benches, hot_path);
