#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! The dispatcher with real shard threads: the submit API, errors, shutdown, and token shares.
//!
//! These run in real time, so they assert on *shares of tokens* and on outcomes, never on
//! timings. The exact, clock-driven checks of the shard loop are in `src/dispatcher/tests.rs`.
//! One file over the usual size: every test here drives the same public surface, grouped by
//! section (submit, shutdown, shares, tasks on the shards, dispatch from the caller's thread).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use iothrottle::dispatcher::{
    current_shard, ClassConfig, ClassId, DiskModel, Dispatcher, DispatcherBuilder, DispatcherStats,
    Figures, IoRequest,
};
use iothrottle::{
    BuildError, DispatchError, JoinError, ManualClock, Rate, SpawnError, SubmitError,
};

use common::disk::NVME;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn submit_runs_the_future_and_returns_its_output() {
    let mut b = Dispatcher::builder().disk(NVME).shards(2);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    assert_eq!(d.shards(), 2);
    assert_eq!(d.current_shard(), None);
    let rt = rt();
    let h = d.submit(c, IoRequest::read(4096), async { 1 + 1 }).unwrap();
    assert_eq!(rt.block_on(h), Ok(2));
    // A future running on a shard submits to its own shard.
    let d2 = d.clone();
    let h = d
        .submit_to(1, c, IoRequest::write(512), async move {
            let here = d2.current_shard();
            let inner = d2
                .submit(c, IoRequest::read(1), async {})
                .expect("submit from a shard");
            inner.await.unwrap();
            here
        })
        .unwrap();
    assert_eq!(rt.block_on(h), Ok(Some(1)));
    let stats = d.stats_blocking();
    assert_eq!(stats.classes[0].requests, 3);
    assert_eq!(stats.shards[1].classes[0].requests, 2);
    assert_eq!(
        stats.classes[0].bytes,
        4096 + 512 + 1,
        "bytes of all three requests"
    );
    assert_eq!(
        stats.classes[0].tokens,
        d.cost(&IoRequest::read(4096))
            + d.cost(&IoRequest::write(512))
            + d.cost(&IoRequest::read(1))
    );
    d.shutdown();
}

#[test]
fn configuration_errors_are_typed() {
    let mut b = Dispatcher::builder().disk(NVME);
    assert!(matches!(
        b.add_class(ClassConfig::new("zero", 0)),
        Err(BuildError::SharesOutOfRange { shares: 0, .. })
    ));
    assert!(matches!(
        b.add_class(ClassConfig::new("big", 1001)),
        Err(BuildError::SharesOutOfRange { shares: 1001, .. })
    ));
    b.add_class(ClassConfig::new("a", 1000)).unwrap();
    assert!(matches!(
        b.add_class(ClassConfig::new("a", 1)),
        Err(BuildError::DuplicateClass { .. })
    ));
    assert!(matches!(
        Dispatcher::builder().disk(NVME).shards(1).build(),
        Err(BuildError::NoClasses)
    ));
    // The chaining form checks the classes at build.
    let chained = |cfgs: &[(&str, u32)]| {
        cfgs.iter()
            .fold(Dispatcher::builder().disk(NVME).shards(1), |b, (n, s)| {
                b.class(ClassConfig::new(*n, *s))
            })
            .build()
    };
    assert!(matches!(
        chained(&[("ok", 1), ("zero", 0)]),
        Err(BuildError::SharesOutOfRange { shares: 0, .. })
    ));
    assert!(matches!(
        chained(&[("a", 1), ("a", 2)]),
        Err(BuildError::DuplicateClass { .. })
    ));
    assert!(matches!(
        Dispatcher::builder()
            .disk(NVME)
            .class(ClassConfig::new("c", 1).with_bandwidth_cap(Rate::per_second(0)))
            .build(),
        Err(BuildError::ZeroBandwidthCap { .. })
    ));
    let d = chained(&[("a", 1), ("b", 2)]).unwrap();
    assert_eq!(d.class_id("b").map(|c| c.index()), Some(1));
    assert_eq!(d.class_id("c"), None);
    d.shutdown();
    let with_class = |b: DispatcherBuilder| {
        let mut b = b;
        b.add_class(ClassConfig::new("c", 1)).unwrap();
        b
    };
    assert!(matches!(
        with_class(Dispatcher::builder().disk(NVME).shards(0)).build(),
        Err(BuildError::ZeroShards)
    ));
    assert!(matches!(
        with_class(Dispatcher::builder().disk(DiskModel::new(
            Figures {
                iops: 0,
                bandwidth: 1
            },
            Figures {
                iops: 1,
                bandwidth: 1
            }
        )))
        .build(),
        Err(BuildError::ZeroDiskFigure { field: "read.iops" })
    ));
    assert!(matches!(
        with_class(Dispatcher::builder().disk(NVME).limit(100).batch(101)).build(),
        Err(BuildError::TokensOutOfRange { what: "batch", .. })
    ));
    assert!(matches!(
        with_class(Dispatcher::builder().disk(NVME).rate(Rate::per_second(0))).build(),
        Err(BuildError::Bucket(_))
    ));
}

#[test]
fn oversized_requests_are_split_or_refused() {
    let mut b = Dispatcher::builder().disk(NVME).shards(1);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let big = IoRequest::write(64 << 20);
    let err = d.submit(c, big, async {}).unwrap_err();
    let SubmitError::TooLarge {
        cost,
        max_cost,
        max_bytes: Some(max_bytes),
    } = err
    else {
        panic!("{err:?}")
    };
    assert_eq!(cost, d.cost(&big));
    assert_eq!(max_cost, d.max_cost());
    assert!(d.cost(&IoRequest::write(max_bytes)) <= max_cost);
    // A raw token cost cannot be split.
    let raw = IoRequest::tokens(d.max_cost() + 1);
    assert!(matches!(
        d.submit_split(c, raw, |_| async {}),
        Err(SubmitError::TooLarge {
            max_bytes: None,
            ..
        })
    ));
    // Split: pieces in order, covering the request, each within max_cost.
    let h = d.submit_split(c, big, |p| async move { p.range }).unwrap();
    let pieces = h.pieces();
    assert!(pieces >= 2);
    let ranges = rt().block_on(h).unwrap();
    assert_eq!(ranges.len(), pieces);
    assert_eq!(ranges.first().unwrap().start, 0);
    assert_eq!(ranges.last().unwrap().end, 64 << 20);
    for w in ranges.windows(2) {
        assert_eq!(w[0].end, w[1].start);
        assert!(d.cost(&IoRequest::write(w[0].end - w[0].start)) <= d.max_cost());
    }
    // A class id of another dispatcher with more classes.
    let mut other = Dispatcher::builder().disk(NVME).shards(1);
    let mut last = c;
    for i in 0..8 {
        last = other
            .add_class(ClassConfig::new(format!("o{i}"), 1))
            .unwrap();
    }
    assert!(matches!(
        d.submit(last, IoRequest::read(1), async {}),
        Err(SubmitError::UnknownClass { class: 7, .. })
    ));
    assert!(matches!(
        d.submit_to(3, c, IoRequest::read(1), async {}),
        Err(SubmitError::UnknownShard { shard: 3, .. })
    ));
}

