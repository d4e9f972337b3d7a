//! [`Checkpointer`]: the background task that saves a bucket's snapshot, off the hot path.
//!
//! # Orderings
//!
//! The counters it updates are statistics (`fetch_add`/`store` with `Relaxed`); the mark is
//! published through [`CheckpointedBucket`]'s own Release store (see `strict.rs`).

use std::fmt;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;

use crate::bucket::ahead;
use crate::bucket::Mode;
use crate::checkpoint::{Checkpoint, CheckpointedBucket, Durability, Snapshot};
use crate::clock::Clock;
use crate::sync::Ordering;
use crate::CheckpointError;
// std's Arc, not `crate::sync`'s: it is part of the public API (`start` takes one).
use std::sync::Arc;

/// When the [`Checkpointer`] saves, and how it retries.
///
/// ```
/// use std::time::Duration;
/// use iothrottle::checkpoint::CheckpointConfig;
///
/// let cfg = CheckpointConfig::default().with_interval(Duration::from_millis(250));
/// assert_eq!(cfg.interval(), Duration::from_millis(250));
/// assert!(CheckpointConfig::default().with_interval(Duration::ZERO).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointConfig {
    interval: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
}

impl Default for CheckpointConfig {
    /// Every second; after a failure retry after 50 ms, doubling up to 5 s.
    fn default() -> Self {
        CheckpointConfig {
            interval: Duration::from_secs(1),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
        }
    }
}

impl CheckpointConfig {
    /// Saves every `interval` (must be positive).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// After a failed save, retries after `initial`, doubling up to `max` (`0 < initial ≤ max`).
    pub fn with_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max;
        self
    }

    /// The save interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), CheckpointError> {
        if self.interval.is_zero() {
            return Err(CheckpointError::InvalidConfig {
                reason: "the checkpoint interval must be positive",
            });
        }
        if self.backoff_initial.is_zero() || self.backoff_initial > self.backoff_max {
            return Err(CheckpointError::InvalidConfig {
                reason: "the back-off must satisfy 0 < initial <= max",
            });
        }
        Ok(())
    }
}

struct Shared<S, M: Mode, C: Clock> {
    bucket: Arc<CheckpointedBucket<M, C>>,
    store: S,
    /// One save at a time, and the sequence number of the next save: saves are numbered in the
    /// order their snapshots are taken, and only one writer moves the strict mark. A save
    /// cancelled while its store write still runs releases the lock early, but its number is
    /// lower than every later save's, and the store refuses to go back on it.
    save_lock: Mutex<u64>,
}

impl<S: Checkpoint, M: Mode, C: Clock + 'static> Shared<S, M, C> {
    /// Takes a snapshot (with a new reservation in strict mode), saves it, and on success
    /// publishes the mark. Updates the counters and logs failures.
    ///
    /// `release`: the caller guarantees that no grab runs any more; strict mode then saves the
    /// tail itself as the mark (the unused reservation is given back).
    async fn save(&self, release: bool) -> Result<(), CheckpointError> {
        let mut next_seq = self.save_lock.lock().await;
        let mut retried = false;
        loop {
            match self.save_locked(release, &mut next_seq).await {
                // The store holds a save of another numbering (another process on the same
                // store, or a store restored elsewhere): number ours above it and save again,
                // once, with a fresh snapshot.
                Err(CheckpointError::Superseded { stored, .. }) if !retried => {
                    retried = true;
                    *next_seq = stored.wrapping_add(1);
                }
                outcome => return outcome,
            }
        }
    }

    /// One save, under the save lock (`next_seq`: its guarded number).
    async fn save_locked(&self, release: bool, next_seq: &mut u64) -> Result<(), CheckpointError> {
        let b = &self.bucket;
        if b.durability() != Durability::Periodic {
            // Before reading the tail: a grab after this re-arms the request.
            b.clear_request();
        }
        let mut snapshot = Snapshot::of(b.bucket(), None);
        snapshot.seq = *next_seq;
        *next_seq = next_seq.wrapping_add(1);
        // The new mark is computed from the snapshot's own tail, so it is never behind it
        // (grabs past the old mark are waiting, not granted: covering them is safe).
        let reserved = match b.durability() {
            Durability::Periodic => None,
            Durability::Strict { .. } if release => {
                snapshot.reserved = Some(snapshot.state.tail);
                None
            }
            Durability::Strict { reserve_ahead, .. } => {
                let wanted = snapshot.state.tail.wrapping_add(reserve_ahead);
                let mark = b.mark();
                let mark = if ahead(wanted, mark) > 0 {
                    wanted
                } else {
                    mark
                };
                snapshot.reserved = Some(mark);
                Some(mark)
            }
        };
        let c = &b.gate().counters;
        match self.store.save(snapshot).await {
            Ok(()) => {
                if let Some(mark) = reserved {
                    b.publish_mark(mark);
                }
                // Relaxed: statistics.
                c.saves.fetch_add(1, Ordering::Relaxed);
                c.consecutive_failures.store(0, Ordering::Relaxed);
                c.last_save_unix_nanos
                    .store(snapshot.wall_nanos(), Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                // Relaxed: statistics.
                c.save_failures.fetch_add(1, Ordering::Relaxed);
                let n = c.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    consecutive_failures = n,
                    "checkpoint save failed; the limiter keeps running from memory"
                );
                Err(e)
            }
        }
    }
}

