//! Per-class statistics: requests, bytes, tokens and queue-wait percentiles.
//!
//! Each shard records into its own [`ClassRecorder`]s (plain fields, no atomics, no locks);
//! [`Dispatcher::stats`](super::Dispatcher::stats) asks every shard for a copy through its
//! channel and merges them.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Queue waits are recorded in nanoseconds from 1 ns to one hour, with 2 significant digits
/// (percentiles within 1%); longer waits count as one hour.
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
    queue_wait: Histogram<u64>,
}

impl ClassRecorder {
    pub(crate) fn new() -> Self {
        ClassRecorder {
            requests: 0,
            bytes: 0,
            tokens: 0,
            cancelled: 0,
            queue_wait: new_histogram(),
        }
    }

    /// A request dispatched after waiting `wait` in the queue.
    pub(crate) fn dispatched(&mut self, bytes: u64, tokens: u64, wait: Duration) {
        self.requests += 1;
        self.bytes += bytes;
        self.tokens += tokens;
        let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        self.queue_wait.saturating_record(ns.max(1));
    }

    pub(crate) fn snapshot(&self, name: &str, shares: u32) -> ClassStats {
        ClassStats {
            name: name.to_owned(),
            shares,
            requests: self.requests,
            bytes: self.bytes,
            tokens: self.tokens,
            cancelled: self.cancelled,
            queue_wait: self.queue_wait.clone(),
        }
    }
}

/// One class's figures (on one shard, or merged over all shards).
///
/// Counters count dispatched requests (their futures were started); `cancelled` counts requests
/// whose handle was dropped before dispatch.
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
    queue_wait: Histogram<u64>,
}

impl ClassStats {
    /// The queue wait (submission to dispatch) below which a fraction `q` (in `0.0..=1.0`) of
    /// the requests fall; zero when none was dispatched.
    pub fn queue_wait_quantile(&self, q: f64) -> Duration {
        if self.queue_wait.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.queue_wait.value_at_quantile(q.clamp(0.0, 1.0)))
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
        if self.queue_wait.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.queue_wait.max())
    }

    /// Adds another shard's figures for the same class.
    fn merge(&mut self, other: &ClassStats) {
        self.requests += other.requests;
        self.bytes += other.bytes;
        self.tokens += other.tokens;
        self.cancelled += other.cancelled;
        self.queue_wait
            .add(&other.queue_wait)
            .expect("histograms share their bounds");
    }

    /// What happened since `earlier` (a snapshot of the same class taken before this one).
    fn since(&self, earlier: &ClassStats) -> ClassStats {
        let mut queue_wait = self.queue_wait.clone();
        // Fails only if `earlier` is not an earlier snapshot; then the whole history is kept.
        if queue_wait.subtract(&earlier.queue_wait).is_err() {
            queue_wait = self.queue_wait.clone();
        }
        ClassStats {
            name: self.name.clone(),
            shares: self.shares,
            requests: self.requests.saturating_sub(earlier.requests),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            tokens: self.tokens.saturating_sub(earlier.tokens),
            cancelled: self.cancelled.saturating_sub(earlier.cancelled),
            queue_wait,
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
}

impl ShardStats {
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

    /// What happened since `earlier` (an earlier snapshot of the same dispatcher): counters and
    /// queue-wait histograms of the interval.
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
        let first = a.snapshot("a", 1);
        for _ in 0..100 {
            a.dispatched(10, 5, Duration::from_millis(10));
        }
        let second = a.snapshot("a", 1);
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
            },
            ShardStats {
                shard: 0,
                classes: vec![first],
            },
        ]);
        assert_eq!(shards.classes[0].requests, 200);
        assert_eq!(shards.shards[0].shard, 0);
        assert_eq!(shards.tokens(), 1000);
    }
}
