//! The classic SQL function: ours against the reference.
//!
//! Time is moved by the test, not slept: between two calls the row's `ts` is moved back by the
//! step (`UPDATE … SET ts = ts - step`), which is what the functions see when the step has
//! passed. The few microseconds of real time between calls are measured on the server and
//! counted in the bound.

mod common;

use std::time::Duration;

use common::pg::{cluster_or_skip, PgCluster};
use common::pg_reference::install_reference_function;
use iothrottle::pg::{PgKeyedLimiter, PgOptions, Schema, MAX_CAPACITY};
use iothrottle::PgLimitError;
use tokio_postgres::NoTls;

async fn setup(pg: &PgCluster) -> (PgKeyedLimiter, tokio_postgres::Client) {
    let l = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    l.install().await.unwrap();
    l.install_classic_function().await.unwrap();
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    install_reference_function(&c, &Schema::new("iothrottle").unwrap())
        .await
        .unwrap();
    (l, c)
}

/// `rate_limiting_request` refuses up front, like the Rust API, with `22023` and the limit in
/// the message, a capacity (`window × rate`) whose micro-tokens fit a `bigint` on the first
/// call but would overflow it on a later one (`22003 bigint out of range` after an idle
/// period), or on the first call for the largest `int` arguments.
#[tokio::test]
async fn classic_function_rejects_capacities_that_overflow_bigint() {
    let Some(pg) = cluster_or_skip("classic_function_rejects_capacities_that_overflow_bigint")
    else {
        return;
    };
    let (l, c) = setup(&pg).await;
    let call = "SELECT iothrottle.rate_limiting_request($1, $2, $3)";
    // 2 000 000 tokens/s for 4 000 000 s: 8 × 10^12 tokens, above MAX_CAPACITY.
    for (rate, window) in [(2_000_000i32, 4_000_000i32), (i32::MAX, i32::MAX)] {
        let err = c
            .query_one(call, &[&"big", &rate, &window])
            .await
            .expect_err("refused up front");
        let db = err.as_db_error().expect("a server error");
        assert_eq!(db.code().code(), "22023", "{db}");
        assert!(
            db.message().contains(&MAX_CAPACITY.to_string()),
            "{}",
            db.message()
        );
        // The Rust API refuses the same parameters.
        assert!(matches!(
            l.request("big", rate, window).await,
            Err(PgLimitError::CapacityTooLarge { .. })
        ));
    }
    // The largest accepted capacity never overflows, however long the key was idle.
    let rate = i32::MAX;
    let window = (MAX_CAPACITY / i64::from(rate)) as i32;
    let first: i32 = c
        .query_one(call, &[&"edge", &rate, &window])
        .await
        .unwrap()
        .get(0);
    assert_eq!(first, i32::MAX, "tokens left, capped to int");
    for idle in ["1 second", "30 days", "100 years"] {
        c.execute(
            &format!(
                "UPDATE iothrottle.token_bucket SET ts = ts - interval '{idle}' WHERE id = 'edge'"
            ),
            &[],
        )
        .await
        .unwrap();
        let left: i32 = c
            .query_one(call, &[&"edge", &rate, &window])
            .await
            .unwrap_or_else(|e| panic!("after {idle} idle: {e}"))
            .get(0);
        assert_eq!(left, i32::MAX);
    }
}

/// What a new key's first call and `calls` more calls `step` apart grant, for the function
/// `f` on table `table` (2 tokens per second, window 1 s: a capacity of 2).
struct Steps {
    /// The calls that were granted.
    granted: u32,
    /// What `capacity + rate × t` allows over the time that passed, in tokens.
    allowed: f64,
    /// The longest real time, on the server's clock, from one call's start to the end of the
    /// next, in seconds: each call's refill is measured over its step plus that much at most.
    gap: f64,
}

