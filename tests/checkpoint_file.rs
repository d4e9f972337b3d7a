//! `FileCheckpoint` on a real file system: atomic replace, first start, damaged files and the
//! empty-bucket fallback.

use std::time::Duration;

use iothrottle::checkpoint::{
    Checkpoint, CheckpointedBucket, Durability, FileCheckpoint, RestoreOutcome, Snapshot,
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
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["b.ckpt"]);
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
