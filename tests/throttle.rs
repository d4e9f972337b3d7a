#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! Integration tests of `Throttle`, on tokio's paused time (`TokioClock`) or a `ManualClock`:
//! no test sleeps in real time, every duration below is virtual and exact.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use iothrottle::throttle::{Permit, Throttle};
use iothrottle::{
    AcquireError, BucketConfig, Capped, Clock, ManualClock, Mode, Rate, TokioClock,
    TryAcquireError, Uncapped,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use common::polls::count_polls;

const MS: Duration = Duration::from_millis(1);

fn throttle<M: Mode>(rate: Rate, limit: u64, threshold: u64) -> Throttle<M, TokioClock> {
    let cfg = BucketConfig::new(rate, limit).with_threshold(threshold);
    Throttle::with_clock(cfg, TokioClock::new()).unwrap()
}

/// Empties the (fresh) bucket: the first acquire fills it to the limit and takes it all.
async fn drain<M: Mode>(th: &Throttle<M, TokioClock>) {
    let limit = th.bucket().limit();
    let permit = th.acquire(limit).await.unwrap();
    assert_eq!(permit.tokens(), limit);
    permit.complete();
}

type Granted<M> = Result<(Duration, Permit<M, TokioClock>), AcquireError>;

/// Spawns `acquire(cost)` and returns once it has taken its place in line (its grab is on the
/// bucket), so that spawn order is grab order. The task returns when it was granted.
async fn spawn_acquire<M: Mode>(
    th: &Throttle<M, TokioClock>,
    cost: u64,
    start: Instant,
) -> JoinHandle<Granted<M>> {
    let before = th.bucket().snapshot().tail;
    let t = th.clone();
    let handle = tokio::spawn(async move {
        let permit = t.acquire(cost).await?;
        Ok((start.elapsed(), permit))
    });
    while th.bucket().snapshot().tail == before {
        tokio::task::yield_now().await;
    }
    handle
}

#[tokio::test(start_paused = true)]
async fn first_acquire_fills_then_waits_exactly_for_the_rate() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 100, 1);
    let start = Instant::now();
    let _full = th.acquire(100).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let _more = th.acquire(50).await.unwrap();
    assert_eq!(start.elapsed(), 50 * MS);
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_grab_order_each_when_its_tokens_arrive() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 10, 1);
    let start = Instant::now();
    drain(&th).await;
    // Big and small claims mixed: a big one in front is never overtaken by small ones behind.
    let costs = [10, 1, 1, 7, 1, 10, 2, 1, 1, 10, 3, 1];
    let mut handles = Vec::new();
    for &cost in &costs {
        handles.push(spawn_acquire(&th, cost, start).await);
    }
    let mut cumulative = 0;
    let mut previous = Duration::ZERO;
    for (handle, &cost) in handles.into_iter().zip(&costs) {
        cumulative += cost;
        let (at, permit) = handle.await.unwrap().unwrap();
        assert_eq!(permit.tokens(), cost);
        // 1 token per ms after the drained bucket: granted exactly when its tokens arrived.
        assert_eq!(
            at,
            Duration::from_millis(cumulative),
            "claim ending at token {cumulative}"
        );
        assert!(at >= previous, "FIFO");
        previous = at;
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_sleeps_without_polling() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 1_000, 1);
    drain(&th).await;
    let start = Instant::now();
    // One second of waiting: a spinning waiter would be polled thousands of times.
    let (fut, polls) = count_polls(th.acquire(1_000));
    let _permit = fut.await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert!(
        polls.load(Ordering::Relaxed) <= 3,
        "polled {} times",
        polls.load(Ordering::Relaxed)
    );

    // Fifty waiters queued: each is polled a bounded number of times, not once per token.
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut counters = Vec::new();
    for _ in 0..50 {
        let (fut, polls) = count_polls({
            let th = th.clone();
            async move { th.acquire(20).await.map(|p| p.tokens()) }
        });
        counters.push(polls);
        tasks.push(tokio::spawn(fut));
        tokio::task::yield_now().await;
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), Ok(20));
    }
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let total: u64 = counters.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    assert!(total <= 3 * 50, "50 waiters polled {total} times in all");
}

