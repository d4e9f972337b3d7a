//! Several threads share one bucket: each grabs tokens, waits for its turn, and the total
//! stays at the configured rate.
//!
//! `cargo run --release --example bucket_basics -- --rate 200000 --threads 4 --seconds 2`

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::{BucketConfig, MonotonicClock, Rate, SharedTokenBucket, Uncapped};

#[derive(Parser, Debug)]
#[command(about = "Threads sharing one lock-free token bucket")]
struct Args {
    /// Tokens per second.
    #[arg(long, default_value_t = 200_000)]
    rate: u64,
    /// Bucket limit (burst), in tokens.
    #[arg(long, default_value_t = 1_000)]
    limit: u64,
    /// Threads grabbing from the bucket.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Tokens per grab.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// How long to run.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let cfg = BucketConfig::new(Rate::per_second(args.rate), args.limit)
        .with_threshold((args.batch).min(args.limit));
    let clock = MonotonicClock::new();
    let bucket = Arc::new(SharedTokenBucket::<Uncapped, _>::with_clock(cfg, clock)?);
    let run_for = Duration::from_secs_f64(args.seconds);
    bucket.replenish(); // the first replenish fills the bucket: the initial burst
    let start = Instant::now();

    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let bucket = Arc::clone(&bucket);
            thread::spawn(move || {
                let mut got = 0u64;
                let mut waits = 0u64;
                while start.elapsed() < run_for {
                    let tail = bucket.grab(args.batch);
                    loop {
                        bucket.replenish();
                        let missing = bucket.deficiency(tail);
                        if missing == 0 {
                            break;
                        }
                        waits += 1;
                        thread::sleep(bucket.duration_for(missing.max(bucket.threshold())));
                    }
                    got += args.batch;
                }
                (got, waits)
            })
        })
        .collect();

    let mut total = 0;
    println!("{:>7} {:>12} {:>8}", "thread", "tokens", "sleeps");
    for (i, w) in workers.into_iter().enumerate() {
        let (got, waits) = w.join().expect("worker panicked");
        println!("{i:>7} {got:>12} {waits:>8}");
        total += got;
    }
    let elapsed = start.elapsed().as_secs_f64();
    // Ideal: the initial burst plus the rate over the elapsed time.
    let ideal = args.limit as f64 + args.rate as f64 * elapsed;
    println!(
        "total {total} tokens in {elapsed:.3} s; ideal (burst + rate x time) {ideal:.0}: {:.2}%",
        100.0 * total as f64 / ideal
    );
    Ok(())
}
