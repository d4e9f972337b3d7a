//! A class's bound on its disk time in flight
//! ([`ClassConfig::with_max_in_flight`](super::ClassConfig::with_max_in_flight)): one counter
//! shared by all shards, changed only by read-modify-writes, so the bound holds exactly
//! whatever the shards do concurrently (the loom model `dispatcher_bound` checks it).

use crate::sync::{AtomicU64, Ordering};

/// Tokens of one class reserved or running, and the most it may have.
#[derive(Debug)]
pub(crate) struct InFlightBound {
    limit: u64,
    in_flight: AtomicU64,
}

impl InFlightBound {
    /// A bound of `limit` tokens, nothing in flight.
    pub(crate) fn new(limit: u64) -> Self {
        InFlightBound {
            limit,
            in_flight: AtomicU64::new(0),
        }
    }

    /// Counts `cost` more tokens in flight if the bound allows it: always when nothing is in
    /// flight (one request alone always goes), else when the total stays within the limit.
    /// `false`: the request must wait for completions.
    pub(crate) fn try_start(&self, cost: u64) -> bool {
        // Relaxed: the counter publishes no other data; the check and the add are one
        // read-modify-write, which alone keeps the bound exact across shards.
        self.in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n == 0 || n.saturating_add(cost) <= self.limit).then(|| n.saturating_add(cost))
            })
            .is_ok()
    }

    /// `cost` tokens counted by [`try_start`](Self::try_start) completed or were given back.
    pub(crate) fn finish(&self, cost: u64) {
        // Relaxed: as in `try_start`.
        let _ = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(cost))
            });
    }

    /// Tokens in flight now (for the tests and the loom models).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn in_flight(&self) -> u64 {
        // Relaxed: a statistic (tests read it with the shards stopped).
        self.in_flight.load(Ordering::Relaxed)
    }
}