/// A waiter whose timer fires late (the runtime was busy) replenishes as of when its tokens
/// were due, so a burst-1 bucket does not overflow while the waiter was late.
#[tokio::test(start_paused = true)]
async fn a_late_timer_loses_no_tokens() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 1, 1);
    let start = Instant::now();
    drain(&th).await;
    let client = {
        let th = th.clone();
        tokio::spawn(async move {
            for _ in 0..10 {
                th.acquire(1).await.unwrap().complete();
            }
            start.elapsed()
        })
    };
    while th.bucket().snapshot().tail != 2 {
        tokio::task::yield_now().await;
    }
    // The client's timer was due at 1 ms; it runs at 3 ms: 2 ms late, with room for 2 tokens.
    tokio::time::advance(3 * MS).await;
    // 10 tokens at 1 per ms: as if the timer had been on time.
    assert_eq!(client.await.unwrap(), 10 * MS);
}

#[tokio::test(start_paused = true)]
async fn fewer_than_threshold_tokens_never_appear() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 100, 10);
    drain(&th).await;
    let start = Instant::now();
    let _one = th.acquire(1).await.unwrap();
    assert_eq!(
        start.elapsed(),
        10 * MS,
        "woken when 10 tokens (the threshold) accrued"
    );
    let _nine = th.acquire(9).await.unwrap();
    assert_eq!(
        start.elapsed(),
        10 * MS,
        "the other 9 of that replenish are there"
    );
}

#[tokio::test(start_paused = true)]
async fn cancelled_waiter_gives_its_tokens_back() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 100, 1);
    drain(&th).await;
    let start = Instant::now();
    let cancelled = tokio::time::timeout(10 * MS, th.acquire(50)).await;
    assert!(cancelled.is_err(), "timed out");
    // As if the cancelled claim had never been made: the 10 tokens of the last 10 ms are there.
    let _p = th.acquire(10).await.unwrap();
    assert_eq!(start.elapsed(), 10 * MS);
    let _p = th.acquire(5).await.unwrap();
    assert_eq!(start.elapsed(), 15 * MS);
}

/// A waiter cancelled while another waits in front of it must not make the one in front be
/// served early: the refund waits until head reaches the cancelled claim.
#[tokio::test(start_paused = true)]
async fn cancel_behind_a_waiter_does_not_serve_the_front_early() {
    let th = throttle::<Capped>(Rate::per_second(1_000), 10, 1);
    let start = Instant::now();
    drain(&th).await;
    let front = spawn_acquire(&th, 10, start).await; // tokens 11..=20
    let middle = spawn_acquire(&th, 10, start).await; // tokens 21..=30, cancelled at 3 ms
    let back = spawn_acquire(&th, 10, start).await; // tokens 31..=40
    tokio::time::sleep(3 * MS).await;
    middle.abort();
    assert!(middle.await.unwrap_err().is_cancelled());
    let (front_at, p) = front.await.unwrap().unwrap();
    assert_eq!(
        front_at,
        10 * MS,
        "the front claim got no tokens from the refund"
    );
    drop(p);
    let (back_at, p) = back.await.unwrap().unwrap();
    assert_eq!(back_at, 20 * MS, "as if the cancelled claim never existed");
    drop(p);
    let s = th.bucket().snapshot();
    assert_eq!(
        s.ceil,
        Some(s.tail + 10),
        "every token released or refunded"
    );
}

