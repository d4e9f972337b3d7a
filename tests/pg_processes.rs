//! Many OS processes, one global rate: N = 2, 4 and 8 separate processes (this test
//! binary re-run as `process_child`, each with its own limiter and connections) share one key
//! on the server's clock, in strict and in leased mode. Whatever the machine's speed, the
//! grants made between two readings of the server's clock, one before the first child starts
//! and one after the last has exited, obey the bound: `rate × W + burst` in strict mode
//! (exact), `rate × W + burst + N × max_lease` in leased mode. These tests assert the bound,
//! never a timing; how close the total comes to `rate × W + burst` is measured by
//! `benches/pg_load.rs --spawn N`.

mod common;

use std::time::Duration;

use common::pg::cluster_or_skip;
use common::pg_children::granted_by_children;
use iothrottle::pg::{LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions};

const STRICT_RATE: i32 = 20;
const STRICT_WINDOW: i32 = 1;

fn lease_options() -> LeaseOptions {
    LeaseOptions::new(2_000, 200, 100)
        .unwrap()
        .with_lease_period(Duration::from_millis(20))
}

/// Runs only when started by `n_processes` (the environment variable says what to do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by the tests below"]
async fn process_child() {
    let Ok(spec) = std::env::var("IOTHROTTLE_PROCESS_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('|').collect();
    let (mode, conn, key, millis) = (p[0], p[1], p[2], p[3].parse::<u64>().unwrap());
    // The run is timed from the connection on: on a loaded machine connecting can take as
    // long as the run.
    let run = Duration::from_millis(millis);
    let mut granted = 0u64;
    if mode == "strict" {
        let l = PgKeyedLimiter::connect(conn, PgOptions::new())
            .await
            .unwrap();
        let end = std::time::Instant::now() + run;
        while std::time::Instant::now() < end {
            if l.request(key, STRICT_RATE, STRICT_WINDOW).await.unwrap() >= 0 {
                granted += 1;
            }
        }
    } else {
        let l = PgLeasedLimiter::connect(conn, PgOptions::new(), lease_options())
            .await
            .unwrap();
        let end = std::time::Instant::now() + run;
        while std::time::Instant::now() < end {
            for _ in 0..64 {
                if l.try_acquire(key, 1).await.unwrap() {
                    granted += 1;
                }
            }
            tokio::task::yield_now().await;
        }
        l.shutdown().await.unwrap();
    }
    println!("GRANTED={granted}");
}

/// Spawns `n` children in `mode` on one key; returns (total granted, the window on the
/// server's clock).
async fn n_processes(mode: &str, n: u64) -> Option<(u64, Duration)> {
    let pg = cluster_or_skip(&format!("{mode}_bound_holds_across_{n}_processes"))?;
    let spec = format!("{mode}|{}|shared|1000", pg.connection_string());
    let env = ("IOTHROTTLE_PROCESS_CHILD", spec.as_str());
    Some(granted_by_children(&pg, "process_child", env, n).await)
}

async fn strict(n: u64) {
    let Some((total, w)) = n_processes("strict", n).await else {
        return;
    };
    let burst = (STRICT_RATE * STRICT_WINDOW) as u128;
    let bound = STRICT_RATE as u128 * w.as_micros() / 1_000_000 + burst;
    eprintln!("strict, {n} processes: {total} granted in {w:?}; rate x W + burst = {bound}");
    assert!(total as u128 <= bound, "{total} > {bound}");
    assert!(total as u128 >= burst, "the processes used the key");
}

async fn leased(n: u64) {
    let Some((total, w)) = n_processes("leased", n).await else {
        return;
    };
    let opts = lease_options();
    let bound = opts.bound(n, w);
    eprintln!("leased, {n} processes: {total} granted in {w:?}; bound {bound}");
    assert!(total as u128 <= bound, "{total} > {bound}");
    assert!(total >= opts.burst() as u64, "the processes used the key");
}

// One test per mode, the process counts one after the other (not 6 × N children at once).
#[tokio::test]
async fn strict_bound_holds_across_2_4_8_processes() {
    for n in [2, 4, 8] {
        strict(n).await;
    }
}

#[tokio::test]
async fn leased_bound_holds_across_2_4_8_processes() {
    for n in [2, 4, 8] {
        leased(n).await;
    }
}
