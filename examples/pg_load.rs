//! The classic load test of the SQL token bucket, for strict mode, leased mode and the
//! reference function: N workers on one id or on N distinct ids, READ COMMITTED or
//! SERIALIZABLE, retries with back-off; prints the achieved rate, the share of calls that got
//! a token and the largest retry count.
//!
//! It needs a server (it starts none):
//!
//! ```text
//! # a local server, or a throwaway one:
//! sudo -u postgres /usr/lib/postgresql/15/bin/initdb -D /tmp/pgload -A trust -U postgres
//! sudo -u postgres /usr/lib/postgresql/15/bin/postgres -D /tmp/pgload -p 5439 \
//!     -c listen_addresses=127.0.0.1 -k /tmp &
//! cargo run --release --features postgres --example pg_load -- \
//!     --url 'host=127.0.0.1 port=5439 user=postgres' --mode all --workers 8 --seconds 5
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use iothrottle::pg::{
    reference, Isolation, LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions, RetryPolicy,
    Schema,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Ids {
    /// Every worker on one id (the hot key).
    One,
    /// Each worker on its own id.
    Distinct,
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
        Ids::Distinct => format!("{run}-{mode}-{worker}"),
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
        reference::install_reference_function(&setup, &schema)
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
    let opts = LeaseOptions::new(args.leased_rate, args.leased_burst, args.max_lease)
        .expect("lease options")
        .with_lease_period(Duration::from_millis(20));
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
        Ids::Distinct => args.workers as i64,
    };
    // Every id starts with its burst; what was granted beyond it came from the refill.
    let beyond = out.granted as f64 - (ids * args.leased_burst) as f64;
    out.rate_check = Some((beyond / out.seconds / ids as f64, args.leased_rate));
    out
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
        eprintln!(
            "pg_load needs a server: --url 'host=127.0.0.1 port=5432 user=postgres'. It starts \
             none; see the top of examples/pg_load.rs or docs/postgres.md for a throwaway one."
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
    let modes: &[Mode] = match args.mode {
        Mode::All => &[Mode::Reference, Mode::Classic, Mode::Strict, Mode::Leased],
        Mode::Reference => &[Mode::Reference],
        Mode::Strict => &[Mode::Strict],
        Mode::Classic => &[Mode::Classic],
        Mode::Leased => &[Mode::Leased],
    };
    let mut outcomes = Vec::new();
    for m in modes {
        let o = match m {
            Mode::Reference => run_reference(&url, &args, &run, false).await,
            Mode::Classic => run_reference(&url, &args, &run, true).await,
            Mode::Strict => run_strict(&url, &args, &run).await,
            Mode::Leased => run_leased(&url, &args, &run).await,
            Mode::All => unreachable!(),
        };
        eprintln!("{}: done", o.mode);
        outcomes.push(o);
    }
    print_table(&args, &outcomes);
}
