//! `PgCheckpoint` against a real throwaway PostgreSQL cluster (see `tests/common/pg.rs`).

mod checkpoint_support;
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pg::cluster_or_skip;
use common::snapshot::{cfg, snapshot_after};
use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, PgCheckpoint,
    RestoreOutcome,
};
use iothrottle::{CheckpointError, MonotonicClock, SharedTokenBucket, Uncapped};

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

/// A name the server cannot store is refused when the store is made, not at every save
/// (where `restore_or_empty` would fall back to an empty bucket and a checkpointer would retry
/// for ever).
#[test]
fn a_bucket_name_with_nul_is_refused_up_front() {
    match PgCheckpoint::new("host=localhost", "a\0b") {
        Err(CheckpointError::InvalidName { name, reason }) => {
            assert_eq!(name, "a\0b");
            assert!(reason.contains("NUL"), "{reason}");
        }
        other => panic!("expected InvalidName, got {other:?}"),
    }
    assert!(matches!(
        PgCheckpoint::new("host=localhost", &"n".repeat(201)),
        Err(CheckpointError::InvalidName { reason, .. }) if reason.contains("200")
    ));
    assert!(PgCheckpoint::new("host=localhost", &"n".repeat(200)).is_ok());
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
            supported: 2
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

/// On Postgres: a save cancelled while its upsert is in flight lands after a newer
/// one; the row keeps the newer snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_pg_save_never_lands_over_a_newer_one() {
    let Some(pg) = cluster_or_skip("a_cancelled_pg_save_never_lands_over_a_newer_one") else {
        return;
    };
    let store = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    checkpoint_support::a_cancelled_save_never_lands_over_a_newer_one(store).await;
}

/// On Postgres, at the SQL level: an upsert with a lower `seq` committed after a
/// higher one on another connection (a timed-out upsert landing late) is refused; an old table
/// without the `seq` column is upgraded and its row loads with `seq` 0.
#[tokio::test]
async fn a_late_upsert_on_another_connection_is_refused() {
    let Some(pg) = cluster_or_skip("a_late_upsert_on_another_connection_is_refused") else {
        return;
    };
    let (client, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // A table and a row as version 1 wrote them (no seq column).
    client
        .batch_execute(
            "CREATE TABLE iothrottle_checkpoint (name text PRIMARY KEY, version integer NOT NULL,
                tail bigint NOT NULL, head bigint NOT NULL, ceil bigint, reserved bigint,
                wall_unix_ns bigint NOT NULL, rate_tokens bigint NOT NULL,
                rate_period_ns bigint NOT NULL, bucket_limit bigint NOT NULL,
                saved_at timestamptz NOT NULL DEFAULT clock_timestamp());
             INSERT INTO iothrottle_checkpoint VALUES ('disk', 1, 0, 100, NULL, 50,
                1700000000000000000, 1000, 1000000000, 500, now());",
        )
        .await
        .unwrap();
    let a = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    let b = PgCheckpoint::new(&pg.url(), "disk").unwrap();
    // Installing again upgrades the version-1 table (adds `seq`); loading never does DDL.
    PgCheckpoint::new(&pg.connection_string(), "disk")
        .unwrap()
        .install()
        .await
        .unwrap();
    let old = a.load().await.unwrap().unwrap();
    assert_eq!((old.seq, old.reserved), (0, Some(50)));
    let mut newer = snapshot_after(20);
    newer.seq = 5;
    a.save(newer).await.unwrap();
    let mut late = snapshot_after(10);
    late.seq = 4;
    let err = b.save(late).await.unwrap_err();
    assert!(
        matches!(err, CheckpointError::Superseded { seq: 4, stored: 5 }),
        "{err}"
    );
    assert_eq!(b.load().await.unwrap(), Some(newer));
    // An equal seq replaces (snapshots saved by hand leave it at 0).
    let mut same = snapshot_after(30);
    same.seq = 5;
    b.save(same).await.unwrap();
    assert_eq!(a.load().await.unwrap(), Some(same));
}
