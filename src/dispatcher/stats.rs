//! Per-class statistics: requests, bytes, tokens, queue length, and three latency
//! distributions per class: queue wait (submission → dispatch), service time (dispatch →
//! completion) and end-to-end latency (submission → completion).
//!
//! Queue wait alone under-reports what a caller sees: on a real disk most of a request's time
//! can be spent *after* dispatch, queued in the device behind other work (3–7× at p99 on this
//! project's virtio disk). The end-to-end figure is the one to compare with a target.
//!
//! Each shard records into its own [`ClassRecorder`]s (plain fields, no atomics, no locks);
//! [`Dispatcher::stats`](super::Dispatcher::stats) asks every shard for a copy through its
//! channel and merges them.

use std::time::Duration;

use hdrhistogram::Histogram;

use crate::sync::Ordering;

use super::state::Shared;

/// Durations are recorded in nanoseconds from 1 ns to one hour, with 2 significant digits
/// (percentiles within 1%); longer ones count as one hour.
const MAX_WAIT_NS: u64 = 3_600_000_000_000;
const SIGFIG: u8 = 2;

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_WAIT_NS, SIGFIG).expect("constant bounds are valid")
}

/// What a shard records for one class.
#[derive(Debug, Clone)]
pub(crate) struct ClassRecorder {
    pub(crate) requests: u64,
    pub(crate) bytes: u64,
    pub(crate) tokens: u64,
    pub(crate) cancelled: u64,
    /// Requests that completed (their future ended, or was torn down).
    pub(crate) completed: u64,
    /// Tokens of the requests dispatched and not yet completed.
    pub(crate) in_flight_tokens: u64,
    queue_wait: Histogram<u64>,
    service: Histogram<u64>,
    latency: Histogram<u64>,
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    h.saturating_record(ns.max(1));
}

impl ClassRecorder {
    pub(crate) fn new() -> Self {
        ClassRecorder {
            requests: 0,
            bytes: 0,
            tokens: 0,
            cancelled: 0,
            completed: 0,
            in_flight_tokens: 0,
            queue_wait: new_histogram(),
            service: new_histogram(),
            latency: new_histogram(),
        }
    }

    /// A request dispatched after waiting `wait` in the queue.
    pub(crate) fn dispatched(&mut self, bytes: u64, tokens: u64, wait: Duration) {
        self.requests += 1;
        self.bytes += bytes;
        self.tokens += tokens;
        self.in_flight_tokens += tokens;
        record(&mut self.queue_wait, wait);
    }

    /// A dispatched request of `tokens` completed, `service` after its dispatch and `latency`
    /// after its submission.
    pub(crate) fn completed(&mut self, tokens: u64, service: Duration, latency: Duration) {
        self.completed += 1;
        self.in_flight_tokens = self.in_flight_tokens.saturating_sub(tokens);
        record(&mut self.service, service);
        record(&mut self.latency, latency);
    }

    /// A copy of the figures; `queued` is how many requests of the class wait on the shard.
    pub(crate) fn snapshot(&self, name: &str, shares: u32, queued: u64) -> ClassStats {
        ClassStats {
            name: name.to_owned(),
            shares,
            requests: self.requests,
            bytes: self.bytes,
            tokens: self.tokens,
            cancelled: self.cancelled,
            completed: self.completed,
            queued,
            in_flight: self.requests - self.completed,
            in_flight_tokens: self.in_flight_tokens,
            queue_wait: self.queue_wait.clone(),
            service: self.service.clone(),
            latency: self.latency.clone(),
        }
    }
}

/// One class's figures (on one shard, or merged over all shards).
///
/// Counters count dispatched requests (their futures were started); `cancelled` counts requests
/// whose handle was dropped before dispatch. `queued`, `in_flight` and `in_flight_tokens` are
/// gauges: their value when the snapshot was taken (an interval from
/// [`DispatcherStats::since`] keeps the later value).
///
/// Three distributions, each with `*_quantile`, `*_p50`, `*_p99` and `*_max`:
///
/// | | from | to |
/// |---|---|---|
/// | `queue_wait` | submission | dispatch (the future is started) |
/// | `service` | dispatch | completion (the future ended) |
/// | `latency` | submission | completion: end to end |
#[derive(Debug, Clone)]
pub struct ClassStats {
    /// The class's name.
    pub name: String,
    /// The class's shares.
    pub shares: u32,
    /// Requests dispatched (a split request counts once per piece).
    pub requests: u64,
    /// Bytes of the dispatched requests.
    pub bytes: u64,
    /// Tokens of the dispatched requests.
    pub tokens: u64,
    /// Requests skipped because their handle was dropped first (their tokens went back).
    pub cancelled: u64,
    /// Dispatched requests whose future has ended.
    pub completed: u64,
    /// Requests waiting in the shards' queues (not yet dispatched), at the snapshot.
    pub queued: u64,
    /// Requests dispatched and not yet completed, at the snapshot.
    pub in_flight: u64,
    /// Tokens (nanoseconds of modelled disk time) of the requests in flight, at the snapshot.
    pub in_flight_tokens: u64,
    queue_wait: Histogram<u64>,
    service: Histogram<u64>,
    latency: Histogram<u64>,
}

