//! [`BlockingThrottle`] and [`BlockingThrottled`]: throttling for code on plain threads.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::bucket::{BucketConfig, Mode, SharedTokenBucket, Uncapped};
use crate::clock::{Clock, MonotonicClock};
use crate::ConfigError;

use super::DEFAULT_MAX_CHUNK;

/// How a blocked thread waits: `std::thread::sleep` by default; tests pass a function that
/// advances a [`ManualClock`](crate::ManualClock) instead.
type Sleep = Arc<dyn Fn(Duration) + Send + Sync>;

/// The shortest nap when tokens are due but a replenish by another thread is in progress.
const MIN_NAP: Duration = Duration::from_micros(50);

/// A [`SharedTokenBucket`] that blocks the calling thread until its tokens are there: no async
/// runtime needed. Cheap to clone (clones share the bucket).
///
/// Claims are made with one `grab` and served in grab order (FIFO across every thread, and
/// across a [`Throttle`](crate::Throttle) sharing the bucket). A blocked thread cannot be
/// cancelled, so a claim is always met; it sleeps (through the sleep function) until its tokens
/// accrue, replenishing the bucket itself.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use iothrottle::adapter::BlockingThrottle;
/// use iothrottle::{BucketConfig, Clock, ManualClock, Rate, SharedTokenBucket, Uncapped};
///
/// let clock = ManualClock::new();
/// let bucket = SharedTokenBucket::<Uncapped, _>::with_clock(
///     BucketConfig::new(Rate::per_second(1_000), 100),
///     clock.clone(),
/// )?;
/// // Sleeping advances the manual clock: the test runs instantly and exactly.
/// let c = clock.clone();
/// let throttle = BlockingThrottle::from_bucket(Arc::new(bucket)).with_sleep(move |d| c.advance(d));
/// throttle.request(1_100); // more than the limit: waited for in pieces
/// assert_eq!(clock.now(), Duration::from_secs(1));
/// # Ok::<(), iothrottle::ConfigError>(())
/// ```
pub struct BlockingThrottle<M: Mode = Uncapped, C: Clock = MonotonicClock> {
    bucket: Arc<SharedTokenBucket<M, C>>,
    sleep: Sleep,
}

impl<M: Mode, C: Clock> Clone for BlockingThrottle<M, C> {
    fn clone(&self) -> Self {
        BlockingThrottle {
            bucket: Arc::clone(&self.bucket),
            sleep: Arc::clone(&self.sleep),
        }
    }
}

impl BlockingThrottle<Uncapped, MonotonicClock> {
    /// A blocking throttle over a new uncapped bucket on a [`MonotonicClock`].
    ///
    /// A blocking throttle has no permit that comes back on completion, so it is uncapped: a
    /// capped bucket (whose ceiling moves only on release) is shared through
    /// [`from_bucket`](Self::from_bucket) by whoever releases it.
    pub fn new(config: BucketConfig) -> Result<Self, ConfigError> {
        Ok(Self::from_bucket(Arc::new(SharedTokenBucket::new(config)?)))
    }
}

impl<M: Mode, C: Clock> BlockingThrottle<M, C> {
    /// A blocking throttle over an existing bucket (which threads, throttles or a dispatcher may
    /// share).
    pub fn from_bucket(bucket: Arc<SharedTokenBucket<M, C>>) -> Self {
        BlockingThrottle {
            bucket,
            sleep: Arc::new(std::thread::sleep),
        }
    }

    /// Replaces how the thread waits (for tests: advance a manual clock).
    pub fn with_sleep(mut self, sleep: impl Fn(Duration) + Send + Sync + 'static) -> Self {
        self.sleep = Arc::new(sleep);
        self
    }

    /// The bucket.
    pub fn bucket(&self) -> &Arc<SharedTokenBucket<M, C>> {
        &self.bucket
    }

    /// Blocks until `cost` tokens (at most the limit) are there, and takes them. The caller
    /// owns them: in capped mode it must report them with `bucket().complete(n)` (or give
    /// unused ones back with `refund`).
    fn take(&self, cost: u64) {
        let bucket = &*self.bucket;
        let tail = bucket.grab(cost);
        if bucket.deficiency(tail) == 0 {
            return;
        }
        loop {
            let now = bucket.clock().now();
            bucket.replenish_at(now);
            // Claims given back by others (a cancelled `Throttle` waiter) that `head` reached.
            bucket.settle_give_backs();
            let missing = bucket.deficiency(tail);
            if missing == 0 {
                return;
            }
            // A replenish adds nothing below the threshold: wait until that many accrued.
            let need = missing.max(bucket.threshold());
            let last = bucket.last_replenish().unwrap_or(now);
            let due = last
                .checked_add(bucket.duration_for(need))
                .unwrap_or(Duration::MAX)
                .saturating_sub(now);
            (self.sleep)(due.max(MIN_NAP).min(Duration::from_secs(3600)));
        }
    }

