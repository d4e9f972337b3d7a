//! Error types, one per operation, each saying what was wrong and with which values. They are
//! re-exported at the crate root (their one public path). `Display` is the error's own message
//! only; a cause is returned by `source()`, so reporters (anyhow, eyre) print each cause once.

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

/// A checkpoint that cannot be saved, loaded or restored.
///
/// Returned by the [`Checkpoint`](crate::checkpoint::Checkpoint) stores, by explicit saves of the
/// [`Checkpointer`](crate::checkpoint::Checkpointer) and by restores. A corrupt or truncated file
/// is never trusted: the documented fallback is an *empty* bucket
/// ([`restore_or_empty`](crate::checkpoint::CheckpointedBucket::restore_or_empty)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("checkpoint file {path}: {op} failed")]
    Io {
        /// The file (or directory) concerned.
        path: std::path::PathBuf,
        /// What was being done: "write", "fsync", "rename", ...
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter (or longer) than its format version says.
    #[error("checkpoint is truncated or has trailing bytes: {len} bytes, expected {expected}")]
    Truncated {
        /// Bytes found.
        len: usize,
        /// Bytes the format needs.
        expected: usize,
    },
    /// The file does not start with the checkpoint magic bytes: not a checkpoint.
    #[error("not an iothrottle checkpoint (bad magic bytes)")]
    BadMagic,
    /// A format version this build cannot read.
    #[error("checkpoint format version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// The checksum does not match the content: the file is corrupt.
    #[error("checkpoint checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The CRC-32 stored in the file.
        stored: u32,
        /// The CRC-32 of the content.
        computed: u32,
    },
    /// The content decodes but no bucket can be in that state.
    #[error("invalid checkpoint: {reason}")]
    InvalidSnapshot {
        /// Which rule the snapshot breaks.
        reason: &'static str,
    },
    /// The bucket configuration (or the restored state) is rejected by the bucket.
    #[error("cannot restore the bucket")]
    Config(#[from] ConfigError),
    /// The Postgres store failed (connection refused or dropped, SQL error).
    #[error("postgres checkpoint: {op} failed: {message}")]
    Postgres {
        /// What was being done: "connect", "create table", "upsert", "select".
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The connection string does not parse.
    #[error("invalid postgres connection string: {message}")]
    ConnectionString {
        /// The driver's message.
        message: String,
    },
    /// A bucket name that cannot be a row key (empty, or longer than 200 bytes).
    #[error("invalid bucket name {name:?}: must be 1..=200 bytes")]
    InvalidName {
        /// The name, as given.
        name: String,
    },
    /// A checkpointer or durability setting that cannot work (a zero interval, a zero
    /// reservation, a back-off that shrinks).
    #[error("invalid checkpoint configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// The store holds a newer save: a save never replaces a higher
    /// [`seq`](crate::checkpoint::Snapshot::seq) (saves are totally ordered in the store).
    #[error("checkpoint save {seq} refused: the store already holds save {stored}")]
    Superseded {
        /// The refused save's sequence number.
        seq: u64,
        /// The stored snapshot's sequence number.
        stored: u64,
    },
    /// The background checkpointer has stopped (its task ended or panicked).
    #[error("the checkpointer has stopped")]
    Stopped,
}

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

/// A [`Dispatcher`](crate::dispatcher::Dispatcher) configuration that cannot be honoured.
///
/// Returned by [`DispatcherBuilder::build`](crate::dispatcher::DispatcherBuilder::build) and
/// [`add_class`](crate::dispatcher::DispatcherBuilder::add_class). Nothing is clamped silently.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A dispatcher needs at least one shard.
    #[error("a dispatcher needs at least one shard")]
    ZeroShards,
    /// More shards than [`DispatcherBuilder::MAX_SHARDS`](crate::dispatcher::DispatcherBuilder::MAX_SHARDS).
    #[error("{shards} shards requested, at most {max} are supported")]
    TooManyShards {
        /// The number requested.
        shards: usize,
        /// The most supported.
        max: usize,
    },
    /// A dispatcher needs at least one priority class.
    #[error("a dispatcher needs at least one priority class (add one with `class`)")]
    NoClasses,
    /// Shares must be in `1..=1000`.
    #[error("class {class:?}: shares must be in 1..=1000, got {shares}")]
    SharesOutOfRange {
        /// The class's name.
        class: String,
        /// The shares, as given.
        shares: u32,
    },
    /// Two classes with one name.
    #[error("two classes are named {class:?}")]
    DuplicateClass {
        /// The name used twice.
        class: String,
    },
    /// A per-class bandwidth cap of zero bytes per second.
    #[error("class {class:?}: a bandwidth cap must be positive")]
    ZeroBandwidthCap {
        /// The class's name.
        class: String,
    },
    /// A latency target of zero.
    #[error("class {class:?}: a latency target must be positive")]
    ZeroLatencyTarget {
        /// The class's name.
        class: String,
    },
    /// An in-flight bound of zero ([`ClassConfig::with_max_in_flight`](crate::dispatcher::ClassConfig::with_max_in_flight)).
    #[error("class {class:?}: a bound on the disk time in flight must be positive")]
    ZeroInFlightBound {
        /// The class's name.
        class: String,
    },
    /// A [`DiskModel`](crate::dispatcher::DiskModel) figure is zero.
    #[error("the disk model's {field} must be positive")]
    ZeroDiskFigure {
        /// Which figure.
        field: &'static str,
    },
    /// No [`DiskModel`](crate::dispatcher::DiskModel) was given: there is no default, because
    /// a guessed disk silently over- or under-commits the real one.
    #[error(
        "the dispatcher needs a disk model: measure the disk (e.g. fio or Seastar's iotune) and \
         pass `DiskModel::new(..)`, or load an io_properties.yaml"
    )]
    NoDiskModel,
    /// The latency goal is zero, or longer than a bucket can hold in tokens.
    #[error("the latency goal must be in 1 ns..={max:?}, got {goal:?}")]
    LatencyGoalOutOfRange {
        /// The goal, as given.
        goal: Duration,
        /// The longest goal accepted.
        max: Duration,
    },
    /// A token amount (`max_cost` or `batch`) is 0 or above the bucket's limit.
    #[error("{what} = {value} must be in 1..={limit}")]
    TokensOutOfRange {
        /// Which setting.
        what: &'static str,
        /// The value, as given.
        value: u64,
        /// The bucket's limit.
        limit: u64,
    },
    /// The bucket (or a class's cap bucket) configuration is invalid.
    #[error("invalid bucket configuration")]
    Bucket(#[from] ConfigError),
    /// A shard thread or its runtime could not be started.
    #[error("could not start shard {shard}")]
    Spawn {
        /// The shard's index.
        shard: usize,
        /// What the OS or tokio said.
        source: std::io::Error,
    },
    /// A shard's [start hook](crate::dispatcher::DispatcherBuilder::on_shard_start) returned
    /// an error or panicked.
    #[error("the start hook of shard {shard} failed")]
    ShardStart {
        /// The shard's index.
        shard: usize,
        /// The hook's error (a panic's message as [`std::io::ErrorKind::Other`]).
        source: std::io::Error,
    },
}

