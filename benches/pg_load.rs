//! A load generator for the PostgreSQL limiters (a benchmark harness, `harness = false`):
//! the classic load test of the SQL token bucket, for strict mode, leased mode and the
//! reference function (`tests/common/pg_reference.rs`): N workers on one id or on N distinct ids, READ COMMITTED or
//! SERIALIZABLE, retries with back-off; prints the achieved rate, the share of calls that got
//! a token and the largest retry count.
//! (One file over the usual size: its modes share one worker loop and one report.)
//!
//! It needs a server (it starts none):
//!
//! ```text
//! # a local server, or a throwaway one:
//! sudo -u postgres /usr/lib/postgresql/15/bin/initdb -D /tmp/pgload -A trust -U postgres
//! sudo -u postgres /usr/lib/postgresql/15/bin/postgres -D /tmp/pgload -p 5439 \
//!     -c listen_addresses=127.0.0.1 -k /tmp &
//! cargo bench --features postgres --bench pg_load -- \
//!     --url 'host=127.0.0.1 port=5439 user=postgres' --mode all --workers 8 --seconds 5
//! ```
//!
//! Other measurements, each one run:
//!
//! ```text
//! # N separate OS processes on one key: total granted vs rate x W + burst (strict, leased);
//! # W runs from the key's row creation (when every child is ready) to the last call
//! pg_load --url … --spawn 4 --mode all --workers 2 --seconds 5 --connections 1 --refill 100 \
//!     --window 1 --leased-burst 100000 --max-lease 20000 --lease-period-ms 100
//! # K hot keys in one leased process: each key's grants vs rate x W + burst (rows created
//! # full at the start; mean and worst key; where the missing tokens are)
//! pg_load --url … --keys 64 --workers 8 --seconds 8 --connections 16 --leased-rate 2000 \
//!     --leased-burst 2000 --max-lease 400
//! # bytes of leased state per key held (max_keys bounds the total)
//! pg_load --url … --memory-keys 20000 --max-keys 10000 --async-commit
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Counts the bytes allocated and not yet freed (for `--memory-keys`).
struct Counting;

static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a
// statistic (Relaxed: nothing is published through it).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE_BYTES.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: `p` was allocated by `alloc` above with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The classic function as published, for comparison (shared with the tests).
#[path = "../tests/common/pg_reference.rs"]
mod pg_reference;

#[path = "common/pg_contenders.rs"]
mod contenders;

