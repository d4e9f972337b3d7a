//! A shard's own timer for its short sleeps (Linux): a `timerfd` registered with the shard's
//! tokio reactor, so the kernel's high-resolution timer wakes the shard thread itself.
//!
//! The alternative, the dispatcher's timer thread ([`timer`](super::timer)), costs two thread
//! wake-ups per short sleep, and on a busy core each is a chance for the shard to lose its CPU:
//! arming it wakes the timer thread on the shard's core, where (a sleeper, so owed time) it
//! preempts the shard; the shard goes back to the run queue beside whatever else is runnable
//! there. With a spinning thread on each core, the timer thread preempts the shards
//! 1,600–2,300 times a second in the main job, and 5–10% of those preemptions leave the shard
//! waiting 1–2 ms behind the spinner (docs/dispatcher.md, "Busy cores"). A timerfd involves
//! no other thread. Where one cannot be made, the shard uses the timer thread.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// One shard's timerfd, on its runtime's reactor.
#[derive(Debug)]
pub(crate) struct ShardTimer {
    fd: AsyncFd<OwnedFd>,
}

const ZERO: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 0,
};

impl ShardTimer {
    /// A disarmed timer, registered with the current tokio runtime (which must have its I/O
    /// driver enabled).
    pub(crate) fn new() -> io::Result<Self> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // SAFETY: `fd` is an open timerfd owned by the `OwnedFd` the `AsyncFd` takes: it stays
        // open, and `as_raw_fd` returns that same descriptor, until the `AsyncFd` is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(ShardTimer { fd })
    }

    /// Arms the timer to expire `after` from now (replacing any earlier arming and clearing an
    /// expiry not yet read).
    pub(crate) fn arm(&self, after: Duration) -> io::Result<()> {
        // A zero `it_value` would disarm: the shortest arming is 1 ns.
        let after = after.max(Duration::from_nanos(1));
        let value = Timespec {
            tv_sec: i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(after.subsec_nanos()),
        };
        self.settime(value)
    }

    /// Disarms the timer (the shard woke for another reason), so that a stale expiry does not
    /// wake it later.
    pub(crate) fn disarm(&self) -> io::Result<()> {
        self.settime(ZERO)
    }

    fn settime(&self, it_value: Timespec) -> io::Result<()> {
        let spec = Itimerspec {
            it_interval: ZERO,
            it_value,
        };
        timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
        Ok(())
    }

    /// Completes when the armed time has passed. A readiness left over from an earlier arming
    /// (the expiry count was cleared by re-arming) is skipped.
    pub(crate) async fn expired(&self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            let mut count = [0u8; 8];
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut count)?)) {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                // Not expired yet: `try_io` cleared the readiness; wait again.
                Err(_would_block) => continue,
            }
        }
    }
}

/// Shard `shard`'s timer, or `None` (with a `tracing` warning) where no timerfd can be made:
/// its short sleeps then use the dispatcher's timer thread. Call on the shard's runtime.
pub(crate) fn for_shard(shard: usize) -> Option<ShardTimer> {
    ShardTimer::new()
        .map_err(|e| {
            tracing::warn!(
                shard,
                error = %e,
                "no timerfd for the shard's short sleeps; they use the dispatcher's timer thread"
            );
        })
        .ok()
}

/// Arms `own` for `after`: `Some` when it is armed, `None` when there is none or arming failed
/// (logged), so that the caller uses the timer thread.
pub(crate) fn arm(own: Option<&ShardTimer>, shard: usize, after: Duration) -> Option<&ShardTimer> {
    own.filter(|t| t.arm(after).map_err(|e| failed(shard, &e)).is_ok())
}

/// Disarms `own` after a sleep (a failure is logged: the worst it causes is one early wake-up).
pub(crate) fn disarm(own: &ShardTimer, shard: usize) {
    if let Err(e) = own.disarm() {
        failed(shard, &e);
    }
}

fn failed(shard: usize, e: &io::Error) {
    tracing::warn!(shard, error = %e, "the shard's timerfd failed");
}

