//! [`CheckpointedBucket`]: the bucket seen through its checkpoint, with the write-ahead
//! reservation check of [`Durability::Strict`] on the grab path.
//!
//! The reservation protocol itself (the mark, the request flag and their orderings) is
//! [`MarkGate`] (`gate.rs`); this type pairs it with the bucket.

use std::fmt;
use std::time::SystemTime;

use std::sync::Arc;

use crate::bucket::{BucketConfig, Mode, SharedTokenBucket, Uncapped};
use crate::checkpoint::gate::MarkGate;
use crate::checkpoint::{empty_bucket, restore_bucket, Checkpoint, RestoreReport};
use crate::clock::{Clock, MonotonicClock};
use crate::sync::Ordering;
use crate::CheckpointError;

/// How much a crash may cost: what the checkpoint guarantees about tokens granted across it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The snapshot is saved every interval. Across a crash the bucket may grant again the
    /// tokens granted since the last successful save: at most `limit + rate × (interval + save
    /// time)`, and `rate × (interval + save time)` when the bucket is drained. The hot path does
    /// nothing extra.
    Periodic,
    /// Write-ahead reservation: the checkpoint records a mark for `tail` *ahead* of use, and no
    /// token past the durable mark is granted. On restore every reserved token counts as spent.
    /// Across any number of crashes no more than `limit + rate × wall time` tokens are granted.
    Strict {
        /// How far ahead of the tail each reservation reaches, in tokens (≥ 1). A new one is
        /// saved when less than half of it is left, so in steady state grabs never wait for
        /// storage if half a reservation lasts longer than a save. A crash burns at most this
        /// many tokens. A good start: `rate × interval`.
        reserve_ahead: u64,
        /// When storage stalls, grabs past the mark proceed (counted in
        /// [`CheckpointStats::grabs_past_mark`](crate::checkpoint::CheckpointStats)) instead of
        /// waiting. Those grabs are not covered by the crash bound.
        fail_open: bool,
    },
}

impl Durability {
    /// Strict mode reserving `reserve_ahead` tokens at a time, waiting when storage stalls.
    pub const fn strict(reserve_ahead: u64) -> Self {
        Durability::Strict {
            reserve_ahead,
            fail_open: false,
        }
    }

    /// Checks the setting: a strict reservation must be 1..=2^62 tokens.
    pub fn validate(&self) -> Result<(), CheckpointError> {
        match *self {
            Durability::Strict { reserve_ahead, .. }
                if reserve_ahead == 0 || reserve_ahead > BucketConfig::MAX_LIMIT =>
            {
                Err(CheckpointError::InvalidConfig {
                    reason: "the strict reservation must be 1..=2^62 tokens",
                })
            }
            _ => Ok(()),
        }
    }
}

/// How a [`CheckpointedBucket`] started.
#[derive(Debug)]
#[non_exhaustive]
pub enum RestoreOutcome {
    /// Nothing was saved: a fresh bucket (its first replenish fills it, as for any new bucket).
    FirstStart,
    /// Restored from the checkpoint.
    Restored(RestoreReport),
    /// The checkpoint could not be loaded or trusted: an *empty* bucket, and why.
    Fallback(CheckpointError),
}

/// Statistics of a checkpointed bucket and its [`Checkpointer`](crate::checkpoint::Checkpointer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CheckpointStats {
    /// Saves that succeeded.
    pub saves: u64,
    /// Saves that failed (each one also logged as a tracing warning).
    pub save_failures: u64,
    /// Failures since the last successful save: non-zero means the store is failing now.
    pub consecutive_failures: u64,
    /// Wall time of the last successful save's snapshot, ns since the Unix epoch (0: none).
    pub last_save_unix_nanos: u64,
    /// Strict mode: grabs that went past the durable mark — they waited for a reservation,
    /// or with `fail_open` proceeded without one (outside the crash bound).
    pub grabs_past_mark: u64,
    /// Strict mode: the durable high-water mark for the tail.
    pub mark: u64,
}

