//! The `metrics` feature against `metrics-util`'s debugging recorder: per-class counters, the
//! queue-length gauge, the queue-wait histogram, cancellations, and the throttle export.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;

use iothrottle::dispatcher::{
    ClassConfig, DiskModel, Dispatcher, DispatcherBuilder, Figures, IoRequest,
};
use iothrottle::metrics::{export_throttle, names, ThrottleCounters};
use iothrottle::Rate;

/// One global recorder for this test binary (the shards are other threads: a thread-local
/// recorder would not see them). Snapshots reset the values, so tests run one at a time.
fn recorder() -> (&'static Snapshotter, std::sync::MutexGuard<'static, ()>) {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let snap = SNAP.get_or_init(|| {
        let r = DebuggingRecorder::new();
        let s = r.snapshotter();
        r.install().expect("first recorder");
        s
    });
    (snap, guard)
}

/// The value of metric `name` with label `label = value`.
fn find<'a>(
    snapshot: &'a [(metrics_util::CompositeKey, DebugValue)],
    kind: MetricKind,
    name: &str,
    label: (&str, &str),
) -> Option<&'a DebugValue> {
    snapshot.iter().find_map(|(k, v)| {
        let key = k.key();
        let matches = k.kind() == kind
            && key.name() == name
            && key
                .labels()
                .any(|l| l.key() == label.0 && l.value() == label.1);
        matches.then_some(v)
    })
}

fn take(snap: &Snapshotter) -> Vec<(metrics_util::CompositeKey, DebugValue)> {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| (k, v))
        .collect()
}

fn counter(v: Option<&DebugValue>) -> u64 {
    match v {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("not a counter: {other:?}"),
    }
}

fn gauge(v: Option<&DebugValue>) -> f64 {
    match v {
        Some(DebugValue::Gauge(g)) => g.into_inner(),
        other => panic!("not a gauge: {other:?}"),
    }
}

fn histogram_len(v: Option<&DebugValue>) -> usize {
    match v {
        Some(DebugValue::Histogram(h)) => h.len(),
        other => panic!("not a histogram: {other:?}"),
    }
}

/// An uncapped dispatcher of `shards` shards over a fast modelled disk, classes to add.
fn uncapped(shards: usize) -> DispatcherBuilder {
    Dispatcher::builder()
        .shards(shards)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1 << 30,
        }))
        .capped(false)
}

#[test]
fn per_class_counters_match_the_dispatcher_stats() {
    let (snap, _serial) = recorder();
    let mut b = uncapped(2).pin_threads(false);
    let fg = b.add_class(ClassConfig::new("m_fg", 800)).unwrap();
    let bg = b.add_class(ClassConfig::new("m_bg", 200)).unwrap();
    let d = b.build().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut handles = Vec::new();
    for i in 0..20u64 {
        handles.push(
            d.submit(fg, IoRequest::read(4096), async move { i })
                .unwrap(),
        );
        handles.push(
            d.submit(bg, IoRequest::write(1 << 16), async move { i })
                .unwrap(),
        );
    }
    for h in handles {
        rt.block_on(h).unwrap();
    }
    let stats = d.stats_blocking();
    d.shutdown();
    let s = take(snap);
    for (class, id) in [("m_fg", fg), ("m_bg", bg)] {
        let c = &stats.classes[id.index()];
        let l = ("class", class);
        assert_eq!(
            counter(find(&s, MetricKind::Counter, names::CLASS_REQUESTS, l)),
            c.requests
        );
        assert_eq!(
            counter(find(&s, MetricKind::Counter, names::CLASS_BYTES, l)),
            c.bytes
        );
        assert_eq!(
            counter(find(&s, MetricKind::Counter, names::CLASS_TOKENS, l)),
            c.tokens
        );
        assert_eq!(c.requests, 20);
        assert_eq!(
            gauge(find(&s, MetricKind::Gauge, names::CLASS_QUEUE_LENGTH, l)),
            0.0
        );
        assert_eq!(
            histogram_len(find(&s, MetricKind::Histogram, names::CLASS_QUEUE_WAIT, l)),
            20
        );
        // Every dispatched request's future ended: one service-time sample each.
        assert_eq!(c.completed, 20);
        assert_eq!(
            histogram_len(find(
                &s,
                MetricKind::Histogram,
                names::CLASS_SERVICE_TIME,
                l
            )),
            20
        );
    }
}

#[test]
fn cancelled_requests_are_counted_and_leave_the_queue_gauge() {
    let (snap, _serial) = recorder();
    let mut b = uncapped(1)
        .rate(Rate::per_second(1_000))
        .limit(100)
        .pin_threads(false);
    let c = b.add_class(ClassConfig::new("m_cancel", 100)).unwrap();
    let d = b.build().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut kept = Vec::new();
    for i in 0..10u64 {
        let h = d
            .submit(c, IoRequest::tokens(50), async move { i })
            .unwrap();
        if i < 5 {
            kept.push(h);
        } // the other five are dropped at once: cancelled before dispatch
    }
    for h in kept {
        rt.block_on(h).unwrap();
    }
    d.shutdown();
    let stats = d.stats_blocking();
    let s = take(snap);
    let l = ("class", "m_cancel");
    let cancelled = counter(find(&s, MetricKind::Counter, names::CLASS_CANCELLED, l));
    let requests = counter(find(&s, MetricKind::Counter, names::CLASS_REQUESTS, l));
    assert_eq!(cancelled, stats.classes[c.index()].cancelled);
    assert_eq!(requests, stats.classes[c.index()].requests);
    assert_eq!(requests + cancelled, 10);
    assert!(
        cancelled >= 1,
        "at least one request was still queued when dropped"
    );
    assert_eq!(
        gauge(find(&s, MetricKind::Gauge, names::CLASS_QUEUE_LENGTH, l)),
        0.0
    );
}

