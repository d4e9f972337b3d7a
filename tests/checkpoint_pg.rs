//! `PgCheckpoint` against a real throwaway PostgreSQL cluster (see `tests/common/pg.rs`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pg::cluster_or_skip;
use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, PgCheckpoint,
    RestoreOutcome, Snapshot,
};
use iothrottle::{
    BucketConfig, CheckpointError, MonotonicClock, Rate, SharedTokenBucket, Uncapped,
};

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 500)
}

fn snapshot_after(used: u64) -> Snapshot {
    let b: SharedTokenBucket = SharedTokenBucket::new(cfg()).unwrap();
    b.replenish();
    b.grab(used);
    Snapshot::of(&b, Some(used + 7))
}

#[tokio::test]
async fn one_row_per_bucket_one_upsert_per_save() {
    let Some(pg) = cluster_or_skip("one_row_per_bucket_one_upsert_per_save") else {
        return;
    };
    let a = PgCheckpoint::new(&pg.connection_string(), "disk-a").unwrap();
    let b = PgCheckpoint::new(&pg.url(), "disk-b").unwrap();
    assert_eq!(
        a.load().await.unwrap(),
        None,
        "first start: table created, no row"
    );
    let s1 = snapshot_after(10);
    let s2 = snapshot_after(20);
    let s3 = snapshot_after(30);
    a.save(s1).await.unwrap();
    b.save(s2).await.unwrap();
    a.save(s3).await.unwrap();
    assert_eq!(a.load().await.unwrap(), Some(s3));
    assert_eq!(b.load().await.unwrap(), Some(s2));
    let (client, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let rows = client
        .query(
            "select name, tail from iothrottle_checkpoint order by name",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        got,
        [("disk-a".to_string(), 30), ("disk-b".to_string(), 20)]
    );
}

#[tokio::test]
async fn survives_a_database_restart_and_reports_the_outage() {
    let Some(mut pg) = cluster_or_skip("survives_a_database_restart_and_reports_the_outage") else {
        return;
    };
    let store = PgCheckpoint::new(&pg.connection_string(), "disk")
        .unwrap()
        .with_timeout(Duration::from_secs(5));
    let b: SharedTokenBucket<Uncapped, MonotonicClock> = SharedTokenBucket::new(cfg()).unwrap();
    b.replenish();
    let b = Arc::new(CheckpointedBucket::new(b, Durability::Periodic).unwrap());
    let cp = Checkpointer::start(
        b.clone(),
        store,
        CheckpointConfig::default()
            .with_interval(Duration::from_millis(50))
            .with_backoff(Duration::from_millis(20), Duration::from_millis(200)),
    )
    .unwrap();
    cp.save_now().await.unwrap();

    pg.crash();
    // An explicit save fails with a clear error; the stats show it; the bucket still works.
    let err = cp.save_now().await.unwrap_err();
    assert!(matches!(err, CheckpointError::Postgres { .. }), "{err}");
    assert!(b.stats().consecutive_failures >= 1);
    let tail = b.grab(100);
    b.bucket().replenish();
    assert_eq!(b.deficiency(tail), 0, "grants continue from memory");

    pg.start_again().unwrap();
    // The next save reconnects.
    cp.save_now().await.unwrap();
    assert_eq!(b.stats().consecutive_failures, 0);
    let tail_now = b.bucket().snapshot().tail;
    cp.shutdown().await.unwrap();
    let again = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    assert_eq!(again.load().await.unwrap().unwrap().state.tail, tail_now);
}

#[tokio::test]
async fn a_database_that_is_down_at_start_gives_an_empty_bucket() {
    let Some(mut pg) = cluster_or_skip("a_database_that_is_down_at_start_gives_an_empty_bucket")
    else {
        return;
    };
    let conn = pg.connection_string();
    pg.stop();
    let store = PgCheckpoint::new(&conn, "disk").unwrap();
    let (b, outcome) = CheckpointedBucket::<Uncapped, _>::restore_or_empty(
        &store,
        cfg(),
        MonotonicClock::new(),
        Durability::Periodic,
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            RestoreOutcome::Fallback(CheckpointError::Postgres { op: "connect", .. })
        ),
        "{outcome:?}"
    );
    assert_eq!(b.bucket().available(), 0);
}

#[test]
fn bad_connection_settings_are_typed_errors() {
    assert!(matches!(
        PgCheckpoint::new("host=x port=notaport", "disk"),
        Err(CheckpointError::ConnectionString { .. })
    ));
    assert!(matches!(
        PgCheckpoint::new("host=localhost", ""),
        Err(CheckpointError::InvalidName { .. })
    ));
}

#[tokio::test]
async fn rows_that_cannot_be_trusted_are_typed_errors() {
    let Some(pg) = cluster_or_skip("rows_that_cannot_be_trusted_are_typed_errors") else {
        return;
    };
    let store = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    store.save(snapshot_after(10)).await.unwrap();
    let (client, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .execute("update iothrottle_checkpoint set version = 99", &[])
        .await
        .unwrap();
    assert!(matches!(
        store.load().await,
        Err(CheckpointError::UnsupportedVersion {
            found: 99,
            supported: 1
        })
    ));
    client
        .execute(
            "update iothrottle_checkpoint set version = 1, rate_tokens = 0",
            &[],
        )
        .await
        .unwrap();
    assert!(matches!(
        store.load().await,
        Err(CheckpointError::InvalidSnapshot { .. })
    ));
    let (b, outcome) = CheckpointedBucket::<Uncapped, _>::restore_or_empty(
        &store,
        cfg(),
        MonotonicClock::new(),
        Durability::Periodic,
    )
    .await
    .unwrap();
    assert!(matches!(outcome, RestoreOutcome::Fallback(_)));
    assert_eq!(b.bucket().available(), 0, "empty, never full");
}
