//! `PgCheckpoint` with a least-privilege role and a server that commits asynchronously,
//! against a real throwaway cluster (`tests/common/pg.rs`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pg::{cluster_or_skip, cluster_with_settings_or_skip, PgCluster};
use common::pg_session::client as admin;
use common::snapshot::{cfg, snapshot_after};
use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, PgCheckpoint,
    Snapshot,
};
use iothrottle::{
    BucketConfig, CheckpointError, MonotonicClock, Rate, SharedTokenBucket, Uncapped,
};

/// The role of the docs (`docs/postgres.md`, "Least-privilege roles"): LOGIN, no CREATE anywhere,
/// USAGE on the schema and SELECT, INSERT, UPDATE on the table. Returns its connection string.
async fn least_privilege_role(pg: &PgCluster, admin: &tokio_postgres::Client) -> String {
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN;
             REVOKE CREATE ON SCHEMA public FROM PUBLIC;
             GRANT USAGE ON SCHEMA public TO app;
             GRANT SELECT, INSERT, UPDATE ON iothrottle_checkpoint TO app;",
        )
        .await
        .unwrap();
    pg.connection_string_as("app")
}

/// Connecting does not run `CREATE TABLE IF NOT EXISTS`, which PostgreSQL 15 refuses to a role
/// without CREATE on `public` even when the table exists (load and save would fail and strict
/// mode would grant nothing).
#[tokio::test]
async fn pg_checkpoint_needs_no_create_privilege() {
    let Some(pg) = cluster_or_skip("pg_checkpoint_needs_no_create_privilege") else {
        return;
    };
    // Installation is a separate step, by a privileged role.
    PgCheckpoint::new(&pg.connection_string(), "setup")
        .unwrap()
        .install()
        .await
        .unwrap();
    let admin = admin(&pg).await;
    let app = least_privilege_role(&pg, &admin).await;

    // The role really cannot create: install() is refused, with the server's reason.
    let store = PgCheckpoint::new(&app, "disk").unwrap();
    match store.install().await {
        Err(CheckpointError::Postgres { message, .. }) => {
            assert!(message.contains("42501"), "{message}")
        }
        other => panic!("install without CREATE: {other:?}"),
    }

    // Load and save work with the DML grants alone.
    assert_eq!(store.load().await.unwrap(), None);
    let s = snapshot_after(10);
    store.save(s).await.unwrap();
    assert_eq!(store.load().await.unwrap(), Some(s));

    // Strict mode grants (each grant waits for a durable reservation saved by this role).
    let b: SharedTokenBucket<Uncapped, MonotonicClock> = SharedTokenBucket::new(cfg()).unwrap();
    b.replenish();
    let b = Arc::new(CheckpointedBucket::new(b, Durability::strict(100)).unwrap());
    let cp = Checkpointer::start(
        b.clone(),
        PgCheckpoint::new(&app, "strict").unwrap(),
        CheckpointConfig::default().with_interval(Duration::from_millis(20)),
    )
    .unwrap();
    let th = iothrottle::Throttle::with_checkpoint(&b);
    let mut last = 0;
    for _ in 0..300 {
        last = tokio::time::timeout(Duration::from_secs(30), th.acquire(1))
            .await
            .expect("strict mode grants with a least-privilege role")
            .expect("no error")
            .tail()
            .expect("a strict grant has a tail");
    }
    cp.shutdown().await.unwrap();
    let saved = PgCheckpoint::new(&app, "strict")
        .unwrap()
        .load()
        .await
        .unwrap()
        .expect("saved by the least-privilege role");
    let mark = saved.reserved.expect("strict mode saves a mark");
    assert!(
        mark.wrapping_sub(last) as i64 >= 0,
        "mark {mark} covers tail {last}"
    );
}