/// A [`Dispatcher::shutdown_timeout`](crate::dispatcher::Dispatcher::shutdown_timeout) that
/// ran out of time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShutdownError {
    /// Futures were still running when the time was up; the shards keep draining in the
    /// background.
    #[error("{running} dispatcher shards still had futures running when the time was up")]
    TimedOut {
        /// The shard threads still running.
        running: usize,
    },
}

/// A run-time change a [`Dispatcher`](crate::dispatcher::Dispatcher) refuses
/// ([`set_shares`](crate::dispatcher::Dispatcher::set_shares),
/// [`set_bandwidth_cap`](crate::dispatcher::Dispatcher::set_bandwidth_cap)); nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The class id is not one of this dispatcher's.
    #[error("no class with id {class} (the dispatcher has {classes})")]
    UnknownClass {
        /// The id given.
        class: usize,
        /// How many classes the dispatcher has.
        classes: usize,
    },
    /// Shares must be in `1..=1000`.
    #[error("class {class:?}: shares must be in 1..=1000, got {shares}")]
    SharesOutOfRange {
        /// The class's name.
        class: String,
        /// The shares, as given.
        shares: u32,
    },
    /// The cap's rate is invalid (zero, or too high).
    #[error("invalid bandwidth cap")]
    Cap(#[from] ConfigError),
}

