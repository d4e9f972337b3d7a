//! The shared token bucket against the floor (a bare atomic) and the competitors, in one group.
//!
//! Ids (`bucket/<case>/<threads>`):
//!
//! | case | what one op is |
//! |---|---|
//! | `iothrottle_grab_deficiency` | `grab(1)` + `deficiency`, a `replenish()` every 64 grabs |
//! | `iothrottle_grab_deficiency_only` (1t) | `grab(1)` + `deficiency`, never a replenish: the fast path alone |
//! | `atomic_fetch_add_floor` | `AtomicU64::fetch_add` + `load`: the floor |
//! | `governor_check` | governor direct `RateLimiter::check()` |
//! | `tokio_semaphore_try_acquire` | `Semaphore::try_acquire()` + `forget`, permits added back every 64 |
//! | `leaky_bucket_try_acquire` | leaky-bucket `try_acquire(1)` |
//! | `layout_padded` / `layout_packed` | a replica of grab + deficiency on two rovers, padded apart or in one cache line |
//! | `replenish_epoch_lockfree` | `replenish_at(t)` of the bucket, `t` one nanosecond later each call |
//! | `replenish_old_trylock` | the same on a copy of the previous algorithm (`last` as a try-lock, remainder carried) |
//!
//! `1t` runs on the bench thread; `2t` runs two threads (pinned to distinct cores where
//! possible) on one shared instance, and reports the time per op of one thread: the aggregate
//! throughput is two ops per reported time. No rate ever throttles: every case measures the
//! fast path. Ratios are what matter (targets: 1t ≤ 1.3× the floor and ≥ 3× faster than
//! governor; 2t ≥ 2× governor's aggregate throughput).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use crossbeam_utils::CachePadded;

use iothrottle::{BucketConfig, BucketState, ManualClock, Rate, SharedTokenBucket, Uncapped};

/// Replenish (or add permits back) once every this many ops, as Seastar's I/O queue roughly does.
const REPLENISH_EVERY: u64 = 64;

/// A bucket that never throttles in a benchmark: the highest rate and the largest limit.
fn iothrottle_bucket() -> SharedTokenBucket<Uncapped> {
    let cfg = BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    );
    let b = SharedTokenBucket::<Uncapped>::new(cfg).expect("valid config");
    b.replenish(); // the first replenish fills the bucket
    b
}

fn governor_limiter() -> governor::DefaultDirectRateLimiter {
    // 10^9 cells per second (one per ns) and the largest burst: never throttles here.
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap())
        .allow_burst(NonZeroU32::MAX);
    governor::RateLimiter::direct(quota)
}

fn semaphore() -> tokio::sync::Semaphore {
    tokio::sync::Semaphore::new(tokio::sync::Semaphore::MAX_PERMITS / 2)
}

fn leaky_bucket() -> leaky_bucket::RateLimiter {
    let max = usize::MAX >> 2;
    leaky_bucket::RateLimiter::builder()
        .max(max)
        .initial(max)
        .refill(max)
        .interval(Duration::from_millis(1))
        .fair(false)
        .build()
}

/// The rovers `tail` and `head` as the core lays them out: each on its own cache line.
#[derive(Default)]
struct Padded {
    tail: CachePadded<AtomicU64>,
    head: CachePadded<AtomicU64>,
}

/// The same two rovers in one cache line (as Seastar lays them out).
#[derive(Default)]
#[repr(C, align(64))]
struct Packed {
    tail: AtomicU64,
    head: AtomicU64,
}

/// What a layout replica needs: its two rovers.
trait Rovers: Send + Sync + Default + 'static {
    fn tail(&self) -> &AtomicU64;
    fn head(&self) -> &AtomicU64;
}

impl Rovers for Padded {
    fn tail(&self) -> &AtomicU64 {
        &self.tail
    }
    fn head(&self) -> &AtomicU64 {
        &self.head
    }
}