/// A slow dispatcher: 1000 tokens per second, requests of 100 tokens (10 per second).
fn slow(shards: usize, capped: bool) -> (Dispatcher, ClassId) {
    slow_with(slow_builder(shards, capped))
}

/// The builder of [`slow`], for a test to add to (a clock, say).
fn slow_builder(shards: usize, capped: bool) -> DispatcherBuilder {
    Dispatcher::builder()
        .disk(NVME)
        .shards(shards)
        .rate(Rate::per_second(1000))
        .limit(100)
        .threshold(1)
        .max_cost(100)
        .capped(capped)
}

/// Builds `b` with one class.
fn slow_with(mut b: DispatcherBuilder) -> (Dispatcher, ClassId) {
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    (b.build().unwrap(), c)
}

#[test]
fn shutdown_dispatches_what_is_queued() {
    let (d, c) = slow(1, false);
    let ran = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..5)
        .map(|i| {
            let ran = ran.clone();
            d.submit(c, IoRequest::tokens(100), async move {
                ran.fetch_add(1, Ordering::SeqCst);
                i
            })
            .unwrap()
        })
        .collect();
    d.shutdown();
    assert_eq!(ran.load(Ordering::SeqCst), 5);
    let rt = rt();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(rt.block_on(h), Ok(i));
    }
    assert_eq!(
        d.submit(c, IoRequest::tokens(1), async {}).unwrap_err(),
        SubmitError::ShutDown
    );
    // Stats survive the shutdown.
    assert_eq!(d.stats_blocking().classes[0].requests, 5);
}

