//! The clock's error: a time a clock cannot take.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use std::time::Duration;

/// A time that a clock cannot take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClockError {
    /// The clock would go backwards.
    #[error("the clock cannot go backwards, from {from:?} to {to:?}")]
    WentBackwards {
        /// The clock's time.
        from: Duration,
        /// The time asked for.
        to: Duration,
    },
    /// The time does not fit in 64 bits of nanoseconds.
    #[error("{at:?} is beyond u64::MAX nanoseconds")]
    OutOfRange {
        /// The time asked for.
        at: Duration,
    },
}
