//! Why a [`Throttle`](crate::Throttle) gave no permit.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use std::time::Duration;

/// Why [`Throttle::acquire`](crate::throttle::Throttle::acquire) gave no permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AcquireError {
    /// The throttle was closed (before or while waiting); every waiter gets this.
    #[error("the throttle is closed")]
    Closed,
    /// The cost is more than the bucket can ever hold: waiting would never end.
    #[error("a cost of {cost} tokens can never be met: the bucket holds at most {limit}")]
    CostExceedsLimit {
        /// The cost asked for.
        cost: u64,
        /// The bucket's limit.
        limit: u64,
    },
}

/// Why [`Throttle::try_acquire`](crate::throttle::Throttle::try_acquire) gave no permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TryAcquireError {
    /// The throttle is closed.
    #[error("the throttle is closed")]
    Closed,
    /// The cost is more than the bucket can ever hold.
    #[error("a cost of {cost} tokens can never be met: the bucket holds at most {limit}")]
    CostExceedsLimit {
        /// The cost asked for.
        cost: u64,
        /// The bucket's limit.
        limit: u64,
    },
    /// Not enough tokens now (or others are queued first).
    #[error("{missing} tokens short; retry in {retry_after:?}")]
    Insufficient {
        /// Tokens still to accrue before this cost could be granted (the queue ahead included).
        missing: u64,
        /// The earliest time, from the check, at which a retry can succeed at the current rate
        /// (replenish threshold included). A retry after it may still fail if others claim the
        /// tokens first.
        retry_after: Duration,
    },
}

impl TryAcquireError {
    /// How long to wait before retrying, for [`Insufficient`](Self::Insufficient); `None` when
    /// retrying cannot help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            TryAcquireError::Insufficient { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}
