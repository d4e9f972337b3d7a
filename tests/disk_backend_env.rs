#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `IOTHROTTLE_IO_BACKEND` forces the blocking pool (its own test binary: it sets the
//! process's environment).

use std::sync::Arc;

use iothrottle::disk::{AlignedBuf, Backend, FileOptions, Resolved, ThrottledFile, BACKEND_ENV};
use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures};

#[test]
fn the_environment_variable_forces_the_blocking_pool() {
    std::env::set_var(BACKEND_ENV, "blocking");
    assert_eq!(Backend::Auto.resolve().unwrap(), Resolved::Blocking);
    // An explicit choice wins over the environment.
    assert_eq!(Backend::IoUring.resolve().unwrap(), Resolved::IoUring);

    let mut b = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1_000_000_000,
        }));
    let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let f = ThrottledFile::open(d, class, dir.path().join("f"), FileOptions::read_write()).unwrap();
    assert_eq!(f.backend(), Resolved::Blocking);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (res, buf) = rt.block_on(f.write_at(AlignedBuf::from_slice(&[3u8; 8192]).unwrap(), 4096));
    res.unwrap();
    let (n, back) = rt.block_on(f.read_at(buf, 4096));
    assert_eq!(n.unwrap(), 8192);
    assert!(back.iter().all(|&b| b == 3));

    std::env::set_var(BACKEND_ENV, "io_uring");
    assert_eq!(Backend::Auto.resolve().unwrap(), Resolved::IoUring);
    std::env::remove_var(BACKEND_ENV);
}