fn quantile(h: &Histogram<u64>, q: f64) -> Duration {
    if h.is_empty() {
        return Duration::ZERO;
    }
    // A NaN `q` counts as 0.
    let q = if q.is_nan() { 0.0 } else { q.clamp(0.0, 1.0) };
    Duration::from_nanos(h.value_at_quantile(q))
}

fn max(h: &Histogram<u64>) -> Duration {
    if h.is_empty() {
        return Duration::ZERO;
    }
    Duration::from_nanos(h.max())
}

impl ClassStats {
    /// The queue wait (submission to dispatch) below which a fraction `q` (in `0.0..=1.0`) of
    /// the requests fall; zero when none was dispatched.
    pub fn queue_wait_quantile(&self, q: f64) -> Duration {
        quantile(&self.queue_wait, q)
    }

    /// Median queue wait.
    pub fn queue_wait_p50(&self) -> Duration {
        self.queue_wait_quantile(0.5)
    }

    /// 99th percentile queue wait.
    pub fn queue_wait_p99(&self) -> Duration {
        self.queue_wait_quantile(0.99)
    }

    /// Longest queue wait (within the histogram's 1% precision).
    pub fn queue_wait_max(&self) -> Duration {
        max(&self.queue_wait)
    }

    /// The service time (dispatch to completion) below which a fraction `q` of the completed
    /// requests fall; zero when none completed.
    pub fn service_quantile(&self, q: f64) -> Duration {
        quantile(&self.service, q)
    }

    /// Median service time.
    pub fn service_p50(&self) -> Duration {
        self.service_quantile(0.5)
    }

    /// 99th percentile service time.
    pub fn service_p99(&self) -> Duration {
        self.service_quantile(0.99)
    }

    /// Longest service time.
    pub fn service_max(&self) -> Duration {
        max(&self.service)
    }

    /// The end-to-end latency (submission to completion) below which a fraction `q` of the
    /// completed requests fall; zero when none completed.
    pub fn latency_quantile(&self, q: f64) -> Duration {
        quantile(&self.latency, q)
    }

    /// Median end-to-end latency.
    pub fn latency_p50(&self) -> Duration {
        self.latency_quantile(0.5)
    }

    /// 99th percentile end-to-end latency.
    pub fn latency_p99(&self) -> Duration {
        self.latency_quantile(0.99)
    }

    /// Longest end-to-end latency.
    pub fn latency_max(&self) -> Duration {
        max(&self.latency)
    }

    /// Adds another shard's figures for the same class.
    pub(crate) fn merge(&mut self, other: &ClassStats) {
        self.requests += other.requests;
        self.bytes += other.bytes;
        self.tokens += other.tokens;
        self.cancelled += other.cancelled;
        self.completed += other.completed;
        self.queued += other.queued;
        self.in_flight += other.in_flight;
        self.in_flight_tokens += other.in_flight_tokens;
        for (mine, theirs) in [
            (&mut self.queue_wait, &other.queue_wait),
            (&mut self.service, &other.service),
            (&mut self.latency, &other.latency),
        ] {
            mine.add(theirs).expect("histograms share their bounds");
        }
    }

    /// What happened since `earlier` (a snapshot of the same class taken before this one).
    fn since(&self, earlier: &ClassStats) -> ClassStats {
        let diff = |now: &Histogram<u64>, then: &Histogram<u64>| {
            let mut h = now.clone();
            // Fails only if `earlier` is not an earlier snapshot; then the whole history is kept.
            if h.subtract(then).is_err() {
                h = now.clone();
            }
            h
        };
        ClassStats {
            name: self.name.clone(),
            shares: self.shares,
            requests: self.requests.saturating_sub(earlier.requests),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            tokens: self.tokens.saturating_sub(earlier.tokens),
            cancelled: self.cancelled.saturating_sub(earlier.cancelled),
            completed: self.completed.saturating_sub(earlier.completed),
            queued: self.queued,
            in_flight: self.in_flight,
            in_flight_tokens: self.in_flight_tokens,
            queue_wait: diff(&self.queue_wait, &earlier.queue_wait),
            service: diff(&self.service, &earlier.service),
            latency: diff(&self.latency, &earlier.latency),
        }
    }
}