async fn grants_step_apart(
    c: &tokio_postgres::Client,
    f: &str,
    table: &str,
    id: &str,
    step: Duration,
    calls: u32,
) -> Steps {
    let call = format!(
        "SELECT iothrottle.{f}($1, 2, 1), extract(epoch FROM now())::float8, \
         extract(epoch FROM clock_timestamp())::float8"
    );
    let shift =
        format!("UPDATE iothrottle.{table} SET ts = ts - make_interval(secs => $2) WHERE id = $1");
    let clock = "SELECT extract(epoch FROM clock_timestamp())::float8";
    let start: f64 = c.query_one(clock, &[]).await.unwrap().get(0);
    let mut granted = 0;
    let mut gap = 0f64;
    let mut began: Option<f64> = None;
    for i in 0..=calls {
        if i > 0 {
            c.execute(&shift, &[&id, &step.as_secs_f64()])
                .await
                .unwrap();
        }
        let row = c.query_one(&call, &[&id]).await.unwrap();
        if row.get::<_, i32>(0) >= 0 {
            granted += 1;
        }
        let (now, ended): (f64, f64) = (row.get(1), row.get(2));
        if let Some(b) = began {
            gap = gap.max(ended - b);
        }
        began = Some(now);
    }
    let end: f64 = c.query_one(clock, &[]).await.unwrap().get(0);
    let t = step.as_secs_f64() * f64::from(calls) + (end - start);
    Steps {
        granted,
        allowed: 2.0 + 2.0 * t,
        gap,
    }
}

/// The reference function does not "round to zero", it rounds the
/// refill to the *nearest* token. Calls at least half a token apart over-grant (each gets a
/// whole token back); calls less than half a token apart never refill. Ours grants what the
/// rate allows in both cases.
#[tokio::test]
async fn reference_function_rounds_to_the_nearest_token() {
    let Some(pg) = cluster_or_skip("reference_function_rounds_to_the_nearest_token") else {
        return;
    };
    let (_l, c) = setup(&pg).await;
    let reference = ("reference_rate_limiting_request", "reference_token_bucket");
    let ours = ("rate_limiting_request", "token_bucket");
    // 0.3 s apart at 2 tokens/s: 0.6 token per call, rounded up to 1.
    let r = grants_step_apart(&c, reference.0, reference.1, "over", ms(300), 20).await;
    let (got, allowed) = (r.granted, r.allowed);
    eprintln!("reference, 0.6 token apart: {got} grants, rate x t allows {allowed:.2}");
    assert_eq!(got, 21, "every call granted");
    assert!(f64::from(got) > allowed + 1.0, "over-grants");
    let r = grants_step_apart(&c, ours.0, ours.1, "over", ms(300), 20).await;
    let (got, allowed) = (r.granted, r.allowed);
    eprintln!("ours, 0.6 token apart: {got} grants, rate x t allows {allowed:.2}");
    assert!(f64::from(got) <= allowed && f64::from(got) >= allowed.floor() - 1.0);

    // 0.2 s apart: 0.4 token per call, rounded down to 0, forever. That holds while no call's
    // refill is measured over more than 0.05 s of real time besides its step (0.4 + 2 × 0.05
    // rounds up): a run with a longer gap (a loaded machine) shows nothing either way, and is
    // run again on a new key.
    let mut tries = 0;
    let got = loop {
        let id = format!("under-{tries}");
        let r = grants_step_apart(&c, reference.0, reference.1, &id, ms(200), 20).await;
        eprintln!(
            "reference, 0.4 token apart: {} grants, rate x t allows {:.2}, longest gap {:.1} ms",
            r.granted,
            r.allowed,
            r.gap * 1e3
        );
        if r.gap < 0.04 {
            break r.granted;
        }
        tries += 1;
        assert!(tries < 5, "no run of 21 calls without a gap of 40 ms");
    };
    assert_eq!(got, 2, "the first two calls, then never a refill");
    let r = grants_step_apart(&c, ours.0, ours.1, "under", ms(200), 20).await;
    let (got, allowed) = (r.granted, r.allowed);
    eprintln!("ours, 0.4 token apart: {got} grants, rate x t allows {allowed:.2}");
    assert!(f64::from(got) <= allowed && f64::from(got) >= allowed.floor() - 1.0);
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
