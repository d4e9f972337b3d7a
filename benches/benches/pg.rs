//! Strict mode against the classic SQL function (`rate_limiting_request`), side by side in one
//! group, on a throwaway cluster (`tests/common/pg.rs`: the system's `initdb`/`postgres`,
//! `fsync=off`, so commits cost CPU and no disk flush: the figures compare the per-call cost
//! of the two, not the disk).
//!
//! Ids (`pg/<contender>/<ids>`): one op is one call taking one token (2 tokens/s, 60 s window,
//! so almost every call is refused after the burst, as in the classic load test), made by 8
//! concurrent tasks on a 2-thread runtime, `iters / 8` calls each:
//!
//! - `classic_function`: `SELECT rate_limiting_request($1, $2, $3)` prepared on 8 sessions,
//!   one per task (the classic client);
//! - `strict`: `PgKeyedLimiter::request`, one limiter with one session per task (the same
//!   sessions and tasks);
//! - `strict_shared`: one `PgKeyedLimiter` with 8 sessions shared by the 8 tasks;
//! - `<ids>`: `one` (all tasks on one id) or `distinct` (one id per task).
//!
//! Without the feature `postgres` or without the PostgreSQL binaries the group prints a loud
//! `SKIPPED` line and measures nothing; it never fails the bench build.
//!
//! ```text
//! cargo bench --features postgres --bench benches -- pg/ --warm-up-time 1 --measurement-time 3
//! ```

#[cfg(feature = "postgres")]
#[allow(dead_code, unreachable_pub)]
#[path = "../../tests/common/pg.rs"]
mod cluster;
#[cfg(feature = "postgres")]
#[allow(unreachable_pub)]
#[path = "../common/pg_contenders.rs"]
mod contenders;

use criterion::Criterion;

/// The `pg` group: strict mode and the classic function, side by side.
#[cfg(feature = "postgres")]
pub fn pg(c: &mut Criterion) {
    use std::sync::Arc;
    use std::time::Instant;

    use criterion::BenchmarkId;
    use iothrottle::pg::{PgKeyedLimiter, PgOptions};

    const TASKS: usize = 8;
    let Some(pg) = skip_without_binaries() else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let url = pg.connection_string();
    let (classic, strict, shared) = rt.block_on(async {
        contenders::install_both(&url, PgOptions::new()).await;
        let mut classic = Vec::new();
        let mut strict = Vec::new();
        for _ in 0..TASKS {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("connect");
            tokio::spawn(conn);
            let (c, l) = contenders::worker(
                &url,
                client,
                "SELECT iothrottle.rate_limiting_request($1, $2, $3)",
                PgOptions::new(),
            )
            .await;
            classic.push(c);
            strict.push(l);
        }
        let shared = Arc::new(
            PgKeyedLimiter::connect(&url, PgOptions::new().with_connections(TASKS))
                .await
                .expect("connect"),
        );
        (classic, strict, shared)
    });
    let mut g = c.benchmark_group("pg");
    // Fresh ids per measurement, so every sample starts from the same state (a new id).
    let mut sample = 0u64;
    for contender in ["classic_function", "strict", "strict_shared"] {
        for ids in ["one", "distinct"] {
            g.bench_function(BenchmarkId::new(contender, ids), |b| {
                b.iter_custom(|iters| {
                    sample += 1;
                    let per_task = iters.div_ceil(TASKS as u64);
                    rt.block_on(async {
                        let start = Instant::now();
                        let tasks: Vec<_> = (0..TASKS)
                            .map(|t| {
                                let id = match ids {
                                    "one" => format!("{contender}-{sample}"),
                                    _ => format!("{contender}-{sample}-{t}"),
                                };
                                let (classic, strict, shared) =
                                    (classic[t].clone(), strict[t].clone(), shared.clone());
                                tokio::spawn(async move {
                                    for _ in 0..per_task {
                                        let left: i64 = match contender {
                                            "classic_function" => classic
                                                .0
                                                .query_one(&classic.1, &[&id, &2i32, &60i32])
                                                .await
                                                .expect("classic call")
                                                .get::<_, i32>(0)
                                                .into(),
                                            "strict" => {
                                                strict.request(&id, 2, 60).await.expect("call")
                                            }
                                            _ => shared.request(&id, 2, 60).await.expect("call"),
                                        };
                                        std::hint::black_box(left);
                                    }
                                })
                            })
                            .collect();
                        for t in tasks {
                            t.await.expect("task");
                        }
                        // Per call: the tasks made `per_task × TASKS` calls.
                        start
                            .elapsed()
                            .mul_f64(iters as f64 / (per_task * TASKS as u64) as f64)
                    })
                })
            });
        }
    }
    g.finish();
    drop(rt);
    drop(pg);
}

#[cfg(feature = "postgres")]
fn skip_without_binaries() -> Option<cluster::PgCluster> {
    // The cluster helper panics under CI=true without binaries; a bench must not.
    if std::env::var("CI").as_deref() == Ok("true") {
        let found = std::panic::catch_unwind(|| cluster::cluster_or_skip("benches pg"));
        return found.unwrap_or_else(|_| {
            eprintln!(
                "\n!!!!!!!! SKIPPED !!!!!!!! benches pg: no PostgreSQL cluster could be started\n"
            );
            None
        });
    }
    cluster::cluster_or_skip("benches pg")
}

/// The `pg` group without the feature `postgres`: nothing to measure.
#[cfg(not(feature = "postgres"))]
pub fn pg(_c: &mut Criterion) {
    eprintln!(
        "\n!!!!!!!! SKIPPED !!!!!!!! benches pg: built without the feature `postgres` \
         (cargo bench --features postgres --bench benches -- pg/)\n"
    );
}

criterion::criterion_group!(benches, pg);