/// One shard's figures, per class (indexed by [`ClassId::index`](super::ClassId::index)).
#[derive(Debug, Clone)]
pub struct ShardStats {
    /// The shard's index.
    pub shard: usize,
    /// Per class.
    pub classes: Vec<ClassStats>,
    /// Tasks handed to this shard by [`Dispatcher::spawn_on`](super::Dispatcher::spawn_on)
    /// and [`Dispatcher::spawn`](super::Dispatcher::spawn) (a counter).
    pub tasks_spawned: u64,
    /// Those tasks not yet ended, at the snapshot (a gauge).
    pub tasks_running: u64,
    /// The times the shard found its core wanted by another thread while it idle-polled, and
    /// parked for a back-off instead (a counter; see
    /// [`DispatcherBuilder::idle_poll`](super::DispatcherBuilder::idle_poll)). Rising in a
    /// quiet phase, it says what else runs on the shard's core.
    pub idle_poll_backoffs: u64,
}

impl ShardStats {
    /// A snapshot of shard `shard`: its classes' figures, its task counts read from `shared`.
    pub(crate) fn new(shared: &Shared, shard: usize, classes: Vec<ClassStats>) -> Self {
        ShardStats {
            shard,
            classes,
            // Relaxed: figures for a snapshot; nothing is published with them.
            tasks_spawned: shared.tasks_spawned[shard].load(Ordering::Relaxed),
            tasks_running: shared.spawned[shard].load(Ordering::Relaxed),
            idle_poll_backoffs: shared.poll_backoffs[shard].load(Ordering::Relaxed),
        }
    }

    /// Tokens dispatched by this shard, all classes.
    pub fn tokens(&self) -> u64 {
        self.classes.iter().map(|c| c.tokens).sum()
    }
}

/// A snapshot of a dispatcher's figures: per shard, and per class merged over the shards.
#[derive(Debug, Clone)]
pub struct DispatcherStats {
    /// Per shard.
    pub shards: Vec<ShardStats>,
    /// Per class, merged over the shards (indexed by [`ClassId::index`](super::ClassId::index)).
    pub classes: Vec<ClassStats>,
}

impl DispatcherStats {
    pub(crate) fn from_shards(mut shards: Vec<ShardStats>) -> Self {
        shards.sort_by_key(|s| s.shard);
        let mut classes: Vec<ClassStats> = Vec::new();
        for s in &shards {
            if classes.is_empty() {
                classes = s.classes.clone();
            } else {
                for (m, c) in classes.iter_mut().zip(&s.classes) {
                    m.merge(c);
                }
            }
        }
        DispatcherStats { shards, classes }
    }

    /// Tokens dispatched, all shards and classes.
    pub fn tokens(&self) -> u64 {
        self.classes.iter().map(|c| c.tokens).sum()
    }

    /// Tasks handed to the shards by `spawn_on` and `spawn`, all shards.
    pub fn tasks_spawned(&self) -> u64 {
        self.shards.iter().map(|s| s.tasks_spawned).sum()
    }

    /// Those tasks not yet ended, all shards.
    pub fn tasks_running(&self) -> u64 {
        self.shards.iter().map(|s| s.tasks_running).sum()
    }

    /// Idle-poll back-offs ([`ShardStats::idle_poll_backoffs`]), all shards.
    pub fn idle_poll_backoffs(&self) -> u64 {
        self.shards.iter().map(|s| s.idle_poll_backoffs).sum()
    }

