#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `FileCheckpoint` on a real file system: atomic replace, first start, damaged files and the
//! empty-bucket fallback.

mod checkpoint_support;

use std::sync::Arc;
use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, FileCheckpoint,
    RestoreOutcome, Snapshot,
};
use iothrottle::{BucketConfig, CheckpointError, ManualClock, Rate, SharedTokenBucket, Uncapped};

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 500)
}

fn bucket_with(tokens_used: u64) -> SharedTokenBucket<Uncapped, ManualClock> {
    let b = SharedTokenBucket::with_clock(cfg(), ManualClock::new()).unwrap();
    b.replenish();
    b.grab(tokens_used);
    b
}

#[test]
fn save_replaces_atomically_and_leaves_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileCheckpoint::new(dir.path().join("b.ckpt"));
    assert!(
        store.load_blocking().unwrap().is_none(),
        "missing file = first start"
    );
    let first = Snapshot::of(&bucket_with(100), None);
    store.save_blocking(&first).unwrap();
    assert_eq!(store.load_blocking().unwrap(), Some(first));
    let second = Snapshot::of(&bucket_with(450), Some(1_000));
    store.save_blocking(&second).unwrap();
    assert_eq!(store.load_blocking().unwrap(), Some(second));
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, [".b.ckpt.lock", "b.ckpt"]);
}

#[test]
fn save_into_a_missing_directory_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileCheckpoint::new(dir.path().join("no/such/dir/b.ckpt"));
    let err = store
        .save_blocking(&Snapshot::of(&bucket_with(1), None))
        .unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
    assert!(err.to_string().contains("no/such/dir"), "{err}");
}

#[test]
fn damaged_files_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.ckpt");
    let store = FileCheckpoint::new(&path);
    store
        .save_blocking(&Snapshot::of(&bucket_with(10), None))
        .unwrap();
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, &good[..40]).unwrap();
    assert!(matches!(
        store.load_blocking(),
        Err(CheckpointError::Truncated { len: 40, .. })
    ));
    let mut flipped = good.clone();
    flipped[20] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    assert!(matches!(
        store.load_blocking(),
        Err(CheckpointError::ChecksumMismatch { .. })
    ));
    std::fs::write(&path, b"hello world, not a checkpoint at all").unwrap();
    assert!(matches!(
        store.load_blocking(),
        Err(CheckpointError::BadMagic)
    ));
}

#[tokio::test]
async fn a_corrupt_file_restores_an_empty_bucket_never_a_full_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.ckpt");
    std::fs::write(&path, [0u8; 86]).unwrap();
    let store = FileCheckpoint::new(&path);
    let err = CheckpointedBucket::<Uncapped, _>::restore(
        &store,
        cfg(),
        ManualClock::new(),
        Durability::Periodic,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, CheckpointError::BadMagic));
    let clock = ManualClock::new();
    let (b, outcome) = CheckpointedBucket::<Uncapped, _>::restore_or_empty(
        &store,
        cfg(),
        clock.clone(),
        Durability::Periodic,
    )
    .await
    .unwrap();
    assert!(matches!(
        outcome,
        RestoreOutcome::Fallback(CheckpointError::BadMagic)
    ));
    assert_eq!(b.bucket().replenish(), 0);
    assert_eq!(b.bucket().available(), 0, "empty, not full");
    clock.advance(Duration::from_millis(20));
    assert_eq!(b.bucket().replenish(), 20, "and refills at the rate");
}