impl Rovers for Packed {
    fn tail(&self) -> &AtomicU64 {
        &self.tail
    }
    fn head(&self) -> &AtomicU64 {
        &self.head
    }
}

/// grab(1) + deficiency on a layout replica, with `head` advanced every 64 ops like a
/// replenish. Orderings as in the core.
#[inline]
fn replica_op<R: Rovers>(r: &R, i: u64) -> u64 {
    let tail = r.tail().fetch_add(1, Ordering::AcqRel) + 1;
    if i.is_multiple_of(REPLENISH_EVERY) {
        r.head().fetch_add(REPLENISH_EVERY, Ordering::AcqRel);
    }
    let head = r.head().load(Ordering::Acquire);
    (tail.wrapping_sub(head) as i64).max(0) as u64
}

/// Runs `op(shared, i)` for `iters` iterations on each of two threads (pinned to distinct cores
/// where possible) after a common start; returns the slower thread's time, i.e. per-op time of
/// one thread when divided by `iters`.
fn two_threads<S, F>(shared: &Arc<S>, iters: u64, op: F) -> Duration
where
    S: Send + Sync + 'static,
    F: Fn(&S, u64) + Send + Sync + Copy + 'static,
{
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let shared = Arc::clone(shared);
            let barrier = Arc::clone(&barrier);
            let core = (cores.len() >= 2).then(|| cores[t]);
            std::thread::spawn(move || {
                if let Some(core) = core {
                    // Pinning is best-effort: unpinned threads still measure contention.
                    let _ = core_affinity::set_for_current(core);
                }
                barrier.wait();
                let start = Instant::now();
                for i in 0..iters {
                    op(&shared, i);
                }
                start.elapsed()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("bench thread panicked"))
        .max()
        .unwrap_or_default()
}

fn iothrottle_op(b: &SharedTokenBucket<Uncapped>, i: u64) {
    if i.is_multiple_of(REPLENISH_EVERY) {
        b.replenish();
    }
    let tail = b.grab(1);
    black_box(b.deficiency(tail));
}

fn iothrottle_fast_path_op(b: &SharedTokenBucket<Uncapped>, _i: u64) {
    let tail = b.grab(1);
    black_box(b.deficiency(tail));
}

fn floor_op(a: &AtomicU64, _i: u64) {
    let v = a.fetch_add(1, Ordering::AcqRel);
    black_box(v);
    black_box(a.load(Ordering::Acquire));
}

fn governor_op(l: &governor::DefaultDirectRateLimiter, _i: u64) {
    let _ = black_box(l.check());
}

fn semaphore_op(s: &tokio::sync::Semaphore, i: u64) {
    if let Ok(p) = s.try_acquire() {
        p.forget();
    }
    if i % REPLENISH_EVERY == REPLENISH_EVERY - 1 {
        s.add_permits(REPLENISH_EVERY as usize);
    }
}

fn leaky_op(l: &leaky_bucket::RateLimiter, _i: u64) {
    black_box(l.try_acquire(1));
}

fn padded_op(r: &Padded, i: u64) {
    black_box(replica_op(r, i));
}

fn packed_op(r: &Packed, i: u64) {
    black_box(replica_op(r, i));
}

/// A replenish target and the fake clock its calls read: each call is one nanosecond later, so
/// that every call earns tokens at the highest rate (2.56 × 10^6 per ns) and, the bucket being
/// empty with the largest limit, goes all the way to the `head` CAS.
struct Repl<T> {
    now: AtomicU64,
    target: T,
}

fn repl_new() -> Repl<SharedTokenBucket<Uncapped, ManualClock>> {
    let cfg = BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    );
    let state = BucketState {
        tail: 0,
        head: 0,
        ceil: None,
    };
    let b = SharedTokenBucket::from_state(cfg, ManualClock::new(), state).expect("valid");
    Repl {
        now: AtomicU64::new(0),
        target: b,
    }
}