use clap::{Parser, ValueEnum};
use iothrottle::pg::{
    Isolation, LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions, RetryPolicy, Schema,
};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// The classic function (UPDATE-then-INSERT, integer tokens), installed for comparison.
    Reference,
    /// `PgKeyedLimiter`: one upsert per call.
    Strict,
    /// The classic-compatible SQL function this crate installs (`rate_limiting_request`),
    /// called like the reference.
    Classic,
    /// `PgLeasedLimiter`: local buckets filled by leases.
    Leased,
    /// All three, one after the other, and the comparison.
    All,
    /// Strict mode against the classic function in interleaved rounds (`--rounds`, the order
    /// alternating), on one id and/or distinct ids (`--ids both`): per-round figures, medians
    /// and ratios, with the load average of each round.
    Compare,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Ids {
    /// Every worker on one id (the hot key).
    One,
    /// Each worker on its own id.
    Distinct,
    /// `--mode compare` only: one id, then distinct ids, in one run.
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Iso {
    ReadCommitted,
    Serializable,
}

/// Load generator for the PostgreSQL limiters.
#[derive(Debug, Parser)]
struct Args {
    /// Server to use: `host=… port=… user=…` or `postgresql://…`. Required.
    #[arg(long)]
    url: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// Which limiter to drive.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// Concurrent workers (each with its own connection, except in leased mode, where the
    /// workers of one process share its limiter).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// One hot id or one id per worker.
    #[arg(long, value_enum, default_value = "one")]
    ids: Ids,
    /// Isolation level of the limiter's statements.
    #[arg(long, value_enum, default_value = "read-committed")]
    isolation: Iso,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Strict/reference: refill per second (the classic default is 2).
    #[arg(long, default_value_t = 2)]
    refill: i32,
    /// Strict/reference: window in seconds (the classic default is 60).
    #[arg(long, default_value_t = 60)]
    window: i32,
    /// Leased: the global rate, tokens per second.
    #[arg(long, default_value_t = 100_000)]
    leased_rate: i64,
    /// Leased: the global burst, tokens.
    #[arg(long, default_value_t = 10_000)]
    leased_burst: i64,
    /// Leased: the largest lease per process and key.
    #[arg(long, default_value_t = 2_000)]
    max_lease: u64,
    /// Leased: independent limiter instances ("processes"), workers spread over them.
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Attempts per call on serialization failures (reference: 50 ms × attempt back-off).
    #[arg(long, default_value_t = 10)]
    attempts: u32,
    /// `synchronous_commit = off` for the limiter's sessions.
    #[arg(long)]
    async_commit: bool,
    /// Schema to install into.
    #[arg(long, default_value = "load_test")]
    schema: String,
    /// Server sessions per limiter (`PgOptions::with_connections`).
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Leased: hot keys in one process (workers cycle over them); per-key rate errors are
    /// printed. 0: one key per worker (`--ids`).
    #[arg(long, default_value_t = 0)]
    keys: usize,
    /// Leased: lease period in milliseconds.
    #[arg(long, default_value_t = 20)]
    lease_period_ms: u64,
    /// Leased: trickle interval in milliseconds (when the global bucket is empty).
    #[arg(long, default_value_t = 10)]
    trickle_ms: u64,
    /// Strict and leased: run N separate OS processes (this program, each with its own
    /// limiter and connections) on one shared key, and compare their total with the bound.
    #[arg(long, default_value_t = 0)]
    spawn: usize,
    /// Internal: run as one of the `--spawn` children on this key.
    #[arg(long, hide = true)]
    child_key: Option<String>,
    /// Measure the leased state's memory: lease one token on each of this many distinct
    /// keys (with `--max-keys`), print bytes per key held.
    #[arg(long, default_value_t = 0)]
    memory_keys: usize,
    /// Leased: the most keys kept locally.
    #[arg(long, default_value_t = 10_000)]
    max_keys: usize,
    /// `--mode compare`: rounds per id setting (each runs every contender for `--seconds`).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    mode: &'static str,
    calls: u64,
    granted: u64,
    errors: u64,
    max_retries: u64,
    statements: u64,
    seconds: f64,
    /// Leased mode: tokens granted beyond the initial burst, per second, and the target.
    rate_check: Option<(f64, i64)>,
}

impl Outcome {
    fn calls_per_sec(&self) -> f64 {
        self.calls as f64 / self.seconds
    }
}

/// Ids are unique per invocation and mode (strict and classic share a table).
fn id_for(args: &Args, worker: usize, run: &str, mode: &str) -> String {
    match args.ids {
        Ids::One => format!("{run}-{mode}-hot"),
        Ids::Distinct | Ids::Both => format!("{run}-{mode}-{worker}"),
    }
}

fn options(args: &Args) -> PgOptions {
    PgOptions::new()
        .with_schema(args.schema.clone())
        .with_isolation(match args.isolation {
            Iso::ReadCommitted => Isolation::ReadCommitted,
            Iso::Serializable => Isolation::Serializable,
        })
        .with_synchronous_commit(!args.async_commit)
        .with_connections(args.connections)
        .with_retry(
            RetryPolicy::new(
                args.attempts,
                Duration::from_millis(2),
                Duration::from_millis(100),
            )
            .expect("valid retry policy"),
        )
}

async fn connect(url: &str, args: &Args) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(conn);
    let iso = match args.isolation {
        Iso::ReadCommitted => "read committed",
        Iso::Serializable => "serializable",
    };
    let sync = if args.async_commit { "off" } else { "on" };
    c.batch_execute(&format!(
        "SET default_transaction_isolation TO '{iso}'; SET synchronous_commit TO {sync}"
    ))
    .await
    .expect("session settings");
    c
}

async fn run_reference(url: &str, args: &Args, run: &str, classic: bool) -> Outcome {
    let schema = Schema::new(&args.schema).expect("schema name");
    let setup = connect(url, args).await;
    let sql = if classic {
        iothrottle::pg::install(&setup, &schema)
            .await
            .expect("install");
        iothrottle::pg::install_classic_function(&setup, &schema)
            .await
            .expect("install the classic function");
        schema.sql("SELECT {s}.rate_limiting_request($1, $2, $3)")
    } else {
        pg_reference::install_reference_function(&setup, &schema)
            .await
            .expect("install the reference function");
        schema.sql("SELECT {s}.reference_rate_limiting_request($1, $2, $3)")
    };
    let end = Instant::now() + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let c = connect(url, args).await;
        let mode = if classic { "classic" } else { "reference" };
        let (sql, id) = (sql.clone(), id_for(args, w, run, mode));
        let (refill, window, attempts) = (args.refill, args.window, args.attempts);
        tasks.push(tokio::spawn(async move {
            let st = c.prepare(&sql).await.expect("prepare");
            let mut o = Outcome::default();
            while Instant::now() < end {
                o.calls += 1;
                // The original client: retry 40001 with 50 ms × attempt back-off.
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    o.statements += 1;
                    match c.query_one(&st, &[&id, &refill, &window]).await {
                        Ok(r) => {
                            if r.get::<_, i32>(0) >= 0 {
                                o.granted += 1;
                            }
                            break;
                        }
                        Err(e)
                            if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
                                && attempt < attempts =>
                        {
                            o.max_retries = o.max_retries.max(attempt as u64);
                            tokio::time::sleep(Duration::from_millis(50 * attempt as u64)).await;
                        }
                        Err(_) => {
                            o.errors += 1;
                            break;
                        }
                    }
                }
            }
            o
        }));
    }
    collect(
        if classic { "classic" } else { "reference" },
        tasks,
        args.seconds,
    )
    .await
}