#[tokio::test]
async fn first_start_then_restore_through_the_trait() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileCheckpoint::new(dir.path().join("b.ckpt"));
    let (b, outcome) = CheckpointedBucket::<Uncapped, _>::restore_or_empty(
        &store,
        cfg(),
        ManualClock::new(),
        Durability::Periodic,
    )
    .await
    .unwrap();
    assert!(matches!(outcome, RestoreOutcome::FirstStart));
    assert_eq!(
        b.bucket().replenish(),
        500,
        "a new bucket fills on its first replenish"
    );
    b.grab(480);
    store.save(Snapshot::of(b.bucket(), None)).await.unwrap();
    let (b2, report) = CheckpointedBucket::<Uncapped, _>::restore(
        &store,
        cfg(),
        ManualClock::new(),
        Durability::Periodic,
    )
    .await
    .unwrap();
    let report = report.expect("restored");
    assert_eq!(report.saved_tokens, 20);
    // Only the wall time since the save is credited: at 1000/s, far below the limit here.
    assert!(report.tokens >= 20 && report.tokens as u128 == (20 + report.earned).min(500));
    assert_eq!(b2.bucket().available() as i64, report.tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_file_save_never_lands_over_a_newer_one() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_support::a_cancelled_save_never_lands_over_a_newer_one(FileCheckpoint::new(
        dir.path().join("b.ckpt"),
    ))
    .await;
}

/// A checkpointer that did not restore from the store (a fresh bucket over an old file)
/// numbers its saves above the stored one instead of being refused for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_checkpointer_numbers_its_saves_above_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileCheckpoint::new(dir.path().join("b.ckpt"));
    let mut old = Snapshot::of(&bucket_with(10), None);
    old.seq = 1_000;
    store.save_blocking(&old).unwrap();
    let mut older = old;
    older.seq = 999;
    assert!(matches!(
        store.save_blocking(&older),
        Err(CheckpointError::Superseded {
            seq: 999,
            stored: 1_000
        })
    ));
    let b = SharedTokenBucket::<Uncapped, _>::with_clock(cfg(), ManualClock::new()).unwrap();
    let b = Arc::new(CheckpointedBucket::new(b, Durability::Periodic).unwrap());
    let cp = Checkpointer::start(b, store.clone(), CheckpointConfig::default()).unwrap();
    cp.save_now().await.unwrap();
    assert!(store.load_blocking().unwrap().unwrap().seq > 1_000);
    cp.shutdown().await.unwrap();
}

/// Two `FileCheckpoint`s on one path (one process: same pid, same temp counter)
/// saving at once must not truncate or rename away each other's temp file.
#[test]
fn two_stores_on_one_path_do_not_clobber_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.ckpt");
    let snap = Snapshot::of(&bucket_with(10), Some(100));
    std::thread::scope(|s| {
        for _ in 0..2 {
            let store = FileCheckpoint::new(&path);
            s.spawn(move || {
                for _ in 0..200 {
                    store.save_blocking(&snap).unwrap();
                    assert_eq!(store.load_blocking().unwrap(), Some(snap));
                }
            });
        }
    });
    let tmp = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_str().unwrap().ends_with(".tmp")
        })
        .count();
    assert_eq!(tmp, 0);
}

/// Temp files of killed saves (any pid, old and new names) are removed when a store
/// on that path is first used; other files are left alone.
#[test]
fn stale_temp_files_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.ckpt");
    let stale = [".b.ckpt.4242.0.tmp", ".b.ckpt.4242-17.tmp"];
    let others = [
        ".b.ckpt.x.tmp",
        ".b.ckpt.other.1.2.tmp",
        ".c.ckpt.1-2.tmp",
        "b.ckpt.1-2.tmp",
    ];
    for name in stale.iter().chain(&others) {
        std::fs::write(dir.path().join(name), b"half a save").unwrap();
    }
    let store = FileCheckpoint::new(&path);
    assert!(store.load_blocking().unwrap().is_none());
    for name in stale {
        assert!(!dir.path().join(name).exists(), "{name} not removed");
    }
    for name in others {
        assert!(dir.path().join(name).exists(), "{name} removed");
    }
    // And by a save, for a store that saves first.
    std::fs::write(dir.path().join(stale[1]), b"half a save").unwrap();
    let store = FileCheckpoint::new(&path);
    store
        .save_blocking(&Snapshot::of(&bucket_with(1), None))
        .unwrap();
    assert!(!dir.path().join(stale[1]).exists());
}
