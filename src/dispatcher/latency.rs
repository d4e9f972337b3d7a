//! Latency-target mode: classes that declare a p99 latency target
//! ([`ClassConfig::with_latency_target`](super::ClassConfig::with_latency_target)) are served in
//! the high tier, and the other classes draw from a shared budget of disk time whose rate an
//! AIMD controller sets: each period (100 ms) it takes the p99 of the protected classes'
//! latencies (submission to completion of their futures), cuts the budget by a quarter while a
//! p99 is above 90% of its target, and gives back 1% of the dispatcher's rate per period while
//! all are below.
//! No disk speed needs to be configured: the budget finds what the others may use without
//! pushing the protected classes past their targets.

use std::sync::Mutex;
use std::time::Duration;

use crate::bucket::{BucketConfig, Rate, SharedTokenBucket, Uncapped};
use crate::sync::{AtomicU64, Ordering};

use super::ArcClock;

/// How often the controller decides.
const PERIOD: Duration = Duration::from_millis(100);

/// While every target is met, the budget grows by this fraction (1/100) of the dispatcher's
/// rate per period.
const GIVE_BACK: u64 = 100;

/// The budget never goes below this fraction (1/64) of the dispatcher's rate, so the other
/// classes always progress.
const MIN_FRACTION: u64 = 64;

/// The latency window and the controller.
#[derive(Debug)]
pub(crate) struct LatencyControl {
    /// Per class: its target, if it is protected.
    targets: Box<[Option<Duration>]>,
    /// Latencies (ns) of the protected classes' requests completed this period.
    samples: Mutex<Vec<Vec<u64>>>,
    /// When the current period ends (ns on the dispatcher's clock).
    next: AtomicU64,
    /// The other classes' budget, in tokens.
    budget: SharedTokenBucket<Uncapped, ArcClock>,
    /// The dispatcher's rate (tokens per second): the budget's ceiling.
    max: u64,
    /// The budget's rate now (tokens per second).
    rate: AtomicU64,
}

impl LatencyControl {
    /// A controller for `targets` (one per class), under a dispatcher of `rate`; `None` when no
    /// class has a target.
    pub(crate) fn new(
        targets: Vec<Option<Duration>>,
        rate: Rate,
        clock: &ArcClock,
    ) -> Result<Option<Self>, crate::ConfigError> {
        if targets.iter().all(Option::is_none) {
            return Ok(None);
        }
        let max = u64::try_from(rate.tokens_in(Duration::from_secs(1)))
            .unwrap_or(Rate::MAX_PER_SECOND)
            .clamp(MIN_FRACTION, Rate::MAX_PER_SECOND);
        // A burst of 1 ms at the full rate, replenished in steps of 20 µs.
        let limit = (max / 1000).max(1);
        let threshold = (max / 50_000).clamp(1, limit);
        let cfg = BucketConfig::new(Rate::per_second(max), limit).with_threshold(threshold);
        Ok(Some(LatencyControl {
            samples: Mutex::new(vec![Vec::new(); targets.len()]),
            targets: targets.into_boxed_slice(),
            next: AtomicU64::new(PERIOD.as_nanos() as u64),
            budget: SharedTokenBucket::with_clock(cfg, clock.clone())?,
            max,
            rate: AtomicU64::new(max),
        }))
    }

    /// `true` for a class with a latency target.
    pub(crate) fn is_protected(&self, class: usize) -> bool {
        self.targets[class].is_some()
    }

    /// The other classes' budget rate now, tokens per second.
    pub(crate) fn rate(&self) -> u64 {
        // Relaxed: a statistic.
        self.rate.load(Ordering::Relaxed)
    }

    /// A request of a protected class completed after `latency`.
    pub(crate) fn record(&self, class: usize, latency: Duration) {
        if self.targets[class].is_none() {
            return;
        }
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        if let Ok(mut s) = self.samples.lock() {
            s[class].push(ns);
        }
    }

    /// Takes `cost` tokens from the others' budget, or says how long until it has them.
    pub(crate) fn take(&self, cost: u64) -> Result<(), Duration> {
        self.budget.replenish();
        let available = self.budget.available();
        if available >= cost {
            self.budget.grab(cost);
            return Ok(());
        }
        let step = self.budget.duration_for(self.budget.threshold());
        Err(self.budget.duration_for(cost - available).max(step))
    }

    /// Decides at the end of each period (whichever shard comes first after it ends).
    pub(crate) fn tick(&self, now: Duration) {
        let now_ns = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        // Acquire/AcqRel: one shard wins each period; the samples are under the mutex.
        let next = self.next.load(Ordering::Acquire);
        if now_ns < next
            || self
                .next
                .compare_exchange(
                    next,
                    now_ns + PERIOD.as_nanos() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
        {
            return;
        }
        let missed = {
            let Ok(mut samples) = self.samples.lock() else {
                return;
            };
            let mut missed = false;
            for (s, target) in samples.iter_mut().zip(self.targets.iter()) {
                let Some(target) = target else { continue };
                if s.is_empty() {
                    continue;
                }
                s.sort_unstable();
                let p99 = s[(s.len() * 99).div_ceil(100) - 1];
                // Aim at 90% of the target: the headroom absorbs the period it takes to react.
                let aim = u64::try_from(target.as_nanos() / 10 * 9).unwrap_or(u64::MAX);
                missed |= p99 > aim;
                s.clear();
            }
            missed
        };
        let rate = self.rate();
        let new = if missed {
            (rate / 4 * 3).max(self.max / MIN_FRACTION)
        } else {
            rate.saturating_add(self.max / GIVE_BACK).min(self.max)
        };
        if new != rate {
            // Relaxed: a statistic; the bucket's rate is what counts.
            self.rate.store(new, Ordering::Relaxed);
            let _ = self.budget.set_rate(Rate::per_second(new));
        }
    }
}
