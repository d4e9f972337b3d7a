//! Every limiter works with the least-privilege role of `docs/postgres.md` ("Least-privilege
//! roles"): only `install()` needs more. Against a real throwaway cluster.

mod common;

use std::time::Duration;

use common::pg::cluster_or_skip;
use iothrottle::pg::{
    LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions, PgWindowLimiter, Zone,
};
use iothrottle::PgLimitError;
use tokio_postgres::NoTls;

/// The GRANTs of the docs, word for word.
const GRANTS: &str = "
CREATE ROLE app LOGIN;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA iothrottle TO app;
GRANT SELECT, INSERT, UPDATE ON iothrottle.token_bucket TO app;
GRANT SELECT ON iothrottle.window_zone TO app;
GRANT SELECT, INSERT, UPDATE, DELETE ON iothrottle.window_key TO app;
GRANT SELECT, INSERT, DELETE ON iothrottle.window_log TO app;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA iothrottle TO app;
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_limiter_works_with_the_documented_grants() {
    let Some(pg) = cluster_or_skip("every_limiter_works_with_the_documented_grants") else {
        return;
    };
    // An administrator installs the schema, the classic function and a zone.
    let admin = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    admin.install().await.unwrap();
    admin.install_classic_function().await.unwrap();
    PgWindowLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap()
        .upsert_zone(&Zone {
            id: "login".into(),
            description: "5 per minute".into(),
            rate: 5,
            window_seconds: 60,
        })
        .await
        .unwrap();
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.batch_execute(GRANTS).await.unwrap();
    let app = pg.connection_string_as("app");

    // install() is refused to the role, with the server's reason.
    let strict = PgKeyedLimiter::connect(&app, PgOptions::new())
        .await
        .unwrap();
    match strict.install().await {
        Err(e @ PgLimitError::Db { .. }) => assert!(e.to_string().contains("42501"), "{e}"),
        other => panic!("install by the app role: {other:?}"),
    }
    // Strict mode, the classic function, peek and give_back.
    assert_eq!(strict.request("user:1", 2, 60).await.unwrap(), 119);
    assert_eq!(strict.peek("user:1", 2, 60).await.unwrap(), 119);
    strict.give_back("user:1", 2, 60, 1).await.unwrap();
    let (ac, aconn) = tokio_postgres::connect(&app, NoTls).await.unwrap();
    tokio::spawn(aconn);
    let left: i32 = ac
        .query_one("SELECT iothrottle.rate_limiting_request('user:2')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 119);
    // Leased mode: leases, local grants, shutdown gives back.
    let leased = PgLeasedLimiter::connect(
        &app,
        PgOptions::new(),
        LeaseOptions::new(1_000, 100, 50).unwrap(),
    )
    .await
    .unwrap();
    let mut granted = 0;
    for _ in 0..40 {
        granted += u32::from(leased.try_acquire_one("hot").await.unwrap());
    }
    assert_eq!(granted, 40);
    leased.shutdown().await.unwrap();
    // The sliding window: checks and purge.
    let window = PgWindowLimiter::connect(&app, PgOptions::new())
        .await
        .unwrap();
    for i in 0..6 {
        let d = window.check("login", "alice").await.unwrap();
        assert_eq!(d.blocked, i >= 5);
    }
    window
        .purge(
            100,
            Some(std::time::SystemTime::now() + Duration::from_secs(3600)),
        )
        .await
        .unwrap();
}
