//! Where the time comes from.
//!
//! The bucket never reads the system time itself: it asks a [`Clock`]. Production code uses
//! [`MonotonicClock`]; tests drive a [`ManualClock`] by hand, or use [`TokioClock`] under tokio's
//! paused time, so that no test has to sleep to check a rate.

use std::fmt;
use std::time::{Duration, Instant};

pub(crate) mod error;

use crate::sync::{Arc, AtomicU64, Ordering};
use error::ClockError;

/// A monotonic source of time.
///
/// `now()` is the time elapsed since the clock's own origin. It must never go backwards: two
/// calls on the same clock (or on clones of it) return non-decreasing values. Timestamps of
/// different clocks are not comparable.
pub trait Clock: Send + Sync {
    /// The time since this clock's origin.
    fn now(&self) -> Duration;

    /// [`now`](Self::now) in whole nanoseconds, saturating at `u64::MAX` (about 584 years):
    /// what the bucket reads on every replenish. A clock that counts in nanoseconds overrides
    /// it to skip the `Duration`; it must agree with `now`.
    #[inline]
    fn now_nanos(&self) -> u64 {
        u64::try_from(self.now().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Duration {
        (**self).now()
    }

    #[inline]
    fn now_nanos(&self) -> u64 {
        (**self).now_nanos()
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now(&self) -> Duration {
        (**self).now()
    }

    #[inline]
    fn now_nanos(&self) -> u64 {
        (**self).now_nanos()
    }
}

/// The default clock: [`std::time::Instant`], measured from the moment the clock was made.
///
/// Copies share the origin, so buckets and shards handed copies of one `MonotonicClock` agree
/// on the time.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }

    /// The instant this clock counts from.
    pub fn origin(&self) -> Instant {
        self.origin
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A monotonic clock read from the CPU's time-stamp counter through
/// [`quanta`](https://docs.rs/quanta) (the clock governor uses): a few nanoseconds per reading
/// where `Instant::now()` costs a vDSO call. quanta falls back to the OS monotonic clock where
/// the counter is not invariant across cores.
///
/// The first `FastClock` of a process calibrates the counter against the OS clock (up to
/// 200 ms, once). Copies share the origin. The default clock of
/// [`KeyedThrottle`](crate::keyed::KeyedThrottle), which reads the time once per check.
///
/// A reading is one counter read and one scaling of the difference from the origin (no
/// thread-local lookup, no lazy initialisation check): every `FastClock` of a process reads
/// one calibrated `quanta::Clock`.
#[derive(Clone, Copy)]
pub struct FastClock {
    clock: &'static quanta::Clock,
    /// The counter's raw reading at the origin.
    origin: u64,
}

/// The process's calibrated counter, shared by every [`FastClock`].
static FAST_CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();

impl FastClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = FAST_CLOCK.get_or_init(quanta::Clock::new);
        FastClock {
            clock,
            origin: clock.raw(),
        }
    }
}

impl Default for FastClock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for FastClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FastClock").finish_non_exhaustive()
    }
}

impl Clock for FastClock {
    #[inline]
    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_nanos())
    }

    #[inline]
    fn now_nanos(&self) -> u64 {
        // Raw readings of one invariant counter never go backwards (quanta uses the OS
        // monotonic clock where the counter is not invariant); a reading not after the origin
        // gives zero.
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

/// `CLOCK_MONOTONIC`, in nanoseconds since the system booted: one time base for every
/// process of the machine (feature `shm`, Unix).
///
/// A [`MonotonicClock`] counts from its own origin (an [`Instant`], which the standard
/// library does not promise to be comparable across processes), so buckets in shared memory
/// ([`SharedTokenBucket::open`](crate::SharedTokenBucket::open)) use this one: on Linux
/// `CLOCK_MONOTONIC` is system-wide, does not jump with the wall clock, and (unlike
/// `CLOCK_BOOTTIME`) stops while the machine is suspended, so a suspend earns no tokens.
///
/// ```
/// # #[cfg(all(feature = "shm", unix))] {
/// use iothrottle::{Clock, SystemMonotonicClock};
///
/// let (a, b) = (SystemMonotonicClock.now(), SystemMonotonicClock.now());
/// assert!(b >= a);
/// # }
/// ```
#[cfg(all(feature = "shm", unix))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SystemMonotonicClock;

#[cfg(all(feature = "shm", unix))]
impl Clock for SystemMonotonicClock {
    fn now(&self) -> Duration {
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        // CLOCK_MONOTONIC is never negative and tv_nsec is below 10^9.
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// A clock that moves only when told to; clones share one time.
///
/// Starts at zero. Time is kept in whole nanoseconds.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(shared.now(), Duration::from_millis(5));
/// assert!(clock.set(Duration::from_millis(1)).is_err()); // never backwards
/// ```
#[derive(Clone)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        ManualClock {
            nanos: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Moves the time forward by `by` (saturating at `u64::MAX` nanoseconds, about 584 years).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: the clock is a lone counter; whoever needs ordering with other data gets it
        // from that data's own synchronisation.
        let _ = self
            .nanos
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_add(by))
            });
    }

    /// Sets the time to `to`, which must not be earlier than the current time.
    pub fn set(&self, to: Duration) -> Result<(), ClockError> {
        let to_ns = u64::try_from(to.as_nanos()).map_err(|_| ClockError::OutOfRange { at: to })?;
        // Relaxed: as in `advance`.
        self.nanos
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (to_ns >= n).then_some(to_ns)
            })
            .map(|_| ())
            .map_err(|current| ClockError::WentBackwards {
                from: Duration::from_nanos(current),
                to,
            })
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now", &self.now())
            .finish()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_nanos())
    }

    fn now_nanos(&self) -> u64 {
        // Relaxed: see `advance`.
        self.nanos.load(Ordering::Relaxed)
    }
}

/// tokio's clock: [`tokio::time::Instant`], measured from the moment the clock was made.
/// (Feature `rt`.)
///
/// Under `#[tokio::test(start_paused = true)]` (or `tokio::time::pause`) this clock follows
/// tokio's virtual time, so async tests of rates run instantly and exactly.
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

#[cfg(feature = "rt")]
impl TokioClock {
    /// A clock whose origin is tokio's `now`.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

#[cfg(feature = "rt")]
impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(feature = "rt")]
impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}
