//! Two processes, two classes each, one disk: both processes' dispatchers take from one
//! bucket in shared memory, so together they keep to the disk's rate.
//!
//! `cargo run --release --features shm --example shared_disk` starts a second copy of itself
//! and runs both for a few seconds; each prints what its classes got, and the first prints the
//! total against the rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures, IoRequest};
use iothrottle::{BucketConfig, Clock, Rate, SharedTokenBucket, SystemMonotonicClock, Uncapped};

#[derive(Parser)]
struct Args {
    /// The bucket file (default: a fresh one under /dev/shm).
    #[arg(long)]
    path: Option<std::path::PathBuf>,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 3)]
    secs: u64,
    /// Run as the second process (started by the first).
    #[arg(long, hide = true)]
    child: bool,
}

/// The disk's rate: a quarter of the disk's time, in nanoseconds of disk time per second.
const RATE: u64 = DiskModel::TOKENS_PER_SECOND / 4;
/// Tokens per request (20 µs of disk time).
const COST: u64 = 20_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let path = args.path.clone().unwrap_or_else(|| {
        std::path::PathBuf::from(format!(
            "/dev/shm/iothrottle-shared-disk-{}",
            std::process::id()
        ))
    });
    let mut second = None;
    if !args.child {
        let _ = std::fs::remove_file(&path);
        second = Some(
            std::process::Command::new(std::env::current_exe()?)
                .args(["--child", "--secs", &args.secs.to_string(), "--path"])
                .arg(&path)
                .stdout(std::process::Stdio::piped())
                .spawn()?,
        );
    }
    let me = if args.child { "process B" } else { "process A" };
    let cfg = BucketConfig::new(Rate::per_second(RATE), 750_000).with_threshold(20_000);
    let clock: Arc<dyn Clock> = Arc::new(SystemMonotonicClock);
    let bucket = Arc::new(SharedTokenBucket::<Uncapped, _>::open_with_clock(
        &path, cfg, clock,
    )?);
    let mut b = Dispatcher::builder()
        .disk(DiskModel::symmetric(Figures {
            iops: 200_000,
            bandwidth: 2_000_000_000,
        }))
        .shards(1)
        .pin_threads(false)
        .shared_bucket(bucket);
    let classes = [
        (
            b.add_class(ClassConfig::new("foreground", 800))?,
            "foreground",
        ),
        (
            b.add_class(ClassConfig::new("background", 200))?,
            "background",
        ),
    ];
    let d = Arc::new(b.build()?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let start = Instant::now();
    let end = start + Duration::from_secs(args.secs);
    let counts: Vec<Arc<AtomicU64>> = classes
        .iter()
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for ((class, _), count) in classes.iter().zip(&counts) {
            // 16 requests in flight per class, so each class always has a queue.
            for _ in 0..16 {
                let (d, class, count) = (Arc::clone(&d), *class, Arc::clone(count));
                tasks.push(tokio::spawn(async move {
                    while Instant::now() < end {
                        d.submit(class, IoRequest::tokens(COST), async {})
                            .unwrap()
                            .await
                            .unwrap();
                        count.fetch_add(COST, Ordering::Relaxed);
                    }
                }));
            }
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let mine: u64 = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    for ((_, name), count) in classes.iter().zip(&counts) {
        let got = count.load(Ordering::Relaxed);
        println!(
            "{me} {name}: {:.1}% of the disk's rate ({:.1}% of this process)",
            100.0 * got as f64 / secs / RATE as f64,
            100.0 * got as f64 / mine.max(1) as f64
        );
    }
    println!(
        "{me} total: {:.1}% of the disk's rate",
        100.0 * mine as f64 / secs / RATE as f64
    );
    d.shutdown();
    if let Some(second) = second {
        let out = second.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        let theirs: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process B total: "))
            .and_then(|l| l.trim_end_matches("% of the disk's rate").parse().ok())
            .unwrap_or(0.0);
        let ours = 100.0 * mine as f64 / secs / RATE as f64;
        println!(
            "both processes: {:.1}% of the disk's rate ({} tokens/s shared through {})",
            ours + theirs,
            RATE,
            path.display()
        );
        let _ = std::fs::remove_file(&path);
    }
    Ok(())
}
