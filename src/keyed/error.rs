//! The keyed throttle's errors: a configuration it refuses, a check it refuses.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use std::time::Duration;

use crate::ConfigError;

/// Why a [`KeyedThrottle`](crate::keyed::KeyedThrottle) cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyedConfigError {
    /// The per-key bucket configuration is rejected.
    #[error("invalid per-key bucket")]
    Bucket(#[from] ConfigError),
    /// A map that can hold no key.
    #[error("max_keys must be at least 1")]
    ZeroMaxKeys,
}

/// Why [`KeyedThrottle::check`](crate::keyed::KeyedThrottle::check) refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyedError {
    /// The key's bucket has too few tokens now; a retry after `retry_after` can succeed.
    #[error("{missing} tokens missing for this key; retry in {retry_after:?}")]
    Insufficient {
        /// Tokens missing.
        missing: u64,
        /// How long until they accrue (at the current time and rate).
        retry_after: Duration,
    },
    /// The cost is more than a key's bucket can ever hold.
    #[error("a cost of {cost} tokens can never be met: a key's bucket holds at most {limit}")]
    CostExceedsLimit {
        /// The cost asked for.
        cost: u64,
        /// The per-key limit.
        limit: u64,
    },
    /// A new key, and `max_keys` keys are tracked, none of them idle: the new key is refused
    /// (keys already tracked keep working). Retry later, or raise the cap.
    #[error("{max_keys} keys are tracked and none is idle: new key refused")]
    TooManyKeys {
        /// The cap.
        max_keys: usize,
    },
}

impl KeyedError {
    /// How long to wait before retrying, if waiting can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            KeyedError::Insufficient { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}