/// A request the [`Dispatcher`](crate::dispatcher::Dispatcher) refuses at submission; the
/// request's future is dropped without being polled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The dispatcher is shutting down or has shut down.
    #[error("the dispatcher is shut down")]
    ShutDown,
    /// No such class.
    #[error("no class with id {class} (the dispatcher has {classes})")]
    UnknownClass {
        /// The class id, as given.
        class: usize,
        /// How many classes there are.
        classes: usize,
    },
    /// No such shard.
    #[error("no shard {shard} (the dispatcher has {shards})")]
    UnknownShard {
        /// The shard, as given.
        shard: usize,
        /// How many shards there are.
        shards: usize,
    },
    /// The request costs more than [`max_cost`](crate::dispatcher::Dispatcher::max_cost) and
    /// cannot be split (one future,
    /// or a raw token cost, or one operation alone is too expensive). Submit it with
    /// [`submit_split`](crate::dispatcher::Dispatcher::submit_split), or in pieces of at most
    /// `max_bytes` bytes.
    #[error(
        "the request costs {cost} tokens, above the most a request may cost, {max_cost}; {}",
        too_large_hint(*.max_bytes)
    )]
    TooLarge {
        /// The request's cost in tokens.
        cost: u64,
        /// The most a request may cost (at most the bucket's limit).
        max_cost: u64,
        /// The largest piece of this kind that fits, `None` if no size fits.
        max_bytes: Option<u64>,
    },
}

fn too_large_hint(max_bytes: Option<u64>) -> String {
    match max_bytes {
        Some(b) => format!("submit it with submit_split, or in pieces of at most {b} bytes"),
        None => "no size of this kind fits: raise max_cost or the latency goal".to_owned(),
    }
}

/// Why a submitted request produced no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The dispatcher shut down (cancelling) before the request was dispatched; its future was
    /// dropped without being polled and its tokens were given back.
    #[error("the dispatcher shut down before the request was dispatched")]
    ShutDown,
    /// The request's future panicked. Its tokens were still released.
    #[error("the request's future panicked: {message}")]
    Panicked {
        /// The panic message, when it was a string.
        message: String,
    },
}

