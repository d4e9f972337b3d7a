//! How close each async rate limiter gets to its configured rate, in real time.
//!
//! One task acquires cost-1 permits back to back from a limiter configured for `--rate` tokens
//! per second (burst 1) for `--seconds`, and counts the grants. The ideal is `rate × seconds`;
//! a limiter that loses the time its timer is late (rounds down on wake-up) falls short.
//!
//! ```text
//! cargo run --release --example throttle_accuracy -- --seconds 10
//! ```
//!
//! Every flag is checked before anything runs: `--rate 0`, `--seconds 0` or an `--only` that
//! names no limiter is a usage error, not a panic or a `NaN%`.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser};
use iothrottle::throttle::Throttle;
use iothrottle::{BucketConfig, Capped, Rate, Uncapped};

/// Fraction of the ideal grants each limiter achieves.
#[derive(Parser, Debug)]
struct Args {
    /// Tokens per second, 1 to 1,000,000 (one cost-1 grant per token: beyond a million per
    /// second the loop, not the limiter, is measured).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    rate: u32,
    /// How long each limiter runs, in seconds (1 to 3,600).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    seconds: u64,
    /// Run only the limiters whose name contains this.
    #[arg(long)]
    only: Option<String>,
}

async fn count<F, Fut>(window: Duration, mut acquire: F) -> u64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let end = Instant::now() + window;
    let mut grants = 0;
    while Instant::now() < end {
        acquire().await;
        grants += 1;
    }
    grants
}

/// The limiters, by the names `--only` matches.
const LIMITERS: [&str; 4] = [
    "iothrottle",
    "iothrottle capped",
    "leaky-bucket",
    "governor",
];

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    if let Some(only) = &args.only {
        if !LIMITERS.iter().any(|name| name.contains(only.as_str())) {
            Args::command()
                .error(
                    clap::error::ErrorKind::InvalidValue,
                    format!(
                        "--only {only:?} matches no limiter; the limiters are: {}",
                        LIMITERS.join(", ")
                    ),
                )
                .exit();
        }
    }
    let window = Duration::from_secs(args.seconds);
    let ideal = u64::from(args.rate) * args.seconds;
    let rate = Rate::per_second(u64::from(args.rate));
    let wanted = |name: &str| args.only.as_deref().is_none_or(|o| name.contains(o));

    println!(
        "{} tokens/s, cost 1, burst 1, {} s: ideal {} grants",
        args.rate, args.seconds, ideal
    );
    println!("{:<28} {:>10} {:>9}", "limiter", "grants", "of ideal");
    let report = |name: &str, grants: u64| {
        println!(
            "{:<28} {:>10} {:>8.2}%",
            name,
            grants,
            100.0 * grants as f64 / ideal as f64
        );
    };

    if wanted("iothrottle") {
        let th: Throttle<Uncapped> = Throttle::new(BucketConfig::new(rate, 1)).unwrap();
        let grants = count(window, || async { drop(th.acquire(1).await.unwrap()) }).await;
        report("iothrottle Throttle", grants);
    }
    if wanted("iothrottle capped") {
        let th: Throttle<Capped> = Throttle::new(BucketConfig::new(rate, 1)).unwrap();
        let grants = count(window, || async { th.acquire(1).await.unwrap().complete() }).await;
        report("iothrottle Throttle (capped)", grants);
    }
    if wanted("leaky-bucket") {
        let limiter = leaky_bucket::RateLimiter::builder()
            .max(1)
            .initial(1)
            .refill(1)
            .interval(Duration::from_secs(1) / args.rate)
            .build();
        let grants = count(window, || limiter.acquire_one()).await;
        report("leaky-bucket RateLimiter", grants);
    }
    if wanted("governor") {
        let quota = governor::Quota::per_second(NonZeroU32::new(args.rate).unwrap())
            .allow_burst(NonZeroU32::MIN);
        let limiter = governor::RateLimiter::direct(quota);
        let grants = count(window, || limiter.until_ready()).await;
        report("governor until_ready", grants);
    }
}
