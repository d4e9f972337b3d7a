//! How much of the disk model's rate one saturating class gets, at the default latency goal
//! and at a longer one, side by side: the tokens dispatched ÷ (rate × elapsed), and where the
//! rest went (counted from the bucket's rovers, sampled every 200 µs).
//!
//! ```text
//! cargo run --release --example capacity                        # a file under /tmp, O_DIRECT
//! cargo run --release --example capacity -- --dir /work --kib 64 --depth 64 --seconds 5
//! cargo run --release --example capacity -- --instant           # requests that complete at once
//! ```
//!
//! The disk model is `--iops` and `--bandwidth-mb` (both directions), or the calibrated figures
//! of `--properties io_properties.yaml` for the file's mount point. Each line prints, per goal:
//! `rate×` (tokens dispatched per second ÷ the bucket's rate), `capped` (share of samples with
//! `head` at `ceil`: the in-flight bound held the class back), `owed` (share with the
//! reservation still waiting for tokens: the rate held it back), `idle` (share with tokens
//! in the bucket and nothing claiming them: the shard was late to take them), the service
//! time (dispatch to completion) p50 and p99, and by Little's law the modelled disk time in
//! flight over the goal (near 1 with `capped` high: the disk's latency, not the pacing, bounds
//! the rate at that goal). See docs/dispatcher.md, "Capped mode".

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::disk::{AlignedBuf, FileOptions, ThrottledFile};
use iothrottle::dispatcher::{
    ClassConfig, DiskModel, Dispatcher, DispatcherBuilder, Figures, IoRequest,
};

#[derive(Parser, Debug)]
struct Args {
    /// Seconds per goal (after a warm-up of a fifth of it).
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Read size, KiB (a multiple of 4).
    #[arg(long, default_value_t = 4)]
    kib: usize,
    /// Reads outstanding.
    #[arg(long, default_value_t = 64)]
    depth: usize,
    /// Where the scratch file goes (a real disk, not tmpfs).
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
    /// Scratch file size, MiB.
    #[arg(long, default_value_t = 256)]
    file_mib: u64,
    /// The model's IOPS (read and write).
    #[arg(long, default_value_t = 20_000)]
    iops: u64,
    /// The model's bandwidth, MB/s (read and write).
    #[arg(long, default_value_t = 1_000)]
    bandwidth_mb: u64,
    /// Take the model from this io_properties.yaml instead (the file's mount point).
    #[arg(long)]
    properties: Option<PathBuf>,
    /// Requests that complete at once (no disk): only the dispatcher's pacing is measured.
    #[arg(long)]
    instant: bool,
    /// Shards.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Goals to compare, µs (default: the builder's, then 4 ms).
    #[arg(long, value_delimiter = ',')]
    goals_us: Vec<u64>,
}

type BoxError = Box<dyn std::error::Error>;

/// What the sampler counted.
#[derive(Default)]
struct Samples {
    total: AtomicU64,
    capped: AtomicU64,
    owed: AtomicU64,
    idle: AtomicU64,
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.kib == 0 || args.kib % 4 != 0 || args.depth == 0 || args.seconds == 0 {
        return Err("--kib must be a positive multiple of 4; --depth, --seconds positive".into());
    }
    // Removed when dropped (at the end, or on an error).
    let scratch = tempfile::Builder::new()
        .prefix("iothrottle-capacity-")
        .tempfile_in(&args.dir)?;
    let path = scratch.path().to_owned();
    let disk = match &args.properties {
        Some(p) => DiskModel::from_properties_for_dir(p, &args.dir)?,
        None => DiskModel::symmetric(Figures {
            iops: args.iops,
            bandwidth: args.bandwidth_mb * 1_000_000,
        }),
    };
    if !args.instant {
        make_file(&path, args.file_mib)?;
    }
    let goals: Vec<Duration> = if args.goals_us.is_empty() {
        vec![
            DispatcherBuilder::DEFAULT_LATENCY_GOAL,
            Duration::from_millis(4),
        ]
    } else {
        args.goals_us
            .iter()
            .map(|&u| Duration::from_micros(u))
            .collect()
    };
    println!(
        "one class, {} KiB reads at depth {}, {} shard(s), {}; model {:?}",
        args.kib,
        args.depth,
        args.shards,
        if args.instant {
            "requests that complete at once".to_string()
        } else {
            format!("O_DIRECT reads of {}", path.display())
        },
        disk
    );
    let outcome = goals
        .iter()
        .try_for_each(|&goal| run(&args, disk, goal, &path));
    drop(scratch);
    outcome
}