#[tokio::test(start_paused = true)]
async fn set_rate_wakes_sleeping_waiters() {
    // Faster: the waiter recomputes at once.
    let th = throttle::<Uncapped>(Rate::per_second(10), 10, 1);
    drain(&th).await;
    let start = Instant::now();
    let waiter = spawn_acquire(&th, 10, start).await; // 1 s at 10/s
    tokio::time::sleep(100 * MS).await;
    th.set_rate(Rate::per_second(1_000)).unwrap();
    // 1 token earned at 10/s in the first 100 ms, 9 more at 1000/s.
    let (at, _p) = waiter.await.unwrap().unwrap();
    assert_eq!(at, 109 * MS);

    // Slower: a waiter that would wake too early sleeps again for the new rate.
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 10, 1);
    drain(&th).await;
    let start = Instant::now();
    let waiter = spawn_acquire(&th, 10, start).await; // 10 ms at 1000/s
    tokio::time::sleep(5 * MS).await;
    th.set_rate(Rate::per_second(100)).unwrap();
    // 5 tokens at 1000/s, 5 more at 100/s.
    let (at, _p) = waiter.await.unwrap().unwrap();
    assert_eq!(at, 55 * MS);

    assert!(matches!(
        th.set_rate(Rate::per_second(0)),
        Err(iothrottle::ConfigError::ZeroRate { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn close_wakes_every_waiter_and_leaks_nothing() {
    let th = throttle::<Capped>(Rate::per_second(1), 10, 1);
    let start = Instant::now();
    let held = th.acquire(4).await.unwrap();
    let mut waiters = Vec::new();
    for cost in [6, 10, 10, 3, 7] {
        waiters.push(spawn_acquire(&th, cost, start).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    th.close();
    assert!(th.is_closed());
    let mut results = Vec::new();
    for w in waiters {
        results.push(w.await.unwrap().map(|(_, p)| p.tokens()));
    }
    // The first one (6 tokens) was in the bucket already; everybody else is told.
    assert_eq!(results[0], Ok(6));
    for r in &results[1..] {
        assert_eq!(*r, Err(AcquireError::Closed));
    }
    assert_eq!(th.acquire(1).await.unwrap_err(), AcquireError::Closed);
    assert_eq!(th.acquire(0).await.unwrap_err(), AcquireError::Closed);
    assert_eq!(th.try_acquire(1).unwrap_err(), TryAcquireError::Closed);
    drop(held);
    let s = th.bucket().snapshot();
    assert_eq!(
        s.ceil,
        Some(s.tail + 10),
        "every token released or refunded"
    );
}

#[test]
fn close_wakes_waiters_on_a_multi_thread_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // One token per hour: without close these would wait for days.
        let th: Throttle<Capped> = Throttle::new(BucketConfig::new(
            Rate::new(1, Duration::from_secs(3600)),
            1,
        ))
        .unwrap();
        let _first = th.acquire(1).await.unwrap();
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let th = th.clone();
            tasks.push(tokio::spawn(async move { th.acquire(1).await.map(drop) }));
        }
        // Let them all queue up, then close.
        while th.bucket().snapshot().tail != 33 {
            tokio::task::yield_now().await;
        }
        th.close();
        for t in tasks {
            assert_eq!(t.await.unwrap(), Err(AcquireError::Closed));
        }
    });
}

#[tokio::test(start_paused = true)]
async fn cost_above_the_limit_is_an_error_and_zero_is_immediate() {
    let th = throttle::<Uncapped>(Rate::per_second(1), 10, 1);
    assert_eq!(
        th.acquire(11).await.unwrap_err(),
        AcquireError::CostExceedsLimit {
            cost: 11,
            limit: 10
        }
    );
    assert_eq!(
        th.try_acquire(u64::MAX).unwrap_err(),
        TryAcquireError::CostExceedsLimit {
            cost: u64::MAX,
            limit: 10
        }
    );
    let start = Instant::now();
    drain(&th).await;
    let _queued = spawn_acquire(&th, 5, start).await;
    // Zero tokens: at once, even with an empty bucket and a queue.
    let p = th.acquire(0).await.unwrap();
    assert_eq!(p.tokens(), 0);
    assert_eq!(th.try_acquire(0).unwrap().tokens(), 0);
    assert_eq!(start.elapsed(), Duration::ZERO);
    let msg = AcquireError::CostExceedsLimit {
        cost: 11,
        limit: 10,
    }
    .to_string();
    assert!(msg.contains("11") && msg.contains("10"), "{msg}");
}

#[test]
fn try_acquire_says_when_to_retry() {
    let clock = ManualClock::new();
    let cfg = BucketConfig::new(Rate::per_second(1_000), 100).with_threshold(5);
    let th: Throttle<Uncapped, ManualClock> = Throttle::with_clock(cfg, clock.clone()).unwrap();
    assert_eq!(th.try_acquire(60).unwrap().tokens(), 60);
    let err = th.try_acquire(50).unwrap_err();
    assert_eq!(
        err,
        TryAcquireError::Insufficient {
            missing: 10,
            retry_after: 10 * MS
        }
    );
    assert_eq!(err.retry_after(), Some(10 * MS));
    clock.advance(10 * MS);
    assert_eq!(th.try_acquire(50).unwrap().tokens(), 50);
    // Below the threshold: the retry time covers the threshold, not just the one token.
    let err = th.try_acquire(1).unwrap_err();
    assert_eq!(err.retry_after(), Some(5 * MS));
    clock.advance(5 * MS);
    assert!(th.try_acquire(1).is_ok());
    assert_eq!(TryAcquireError::Closed.retry_after(), None);
}

#[tokio::test(start_paused = true)]
async fn try_acquire_never_jumps_the_queue() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 10, 1);
    let start = Instant::now();
    drain(&th).await;
    let waiter = spawn_acquire(&th, 5, start).await;
    tokio::time::advance(3 * MS).await;
    // 3 tokens accrued, all owed to the waiter: a newcomer must queue 3 more ms (2 + 1).
    let err = th.try_acquire(1).unwrap_err();
    assert_eq!(
        err,
        TryAcquireError::Insufficient {
            missing: 3,
            retry_after: 3 * MS
        }
    );
    let (at, _p) = waiter.await.unwrap().unwrap();
    assert_eq!(at, 5 * MS);
}