/// What went wrong in the PostgreSQL limiters ([`crate::pg`]).
///
/// Bad input is reported before anything is sent to the server. Server errors keep their
/// SQLSTATE; serialization failures and deadlocks are retried first (see
/// [`RetryPolicy`](crate::pg::RetryPolicy)) and only surface as
/// [`RetriesExhausted`](Self::RetriesExhausted).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgLimitError {
    /// The key is the empty string.
    #[error("the key is empty")]
    EmptyKey,
    /// The key is longer than [`MAX_KEY_BYTES`](crate::pg::MAX_KEY_BYTES).
    #[error("the key is {len} bytes long, the maximum is {max}")]
    KeyTooLong {
        /// The key's length in bytes (UTF-8).
        len: usize,
        /// The longest key accepted, in bytes.
        max: usize,
    },
    /// The key contains a NUL character, which PostgreSQL `text` cannot store.
    #[error("the key contains a NUL character")]
    KeyHasNul,
    /// A refill rate of zero or less.
    #[error("the refill rate must be at least 1 token per second, got {rate}")]
    InvalidRate {
        /// The rate, as given.
        rate: i64,
    },
    /// A window (or burst) of zero or less.
    #[error("the window must be at least 1 second, got {window}")]
    InvalidWindow {
        /// The window, as given.
        window: i64,
    },
    /// A burst (bucket capacity) of zero or less.
    #[error("the burst must be at least 1 token, got {burst}")]
    InvalidBurst {
        /// The burst, as given.
        burst: i64,
    },
    /// A request for zero or fewer tokens.
    #[error("the number of tokens requested must be at least 1, got {n}")]
    InvalidCount {
        /// The count, as given.
        n: i64,
    },
    /// A leased-mode request for more tokens than one lease can hold.
    #[error("{n} tokens requested at once, but a lease holds at most {max}")]
    TooManyTokens {
        /// The tokens requested.
        n: u64,
        /// The largest lease.
        max: u64,
    },
    /// The bucket would hold more micro-tokens than the 64-bit arithmetic allows.
    #[error("a bucket of {tokens} tokens is above the maximum of {max} tokens")]
    CapacityTooLarge {
        /// The capacity asked for (window × rate, or the burst), in tokens.
        tokens: i128,
        /// The largest capacity accepted, in tokens.
        max: i64,
    },
    /// A schema or zone name that is not a plain lower-case identifier.
    #[error("invalid {what} {name:?}: {reason}")]
    InvalidName {
        /// What the name is for ("schema", "zone").
        what: &'static str,
        /// The name, as given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// An option that cannot be honoured.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// The option's name.
        name: &'static str,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The sliding-window zone does not exist.
    #[error("no sliding-window zone named {zone:?}")]
    UnknownZone {
        /// The zone asked for.
        zone: String,
    },
    /// The installed schema is newer than this version of the crate knows.
    #[error("schema version {found} is newer than the {supported} this crate supports")]
    SchemaTooNew {
        /// The version found in the database.
        found: i32,
        /// The newest version this crate installs.
        supported: i32,
    },
    /// The limiter's tables are not installed in the schema.
    #[error("the limiter is not installed in schema {schema:?}: call install() first")]
    NotInstalled {
        /// The schema looked in.
        schema: String,
    },
    /// A serialization failure (40001) or deadlock (40P01) persisted through every attempt.
    #[error("gave up after {attempts} attempts, the last failed with {}", pg_error_text(.source))]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
        /// The SQLSTATE of the last failure.
        sqlstate: String,
        /// The last failure.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The connection failed or was closed while a statement was in flight. Whether that
    /// statement committed is unknown; the next call reconnects.
    #[error(
        "connection to PostgreSQL lost (the outcome of the call is unknown): {}{}",
        pg_error_text(.source),
        .closed_by.as_ref().map(|r| format!(" (the server closed the session: {r})")).unwrap_or_default()
    )]
    Connection {
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
        /// For a call queued on a session that the server closed, the server's reason as
        /// another call on that session received it: SQLSTATE, severity and message
        /// (`57P01 FATAL: terminating connection due to administrator command`). `None` when
        /// `source` carries the server's error itself, or the server sent none.
        closed_by: Option<String>,
    },
    /// A call took longer than its timeout; its outcome is unknown, and its connection was
    /// dropped (the next call reconnects).
    #[error("the call took longer than {after:?} (the outcome is unknown)")]
    TimedOut {
        /// The timeout.
        after: std::time::Duration,
    },
    /// The server could not be reached a moment ago; calls fail at once until the reconnect
    /// back-off has passed.
    #[error(
        "PostgreSQL unavailable, next connection attempt in {retry_in:?}; last failure: {why}"
    )]
    Unavailable {
        /// When the next connection attempt will be made.
        retry_in: std::time::Duration,
        /// The last connection failure, as text (SQLSTATE and message, or the socket error).
        why: String,
    },
    /// Any other error from the server, with its SQLSTATE.
    #[error("PostgreSQL error {}", pg_error_text(.source))]
    Db {
        /// The SQLSTATE code (five characters), or `"?????"` when the server sent none.
        sqlstate: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// A driver error as text for `Display`: the server's SQLSTATE, severity, message, and detail
/// and hint when present (`57P01 FATAL: terminating connection due to administrator
/// command`); without a server error, the driver's message and its causes (`error connecting
/// to server: Connection refused (os error 111)`).
#[cfg(feature = "postgres")]
pub(crate) fn pg_error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!("{} {}: {}", db.code().code(), db.severity(), db.message());
        if let Some(d) = db.detail() {
            s.push_str(" (detail: ");
            s.push_str(d);
            s.push(')');
        }
        if let Some(h) = db.hint() {
            s.push_str(" (hint: ");
            s.push_str(h);
            s.push(')');
        }
        return s;
    }
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(c) = source {
        s.push_str(": ");
        s.push_str(&c.to_string());
        source = c.source();
    }
    s
}

