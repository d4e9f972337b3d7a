//! Durable checkpoints: no free burst after a crash.
//!
//! A storage engine that restarts must not come back with a full bucket and flood a disk that
//! is still busy, nor forget what it had granted. The bucket's state is saved as a
//! [`Snapshot`] into a [`Checkpoint`] store — a local file ([`FileCheckpoint`], the default) or
//! PostgreSQL (`PgCheckpoint`, feature `postgres`) — by a background [`Checkpointer`], and
//! restored on start by [`restore_state`] / [`CheckpointedBucket::restore`].
//!
//! - [`Snapshot`] and the restore math ([`restore_state`], [`RestoreReport`]): this file.
//! - [`FileCheckpoint`]: the atomic, versioned, checksummed file (`file.rs`).
//! - `PgCheckpoint`: one row per named bucket, one upsert per save (`postgres.rs`).
//! - [`Checkpointer`]: the background task, off the hot path (`checkpointer.rs`).
//! - [`CheckpointedBucket`] and [`Durability`]: the bucket with its checkpoint layer
//!   (`strict.rs`).
//! - [`MarkGate`]: the layer, strict mode's write-ahead reservation check, which a
//!   [`Throttle`](crate::Throttle) waits on (`gate.rs`).
//!
//! The restore semantics and the crash bounds of both durability modes are in
//! `docs/checkpoint.md`, included below.
#![doc = include_str!("../../docs/checkpoint.md")]

mod checkpointer;
pub(crate) mod error;
mod file;
pub(crate) mod gate;
#[cfg(feature = "postgres")]
mod postgres;
mod strict;

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use checkpointer::{CheckpointConfig, Checkpointer};
pub use file::FileCheckpoint;
pub use gate::MarkGate;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::PgCheckpoint;
pub use strict::{CheckpointStats, CheckpointedBucket, Durability, RestoreOutcome};

use crate::bucket::{BucketConfig, BucketState, Mode, Rate, SharedTokenBucket};
use crate::clock::Clock;
use crate::CheckpointError;

/// The version of the snapshot format (file layout and Postgres row) this build writes. Version 2
/// added [`Snapshot::seq`]; version-1 checkpoints still load (with `seq` 0). A store refuses
/// versions it does not know with [`CheckpointError::UnsupportedVersion`].
pub const FORMAT_VERSION: u32 = 2;

/// Where a bucket stands, when, and under which configuration: what a [`Checkpoint`] stores.
///
/// Positions are absolute and wrap (only differences mean something). `wall` is the system
/// (wall-clock) time of the snapshot: the monotonic clocks of two processes cannot be compared,
/// so the downtime between a crash and a restart is measured on the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// The rovers' positions.
    pub state: BucketState,
    /// Strict mode: the durable high-water mark for `tail` — every position up to it may have
    /// been granted. A restore assumes they all were. `None` in periodic mode.
    pub reserved: Option<u64>,
    /// Wall-clock time of the snapshot, taken after the positions were read.
    pub wall: SystemTime,
    /// The bucket's rate when the snapshot was taken.
    pub rate: Rate,
    /// The bucket's limit when the snapshot was taken.
    pub limit: u64,
    /// The save's sequence number: saves are totally ordered in the store by it. Every store
    /// refuses a snapshot whose `seq` is *lower* than the stored one's
    /// ([`CheckpointError::Superseded`]), so a late write of an older save (a cancelled
    /// `save_now` whose blocking write still runs, a timed-out upsert) can never replace a newer
    /// one. An equal `seq` replaces (snapshots saved by hand can leave it at 0). The
    /// [`Checkpointer`] numbers its saves under its save lock, above the restored snapshot's.
    pub seq: u64,
}

impl Snapshot {
    /// A snapshot of `bucket` now. The positions are read first and the wall clock last, so
    /// the downtime a restore credits never covers time the positions had already seen.
    pub fn of<M: Mode, C: Clock>(bucket: &SharedTokenBucket<M, C>, reserved: Option<u64>) -> Self {
        let state = bucket.snapshot();
        let rate = bucket.rate();
        let limit = bucket.limit();
        Snapshot {
            state,
            reserved,
            wall: SystemTime::now(),
            rate,
            limit,
            seq: 0,
        }
    }

