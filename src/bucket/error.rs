//! The bucket's errors: a configuration or rate change it refuses, a rate string it cannot parse,
//! a shared-memory bucket file it cannot open.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use std::time::Duration;

/// A bucket configuration (or a rate change) that cannot be honoured.
///
/// Returned by [`SharedTokenBucket::new`](crate::SharedTokenBucket::new),
/// [`with_clock`](crate::SharedTokenBucket::with_clock),
/// [`set_rate`](crate::SharedTokenBucket::set_rate) and
/// [`from_state`](crate::SharedTokenBucket::from_state). Nothing is ever clamped silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The rate adds no tokens: zero tokens, or a zero period.
    #[error("the rate must be positive, got {tokens} tokens per {period:?}")]
    ZeroRate {
        /// Tokens per period, as given.
        tokens: u64,
        /// The period, as given.
        period: Duration,
    },
    /// The rate is above [`Rate::MAX_PER_SECOND`](crate::Rate::MAX_PER_SECOND).
    #[error(
        "the rate {tokens} tokens per {period:?} is above the maximum of {max_per_second} tokens \
         per second (one hour of tokens must stay below 2^63)"
    )]
    RateTooHigh {
        /// Tokens per period, as given.
        tokens: u64,
        /// The period, as given.
        period: Duration,
        /// The largest rate accepted, in tokens per second.
        max_per_second: u64,
    },
    /// The period does not fit in 64 bits of nanoseconds (about 584 years).
    #[error("the rate's period {period:?} is longer than u64::MAX nanoseconds")]
    PeriodTooLong {
        /// The period, as given.
        period: Duration,
    },
    /// A bucket that can hold no token.
    #[error("the limit must be at least 1 token")]
    ZeroLimit,
    /// The limit is above [`BucketConfig::MAX_LIMIT`](crate::BucketConfig::MAX_LIMIT).
    #[error(
        "the limit {limit} is above the maximum {max} (rovers must stay within 2^63 of each other)"
    )]
    LimitTooLarge {
        /// The limit, as given.
        limit: u64,
        /// The largest limit accepted.
        max: u64,
    },
    /// The replenish threshold is 0 or above the limit.
    #[error("the replenish threshold {threshold} must be in 1..={limit}")]
    ThresholdOutOfRange {
        /// The threshold, as given.
        threshold: u64,
        /// The bucket's limit.
        limit: u64,
    },
    /// A saved [`BucketState`](crate::BucketState) that no bucket of this configuration can be in.
    #[error("invalid bucket state: {reason}")]
    InvalidState {
        /// Which invariant the state breaks.
        reason: &'static str,
    },
}

/// A string that is not a [`Rate`](crate::Rate) (see its `FromStr` for the grammar).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseRateError {
    /// Not of the form `N [UNIT]/TIME` or `N per M TIME`.
    #[error("{input:?} is not a rate: expected e.g. \"50MiB/s\", \"1000/s\" or \"7 per 3s\"")]
    Syntax {
        /// The string, as given.
        input: String,
    },
    /// An amount or time unit that is not known.
    #[error(
        "unknown unit {unit:?} in the rate {input:?} (amounts: B, KiB, MiB, GiB, TiB, kB, MB, \
         GB, TB; times: s, ms, us, ns)"
    )]
    UnknownUnit {
        /// The string, as given.
        input: String,
        /// The unit that is not known.
        unit: String,
    },
    /// The number of tokens does not fit `u64`, or the period 64-bit seconds.
    #[error("the rate {input:?} is too large to represent")]
    Overflow {
        /// The string, as given.
        input: String,
    },
    /// A well-formed rate that no bucket accepts (zero, or above the maximum).
    #[error("the rate {input:?} is not accepted")]
    Invalid {
        /// The string, as given.
        input: String,
        /// Why a bucket refuses it.
        source: ConfigError,
    },
}

#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
/// Why a shared-memory bucket could not be opened.
///
/// Each variant names the file; a mismatch names the setting that differs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The configuration passed is not a valid bucket configuration.
    #[error("invalid configuration for a shared bucket")]
    Config(#[from] ConfigError),
    /// A file operation failed.
    #[error("cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the bucket's magic: it is something else.
    #[error("{path} is not a shared bucket")]
    NotABucket {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The file is shorter than its layout needs (cut short, or still being written by a
    /// tool that does not use [`SharedTokenBucket::open`](crate::SharedTokenBucket::open)).
    #[error("{path} is {len} bytes, a shared bucket needs {need}")]
    Truncated {
        /// The file.
        path: std::path::PathBuf,
        /// Its length.
        len: u64,
        /// The length its layout needs.
        need: u64,
    },
    /// The file was written by a build with another layout version.
    #[error("{path} has bucket layout version {found}, this build reads version {expected}")]
    Version {
        /// The file.
        path: std::path::PathBuf,
        /// The file's version.
        found: u32,
        /// This build's version.
        expected: u32,
    },
    /// Same version but another state size or offset: a build for another platform (cache
    /// line size) wrote it, or the file is corrupt.
    #[error(
        "{path} holds a {found_size}-byte state at offset {found_offset}, \
         this build expects {expected_size} bytes at {expected_offset}"
    )]
    Layout {
        /// The file.
        path: std::path::PathBuf,
        /// The file's state size.
        found_size: u64,
        /// The file's state offset.
        found_offset: u64,
        /// This build's state size.
        expected_size: u64,
        /// This build's state offset.
        expected_offset: u64,
    },
    /// The file was created under another boot of the machine (its timestamps are
    /// `CLOCK_MONOTONIC` readings of that boot, meaningless now). Remove it, or keep bucket
    /// files on a tmpfs such as `/dev/shm`, which a reboot empties.
    #[error("{path} was created under another boot of this machine")]
    OtherBoot {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The bucket exists with a different configuration.
    #[error("{path} is shared with {setting} {theirs}, this process asked for {ours}")]
    Incompatible {
        /// The file.
        path: std::path::PathBuf,
        /// Which setting differs: `"mode"`, `"limit"`, `"threshold"` or `"rate"`.
        setting: &'static str,
        /// The value this process asked for.
        ours: String,
        /// The value the bucket was created with.
        theirs: String,
    },
}
