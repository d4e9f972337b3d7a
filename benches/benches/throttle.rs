//! Async acquire: `Throttle` against leaky-bucket's `RateLimiter` and a tokio-`Semaphore`
//! throttle (a semaphore refilled by a timer task), in one group.
//!
//! - `uncontended/*`: one task, a rate that never runs out: the cost of an acquire that does not
//!   wait (ours: one `fetch_add` and one load).
//! - `waiters/*`: 16 tasks each acquiring 1 token in a loop at 1,000 tokens/s, burst 16, on a
//!   current-thread runtime with tokio's paused time: every acquire waits in line, and the
//!   virtual clock jumps over the waits. The time per grant is the CPU cost of the whole waiting
//!   path (claim, timer, wake-up, replenish), with no real time waited.
//!
//! - `cancel/N`: `N` claims queued behind one waiter that is never served, then all cancelled
//!   (dropped): each give-back is deferred (head has not reached it). The time per
//!   cancellation, with up to `N` give-backs already deferred (each in O(log N)).
//!
//! The accuracy figure (grants achieved in real time) is `examples/throttle_accuracy.rs`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use iothrottle::throttle::Throttle;
use iothrottle::{BucketConfig, Capped, Mode, Rate, SharedTokenBucket, TokioClock, Uncapped};
use tokio::sync::Semaphore;

const BIG: u64 = 1 << 40;

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn ours_uncontended<M: Mode>(iters: u64) -> Duration {
    let rt = current_thread();
    rt.block_on(async {
        let th: Throttle<M> = Throttle::from_bucket(Arc::new(
            SharedTokenBucket::new(BucketConfig::new(Rate::per_second(1_000_000_000), BIG))
                .unwrap(),
        ));
        let start = Instant::now();
        for _ in 0..iters {
            drop(black_box(th.acquire(black_box(1)).await.unwrap()));
        }
        start.elapsed()
    })
}

fn leaky_uncontended(iters: u64) -> Duration {
    let rt = current_thread();
    rt.block_on(async {
        let limiter = leaky_bucket::RateLimiter::builder()
            .max(BIG as usize)
            .initial(BIG as usize)
            .refill(BIG as usize)
            .interval(Duration::from_millis(1))
            .build();
        let start = Instant::now();
        for _ in 0..iters {
            limiter.acquire(black_box(1)).await;
        }
        start.elapsed()
    })
}

fn semaphore_uncontended(iters: u64) -> Duration {
    let rt = current_thread();
    rt.block_on(async {
        let sem = Semaphore::new(BIG as usize);
        let start = Instant::now();
        for _ in 0..iters {
            sem.acquire_many(black_box(1)).await.unwrap().forget();
        }
        start.elapsed()
    })
}

const TASKS: u64 = 16;

/// Runs `TASKS` tasks (each made by `make`, which splits the grants) of 1 token on a paused current-thread runtime.
fn waiters<F, Fut>(make: F) -> Duration
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let rt = paused();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..TASKS {
            tasks.push(tokio::task::spawn_local(make()));
        }
        for t in tasks {
            t.await.unwrap();
        }
        start.elapsed()
    })
}

fn ours_waiters<M: Mode>(iters: u64) -> Duration {
    let per_task = iters.div_ceil(TASKS);
    let th = std::cell::OnceCell::new();
    let make = || {
        let th: &Throttle<M, TokioClock> = th.get_or_init(|| {
            Throttle::with_clock(
                BucketConfig::new(Rate::per_second(1_000), TASKS),
                TokioClock::new(),
            )
            .unwrap()
        });
        let th = th.clone();
        async move {
            for _ in 0..per_task {
                drop(black_box(th.acquire(1).await.unwrap()));
            }
        }
    };
    waiters(make)
}