fn repl_new_op(r: &Repl<SharedTokenBucket<Uncapped, ManualClock>>, _i: u64) {
    let now = r.now.fetch_add(1, Ordering::Relaxed) + 1;
    black_box(r.target.replenish_at(Duration::from_nanos(now)));
}

fn repl_old_op(r: &Repl<old::Bucket>, _i: u64) {
    let now = r.now.fetch_add(1, Ordering::Relaxed) + 1;
    black_box(r.target.replenish(now));
}

/// A copy of the replenish that `last` doubled as a try-lock for (before the epoch design), kept
/// to measure the new one against: the replenish right is a CAS that sets the top bit of
/// `last`, the fraction of a token is carried in `rem` under the right, and the rate sits in a
/// two-slot seqlock. Uncapped only; same rovers and the same `head` CAS as the core.
mod old {
    use std::sync::atomic::{fence, AtomicU64, Ordering};

    use crossbeam_utils::CachePadded;

    const BUSY: u64 = 1 << 63;

    pub(super) struct Bucket {
        tail: CachePadded<AtomicU64>,
        head: CachePadded<AtomicU64>,
        repl: CachePadded<Repl>,
        limit: u64,
        threshold: u64,
    }

    struct Repl {
        last: AtomicU64,
        rem: AtomicU64,
        rem_gen: AtomicU64,
        seq: AtomicU64,
        slots: [(AtomicU64, AtomicU64); 2],
    }

    impl Bucket {
        /// Empty, replenished at 0, `tokens` per `period_ns`.
        pub(super) fn new(tokens: u64, period_ns: u64, limit: u64) -> Self {
            let slot = || (AtomicU64::new(tokens), AtomicU64::new(period_ns));
            Bucket {
                tail: CachePadded::new(AtomicU64::new(0)),
                head: CachePadded::new(AtomicU64::new(0)),
                repl: CachePadded::new(Repl {
                    last: AtomicU64::new(0),
                    rem: AtomicU64::new(0),
                    rem_gen: AtomicU64::new(0),
                    seq: AtomicU64::new(0),
                    slots: [slot(), slot()],
                }),
                limit,
                threshold: 1,
            }
        }

        fn rate(&self) -> (u64, u64, u64) {
            loop {
                let s1 = self.repl.seq.load(Ordering::Acquire);
                let slot = &self.repl.slots[((s1 >> 1) & 1) as usize];
                let t = slot.0.load(Ordering::Relaxed);
                let p = slot.1.load(Ordering::Relaxed);
                fence(Ordering::Acquire);
                if self.repl.seq.load(Ordering::Relaxed) >> 1 == s1 >> 1 {
                    return (t, p, s1 >> 1);
                }
                std::hint::spin_loop();
            }
        }

        fn earned(t: u64, p: u64, elapsed: u64, carried: u64) -> (u128, u64) {
            let num = t as u128 * elapsed as u128;
            let (whole, rem) = (num / p as u128, num % p as u128);
            let frac = rem + carried as u128;
            (whole + frac / p as u128, (frac % p as u128) as u64)
        }

        fn fill(&self, extra: u128) -> u64 {
            let mut head = self.head.load(Ordering::Acquire);
            loop {
                let tail = self.tail.load(Ordering::Acquire);
                let room = tail.wrapping_add(self.limit).wrapping_sub(head) as i64;
                if room <= 0 {
                    return 0;
                }
                let add = extra.min(room as u128) as u64;
                if add == 0 {
                    return 0;
                }
                match self.head.compare_exchange_weak(
                    head,
                    head.wrapping_add(add),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return add,
                    Err(actual) => head = actual,
                }
            }
        }

