//! Why the strict limiter keeps per-key-affine sessions instead of a pool that hands any idle
//! session to any call: W workers calling strict mode, first on one hot key, then on W distinct
//! keys, for S seconds each, two ways side by side:
//!
//! - `affine`: one limiter with `--sessions N` sessions; a key's calls in flight always share
//!   one session (a key with none in flight takes the least busy one), so a hot key's
//!   statements are pipelined on one session, one after the other;
//! - `spread`: N limiters of one session each, calls handed out round-robin: what a pool
//!   (deadpool, bb8) does; a hot key's statements run on N sessions at once and queue on its
//!   row lock.
//!
//! Prints calls/s and the mean number of the limiter's sessions waiting on a lock (sampled
//! from `pg_stat_activity` every 5 ms).
//!
//! ```text
//! cargo run --release --features postgres --example pg_affinity -- \
//!     --url 'host=127.0.0.1 port=5439 user=postgres' --workers 16 --sessions 4 --seconds 3
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::pg::{PgKeyedLimiter, PgOptions};

#[derive(Parser, Debug)]
struct Args {
    /// Connection string of a server (the limiter's schema is installed there).
    #[arg(long)]
    url: String,
    /// Concurrent callers.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Server sessions, in both layouts.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// `synchronous_commit = off` on the limiter's sessions.
    #[arg(long)]
    async_commit: bool,
}

/// Which keys the workers call.
#[derive(Clone, Copy)]
enum Load {
    Hot,
    Distinct,
    /// Even workers on one hot key, odd ones on their own keys; only the latter are counted.
    Mixed,
}

async fn run(args: &Args, limiters: &[Arc<PgKeyedLimiter>], load: Load, tag: &str) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let (stop, calls) = (stop.clone(), calls.clone());
        let limiters = limiters.to_vec();
        let hot = match load {
            Load::Hot => true,
            Load::Distinct => false,
            Load::Mixed => w % 2 == 0,
        };
        let counted = !matches!(load, Load::Mixed) || !hot;
        let key = if hot {
            format!("{tag}-hot")
        } else {
            format!("{tag}-{w}")
        };
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            // Relaxed: a stop flag and a counter read after the join.
            while !stop.load(Ordering::Relaxed) {
                let l = &limiters[i % limiters.len()];
                i += 1;
                l.request(&key, 1_000_000, 1).await.expect("request");
                if counted {
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let (admin, conn) = tokio_postgres::connect(&args.url, tokio_postgres::NoTls)
        .await
        .expect("admin connect");
    tokio::spawn(conn);
    let start = Instant::now();
    let (mut samples, mut waiting) = (0u64, 0i64);
    while start.elapsed() < Duration::from_secs(args.seconds) {
        let row = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'iothrottle' AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .expect("pg_stat_activity");
        waiting += row.get::<_, i64>(0);
        samples += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    for t in tasks {
        t.await.expect("worker");
    }
    (
        calls.load(Ordering::Relaxed) as f64 / secs,
        waiting as f64 / samples.max(1) as f64,
    )
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let opts = PgOptions::new().with_synchronous_commit(!args.async_commit);
    let one = PgKeyedLimiter::connect(&args.url, opts.clone().with_connections(args.sessions))
        .await
        .expect("connect");
    one.install().await.expect("install");
    let affine = vec![Arc::new(one)];
    let mut spread = Vec::new();
    for _ in 0..args.sessions {
        spread.push(Arc::new(
            PgKeyedLimiter::connect(&args.url, opts.clone().with_connections(1))
                .await
                .expect("connect"),
        ));
    }
    println!(
        "workers {} sessions {} seconds {} synchronous_commit {}",
        args.workers,
        args.sessions,
        args.seconds,
        if args.async_commit { "off" } else { "on" }
    );
    for (load, what) in [
        (Load::Hot, "one hot key"),
        (Load::Distinct, "distinct keys"),
        (Load::Mixed, "mixed, cold keys"),
    ] {
        let (a, aw) = run(&args, &affine, load, "affine").await;
        let (s, sw) = run(&args, &spread, load, "spread").await;
        println!(
            "{what:>16}: affine {a:>8.0} calls/s (lock waiters {aw:.2}) | spread {s:>8.0} calls/s \
             (lock waiters {sw:.2}) | affine/spread {:.2}x",
            a / s
        );
    }
}