    /// Blocks until `cost` tokens were granted, whatever the cost: a cost above the bucket's
    /// limit is taken piece by piece (RocksDB's `RateLimiter::Request`). The tokens are spent
    /// (in capped mode each piece counts as completed when granted).
    pub fn request(&self, cost: u64) {
        let limit = self.bucket.limit();
        let mut left = cost;
        while left > 0 {
            let piece = left.min(limit);
            self.take(piece);
            self.bucket.complete(piece);
            left -= piece;
        }
    }

    /// Wraps a `std::io::Read` / `Write` so that each byte costs one token of this throttle.
    pub fn wrap<T>(&self, inner: T) -> BlockingThrottled<T, M, C> {
        BlockingThrottled::new(inner, self.clone())
    }
}

impl<M: Mode, C: Clock> fmt::Debug for BlockingThrottle<M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingThrottle")
            .field("bucket", &self.bucket)
            .finish_non_exhaustive()
    }
}

/// A `std::io::Read` / `Write` whose bytes are throttled by a [`BlockingThrottle`], one token
/// per byte, with the rules of [`ThrottledIo`](crate::adapter::ThrottledIo): tokens are taken
/// before the bytes move (at most `max_chunk`, at most the limit, per call), and what a short
/// read or write did not use is refunded at once. `Seek` passes through.
///
/// ```
/// use std::io::{Read, Write};
/// use iothrottle::adapter::BlockingThrottle;
/// use iothrottle::{BucketConfig, Rate};
///
/// let throttle = BlockingThrottle::new(BucketConfig::new(Rate::per_second(1 << 30), 1 << 20))?;
/// let mut out = throttle.wrap(Vec::new());
/// out.write_all(b"hello")?;
/// let mut back = String::new();
/// throttle.wrap(&out.get_ref()[..]).read_to_string(&mut back)?;
/// assert_eq!(back, "hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct BlockingThrottled<T, M: Mode = Uncapped, C: Clock = MonotonicClock> {
    inner: T,
    throttle: BlockingThrottle<M, C>,
    max_chunk: u64,
}

impl<T, M: Mode, C: Clock> BlockingThrottled<T, M, C> {
    /// Wraps `inner`. Pieces of at most [`DEFAULT_MAX_CHUNK`] (or the limit).
    pub fn new(inner: T, throttle: BlockingThrottle<M, C>) -> Self {
        let max_chunk = DEFAULT_MAX_CHUNK.min(throttle.bucket.limit());
        BlockingThrottled {
            inner,
            throttle,
            max_chunk,
        }
    }

    /// Sets the largest piece granted to one call: `bytes` clamped to `1..=limit`.
    pub fn with_max_chunk(mut self, bytes: u64) -> Self {
        self.max_chunk = bytes.clamp(1, self.throttle.bucket.limit());
        self
    }

    /// The wrapped object.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// The wrapped object, mutably (I/O done through it is not throttled).
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// The wrapped object.
    pub fn into_inner(self) -> T {
        self.inner
    }

    /// Takes tokens for `len` bytes (clamped), runs `op` on at most that many, settles.
    fn throttled(
        &mut self,
        len: usize,
        op: impl FnOnce(&mut T, usize) -> io::Result<usize>,
    ) -> io::Result<usize> {
        if len == 0 {
            return op(&mut self.inner, 0);
        }
        let n = (len as u64).min(self.max_chunk);
        self.throttle.take(n);
        let res = op(&mut self.inner, n as usize);
        let used = match &res {
            Ok(k) => (*k as u64).min(n),
            Err(_) => 0,
        };
        let bucket = &self.throttle.bucket;
        if used > 0 {
            bucket.complete(used);
        }
        if n > used {
            bucket.refund(n - used);
        }
        res
    }
}

impl<T: fmt::Debug, M: Mode, C: Clock> fmt::Debug for BlockingThrottled<T, M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingThrottled")
            .field("inner", &self.inner)
            .field("max_chunk", &self.max_chunk)
            .finish_non_exhaustive()
    }
}

impl<T: io::Read, M: Mode, C: Clock> io::Read for BlockingThrottled<T, M, C> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.throttled(buf.len(), |inner, n| inner.read(&mut buf[..n]))
    }
}

impl<T: io::Write, M: Mode, C: Clock> io::Write for BlockingThrottled<T, M, C> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.throttled(buf.len(), |inner, n| inner.write(&buf[..n]))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<T: io::Seek, M: Mode, C: Clock> io::Seek for BlockingThrottled<T, M, C> {
    fn seek(&mut self, pos: io::SeekFrom) -> io::Result<u64> {
        self.inner.seek(pos)
    }
}
