//! The dispatcher: per-request overhead against a bare `tokio::spawn`, queue depth 1 on one
//! and two shards, and the fairness figures (printed as `FIGURE ...` lines).
//!
//! ```text
//! cargo bench --bench benches -- dispatcher
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures, IoRequest};
use iothrottle::Rate;

/// Requests in flight while measuring overhead (both sides submit this many, then await them).
const WINDOW: u64 = 256;

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A dispatcher that never throttles: the rate is the largest the bucket takes.
fn unthrottled(shards: usize) -> (Dispatcher, ClassId) {
    let d = Dispatcher::builder()
        .shards(shards)
        .disk(DiskModel::new(
            Figures {
                iops: 400_000,
                bandwidth: 2_000_000_000,
            },
            Figures {
                iops: 100_000,
                bandwidth: 1_000_000_000,
            },
        ))
        .capped(false)
        .rate(Rate::per_second(Rate::MAX_PER_SECOND))
        .limit(1 << 50)
        .threshold(1 << 20)
        .batch(1 << 30)
        .pin_threads(false)
        .class(ClassConfig::new("c", 100))
        .build()
        .unwrap();
    let c = d.class_id("c").unwrap();
    (d, c)
}

/// Overhead per request: submit from this thread, run on another, await the result.
fn overhead(c: &mut Criterion) {
    let mut g = c.benchmark_group("dispatcher/overhead");
    let rt = current_thread();

    let (d, class) = unthrottled(1);
    g.bench_function("dispatcher_submit", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            rt.block_on(async {
                let mut left = iters;
                let mut handles = Vec::with_capacity(WINDOW as usize);
                while left > 0 {
                    let n = left.min(WINDOW);
                    for i in 0..n {
                        handles.push(
                            d.submit(class, IoRequest::tokens(1), async move { black_box(i) })
                                .unwrap(),
                        );
                    }
                    for h in handles.drain(..) {
                        black_box(h.await.unwrap());
                    }
                    left -= n;
                }
            });
            start.elapsed()
        })
    });
    d.shutdown();

    // The same shape on a bare tokio runtime with one worker thread.
    let pool = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let handle = pool.handle().clone();
    g.bench_function("tokio_spawn", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            rt.block_on(async {
                let mut left = iters;
                let mut handles = Vec::with_capacity(WINDOW as usize);
                while left > 0 {
                    let n = left.min(WINDOW);
                    for i in 0..n {
                        handles.push(handle.spawn(async move { black_box(i) }));
                    }
                    for h in handles.drain(..) {
                        black_box(h.await.unwrap());
                    }
                    left -= n;
                }
            });
            start.elapsed()
        })
    });
    g.finish();
}

/// Queue depth 1 per shard on a throttled dispatcher (1 µs of disk time per request, a 1 ms
/// limit): the time per completed request, all shards together. As in a thread-per-core
/// engine, each shard's load comes from a future running on that shard, which submits one read
/// at a time and waits for it. Full-limit reservations (the 17× collapse of seastar issue
/// #3201) would cap the total at 1,000 requests per second; the target is two shards doing at
/// least 80% of one shard's IOPS.
fn queue_depth_one(c: &mut Criterion) {
    let mut g = c.benchmark_group("dispatcher/qd1");
    let rt = current_thread();
    for shards in [1usize, 2] {
        let b = Dispatcher::builder()
            .shards(shards)
            .disk(DiskModel::symmetric(Figures {
                iops: 1_000_000,
                bandwidth: u64::MAX / 4,
            }))
            .capped(false)
            .limit(1_000_000)
            .class(ClassConfig::new("c", 100));
        let d = Arc::new(b.build().unwrap());
        let class = d.class_id("c").unwrap();
        g.bench_with_input(BenchmarkId::new("shards", shards), &shards, |b, &shards| {
            b.iter_custom(|iters| {
                let per = iters.div_ceil(shards as u64);
                let start = Instant::now();
                let drivers: Vec<_> = (0..shards)
                    .map(|shard| {
                        let inner = d.clone();
                        d.submit_to(shard, class, IoRequest::tokens(1), async move {
                            for i in 0..per {
                                let h =
                                    inner
                                        .submit(class, IoRequest::read(4096), async move {
                                            black_box(i)
                                        })
                                        .unwrap();
                                black_box(h.await.unwrap());
                            }
                        })
                        .unwrap()
                    })
                    .collect();
                rt.block_on(async {
                    for h in drivers {
                        h.await.unwrap();
                    }
                });
                // Time per request, all shards together.
                start
                    .elapsed()
                    .mul_f64(iters as f64 / (per * shards as u64) as f64)
            })
        });
        d.shutdown();
    }
    g.finish();
}