    /// What happened since `earlier` (an earlier snapshot of the same dispatcher): counters and
    /// latency histograms of the interval, gauges as of `self`.
    pub fn since(&self, earlier: &DispatcherStats) -> DispatcherStats {
        let diff = |now: &[ClassStats], then: &[ClassStats]| -> Vec<ClassStats> {
            now.iter().zip(then).map(|(n, t)| n.since(t)).collect()
        };
        DispatcherStats {
            shards: self
                .shards
                .iter()
                .zip(&earlier.shards)
                .map(|(n, t)| ShardStats {
                    shard: n.shard,
                    classes: diff(&n.classes, &t.classes),
                    tasks_spawned: n.tasks_spawned.saturating_sub(t.tasks_spawned),
                    tasks_running: n.tasks_running,
                    idle_poll_backoffs: n.idle_poll_backoffs.saturating_sub(t.idle_poll_backoffs),
                })
                .collect(),
            classes: diff(&self.classes, &earlier.classes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_merge_and_diff() {
        let mut a = ClassRecorder::new();
        for us in 1..=100 {
            a.dispatched(10, 5, Duration::from_micros(us));
        }
        let first = a.snapshot("a", 1, 0);
        for _ in 0..100 {
            a.dispatched(10, 5, Duration::from_millis(10));
        }
        let second = a.snapshot("a", 1, 0);
        let interval = second.since(&first);
        assert_eq!(interval.requests, 100);
        assert_eq!(interval.tokens, 500);
        let p50 = interval.queue_wait_p50();
        assert!(
            p50 >= Duration::from_micros(9_900) && p50 <= Duration::from_micros(10_100),
            "{p50:?}"
        );
        let p50_all = second.queue_wait_p50();
        assert!(p50_all <= Duration::from_micros(101), "{p50_all:?}");
        let shards = DispatcherStats::from_shards(vec![
            ShardStats {
                shard: 1,
                classes: vec![first.clone()],
                tasks_spawned: 0,
                tasks_running: 0,
                idle_poll_backoffs: 0,
            },
            ShardStats {
                shard: 0,
                classes: vec![first],
                tasks_spawned: 0,
                tasks_running: 0,
                idle_poll_backoffs: 0,
            },
        ]);
        assert_eq!(shards.classes[0].requests, 200);
        assert_eq!(shards.shards[0].shard, 0);
        assert_eq!(shards.tokens(), 1000);
    }
}

#[cfg(test)]
mod latency_tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// Queue wait, service time and end-to-end latency are three separate distributions: a
    /// request that waits 10 µs and then runs 990 µs on the disk has a 10 µs queue wait, a
    /// 990 µs service time and a 1 ms latency. (Queue wait alone under-reports what callers
    /// see.)
    #[test]
    fn queue_wait_alone_under_reports_end_to_end_latency() {
        let mut r = ClassRecorder::new();
        for _ in 0..100 {
            r.dispatched(4096, 7, 10 * US);
            r.completed(7, 990 * US, 1000 * US);
        }
        let s = r.snapshot("fg", 100, 3);
        let within = |d: Duration, want: Duration| {
            let (d, want) = (d.as_nanos() as f64, want.as_nanos() as f64);
            (d / want - 1.0).abs() <= 0.01
        };
        assert!(
            within(s.queue_wait_p99(), 10 * US),
            "{:?}",
            s.queue_wait_p99()
        );
        assert!(within(s.service_p99(), 990 * US), "{:?}", s.service_p99());
        assert!(within(s.latency_p99(), 1000 * US), "{:?}", s.latency_p99());
        assert!(within(s.latency_max(), 1000 * US));
        assert_eq!((s.completed, s.in_flight, s.queued), (100, 0, 3));
        assert_eq!(s.in_flight_tokens, 0);
    }

    #[test]
    fn gauges_count_in_flight_and_merge_across_shards() {
        let mut r = ClassRecorder::new();
        r.dispatched(4096, 7, US);
        r.dispatched(4096, 5, US);
        r.completed(7, US, 2 * US);
        let early = r.snapshot("c", 1, 4);
        assert_eq!((early.in_flight, early.in_flight_tokens), (1, 5));
        r.completed(5, 3 * US, 4 * US);
        let late = r.snapshot("c", 1, 2);
        let interval = late.since(&early);
        // Counters are the interval's, gauges the later snapshot's.
        assert_eq!(
            (interval.completed, interval.in_flight, interval.queued),
            (1, 0, 2)
        );
        assert!(interval.latency_p50() >= 4 * US - Duration::from_nanos(50));
        let all = DispatcherStats::from_shards(vec![
            ShardStats {
                shard: 0,
                classes: vec![early],
                tasks_spawned: 0,
                tasks_running: 0,
                idle_poll_backoffs: 0,
            },
            ShardStats {
                shard: 1,
                classes: vec![late],
                tasks_spawned: 0,
                tasks_running: 0,
                idle_poll_backoffs: 0,
            },
        ]);
        let c = &all.classes[0];
        assert_eq!((c.queued, c.in_flight, c.in_flight_tokens), (6, 1, 5));
        assert_eq!(c.completed, 3);
        // Empty histograms and odd quantiles are total: zero, never a panic.
        let empty = ClassRecorder::new().snapshot("e", 1, 0);
        assert_eq!(empty.latency_quantile(f64::NAN), Duration::ZERO);
        assert_eq!(c.latency_quantile(f64::NAN), c.latency_quantile(0.0));
        assert_eq!(c.service_quantile(7.0), c.service_max());
    }
}