#[test]
fn throttle_counters_are_exported_as_absolute_values() {
    let (snap, _serial) = recorder();
    export_throttle(
        "m_t",
        ThrottleCounters {
            granted: 10,
            waiting: 2,
            cancelled: 1,
        },
    );
    export_throttle(
        "m_t",
        ThrottleCounters {
            granted: 25,
            waiting: 0,
            cancelled: 3,
        },
    );
    let s = take(snap);
    let l = ("throttle", "m_t");
    assert_eq!(
        counter(find(&s, MetricKind::Counter, names::THROTTLE_GRANTED, l)),
        25
    );
    assert_eq!(
        counter(find(&s, MetricKind::Counter, names::THROTTLE_CANCELLED, l)),
        3
    );
    assert_eq!(
        gauge(find(&s, MetricKind::Gauge, names::THROTTLE_WAITING, l)),
        0.0
    );
}

#[test]
fn export_throttle_stats_publishes_the_throttles_own_counters() {
    use iothrottle::metrics::export_throttle_stats;
    use iothrottle::{BucketConfig, ManualClock, Throttle, Uncapped};

    let (snap, _serial) = recorder();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let clock = ManualClock::new();
    let th = Throttle::<Uncapped, _>::with_clock(
        BucketConfig::new(Rate::per_second(1), 100),
        clock.clone(),
    )
    .unwrap();
    clock.advance(std::time::Duration::from_secs(1_000));
    th.bucket().replenish();
    let l = ("throttle", "m_stats");
    rt.block_on(async {
        let permit = th.acquire(30).await.unwrap();
        std::mem::forget(permit);
        // A claim that cannot be met on the frozen clock: waiting after its first poll.
        let mut waiter = Box::pin(th.acquire(100));
        tokio::select! {
            biased;
            _ = &mut waiter => panic!("100 tokens on a frozen clock after 30 were taken"),
            _ = async {} => {}
        }
        export_throttle_stats("m_stats", &th);
        let s = take(snap);
        let stats = th.stats();
        assert_eq!(stats.waiting, 1);
        assert_eq!(
            counter(find(&s, MetricKind::Counter, names::THROTTLE_GRANTED, l)),
            stats.granted_tokens
        );
        assert_eq!(stats.granted_tokens, 30);
        assert_eq!(
            gauge(find(&s, MetricKind::Gauge, names::THROTTLE_WAITING, l)),
            1.0
        );
        drop(waiter);
    });
    export_throttle_stats("m_stats", &th);
    let s = take(snap);
    assert_eq!(th.stats().cancelled, 1);
    assert_eq!(
        counter(find(&s, MetricKind::Counter, names::THROTTLE_CANCELLED, l)),
        1
    );
    assert_eq!(
        gauge(find(&s, MetricKind::Gauge, names::THROTTLE_WAITING, l)),
        0.0
    );
}

/// Requests dispatched on their callers' threads emit what a queued one does: the queue gauge
/// goes up and back down (not below zero), one queue-wait sample of zero each.
#[test]
fn requests_dispatched_from_their_callers_leave_the_queue_gauge_at_zero() {
    let (snap, _serial) = recorder();
    let mut b = uncapped(1).pin_threads(false).caller_dispatch(true);
    let c = b.add_class(ClassConfig::new("m_caller", 100)).unwrap();
    let d = b.build().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let me = std::thread::current().id();
    for _ in 0..10 {
        let h = d
            .submit(c, IoRequest::read(4096), async {
                std::thread::current().id()
            })
            .unwrap();
        assert_eq!(rt.block_on(h), Ok(me), "dispatched on the caller's thread");
    }
    let stats = d.stats_blocking();
    d.shutdown();
    let s = take(snap);
    let l = ("class", "m_caller");
    assert_eq!(stats.classes[c.index()].requests, 10);
    // Zero, as the histogram's lowest value (1 ns) records it.
    assert!(stats.classes[c.index()].queue_wait_max() <= Duration::from_nanos(1));
    assert_eq!(
        counter(find(&s, MetricKind::Counter, names::CLASS_REQUESTS, l)),
        10
    );
    assert_eq!(
        gauge(find(&s, MetricKind::Gauge, names::CLASS_QUEUE_LENGTH, l)),
        0.0
    );
    match find(&s, MetricKind::Histogram, names::CLASS_QUEUE_WAIT, l) {
        Some(DebugValue::Histogram(h)) => {
            assert_eq!(h.len(), 10);
            assert!(h.iter().all(|w| w.into_inner() == 0.0), "waits: {h:?}");
        }
        other => panic!("not a histogram: {other:?}"),
    }
}