/// A [`SharedTokenBucket`] with its checkpoint layer ([`MarkGate`]): the hot path of a durable
/// limiter.
///
/// In [`Durability::Periodic`] mode `grab` and `deficiency` are the bucket's own. In
/// [`Durability::Strict`] mode `grab` also compares the new tail with the durable reservation
/// mark (one extra load) and wakes the checkpointer when less than half a reservation is left;
/// `deficiency` stays positive for tokens past the mark until a reservation covers them.
/// Neither ever waits for I/O. To wait, use a [`Throttle`](crate::Throttle) over it
/// ([`Throttle::with_checkpoint`](crate::Throttle::with_checkpoint)) or a dispatcher built over
/// it (`DispatcherBuilder::checkpoint`): their cancel-safe waiting protocols then also wait,
/// without polling, for the durable mark.
///
/// ```
/// use iothrottle::checkpoint::{CheckpointedBucket, Durability};
/// use iothrottle::{BucketConfig, ManualClock, Rate, SharedTokenBucket, Uncapped};
///
/// let cfg = BucketConfig::new(Rate::per_second(1_000), 100);
/// let bucket = SharedTokenBucket::<Uncapped, _>::with_clock(cfg, ManualClock::new())?;
/// bucket.replenish();
/// let strict = CheckpointedBucket::new(bucket, Durability::strict(50))?;
/// let tail = strict.grab(10);
/// // The tokens are in the bucket, but no reservation covers them yet.
/// assert_eq!(strict.bucket().deficiency(tail), 0);
/// assert_eq!(strict.deficiency(tail), 10);
/// # Ok::<(), iothrottle::CheckpointError>(())
/// ```
pub struct CheckpointedBucket<M: Mode = Uncapped, C: Clock = MonotonicClock> {
    bucket: Arc<SharedTokenBucket<M, C>>,
    gate: Arc<MarkGate>,
    /// The [`seq`](crate::checkpoint::Snapshot::seq) of the snapshot this bucket was restored
    /// from (0: none); the checkpointer numbers its saves above it.
    pub(crate) restored_seq: u64,
}

impl<M: Mode, C: Clock> CheckpointedBucket<M, C> {
    /// Wraps `bucket`. In strict mode nothing is reserved yet: the mark is the current tail, and
    /// the first grab waits for the checkpointer's first reservation.
    pub fn new(
        bucket: SharedTokenBucket<M, C>,
        durability: Durability,
    ) -> Result<Self, CheckpointError> {
        durability.validate()?;
        let tail = bucket.snapshot().tail;
        Ok(CheckpointedBucket {
            bucket: Arc::new(bucket),
            gate: Arc::new(MarkGate::new(durability, tail)),
            restored_seq: 0,
        })
    }

    /// Loads `store` and builds the bucket from it: a fresh bucket on first start, the restore
    /// math of [`restore_state`](crate::checkpoint::restore_state) otherwise. A checkpoint that
    /// cannot be loaded or trusted is an error; see [`restore_or_empty`](Self::restore_or_empty)
    /// for the fallback.
    pub async fn restore<S: Checkpoint>(
        store: &S,
        config: BucketConfig,
        clock: C,
        durability: Durability,
    ) -> Result<(Self, Option<RestoreReport>), CheckpointError> {
        durability.validate()?;
        match store.load().await? {
            None => Ok((
                Self::new(SharedTokenBucket::with_clock(config, clock)?, durability)?,
                None,
            )),
            Some(snapshot) => {
                let (bucket, report) = restore_bucket(&snapshot, config, clock, SystemTime::now())?;
                let mut this = Self::new(bucket, durability)?;
                this.restored_seq = snapshot.seq;
                Ok((this, Some(report)))
            }
        }
    }