    /// The tail a restore starts from: the reservation mark when it is ahead of the saved tail
    /// (every reserved token counts as spent), else the saved tail.
    pub fn effective_tail(&self) -> u64 {
        match self.reserved {
            Some(mark) if ahead(mark, self.state.tail) > 0 => mark,
            _ => self.state.tail,
        }
    }

    /// Tokens in the bucket (positive) or owed (negative) as saved, after the reservation:
    /// `head - effective_tail`.
    pub fn tokens(&self) -> i64 {
        ahead(self.state.head, self.effective_tail())
    }

    /// Wall time as nanoseconds since the Unix epoch (0 for a clock set before 1970).
    pub(crate) fn wall_nanos(&self) -> u64 {
        self.wall
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    /// Checks what no bucket can produce: an invalid rate or limit, a deficit of 2^62 tokens or
    /// more, a reservation mark behind the tail or 2^62 or more ahead of it.
    pub fn validate(&self) -> Result<(), CheckpointError> {
        let invalid = |reason| Err(CheckpointError::InvalidSnapshot { reason });
        if self.rate.validate().is_err() {
            return invalid("the saved rate is not a valid rate");
        }
        if self.limit == 0 || self.limit > BucketConfig::MAX_LIMIT {
            return invalid("the saved limit is 0 or above the maximum limit");
        }
        if let Some(mark) = self.reserved {
            let d = ahead(mark, self.state.tail);
            if !(0..MAX_GAP).contains(&d) {
                return invalid("the reservation mark is behind the tail or 2^62 ahead of it");
            }
        }
        if self.tokens() <= -MAX_GAP {
            return invalid("a deficit of 2^62 tokens or more");
        }
        Ok(())
    }
}

/// The largest gap between two rovers a valid snapshot has: 2^62.
const MAX_GAP: i64 = BucketConfig::MAX_LIMIT as i64;

use crate::bucket::ahead;

/// A durable home for one bucket's [`Snapshot`].
///
/// `save` replaces the stored snapshot atomically: after a crash at any moment, `load` returns
/// either the previous snapshot or the new one, never a mix. `load` returns `Ok(None)` when
/// nothing was ever saved (first start) and an error when what is stored cannot be trusted.
/// Both are called from the [`Checkpointer`]'s background task, never from the hot path.
pub trait Checkpoint: Send + Sync + 'static {
    /// Stores `snapshot`, replacing the previous one. Returns once it is durable.
    fn save(&self, snapshot: Snapshot) -> impl Future<Output = Result<(), CheckpointError>> + Send;

    /// The last saved snapshot; `None` on first start.
    fn load(&self) -> impl Future<Output = Result<Option<Snapshot>, CheckpointError>> + Send;
}

/// A shared store (e.g. the checkpointer's and the application's handle on one
/// `PgCheckpoint`).
impl<S: Checkpoint> Checkpoint for std::sync::Arc<S> {
    fn save(&self, snapshot: Snapshot) -> impl Future<Output = Result<(), CheckpointError>> + Send {
        (**self).save(snapshot)
    }

    fn load(&self) -> impl Future<Output = Result<Option<Snapshot>, CheckpointError>> + Send {
        (**self).load()
    }
}

/// What a restore did, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RestoreReport {
    /// Tokens the snapshot held (negative: owed), after counting the reservation as spent and
    /// before any adaptation.
    pub saved_tokens: i64,
    /// Tokens of the strict-mode reservation counted as spent (0 in periodic mode).
    pub reserved_spent: u64,
    /// Wall-clock time between the snapshot and the restore (zero if the clock went back).
    pub downtime: Duration,
    /// The wall clock is earlier than the snapshot's: the downtime counts as zero.
    pub clock_went_backwards: bool,
    /// The rate that credited the downtime: the slower of the saved and the configured rate.
    pub credit_rate: Rate,
    /// Tokens the downtime earned: `credit_rate.tokens_in(downtime)` (not yet capped).
    pub earned: u128,
    /// The snapshot was taken under another rate.
    pub rate_changed: bool,
    /// The snapshot was taken under another limit.
    pub limit_changed: bool,
    /// Tokens in the restored bucket (negative: still owed):
    /// `min(limit, min(saved_tokens, limit) + earned)`.
    pub tokens: i64,
}