fn leaky_waiters(iters: u64) -> Duration {
    let per_task = iters.div_ceil(TASKS);
    let limiter = std::cell::OnceCell::new();
    let make = || {
        let limiter: &Arc<leaky_bucket::RateLimiter> = limiter.get_or_init(|| {
            Arc::new(
                leaky_bucket::RateLimiter::builder()
                    .max(TASKS as usize)
                    .initial(TASKS as usize)
                    .refill(1)
                    .interval(Duration::from_millis(1))
                    .fair(true)
                    .build(),
            )
        });
        let limiter = limiter.clone();
        async move {
            for _ in 0..per_task {
                limiter.acquire(1).await;
            }
        }
    };
    waiters(make)
}

fn semaphore_waiters(iters: u64) -> Duration {
    let per_task = iters.div_ceil(TASKS);
    let sem = std::cell::OnceCell::new();
    let make = || {
        let sem: &Arc<Semaphore> = sem.get_or_init(|| {
            let sem = Arc::new(Semaphore::new(TASKS as usize));
            // The refill task: one permit per ms, capped at the burst.
            let refill = Arc::downgrade(&sem);
            tokio::task::spawn_local(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                while let Some(sem) = refill.upgrade() {
                    if sem.available_permits() < TASKS as usize {
                        sem.add_permits(1);
                    }
                    drop(sem);
                    tick.tick().await;
                }
            });
            sem
        });
        let sem = sem.clone();
        async move {
            for _ in 0..per_task {
                sem.acquire().await.unwrap().forget();
            }
        }
    };
    waiters(make)
}

fn bench_throttle(c: &mut Criterion) {
    let mut g = c.benchmark_group("throttle");
    g.bench_function("uncontended/iothrottle", |b| {
        b.iter_custom(ours_uncontended::<Uncapped>)
    });
    g.bench_function("uncontended/iothrottle_capped", |b| {
        b.iter_custom(ours_uncontended::<Capped>)
    });
    g.bench_function("uncontended/leaky_bucket", |b| {
        b.iter_custom(leaky_uncontended)
    });
    g.bench_function("uncontended/semaphore", |b| {
        b.iter_custom(semaphore_uncontended)
    });
    g.bench_function("waiters/iothrottle", |b| {
        b.iter_custom(ours_waiters::<Uncapped>)
    });
    g.bench_function("waiters/iothrottle_capped", |b| {
        b.iter_custom(ours_waiters::<Capped>)
    });
    g.bench_function("waiters/leaky_bucket", |b| b.iter_custom(leaky_waiters));
    g.bench_function("waiters/semaphore", |b| b.iter_custom(semaphore_waiters));
    g.finish();
}

/// Queues `n` claims of 1 token behind a waiter that is never served (1 token per hour),
/// cancels them all in order, and returns the time the `n` cancellations took.
fn cancel_batch(n: u64) -> Duration {
    use std::future::Future;
    use std::task::{Context, Waker};
    let rt = current_thread();
    rt.block_on(async {
        let th: Throttle = Throttle::from_bucket(Arc::new(
            SharedTokenBucket::new(BucketConfig::new(
                Rate::new(1, Duration::from_secs(3600)),
                1,
            ))
            .unwrap(),
        ));
        let mut cx = Context::from_waker(Waker::noop());
        let first = th.acquire(1).await.unwrap(); // the whole bucket
        let mut front = Box::pin(th.acquire(1));
        assert!(front.as_mut().poll(&mut cx).is_pending());
        let mut queued = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let mut f = Box::pin(th.acquire(1));
            assert!(f.as_mut().poll(&mut cx).is_pending());
            queued.push(f);
        }
        let start = Instant::now();
        for f in queued {
            drop(black_box(f));
        }
        let elapsed = start.elapsed();
        drop((front, first));
        elapsed
    })
}

fn bench_cancel(c: &mut Criterion) {
    let mut g = c.benchmark_group("throttle_cancel");
    g.sample_size(10);
    for n in [2_000u64, 14_000, 100_000] {
        g.bench_function(format!("cancel/{n}"), |b| {
            b.iter_custom(|iters| {
                // Whole batches of `n`; the time is scaled to `iters` cancellations.
                let mut done = 0u64;
                let mut total = Duration::ZERO;
                while done < iters {
                    total += cancel_batch(n);
                    done += n;
                }
                total.mul_f64(iters as f64 / done as f64)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_throttle, bench_cancel);
