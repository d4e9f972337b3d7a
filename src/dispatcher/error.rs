//! The dispatcher's errors: a configuration it refuses, a request it refuses or could not run,
//! a run-time change it refuses, a shutdown that ran out of time, a task it could not spawn or
//! run.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use std::time::Duration;

use crate::ConfigError;

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
    /// Not even one 4 KiB read or write of the disk model fits in the most one request may
    /// cost: every read or write would be refused.
    #[error(
        "the disk model's smallest {kind} (4 KiB) takes {cost} ns of disk time, more than the \
         {max_cost} ns one request may cost (max_cost; by default half the latency goal, \
         {goal:?} here): set the latency goal to at least {needed_goal:?} (or max_cost to at \
         least {cost}), or check the disk model's IOPS and bandwidth"
    )]
    DiskTooSlowForGoal {
        /// `"read"` or `"write"`.
        kind: &'static str,
        /// The disk time of one 4 KiB request of that kind, in tokens (nanoseconds).
        cost: u64,
        /// The most one request may cost.
        max_cost: u64,
        /// The latency goal.
        goal: Duration,
        /// The smallest latency goal whose default `max_cost` fits one 4 KiB request.
        needed_goal: Duration,
    },
    /// The [shard slice](crate::dispatcher::DispatcherBuilder::shard_slice) is outside what the
    /// OS grants.
    #[error("the shard slice must be in {min:?}..={max:?}, got {slice:?}")]
    ShardSliceOutOfRange {
        /// The slice, as given.
        slice: Duration,
        /// The shortest slice accepted.
        min: Duration,
        /// The longest slice accepted.
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
    /// A split request would be more than
    /// [`MAX_SPLIT_PIECES`](crate::dispatcher::MAX_SPLIT_PIECES) pieces: submit it in parts of
    /// at most `max_bytes` bytes.
    #[error(
        "the request would be split into {pieces} pieces, more than the {max_pieces} one request \
         may have; submit it in parts of at most {max_bytes} bytes"
    )]
    TooManyPieces {
        /// The pieces the request would take.
        pieces: u64,
        /// The most pieces one request may have.
        max_pieces: u64,
        /// The most bytes one split request of this kind may carry.
        max_bytes: u64,
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

/// Why a task could not be spawned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The dispatcher is shutting down (or shut down): it takes no new tasks.
    #[error("the dispatcher is shut down")]
    ShutDown,
    /// No shard has this index.
    #[error("shard {shard} does not exist (the dispatcher has {shards})")]
    UnknownShard {
        /// The index asked for.
        shard: usize,
        /// The dispatcher's shards.
        shards: usize,
    },
}

/// Why a spawned task produced no output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The task was dropped before it completed: the dispatcher shut down (shutdown cancels
    /// the spawned tasks), or its shard never started it.
    #[error("the task was cancelled")]
    Cancelled,
    /// The task (or the closure that made it) panicked; the shard kept running.
    #[error("the task panicked: {message}")]
    Panicked {
        /// The panic message, when it was a string.
        message: String,
    },
}