/// The strict guarantee does not rely on the server's `synchronous_commit`: the store's session
/// turns durable commits on itself. With the server set to `off` (and a WAL writer that waits
/// 10 s), an acknowledged save survives `kill -9` of the server.
#[tokio::test]
async fn strict_checkpoint_is_durable_when_the_server_commits_asynchronously() {
    let Some(mut pg) = cluster_with_settings_or_skip(
        "strict_checkpoint_is_durable_when_the_server_commits_asynchronously",
        &[("synchronous_commit", "off"), ("wal_writer_delay", "10s")],
    ) else {
        return;
    };
    let admin = admin(&pg).await;
    let store = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    store.install().await.unwrap();
    // Flush the table's creation (the admin session commits asynchronously).
    admin.batch_execute("CHECKPOINT").await.unwrap();
    let server: String = admin
        .query_one("SHOW synchronous_commit", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(server, "off", "the server commits asynchronously");
    assert_eq!(store.synchronous_commit().await.unwrap(), "on");

    // Strict mode, as in the field report: grants at full speed, then a crash of the server
    // and the limiter at once (the bucket is dropped without a final save).
    let b: SharedTokenBucket<Uncapped, MonotonicClock> =
        SharedTokenBucket::new(BucketConfig::new(Rate::per_second(5_000), 5_000)).unwrap();
    b.replenish();
    let b = Arc::new(CheckpointedBucket::new(b, Durability::strict(500)).unwrap());
    let cp = Checkpointer::start(
        b.clone(),
        PgCheckpoint::new(&pg.connection_string(), "strict").unwrap(),
        CheckpointConfig::default().with_interval(Duration::from_millis(20)),
    )
    .unwrap();
    let th = iothrottle::Throttle::with_checkpoint(&b);
    let mut granted_tail = 0;
    for _ in 0..2_000 {
        granted_tail = tokio::time::timeout(Duration::from_secs(30), th.acquire(1))
            .await
            .expect("strict grants")
            .expect("no error")
            .tail()
            .expect("a strict grant has a tail");
    }
    // The plain store's last acknowledged save too.
    let s = snapshot_after(42);
    store.save(s).await.unwrap();
    pg.crash();
    drop(cp);
    pg.start_again().unwrap();

    assert_eq!(
        load_after_restart(&store).await,
        Some(s),
        "an acknowledged save survives a crash of the server"
    );
    let restored =
        load_after_restart(&PgCheckpoint::new(&pg.connection_string(), "strict").unwrap())
            .await
            .expect("the strict bucket's row survives");
    let mark = restored.effective_tail();
    assert!(
        mark.wrapping_sub(granted_tail) as i64 >= 0,
        "restored mark {mark} is behind the {granted_tail} tokens granted"
    );
}

/// Loads after a server restart: the first call may report the old session's end (57P01);
/// the next one reconnects.
async fn load_after_restart(store: &PgCheckpoint) -> Option<Snapshot> {
    match store.load().await {
        Ok(s) => s,
        Err(e) => {
            assert!(matches!(e, CheckpointError::Postgres { .. }), "{e}");
            store.load().await.unwrap()
        }
    }
}

/// The checkpoint's Postgres errors carry the server's SQLSTATE.
#[tokio::test]
async fn checkpoint_errors_show_sqlstate_and_server_message() {
    let Some(pg) = cluster_or_skip("checkpoint_errors_show_sqlstate_and_server_message") else {
        return;
    };
    let store = PgCheckpoint::new(&pg.connection_string(), "disk").unwrap();
    store.install().await.unwrap();
    store.save(snapshot_after(1)).await.unwrap();
    let admin = admin(&pg).await;
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap();
    // The store's session was terminated: the next call reports why (or, if the driver saw
    // the session close first, reconnects and succeeds).
    match store.load().await {
        Err(CheckpointError::Postgres { message, .. }) => {
            assert!(message.contains("57P01"), "{message}");
            assert!(
                message.contains("terminating connection due to administrator command"),
                "{message}"
            );
        }
        other => assert!(matches!(other, Ok(Some(_))), "{other:?}"),
    }
    // A server error: a role without grants on the table.
    admin
        .batch_execute("CREATE ROLE nogrant LOGIN")
        .await
        .unwrap();
    let err = PgCheckpoint::new(&pg.connection_string_as("nogrant"), "disk")
        .unwrap()
        .save(snapshot_after(2))
        .await
        .expect_err("no grants");
    let text = err.to_string();
    assert!(text.contains("42501"), "{text}");
    assert!(text.contains("permission denied"), "{text}");
}