/// The restore math: the state a bucket of `config` restarts in, from `snapshot`, at wall time
/// `now`.
///
/// - tokens = `min(limit, saved_tokens + rate × downtime)`, in exact integer arithmetic
///   ([`Rate::tokens_in`]); a saved deficit (negative tokens) is still owed and is paid off by
///   the downtime first.
/// - strict mode: every token up to the reservation mark counts as spent (the tail restarts at
///   the mark).
/// - a wall clock earlier than the snapshot's counts as zero downtime (tracing warning).
/// - a snapshot from another rate or limit is adapted (tracing warning): saved tokens above the
///   new limit are cut to it, and the downtime is credited at the slower of the two rates.
///
/// The returned state keeps the absolute tail (so reservation marks stay comparable across
/// restarts); `capped` selects whether it has a `ceil` (nothing is in flight after a restart:
/// `ceil = tail + limit`).
pub fn restore_state(
    snapshot: &Snapshot,
    config: &BucketConfig,
    capped: bool,
    now: SystemTime,
) -> Result<(BucketState, RestoreReport), CheckpointError> {
    config.validate()?;
    snapshot.validate()?;
    let limit = config.limit();
    let rate_changed = snapshot.rate.cmp_rate(&config.rate()).is_ne();
    let limit_changed = snapshot.limit != limit;
    if rate_changed || limit_changed {
        tracing::warn!(
            saved_rate = %snapshot.rate,
            saved_limit = snapshot.limit,
            rate = %config.rate(),
            limit,
            "checkpoint was saved under another configuration: adapting it (tokens capped at \
             the new limit, downtime credited at the slower rate)"
        );
    }
    let (downtime, went_back) = match now.duration_since(snapshot.wall) {
        Ok(d) => (d, false),
        Err(e) => {
            tracing::warn!(
                behind = ?e.duration(),
                "wall clock is earlier than the checkpoint's: counting zero downtime"
            );
            (Duration::ZERO, true)
        }
    };
    let credit_rate = std::cmp::min_by(snapshot.rate, config.rate(), Rate::cmp_rate);
    let earned = credit_rate.tokens_in(downtime);
    let saved_tokens = snapshot.tokens();
    let tail = snapshot.effective_tail();
    let reserved_spent = tail.wrapping_sub(snapshot.state.tail);
    let start = (saved_tokens as i128).min(limit as i128);
    let tokens = (start + earned.min(u64::MAX as u128) as i128).min(limit as i128) as i64;
    let head = tail.wrapping_add(tokens as u64);
    let state = BucketState {
        tail,
        head,
        ceil: capped.then(|| tail.wrapping_add(limit)),
    };
    let report = RestoreReport {
        saved_tokens,
        reserved_spent,
        downtime,
        clock_went_backwards: went_back,
        credit_rate,
        earned,
        rate_changed,
        limit_changed,
        tokens,
    };
    tracing::debug!(?report, "checkpoint restored");
    Ok((state, report))
}

/// A bucket of `config` restored from `snapshot` at wall time `now`, as if replenished now
/// ([`SharedTokenBucket::from_state`]): time accrues from the restore on.
pub fn restore_bucket<M: Mode, C: Clock>(
    snapshot: &Snapshot,
    config: BucketConfig,
    clock: C,
    now: SystemTime,
) -> Result<(SharedTokenBucket<M, C>, RestoreReport), CheckpointError> {
    let (state, report) = restore_state(snapshot, &config, M::CAPPED, now)?;
    Ok((SharedTokenBucket::from_state(config, clock, state)?, report))
}

/// An *empty* bucket of `config`: the fallback when a checkpoint exists but cannot be trusted.
/// It holds no token and accrues from now on, so a corrupt file never turns into a free burst.
pub fn empty_bucket<M: Mode, C: Clock>(
    config: BucketConfig,
    clock: C,
) -> Result<SharedTokenBucket<M, C>, CheckpointError> {
    let state = BucketState {
        tail: 0,
        head: 0,
        ceil: M::CAPPED.then_some(config.limit()),
    };
    Ok(SharedTokenBucket::from_state(config, clock, state)?)
}

#[cfg(test)]
mod tests;