/// Completes when `own` expires (an error ends the wait too: the shard then re-evaluates, as
/// on any wake-up).
pub(crate) async fn expired(own: Option<&ShardTimer>) {
    if let Some(t) = own {
        let _ = t.expired().await;
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;
    use crate::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures, IoRequest};
    use crate::sync::Ordering;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn an_armed_timer_expires_and_a_disarmed_one_does_not() {
        rt().block_on(async {
            let t = ShardTimer::new().expect("a timerfd");
            t.arm(Duration::from_micros(50)).expect("armed");
            t.expired().await.expect("expired");
            // Re-armed far ahead, then disarmed: the kernel holds no expiry for it, and it does
            // not complete (polled once after yielding to the reactor: nothing is timed).
            t.arm(Duration::from_secs(3600)).expect("armed");
            assert!(armed_for(&t) > Duration::from_secs(3000));
            t.disarm().expect("disarmed");
            assert_eq!(armed_for(&t), Duration::ZERO);
            let expired = t.expired();
            tokio::pin!(expired);
            assert!(futures_poll_once(expired.as_mut()).await.is_none());
        });
    }

    #[test]
    fn rearming_clears_an_expiry_not_yet_read() {
        rt().block_on(async {
            let t = ShardTimer::new().expect("a timerfd");
            // Expires (1 ns) and is re-armed far ahead before anyone reads the expiry.
            t.arm(Duration::from_nanos(1)).expect("armed");
            std::thread::yield_now();
            t.arm(Duration::from_secs(3600)).expect("re-armed");
            let expired = t.expired();
            tokio::pin!(expired);
            assert!(futures_poll_once(expired.as_mut()).await.is_none());
        });
    }

    /// An armed timer never completes before its time, on a runtime that parks (current-thread)
    /// and on a multi-thread one (the main job's readers wait for their arrivals on it), and
    /// one timer serves many armings in turn.
    #[test]
    fn an_armed_timer_never_expires_before_its_time() {
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        for rt in [&rt(), &multi] {
            rt.block_on(async {
                // A liveness bound only: a timer that never expires fails instead of hanging.
                let guard = Duration::from_secs(30);
                let t = ShardTimer::new().expect("a timerfd");
                let start = std::time::Instant::now();
                for k in 1..=50u64 {
                    let at = start + Duration::from_micros(300 * k);
                    t.arm(at.saturating_duration_since(std::time::Instant::now()))
                        .expect("armed");
                    tokio::time::timeout(guard, t.expired())
                        .await
                        .expect("the timer expires")
                        .expect("read");
                    assert!(std::time::Instant::now() >= at, "arming {k} expired early");
                }
            });
        }
    }

    /// How long until `t` expires, as the kernel holds it (zero: disarmed).
    fn armed_for(t: &ShardTimer) -> Duration {
        let spec = rustix::time::timerfd_gettime(t.fd.get_ref()).expect("timerfd_gettime");
        Duration::new(spec.it_value.tv_sec as u64, spec.it_value.tv_nsec as u32)
    }

    /// Polls `f` once after letting the reactor run, `None` when it is pending.
    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
        tokio::task::yield_now().await;
        std::future::poll_fn(|cx| match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
            std::task::Poll::Pending => std::task::Poll::Ready(None),
        })
        .await
    }

    #[test]
    fn short_sleeps_wake_on_the_shards_own_timer_not_the_timer_thread() {
        // A disk of 2,000 reads a second: past the burst (the 2 ms goal), each read waits
        // ~500 µs for its tokens, a sleep shorter than tokio's timer resolves.
        let mut b = Dispatcher::builder()
            .shards(1)
            .pin_threads(false)
            .latency_goal(Duration::from_millis(2))
            .disk(DiskModel::symmetric(Figures {
                iops: 2_000,
                bandwidth: 1 << 30,
            }));
        let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
        let d = b.build().unwrap();
        rt().block_on(async {
            let jobs: Vec<_> = (0..40)
                .map(|_| d.submit(class, IoRequest::read(4096), async {}).unwrap())
                .collect();
            for j in jobs {
                j.await.unwrap();
            }
        });
        // Relaxed: statistics, read after the requests ended.
        let [own, thread] = &d.shared.short_sleeps[0];
        let (own, thread) = (own.load(Ordering::Relaxed), thread.load(Ordering::Relaxed));
        assert!(
            own > 0,
            "no short sleep on the shard's timerfd (timer thread: {thread})"
        );
        assert_eq!(thread, 0, "short sleeps on the timer thread");
        d.shutdown();
    }
}
