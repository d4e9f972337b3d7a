//! The modelled disks the dispatcher tests state, and the dispatcher and runtime the `disk_*`
//! tests run their real I/O on.

use std::sync::Arc;

use iothrottle::dispatcher::{
    ClassConfig, ClassId, DiskModel, Dispatcher, DispatcherBuilder, Figures,
};

/// A fast NVMe drive (2 GB/s reads, 1 GB/s writes, 400k read IOPS, 100k write IOPS), stated
/// explicitly: there is no default disk.
pub const NVME: DiskModel = DiskModel::new(
    Figures {
        iops: 400_000,
        bandwidth: 2_000_000_000,
    },
    Figures {
        iops: 100_000,
        bandwidth: 1_000_000_000,
    },
);

/// One unpinned shard over a fast modelled disk (1 GB/s, 100k IOPS), one class `io`.
pub fn builder(capped: bool) -> DispatcherBuilder {
    Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .capped(capped)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1_000_000_000,
        }))
        .class(ClassConfig::new("io", 100))
}

/// Builds `builder` (which has the class `io`) and returns it with that class.
pub fn build(builder: DispatcherBuilder) -> (Arc<Dispatcher>, ClassId) {
    let d = builder.build().unwrap();
    let class = d.class_id("io").unwrap();
    (Arc::new(d), class)
}

/// [`builder`], built, and its class.
pub fn dispatcher(capped: bool) -> (Arc<Dispatcher>, ClassId) {
    build(builder(capped))
}

/// A current-thread runtime with timers and an I/O driver: a caller whose file pieces may go on
/// its own ring.
pub fn rt_io() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A current-thread runtime with timers, for the callers' side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}