fn make_file(path: &std::path::Path, mib: u64) -> Result<(), BoxError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    for _ in 0..mib {
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    Ok(())
}

fn run(
    args: &Args,
    disk: DiskModel,
    goal: Duration,
    path: &std::path::Path,
) -> Result<(), BoxError> {
    let d = Arc::new(
        Dispatcher::builder()
            .disk(disk)
            .latency_goal(goal)
            .shards(args.shards)
            .class(ClassConfig::new("c", 100))
            .build()?,
    );
    let class = d.class_id("c").expect("configured above");
    let rate = d.rate();
    let per_second = rate.per_second_f64();
    let bytes = args.kib << 10;
    let file = if args.instant {
        None
    } else {
        Some(Arc::new(ThrottledFile::open(
            d.clone(),
            class,
            path,
            FileOptions::default(),
        )?))
    };
    let blocks = (args.file_mib << 20) / bytes as u64;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Samples::default());
    let warm = Duration::from_secs(args.seconds).div_f64(5.0);
    let (first, last, elapsed) = rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..args.depth {
            let (d, stop, file) = (d.clone(), stop.clone(), file.clone());
            tasks.push(tokio::spawn(async move {
                let mut buf = AlignedBuf::zeroed(bytes).expect("a multiple of 4 KiB");
                let mut i = t as u64;
                while !stop.load(Ordering::Relaxed) {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    match &file {
                        Some(f) => {
                            let (res, b) = f.read_at(buf, (i >> 11) % blocks * bytes as u64).await;
                            buf = b;
                            if res.is_err() {
                                return;
                            }
                        }
                        None => {
                            let Ok(h) = d.submit(class, IoRequest::read(bytes as u64), async {})
                            else {
                                return;
                            };
                            if h.await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }));
        }
        // The sampler: a thread of its own, reading the rovers every 200 µs.
        let sampler = {
            let (d, stop, s) = (d.clone(), stop.clone(), samples.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let b = d.bucket_state();
                    s.total.fetch_add(1, Ordering::Relaxed);
                    if b.ceil == Some(b.head) {
                        s.capped.fetch_add(1, Ordering::Relaxed);
                    } else if b.tokens() < 0 {
                        s.owed.fetch_add(1, Ordering::Relaxed);
                    } else {
                        s.idle.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        tokio::time::sleep(warm).await;
        let first = d.stats().await;
        let (s0, t0) = (snapshot(&samples), Instant::now());
        tokio::time::sleep(Duration::from_secs(args.seconds)).await;
        let last = d.stats().await;
        let elapsed = t0.elapsed();
        let s1 = snapshot(&samples);
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        let _ = sampler.join();
        (first, last, (elapsed, s0, s1))
    });
    let (elapsed, s0, s1) = elapsed;
    let window = last.since(&first);
    let tokens = window.tokens();
    let c = &window.classes[0];
    let share = |i: usize| {
        let n = (s1[0] - s0[0]).max(1) as f64;
        (s1[i] - s0[i]) as f64 / n
    };
    let ratio = tokens as f64 / (per_second * elapsed.as_secs_f64());
    println!(
        "goal {:>6?}: rate× {ratio:.4}  capped {:.3}  owed {:.3}  idle {:.3}  service p50 {:?} p99 {:?}  in flight ≈ {:.2} of the goal  queue p50 {:?}  ({} requests, {:.1} MB/s)",
        goal,
        share(1),
        share(2),
        share(3),
        c.service_p50(),
        c.service_p99(),
        // Little's law: modelled disk time in flight = tokens per second × time in flight.
        tokens as f64 / elapsed.as_secs_f64() * c.service_p50().as_secs_f64()
            / goal.as_nanos() as f64,
        c.queue_wait_p50(),
        c.requests,
        (c.requests as f64 * bytes as f64) / elapsed.as_secs_f64() / 1e6,
    );
    d.shutdown();
    Ok(())
}

fn snapshot(s: &Samples) -> [u64; 4] {
    [
        s.total.load(Ordering::Relaxed),
        s.capped.load(Ordering::Relaxed),
        s.owed.load(Ordering::Relaxed),
        s.idle.load(Ordering::Relaxed),
    ]
}