/// Runs saturating feeds (shard, class, request, depth) on real threads until the first feed
/// completes `target` requests after a warm-up of `target / 4`; returns the tokens per feed
/// dispatched in between (per class, or per shard when `by_shard`).
fn shares_of(
    d: &Arc<Dispatcher>,
    feeds: &[(usize, ClassId, IoRequest)],
    target: u64,
    by_shard: bool,
) -> Vec<u64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Vec<_> = feeds.iter().map(|_| Arc::new(AtomicU64::new(0))).collect();
    let stats = rt.block_on(async {
        for (f, &(shard, class, req)) in feeds.iter().enumerate() {
            for _ in 0..256 {
                let (d, stop, count) = (d.clone(), stop.clone(), counts[f].clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(h) = d.submit_to(shard, class, req, async {}) else {
                            return;
                        };
                        if h.await.is_err() {
                            return;
                        }
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        }
        let max = || {
            counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .max()
                .unwrap()
        };
        while max() < target / 4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let first = d.stats().await;
        while max() < target {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let last = d.stats().await;
        stop.store(true, Ordering::Relaxed);
        last.since(&first)
    });
    d.shutdown_now();
    if by_shard {
        stats.shards.iter().map(|s| s.tokens()).collect()
    } else {
        stats.classes.iter().map(|c| c.tokens).collect()
    }
}

/// The fairness figures. Each "iteration" is one whole scenario; the time is not the point:
/// the shares are printed as `FIGURE` lines.
fn fairness(c: &mut Criterion) {
    let mut g = c.benchmark_group("dispatcher/fairness");
    g.sample_size(10);
    let builder = |shards| {
        Dispatcher::builder()
            .shards(shards)
            .disk(DiskModel::symmetric(Figures {
                iops: 10_000,
                bandwidth: 100_000_000,
            }))
            .capped(false)
            .limit(25_000_000)
            .batch(500_000)
    };
    let r4k = IoRequest::read(4096);
    type Scenario = (&'static str, fn(&[u64]) -> f64, &'static str);
    let scenarios: [Scenario; 3] = [
        (
            "4to1_one_shard",
            |t| t[0] as f64 / t[1] as f64,
            "ratio (target 4 ±5%)",
        ),
        (
            "5to1_two_shards",
            |t| t[0] as f64 / t[1] as f64,
            "ratio (target 5 ±10%; Seastar: 1)",
        ),
        (
            "4k_vs_1m_shards",
            |t| t[0] as f64 / (t[0] + t[1]) as f64,
            "4 KiB shard's share of tokens (target 0.5 ±10%)",
        ),
    ];
    for (i, (name, figure, what)) in scenarios.into_iter().enumerate() {
        let mut seen = Vec::new();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let (shards, shares) = match i {
                        0 => (1, (800, 200)),
                        1 => (2, (500, 100)),
                        _ => (2, (100, 100)),
                    };
                    let d = builder(shards)
                        .class(ClassConfig::new("x", shares.0))
                        .class(ClassConfig::new("y", shares.1))
                        .build()
                        .unwrap();
                    let d = Arc::new(d);
                    let (x, y) = (d.class_id("x").unwrap(), d.class_id("y").unwrap());
                    let t = match i {
                        0 => shares_of(&d, &[(0, x, r4k), (0, y, r4k)], 2000, false),
                        1 => shares_of(&d, &[(0, x, r4k), (1, y, r4k)], 2000, false),
                        _ => shares_of(
                            &d,
                            &[(0, x, r4k), (1, x, IoRequest::read(1 << 20))],
                            2000,
                            true,
                        ),
                    };
                    let _ = y;
                    seen.push(figure(&t));
                }
                start.elapsed()
            })
        });
        if !seen.is_empty() {
            let mean = seen.iter().sum::<f64>() / seen.len() as f64;
            let (lo, hi) = seen
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            println!(
                "FIGURE dispatcher/fairness/{name}: {what}: mean {mean:.3}, min {lo:.3}, max {hi:.3} over {} runs",
                seen.len()
            );
        }
    }
    g.finish();
}

criterion::criterion_group!(benches, overhead, queue_depth_one, fairness);