async fn run_strict(url: &str, args: &Args, run: &str) -> Outcome {
    let mut tasks = Vec::new();
    let mut limiters = Vec::new();
    for _ in 0..args.workers {
        let l = PgKeyedLimiter::connect(url, options(args))
            .await
            .expect("connect");
        limiters.push(l);
    }
    limiters[0].install().await.expect("install");
    let end = Instant::now() + Duration::from_secs_f64(args.seconds);
    for (w, l) in limiters.into_iter().enumerate() {
        let id = id_for(args, w, run, "strict");
        let (refill, window) = (args.refill, args.window);
        tasks.push(tokio::spawn(async move {
            let mut o = Outcome::default();
            while Instant::now() < end {
                o.calls += 1;
                match l.request(&id, refill, window).await {
                    Ok(left) if left >= 0 => o.granted += 1,
                    Ok(_) => {}
                    Err(_) => o.errors += 1,
                }
            }
            let s = l.stats();
            o.max_retries = s.max_retries;
            o.statements = s.calls + s.retries;
            o
        }));
    }
    collect("strict", tasks, args.seconds).await
}

async fn run_leased(url: &str, args: &Args, run: &str) -> Outcome {
    let opts = lease_options(args);
    let mut procs = Vec::new();
    for _ in 0..args.processes.max(1) {
        procs.push(Arc::new(
            PgLeasedLimiter::connect(url, options(args), opts)
                .await
                .expect("connect"),
        ));
    }
    procs[0].install().await.expect("install");
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let l = procs[w % procs.len()].clone();
        let id = id_for(args, w, run, "leased");
        // Each worker holds a handle on its key (no map lookup per call).
        let mut key = l.key(&id).await.expect("key");
        tasks.push(tokio::spawn(async move {
            let mut o = Outcome::default();
            loop {
                for _ in 0..256 {
                    o.calls += 1;
                    match key.try_acquire(1).await {
                        Ok(true) => o.granted += 1,
                        Ok(false) => {}
                        Err(_) => o.errors += 1,
                    }
                }
                // Let the background lease tasks run.
                tokio::task::yield_now().await;
                if Instant::now() >= end {
                    break;
                }
            }
            o
        }));
    }
    let mut out = collect("leased", tasks, 0.0).await;
    out.seconds = start.elapsed().as_secs_f64();
    let mut statements = 0;
    for p in &procs {
        let _ = p.shutdown().await;
        let s = p.db_stats();
        statements += s.calls + s.retries;
        out.max_retries = out.max_retries.max(s.max_retries);
    }
    out.statements = statements;
    let ids = match args.ids {
        Ids::One => 1,
        Ids::Distinct | Ids::Both => args.workers as i64,
    };
    // Every id starts with its burst; what was granted beyond it came from the refill.
    let beyond = out.granted as f64 - (ids * args.leased_burst) as f64;
    out.rate_check = Some((beyond / out.seconds / ids as f64, args.leased_rate));
    out
}

fn lease_options(args: &Args) -> LeaseOptions {
    LeaseOptions::new(args.leased_rate, args.leased_burst, args.max_lease)
        .expect("lease options")
        .with_lease_period(Duration::from_millis(args.lease_period_ms))
        .with_trickle_interval(Duration::from_millis(args.trickle_ms))
        .with_max_keys(args.max_keys)
}