#[tokio::test(start_paused = true)]
async fn capped_permits_release_exactly_their_tokens() {
    let th = throttle::<Capped>(Rate::per_second(1_000), 10, 1);
    let start = Instant::now();
    let a = th.acquire(6).await.unwrap();
    let b = th.acquire(4).await.unwrap();
    // 10 tokens in flight: however long we wait, the cap keeps the bucket empty.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(th.try_acquire(1).is_err());
    a.complete();
    // 6 completed: 6 may be replenished again. The time that passed while the cap held the
    // bucket empty was spent by the replenish in `try_acquire` (like time on a full bucket):
    // the 6 tokens accrue from there.
    let c = th.acquire(6).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1) + 6 * MS);
    assert!(th.try_acquire(1).is_err());
    drop((b, c));
    let s = th.bucket().snapshot();
    assert_eq!(s.ceil, Some(s.tail + 10));
}

/// A tiny seeded generator (xorshift64*), so the random test replays exactly.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Workers acquire, cancel (timeouts), drop at once, hold permits (stalls) and try_acquire at
/// random over a long virtual window. The rate must hold: no token leaks (Seastar's capped
/// release crept down to ~50% this way), and no refund ever lets grants run ahead of the rate.
async fn random_load_holds_the_rate<M: Mode>(seed: u64) {
    const RATE: u64 = 1_000;
    const LIMIT: u64 = 200;
    const WORKERS: u64 = 16;
    let window = Duration::from_secs(30);
    let th = throttle::<M>(Rate::per_second(RATE), LIMIT, 1);
    let clock = *th.bucket().clock();
    let granted = Arc::new(AtomicU64::new(0));
    let over_rate = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + window;
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let th = th.clone();
        let granted = granted.clone();
        let over_rate = over_rate.clone();
        let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        tasks.push(tokio::spawn(async move {
            let count = |p: &Permit<M, TokioClock>| {
                let total = granted.fetch_add(p.tokens(), Ordering::Relaxed) + p.tokens();
                // Never more than a full bucket plus what the rate has earned so far.
                let allowed = LIMIT + Rate::per_second(RATE).tokens_in(clock.now()) as u64;
                if total > allowed {
                    over_rate.fetch_add(1, Ordering::Relaxed);
                }
            };
            while Instant::now() < end {
                let cost = 1 + rng.below(10);
                match rng.below(5) {
                    // Acquire and hold the permit for a while (the I/O), then complete.
                    0 => {
                        let p = th.acquire(cost).await.unwrap();
                        count(&p);
                        tokio::time::sleep(Duration::from_millis(rng.below(50))).await;
                        p.complete();
                    }
                    // Give up after a random timeout: cancellation while queued.
                    1 => {
                        let limit = Duration::from_millis(rng.below(20));
                        if let Ok(p) = tokio::time::timeout(limit, th.acquire(cost)).await {
                            count(&p.unwrap());
                        }
                    }
                    // Acquire and drop at once (work done instantly, or abandoned).
                    2 => count(&th.acquire(cost).await.unwrap()),
                    // Try without waiting; back off as told.
                    3 => match th.try_acquire(cost) {
                        Ok(p) => count(&p),
                        Err(e) => {
                            let wait = e.retry_after().unwrap();
                            tokio::time::sleep(wait.min(Duration::from_millis(20))).await;
                        }
                    },
                    // Stall: do nothing for a moment.
                    _ => tokio::time::sleep(Duration::from_millis(rng.below(5))).await,
                }
            }
        }));
    }
    for t in tasks {
        // A leak shows as workers stuck behind a cap that never comes back: fail, don't hang.
        tokio::time::timeout_at(end + Duration::from_secs(5), t)
            .await
            .expect("workers stuck: tokens leaked")
            .unwrap();
    }
    let granted = granted.load(Ordering::Relaxed);
    let ideal = RATE * window.as_secs();
    assert_eq!(
        over_rate.load(Ordering::Relaxed),
        0,
        "grants ran ahead of the rate"
    );
    assert!(
        granted as f64 >= 0.99 * ideal as f64,
        "granted {granted} of {ideal} tokens ({:.2}%)",
        100.0 * granted as f64 / ideal as f64
    );
    let s = th.bucket().snapshot();
    if M::CAPPED {
        assert_eq!(
            s.ceil,
            Some(s.tail + LIMIT),
            "every token released or refunded"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn random_cancel_drop_stall_holds_the_rate_capped() {
    for seed in [1, 0xdead_beef, 42] {
        random_load_holds_the_rate::<Capped>(seed).await;
    }
}

#[tokio::test(start_paused = true)]
async fn random_cancel_drop_stall_holds_the_rate_uncapped() {
    random_load_holds_the_rate::<Uncapped>(7).await;
}

#[test]
fn many_tasks_on_a_multi_thread_runtime_get_exactly_their_tokens() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let th: Throttle<Capped> =
            Throttle::new(BucketConfig::new(Rate::per_second(200_000), 64)).unwrap();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let th = th.clone();
            tasks.push(tokio::spawn(async move {
                let mut got = 0;
                for i in 0..500u64 {
                    let p = th.acquire(1 + i % 4).await.unwrap();
                    got += p.tokens();
                }
                got
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        assert_eq!(total, 8 * (125 * (1 + 2 + 3 + 4)));
        let s = th.bucket().snapshot();
        assert_eq!(s.ceil, Some(s.tail + 64));
    });
}

/// Real threads, real time: acquisitions, timeouts (cancellations while queued) and
/// try_acquires race on a capped bucket. Nothing may hang, and at the end every token is
/// released or refunded (`ceil == tail + limit`), whatever the interleaving.
fn racing_cancellations_leak_nothing(workers: u64, ops: u64, seed: u64) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let th: Throttle<Capped> =
            Throttle::new(BucketConfig::new(Rate::per_second(200_000), 64).with_threshold(4))
                .unwrap();
        let mut tasks = Vec::new();
        for w in 0..workers {
            let th = th.clone();
            let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            tasks.push(tokio::spawn(async move {
                for _ in 0..ops {
                    let cost = 1 + rng.below(16);
                    match rng.below(3) {
                        0 => drop(th.acquire(cost).await.unwrap()),
                        1 => {
                            let limit = Duration::from_micros(rng.below(1_500));
                            let _ = tokio::time::timeout(limit, th.acquire(cost)).await;
                        }
                        _ => {
                            if let Err(e) = th.try_acquire(cost) {
                                assert!(e.retry_after().is_some());
                                tokio::task::yield_now().await;
                            }
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let s = th.bucket().snapshot();
        assert_eq!(
            s.ceil,
            Some(s.tail + 64),
            "every token released or refunded"
        );
    });
}

#[test]
fn racing_cancellations_on_a_multi_thread_runtime_leak_nothing() {
    racing_cancellations_leak_nothing(8, 300, 3);
}

/// The long version: `cargo test --release --test throttle -- --ignored` (about a minute on
/// 2 cores).
#[test]
#[ignore = "stress test: run in release"]
fn stress_racing_cancellations_leak_nothing() {
    for seed in 0..10 {
        racing_cancellations_leak_nothing(16, 5_000, seed);
    }
}

/// A rate raise re-wakes a waiter, which recomputes its deadline: 1/s →
/// 1000/s while a waiter waits for 1 token; it is served within one replenish period at the
/// new rate (1 ms), not at its old deadline (1 s).
#[tokio::test(start_paused = true)]
async fn set_rate_raise_mid_wait_serves_within_one_period_at_the_new_rate() {
    let th = throttle::<Uncapped>(Rate::per_second(1), 1, 1);
    drain(&th).await;
    let start = Instant::now();
    let waiter = spawn_acquire(&th, 1, start).await;
    tokio::time::sleep(10 * MS).await;
    th.set_rate(Rate::per_second(1_000)).unwrap();
    let (at, _p) = waiter.await.unwrap().unwrap();
    assert!(at <= 11 * MS, "served at {at:?}");
}

/// `Throttle::new` is generic over the mode: the turbofish names it.
#[tokio::test]
async fn new_is_generic_over_the_mode_and_stats_count() {
    let th = Throttle::<Uncapped>::new(BucketConfig::new(Rate::per_second(1_000), 10)).unwrap();
    let capped = Throttle::<Capped>::new(BucketConfig::new(Rate::per_second(1_000), 10)).unwrap();
    assert!(!capped.is_closed());
    assert!(capped.bucket().snapshot().ceil.is_some());
    assert!(th.bucket().snapshot().ceil.is_none());
    let p = th.acquire(4).await.unwrap();
    assert_eq!(p.tokens(), 4);
    let s = th.stats();
    assert_eq!((s.granted_tokens, s.waiting, s.cancelled), (4, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn stats_count_granted_waiting_and_cancelled() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 10, 1);
    drain(&th).await;
    assert_eq!(th.stats().granted_tokens, 10);
    let start = Instant::now();
    let a = spawn_acquire(&th, 5, start).await;
    let b = spawn_acquire(&th, 5, start).await;
    assert_eq!(th.stats().waiting, 2);
    b.abort();
    let _ = b.await;
    assert_eq!(th.stats().cancelled, 1);
    assert_eq!(th.stats().waiting, 1);
    let (_, p) = a.await.unwrap().unwrap();
    drop(p);
    let s = th.stats();
    assert_eq!((s.granted_tokens, s.waiting, s.cancelled), (15, 0, 1));
}

/// Two throttles on one bucket (1 token/s, limit 10): B takes the full bucket, B's next waiter
/// claims tokens 11..=20, A's claim of 21..=30 is cancelled behind it (its give-back waits for
/// `head`), then A goes away (`close`d, or every handle dropped). B's waiter must still be
/// served when its tokens accrue (10 s), not from A's claim: a throttle leaving takes none of
/// the bucket's order with it, and the bucket never grants more than `limit + rate × t`.
async fn a_throttle_leaving_a_shared_bucket(close: bool) {
    let cfg = BucketConfig::new(Rate::per_second(1), 10);
    let bucket = Arc::new(
        iothrottle::SharedTokenBucket::<Uncapped, _>::with_clock(cfg, TokioClock::new()).unwrap(),
    );
    let a = Throttle::from_bucket(bucket.clone());
    let b = Throttle::from_bucket(bucket.clone());
    let start = Instant::now();
    drain(&b).await;
    let b_waiter = spawn_acquire(&b, 10, start).await;
    let a_waiter = spawn_acquire(&a, 10, start).await;
    a_waiter.abort();
    assert!(a_waiter.await.unwrap_err().is_cancelled());
    assert_eq!(
        bucket.deferred_give_backs(),
        1,
        "behind B's waiter: deferred"
    );
    if close {
        a.close();
    } else {
        drop(a);
    }
    // Nothing was refunded ahead of B's waiter: it still misses all of its 10 tokens.
    assert_eq!(bucket.snapshot().head, 10);
    // Wake B's waiter (a rate change does): it must find its tokens missing and sleep on.
    b.set_rate(Rate::per_second(1)).unwrap();
    tokio::task::yield_now().await;
    let (at, _p) = b_waiter.await.unwrap().unwrap();
    assert_eq!(at, Duration::from_secs(10), "B's waiter at the rate");
    // 20 tokens granted by 10 s: limit + rate × t. A's claim is back now, as if never made.
    assert_eq!(bucket.deferred_give_backs(), 0);
    let _p = b.acquire(10).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(20));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_throttle_never_serves_another_throttles_waiter_early() {
    a_throttle_leaving_a_shared_bucket(false).await;
}

#[tokio::test(start_paused = true)]
async fn closing_a_throttle_never_serves_another_throttles_waiter_early() {
    a_throttle_leaving_a_shared_bucket(true).await;
}

/// Waiting only: with an uncapped bucket the permit means nothing once granted, so the call
/// needs no binding and warns about nothing (a compile-time check: `unused_must_use` is denied
/// here).
#[deny(unused_must_use)]
async fn wait_for(t: &Throttle<Uncapped, TokioClock>, n: u64) -> Result<(), AcquireError> {
    t.acquire(n).await?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn acquire_then_question_mark_compiles_without_a_must_use_warning() {
    let th = throttle::<Uncapped>(Rate::per_second(1_000), 100, 1);
    drain(&th).await;
    let start = Instant::now();
    wait_for(&th, 50).await.unwrap();
    assert_eq!(start.elapsed(), 50 * MS);
}
