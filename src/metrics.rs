//! Metrics through the [`metrics`](https://docs.rs/metrics) crate facade (feature `metrics`).
//!
//! Install any `metrics` recorder (Prometheus exporter, statsd, the debugging recorder of
//! `metrics-util` in tests) **before** building the dispatcher: each shard registers its
//! handles on first use and keeps them, as the `metrics` ecosystem expects.
//!
//! # Per dispatcher class (label `class` = the class's name)
//!
//! | name | kind | what |
//! |---|---|---|
//! | `iothrottle_class_requests_total` | counter | requests dispatched (a split request once per piece) |
//! | `iothrottle_class_bytes_total` | counter | bytes of the dispatched requests |
//! | `iothrottle_class_tokens_total` | counter | tokens granted to the dispatched requests |
//! | `iothrottle_class_cancelled_total` | counter | requests dropped before dispatch (tokens went back) |
//! | `iothrottle_class_queue_length` | gauge | requests submitted and not yet dispatched, cancelled or failed |
//! | `iothrottle_class_queue_wait_seconds` | histogram | submission to dispatch |
//! | `iothrottle_class_service_time_seconds` | histogram | dispatch to completion of the request's future (recorded when the future ends, on the dispatcher's clock) |
//!
//! # Per throttle (label `throttle` = a name of your choice)
//!
//! | name | kind | what |
//! |---|---|---|
//! | `iothrottle_throttle_granted_total` | counter | tokens granted |
//! | `iothrottle_throttle_waiting` | gauge | claims waiting now |
//! | `iothrottle_throttle_cancelled_total` | counter | claims given back (cancelled, closed) |
//!
//! [`export_throttle_stats`] publishes a throttle's [`stats`](crate::Throttle::stats) (and
//! [`export_throttle`] any snapshot of such counters); call it periodically (or from your
//! exporter's scrape hook).
//!
//! # Cost
//!
//! With the feature off nothing here is compiled and the dispatcher's hooks are
//! `#[cfg(feature = "metrics")]` statements: the hot paths are the same machine code. With the
//! feature on, a dispatched request costs one thread-local map lookup by class name, three
//! counter increments, a gauge decrement and a histogram record on cached handles (the benchmark
//! `dispatcher/overhead` measures it with and without the feature).

use metrics::{counter, gauge};

/// Metric names, for dashboards and tests.
pub mod names {
    /// Counter: requests dispatched, per class.
    pub const CLASS_REQUESTS: &str = "iothrottle_class_requests_total";
    /// Counter: bytes dispatched, per class.
    pub const CLASS_BYTES: &str = "iothrottle_class_bytes_total";
    /// Counter: tokens granted, per class.
    pub const CLASS_TOKENS: &str = "iothrottle_class_tokens_total";
    /// Counter: requests cancelled before dispatch, per class.
    pub const CLASS_CANCELLED: &str = "iothrottle_class_cancelled_total";
    /// Gauge: requests queued, per class.
    pub const CLASS_QUEUE_LENGTH: &str = "iothrottle_class_queue_length";
    /// Histogram (seconds): submission to dispatch, per class.
    pub const CLASS_QUEUE_WAIT: &str = "iothrottle_class_queue_wait_seconds";
    /// Histogram (seconds): dispatch to completion, per class.
    pub const CLASS_SERVICE_TIME: &str = "iothrottle_class_service_time_seconds";
    /// Counter: tokens granted, per throttle.
    pub const THROTTLE_GRANTED: &str = "iothrottle_throttle_granted_total";
    /// Gauge: claims waiting, per throttle.
    pub const THROTTLE_WAITING: &str = "iothrottle_throttle_waiting";
    /// Counter: claims given back, per throttle.
    pub const THROTTLE_CANCELLED: &str = "iothrottle_throttle_cancelled_total";
}

/// The dispatcher's per-class metrics (the dispatcher is part of feature `rt`).
#[cfg(feature = "rt")]
mod class {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::time::Duration;

