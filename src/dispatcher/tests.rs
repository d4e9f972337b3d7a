//! Deterministic tests of the shard loop: several [`ShardCore`]s driven on one thread by a
//! [`ManualClock`], sharing one bucket and the classes' fairness state exactly as the shard
//! threads do. Every token is counted; nothing sleeps. One file over the usual size: the
//! simulator and the scenarios that drive it are read together.

use std::time::Duration;

use super::queue::{Entry, Payload};
use super::shard::{Next, ShardCore};
use super::*;
use crate::bucket::Rate;
use crate::clock::ManualClock;
use crate::sync::Arc;

/// A simulated request: which feed it came from.
#[derive(Debug)]
struct Job {
    feed: usize,
    cancelled: bool,
}

impl Payload for Job {
    fn is_cancelled(&self) -> bool {
        self.cancelled
    }
}

/// Keeps `depth` requests of `request` outstanding (queued or running) on `shard` for `class`,
/// between `start` and `stop`.
#[derive(Debug, Clone)]
struct Feed {
    shard: usize,
    class: usize,
    request: IoRequest,
    depth: usize,
    start: Duration,
    stop: Duration,
    outstanding: usize,
    /// Submitted from outside the shards: a request that can go at once is dispatched on its
    /// caller's thread (`Shared::try_fast`), as `Dispatcher::submit` does.
    fast: bool,
}

impl Feed {
    fn new(shard: usize, class: ClassId, request: IoRequest, depth: usize) -> Self {
        Feed {
            shard,
            class: class.0,
            request,
            depth,
            start: Duration::ZERO,
            stop: Duration::MAX,
            outstanding: 0,
            fast: false,
        }
    }

    fn submitted_by_callers(mut self) -> Self {
        self.fast = true;
        self
    }

    fn between(mut self, start: Duration, stop: Duration) -> Self {
        self.start = start;
        self.stop = stop;
        self
    }
}

#[derive(Debug, Clone, Copy)]
struct Running {
    done_at: Duration,
    feed: usize,
    cost: u64,
    shard: usize,
    class: usize,
    times: (Duration, Duration),
}

struct Sim {
    clock: ManualClock,
    shared: Arc<Shared>,
    shards: Vec<ShardCore<Job>>,
    /// When each shard wants to be polled; `None` while idle.
    wake: Vec<Option<Duration>>,
    feeds: Vec<Feed>,
    /// Tokens dispatched, per feed.
    tokens: Vec<u64>,
    /// Requests dispatched, per feed.
    requests: Vec<u64>,
    /// When each feed last had a request dispatched.
    last: Vec<Duration>,
    /// Requests running: (completes at, feed, cost, shard, class, (submitted, dispatched)).
    running: Vec<Running>,
    /// A modelled disk (tokens per second it really serves, FIFO): a request completes once
    /// the disk has served everything dispatched before it and itself. `None`: `disk_speed`,
    /// else `latency`.
    disk_rate: Option<u64>,
    /// Per feed: (completed at, submission-to-completion latency) of each request (recorded
    /// with `disk_rate`).
    latencies: Vec<Vec<(Duration, Duration)>>,
    /// How long a dispatched request runs (when neither `disk_rate` nor `disk_speed` is set).
    latency: Duration,
    /// A modelled disk instead of a fixed latency: it serves dispatched requests one after the
    /// other in dispatch order, each for its cost divided by this speed (1.0: exactly as the
    /// model says; 0.5: twice as slow).
    disk_speed: Option<f64>,
    /// With `disk_speed`: a disk whose service times vary around the model's, `(state,
    /// swing)`: each request takes its modelled time times a factor drawn evenly from
    /// `[1 − swing, 1 + swing]` (the state of a seeded generator), so that on average it keeps
    /// the model's pace, faster and slower by turns, as a real disk does.
    disk_swing: Option<(u64, f64)>,
    /// When the modelled disk finishes what it was given so far.
    disk_free_at: Duration,
    /// A host that stalls writes (with `disk_speed`): a write dispatched in `[from, to)`
    /// completes no earlier than `to`, without holding up the reads behind it.
    write_stall: Option<(Duration, Duration)>,
    /// The most tokens ever dispatched and not completed at once.
    max_in_flight: u64,
    /// Every grab size, to check reservations (recorded from the bucket's tail).
    now: Duration,
    polls: u64,
    /// Polls per shard.
    shard_polls: Vec<u64>,
    /// Requests dispatched on their callers' threads, per feed.
    fast: Vec<u64>,
}

impl Sim {
    fn new(builder: DispatcherBuilder, clock: ManualClock, feeds: Vec<Feed>) -> Sim {
        let (shared, shards) = builder.clock(clock.clone()).shared().unwrap();
        let n = feeds.len();
        Sim {
            clock,
            shards: (0..shards)
                .map(|s| ShardCore::new(shared.clone(), s))
                .collect(),
            wake: vec![None; shards],
            shared,
            feeds,
            tokens: vec![0; n],
            requests: vec![0; n],
            last: vec![Duration::ZERO; n],
            disk_rate: None,
            latencies: vec![Vec::new(); n],
            running: Vec::new(),
            latency: Duration::ZERO,
            disk_speed: None,
            disk_swing: None,
            disk_free_at: Duration::ZERO,
            write_stall: None,
            max_in_flight: 0,
            now: Duration::ZERO,
            polls: 0,
            shard_polls: vec![0; shards],
            fast: vec![0; n],
        }
    }

    fn complete(&mut self, r: Running, now: Duration) {
        self.shared.budget.release(r.cost);
        if self.shared.classes.finish(r.class, r.cost) {
            // The class's in-flight bound has room again: its shards look (as the runner's
            // completions wake them).
            for w in &mut self.wake {
                *w = Some(w.map_or(now, |w| w.min(now)));
            }
        }
        self.shards[r.shard].completed(r.class, r.cost, r.times, now);
        self.feeds[r.feed].outstanding -= 1;
        let latency = now.saturating_sub(r.times.0);
        if let Some(lc) = self.shared.classes.latency() {
            lc.record(r.class, latency);
        }
        if self.disk_rate.is_some() {
            self.latencies[r.feed].push((now, latency));
        }
    }

    fn in_flight(&self) -> u64 {
        self.running.iter().map(|r| r.cost).sum()
    }