/// On a frozen clock no token accrues: of 200 requests of 100 tokens on a bucket of 100, at
/// most the one the initial tokens pay for runs, whenever `shutdown_now` lands; every other one
/// fails with `ShutDown`, none is lost.
#[test]
fn shutdown_now_fails_what_is_queued() {
    let (d, c) = slow_with(slow_builder(2, true).clock(ManualClock::new()));
    // The shards' first poll fills the bucket (polled for; the bound only stops a hang).
    let waiting = std::time::Instant::now();
    while d.bucket_state().tokens() < 100 {
        assert!(
            waiting.elapsed() < std::time::Duration::from_secs(60),
            "the bucket was never filled"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let ran = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..200)
        .map(|_| {
            let ran = ran.clone();
            d.submit(c, IoRequest::tokens(100), async move {
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    d.shutdown_now();
    let rt = rt();
    let mut ok = 0;
    let mut failed = 0;
    for h in handles {
        match rt.block_on(h) {
            Ok(()) => ok += 1,
            Err(DispatchError::ShutDown) => failed += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(ok, ran.load(Ordering::SeqCst));
    assert_eq!(ok + failed, 200);
    assert!(ok <= 1, "{ok} ran on the initial 100 tokens");
    // Exact accounting: the bucket's first fill (100) less what ran is left (a reservation
    // failed by the shutdown is refunded), and every token grabbed was released or refunded.
    let state = d.bucket_state();
    assert_eq!(state.tokens(), 100 - 100 * ok as i64, "{state:?}");
    assert_eq!(
        state.ceil.map(|ceil| ceil.wrapping_sub(state.tail)),
        Some(100)
    );
    assert_eq!(
        d.submit(c, IoRequest::tokens(1), async {}).unwrap_err(),
        SubmitError::ShutDown
    );
}

#[test]
fn a_dropped_handle_cancels_its_request() {
    let (d, c) = slow(1, true);
    let rt = rt();
    // Empty the bucket, then queue one more and drop its handle before its tokens come.
    let first = d.submit(c, IoRequest::tokens(100), async {}).unwrap();
    rt.block_on(first).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    let h = d
        .submit(c, IoRequest::tokens(100), async move {
            r.store(true, Ordering::SeqCst)
        })
        .unwrap();
    drop(h);
    // A later request still runs: the cancelled one's tokens did not leak (capped mode would
    // stall if they had, the bucket only holds 100).
    let after = d.submit(c, IoRequest::tokens(100), async { 7 }).unwrap();
    assert_eq!(rt.block_on(after), Ok(7));
    let stats = d.stats_blocking();
    let c0 = &stats.classes[0];
    // Either it was dispatched before the drop was seen, or it was skipped: never both.
    assert_eq!(c0.requests + c0.cancelled, 3);
    assert_eq!(ran.load(Ordering::SeqCst), c0.requests == 3);
    d.shutdown();
}

#[test]
fn a_panicking_future_reports_and_releases() {
    let (d, c) = slow(1, true);
    let rt = rt();
    for _ in 0..3 {
        let h = d
            .submit(c, IoRequest::tokens(100), async {
                panic!("disk on fire");
            })
            .unwrap();
        let err = rt.block_on(h).unwrap_err();
        assert_eq!(
            err,
            DispatchError::Panicked {
                message: "disk on fire".into()
            }
        );
    }
    // Capped with a limit of 100: had the panics kept their tokens, this would never run.
    let h = d
        .submit(c, IoRequest::tokens(100), async { "fine" })
        .unwrap();
    assert_eq!(rt.block_on(h), Ok("fine"));
    d.shutdown();
}

#[test]
fn capped_mode_releases_every_completion() {
    // Limit 100, requests of 50, one after the other: 400 requests need 200 limits' worth of
    // releases. A leak of even one request's tokens per 2 would stall it.
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(2)
        .rate(Rate::per_second(1_000_000))
        .limit(100)
        .threshold(1)
        .capped(true);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    assert!(d.is_capped());
    let rt = rt();
    rt.block_on(async {
        for i in 0..400u64 {
            let h = d
                .submit(c, IoRequest::tokens(50), async move {
                    tokio::task::yield_now().await;
                    i
                })
                .unwrap();
            assert_eq!(h.await, Ok(i));
        }
    });
    assert_eq!(d.stats_blocking().tokens(), 400 * 50);
    d.shutdown();
}

/// Requests kept outstanding per feed in the real-thread share tests: 1024 4 KiB reads are
/// over 170 ms of a class's work at its share (at most 5/6) of the slow disk below, so a client thread
/// descheduled for less than that on a loaded machine leaves no class without a queue (a class
/// with nothing queued cannot claim its share, and the others take it).
const DEPTH: usize = 1024;

/// Keeps `depth` requests outstanding per feed (shard, class, request); returns what was
/// dispatched between the moments the first feed reaches `target / 4` and `target`
/// completions (the first quarter is warm-up: the bucket starts full, and while it has tokens
/// to spare every class gets what it asks for).
fn saturate(
    d: &Arc<Dispatcher>,
    feeds: &[(usize, ClassId, IoRequest)],
    depth: usize,
    target: u64,
) -> DispatcherStats {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let warm = Arc::new(tokio::sync::Notify::new());
    let done = Arc::new(tokio::sync::Notify::new());
    let counts: Vec<Arc<AtomicU64>> = feeds.iter().map(|_| Arc::new(AtomicU64::new(0))).collect();
    let snapshot = rt.block_on(async {
        let mut tasks = Vec::new();
        for (f, &(shard, class, req)) in feeds.iter().enumerate() {
            for _ in 0..depth {
                let d = d.clone();
                let stop = stop.clone();
                let done = done.clone();
                let warm = warm.clone();
                let count = counts[f].clone();
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let h = match d.submit_to(shard, class, req, async {}) {
                            Ok(h) => h,
                            Err(_) => return,
                        };
                        if h.await.is_err() {
                            return;
                        }
                        let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                        if n == target / 4 {
                            warm.notify_one();
                        }
                        if n == target {
                            done.notify_one();
                        }
                    }
                }));
            }
        }
        warm.notified().await;
        let start = d.stats().await;
        done.notified().await;
        let end = d.stats().await;
        stop.store(true, Ordering::SeqCst);
        end.since(&start)
    });
    d.shutdown_now();
    drop(rt);
    snapshot
}

fn fast(shards: usize) -> DispatcherBuilder {
    // A slow disk (100 MB/s, 10k IOPS: 141 µs per 4 KiB read, 10.6 ms per 1 MiB) keeps the
    // request rate low enough for a busy CI box: the bucket, not the CPU, is the bottleneck.
    Dispatcher::builder()
        .shards(shards)
        .disk(DiskModel::symmetric(Figures {
            iops: 10_000,
            bandwidth: 100_000_000,
        }))
        .limit(25_000_000)
        .batch(500_000)
}

fn tokens(stats: &DispatcherStats) -> Vec<u64> {
    stats.classes.iter().map(|c| c.tokens).collect()
}

#[test]
fn real_threads_4_to_1_on_one_shard() {
    let mut b = fast(1);
    let hi = b.add_class(ClassConfig::new("hi", 800)).unwrap();
    let lo = b.add_class(ClassConfig::new("lo", 200)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let r = IoRequest::read(4096);
    let t = tokens(&saturate(&d, &[(0, hi, r), (0, lo, r)], DEPTH, 4000));
    let ratio = t[0] as f64 / t[1] as f64;
    println!("real threads, one shard, 4:1 -> {ratio:.3}");
    assert!((ratio / 4.0 - 1.0).abs() <= 0.05, "ratio {ratio}");
}

#[test]
fn real_threads_5_to_1_on_two_shards() {
    let mut b = fast(2);
    let hi = b.add_class(ClassConfig::new("hi", 500)).unwrap();
    let lo = b.add_class(ClassConfig::new("lo", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let r = IoRequest::read(4096);
    let t = tokens(&saturate(&d, &[(0, hi, r), (1, lo, r)], DEPTH, 4000));
    let ratio = t[0] as f64 / t[1] as f64;
    println!("real threads, two shards, 5:1 -> {ratio:.3}");
    assert!((ratio / 5.0 - 1.0).abs() <= 0.10, "ratio {ratio}");
}

#[test]
fn real_threads_small_and_large_requests_get_half_the_tokens_each() {
    let mut b = fast(2);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let stats = saturate(
        &d,
        &[
            (0, c, IoRequest::read(4096)),
            (1, c, IoRequest::read(1 << 20)),
        ],
        DEPTH,
        4000,
    );
    let s0 = stats.shards[0].tokens() as f64;
    let s1 = stats.shards[1].tokens() as f64;
    let share = s0 / (s0 + s1);
    println!(
        "real threads, 4 KiB vs 1 MiB shards (one class): 4 KiB shard share {share:.3}, requests {} vs {}",
        stats.shards[0].classes[0].requests, stats.shards[1].classes[0].requests
    );
    assert!((share - 0.5).abs() <= 0.05, "share {share}");
}

#[test]
fn handles_and_the_dispatcher_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Dispatcher>();
    send::<iothrottle::dispatcher::IoHandle<Vec<u8>>>();
    send::<iothrottle::dispatcher::SplitHandle<Vec<u8>>>();
}

/// Capped release must not leak (Seastar's capped mode did, seastar PR #1766): requests that
/// complete, panic, are cancelled by dropping their handle, or are failed by `shutdown_now`
/// all give their tokens back exactly once, so `ceil - tail` returns to the limit.
#[test]
fn capped_release_accounts_for_every_token() {
    churn(2, 1, 3000, 0x2545_F491_4F6C_DD1D);
}

/// The same with more shards and classes (one with a bandwidth cap), many seeds. Run by CI in
/// release: `cargo test --release --test dispatcher -- --ignored`.
#[test]
#[ignore = "stress test: run with --release --ignored"]
fn stress_capped_release_churn() {
    for seed in 1..=20u64 {
        churn(4, 3, 5000, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    }
}

/// Random requests on `shards` shards and `classes` classes: some panic, some yield or sleep,
/// some have their handle dropped at once; half the rest are awaited, then `shutdown_now` cuts
/// the others off. Afterwards every grabbed token must have been released or refunded.
fn churn(shards: usize, classes: usize, requests: u64, seed: u64) {
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(shards)
        .rate(Rate::per_second(50_000_000))
        .limit(1_000_000)
        .threshold(1000)
        .capped(true);
    let ids: Vec<ClassId> = (0..classes)
        .map(|i| {
            let mut cfg = ClassConfig::new(format!("c{i}"), 1 + 300 * i as u32);
            if i == 2 {
                cfg = cfg.with_bandwidth_cap(Rate::per_second(1 << 20));
            }
            b.add_class(cfg).unwrap()
        })
        .collect();
    let d = Arc::new(b.build().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut kept = Vec::new();
    for i in 0..requests {
        let r = next();
        let cost = 1 + r % 20_000;
        let fate = (r >> 32) % 10;
        let class = ids[(r >> 40) as usize % ids.len()];
        let req = if r & 1 == 0 {
            IoRequest::tokens(cost)
        } else {
            IoRequest::read(cost)
        };
        let h = d
            .submit(class, req, async move {
                match fate {
                    0 if i % 5 == 0 => panic!("request {i} panics"),
                    1 => tokio::task::yield_now().await,
                    2 => tokio::time::sleep(std::time::Duration::from_micros(200)).await,
                    _ => {}
                }
                i
            })
            .unwrap();
        match fate {
            3 | 4 => drop(h), // cancelled, maybe before dispatch
            _ => kept.push((i, (fate, h))),
        }
    }
    // Wait for the first half of the kept ones (they run: the cap class's bytes trickle in,
    // so only the uncapped classes' are awaited), then cut the rest off.
    let (wait, rest): (Vec<_>, Vec<_>) = kept.into_iter().partition(|(i, _)| i % 2 == 0);
    rt.block_on(async {
        for (i, (fate, h)) in wait {
            if classes > 2 {
                drop(h);
                continue;
            }
            let out = h.await;
            if fate == 0 && i % 5 == 0 {
                assert!(matches!(out, Err(DispatchError::Panicked { .. })));
            } else {
                assert_eq!(out, Ok(i));
            }
        }
    });
    d.shutdown_now();
    rt.block_on(async {
        for (_, (_, h)) in rest {
            // Completed, panicked, or failed by the shutdown: never hangs.
            let _ = h.await;
        }
    });
    let state = d.bucket_state();
    let ceil = state.ceil.expect("capped");
    assert_eq!(
        ceil.wrapping_sub(state.tail),
        1_000_000,
        "seed {seed}: {state:?}"
    );
}

/// `shards(usize::MAX)` is a typed error, not a capacity-overflow panic.
#[test]
fn too_many_shards_is_a_typed_error_and_more_than_the_cores_a_warning() {
    let build = |n: usize| {
        Dispatcher::builder()
            .shards(n)
            .disk(NVME)
            .class(ClassConfig::new("c", 1))
            .build()
    };
    for n in [usize::MAX, DispatcherBuilder::MAX_SHARDS + 1] {
        assert!(matches!(
            build(n),
            Err(BuildError::TooManyShards { shards, max }) if shards == n
                && max == DispatcherBuilder::MAX_SHARDS
        ));
    }
    // More shards than cores: built, with a warning.
    let logs = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || LogSink(sink.clone()))
        .with_ansi(false)
        .finish();
    let cores = std::thread::available_parallelism().unwrap().get();
    let d = tracing::subscriber::with_default(subscriber, || build(cores + 1)).unwrap();
    assert_eq!(d.shards(), cores + 1);
    d.shutdown();
    let logs = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("more dispatcher shards than cores"), "{logs}");
}

struct LogSink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A hang guard for liveness tests: `f` must finish (how fast is not asserted).
fn finishes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what}: still blocked after 60 s"))
}

/// With real threads: a request waiting 1,000 s for its tokens is served once the rate is
/// raised (the raise wakes the shard, which does not sleep out its old deadline).
#[test]
fn set_rate_reaches_a_request_already_waiting() {
    let d = Dispatcher::builder()
        .shards(2)
        .disk(NVME)
        .rate(Rate::new(1, std::time::Duration::from_secs(1000)))
        .limit(2)
        .threshold(1)
        .max_cost(1)
        .class(ClassConfig::new("c", 1))
        .build()
        .unwrap();
    let c = d.class_id("c").unwrap();
    let rt = rt();
    // The first fill (2 tokens) serves one request per shard; the next ones wait.
    for shard in 0..2 {
        let h = d
            .submit_to(shard, c, IoRequest::tokens(1), async {})
            .unwrap();
        rt.block_on(h).unwrap();
    }
    let waiting: Vec<_> = (0..2)
        .map(|shard| {
            d.submit_to(shard, c, IoRequest::tokens(1), async { 7 })
                .unwrap()
        })
        .collect();
    d.set_rate(Rate::per_second(1_000_000)).unwrap();
    let got = finishes("a request after set_rate", move || {
        let rt = crate::rt();
        waiting
            .into_iter()
            .map(|h| rt.block_on(h).unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(got, vec![7, 7]);
    d.shutdown();
}

#[test]
fn runtime_control_errors_are_typed() {
    use iothrottle::ControlError;
    let d = Dispatcher::builder()
        .shards(1)
        .disk(NVME)
        .class(ClassConfig::new("c", 10).with_bandwidth_cap(Rate::per_second(1 << 20)))
        .build()
        .unwrap();
    let c = d.class_id("c").unwrap();
    let other = Dispatcher::builder()
        .shards(1)
        .disk(NVME)
        .class(ClassConfig::new("a", 1))
        .class(ClassConfig::new("b", 1))
        .build()
        .unwrap();
    let b = other.class_id("b").unwrap();
    assert_eq!(
        d.set_shares(b, 1),
        Err(ControlError::UnknownClass {
            class: 1,
            classes: 1
        })
    );
    for bad in [0, 1001] {
        assert!(matches!(
            d.set_shares(c, bad),
            Err(ControlError::SharesOutOfRange { shares, .. }) if shares == bad
        ));
    }
    assert!(matches!(
        d.set_bandwidth_cap(c, Some(Rate::per_second(0))),
        Err(ControlError::Cap(_))
    ));
    // Nothing changed by the refusals; then the changes show in the configuration.
    assert_eq!(d.class_config(c).unwrap().shares(), 10);
    assert_eq!(
        d.class_config(c).unwrap().bandwidth_cap(),
        Some(Rate::per_second(1 << 20))
    );
    d.set_shares(c, 500).unwrap();
    d.set_bandwidth_cap(c, None).unwrap();
    let cfg = d.class_config(c).unwrap();
    assert_eq!((cfg.shares(), cfg.bandwidth_cap()), (500, None));
    d.set_bandwidth_cap(c, Some(Rate::per_second(4 << 20)))
        .unwrap();
    assert_eq!(
        d.class_config(c).unwrap().bandwidth_cap(),
        Some(Rate::per_second(4 << 20))
    );
    // Requests still run after the changes.
    let h = d.submit(c, IoRequest::write(4096), async { 1 }).unwrap();
    assert_eq!(rt().block_on(h), Ok(1));
    assert_eq!(d.stats_blocking().classes[0].shares, 500);
    d.shutdown();
    other.shutdown();
}

/// A future that panics when dropped.
struct PanicOnDrop(u32);

impl std::future::Future for PanicOnDrop {
    type Output = u32;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<u32> {
        std::task::Poll::Ready(self.0)
    }
}

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        panic!("drop of future {}", self.0);
    }
}

/// A cancelled future whose `Drop` panics does not kill its shard thread (later requests there
/// would fail with `ShutDown`), and the shard's classes do not stay "backlogged" (which would
/// freeze the other shards' fairness).
#[test]
fn a_future_whose_drop_panics_does_not_kill_its_shard() {
    let d = Dispatcher::builder()
        .shards(2)
        .disk(NVME)
        .rate(Rate::per_second(1000))
        .limit(100)
        .threshold(1)
        .max_cost(100)
        .class(ClassConfig::new("a", 1))
        .class(ClassConfig::new("b", 1))
        .build()
        .unwrap();
    let (a, b) = (d.class_id("a").unwrap(), d.class_id("b").unwrap());
    // The first request takes the first fill; the next two wait and are cancelled: their
    // futures are dropped by the shard (one queued, one reserved).
    let first = d.submit_to(0, a, IoRequest::tokens(100), async {}).unwrap();
    for i in 0..2 {
        drop(
            d.submit_to(0, a, IoRequest::tokens(50), PanicOnDrop(i))
                .unwrap(),
        );
    }
    // A future that completes, then panics in its drop: the handle hears of it.
    let completed = d
        .submit_to(0, a, IoRequest::tokens(1), PanicOnDrop(9))
        .unwrap();
    let later: Vec<_> = (0..5)
        .flat_map(|i| {
            [
                d.submit_to(0, a, IoRequest::tokens(20), async move { i })
                    .unwrap(),
                d.submit_to(1, b, IoRequest::tokens(20), async move { i })
                    .unwrap(),
            ]
        })
        .collect();
    let (first, completed, later) = finishes("requests after a panicking drop", move || {
        let rt = rt();
        let later: Vec<_> = later.into_iter().map(|h| rt.block_on(h)).collect();
        (rt.block_on(first), rt.block_on(completed), later)
    });
    assert_eq!(first, Ok(()));
    assert!(
        matches!(&completed, Err(DispatchError::Panicked { message }) if message.contains("in drop: drop of future 9")),
        "{completed:?}"
    );
    for (i, r) in later.into_iter().enumerate() {
        assert_eq!(r, Ok((i / 2) as i32), "request {i}");
    }
    assert_eq!(d.panics(), 3);
    d.shutdown();
}

/// A dispatcher whose one running future waits for `rx`, which the test sends only later;
/// the returned receiver hears when the future started.
fn blocked_on(
    rx: tokio::sync::oneshot::Receiver<u32>,
) -> (
    Dispatcher,
    iothrottle::dispatcher::IoHandle<u32>,
    tokio::sync::oneshot::Receiver<()>,
) {
    let d = Dispatcher::builder()
        .shards(1)
        .disk(NVME)
        .class(ClassConfig::new("c", 1))
        .build()
        .unwrap();
    let c = d.class_id("c").unwrap();
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let h = d
        .submit(c, IoRequest::read(1), async move {
            let _ = started_tx.send(());
            rx.await.unwrap_or(0)
        })
        .unwrap();
    (d, h, started)
}

/// Dropping a dispatcher in async code does not block the runtime's thread on a future that
/// needs that thread (a deadlock): drop does not wait there.
#[test]
fn dropping_the_dispatcher_in_async_code_does_not_deadlock() {
    let got = finishes("drop in async code", || {
        rt().block_on(async {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (d, h, started) = blocked_on(rx);
            started.await.unwrap();
            drop(d);
            // The running future finishes in the background once it hears from us.
            tx.send(5).unwrap();
            h.await
        })
    });
    assert_eq!(got, Ok(5));
}

#[test]
fn shutdown_async_waits_without_blocking_the_runtime() {
    let got = finishes("shutdown_async", || {
        rt().block_on(async {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (d, h, started) = blocked_on(rx);
            started.await.unwrap();
            // Sent by a task of this same (single-threaded) runtime while we await shutdown.
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                tx.send(6).unwrap();
            });
            d.shutdown_async().await;
            assert!(matches!(
                d.submit(d.class_id("c").unwrap(), IoRequest::read(1), async { 0 }),
                Err(SubmitError::ShutDown)
            ));
            h.await
        })
    });
    assert_eq!(got, Ok(6));
}

#[test]
fn shutdown_timeout_bounds_the_wait() {
    use iothrottle::ShutdownError;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (d, h, started) = blocked_on(rx);
    rt().block_on(started).unwrap();
    let d = finishes("shutdown_timeout", move || {
        let r = d.shutdown_timeout(std::time::Duration::from_millis(50));
        assert_eq!(r, Err(ShutdownError::TimedOut { running: 1 }));
        d
    });
    tx.send(8).unwrap();
    assert_eq!(rt().block_on(h), Ok(8));
    assert_eq!(
        d.shutdown_timeout(std::time::Duration::from_secs(60)),
        Ok(())
    );
}

/// A builder without a disk model is a typed error: no default disk (an NVMe drive's figures
/// would be about 4× too fast for a virtio disk) is assumed silently.
#[test]
fn build_without_a_disk_model_is_a_typed_error() {
    let mut b = Dispatcher::builder().shards(1);
    b.add_class(ClassConfig::new("c", 1)).unwrap();
    let err = b.build().unwrap_err();
    assert!(matches!(err, BuildError::NoDiskModel), "{err:?}");
    assert!(err.to_string().contains("disk model"), "{err}");
    let mut b = Dispatcher::builder()
        .shards(1)
        .disk(NVME)
        .latency_goal(std::time::Duration::ZERO);
    b.add_class(ClassConfig::new("c", 1)).unwrap();
    assert!(matches!(
        b.build(),
        Err(BuildError::LatencyGoalOutOfRange { .. })
    ));
}

/// At default settings `submit_split` cuts a 1 MiB write into 4 KiB-aligned pieces within the
/// latency goal that add up to the request, and `submit`'s `TooLarge` error says what fits.
#[test]
fn a_one_mib_write_at_default_settings_splits_into_aligned_pieces() {
    // A disk like this project's virtio disk: 1 MiB is ~1.6 ms of disk time, over the goal.
    let disk = DiskModel::new(
        Figures {
            iops: 20_000,
            bandwidth: 400_000_000,
        },
        Figures {
            iops: 20_000,
            bandwidth: 700_000_000,
        },
    );
    let mut b = Dispatcher::builder().disk(disk).shards(2);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    assert_eq!(d.latency_goal(), DispatcherBuilder::DEFAULT_LATENCY_GOAL);
    assert!(d.is_capped());
    let write = IoRequest::write(1 << 20);
    let err = d.submit(c, write, async {}).unwrap_err();
    assert!(err.to_string().contains("submit_split"), "{err}");
    assert!(!err.to_string().contains("Some("), "{err}");
    let h = d
        .submit_split(c, write, |p| async move { p.range })
        .unwrap();
    let ranges = rt().block_on(h).unwrap();
    assert!(ranges.len() >= 2);
    let max = d.max_piece(iothrottle::dispatcher::IoKind::Write).unwrap();
    let mut at = 0;
    for r in &ranges {
        assert_eq!(r.start, at);
        assert_eq!(r.start % 4096, 0, "{r:?}");
        assert!(r.end - r.start <= max);
        assert!(d.cost(&IoRequest::write(r.end - r.start)) <= d.max_cost());
        at = r.end;
    }
    assert_eq!(at, 1 << 20);
    d.shutdown();
    // Everything completed and was released: the capped bucket is whole again.
    let s = d.bucket_state();
    assert_eq!(s.ceil.unwrap().wrapping_sub(s.tail), d.limit());
}

/// Real threads record service time (dispatch → completion) and end-to-end latency
/// (submission → completion) per class, besides the queue wait.
#[test]
fn stats_report_service_time_and_end_to_end_latency() {
    let mut b = Dispatcher::builder().disk(NVME).shards(1);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let rt = rt();
    let nap = std::time::Duration::from_millis(3);
    for _ in 0..5 {
        let h = d
            .submit(c, IoRequest::read(4096), async move {
                tokio::time::sleep(nap).await;
            })
            .unwrap();
        rt.block_on(h).unwrap();
    }
    let s = d.stats_blocking();
    let c = &s.classes[c.index()];
    assert_eq!(
        (c.requests, c.completed, c.in_flight, c.queued),
        (5, 5, 0, 0)
    );
    // A sleep never ends early; the histograms are within 1%.
    let floor = nap.mul_f64(0.99);
    assert!(c.service_p50() >= floor, "{:?}", c.service_p50());
    assert!(c.latency_p50() >= c.service_p50().mul_f64(0.99));
    assert!(c.latency_max() >= c.queue_wait_max());
    d.shutdown();
}

thread_local! {
    /// Set by the start hooks below: the shard index the hook was given on this thread.
    static HOOKED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// A builder of `shards` unpinned shards over the NVMe model (the hook tests).
fn unpinned(shards: usize) -> iothrottle::dispatcher::DispatcherBuilder {
    Dispatcher::builder()
        .disk(NVME)
        .shards(shards)
        .pin_threads(false)
}

#[test]
fn start_hook_runs_once_on_each_shard_thread_before_its_requests() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let mut b = unpinned(3).on_shard_start(move |shard| {
        HOOKED.with(|h| h.set(Some(shard)));
        let name = std::thread::current().name().map(str::to_owned);
        s.lock().unwrap().push((shard, name));
        Ok(())
    });
    let c = b.add_class(ClassConfig::new("c", 1)).unwrap();
    let d = b.build().unwrap();
    // `build` waited for every hook: all three ran, once each, on their own shard's thread.
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let want: Vec<_> = (0..3)
        .map(|i| (i, Some(format!("iothrottle-shard-{i}"))))
        .collect();
    assert_eq!(seen, want);
    let rt = rt();
    for shard in 0..3 {
        let h = d
            .submit_to(shard, c, IoRequest::read(4096), async {
                HOOKED.with(|h| h.get())
            })
            .unwrap();
        assert_eq!(
            rt.block_on(h),
            Ok(Some(shard)),
            "the hook's thread runs shard {shard}"
        );
    }
}

/// Counts the shard threads that ended (a thread-local's destructor runs as its thread ends).
struct Ended(Arc<AtomicU64>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

thread_local! {
    static ENDED: std::cell::RefCell<Option<Ended>> = const { std::cell::RefCell::new(None) };
}

/// A dispatcher of 4 shards whose hook does `fail` on shard 2; returns the build's error and
/// how many hooks ran and how many shard threads had ended once `build` returned.
fn failing_start(fail: fn() -> std::io::Result<()>) -> (BuildError, u64, u64) {
    let (ran, ended) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (r, e) = (ran.clone(), ended.clone());
    let mut b = unpinned(4).on_shard_start(move |shard| {
        r.fetch_add(1, Ordering::SeqCst);
        ENDED.with(|slot| *slot.borrow_mut() = Some(Ended(e.clone())));
        if shard == 2 {
            fail()
        } else {
            Ok(())
        }
    });
    b.add_class(ClassConfig::new("c", 1)).unwrap();
    let err = b.build().expect_err("shard 2's hook fails");
    (
        err,
        ran.load(Ordering::SeqCst),
        ended.load(Ordering::SeqCst),
    )
}

#[test]
fn a_failing_start_hook_fails_the_build_and_stops_the_started_shards() {
    let (err, ran, ended) = failing_start(|| {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "no SCHED_FIFO for you",
        ))
    });
    match &err {
        BuildError::ShardStart { shard: 2, source } => {
            assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
            assert!(source.to_string().contains("no SCHED_FIFO"));
        }
        other => panic!("expected ShardStart for shard 2, got {other:?}"),
    }
    assert!(err.to_string().contains("shard 2"), "{err}");
    // Shard 3 was never started; shards 0–2 ran their hooks and were joined by the drop.
    assert_eq!((ran, ended), (3, 3));
}

#[test]
fn a_panicking_start_hook_is_an_error_not_a_panic() {
    let (err, ran, ended) = failing_start(|| panic!("hook exploded"));
    match &err {
        BuildError::ShardStart { shard: 2, source } => {
            assert!(source.to_string().contains("hook exploded"), "{source}");
        }
        other => panic!("expected ShardStart for shard 2, got {other:?}"),
    }
    assert_eq!((ran, ended), (3, 3));
}

/// Stop hooks: each shard's runs once, on its own thread, after every request it dispatched
/// ended and before `shutdown` returns; none runs while the dispatcher lives.
#[test]
fn stop_hook_runs_once_on_each_shard_thread_after_its_last_request() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Per shard: its request has ended.
    let finished: Arc<Vec<AtomicU64>> = Arc::new((0..3).map(|_| AtomicU64::new(0)).collect());
    let (s, f) = (seen.clone(), finished.clone());
    let mut b = unpinned(3).on_shard_stop(move |shard| {
        let name = std::thread::current().name().map(str::to_owned);
        // Whether this shard's request had ended when its hook ran.
        s.lock()
            .unwrap()
            .push((shard, name, f[shard].load(Ordering::SeqCst)));
    });
    let c = b.add_class(ClassConfig::new("c", 1)).unwrap();
    let d = b.build().unwrap();
    // A slow request on each shard, still running when the shutdown starts.
    let handles: Vec<_> = (0..3)
        .map(|shard| {
            let f = finished.clone();
            d.submit_to(shard, c, IoRequest::read(4096), async move {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                f[shard].store(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    assert!(seen.lock().unwrap().is_empty(), "no hook while running");
    d.shutdown();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(
        seen.len(),
        3,
        "once per shard, all before shutdown returned"
    );
    for (i, (shard, name, done)) in seen.into_iter().enumerate() {
        assert_eq!(shard, i);
        assert_eq!(
            name,
            Some(format!("iothrottle-shard-{i}")),
            "on its own thread"
        );
        assert_eq!(done, 1, "shard {i}'s hook ran before its request ended");
    }
    let rt = rt();
    for h in handles {
        assert_eq!(rt.block_on(h), Ok(()));
    }
}

/// A failed build stops the shards it started: their stop hooks run, the failed shard's and
/// the never-started shard's do not.
#[test]
fn a_failed_build_runs_the_stop_hooks_of_the_started_shards_only() {
    let stopped = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = stopped.clone();
    let mut b = unpinned(4)
        .on_shard_start(|shard| match shard {
            2 => Err(std::io::Error::other("no")),
            _ => Ok(()),
        })
        .on_shard_stop(move |shard| s.lock().unwrap().push(shard));
    b.add_class(ClassConfig::new("c", 1)).unwrap();
    assert!(matches!(
        b.build(),
        Err(BuildError::ShardStart { shard: 2, .. })
    ));
    let mut stopped = stopped.lock().unwrap().clone();
    stopped.sort();
    assert_eq!(stopped, [0, 1]);
}

/// A panicking stop hook is caught on its shard and counted; the other shards' hooks run and
/// the shutdown completes.
#[test]
fn a_panicking_stop_hook_is_counted_not_propagated() {
    let ran = Arc::new(AtomicU64::new(0));
    let r = ran.clone();
    let mut b = unpinned(2).on_shard_stop(move |shard| {
        r.fetch_add(1, Ordering::SeqCst);
        if shard == 0 {
            panic!("stop hook exploded");
        }
    });
    b.add_class(ClassConfig::new("c", 1)).unwrap();
    let d = b.build().unwrap();
    assert_eq!(d.panics(), 0);
    d.shutdown();
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(d.panics(), 1, "the stop hook's panic, caught on its shard");
}

/// The scheduling policy of each shard of `d`, read on the shard.
#[cfg(target_os = "linux")]
fn shard_policies(d: &Dispatcher, c: ClassId) -> Vec<i32> {
    let rt = rt();
    (0..d.shards())
        .map(|shard| {
            let h = d
                .submit_to(shard, c, IoRequest::read(4096), async {
                    // SAFETY: no arguments but the calling thread (0).
                    unsafe { libc::sched_getscheduler(0) }
                })
                .unwrap();
            rt.block_on(h).unwrap()
        })
        .collect()
}

#[cfg(target_os = "linux")]
#[test]
fn start_hook_sets_the_shards_scheduling_policy() {
    // SAFETY: no arguments but the calling thread (0).
    let own = unsafe { libc::sched_getscheduler(0) };
    // Control: without the hook the shards inherit the builder's policy, so the check below
    // sees the hook's work, not an inherited `SCHED_BATCH`.
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(2)
        .pin_threads(false);
    let c = b.add_class(ClassConfig::new("c", 1)).unwrap();
    let plain = b.build().unwrap();
    assert_eq!(shard_policies(&plain, c), vec![own, own]);
    assert_ne!(
        own,
        libc::SCHED_BATCH,
        "the test thread must not already be SCHED_BATCH"
    );

    let mut b = unpinned(2).on_shard_start(|_| {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: the calling thread's policy, from a live `sched_param`.
        match unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    });
    let c = b.add_class(ClassConfig::new("c", 1)).unwrap();
    let d = b.build().unwrap();
    assert_eq!(shard_policies(&d, c), vec![libc::SCHED_BATCH; 2]);
    // The builder's thread keeps its own policy.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::sched_getscheduler(0) }, own);
}

// ---- the engine's own tasks on the shards -------------------------------------------------------

fn two_shards() -> (Arc<Dispatcher>, ClassId) {
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(2)
        .pin_threads(false);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    (Arc::new(b.build().unwrap()), c)
}

#[test]
fn each_shard_runs_on_the_cpu_it_names_and_shards_on_finds_it() {
    let Some(cores) = core_affinity::get_core_ids().filter(|c| !c.is_empty()) else {
        eprintln!("SKIPPED: cannot list the cores on this machine");
        return;
    };
    let shards = cores.len() + 1; // one more than the cores: the last one wraps
    let d = Dispatcher::builder()
        .disk(NVME)
        .shards(shards)
        .class(ClassConfig::new("c", 100))
        .build()
        .unwrap();
    let rt = rt();
    for s in 0..shards {
        let want = cores[s % cores.len()].id;
        assert_eq!(d.shard_cpu(s), Some(want), "shard {s}");
        // SAFETY: sched_getcpu takes no arguments and reads no memory of ours.
        let task = d
            .spawn_on(s, || async { unsafe { libc::sched_getcpu() } })
            .unwrap();
        let ran_on = rt.block_on(task).unwrap();
        assert_eq!(ran_on, want as i32, "shard {s} runs where it says");
        assert!(d.shards_on(&[want]).contains(&s));
    }
    assert_eq!(d.shard_cpu(shards), None, "no such shard");
    let all: Vec<usize> = cores.iter().map(|c| c.id).collect();
    assert_eq!(d.shards_on(&all), (0..shards).collect::<Vec<_>>());
    assert!(d.shards_on(&[usize::MAX]).is_empty());
    d.shutdown();
    let (unpinned, _) = two_shards();
    assert_eq!((unpinned.shard_cpu(0), unpinned.shard_cpu(1)), (None, None));
    assert!(
        unpinned.shards_on(&all).is_empty(),
        "unpinned shards are on no CPU"
    );
    unpinned.shutdown();
}

#[test]
fn a_not_send_task_runs_on_the_shard_it_was_spawned_on_and_costs_no_tokens() {
    use std::cell::Cell;
    use std::rc::Rc;

    let (d, _) = two_shards();
    let rt = rt();
    let h = d
        .spawn_on(1, || {
            // Made on the shard: an `Rc` held across an await (a `!Send` future).
            let here = Rc::new(Cell::new(0));
            async move {
                here.set(1);
                tokio::task::yield_now().await;
                let shard = current_shard().expect("runs on a shard");
                // A `!Send` output from a task spawned locally.
                let local = shard.spawn_local(async { Rc::new(41) }).unwrap();
                let got = *local.await.unwrap() + here.get();
                (
                    shard.index(),
                    got,
                    std::thread::current().name().map(str::to_owned),
                )
            }
        })
        .unwrap();
    let (index, got, name) = rt.block_on(h).unwrap();
    assert_eq!((index, got), (1, 42));
    assert_eq!(name.as_deref(), Some("iothrottle-shard-1"));
    assert!(current_shard().is_none(), "not a shard here");
    let stats = d.stats_blocking();
    assert_eq!(stats.classes[0].requests, 0);
    assert_eq!(stats.classes[0].tokens, 0, "a task is not charged tokens");
    assert!(matches!(
        d.spawn_on(2, || async {}),
        Err(SpawnError::UnknownShard {
            shard: 2,
            shards: 2
        })
    ));
    d.shutdown();
}

#[test]
fn panics_in_spawned_tasks_are_caught_counted_and_the_shard_keeps_running() {
    let (d, _) = two_shards();
    let rt = rt();
    let h = d
        .spawn_on(0, || async {
            tokio::task::yield_now().await;
            panic!("boom in the task")
        })
        .unwrap();
    match rt.block_on(h) {
        Err(JoinError::Panicked { message }) => assert_eq!(message, "boom in the task"),
        other => panic!("expected a panic, got {other:?}"),
    }
    assert_eq!(d.panics(), 1);
    // The closure that makes the future panics, on the shard.
    let h = d
        .spawn_on(0, || -> std::future::Ready<()> { panic!("boom making it") })
        .unwrap();
    assert_eq!(
        rt.block_on(h),
        Err(JoinError::Panicked {
            message: "boom making it".to_owned()
        })
    );
    assert_eq!(d.panics(), 2);
    // The shard still runs tasks.
    assert_eq!(rt.block_on(d.spawn_on(0, || async { 7 }).unwrap()), Ok(7));
    d.shutdown();
}

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn shutdown_cancels_running_spawned_tasks_and_takes_no_new_ones() {
    for now in [false, true] {
        let (d, _) = two_shards();
        let rt = rt();
        let dropped = Arc::new(AtomicBool::new(false));
        let (started_tx, started) = std::sync::mpsc::channel();
        let flag = DropFlag(dropped.clone());
        // A task that never ends on its own (a server loop).
        let h = d
            .spawn_on(1, move || async move {
                let _flag = flag;
                started_tx.send(()).unwrap();
                std::future::pending::<()>().await
            })
            .unwrap();
        started.recv().unwrap();
        if now {
            d.shutdown_now();
        } else {
            d.shutdown();
        }
        // `shutdown` returned: the task was dropped, its handle says so.
        assert!(dropped.load(Ordering::SeqCst), "the task was not dropped");
        assert_eq!(rt.block_on(h), Err(JoinError::Cancelled));
        assert!(matches!(
            d.spawn_on(0, || async {}),
            Err(SpawnError::ShutDown)
        ));
        assert!(matches!(d.spawn(|| async {}), Err(SpawnError::ShutDown)));
    }
}

#[test]
fn io_submitted_from_a_shard_task_is_dispatched_on_that_shard() {
    let (d, c) = two_shards();
    let rt = rt();
    let d2 = d.clone();
    let h = d
        .spawn_on(1, move || async move {
            let task = std::thread::current().id();
            let shard = current_shard().unwrap();
            let local = shard
                .submit(c, IoRequest::read(4096), async {
                    std::thread::current().id()
                })
                .unwrap();
            // The dispatcher's own `submit` from a shard stays there too.
            let via = d2
                .submit(c, IoRequest::read(4096), async {
                    std::thread::current().id()
                })
                .unwrap();
            (task, local.await.unwrap(), via.await.unwrap())
        })
        .unwrap();
    let (task, local, via) = rt.block_on(h).unwrap();
    assert_ne!(task, std::thread::current().id());
    assert_eq!(local, task, "dispatched on another thread");
    assert_eq!(via, task, "dispatched on another thread");
    let stats = d.stats_blocking();
    assert_eq!(stats.shards[1].classes[0].requests, 2);
    assert_eq!(stats.shards[0].classes[0].requests, 0);
    d.shutdown();
}

#[test]
fn spawn_picks_the_shard_with_the_fewest_running_tasks() {
    let (d, _) = two_shards();
    let rt = rt();
    let (release_tx, release) = tokio::sync::oneshot::channel::<()>();
    let (where_tx, where_rx) = std::sync::mpsc::channel();
    let first = d
        .spawn(|| async move {
            where_tx.send(current_shard().unwrap().index()).unwrap();
            let _ = release.await;
        })
        .unwrap();
    let busy = where_rx.recv().unwrap();
    // The first runs until released: every next one goes to the other shard, whatever the
    // round-robin position says.
    for _ in 0..4 {
        let next = d
            .spawn(|| async { current_shard().unwrap().index() })
            .unwrap();
        assert_eq!(rt.block_on(next), Ok(1 - busy));
    }
    release_tx.send(()).unwrap();
    assert_eq!(rt.block_on(first), Ok(()));
    // Both idle now: the round-robin spreads them.
    let spread: std::collections::HashSet<usize> = (0..2)
        .map(|_| {
            d.spawn(|| async { current_shard().unwrap().index() })
                .unwrap()
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| rt.block_on(h).unwrap())
        .collect();
    assert_eq!(spread.len(), 2);
    d.shutdown();
}

/// The stats count the tasks handed to each shard and those still running.
#[test]
fn stats_count_the_spawned_tasks_and_those_running() {
    let (d, _) = two_shards();
    let rt = rt();
    let (release_tx, release) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started) = std::sync::mpsc::channel();
    let long = d
        .spawn_on(0, || async move {
            started_tx.send(()).unwrap();
            let _ = release.await;
        })
        .unwrap();
    started.recv().unwrap();
    for shard in [0, 1, 1] {
        let h = d.spawn_on(shard, || async { 7 }).unwrap();
        assert_eq!(rt.block_on(h), Ok(7));
    }
    let s = d.stats_blocking();
    assert_eq!(
        [s.shards[0].tasks_spawned, s.shards[1].tasks_spawned],
        [2, 2]
    );
    assert_eq!(
        [s.shards[0].tasks_running, s.shards[1].tasks_running],
        [1, 0]
    );
    assert_eq!((s.tasks_spawned(), s.tasks_running()), (4, 1));
    release_tx.send(()).unwrap();
    assert_eq!(rt.block_on(long), Ok(()));
    let later = d.stats_blocking();
    assert_eq!((later.tasks_spawned(), later.tasks_running()), (4, 0));
    assert_eq!(later.since(&s).tasks_spawned(), 0, "none since");
    d.shutdown();
    assert_eq!(d.stats_blocking().tasks_spawned(), 4, "kept after shutdown");
}

/// A split request whose size asks for more pieces than one request may have is a typed error
/// at once: nothing is allocated for it (a `u64::MAX` write would be ~10^14 pieces).
#[test]
fn submit_split_of_an_absurd_size_is_a_typed_error_not_an_allocation() {
    let mut b = Dispatcher::builder().disk(NVME).shards(1);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let mut made = 0u64;
    let err = d
        .submit_split(c, IoRequest::write(u64::MAX), |_| {
            made += 1;
            async {}
        })
        .unwrap_err();
    let max = d.max_piece(iothrottle::dispatcher::IoKind::Write).unwrap();
    assert_eq!(
        err,
        SubmitError::TooManyPieces {
            pieces: u64::MAX.div_ceil(max),
            max_pieces: iothrottle::dispatcher::MAX_SPLIT_PIECES,
            max_bytes: max * iothrottle::dispatcher::MAX_SPLIT_PIECES,
        }
    );
    assert_eq!(made, 0, "no piece was made");
    // One byte over the most pieces: refused too (the boundary itself is a unit test of
    // `split`).
    let over = max * iothrottle::dispatcher::MAX_SPLIT_PIECES + 1;
    assert!(matches!(
        d.submit_split(c, IoRequest::write(over), |_| async {}),
        Err(SubmitError::TooManyPieces { .. })
    ));
    d.shutdown();
}

// ---- dispatch from the caller's thread ----------------------------------------------------------

#[test]
fn a_request_that_can_go_at_once_runs_on_its_callers_thread_and_is_counted() {
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(2)
        .pin_threads(false)
        .caller_dispatch(true);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let rt = rt();
    let me = std::thread::current().id();
    let h = d
        .submit_to(1, c, IoRequest::read(4096), async {
            std::thread::current().id()
        })
        .unwrap();
    assert_eq!(rt.block_on(h), Ok(me), "a hop to a shard");
    let stats = d.stats_blocking();
    assert_eq!(stats.shards[1].classes[0].requests, 1);
    assert_eq!(stats.shards[1].classes[0].completed, 1);
    assert_eq!(
        stats.classes[0].tokens,
        d.cost(&IoRequest::read(4096)),
        "charged as a shard's request"
    );
    d.shutdown();
    // Off (the default): the shard runs it.
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(1)
        .pin_threads(false);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let h = d
        .submit(c, IoRequest::read(4096), async {
            std::thread::current().name().map(str::to_owned)
        })
        .unwrap();
    assert_eq!(
        rt.block_on(h).unwrap().as_deref(),
        Some("iothrottle-shard-0")
    );
    d.shutdown();
}

#[test]
fn a_request_from_its_caller_whose_handle_is_dropped_still_runs_to_its_end() {
    let mut b = Dispatcher::builder()
        .disk(NVME)
        .shards(1)
        .pin_threads(false)
        .caller_dispatch(true);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let d = b.build().unwrap();
    let (ran_tx, ran) = std::sync::mpsc::channel();
    let h = d
        .submit(c, IoRequest::read(4096), async move {
            tokio::task::yield_now().await;
            ran_tx
                .send(std::thread::current().name().map(str::to_owned))
                .unwrap();
        })
        .unwrap();
    drop(h);
    // It was dispatched (its tokens were taken): the shard runs it to its end.
    assert_eq!(ran.recv().unwrap().as_deref(), Some("iothrottle-shard-0"));
    d.shutdown();
    assert_eq!(d.stats_blocking().classes[0].completed, 1);
    assert_eq!(
        d.bucket_state().tokens(),
        d.limit() as i64,
        "every token back"
    );
}
