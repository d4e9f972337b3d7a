//! The throwaway cluster starts, answers SQL, survives a restart, and stops on drop.

mod common;

use common::pg::cluster_or_skip;

#[tokio::test]
async fn throwaway_cluster_answers_and_restarts() {
    let Some(mut pg) = cluster_or_skip("throwaway_cluster_answers_and_restarts") else {
        return;
    };
    let (client, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    let conn = tokio::spawn(conn);
    let row = client.query_one("select 40 + 2", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
    client
        .batch_execute("create table t(x int); insert into t values (7)")
        .await
        .unwrap();
    drop(client);
    let _ = conn.await;

    pg.stop();
    assert!(!pg.is_running());
    pg.start_again().unwrap();
    let (client, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .expect("reconnect");
    tokio::spawn(conn);
    let row = client.query_one("select x from t", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 7, "data survives a restart");
}
