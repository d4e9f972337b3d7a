//! Bytes per key: iothrottle's `KeyedThrottle` against governor's keyed limiter, measured with a
//! counting global allocator (heap bytes requested, after inserting N keys, divided by N).
//!
//! `cargo run --release --example keyed_memory -- --keys 100000`

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicIsize, Ordering};

use clap::Parser;

use iothrottle::keyed::KeyedThrottle;
use iothrottle::{BucketConfig, Rate};

/// Counts live heap bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Parser)]
struct Args {
    /// How many distinct keys (u64) to insert into each limiter.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    keys: u64,
}

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn main() {
    let args = Args::parse();
    let n = args.keys;

    let before = live();
    let ours = KeyedThrottle::<u64>::new(
        BucketConfig::new(Rate::per_second(1_000_000), 1_000),
        n as usize,
    )
    .expect("valid config");
    for key in 0..n {
        ours.check(&key, 1).expect("a fresh key has a full bucket");
    }
    let ours_bytes = live() - before;
    drop(ours);

    let before = live();
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000).unwrap())
        .allow_burst(NonZeroU32::new(1_000).unwrap());
    let theirs = governor::RateLimiter::keyed(quota);
    for key in 0..n {
        theirs.check_key(&key).expect("a fresh key is allowed");
    }
    let theirs_bytes = live() - before;
    drop(theirs);

    let per = |b: isize| b as f64 / n as f64;
    println!("keys: {n}");
    println!(
        "iothrottle KeyedThrottle<u64>: {:>8.1} bytes/key (slot {} B: key and state)",
        per(ours_bytes),
        KeyedThrottle::<u64>::state_bytes_per_key()
    );
    println!(
        "governor keyed (dashmap):      {:>8.1} bytes/key",
        per(theirs_bytes)
    );
    println!(
        "ratio: {:.1}x",
        per(ours_bytes) / per(theirs_bytes).max(f64::MIN_POSITIVE)
    );
}