    /// Like [`restore`](Self::restore), but a checkpoint that cannot be loaded or trusted
    /// (corrupt or truncated file, unreachable database, invalid content) gives an **empty**
    /// bucket — never a full one — with a tracing warning. Only a bad `config` or `durability`
    /// is still an error.
    pub async fn restore_or_empty<S: Checkpoint>(
        store: &S,
        config: BucketConfig,
        clock: C,
        durability: Durability,
    ) -> Result<(Self, RestoreOutcome), CheckpointError>
    where
        C: Clone,
    {
        config.validate()?;
        durability.validate()?;
        match Self::restore(store, config, clock.clone(), durability).await {
            Ok((b, Some(report))) => Ok((b, RestoreOutcome::Restored(report))),
            Ok((b, None)) => Ok((b, RestoreOutcome::FirstStart)),
            Err(e) => {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "checkpoint unusable: starting with an EMPTY bucket"
                );
                let bucket = empty_bucket(config, clock)?;
                Ok((Self::new(bucket, durability)?, RestoreOutcome::Fallback(e)))
            }
        }
    }

    /// The bucket itself (for `replenish`, `duration_for`, `set_rate`, ...). Grabbing on it
    /// directly bypasses the strict reservation check.
    pub fn bucket(&self) -> &SharedTokenBucket<M, C> {
        &self.bucket
    }

    /// The bucket, shared (what a [`Throttle`](crate::Throttle) over it holds).
    pub fn shared_bucket(&self) -> &Arc<SharedTokenBucket<M, C>> {
        &self.bucket
    }

    /// The checkpoint layer: what a waiter checks after each grab.
    pub fn gate(&self) -> &Arc<MarkGate> {
        &self.gate
    }

    /// The durability mode.
    pub fn durability(&self) -> Durability {
        self.gate.durability()
    }

    /// Claims `n` tokens, like [`SharedTokenBucket::grab`]; never waits. In strict mode it also
    /// asks the checkpointer for a new reservation when less than half of one is left.
    #[inline]
    pub fn grab(&self, n: u64) -> u64 {
        let tail = self.bucket.grab(n);
        self.gate.on_grab(tail);
        tail
    }

    /// How many tokens up to `tail` cannot be used yet. In strict mode (without `fail_open`)
    /// that includes the tokens past the durable mark; wait for those with
    /// [`wait_durable`](Self::wait_durable).
    #[inline]
    pub fn deficiency(&self, tail: u64) -> u64 {
        let d = self.bucket.deficiency(tail);
        if self.gate.blocks(tail) {
            return d.max(self.gate.past_mark(tail));
        }
        d
    }

    /// Tokens up to `tail` that no durable reservation covers (0 in periodic mode).
    pub fn past_mark(&self, tail: u64) -> u64 {
        self.gate.past_mark(tail)
    }

    /// Waits until a durable reservation covers `tail` (at once in periodic or fail-open mode).
    pub async fn wait_durable(&self, tail: u64) {
        self.gate.wait_durable(tail).await
    }

    /// Statistics of the bucket and its checkpointer.
    pub fn stats(&self) -> CheckpointStats {
        let c = &self.gate.counters;
        // Relaxed loads: statistics (see the gate's orderings); Acquire for the mark.
        CheckpointStats {
            saves: c.saves.load(Ordering::Relaxed),
            save_failures: c.save_failures.load(Ordering::Relaxed),
            consecutive_failures: c.consecutive_failures.load(Ordering::Relaxed),
            last_save_unix_nanos: c.last_save_unix_nanos.load(Ordering::Relaxed),
            grabs_past_mark: c.grabs_past_mark.load(Ordering::Relaxed),
            mark: self.gate.mark(),
        }
    }

    /// The durable mark (strict mode).
    pub(crate) fn mark(&self) -> u64 {
        self.gate.mark()
    }

    /// Clears the reservation request; the checkpointer calls it before reading the tail.
    pub(crate) fn clear_request(&self) {
        self.gate.clear_request();
    }

    /// Whether a new reservation is due: less than half of one left.
    pub(crate) fn reservation_due(&self) -> bool {
        self.gate.low(self.bucket.snapshot().tail)
    }

    /// Publishes a mark that the store has made durable, and wakes the grabs waiting for it.
    /// Called by the checkpointer only, under its save lock (marks only move forward).
    pub(crate) fn publish_mark(&self, mark: u64) {
        self.gate.publish_mark(mark);
    }
}

impl<M: Mode, C: Clock> fmt::Debug for CheckpointedBucket<M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointedBucket")
            .field("bucket", &self.bucket)
            .field("durability", &self.durability())
            .field("stats", &self.stats())
            .finish()
    }
}