/// `--keys N`: one process, N hot keys, workers cycling over their share of the keys.
/// Prints each key's refill rate against the global rate (mean, worst below, worst above).
async fn run_hot_keys(url: &str, args: &Args, run: &str) {
    let l = Arc::new(
        PgLeasedLimiter::connect(url, options(args), lease_options(args))
            .await
            .expect("connect"),
    );
    l.install().await.expect("install");
    // Open every session and prepare its statements first (a deployed service has them
    // open): the run measures leasing, not connecting.
    for i in 0..args.connections * 8 {
        let _ = l.try_acquire_one(&format!("{run}-warm-{i}")).await;
    }
    let _ = l.shutdown().await;
    let n = args.keys;
    // One task per key (at least `--workers`): a call that finds its key dry waits for the
    // lease, and must not hold up the other keys' calls.
    let tasks_n = args.workers.max(n);
    let mut per_worker: Vec<Vec<(usize, iothrottle::pg::LeasedKey)>> =
        (0..tasks_n).map(|_| Vec::new()).collect();
    for k in 0..n {
        let key = l.key(&format!("{run}-hot-{k}")).await.expect("key");
        per_worker[k % tasks_n].push((k, key));
    }
    // Every key's row exists, full, from `start` on (as its first lease would create it), so
    // `rate x W + burst` from `start` is exactly what each row makes available.
    let c = connect(url, args).await;
    let names: Vec<String> = (0..n).map(|k| format!("{run}-hot-{k}")).collect();
    let start = Instant::now();
    c.execute(
        &format!(
            "INSERT INTO {}.token_bucket (id, micro, ts, granted) \
             SELECT unnest($1::text[]), $2::bigint * 1000000, clock_timestamp(), 0",
            args.schema
        ),
        &[&names, &args.leased_burst],
    )
    .await
    .expect("create the rows");
    let end = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::new();
    for mut keys in per_worker.into_iter().filter(|k| !k.is_empty()) {
        tasks.push(tokio::spawn(async move {
            let mut granted = Vec::new();
            let mut calls = 0u64;
            let mut got = vec![0u64; keys.len()];
            let first = vec![start; keys.len()];
            let mut first_grant = vec![Duration::ZERO; keys.len()];
            loop {
                for (i, (_, key)) in keys.iter_mut().enumerate() {
                    for _ in 0..16 {
                        calls += 1;
                        if let Ok(true) = key.try_acquire(1).await {
                            if got[i] == 0 {
                                first_grant[i] = start.elapsed();
                            }
                            got[i] += 1;
                        }
                    }
                }
                tokio::task::yield_now().await;
                if Instant::now() >= end {
                    break;
                }
            }
            // The last call's end: every grant of this task is before it.
            let last = Instant::now();
            for (i, (k, _)) in keys.iter().enumerate() {
                granted.push((*k, got[i], first[i]));
            }
            (granted, calls, last, first_grant)
        }));
    }
    let mut granted = vec![0u64; n];
    let mut firsts = vec![start; n];
    let mut calls = 0;
    let mut last = start;
    let mut first_grants = Vec::new();
    for t in tasks {
        let (g, c, t_last, fg) = t.await.expect("worker");
        first_grants.extend(fg);
        calls += c;
        last = last.max(t_last);
        for (k, v, f) in g {
            granted[k] = v;
            firsts[k] = f;
        }
    }
    // The window: from before the first call (before any key's row exists) to the end of the
    // last call, so `rate x W + burst` is at least what each key's row made available.
    let secs = last.duration_since(start).as_secs_f64();
    // Where the missing tokens are: held locally (given back at shutdown) and left in the
    // rows (refill not leased yet), per key on average.
    let held: u64 = (0..n)
        .map(|k| l.local_tokens(&format!("{run}-hot-{k}")))
        .sum();
    let left: f64 = c
        .query_one(
            &format!(
                "SELECT coalesce(sum(least($1::bigint * 1000000, micro + $2::bigint * \
                 (extract(epoch FROM clock_timestamp() - ts) * 1000000)::bigint)), 0)::float8 \
                 / 1000000 FROM {}.token_bucket WHERE id LIKE $3",
                args.schema
            ),
            &[
                &args.leased_burst,
                &args.leased_rate,
                &format!("{run}-hot-%"),
            ],
        )
        .await
        .expect("rows")
        .get(0);
    println!(
        "per key: first grant after {:.1} ms (mean), {:.1} ms (last key); at the end {:.1} \
         tokens held locally, {:.1} left in the row (read after the run)",
        first_grants.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1e3 / n as f64,
        first_grants
            .iter()
            .max()
            .map_or(0.0, |d| d.as_secs_f64() * 1e3),
        held as f64 / n as f64,
        left / n as f64
    );
    let ls = l.stats();
    let _ = l.shutdown().await;
    let db = l.db_stats();
    println!(
        "leases {} in {} statements ({:.1} per statement), {} short, largest {}",
        ls.leases,
        ls.lease_statements,
        ls.leases as f64 / ls.lease_statements.max(1) as f64,
        ls.short_leases,
        ls.largest_lease
    );
    // Each key: granted against `rate x W + burst`, W from just before its row was created to
    // the end of the last call: what its row can have made available.
    let allowed: Vec<f64> = firsts
        .iter()
        .map(|f| {
            args.leased_rate as f64 * last.duration_since(*f).as_secs_f64()
                + args.leased_burst as f64
        })
        .collect();
    let errs: Vec<f64> = granted
        .iter()
        .zip(&allowed)
        .map(|(&g, &a)| g as f64 / a - 1.0)
        .collect();
    let mean = errs.iter().sum::<f64>() / n as f64;
    let lo = errs.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = errs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    println!(
        "hot keys: {n} keys in one process, {} connections, synchronous_commit={}, {:.2} s: \
         {:.0} calls/s, {:.0} statements/s; granted {} of rate x W + burst = {:.0} \
         (rate {}/s, burst {}); per key: mean {:+.2}%, lowest {:+.2}%, highest {:+.2}% ({})",
        args.connections,
        if args.async_commit { "off" } else { "on" },
        secs,
        calls as f64 / secs,
        (db.calls + db.retries) as f64 / secs,
        granted.iter().sum::<u64>(),
        allowed.iter().sum::<f64>(),
        args.leased_rate,
        args.leased_burst,
        100.0 * mean,
        100.0 * lo,
        100.0 * hi,
        if hi > 0.0 { "ABOVE" } else { "never above" }
    );
}

/// The contenders of `--mode compare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    /// `SELECT rate_limiting_request($1, $2, $3)`, one connection per worker.
    Classic,
    /// `PgKeyedLimiter::request`, one limiter with one session per worker (the same sessions
    /// and tasks as the classic function's clients).
    Strict,
    /// One `PgKeyedLimiter` shared by all workers, with `--connections` sessions.
    StrictShared,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Classic => "classic",
            Contender::Strict => "strict",
            Contender::StrictShared => "strict-shared",
        }
    }
}