    use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};

    use super::names;

    /// One class's handles, registered once per shard thread.
    struct ClassHandles {
        requests: Counter,
        bytes: Counter,
        tokens: Counter,
        cancelled: Counter,
        queue: Gauge,
        wait: Histogram,
        service: Histogram,
    }

    impl ClassHandles {
        fn new(class: &str) -> Self {
            let label = || ("class", class.to_owned());
            ClassHandles {
                requests: counter!(names::CLASS_REQUESTS, &[label()]),
                bytes: counter!(names::CLASS_BYTES, &[label()]),
                tokens: counter!(names::CLASS_TOKENS, &[label()]),
                cancelled: counter!(names::CLASS_CANCELLED, &[label()]),
                queue: gauge!(names::CLASS_QUEUE_LENGTH, &[label()]),
                wait: histogram!(names::CLASS_QUEUE_WAIT, &[label()]),
                service: histogram!(names::CLASS_SERVICE_TIME, &[label()]),
            }
        }
    }

    thread_local! {
        /// Per-thread (per-shard) handle cache: no lock, no allocation after the first use.
        static CLASSES: RefCell<HashMap<String, ClassHandles>> = RefCell::new(HashMap::new());
    }

    fn with_class(class: &str, f: impl FnOnce(&ClassHandles)) {
        CLASSES.with(|cache| {
            let mut cache = cache.borrow_mut();
            if let Some(h) = cache.get(class) {
                f(h);
            } else {
                let h = ClassHandles::new(class);
                f(&h);
                cache.insert(class.to_owned(), h);
            }
        });
    }

    /// A request of `class` entered a queue.
    pub(crate) fn class_queued(class: &str) {
        with_class(class, |h| h.queue.increment(1.0));
    }

    /// A request of `class` was dispatched after waiting `wait`.
    pub(crate) fn class_dispatched(class: &str, bytes: u64, tokens: u64, wait: Duration) {
        with_class(class, |h| {
            h.requests.increment(1);
            h.bytes.increment(bytes);
            h.tokens.increment(tokens);
            h.queue.decrement(1.0);
            h.wait.record(wait.as_secs_f64());
        });
    }

    /// A request of `class` left its queue without being dispatched: cancelled by its handle
    /// (`cancelled`), or failed by a shutdown.
    pub(crate) fn class_unqueued(class: &str, cancelled: bool) {
        with_class(class, |h| {
            if cancelled {
                h.cancelled.increment(1);
            }
            h.queue.decrement(1.0);
        });
    }

    /// A dispatched request of `class` finished `service` after its dispatch.
    pub(crate) fn class_completed(class: &str, service: Duration) {
        with_class(class, |h| h.service.record(service.as_secs_f64()));
    }
}

#[cfg(feature = "rt")]
pub(crate) use class::{class_completed, class_dispatched, class_queued, class_unqueued};

/// A snapshot of a throttle's counters, as exported by [`export_throttle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleCounters {
    /// Tokens granted since the throttle was made.
    pub granted: u64,
    /// Claims waiting now.
    pub waiting: u64,
    /// Claims given back (cancelled or closed) since the throttle was made.
    pub cancelled: u64,
}

/// Publishes `counters` under the label `throttle = name`: the counters are set to the absolute
/// values (they only grow), the gauge to the current value.
pub fn export_throttle(name: &str, counters: ThrottleCounters) {
    let label = || [("throttle", name.to_owned())];
    counter!(names::THROTTLE_GRANTED, &label()).absolute(counters.granted);
    gauge!(names::THROTTLE_WAITING, &label()).set(counters.waiting as f64);
    counter!(names::THROTTLE_CANCELLED, &label()).absolute(counters.cancelled);
}

/// Publishes `throttle`'s [`stats`](crate::Throttle::stats) under the label `throttle = name`,
/// as [`export_throttle`] does: granted tokens and cancelled claims as absolute counters, the
/// claims waiting now as a gauge. Reads relaxed counters: nothing on the throttle's fast path.
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub fn export_throttle_stats<M: crate::Mode, C: crate::Clock>(
    name: &str,
    throttle: &crate::Throttle<M, C>,
) {
    let stats = throttle.stats();
    export_throttle(
        name,
        ThrottleCounters {
            granted: stats.granted_tokens,
            waiting: stats.waiting,
            cancelled: stats.cancelled,
        },
    );
}
