//! Measuring foreground latency honestly: a fixed schedule of arrivals that never waits for the
//! reads (open loop), latency counted from each read's scheduled arrival, and summaries over
//! rounds (also compiled into `tests/disk_throttle_main.rs`).
//!
//! A reader that falls behind issues its next read at once, and that read's latency includes
//! the time it waited to be issued: the schedule is never moved to "now" (wrk2's rule; a
//! closed loop that skips ahead hides the backlog, which is coordinated omission).

use std::time::{Duration, Instant};

/// One reader's arrivals: `start + offset + k × interval` for `k = 0, 1, …`, while before
/// `end`.
#[derive(Debug, Clone)]
pub struct Schedule {
    start: Instant,
    offset: Duration,
    interval: Duration,
    end: Instant,
    /// Arrivals handed out so far.
    taken: u64,
}

impl Schedule {
    /// Arrivals every `interval` (positive), the first at `start + offset`, the last before
    /// `start + span`.
    pub fn new(start: Instant, offset: Duration, interval: Duration, span: Duration) -> Self {
        assert!(!interval.is_zero(), "a positive interval");
        Schedule {
            start,
            offset,
            interval,
            end: start + span,
            taken: 0,
        }
    }

    /// The `k`-th arrival (computed from the start, so no rounding accumulates).
    pub fn arrival(&self, k: u64) -> Instant {
        let ns = self.offset.as_nanos() + self.interval.as_nanos() * k as u128;
        self.start + Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// The next arrival, or `None` once the next would be at or after the end. However late
    /// the caller is, this is the arrival that was scheduled, never "now".
    pub fn next_arrival(&mut self) -> Option<Instant> {
        let at = self.arrival(self.taken);
        if at >= self.end {
            return None;
        }
        self.taken += 1;
        Some(at)
    }

    /// How many arrivals before the end have not been handed out.
    pub fn remaining(&self) -> u64 {
        let span = self.end.saturating_duration_since(self.start);
        let Some(room) = span.checked_sub(self.offset) else {
            return 0;
        };
        if room.is_zero() {
            return 0;
        }
        // Arrivals k with offset + k × interval < span: ceil(room / interval).
        let total = room.as_nanos().div_ceil(self.interval.as_nanos());
        (total as u64).saturating_sub(self.taken)
    }

    /// Gives up on the arrivals not handed out (a run cut short): the latency each of them had
    /// reached by `now` (a lower bound on what it would have had), so that they are counted,
    /// not dropped.
    pub fn abandon(&mut self, now: Instant) -> Vec<Duration> {
        let mut out = Vec::with_capacity(usize::try_from(self.remaining()).unwrap_or(0));
        while let Some(at) = self.next_arrival() {
            out.push(now.saturating_duration_since(at));
        }
        out
    }
}

/// The median of `xs` (the mean of the two middle values for an even count); `None` when
/// empty.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// One phase's figures, round by round: the foreground's p99 and the compaction's MB/s.
#[derive(Debug, Clone, Default)]
pub struct Rounds {
    pub p99: Vec<Duration>,
    pub bg_mb_s: Vec<f64>,
}

impl Rounds {
    pub fn push(&mut self, p99: Duration, bg_mb_s: f64) {
        self.p99.push(p99);
        self.bg_mb_s.push(bg_mb_s);
    }

    /// The median round's p99.
    pub fn median_p99(&self) -> Duration {
        let xs: Vec<f64> = self.p99.iter().map(|d| d.as_secs_f64()).collect();
        median(&xs).map_or(Duration::ZERO, Duration::from_secs_f64)
    }

    /// The worst (highest) round's p99.
    pub fn worst_p99(&self) -> Duration {
        self.p99.iter().copied().max().unwrap_or(Duration::ZERO)
    }

    /// The median round's compaction bandwidth.
    pub fn median_bg(&self) -> f64 {
        median(&self.bg_mb_s).unwrap_or(0.0)
    }

    /// The worst (lowest) round's compaction bandwidth.
    pub fn worst_bg(&self) -> f64 {
        self.bg_mb_s.iter().copied().reduce(f64::min).unwrap_or(0.0)
    }
}