/// The 1-minute load average (`/proc/loadavg`), or NaN.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Nanoseconds process `pid` (a server backend, or all threads of this process with `None`)
/// has run on a CPU (`/proc/PID/task/*/schedstat`; 0 where it is not readable).
fn cpu_ns(pid: Option<i32>) -> u64 {
    let dir = match pid {
        Some(p) => format!("/proc/{p}/task"),
        None => "/proc/self/task".into(),
    };
    let Ok(tasks) = std::fs::read_dir(dir) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            std::fs::read_to_string(t.path().join("schedstat"))
                .ok()?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Server backends of `application_name = 'iothrottle'` (the limiters' sessions).
async fn limiter_pids(c: &tokio_postgres::Client) -> Vec<i32> {
    c.query(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'iothrottle'",
        &[],
    )
    .await
    .expect("pg_stat_activity")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `--mode compare`: strict mode against the classic function, side by side in one process.
/// Every session is opened and every statement prepared before the first round; each round
/// runs every contender for `--seconds` on fresh ids, the order rotating from round to round
/// (so neither always runs first after a pause or always follows the other's WAL); the
/// summary gives the median calls per second and the median of the per-round ratios.
async fn run_compare(url: &str, args: &Args, run: &str) {
    contenders::install_both(url, options(args)).await;
    let schema = Schema::new(&args.schema).expect("schema name");
    let sql = schema.sql("SELECT {s}.rate_limiting_request($1, $2, $3)");
    let watch = connect(url, args).await;
    let before = limiter_pids(&watch).await;
    let mut classic = Vec::new();
    let mut strict = Vec::new();
    // The server backends of each contender, for CPU time per call.
    let mut pids: [Vec<i32>; 3] = Default::default();
    for w in 0..args.workers {
        let c = connect(url, args).await;
        pids[0].push(
            c.query_one("SELECT pg_backend_pid()", &[])
                .await
                .expect("pid")
                .get(0),
        );
        let (c, l) = contenders::worker(url, c, &sql, options(args)).await;
        let warm = format!("{run}-warm-classic-{w}");
        c.0.query_one(&c.1, &[&warm, &args.refill, &args.window])
            .await
            .expect("warm-up call");
        l.request(&format!("{run}-warm-strict-{w}"), args.refill, args.window)
            .await
            .expect("warm-up call");
        classic.push(c);
        strict.push(l);
    }
    pids[1] = limiter_pids(&watch)
        .await
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    let shared = Arc::new(
        PgKeyedLimiter::connect(url, options(args))
            .await
            .expect("connect"),
    );
    // Open (and prepare on) every session of the shared limiter: keys hash to sessions, so
    // enough distinct warm-up keys reach all of them.
    for i in 0..args.connections * 16 {
        shared
            .request(&format!("{run}-warm-shared-{i}"), args.refill, args.window)
            .await
            .expect("warm-up call");
    }
    pids[2] = limiter_pids(&watch)
        .await
        .into_iter()
        .filter(|p| !before.contains(p) && !pids[1].contains(p))
        .collect();
    let contenders = [
        Contender::Classic,
        Contender::Strict,
        Contender::StrictShared,
    ];
    let settings: &[Ids] = match args.ids {
        Ids::One => &[Ids::One],
        Ids::Distinct => &[Ids::Distinct],
        Ids::Both => &[Ids::One, Ids::Distinct],
    };
    println!(
        "\ncompare: {} workers, {} rounds of {} s per contender, {:?}, synchronous_commit={}, \
         refill {}/s, window {} s, shared limiter with {} sessions",
        args.workers,
        args.rounds,
        args.seconds,
        args.isolation,
        if args.async_commit { "off" } else { "on" },
        args.refill,
        args.window,
        args.connections,
    );
    println!(
        "server sessions: classic {}, strict {}, strict-shared {}",
        pids[0].len(),
        pids[1].len(),
        pids[2].len()
    );
    println!("\n| ids | round | order | classic calls/s | strict calls/s | strict-shared calls/s | strict / classic | strict-shared / classic | load |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|");
    let mut summary = Vec::new();
    for &ids in settings {
        let mut cps: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
        let mut loads = Vec::new();
        // CPU nanoseconds (server backends, this process) and calls, per contender.
        let mut cpu = [(0u64, 0u64, 0u64); 3];
        for round in 0..args.rounds {
            let mut order = contenders.to_vec();
            order.rotate_left(round % contenders.len());
            let mut got = [0.0f64; 3];
            for &c in &order {
                let id = |w: usize| match ids {
                    Ids::One => format!("{run}-{}-{round}-hot", c.name()),
                    _ => format!("{run}-{}-{round}-{w}", c.name()),
                };
                let i = contenders.iter().position(|&x| x == c).expect("contender");
                let server_cpu = |pids: &[i32]| pids.iter().map(|&p| cpu_ns(Some(p))).sum::<u64>();
                let (server0, client0) = (server_cpu(&pids[i]), cpu_ns(None));
                let end = Instant::now() + Duration::from_secs_f64(args.seconds);
                let start = Instant::now();
                let mut tasks = Vec::new();
                for w in 0..args.workers {
                    let id = id(w);
                    let (refill, window) = (args.refill, args.window);
                    let (classic, strict, shared) =
                        (classic[w].clone(), strict[w].clone(), shared.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut calls = 0u64;
                        while Instant::now() < end {
                            let ok = match c {
                                Contender::Classic => classic
                                    .0
                                    .query_one(&classic.1, &[&id, &refill, &window])
                                    .await
                                    .is_ok(),
                                Contender::Strict => {
                                    strict.request(&id, refill, window).await.is_ok()
                                }
                                Contender::StrictShared => {
                                    shared.request(&id, refill, window).await.is_ok()
                                }
                            };
                            assert!(ok, "{} call failed", c.name());
                            calls += 1;
                        }
                        calls
                    }));
                }
                let mut calls = 0;
                for t in tasks {
                    calls += t.await.expect("worker");
                }
                got[i] = calls as f64 / start.elapsed().as_secs_f64();
                cpu[i].0 += server_cpu(&pids[i]) - server0;
                cpu[i].1 += cpu_ns(None) - client0;
                cpu[i].2 += calls;
            }
            let load = load_average();
            loads.push(load);
            for i in 0..contenders.len() {
                cps[i].push(got[i]);
                ratios[i].push(got[i] / got[0]);
            }
            println!(
                "| {ids:?} | {round} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {load:.1} |",
                order
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join(", "),
                got[0],
                got[1],
                got[2],
                got[1] / got[0],
                got[2] / got[0],
            );
        }
        let load = median(&mut loads);
        for (i, c) in contenders.iter().enumerate() {
            let r = ratios[i].clone();
            let (server, client, calls) = cpu[i];
            summary.push((
                c.name(),
                ids,
                median(&mut cps[i]),
                median(&mut ratios[i]),
                r,
                load,
                server as f64 / 1e3 / calls.max(1) as f64,
                client as f64 / 1e3 / calls.max(1) as f64,
            ));
        }
    }
    println!("\n| mode | ids | calls/s (median) | ratio to classic (median of rounds) | ratios per round | server CPU µs/call | client CPU µs/call | load average (median) |");
    println!("|---|---|---:|---:|---|---:|---:|---:|");
    for (name, ids, cps, ratio, all, load, server, client) in summary {
        println!(
            "| {name} | {ids:?} | {cps:.0} | {ratio:.2} | {} | {server:.1} | {client:.1} | {load:.1} |",
            all.iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// `--spawn N`: N OS processes (this program with `--child-key`) on one key; the total they
/// granted between two readings of the server's clock against `rate × W + burst`.
async fn run_spawned(url: &str, args: &Args, run: &str, mode: Mode) {
    let setup = PgKeyedLimiter::connect(url, options(args))
        .await
        .expect("connect");
    setup.install().await.expect("install");
    let c = connect(url, args).await;
    let clock = "SELECT clock_timestamp()";
    let key = format!("{run}-spawned-{mode:?}");
    let exe = std::env::current_exe().expect("own path");
    // The children get this invocation's flags, without `--spawn`/`--mode` and the value
    // that follows either.
    let mut cleaned = Vec::new();
    let mut skip = false;
    let all: Vec<String> = std::env::args().skip(1).collect();
    for a in &all {
        if skip {
            skip = false;
            continue;
        }
        if a == "--spawn" || a == "--mode" {
            skip = true;
            continue;
        }
        if a.starts_with("--spawn=") || a.starts_with("--mode=") {
            continue;
        }
        cleaned.push(a.clone());
    }
    let start: SystemTime = c.query_one(clock, &[]).await.expect("clock").get(0);
    let children: Vec<_> = (0..args.spawn)
        .map(|_| {
            std::process::Command::new(&exe)
                .args(&cleaned)
                .args([
                    "--mode",
                    if mode == Mode::Strict {
                        "strict"
                    } else {
                        "leased"
                    },
                ])
                .args(["--child-key", &key])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    // Every child connected and waiting: create the key's row, full (as its first call
    // would), then start them all. The window starts at the row's creation on the server's
    // clock, so `rate x W + burst` is exactly what the row makes available.
    use std::io::{BufRead, Read, Write};
    let mut children: Vec<_> = children
        .into_iter()
        .map(|mut ch| {
            let mut out = std::io::BufReader::new(ch.stdout.take().expect("stdout"));
            let mut line = String::new();
            out.read_line(&mut line).expect("child ready");
            assert_eq!(line.trim(), "READY", "child: {line}");
            (ch, out)
        })
        .collect();
    let (rate_i, burst_i) = match mode {
        Mode::Strict => (args.refill as i64, args.refill as i64 * args.window as i64),
        _ => (args.leased_rate, args.leased_burst),
    };
    let _ = rate_i;
    let created: i64 = c
        .query_one(
            &format!(
                "INSERT INTO {}.token_bucket (id, micro, ts, granted) \
                 VALUES ($1, $2::bigint * 1000000, clock_timestamp(), 0) \
                 RETURNING (extract(epoch FROM ts) * 1000000)::bigint",
                args.schema
            ),
            &[&key, &burst_i],
        )
        .await
        .expect("create the row")
        .get(0);
    for (ch, _) in children.iter_mut() {
        let stdin = ch.stdin.as_mut().expect("stdin");
        stdin
            .write_all(b"GO\n")
            .and_then(|_| stdin.flush())
            .expect("start child");
    }
    let mut total = 0u64;
    let (mut first, mut last) = (i64::MAX, i64::MIN);
    for (mut ch, mut out) in children {
        let mut text = String::new();
        out.read_to_string(&mut text).expect("child output");
        assert!(ch.wait().expect("child").success(), "child: {text}");
        let line = text
            .lines()
            .find(|l| l.starts_with("GRANTED="))
            .unwrap_or_else(|| panic!("child output: {text}"));
        eprintln!("child: {line}");
        let field = |name: &str| -> i64 {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name))
                .expect("field")
                .parse()
                .expect("number")
        };
        total += field("GRANTED=") as u64;
        first = first.min(field("START="));
        last = last.max(field("END="));
    }
    let end: SystemTime = c.query_one(clock, &[]).await.expect("clock").get(0);
    let whole = end
        .duration_since(start)
        .expect("clock forward")
        .as_secs_f64();
    // The window: from the row's creation to the last child's last call (every grant is
    // inside it); the whole run also includes the processes' start-up.
    assert!(first >= created, "calls after the row's creation");
    let w = (last - created) as f64 / 1e6;
    assert!(w <= whole + 0.001, "window inside the run");
    let (rate, burst, slack) = match mode {
        Mode::Strict => (
            args.refill as f64,
            (args.refill as i64 * args.window as i64) as f64,
            0.0,
        ),
        _ => (
            args.leased_rate as f64,
            args.leased_burst as f64,
            (args.spawn as u64 * args.max_lease) as f64,
        ),
    };
    let ideal = rate * w + burst;
    eprintln!(
        "first call {:.1} ms after the row's creation; returned at shutdown: the RETURNED \
         fields above",
        (first - created) as f64 / 1e3
    );
    println!(
        "{mode:?}, {} processes on one key for {w:.2} s: granted {total}, rate x W + burst = \
         {ideal:.0} ({:+.2}%), bound with K x max_lease = {:.0}: {}",
        args.spawn,
        100.0 * (total as f64 / ideal - 1.0),
        ideal + slack,
        if (total as f64) <= ideal + slack {
            "within"
        } else {
            "ABOVE"
        }
    );
}

/// Microseconds since the Unix epoch on the server's clock.
async fn server_micros(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        &[],
    )
    .await
    .expect("clock")
    .get(0)
}

/// A `--spawn` child: drive `key` for `--seconds`; print `GRANTED=n START=µs END=µs` (the
/// server's clock just before the first call and just after the last).
async fn run_child(url: &str, args: &Args, key: &str) {
    let clock = connect(url, args).await;
    // Connect the limiter before reading the start time: only calls are in the window.
    let strict = if args.mode == Mode::Strict {
        Some(Arc::new(
            PgKeyedLimiter::connect(url, options(args))
                .await
                .expect("connect"),
        ))
    } else {
        None
    };
    let leased = if args.mode == Mode::Strict {
        None
    } else {
        Some(
            PgLeasedLimiter::connect(url, options(args), lease_options(args))
                .await
                .expect("connect"),
        )
    };
    // Connected: wait for the parent's start signal (it creates the key's row first).
    {
        use std::io::{BufRead, Write};
        println!("READY");
        std::io::stdout().flush().expect("stdout");
        let mut go = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut go)
            .expect("start signal");
    }
    let started = server_micros(&clock).await;
    let end = Instant::now() + Duration::from_secs_f64(args.seconds);
    let mut total = 0u64;
    if let Some(l) = strict {
        let mut tasks = Vec::new();
        for _ in 0..args.workers {
            let (l, key) = (l.clone(), key.to_owned());
            let (refill, window) = (args.refill, args.window);
            tasks.push(tokio::spawn(async move {
                let mut g = 0u64;
                while Instant::now() < end {
                    if let Ok(left) = l.request(&key, refill, window).await {
                        g += u64::from(left >= 0);
                    }
                }
                g
            }));
        }
        for t in tasks {
            total += t.await.expect("worker");
        }
    } else if let Some(l) = leased {
        let mut tasks = Vec::new();
        for _ in 0..args.workers {
            let mut k = l.key(key).await.expect("key");
            tasks.push(tokio::spawn(async move {
                let mut g = 0u64;
                while Instant::now() < end {
                    for _ in 0..64 {
                        g += u64::from(matches!(k.try_acquire(1).await, Ok(true)));
                    }
                    tokio::task::yield_now().await;
                }
                g
            }));
        }
        for t in tasks {
            total += t.await.expect("worker");
        }
        let ended = server_micros(&clock).await;
        let s = l.stats();
        let returned = l.shutdown().await.unwrap_or(0);
        println!(
            "GRANTED={total} START={started} END={ended} RETURNED={returned} LEASES={} \
             SHORT={} LARGEST={}",
            s.leases, s.short_leases, s.largest_lease
        );
        return;
    }
    let ended = server_micros(&clock).await;
    println!("GRANTED={total} START={started} END={ended}");
}

/// `--memory-keys N`: bytes of leased state per key held.
async fn run_memory(url: &str, args: &Args, run: &str) {
    let l = PgLeasedLimiter::connect(
        url,
        options(args),
        lease_options(args).with_max_keys(args.max_keys),
    )
    .await
    .expect("connect");
    l.install().await.expect("install");
    // Warm up the connections and statement caches before measuring.
    for i in 0..args.connections * 8 {
        let _ = l.try_acquire_one(&format!("{run}-warm-{i}")).await;
    }
    let _ = l.shutdown().await;
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let start = Instant::now();
    for i in 0..args.memory_keys {
        let _ = l.try_acquire_one(&format!("{run}-m-{i:09}")).await;
    }
    let held = args.memory_keys.min(args.max_keys);
    let grown = LIVE_BYTES.load(Ordering::Relaxed) - before;
    let stats = l.stats();
    println!(
        "memory: {} distinct keys in {:.1} s, max_keys {}, {} evictions: {} bytes live for {} \
         keys held = {:.0} bytes per key (key names of {} bytes included)",
        args.memory_keys,
        start.elapsed().as_secs_f64(),
        args.max_keys,
        stats.evictions,
        grown,
        held,
        grown as f64 / held as f64,
        format!("{run}-m-000000000").len()
    );
    let _ = l.shutdown().await;
    println!(
        "memory: after shutdown {} bytes live above the start",
        LIVE_BYTES.load(Ordering::Relaxed) - before
    );
}

async fn collect(
    mode: &'static str,
    tasks: Vec<tokio::task::JoinHandle<Outcome>>,
    seconds: f64,
) -> Outcome {
    let mut total = Outcome {
        mode,
        seconds,
        ..Outcome::default()
    };
    for t in tasks {
        let o = t.await.expect("worker");
        total.calls += o.calls;
        total.granted += o.granted;
        total.errors += o.errors;
        total.statements += o.statements;
        total.max_retries = total.max_retries.max(o.max_retries);
    }
    total
}

fn print_table(args: &Args, outcomes: &[Outcome]) {
    println!(
        "\n{} workers, ids: {:?}, {:?}, {} s per run{}",
        args.workers,
        args.ids,
        args.isolation,
        args.seconds,
        if args.async_commit {
            ", synchronous_commit=off"
        } else {
            ""
        }
    );
    println!("| mode | calls/s | got a token | granted/s | statements/s | max retries | errors |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for o in outcomes {
        println!(
            "| {} | {:.0} | {:.1}% | {:.0} | {:.0} | {} | {} |",
            o.mode,
            o.calls_per_sec(),
            100.0 * o.granted as f64 / o.calls.max(1) as f64,
            o.granted as f64 / o.seconds,
            o.statements as f64 / o.seconds,
            o.max_retries,
            o.errors
        );
    }
    for o in outcomes {
        if let Some((achieved, target)) = o.rate_check {
            if o.granted * 100 >= o.calls * 99 {
                println!("leased: demand below the global rate (no rate to hold)");
                continue;
            }
            println!(
                "leased: refill granted at {achieved:.0}/s per id against a global rate of \
                 {target}/s ({:+.2}%)",
                100.0 * (achieved / target as f64 - 1.0)
            );
        }
    }
    let find = |m| outcomes.iter().find(|o| o.mode == m);
    if let (Some(r), Some(l)) = (find("reference"), find("leased")) {
        println!(
            "leased / reference calls per second: {:.0}x",
            l.calls_per_sec() / r.calls_per_sec()
        );
    }
    if let (Some(r), Some(s)) = (find("reference"), find("strict")) {
        println!(
            "strict / reference calls per second: {:.2}x",
            s.calls_per_sec() / r.calls_per_sec()
        );
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args = Args::parse();
    let Some(url) = args.url.clone() else {
        if args.bench {
            // `cargo bench` runs every bench target: without a server this one has nothing
            // to measure.
            eprintln!("pg_load: skipped (no --url; it starts no server, see benches/pg_load.rs)");
            return;
        }
        eprintln!(
            "pg_load needs a server: --url 'host=127.0.0.1 port=5432 user=postgres'. It starts \
             none; see the top of benches/pg_load.rs or docs/postgres.md for a throwaway one."
        );
        std::process::exit(2);
    };
    // A fresh prefix per invocation, so repeated runs do not start from drained buckets.
    let run = format!(
        "r{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_millis()
    );
    if let Some(key) = args.child_key.clone() {
        run_child(&url, &args, &key).await;
        return;
    }
    if args.memory_keys > 0 {
        run_memory(&url, &args, &run).await;
        return;
    }
    if args.keys > 0 {
        run_hot_keys(&url, &args, &run).await;
        return;
    }
    if args.mode == Mode::Compare {
        run_compare(&url, &args, &run).await;
        return;
    }
    if args.spawn > 0 {
        for m in [Mode::Strict, Mode::Leased] {
            if args.mode == m || args.mode == Mode::All {
                run_spawned(&url, &args, &run, m).await;
            }
        }
        return;
    }
    let modes: &[Mode] = match args.mode {
        Mode::All => &[Mode::Reference, Mode::Classic, Mode::Strict, Mode::Leased],
        Mode::Reference => &[Mode::Reference],
        Mode::Strict => &[Mode::Strict],
        Mode::Classic => &[Mode::Classic],
        Mode::Leased => &[Mode::Leased],
        Mode::Compare => unreachable!(),
    };
    let mut outcomes = Vec::new();
    for m in modes {
        let o = match m {
            Mode::Reference => run_reference(&url, &args, &run, false).await,
            Mode::Classic => run_reference(&url, &args, &run, true).await,
            Mode::Strict => run_strict(&url, &args, &run).await,
            Mode::Leased => run_leased(&url, &args, &run).await,
            Mode::All | Mode::Compare => unreachable!(),
        };
        eprintln!("{}: done", o.mode);
        outcomes.push(o);
    }
    print_table(&args, &outcomes);
}
