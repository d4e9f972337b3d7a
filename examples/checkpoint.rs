//! A durable limiter: consume tokens with checkpointing on, shut down, restart, and see that
//! the restart does not come back with a free burst.
//!
//! ```text
//! cargo run --example checkpoint                        # a file in a temp directory
//! cargo run --example checkpoint -- --file /var/lib/x.ckpt --strict
//! cargo run --example checkpoint --features postgres -- --postgres postgresql://postgres@127.0.0.1:5432/postgres
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::checkpoint::{
    Checkpoint, CheckpointConfig, CheckpointedBucket, Checkpointer, Durability, FileCheckpoint,
    RestoreOutcome,
};
use iothrottle::{BucketConfig, MonotonicClock, Rate, Throttle, Uncapped};

#[derive(Parser, Debug)]
#[command(about = "Checkpointed token bucket: no free burst after a restart")]
struct Args {
    /// Checkpoint file (default: a file in a fresh temp directory).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Save into PostgreSQL instead (connection string or URL); needs `--features postgres`.
    #[arg(long)]
    postgres: Option<String>,
    /// Tokens per second.
    #[arg(long, default_value_t = 100_000)]
    rate: u64,
    /// Bucket limit.
    #[arg(long, default_value_t = 20_000)]
    limit: u64,
    /// How long each "process life" consumes tokens, in milliseconds.
    #[arg(long, default_value_t = 500)]
    millis: u64,
    /// Strict (write-ahead reservation) durability instead of periodic.
    #[arg(long)]
    strict: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    // Errors are printed with their message (`Display`), not as a Debug struct.
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let config = BucketConfig::new(Rate::per_second(args.rate), args.limit);
    config.validate()?;
    let durability = if args.strict {
        // Half a second of tokens per reservation.
        Durability::strict((args.rate / 2).max(1))
    } else {
        Durability::Periodic
    };

    if let Some(url) = &args.postgres {
        #[cfg(feature = "postgres")]
        {
            let store = Arc::new(iothrottle::checkpoint::PgCheckpoint::new(url, "example")?);
            println!("checkpointing into PostgreSQL, row \"example\"");
            return lives(store, config, durability, &args).await;
        }
        #[cfg(not(feature = "postgres"))]
        {
            let _ = url;
            return Err(
                "--postgres needs: cargo run --example checkpoint --features postgres".into(),
            );
        }
    }
    let _tmp;
    let path = match &args.file {
        Some(p) => p.clone(),
        None => {
            let dir = tempfile::tempdir()?;
            let p = dir.path().join("bucket.ckpt");
            _tmp = dir;
            p
        }
    };
    println!("checkpointing into {}", path.display());
    lives(
        Arc::new(FileCheckpoint::new(path)),
        config,
        durability,
        &args,
    )
    .await
}

/// Two "process lives" on one store: the second starts from what the first saved.
async fn lives<S: Checkpoint>(
    store: Arc<S>,
    config: BucketConfig,
    durability: Durability,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    for life in 1..=2 {
        let (bucket, outcome) = CheckpointedBucket::<Uncapped, _>::restore_or_empty(
            &store,
            config,
            MonotonicClock::new(),
            durability,
        )
        .await?;
        match &outcome {
            RestoreOutcome::FirstStart => println!("life {life}: first start (fills to the limit)"),
            RestoreOutcome::Restored(r) => println!(
                "life {life}: restored {} tokens (saved {}, downtime {:?} earned {}, reserved spent {})",
                r.tokens, r.saved_tokens, r.downtime, r.earned, r.reserved_spent
            ),
            RestoreOutcome::Fallback(e) => println!("life {life}: unusable checkpoint ({e}): empty bucket"),
            _ => println!("life {life}: {outcome:?}"),
        }
        let bucket = Arc::new(bucket);
        let cp = Checkpointer::start(
            bucket.clone(),
            store.clone(),
            CheckpointConfig::default().with_interval(Duration::from_millis(100)),
        )?;
        // The throttle's waiting protocol, which also waits for the strict durable mark.
        let throttle = Throttle::with_checkpoint(&bucket);
        let batch = args.limit.min(1_000);
        let start = Instant::now();
        let mut granted = 0u64;
        while start.elapsed() < Duration::from_millis(args.millis) {
            drop(throttle.acquire(batch).await?);
            granted += batch;
        }
        let secs = start.elapsed().as_secs_f64();
        // Every acquire has returned: an idle shutdown gives an unused strict reservation back.
        if let Err(e) = cp.shutdown_idle().await {
            println!(
                "life {life}: final save failed ({e}); the next start falls back as documented"
            );
        }
        let s = bucket.stats();
        println!(
            "life {life}: granted {granted} tokens in {secs:.2} s ({:.0}/s at a rate of {}/s), \
             {} saves, {} failed, {} grabs past the mark",
            granted as f64 / secs,
            args.rate,
            s.saves,
            s.save_failures,
            s.grabs_past_mark
        );
    }
    Ok(())
}
