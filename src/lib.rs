//! # iothrottle
//!
//! Disk I/O throttling for storage engines, following Seastar's design: a **shared lock-free
//! token bucket** that every core claims from, with exact integer arithmetic and an optional
//! *capped release* mode that ties the rate to what the disk really completes.
//!
//! ```
//! use std::time::Duration;
//! use iothrottle::{BucketConfig, ManualClock, Rate, SharedTokenBucket, Uncapped};
//!
//! let clock = ManualClock::new();
//! let cfg = BucketConfig::new(Rate::per_second(1_000), 100).with_threshold(10);
//! let bucket: SharedTokenBucket<Uncapped, ManualClock> =
//!     SharedTokenBucket::with_clock(cfg, clock.clone())?;
//! bucket.replenish(); // the first replenish fills the bucket to its limit
//! let tail = bucket.grab(30);
//! assert_eq!(bucket.deficiency(tail), 0);
//! assert_eq!(bucket.available(), 70);
//! clock.advance(Duration::from_millis(10));
//! assert_eq!(bucket.replenish(), 10);
//! # Ok::<(), iothrottle::ConfigError>(())
//! ```
//!
//! ## Modules
//!
//! - [`bucket`]: the lock-free core, [`SharedTokenBucket`].
//! - [`clock`]: where time comes from ([`MonotonicClock`], [`ManualClock`] for tests).
//! - [`checkpoint`]: durable checkpoints (a file, or PostgreSQL): no free burst after a crash.
//! - [`throttle`]: [`Throttle`], the async front of the bucket for any tokio runtime.
//! - [`dispatcher`]: the thread-per-core I/O dispatcher, [`Dispatcher`].
//! - [`error`]: typed errors.
//!
//! ## Feature flags
//!
//! - `postgres` (off by default): PostgreSQL backends through `tokio-postgres`.
//!
//! ## Model checking
//!
//! Every atomic protocol is model-checked with [loom](https://docs.rs/loom):
//! `RUSTFLAGS="--cfg iothrottle_loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --test loom`.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    unsafe_op_in_unsafe_fn,
    rust_2018_idioms
)]

pub mod bucket;
pub mod checkpoint;
pub mod clock;
#[cfg(not(iothrottle_loom))]
pub mod disk;
#[cfg(not(iothrottle_loom))]
pub mod dispatcher;
#[cfg(iothrottle_loom)]
#[path = "dispatcher/loom.rs"]
pub mod dispatcher;
pub mod error;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod pg;
mod sync;
pub mod throttle;

pub use bucket::{BucketConfig, BucketState, Capped, Mode, Rate, SharedTokenBucket, Uncapped};
pub use clock::{Clock, ManualClock, MonotonicClock, TokioClock};
#[cfg(not(iothrottle_loom))]
pub use dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, IoRequest};
pub use error::ParseRateError;
pub use error::{
    AcquireError, BuildError, CheckpointError, ClockError, ConfigError, DispatchError, SubmitError,
    TryAcquireError,
};
pub use throttle::{Permit, Throttle};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use error::PgLimitError;