        pub(super) fn replenish(&self, now: u64) -> u64 {
            let last = self.repl.last.load(Ordering::Acquire);
            if last & BUSY != 0 || now <= last {
                return 0;
            }
            let (t, p, gen) = self.rate();
            let carried = self.repl.rem.load(Ordering::Relaxed);
            if Self::earned(t, p, now - last, carried).0 < self.threshold as u128 {
                return 0;
            }
            if self
                .repl
                .last
                .compare_exchange(last, last | BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                return 0;
            }
            let carried = if self.repl.rem_gen.load(Ordering::Relaxed) == gen {
                self.repl.rem.load(Ordering::Relaxed)
            } else {
                0
            };
            let (extra, rem) = Self::earned(t, p, now - last, carried);
            if extra < self.threshold as u128 {
                self.repl.last.store(last, Ordering::Release);
                return 0;
            }
            let added = self.fill(extra);
            self.repl.rem.store(rem, Ordering::Relaxed);
            self.repl.rem_gen.store(gen, Ordering::Relaxed);
            self.repl.last.store(now, Ordering::Release);
            added
        }
    }
}

fn repl_old() -> Repl<old::Bucket> {
    Repl {
        now: AtomicU64::new(0),
        target: old::Bucket::new(Rate::MAX_PER_SECOND, 1_000_000_000, BucketConfig::MAX_LIMIT),
    }
}

/// One-thread case: `op` on a fresh instance, counted per call.
fn one<S: 'static>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    s: S,
    op: fn(&S, u64),
) {
    c.bench_function(BenchmarkId::new(name, "1t"), |b| {
        let mut i = 0u64;
        b.iter(|| {
            op(&s, i);
            i = i.wrapping_add(1);
        })
    });
}

/// Two-thread case: `op` on one shared instance from two threads.
fn two<S: Send + Sync + 'static>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    s: S,
    op: fn(&S, u64),
) {
    let s = Arc::new(s);
    c.bench_function(BenchmarkId::new(name, "2t"), |b| {
        b.iter_custom(|iters| two_threads(&s, iters, op))
    });
}

/// The `bucket` group: every case side by side.
pub fn bucket(c: &mut Criterion) {
    let mut g = c.benchmark_group("bucket");
    one(
        &mut g,
        "iothrottle_grab_deficiency",
        iothrottle_bucket(),
        iothrottle_op,
    );
    // What the replenish every 64 grabs costs: the same ops without it.
    one(
        &mut g,
        "iothrottle_grab_deficiency_only",
        iothrottle_bucket(),
        iothrottle_fast_path_op,
    );
    one(
        &mut g,
        "atomic_fetch_add_floor",
        AtomicU64::new(0),
        floor_op,
    );
    one(&mut g, "governor_check", governor_limiter(), governor_op);
    one(
        &mut g,
        "tokio_semaphore_try_acquire",
        semaphore(),
        semaphore_op,
    );
    one(&mut g, "leaky_bucket_try_acquire", leaky_bucket(), leaky_op);

    two(
        &mut g,
        "iothrottle_grab_deficiency",
        iothrottle_bucket(),
        iothrottle_op,
    );
    two(
        &mut g,
        "atomic_fetch_add_floor",
        AtomicU64::new(0),
        floor_op,
    );
    two(&mut g, "governor_check", governor_limiter(), governor_op);
    two(
        &mut g,
        "tokio_semaphore_try_acquire",
        semaphore(),
        semaphore_op,
    );
    two(&mut g, "leaky_bucket_try_acquire", leaky_bucket(), leaky_op);

    // Does padding the rovers apart help under contention? (The core pads.)
    two(&mut g, "layout_padded", Padded::default(), padded_op);
    two(&mut g, "layout_packed", Packed::default(), packed_op);

    // The replenish path: the lock-free epoch design against a copy of the try-lock one.
    one(&mut g, "replenish_epoch_lockfree", repl_new(), repl_new_op);
    one(&mut g, "replenish_old_trylock", repl_old(), repl_old_op);
    two(&mut g, "replenish_epoch_lockfree", repl_new(), repl_new_op);
    two(&mut g, "replenish_old_trylock", repl_old(), repl_old_op);
    g.finish();
}

criterion::criterion_group!(benches, bucket);