    /// Runs until `until`, in steps of `dt`.
    fn run(&mut self, until: Duration, dt: Duration) {
        let mut step = 0usize;
        while self.now < until {
            self.now += dt;
            let now = self.now;
            self.clock.set(now).unwrap();
            // Completions.
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].done_at <= now {
                    let r = self.running.swap_remove(i);
                    self.complete(r, now);
                } else {
                    i += 1;
                }
            }
            // Submissions.
            let mut went = Vec::new();
            for f in 0..self.feeds.len() {
                let feed = &mut self.feeds[f];
                if now < feed.start || now >= feed.stop {
                    continue;
                }
                while feed.outstanding < feed.depth {
                    feed.outstanding += 1;
                    let cost = self.shared.disk.cost(&feed.request);
                    if feed.fast && self.shared.try_fast(feed.class, feed.shard, cost, now) {
                        went.push(Running {
                            done_at: now + self.latency,
                            feed: f,
                            cost,
                            shard: feed.shard,
                            class: feed.class,
                            times: (now, now),
                        });
                        continue;
                    }
                    self.shards[feed.shard].enqueue(Entry {
                        class: feed.class,
                        cost,
                        bytes: feed.request.bytes(),
                        submitted: now,
                        payload: Job {
                            feed: f,
                            cancelled: false,
                        },
                    });
                    // A new request wakes an idle shard (the channel does that for real).
                    if self.wake[feed.shard].is_none() {
                        self.wake[feed.shard] = Some(now);
                    }
                }
            }
            for r in went {
                self.tokens[r.feed] += r.cost;
                self.requests[r.feed] += 1;
                self.fast[r.feed] += 1;
                self.last[r.feed] = now;
                if self.latency.is_zero() {
                    self.complete(r, now);
                } else {
                    self.running.push(r);
                }
            }
            // Shards, in an order that rotates so that none is always first.
            let n = self.shards.len();
            for k in 0..n {
                let s = (k + step) % n;
                if self.wake[s].is_none_or(|w| w > now) {
                    continue;
                }
                self.polls += 1;
                self.shard_polls[s] += 1;
                let mut out = Vec::new();
                let next = self.shards[s].poll(now, &mut |e| out.push(e));
                for e in out {
                    let f = e.payload.feed;
                    self.tokens[f] += e.cost;
                    self.requests[f] += 1;
                    self.last[f] = now;
                    let mut r = Running {
                        done_at: now + self.latency,
                        feed: f,
                        cost: e.cost,
                        shard: s,
                        class: e.class,
                        times: (e.submitted, now),
                    };
                    if let Some(rate) = self.disk_rate {
                        let service = Duration::from_nanos(
                            (e.cost as u128 * 1_000_000_000 / rate as u128) as u64,
                        );
                        self.disk_free_at = self.disk_free_at.max(now) + service;
                        r.done_at = self.disk_free_at;
                        self.running.push(r);
                    } else if let Some(speed) = self.disk_speed {
                        // Each request takes its modelled time times a factor drawn evenly
                        // from [1 − swing, 1 + swing] (xorshift64 from a fixed seed, so every
                        // run draws the same): on average exactly the model's pace.
                        let factor = match &mut self.disk_swing {
                            Some((x, swing)) => {
                                *x ^= *x << 13;
                                *x ^= *x >> 7;
                                *x ^= *x << 17;
                                let u = (*x >> 11) as f64 / (1u64 << 53) as f64;
                                1.0 + *swing * (2.0 * u - 1.0)
                            }
                            None => 1.0,
                        };
                        let busy = Duration::from_secs_f64(e.cost as f64 / 1e9 / speed * factor);
                        let stalled = self.write_stall.filter(|&(from, to)| {
                            self.feeds[f].request.kind() == Some(IoKind::Write)
                                && now >= from
                                && now < to
                        });
                        if let Some((_, to)) = stalled {
                            r.done_at = to.max(now + busy);
                        } else {
                            self.disk_free_at = self.disk_free_at.max(now) + busy;
                            r.done_at = self.disk_free_at;
                        }
                        self.running.push(r);
                    } else if self.latency.is_zero() {
                        self.complete(r, now);
                    } else {
                        self.running.push(r);
                    }
                }
                self.max_in_flight = self.max_in_flight.max(self.in_flight());
                self.wake[s] = match next {
                    Next::Idle => None,
                    Next::WakeAfter(d) => Some(now + d),
                    Next::WaitDurable(_) => unreachable!("no checkpoint in these tests"),
                };
            }
            step += 1;
        }
    }

    /// A run-time change made through `f` (as `Dispatcher::set_rate`, `set_shares`,
    /// `set_bandwidth_cap` make it), then every shard woken, as their `Msg::Wake` does.
    fn control(&mut self, f: impl FnOnce(&Shared)) {
        f(&self.shared);
        for w in &mut self.wake {
            *w = Some(self.now);
        }
    }

    fn share(&self, feed: usize) -> f64 {
        self.tokens[feed] as f64 / self.tokens.iter().sum::<u64>() as f64
    }

    /// Empties the shards (as shutdown does) so that the classes' backlog counts return to 0.
    fn drain(&mut self) {
        for s in &mut self.shards {
            s.drain();
        }
    }
}

/// The disk the simulations model unless they say otherwise: a fast NVMe drive (2 GB/s reads,
/// 1 GB/s writes, 400k read IOPS, 100k write IOPS), stated explicitly.
const NVME: DiskModel = DiskModel::new(
    Figures {
        iops: 400_000,
        bandwidth: 2_000_000_000,
    },
    Figures {
        iops: 100_000,
        bandwidth: 1_000_000_000,
    },
);

fn builder(shards: usize) -> DispatcherBuilder {
    Dispatcher::builder().shards(shards).disk(NVME)
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}

const MS: Duration = Duration::from_millis(1);
const DT: Duration = Duration::from_micros(10);

#[test]
fn shares_4_to_1_on_one_shard() {
    let mut b = builder(1);
    let hi = b.add_class(ClassConfig::new("hi", 400)).unwrap();
    let lo = b.add_class(ClassConfig::new("lo", 100)).unwrap();
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, hi, req, 256), Feed::new(0, lo, req, 256)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    let r = ratio(sim.tokens[0], sim.tokens[1]);
    println!(
        "4:1 on one shard: {r:.3} ({} vs {} tokens)",
        sim.tokens[0], sim.tokens[1]
    );
    assert!((r / 4.0 - 1.0).abs() <= 0.05, "ratio {r}");
    sim.drain();
}

#[test]
fn shares_5_to_1_across_shards() {
    let mut b = builder(2);
    let hi = b.add_class(ClassConfig::new("hi", 500)).unwrap();
    let lo = b.add_class(ClassConfig::new("lo", 100)).unwrap();
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, hi, req, 256), Feed::new(1, lo, req, 256)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    let r = ratio(sim.tokens[0], sim.tokens[1]);
    println!(
        "5:1 across shards: {r:.3} ({} vs {} tokens)",
        sim.tokens[0], sim.tokens[1]
    );
    assert!((r / 5.0 - 1.0).abs() <= 0.10, "ratio {r}");
    sim.drain();
}

#[test]
fn small_and_large_requests_get_equal_tokens_across_shards() {
    // One class on both shards: only the reservations decide.
    let mut b = builder(2).latency_goal(4 * MS); // 1 MiB in one request
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let feeds = vec![
        Feed::new(0, c, IoRequest::read(4096), 1024),
        Feed::new(1, c, IoRequest::read(1 << 20), 16),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    let small = sim.share(0);
    println!(
        "4 KiB shard: {:.3} of tokens, {} requests; 1 MiB shard: {} requests",
        small, sim.requests[0], sim.requests[1]
    );
    assert!((small - 0.5).abs() <= 0.05, "small-request share {small}");
    sim.drain();
}

#[test]
fn small_and_large_requests_in_two_equal_classes() {
    let mut b = builder(2).latency_goal(4 * MS); // 1 MiB in one request
    let x = b.add_class(ClassConfig::new("x", 100)).unwrap();
    let y = b.add_class(ClassConfig::new("y", 100)).unwrap();
    let feeds = vec![
        Feed::new(0, x, IoRequest::read(4096), 1024),
        Feed::new(1, y, IoRequest::write(1 << 20), 16),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    let small = sim.share(0);
    assert!((small - 0.5).abs() <= 0.05, "small-request share {small}");
    sim.drain();
}

#[test]
fn long_run_rate_is_exact() {
    // 100 simulated seconds, two shards, three classes, mixed sizes.
    let mut b = builder(2).rate(Rate::per_second(300_000_000));
    let x = b.add_class(ClassConfig::new("x", 700)).unwrap();
    let y = b.add_class(ClassConfig::new("y", 300)).unwrap();
    let z = b.add_class(ClassConfig::new("z", 10)).unwrap();
    let feeds = vec![
        Feed::new(0, x, IoRequest::read(4096), 64),
        Feed::new(1, y, IoRequest::write(128 << 10), 8),
        Feed::new(1, z, IoRequest::read(16 << 10), 8),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    let secs = 100;
    sim.run(Duration::from_secs(secs), Duration::from_micros(100));
    let total: u64 = sim.tokens.iter().sum();
    let expected = 300_000_000 * secs;
    let err = (total as f64 - expected as f64) / expected as f64;
    println!("long run: {total} tokens dispatched, {expected} expected, error {err:.5}");
    assert!(err.abs() <= 0.01, "error {err}");
    // Dispatched tokens can never exceed what the bucket issued: the rate plus the first fill.
    assert!(total <= expected + sim.shared.budget.limit());
    sim.drain();
}

#[test]
fn queue_depth_one_does_not_collapse() {
    // Each request runs 100 µs and costs 10 µs of disk time (a tenth of the rate per shard):
    // one shard alone does 10_000 IOPS; two shards must do about twice that. Full-limit
    // reservations (as in Seastar's io_queue up to its issue #3201) would hand each shard 2 ms of
    // tokens per request and collapse to ~500 IOPS each.
    let run = |shards: usize| {
        let mut b = builder(shards).disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: u64::MAX / 4,
        }));
        let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
        let feeds = (0..shards)
            .map(|s| Feed::new(s, c, IoRequest::read(0), 1))
            .collect();
        let mut sim = Sim::new(b, ManualClock::new(), feeds);
        sim.latency = Duration::from_micros(100);
        sim.run(1000 * MS, DT);
        let iops: u64 = sim.requests.iter().sum();
        sim.drain();
        iops
    };
    let one = run(1);
    let two = run(2);
    println!("queue depth 1: one shard {one} IOPS, two shards {two} IOPS");
    assert!(one >= 9_000, "one shard: {one}");
    assert!(
        two as f64 >= 1.8 * one as f64,
        "two shards {two} vs one {one}"
    );
}