/// A failure of a [`ThrottledFile`](crate::disk::ThrottledFile) or [`AlignedBuf`](crate::disk::AlignedBuf)
/// operation. Every check that can be made before the I/O is made before it: an error of that
/// kind means nothing was read or written.
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// An O_DIRECT buffer length, file offset or piece size that is not a multiple of the
    /// alignment (checked before any I/O: nothing was written).
    #[error("O_DIRECT needs {what} aligned to {align} bytes, got {value}")]
    Unaligned {
        /// `"buffer length"`, `"offset"` or `"max piece size"`.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The alignment needed ([`ALIGN`](crate::disk::ALIGN)).
        align: u64,
    },
    /// An empty buffer (O_DIRECT transfers at least one aligned block).
    #[error("an O_DIRECT buffer must not be empty")]
    EmptyBuffer,
    /// `offset + length` does not fit in a file offset.
    #[error("offset {offset} + length {len} overflows a file offset")]
    OffsetOverflow {
        /// The offset given.
        offset: u64,
        /// The length given.
        len: u64,
    },
    /// The file system refused `O_DIRECT` at open (`EINVAL`): many FUSE file systems and
    /// tmpfs before Linux 6.6 do.
    #[error("{path}: the file system ({fs}) does not support O_DIRECT (open returned EINVAL)")]
    DirectIoUnsupported {
        /// The file.
        path: std::path::PathBuf,
        /// The file system's type, as `statfs` names it.
        fs: String,
    },
    /// A file handed to [`ThrottledFile::from_file`](crate::disk::ThrottledFile::from_file) was
    /// not opened with `O_DIRECT`.
    #[error("{path} was not opened with O_DIRECT")]
    NotDirect {
        /// The file's name, as given.
        path: std::path::PathBuf,
    },
    /// The file lives in memory (tmpfs, ramfs): O_DIRECT there is not disk I/O, so neither
    /// throttling nor calibrating it means anything.
    #[error(
        "{path} is on {fs}, a memory file system, not a disk: put it on a real disk \
         (O_DIRECT there would only measure or throttle RAM)"
    )]
    NotADisk {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The file system's type.
        fs: &'static str,
    },
    /// The disk is full (`ENOSPC`) or the file would exceed its size limit (`EFBIG`). A write
    /// reserves its whole range (`fallocate`) before writing any byte, so when the reservation
    /// fails nothing of the write was written.
    #[error("no space for {len} bytes at offset {offset}")]
    NoSpace {
        /// Offset of the write.
        offset: u64,
        /// Length of the write.
        len: u64,
        /// `ENOSPC` or `EFBIG`.
        #[source]
        source: std::io::Error,
    },
    /// A write that the kernel completed only in part (the file holds the first `done` bytes
    /// of it). The range was reserved first, so this needs a failing device, not a full one.
    #[error("short write at offset {offset}: {done} of {len} bytes written")]
    ShortWrite {
        /// Offset of the write.
        offset: u64,
        /// Bytes written.
        done: u64,
        /// Bytes asked.
        len: u64,
    },
    /// The dispatcher refused the request or shut down before running it.
    #[error("the dispatcher refused the request")]
    Submit(#[from] SubmitError),
    /// The dispatcher stopped before the request ran.
    #[error("the dispatcher dropped the request")]
    Dispatch(#[from] DispatchError),
    /// The blocking pool that runs I/O where io_uring is unavailable is gone (runtime shut down).
    #[error("the blocking I/O pool is gone: {0}")]
    PoolGone(String),
    /// Any other I/O error from the kernel, with what was being done.
    #[error("{op} {path} failed")]
    Io {
        /// What was being done (`"open"`, `"read"`, `"write"`, `"fallocate"`…).
        op: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
}

/// A failure reading, parsing or choosing from an io-properties file
/// ([`DiskModel::from_properties`](crate::DiskModel::from_properties)).
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PropertiesError {
    /// The file cannot be read (missing, no permission, not UTF-8…).
    #[error("cannot read io-properties file {path}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The text is not an io-properties document.
    #[error("{path}:{line}: {what}")]
    Syntax {
        /// The file (or `<string>`).
        path: std::path::PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: String,
    },
    /// A disk entry lacks one of the five keys.
    #[error("{path}: disk #{index} has no `{key}`")]
    MissingKey {
        /// The file.
        path: std::path::PathBuf,
        /// 0-based position in `disks:`.
        index: usize,
        /// The missing key.
        key: &'static str,
    },
    /// A figure is zero (a disk model needs four positive figures).
    #[error("{path}: disk {mountpoint}: `{key}` is 0; every figure must be positive")]
    ZeroFigure {
        /// The file.
        path: std::path::PathBuf,
        /// The disk's mount point.
        mountpoint: String,
        /// The key.
        key: &'static str,
    },
    /// The file has no disk entry.
    #[error("{path}: no disk under `disks:`")]
    NoDisk {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The file describes several disks and none was chosen: use
    /// [`DiskModel::from_properties_for`](crate::DiskModel::from_properties_for).
    #[error("{path} describes {count} disks ({mountpoints:?}): say which mount point to use")]
    Ambiguous {
        /// The file.
        path: std::path::PathBuf,
        /// How many disks.
        count: usize,
        /// Their mount points.
        mountpoints: Vec<String>,
    },
    /// The file has no entry for the mount point asked for.
    #[error("{path} has no disk for mount point {wanted}; it describes {found:?}")]
    OtherMountpoint {
        /// The file.
        path: std::path::PathBuf,
        /// The mount point asked for.
        wanted: String,
        /// The mount points the file describes.
        found: Vec<String>,
    },
    /// The mount point of a directory could not be found.
    #[error("cannot find the mount point of {path}")]
    Mountpoint {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A failure of [`calibrate`](crate::disk::calibrate).
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrateError {
    /// The scratch file could not be created, reserved, written or read.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// The options are out of range.
    #[error("bad calibration option: {0}")]
    Options(String),
    /// The mount point of the directory could not be found.
    #[error(transparent)]
    Properties(#[from] PropertiesError),
    /// io_uring could not be set up (calibration keeps a queue depth from one thread with it).
    #[error("io_uring is unavailable")]
    NoIoUring(#[source] std::io::Error),
    /// The disk completed no request during a phase (a figure of 0 is not a disk model).
    #[error("the {phase} phase completed no request")]
    NothingMeasured {
        /// Which phase.
        phase: &'static str,
    },
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;
    use std::error::Error;
    use std::io;

    /// Walks `e`'s `source()` chain and checks that no message contains its cause's text, so a
    /// reporter that prints the chain (anyhow, eyre) prints each cause once. Returns the
    /// number of links.
    fn check_chain(e: &(dyn Error + 'static)) -> usize {
        let mut links = 1;
        let mut cur = e;
        while let Some(cause) = cur.source() {
            let (msg, inner) = (cur.to_string(), cause.to_string());
            assert!(
                !msg.contains(&inner),
                "{msg:?} repeats its cause {inner:?} ({cur:?})"
            );
            links += 1;
            cur = cause;
        }
        links
    }

    fn io_error() -> io::Error {
        io::Error::new(io::ErrorKind::PermissionDenied, "the OS said no")
    }

    fn config_error() -> ConfigError {
        ConfigError::ZeroRate {
            tokens: 0,
            period: Duration::from_secs(1),
        }
    }

    #[test]
    fn no_error_prints_its_cause_twice() {
        let with_a_cause: Vec<Box<dyn Error + 'static>> = vec![
            Box::new(ParseRateError::Invalid {
                input: "0/s".into(),
                source: config_error(),
            }),
            Box::new(CheckpointError::Io {
                path: "/x/b.ckpt".into(),
                op: "write",
                source: io_error(),
            }),
            Box::new(CheckpointError::Config(config_error())),
            Box::new(BuildError::Bucket(config_error())),
            Box::new(BuildError::Spawn {
                shard: 1,
                source: io_error(),
            }),
            Box::new(BuildError::ShardStart {
                shard: 1,
                source: io_error(),
            }),
            Box::new(ControlError::Cap(config_error())),
            Box::new(crate::keyed::KeyedConfigError::Bucket(config_error())),
        ];
        for e in &with_a_cause {
            assert!(check_chain(e.as_ref()) >= 2, "{e:?} has no cause");
        }
    }

    #[cfg(all(feature = "rt", not(iothrottle_loom)))]
    #[test]
    fn no_disk_error_prints_its_cause_twice() {
        let with_a_cause: Vec<Box<dyn Error + 'static>> = vec![
            Box::new(DiskError::NoSpace {
                offset: 0,
                len: 4096,
                source: io_error(),
            }),
            Box::new(DiskError::Submit(SubmitError::ShutDown)),
            Box::new(DiskError::Dispatch(DispatchError::ShutDown)),
            Box::new(DiskError::Io {
                op: "open",
                path: "/x/f".into(),
                source: io_error(),
            }),
            Box::new(PropertiesError::Read {
                path: "/x/io_properties.yaml".into(),
                source: io_error(),
            }),
            Box::new(PropertiesError::Mountpoint {
                path: "/x".into(),
                source: io_error(),
            }),
            Box::new(CalibrateError::NoIoUring(io_error())),
            Box::new(CalibrateError::Disk(DiskError::NoSpace {
                offset: 0,
                len: 4096,
                source: io_error(),
            })),
            Box::new(CalibrateError::Properties(PropertiesError::Read {
                path: "/x/io_properties.yaml".into(),
                source: io_error(),
            })),
        ];
        for e in &with_a_cause {
            assert!(check_chain(e.as_ref()) >= 2, "{e:?} has no cause");
        }
    }

    /// The cause is still there, one `source()` away, with its own text.
    #[test]
    fn the_cause_comes_from_source() {
        let e = CheckpointError::Io {
            path: "/x/b.ckpt".into(),
            op: "fsync",
            source: io_error(),
        };
        assert_eq!(e.to_string(), "checkpoint file /x/b.ckpt: fsync failed");
        assert_eq!(e.source().unwrap().to_string(), "the OS said no");
    }
}