/// The background task that saves a [`CheckpointedBucket`] into a [`Checkpoint`] store.
///
/// It saves every [`interval`](CheckpointConfig::with_interval) (default 1 s), and in strict
/// mode also as soon as a grab finds less than half a reservation left. A failed save is
/// retried with a doubling back-off, logged (tracing `WARN`) and counted in
/// [`CheckpointedBucket::stats`]; it never panics, and the bucket keeps working from memory
/// (in strict mode grabs past the mark wait, or proceed with `fail_open`).
/// [`shutdown`](Self::shutdown) makes a final save. Dropping the checkpointer without
/// `shutdown` stops the task without one.
///
/// Must be started inside a tokio runtime (`rt` is enough; the file store uses
/// `spawn_blocking`).
pub struct Checkpointer<S: Checkpoint, M: Mode, C: Clock + 'static> {
    shared: Arc<Shared<S, M, C>>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl<S: Checkpoint, M: Mode, C: Clock + 'static> Checkpointer<S, M, C> {
    /// Starts saving `bucket` into `store` on the current tokio runtime (outside one:
    /// [`CheckpointError::InvalidConfig`]). In strict mode the first reservation is saved at
    /// once.
    pub fn start(
        bucket: Arc<CheckpointedBucket<M, C>>,
        store: S,
        config: CheckpointConfig,
    ) -> Result<Self, CheckpointError> {
        config.validate()?;
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| CheckpointError::InvalidConfig {
                reason: "the checkpointer must be started inside a tokio runtime",
            })?;
        // Above the restored snapshot's number: the first save replaces it.
        let bucket_seq = bucket.restored_seq.wrapping_add(1);
        let shared = Arc::new(Shared {
            bucket,
            store,
            save_lock: Mutex::new(bucket_seq),
        });
        let (stop, stopped) = watch::channel(false);
        let task = runtime.spawn(run(shared.clone(), config, stopped));
        Ok(Checkpointer {
            shared,
            stop,
            task: Some(task),
        })
    }

    /// Saves now and reports the outcome (the background task keeps its own schedule).
    pub async fn save_now(&self) -> Result<(), CheckpointError> {
        self.shared.save(false).await
    }

    /// The bucket.
    pub fn bucket(&self) -> &Arc<CheckpointedBucket<M, C>> {
        &self.shared.bucket
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.shared.store
    }

    /// Stops the background task and makes a final save, whose outcome it returns. In strict
    /// mode the final snapshot keeps the current reservation (grabs may still be running), so
    /// a clean restart also counts the unused part of it as spent.
    pub async fn shutdown(mut self) -> Result<(), CheckpointError> {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            if task.await.is_err() {
                return Err(CheckpointError::Stopped);
            }
        }
        self.shared.save(false).await
    }

    /// Like [`shutdown`](Self::shutdown), for a bucket that is idle: the caller guarantees
    /// that no grab runs any more (every `acquire` has returned or been dropped). In strict
    /// mode the final snapshot then gives the unused reservation back (its mark is the tail),
    /// so a clean restart does not count it as spent. Grabbing after this breaks the strict
    /// bound.
    pub async fn shutdown_idle(mut self) -> Result<(), CheckpointError> {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            if task.await.is_err() {
                return Err(CheckpointError::Stopped);
            }
        }
        self.shared.save(true).await
    }
}

async fn run<S: Checkpoint, M: Mode, C: Clock + 'static>(
    shared: Arc<Shared<S, M, C>>,
    config: CheckpointConfig,
    mut stopped: watch::Receiver<bool>,
) {
    let b = shared.bucket.clone();
    let mut next = tokio::time::Instant::now();
    let mut backoff = config.backoff_initial;
    loop {
        if !b.reservation_due() {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = b.gate().wake.notified() => {}
                _ = stopped.changed() => return,
            }
        }
        if *stopped.borrow() {
            return;
        }
        match shared.save(false).await {
            Ok(()) => {
                backoff = config.backoff_initial;
                next = tokio::time::Instant::now() + config.interval;
            }
            Err(_) => {
                // Logged and counted by `save`; retry after the back-off (or when stopped).
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopped.changed() => return,
                }
                backoff = (backoff * 2).min(config.backoff_max);
                next = tokio::time::Instant::now();
            }
        }
    }
}

impl<S: Checkpoint, M: Mode, C: Clock + 'static> Drop for Checkpointer<S, M, C> {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl<S: Checkpoint, M: Mode, C: Clock + 'static> fmt::Debug for Checkpointer<S, M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpointer")
            .field("bucket", &self.shared.bucket)
            .field("running", &self.task.is_some())
            .finish()
    }
}