#[test]
fn an_idle_class_cannot_bank_its_idle_time() {
    let mut b = builder(1);
    let busy = b.add_class(ClassConfig::new("busy", 100)).unwrap();
    let late = b.add_class(ClassConfig::new("late", 100)).unwrap();
    let req = IoRequest::read(4096);
    let feeds = vec![
        Feed::new(0, busy, req, 256),
        Feed::new(0, late, req, 256).between(500 * MS, Duration::MAX),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(500 * MS, DT);
    let before = sim.tokens.clone();
    // 10 ms after the late class starts: with banking it would take them all.
    sim.run(510 * MS, DT);
    let busy_got = sim.tokens[0] - before[0];
    let late_got = sim.tokens[1] - before[1];
    println!("10 ms after waking: busy {busy_got}, late {late_got}");
    // Equal shares: the late class may lead by its idle credit (one reservation, 2 ms) and a
    // batch, never by the 500 ms it was idle.
    let limit = sim.shared.max_cost;
    assert!(late_got <= busy_got + 3 * limit, "{late_got} vs {busy_got}");
    assert!(busy_got > 0);
    sim.drain();
}

#[test]
fn per_class_bandwidth_cap_holds() {
    let mut b = builder(2);
    let capped = b
        .add_class(ClassConfig::new("capped", 1000).with_bandwidth_cap(Rate::per_second(100 << 20)))
        .unwrap();
    let other = b.add_class(ClassConfig::new("other", 1)).unwrap();
    let feeds = vec![
        Feed::new(0, capped, IoRequest::write(256 << 10), 16),
        Feed::new(1, capped, IoRequest::write(256 << 10), 16),
        Feed::new(1, other, IoRequest::read(4096), 64),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    let bytes = (sim.requests[0] + sim.requests[1]) * (256 << 10);
    let cap_bytes = (100u64 << 20) + (100 << 20) / 10 + (256 << 10);
    println!(
        "capped class: {} MiB in 1 s (cap 100 MiB/s); other class {} requests",
        bytes >> 20,
        sim.requests[2]
    );
    assert!(bytes <= cap_bytes, "{bytes} > {cap_bytes}");
    assert!(
        bytes >= (90 << 20),
        "the capped class should still get its cap: {bytes}"
    );
    // The rest of the disk goes to the other class despite its single share.
    assert!(sim.share(2) > 0.5, "other class share {}", sim.share(2));
    sim.drain();
}

#[test]
fn capped_mode_follows_completions() {
    // Requests run 10 ms; the limit (the latency goal's tokens) bounds what is in flight, so the rate is
    // what completions allow, not the configured one.
    let mut b = builder(1).capped(true);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let feeds = vec![Feed::new(0, c, IoRequest::read(4096), 1024)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.latency = 10 * MS;
    sim.run(1000 * MS, DT);
    let limit = sim.shared.budget.limit();
    let total: u64 = sim.tokens.iter().sum();
    // At most one limit in flight per 10 ms: 100 limits per second, plus the first.
    assert!(total <= 101 * limit, "{total}");
    // And at least what fits in whole reservations: a reservation (a batch, overshooting by
    // less than one request) that does not fit in what completions left waits for the next.
    let one = sim.shared.disk.cost(&IoRequest::read(4096));
    assert!(total >= 100 * (limit - sim.shared.batch - one), "{total}");
    // Uncapped, the same load gets the full rate.
    let mut b = builder(1).capped(false);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let mut free = Sim::new(
        b,
        ManualClock::new(),
        vec![Feed::new(0, c, IoRequest::read(4096), 1 << 16)],
    );
    free.latency = 10 * MS;
    free.run(1000 * MS, DT);
    let free_total: u64 = free.tokens.iter().sum();
    assert!(free_total >= 990_000_000, "{free_total}");
    sim.drain();
    free.drain();
}

#[test]
fn cancelled_requests_give_their_tokens_back() {
    let clock = ManualClock::new();
    let mut b = builder(1).clock(clock.clone());
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    let mut core = ShardCore::<Job>::new(shared.clone(), 0);
    let limit = shared.budget.limit();
    // First poll fills the bucket; use it all so that the next reservation waits.
    let cost = shared.max_cost;
    for _ in 0..2 {
        core.enqueue(Entry {
            class: c.0,
            cost,
            bytes: 0,
            submitted: Duration::ZERO,
            payload: Job {
                feed: 0,
                cancelled: false,
            },
        });
    }
    let mut got = 0;
    assert_eq!(core.poll(Duration::ZERO, &mut |_| got += 1), Next::Idle);
    assert_eq!(got, 2);
    assert_eq!(limit, 2 * cost);
    // Now queue one that is cancelled while it waits for its reservation.
    core.enqueue(Entry {
        class: c.0,
        cost,
        bytes: 0,
        submitted: Duration::ZERO,
        payload: Job {
            feed: 0,
            cancelled: false,
        },
    });
    let next = core.poll(Duration::ZERO, &mut |_| got += 1);
    assert_eq!(next, Next::WakeAfter(shared.budget.duration_for(cost)));
    let drained = core.drain();
    assert_eq!(drained.len(), 1);
    // The refund put the claimed tokens back: nothing is owed any more.
    let state = match &shared.budget {
        budget::Budget::Uncapped(b) => b.snapshot(),
        budget::Budget::Capped(b) => b.snapshot(),
    };
    assert_eq!(state.tokens(), 0);
    assert!(core.is_idle());
}

/// A class waking up while the only other class is between two requests (queue depth 1, so not
/// backlogged at that instant) is lifted relative to the front of virtual time: it does not
/// keep its stale virtual time and take the disk for ~250 ms.
#[test]
fn a_class_waking_next_to_a_queue_depth_one_class_does_not_bank() {
    let mut b = builder(1)
        .disk(DiskModel::symmetric(Figures {
            iops: 20_000,
            bandwidth: 200_000_000,
        }))
        .max_cost(500_000);
    let fg = b.add_class(ClassConfig::new("fg", 4)).unwrap();
    let bg = b.add_class(ClassConfig::new("bg", 1)).unwrap();
    let feeds = vec![
        Feed::new(0, fg, IoRequest::read(4096), 1),
        Feed::new(0, bg, IoRequest::write(80 << 10), 40).between(1000 * MS, 3000 * MS),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.latency = Duration::from_micros(20);
    sim.run(4000 * MS, DT);
    let st = sim.shards[0].stats();
    let (fg_max, bg_max) = (st[0].queue_wait_max(), st[1].queue_wait_max());
    println!(
        "queue depth 1 next to a waking class: fg max wait {fg_max:?}, bg max wait {bg_max:?}"
    );
    // At most one compaction piece (460 µs) ahead, its own tokens, and the 10 µs steps.
    assert!(fg_max <= 2 * MS, "{fg_max:?}");
    sim.drain();
}

fn class(b: &mut DispatcherBuilder, name: &str, shares: u32) -> ClassId {
    b.add_class(ClassConfig::new(name, shares)).unwrap()
}

/// A dispatcher of 1,000 tokens per second with a threshold of 100 (a replenish period of
/// 100 ms), requests of 1,000 tokens: one per second. The first fill (2,000) serves one request
/// per shard at once.
fn slow_sim(shards: usize) -> (Sim, ClassId) {
    let mut b = builder(shards)
        .rate(Rate::per_second(1000))
        .limit(2000)
        .threshold(100)
        .max_cost(1000)
        .batch(1000);
    let c = class(&mut b, "c", 100);
    let feeds = (0..shards)
        .map(|s| Feed::new(s, c, IoRequest::tokens(1000), 1).between(Duration::ZERO, 2 * MS))
        .collect();
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.latency = Duration::from_micros(1);
    (sim, c)
}

/// `Dispatcher::set_rate` wakes the shards, and every shard takes up the new rate within one
/// replenish period: after a 1,000× raise a waiting request is served in ~1 ms, not at its
/// old deadline (1 s).
#[test]
fn set_rate_wakes_every_shard() {
    let (mut sim, _) = slow_sim(2);
    // The first fill (1,000 tokens) serves one request; each shard's next waits for 1 s.
    sim.run(10 * MS, Duration::from_micros(1));
    assert_eq!(sim.requests.iter().sum::<u64>(), 2, "{:?}", sim.requests);
    sim.control(|s| s.set_rate(Rate::per_second(1_000_000)).unwrap());
    sim.run(20 * MS, Duration::from_micros(1));
    // 2,000 tokens at 10^6 per second: 2 ms, plus one replenish period (100 µs) per shard.
    let deadline = 10 * MS + 2 * MS + 2 * Duration::from_micros(100);
    println!("after a 1,000x raise at 10 ms: served at {:?}", sim.last);
    for (feed, at) in sim.last.iter().enumerate() {
        assert_eq!(sim.requests[feed], 2, "feed {feed}");
        assert!(*at <= deadline, "feed {feed} served at {at:?}");
    }
    sim.drain();
}

/// Through the dispatcher: the 10 ms before a raise earn 10 tokens at the
/// old rate, not 10,000 at the new one, so the waiting requests (1,980 tokens still owed) are
/// served no earlier than ~2 ms after the raise (the bucket's `set_rate` closes the old rate's
/// interval; `Dispatcher::set_rate` goes through it).
#[test]
fn set_rate_counts_the_time_before_at_the_old_rate() {
    let (mut sim, _) = slow_sim(2);
    sim.run(10 * MS, Duration::from_micros(1));
    sim.control(|s| s.set_rate(Rate::per_second(1_000_000)).unwrap());
    sim.run(20 * MS, Duration::from_micros(1));
    let served = *sim.last.iter().max().unwrap();
    // 10 tokens earned before the raise: the other 1,990 need 1.99 ms at the new rate.
    assert!(
        served >= 10 * MS + Duration::from_micros(1_990),
        "{served:?}"
    );
    sim.drain();
}

#[test]
fn a_lowered_rate_holds_within_a_replenish_period() {
    let mut b = builder(2).rate(Rate::per_second(100_000_000));
    let c = class(&mut b, "c", 100);
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, c, req, 64), Feed::new(1, c, req, 64)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(100 * MS, DT);
    sim.control(|s| s.set_rate(Rate::per_second(10_000_000)).unwrap());
    let before: u64 = sim.tokens.iter().sum();
    sim.run(1100 * MS, DT);
    let got = sim.tokens.iter().sum::<u64>() - before;
    println!("after lowering to 10^7 tokens/s: {got} tokens in 1 s");
    // The new rate, plus at most what the bucket held (its limit: 4 ms at the old rate) and
    // one reservation per shard.
    let slack = sim.shared.budget.limit() + 2 * sim.shared.batch;
    assert!(got <= 10_000_000 + slack, "{got}");
    assert!(got >= 9_900_000, "{got}");
    sim.drain();
}

/// A class waiting for its bandwidth cap does not sleep `cap.duration_for(missing)` —
/// nanoseconds for a few bytes — since the cap bucket adds bytes only in steps of its
/// threshold (1 ms of the cap): that would be hundreds of wake-ups where one suffices. Counts
/// the shard's polls; no timing.
#[test]
fn a_capped_class_does_not_busy_poll() {
    let mut b = builder(1);
    // 1,000,000 bytes per second: the cap bucket adds bytes in steps of 1,000 (1 ms).
    let capped = b
        .add_class(ClassConfig::new("capped", 100).with_bandwidth_cap(Rate::per_second(1_000_000)))
        .unwrap();
    // 1,010-byte requests: after each step the next request is a few bytes short, fewer
    // than a step.
    let feeds = vec![Feed::new(0, capped, IoRequest::write(1010), 1)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, Duration::from_micros(1));
    let requests = sim.requests[0];
    let polls = sim.shard_polls[0];
    let per_request = polls as f64 / requests as f64;
    println!("capped class: {requests} requests, {polls} polls ({per_request:.1} per request)");
    // The burst (100 ms of the cap), then one per ~1 ms.
    assert!(requests >= 900, "{requests}");
    // One poll when the request arrives (it claims its bytes) and one when they are there.
    assert!(per_request <= 2.0, "{per_request} polls per request");
    sim.drain();
}

#[test]
fn set_shares_takes_effect_on_every_shard() {
    let mut b = builder(2);
    let x = class(&mut b, "x", 100);
    let y = class(&mut b, "y", 100);
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, x, req, 256), Feed::new(1, y, req, 256)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(200 * MS, DT);
    let r = ratio(sim.tokens[0], sim.tokens[1]);
    assert!((r - 1.0).abs() <= 0.05, "before: {r}");
    sim.control(|s| s.set_shares(x, 400).unwrap());
    // Within a replenish period (20 µs) and a reservation: measure from 1 ms after.
    sim.run(201 * MS, DT);
    let before = sim.tokens.clone();
    sim.run(301 * MS, DT);
    let r = ratio(sim.tokens[0] - before[0], sim.tokens[1] - before[1]);
    println!("shares 1:1 changed to 4:1 across shards: {r:.3}");
    assert!((r / 4.0 - 1.0).abs() <= 0.10, "after: {r}");
    assert_eq!(sim.shards[0].stats()[0].shares, 400);
    sim.drain();
}

#[test]
fn set_bandwidth_cap_sets_changes_and_removes_a_cap() {
    let mut b = builder(2);
    let c = class(&mut b, "c", 100);
    let req = IoRequest::write(64 << 10);
    let feeds = vec![Feed::new(0, c, req, 16), Feed::new(1, c, req, 16)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    let bytes = |sim: &Sim| sim.requests.iter().sum::<u64>() * (64 << 10);
    sim.run(100 * MS, DT);
    let free = bytes(&sim);
    let window = |sim: &mut Sim, cap: Option<u64>, until: Duration| {
        sim.control(|s| {
            s.set_bandwidth_cap(c, cap.map(Rate::per_second)).unwrap();
        });
        let before = bytes(sim);
        sim.run(until, DT);
        bytes(sim) - before
    };
    let capped = window(&mut sim, Some(50 << 20), 600 * MS);
    let raised = window(&mut sim, Some(200 << 20), 1100 * MS);
    let removed = window(&mut sim, None, 1200 * MS);
    println!(
        "uncapped {} MiB/100 ms; cap 50 MiB/s: {} MiB/500 ms; 200 MiB/s: {} MiB/500 ms; \
         removed: {} MiB/100 ms",
        free >> 20,
        capped >> 20,
        raised >> 20,
        removed >> 20
    );
    // Each cap: its rate over 500 ms, plus its burst (100 ms) and one request per shard.
    let within = |got: u64, cap: u64| {
        // The reservations already made when the cap changed (one per shard, 250 µs of disk
        // time: up to 4 requests each) are not held back.
        let most = cap / 2 + cap / 10 + 8 * (64 << 10);
        assert!(
            got <= most && got >= cap / 2 * 9 / 10,
            "{got} for cap {cap}"
        );
    };
    within(capped, 50 << 20);
    within(raised, 200 << 20);
    assert!(removed * 10 >= free * 9, "{removed} vs {free}");
    sim.drain();
}

#[test]
fn a_high_priority_class_goes_first_within_the_rate() {
    // The high class (1 share) runs at queue depth 1; the normal classes (1,000 shares each)
    // saturate. A high request waits at most for the reservations already ahead of it in the
    // bucket (its shard's, the other shard's, and the one that shard may grab meanwhile:
    // 3 × 250 µs), and the normal classes share the rest 1:1.
    let mut b = builder(2).disk(DiskModel::symmetric(Figures {
        iops: 100_000,
        bandwidth: u64::MAX / 4,
    }));
    let hi = b
        .add_class(ClassConfig::new("hi", 1).with_priority(Priority::High))
        .unwrap();
    let x = class(&mut b, "x", 1000);
    let y = class(&mut b, "y", 1000);
    let req = IoRequest::read(0);
    let feeds = vec![
        Feed::new(0, hi, req, 1),
        Feed::new(0, x, req, 256),
        Feed::new(1, y, req, 256),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.latency = Duration::from_micros(100);
    sim.run(1000 * MS, DT);
    let total: u64 = sim.tokens.iter().sum();
    println!(
        "high priority at queue depth 1: {} requests ({:.3} of the tokens); normal {} and {}",
        sim.requests[0],
        sim.share(0),
        sim.tokens[1],
        sim.tokens[2]
    );
    let wait = sim.shards[0].stats()[0].queue_wait_max();
    println!("high priority: max queue wait {wait:?}");
    assert!(wait <= 800 * Duration::from_micros(1), "{wait:?}");
    assert!(sim.requests[0] >= 2_000, "{}", sim.requests[0]);
    assert!(total <= 1_000_000_000 + sim.shared.budget.limit());
    let r = ratio(sim.tokens[1], sim.tokens[2]);
    assert!((r - 1.0).abs() <= 0.10, "normal classes {r}");
    sim.drain();

    // Saturating, the high class takes the disk: the normal class gets at most a few
    // reservations that were already queued when the high class's arrived.
    let mut b = builder(2);
    let hi = b
        .add_class(ClassConfig::new("hi", 1).with_priority(Priority::High))
        .unwrap();
    let lo = class(&mut b, "lo", 1000);
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, hi, req, 256), Feed::new(1, lo, req, 256)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    sim.run(1000 * MS, DT);
    println!("saturating high class: {:.4} of the tokens", sim.share(0));
    assert!(sim.share(0) >= 0.99, "{}", sim.share(0));
    sim.drain();
}

/// Shares hold while virtual time crosses its wrap.
#[test]
fn shares_hold_across_the_virtual_time_wrap() {
    let mut b = builder(2);
    let hi = class(&mut b, "hi", 400);
    let lo = class(&mut b, "lo", 100);
    let req = IoRequest::read(4096);
    let feeds = vec![Feed::new(0, hi, req, 256), Feed::new(1, lo, req, 256)];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    // ~2e9 virtual units per second for these classes: they wrap after ~0.5 s.
    sim.shared.classes.fair().start_at(u64::MAX - 1_000_000_000);
    sim.run(1000 * MS, DT);
    let v = sim.shared.classes.vtime(hi.0);
    assert!(v < 1 << 40, "did not wrap: {v}");
    let r = ratio(sim.tokens[0], sim.tokens[1]);
    println!("4:1 across the wrap: {r:.3}");
    assert!((r / 4.0 - 1.0).abs() <= 0.10, "{r}");
    sim.drain();
}

/// A disk like this project's virtio disk, stated explicitly (random 4 KiB reads ~10k IOPS at
/// queue depth 1, writes ~1 GB/s).
const VIRTIO: DiskModel = DiskModel::new(
    Figures {
        iops: 20_000,
        bandwidth: 400_000_000,
    },
    Figures {
        iops: 20_000,
        bandwidth: 1_000_000_000,
    },
);

/// Background pieces as large as the dispatcher issues them, `depth` of them outstanding per
/// shard: a compaction with a deep backlog.
fn backlog(sim_shared: &Shared, shard: usize, class: ClassId, depth: usize) -> Feed {
    let piece = sim_shared
        .disk
        .max_aligned_bytes_within(IoKind::Write, sim_shared.max_cost)
        .expect("a 4 KiB block fits the default max_cost");
    Feed::new(shard, class, IoRequest::write(piece), depth)
}

fn goal_sim(capped: bool, speed: f64) -> Sim {
    let mut b = builder(2).disk(VIRTIO).capped(capped);
    let fg = b.add_class(ClassConfig::new("fg", 800)).unwrap();
    let bg = b.add_class(ClassConfig::new("bg", 200)).unwrap();
    let mut sim = Sim::new(b, ManualClock::new(), Vec::new());
    sim.feeds = vec![
        Feed::new(0, fg, IoRequest::read(4096), 8),
        backlog(&sim.shared, 0, bg, 64),
        backlog(&sim.shared, 1, bg, 64),
    ];
    sim.tokens = vec![0; 3];
    sim.requests = vec![0; 3];
    sim.last = vec![Duration::ZERO; 3];
    sim.latencies = vec![Vec::new(); 3];
    sim.disk_speed = Some(speed);
    sim
}

/// The latency goal bounds the disk time in flight: with capped release (the default) the tokens
/// dispatched and not yet completed never exceed the goal's, even when the disk is 30% slower
/// than its model. Uncapped, the bucket keeps dispatching at the model's rate and the slow
/// disk's queue grows without bound.
#[test]
fn in_flight_disk_time_never_exceeds_the_latency_goal() {
    let goal = Dispatcher::builder().latency_goal;
    let goal_tokens = goal.as_nanos() as u64;
    for speed in [1.0, 0.7] {
        let mut sim = goal_sim(true, speed);
        assert_eq!(sim.shared.budget.limit(), goal_tokens);
        sim.run(300 * MS, DT);
        println!(
            "capped, disk at {speed}× its model: most in flight {} µs of disk time (goal {goal:?})",
            sim.max_in_flight / 1000
        );
        assert!(sim.max_in_flight <= goal_tokens, "{}", sim.max_in_flight);
        // Still busy: the disk is kept at least half full of work (no collapse).
        let done: u64 = sim.tokens.iter().sum();
        assert!(done as f64 >= 0.5 * 0.3e9 * speed, "{done}");
        sim.drain();
    }
    let mut free = goal_sim(false, 0.7);
    free.run(300 * MS, DT);
    println!(
        "uncapped, disk at 0.7× its model: most in flight {} µs of disk time",
        free.max_in_flight / 1000
    );
    assert!(
        free.max_in_flight > 20 * goal_tokens,
        "{}",
        free.max_in_flight
    );
    free.drain();
}

/// A foreground read arriving behind a deep compaction backlog is served within about the goal:
/// at most the goal's disk time in flight, one reservation per shard (a batch and a piece)
/// granted ahead of it, and its own cost. The same load on an uncapped dispatcher with a 4 ms
/// limit makes it wait behind the whole burst.
#[test]
fn a_foreground_read_behind_a_large_background_backlog_waits_about_the_goal() {
    let run = |old: bool| {
        let mut b = builder(2).disk(VIRTIO);
        if old {
            b = b.capped(false).latency_goal(4 * MS);
        }
        let fg = b.add_class(ClassConfig::new("fg", 800)).unwrap();
        let bg = b.add_class(ClassConfig::new("bg", 200)).unwrap();
        let mut sim = Sim::new(b, ManualClock::new(), Vec::new());
        sim.feeds = vec![
            backlog(&sim.shared, 0, bg, 256),
            backlog(&sim.shared, 1, bg, 256),
            // Queue depth 1, arriving once the backlog is established.
            Feed::new(0, fg, IoRequest::read(4096), 1).between(100 * MS, Duration::MAX),
        ];
        sim.tokens = vec![0; 3];
        sim.requests = vec![0; 3];
        sim.last = vec![Duration::ZERO; 3];
        sim.latencies = vec![Vec::new(); 3];
        sim.disk_speed = Some(1.0);
        sim.run(600 * MS, DT);
        let fg_stats = &sim.shards[0].stats()[fg.index()];
        let bound = sim.shared.latency_goal.as_nanos() as u64
            + 2 * (sim.shared.batch + sim.shared.max_cost)
            + sim.shared.disk.cost(&IoRequest::read(4096))
            + 2 * DT.as_nanos() as u64;
        let out = (
            fg_stats.latency_max(),
            fg_stats.latency_p99(),
            fg_stats.completed,
            Duration::from_nanos(bound),
        );
        let bg_tokens = sim.tokens[0] + sim.tokens[1];
        sim.drain();
        (out, bg_tokens)
    };
    let ((max, p99, n, bound), bg_tokens) = run(false);
    let ((old_max, old_p99, _, _), _) = run(true);
    println!(
        "fg read behind a backlog: max {max:?} p99 {p99:?} over {n} reads (bound {bound:?}); \
         old defaults: max {old_max:?} p99 {old_p99:?}"
    );
    assert!(n > 100, "{n}");
    assert!(max <= bound, "{max:?} > {bound:?}");
    assert!(old_p99 > 2 * p99, "{old_p99:?} vs {p99:?}");
    // The compaction still gets most of the disk (the reads are a small load).
    assert!(bg_tokens as f64 >= 0.8 * 0.6e9, "{bg_tokens}");
}

/// 1 MiB writes at the default settings are split, not refused, into 4 KiB-aligned pieces that
/// cover the request exactly and each cost at most `max_cost` (within the goal).
#[test]
fn one_mib_write_splits_into_aligned_pieces_within_the_goal() {
    for disk in [
        VIRTIO,
        NVME,
        DiskModel::symmetric(Figures {
            iops: 5_000,
            bandwidth: 150_000_000,
        }),
    ] {
        let mut b = builder(1).disk(disk);
        b.add_class(ClassConfig::new("c", 1)).unwrap();
        let (shared, _) = b.shared().unwrap();
        assert!(shared.max_cost <= shared.latency_goal.as_nanos() as u64);
        let max = shared
            .disk
            .max_aligned_bytes_within(IoKind::Write, shared.max_cost)
            .unwrap();
        let pieces = cost::split(1 << 20, max).unwrap();
        assert_eq!(pieces.iter().map(Piece::len).sum::<u64>(), 1 << 20);
        for p in &pieces {
            assert_eq!(p.range.start % SPLIT_ALIGN, 0);
            assert_eq!(p.len() % SPLIT_ALIGN, 0);
            assert!(shared.disk.cost(&IoRequest::write(p.len())) <= shared.max_cost);
        }
    }
}

/// The p99 of `samples`.
fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[(samples.len() * 99).div_ceil(100) - 1]
}

/// Latency-target mode on a modelled disk that really serves half of what
/// the dispatcher's rate assumes (so the dispatcher alone would queue work in the disk, and
/// latency grows with the queued disk time). A foreground class protects its p99 of 5 ms; a
/// compaction starts at 1 s. Within 2 s of that load change the foreground meets its target,
/// and the compaction gets at least 80% of the disk time the foreground leaves.
#[test]
fn latency_target_mode_protects_p99_and_leaves_the_rest() {
    let target = 5 * MS;
    let disk = DiskModel::symmetric(Figures {
        iops: 100_000,
        bandwidth: 500_000_000,
    });
    let mut b = builder(2).disk(disk);
    let fg = b
        .add_class(ClassConfig::new("fg", 100).with_latency_target(target))
        .unwrap();
    let bg = class(&mut b, "bg", 100);
    let feeds = vec![
        Feed::new(0, fg, IoRequest::read(16 << 10), 4),
        Feed::new(1, bg, IoRequest::write(128 << 10), 32).between(1000 * MS, Duration::MAX),
    ];
    let mut sim = Sim::new(b, ManualClock::new(), feeds);
    // The real disk: half the dispatcher's (default) rate.
    let disk_rate = 500_000_000;
    sim.disk_rate = Some(disk_rate);
    let (from, to) = (3000 * MS, 10_000 * MS);
    sim.run(from, Duration::from_micros(20));
    let before = sim.tokens.clone();
    sim.run(to, Duration::from_micros(20));
    let window: Vec<_> = sim.latencies[0]
        .iter()
        .filter(|(at, _)| *at >= from)
        .map(|(_, l)| *l)
        .collect();
    let fg_p99 = p99(window);
    // Disk time (at the real disk's speed) each class used in the window.
    let busy = |feed: usize| (sim.tokens[feed] - before[feed]) as f64 * 1e9 / disk_rate as f64;
    let span = (to - from).as_nanos() as f64;
    let left = span - busy(0);
    let bg_share = busy(1) / left;
    let before_change: Vec<_> = sim.latencies[0]
        .iter()
        .filter(|(at, _)| *at < 1000 * MS)
        .map(|(_, l)| *l)
        .collect();
    println!(
        "latency target 5 ms: fg p99 {:?} alone, {fg_p99:?} from 2 s after compaction started; \
         compaction used {bg_share:.3} of the disk time fg left (budget now {} tokens/s)",
        p99(before_change),
        sim.shared.classes.latency().unwrap().rate()
    );
    assert!(fg_p99 <= target, "fg p99 {fg_p99:?}");
    assert!(
        bg_share >= 0.8,
        "compaction got {bg_share:.3} of what was left"
    );
    sim.drain();
}

/// Capped mode shares one in-flight budget (the goal) among all classes: when the host stalls
/// writes, stalled background writes held all of it and a foreground read waited for them to
/// complete, the whole stall (the real-disk main job's foreground queue-wait p99 of 3–8 ms).
/// With the background bounded to half the goal in flight
/// ([`ClassConfig::with_max_in_flight`]), the other half stays free for the reads: their
/// latency stays within about the goal through a 20 ms write stall, and the compaction still
/// gets most of the disk outside it.
#[test]
fn stalled_background_writes_do_not_hold_foreground_reads_behind_them() {
    let run = |bounded: bool| {
        let goal = DispatcherBuilder::DEFAULT_LATENCY_GOAL;
        let mut b = builder(2).disk(VIRTIO);
        let fg = b.add_class(ClassConfig::new("fg", 800)).unwrap();
        let mut bg_config = ClassConfig::new("bg", 200);
        if bounded {
            bg_config = bg_config.with_max_in_flight(goal / 2);
        }
        let bg = b.add_class(bg_config).unwrap();
        let mut sim = Sim::new(b, ManualClock::new(), Vec::new());
        sim.feeds = vec![
            Feed::new(0, fg, IoRequest::read(4096), 4),
            backlog(&sim.shared, 0, bg, 64),
            backlog(&sim.shared, 1, bg, 64),
        ];
        sim.tokens = vec![0; 3];
        sim.requests = vec![0; 3];
        sim.last = vec![Duration::ZERO; 3];
        sim.latencies = vec![Vec::new(); 3];
        sim.disk_speed = Some(1.0);
        sim.write_stall = Some((200 * MS, 220 * MS));
        sim.run(400 * MS, DT);
        let fg_stats = sim.shards[0].stats()[fg.index()].clone();
        let bg_tokens = sim.tokens[1] + sim.tokens[2];
        let bg_in_flight_max = if bounded {
            Some(sim.shared.classes.in_flight(bg.index()))
        } else {
            None
        };
        let bound = goal.as_nanos() as u64
            + 2 * (sim.shared.batch + sim.shared.max_cost)
            + sim.shared.disk.cost(&IoRequest::read(4096))
            + 2 * DT.as_nanos() as u64;
        sim.drain();
        (
            fg_stats.latency_max(),
            fg_stats.latency_p99(),
            fg_stats.completed,
            bg_tokens,
            bg_in_flight_max,
            Duration::from_nanos(bound),
        )
    };
    let (max, p99, n, bg_tokens, _, bound) = run(true);
    let (old_max, old_p99, _, old_bg, _, _) = run(false);
    println!(
        "20 ms write stall: fg max {max:?} p99 {p99:?} over {n} reads, bg {bg_tokens} tokens \
         (bound {bound:?}); unbounded bg: fg max {old_max:?} p99 {old_p99:?}, bg {old_bg} tokens"
    );
    assert!(n > 1000, "{n}");
    assert!(max <= bound, "{max:?} > {bound:?}");
    // Without the bound a read waits for the stall to end.
    assert!(old_max >= 10 * MS, "{old_max:?}");
    // The compaction keeps most of what it had: the disk outside the stall (400 ms) at
    // least 80% of what the unbounded one moved.
    assert!(
        bg_tokens as f64 >= 0.8 * old_bg as f64,
        "{bg_tokens} vs {old_bg}"
    );
}

/// The in-flight bound holds across shards and is given back on completion and cancellation:
/// never more than the bound (or one request alone) of the class in flight, nothing left
/// counted once everything completed or was drained.
#[test]
fn the_in_flight_bound_holds_across_shards_and_returns_to_zero() {
    let mut b = builder(2).disk(VIRTIO);
    let bound = 300 * 1000; // 300 µs of disk time: two 64 KiB writes (115 µs each), not three
    let bg = b
        .add_class(ClassConfig::new("bg", 200).with_max_in_flight(Duration::from_nanos(bound)))
        .unwrap();
    let mut sim = Sim::new(b, ManualClock::new(), Vec::new());
    sim.feeds = vec![
        Feed::new(0, bg, IoRequest::write(64 << 10), 16),
        Feed::new(1, bg, IoRequest::write(64 << 10), 16),
    ];
    sim.tokens = vec![0; 2];
    sim.requests = vec![0; 2];
    sim.last = vec![Duration::ZERO; 2];
    sim.latencies = vec![Vec::new(); 2];
    sim.disk_speed = Some(1.0);
    let piece = sim.shared.disk.cost(&sim.feeds[0].request);
    let mut most = 0;
    for _ in 0..100 {
        sim.run(sim.now + MS, DT);
        let counted = sim.shared.classes.in_flight(bg.index());
        assert_eq!(
            counted,
            sim.in_flight() + reserved(&sim),
            "counted vs running"
        );
        most = most.max(counted);
    }
    println!("bound {bound} tokens, pieces of {piece}: most in flight {most}");
    assert!(most <= bound, "{most}");
    // The bound is used: two pieces at once.
    assert!(most >= 2 * piece, "{most}");
    // Both shards moved work.
    assert!(sim.tokens[0] > 0 && sim.tokens[1] > 0, "{:?}", sim.tokens);
    sim.feeds.iter_mut().for_each(|f| f.stop = Duration::ZERO);
    sim.drain();
    sim.run(sim.now + 10 * MS, DT);
    assert_eq!(sim.shared.classes.in_flight(bg.index()), 0);
}

/// Tokens of reservations not yet dispatched, all shards.
fn reserved(sim: &Sim) -> u64 {
    sim.shards.iter().map(|s| s.reserved_tokens()).sum()
}

#[test]
fn a_zero_in_flight_bound_is_refused() {
    let mut b = builder(1);
    let e = b
        .add_class(ClassConfig::new("bg", 1).with_max_in_flight(Duration::ZERO))
        .unwrap_err();
    assert!(
        matches!(e, crate::BuildError::ZeroInFlightBound { .. }),
        "{e}"
    );
}

/// A payload whose cancellation the test decides after it was queued.
#[derive(Debug)]
struct Flag(std::rc::Rc<std::cell::Cell<bool>>);

impl Payload for Flag {
    fn is_cancelled(&self) -> bool {
        self.0.get()
    }
}

fn flagged(class: ClassId, cost: u64) -> (Entry<Flag>, std::rc::Rc<std::cell::Cell<bool>>) {
    let flag = std::rc::Rc::new(std::cell::Cell::new(false));
    let entry = Entry {
        class: class.0,
        cost,
        bytes: 0,
        submitted: Duration::ZERO,
        payload: Flag(flag.clone()),
    };
    (entry, flag)
}

/// A request cancelled while its shard waits for its reservation's tokens gives them back as
/// a cancelled throttle claim does (as if never made): neither its shard nor the shard whose
/// reservation lies behind it waits for those tokens to accrue, and nothing is over-granted.
#[test]
fn a_request_cancelled_while_its_tokens_accrue_gives_them_back_at_once() {
    let clock = ManualClock::new();
    // One token per microsecond; uncapped, so only the rate decides when tokens are there.
    let mut b = builder(2)
        .clock(clock.clone())
        .capped(false)
        .rate(Rate::per_second(1_000_000));
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    let (mut first, mut second) = (
        ShardCore::<Flag>::new(shared.clone(), 0),
        ShardCore::<Flag>::new(shared.clone(), 1),
    );
    let cost = shared.max_cost;
    // An empty bucket at t = 0.
    shared.budget.replenish_at(Duration::ZERO);
    shared.budget.grab(shared.budget.limit());
    let (entry, cancel) = flagged(c, cost);
    first.enqueue(entry);
    let wait = shared.budget.duration_for(cost);
    assert_eq!(
        first.poll(Duration::ZERO, &mut |_| {}),
        Next::WakeAfter(wait)
    );
    // The second shard's reservation lies behind the first's.
    let (entry, _) = flagged(c, cost);
    second.enqueue(entry);
    assert_eq!(
        second.poll(Duration::ZERO, &mut |_| {}),
        Next::WakeAfter(shared.budget.duration_for(2 * cost))
    );
    // Nothing cancelled yet: the shard's wake-up on cancellation stays quiet.
    let waker = futures_noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(first.poll_reservation_cancelled(&mut cx).is_pending());
    cancel.set(true);
    assert!(first.poll_reservation_cancelled(&mut cx).is_ready());
    // The first shard gives the claim back at once, not at `wait`.
    let mut dispatched = 0;
    assert_eq!(
        first.poll(Duration::ZERO, &mut |_| dispatched += 1),
        Next::Idle
    );
    assert_eq!(dispatched, 0);
    assert!(first.is_idle());
    // The second now waits only for its own tokens.
    assert_eq!(
        second.poll(Duration::ZERO, &mut |_| {}),
        Next::WakeAfter(wait)
    );
    // Not a token early: just before they accrue it still waits, then it goes.
    let before = wait - Duration::from_micros(1);
    clock.set(before).unwrap();
    assert!(matches!(
        second.poll(before, &mut |_| dispatched += 1),
        Next::WakeAfter(_)
    ));
    assert_eq!(dispatched, 0);
    // The next replenish (20 µs later) finds them there.
    let then = before + Duration::from_micros(20);
    clock.set(then).unwrap();
    assert_eq!(second.poll(then, &mut |_| dispatched += 1), Next::Idle);
    assert_eq!(dispatched, 1);
    assert_eq!(shared.budget.deficiency(shared.budget.snapshot().tail), 0);
    // Exactly what accrued since the claim's tokens were there: nothing over-granted.
    assert_eq!(
        shared.budget.snapshot().tokens(),
        (then - wait).as_micros() as i64,
        "nothing over-granted"
    );
}

/// A waker that does nothing (the test polls by hand).
fn futures_noop_waker() -> std::task::Waker {
    std::task::Waker::noop().clone()
}

/// Re-applying a cap every 50 ms (the same value, or alternating between two close values) lets
/// through no more than the cap over the whole time plus one burst: an unchanged cap is a no-op,
/// and a changed one carries over what the class just used instead of a fresh full burst.
#[test]
fn reapplying_a_cap_often_never_adds_bursts() {
    for alternate in [false, true] {
        let mut b = builder(2);
        let c = class(&mut b, "c", 100);
        let req = IoRequest::write(64 << 10);
        let feeds = vec![Feed::new(0, c, req, 16), Feed::new(1, c, req, 16)];
        let mut sim = Sim::new(b, ManualClock::new(), feeds);
        let bytes = |sim: &Sim| sim.requests.iter().sum::<u64>() * (64 << 10);
        let cap = |i: u64| {
            Rate::per_second(if alternate && i % 2 == 1 {
                17 << 20
            } else {
                16 << 20
            })
        };
        sim.control(|s| {
            assert!(s.set_bandwidth_cap(c, Some(cap(0))).unwrap());
        });
        let before = bytes(&sim);
        for i in 1..=20u64 {
            sim.run(Duration::from_millis(50 * i), DT);
            sim.control(|s| {
                let changed = s.set_bandwidth_cap(c, Some(cap(i))).unwrap();
                assert_eq!(changed, alternate, "an unchanged cap is a no-op");
            });
        }
        let got = bytes(&sim) - before;
        // 1 s at the higher cap, one burst (100 ms of it) and the reservations in flight when
        // the cap was set (one per shard, up to 4 requests each).
        let most = (17 << 20) + (17 << 20) / 10 + 8 * (64 << 10);
        println!(
            "cap re-applied every 50 ms (alternating: {alternate}): {} KiB in 1 s",
            got >> 10
        );
        assert!(got <= most, "{got} bytes in 1 s, at most {most}");
        assert!(
            got >= (16 << 20) * 9 / 10,
            "{got} bytes in 1 s: the cap still runs"
        );
        sim.drain();
    }
}

/// Requests dispatched on their callers' threads next to a backlogged class keep the shares:
/// a class goes from its caller only while the fairness rules would let its shard reserve for
/// it, and pays the same virtual time.
#[test]
fn requests_from_callers_next_to_a_backlogged_class_keep_4_to_1() {
    for shards in [1, 2] {
        let mut b = builder(shards).caller_dispatch(true);
        let fg = b.add_class(ClassConfig::new("fg", 400)).unwrap();
        let bg = b.add_class(ClassConfig::new("bg", 100)).unwrap();
        let req = IoRequest::read(4096);
        let feeds = vec![
            Feed::new(0, fg, req, 64).submitted_by_callers(),
            Feed::new(shards - 1, bg, req, 64),
        ];
        let mut sim = Sim::new(b, ManualClock::new(), feeds);
        sim.latency = Duration::from_micros(100);
        sim.run(1000 * MS, DT);
        let r = ratio(sim.tokens[0], sim.tokens[1]);
        println!(
            "4:1 with the fast path, {shards} shard(s): {r:.3} ({} of {} fg requests from callers)",
            sim.fast[0], sim.requests[0]
        );
        assert!(sim.fast[0] > 0, "no request went from its caller");
        assert!((r / 4.0 - 1.0).abs() <= 0.05, "ratio {r}");
        sim.drain();
    }
}

/// A request goes from its caller's thread only when nothing of its class waits (FIFO within
/// the class) and its tokens are there now.
#[test]
fn a_request_goes_from_its_caller_only_with_nothing_of_its_class_waiting() {
    let clock = ManualClock::new();
    let mut b = builder(1)
        .clock(clock.clone())
        .capped(false)
        .caller_dispatch(true);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let other = b.add_class(ClassConfig::new("other", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    let mut core = ShardCore::<Flag>::new(shared.clone(), 0);
    let cost = shared.disk.cost(&IoRequest::read(4096));
    assert!(shared.try_fast(c.0, 0, cost, Duration::ZERO));
    // One of the class queued: the next waits behind it, even with tokens there.
    let (entry, _) = flagged(c, cost);
    core.enqueue(entry);
    assert!(shared.budget.available() >= cost);
    assert!(!shared.try_fast(c.0, 0, cost, Duration::ZERO));
    // Another class is not held by it.
    assert!(shared.try_fast(other.0, 0, cost, Duration::ZERO));
    let mut went = 0;
    assert_eq!(core.poll(Duration::ZERO, &mut |_| went += 1), Next::Idle);
    assert_eq!(went, 1);
    assert!(shared.try_fast(c.0, 0, cost, Duration::ZERO));
    // An empty bucket: the shard's path, which waits for the tokens.
    shared.budget.grab(shared.budget.available());
    assert!(!shared.try_fast(c.0, 0, cost, Duration::ZERO));
    // The default: for files only (their pieces), not for submitted futures.
    let mut b = builder(1);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    assert!(shared.caller_files && !shared.caller_dispatch);
    assert!(shared.try_fast(c.0, 0, cost, Duration::ZERO));
    // Off: never.
    let mut b = builder(1).caller_dispatch(false);
    let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    assert!(!shared.caller_files && !shared.caller_dispatch);
    assert!(!shared.try_fast(c.0, 0, cost, Duration::ZERO));
}

/// A caller-dispatching dispatcher with classes fg (400 shares) and bg (100), tokens in the
/// bucket, and one request of `cost` (a 4 KiB read) of bg waiting in the shard's queue.
struct BgWaiting {
    shared: Arc<Shared>,
    core: ShardCore<Flag>,
    fg: ClassId,
    bg: ClassId,
    cost: u64,
}

fn bg_waiting() -> BgWaiting {
    let mut b = builder(1).capped(false).caller_dispatch(true);
    let fg = b.add_class(ClassConfig::new("fg", 400)).unwrap();
    let bg = b.add_class(ClassConfig::new("bg", 100)).unwrap();
    let (shared, _) = b.shared().unwrap();
    let mut core = ShardCore::<Flag>::new(shared.clone(), 0);
    let cost = shared.disk.cost(&IoRequest::read(4096));
    shared.budget.replenish_at(Duration::ZERO);
    let (entry, _) = flagged(bg, cost);
    core.enqueue(entry);
    BgWaiting {
        shared,
        core,
        fg,
        bg,
        cost,
    }
}

/// The shares hold for requests from callers: a class whose virtual time is ahead of a
/// backlogged class's by more than the window waits in its shard's queue even with tokens in
/// the bucket, and a class that was idle banks no credit (its virtual time is lifted as when it
/// becomes backlogged).
#[test]
fn a_request_goes_from_its_caller_only_when_the_shares_let_its_class_go() {
    let BgWaiting {
        shared,
        mut core,
        fg,
        bg,
        cost,
    } = bg_waiting();
    // fg far ahead of the backlogged bg.
    shared.classes.charge(fg.0, 0, 100 * shared.batch);
    assert!(shared.budget.available() >= cost);
    assert!(!shared.try_fast(fg.0, 0, cost, Duration::ZERO));
    // bg catches up (it was served a lot): fg may go again.
    shared.classes.charge(bg.0, 0, 100 * shared.batch);
    let before = shared.classes.vtime(fg.0);
    assert!(shared.try_fast(fg.0, 0, cost, Duration::ZERO));
    assert!(shared.classes.vtime(fg.0) > before, "charged");
    // fg idle while bg is served far more: its first request from a caller starts from bg's
    // virtual time less the idle credit, not from where it stopped.
    shared.classes.charge(bg.0, 0, 10_000 * shared.batch);
    let bg_v = shared.classes.vtime(bg.0);
    assert!(shared.try_fast(fg.0, 0, cost, Duration::ZERO));
    let credit = shared.batch * crate::dispatcher::fair::SCALE / 400;
    assert!(
        crate::bucket::ahead(shared.classes.vtime(fg.0), bg_v.wrapping_sub(credit)) >= 0,
        "fg banked its idle time"
    );
    core.drain();
}

/// A saturating class on a disk that keeps the model's pace only on average (as real disks
/// do: slower for a moment, then faster) gets the model's rate at the default latency goal:
/// the tokens `ceil` holds back while the disk is behind are kept (up to the limit) for when
/// it catches up, instead of being discarded, so the disk time in flight still never exceeds
/// the goal and nothing is lost to the swings.
#[test]
fn a_saturating_class_gets_the_rate_from_a_disk_that_keeps_the_pace_on_average() {
    for (bytes, swing) in [(64 << 10, 0.5), (64 << 10, 0.3), (16 << 10, 0.5)] {
        let mut b = builder(1).disk(VIRTIO);
        let c = b.add_class(ClassConfig::new("c", 100)).unwrap();
        let feeds = vec![Feed::new(0, c, IoRequest::read(bytes), 256)];
        let mut sim = Sim::new(b, ManualClock::new(), feeds);
        sim.disk_speed = Some(1.0);
        sim.disk_swing = Some((0x9E37_79B9_7F4A_7C15, swing));
        sim.run(100 * MS, Duration::from_micros(1));
        let before = sim.tokens[0];
        sim.run(1100 * MS, Duration::from_micros(1));
        let got = (sim.tokens[0] - before) as f64 / 1e9;
        println!(
            "{bytes} B reads, service times 1 ± {swing} of the model's: {got:.4} of the rate, most in flight {} µs",
            sim.max_in_flight / 1000
        );
        assert!(sim.max_in_flight <= sim.shared.budget.limit());
        assert!(
            got >= 0.985,
            "{bytes} B, swing {swing}: {got:.4} of the rate"
        );
        sim.drain();
    }
}

/// A class with requests waiting and a smaller virtual time is served first: a request from a
/// caller does not take the tokens its shard would give that class, even with a lead the
/// fairness window would allow between shards.
#[test]
fn a_request_from_its_caller_does_not_overtake_a_waiting_class_behind_it() {
    let BgWaiting {
        shared,
        mut core,
        fg,
        bg,
        cost,
    } = bg_waiting();
    // fg just ahead of the waiting bg.
    while crate::bucket::ahead(shared.classes.vtime(fg.0), shared.classes.vtime(bg.0)) <= 0 {
        shared.classes.charge(fg.0, 0, cost);
    }
    assert!(
        shared.classes.may_go_now(fg.0, 0).is_ok(),
        "within the window"
    );
    assert!(shared.budget.available() >= 2 * cost, "tokens there");
    assert!(!shared.try_fast(fg.0, 0, cost, Duration::ZERO));
    // bg served: nothing waits behind fg any more.
    let mut went = 0;
    assert_eq!(core.poll(Duration::ZERO, &mut |_| went += 1), Next::Idle);
    assert_eq!(went, 1);
    assert!(shared.try_fast(fg.0, 0, cost, Duration::ZERO));
    core.drain();
}
