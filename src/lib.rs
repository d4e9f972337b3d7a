//! # iothrottle
//!
//! Keep background I/O (compaction, flushes, backups, rebuilds) from starving the foreground
//! reads of a storage engine: give the background a byte rate, or let classes share the disk by
//! weights, and wrap the files it writes so every byte waits its turn.
//!
//! ## Throttle my compaction against my reads
//!
//! One line at the call site: the compaction's output file takes its bytes from a
//! [`Throttle`] (64 MiB/s here, bursts of 4 MiB); the reads do not touch it.
//!
// The example needs the tokio layers: without feature `rt` it is shown, not run.
#![cfg_attr(feature = "rt", doc = "```")]
#![cfg_attr(not(feature = "rt"), doc = "```ignore")]
//! use tokio::io::AsyncWriteExt;
//! use iothrottle::adapter::ThrottleExt;
//! use iothrottle::{BucketConfig, Rate, Throttle, TokioClock, Uncapped};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let compaction: Throttle<Uncapped, TokioClock> = Throttle::with_clock(
//!     BucketConfig::new(Rate::per_second(64 << 20), 4 << 20),
//!     TokioClock::new(),
//! )?;
//! // In an engine: tokio::fs::File::create(path).await?.throttled(&compaction)
//! let mut sst = tokio::io::sink().throttled(&compaction);
//! let start = tokio::time::Instant::now();
//! sst.write_all(&vec![0u8; 68 << 20]).await?; // one 4 MiB burst, then 64 MiB at 64 MiB/s
//! let took = start.elapsed().as_secs_f64();
//! assert!((1.0..1.01).contains(&took), "{took}"); // tokio's timers tick in whole ms
//! # Ok(())
//! # }
//! ```
//!
//! When the reads should rather *share* the disk with the compaction (the compaction gets what
//! the reads leave, by weight), submit both through a [`Dispatcher`] with two classes; see
//! [`dispatcher`].
//!
//! ## Which one do I need?
//!
//! | you want | use |
//! |---|---|
//! | one rate (bytes/s, IOPS) for a set of tasks, async, any tokio runtime | [`Throttle`]: `acquire(cost).await`, or the [`adapter`]s around files and sockets |
//! | the same on plain threads | [`adapter::BlockingThrottle`] and its `std::io` wrapper |
//! | RocksDB's `RateLimiter::Request(bytes)`: any size, never an error | [`Throttle::request`] |
//! | classes (foreground, compaction, flush) sharing one disk by shares, thread-per-core, Seastar's io_queue | [`Dispatcher`] |
//! | a limit per tenant, table or client, in memory | [`keyed::KeyedThrottle`] |
//! | a limit per key shared by many processes | the `pg` module (feature `postgres`): PostgreSQL-backed |
//! | no free burst after a restart | [`checkpoint`] |
//! | your own runtime or event loop, no tokio | [`SharedTokenBucket`] alone: `default-features = false` |
//!
//! ## The core: a shared lock-free bucket
//!
//! Everything above stands on Seastar's design: a **shared lock-free token bucket** that every
//! core claims from, with exact integer arithmetic and an optional *capped release* mode that
//! ties the rate to what the disk really completes.
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
//! - [`clock`]: where time comes from ([`MonotonicClock`], [`FastClock`], [`ManualClock`] for tests).
//! - [`throttle`]: [`Throttle`], the async front of the bucket for any tokio runtime.
//! - [`adapter`]: throttled `AsyncRead`/`AsyncWrite`/`AsyncSeek` and `std::io` wrappers,
//!   RocksDB-style `request`.
//! - [`dispatcher`]: the thread-per-core I/O dispatcher, [`Dispatcher`].
//! - [`keyed`]: per-key limits in memory, [`keyed::KeyedThrottle`].
//! - [`checkpoint`]: durable checkpoints (a file, or PostgreSQL): no free burst after a crash.
//! - `pg` (feature `postgres`): per-key limits on PostgreSQL, strict, leased or sliding-window.
//! - `metrics` (feature `metrics`): counters and histograms through the `metrics` facade.
//! - Errors: one typed enum per operation, defined with the module that returns it and public at
//!   the crate root only ([`ConfigError`], [`BuildError`], …); each error's `Display` is its own
//!   message, and its cause comes from `source()`.
//!
//! ## Feature flags
//!
//! - `rt` (on by default): the tokio layers ([`throttle`], the async [`adapter`]s,
//!   [`dispatcher`], [`checkpoint`], [`TokioClock`]). Without it the crate is the bucket, the
//!   blocking adapters and the keyed throttle, and compiles no tokio.
//! - `postgres` (off by default): PostgreSQL backends through `tokio-postgres` (implies `rt`).
//! - `postgres-tls` (off by default): TLS for those backends through `tokio-postgres-rustls`
//!   (rustls with the `ring` provider); implies `postgres`.
//! - `postgres-pool` (off by default): limiters over the caller's `deadpool_postgres::Pool`
//!   (`PgKeyedLimiter::from_pool`, `PgWindowLimiter::from_pool`); implies `postgres`.
//! - `metrics` (off by default): per-class and per-throttle metrics through the `metrics`
//!   facade; nothing of it is compiled when off.
//!
//! ## API conventions
//!
//! - A type with a `build()` step is a builder and its setters take bare names, as tokio's
//!   `runtime::Builder` does: `DispatcherBuilder::shards`, `.disk(..)`, `.class(..)`.
//! - A plain configuration value, used as it is, is set by `with_*` methods taking and
//!   returning `self` ([`BucketConfig::with_threshold`], `ClassConfig::with_max_in_flight`,
//!   `PgOptions::with_schema`), or by public fields with a `Default` (`FileOptions`).
//! - A setter on a running object is `set_*` and takes `&self`
//!   ([`SharedTokenBucket::set_rate`]).
//! - A constructor reading time from another [`Clock`] is `with_clock`; one over an existing
//!   bucket is `from_bucket`.
//! - A rate, bandwidth included, is a [`Rate`].
//!
//! ## Model checking
//!
//! Every atomic protocol is model-checked with [loom](https://docs.rs/loom). The models live in
//! `loom-tests/` and are compiled inside the crate, so they need no public hooks:
//! `RUSTFLAGS="--cfg iothrottle_loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom cargo
//! test --release --lib loom_tests`.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    unsafe_op_in_unsafe_fn,
    rust_2018_idioms
)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod adapter;
pub mod bucket;
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub mod checkpoint;
pub mod clock;
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub mod disk;
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub mod dispatcher;
// The loom models' build: of the dispatcher, only its atomic cores (they use nothing but
// `crate::sync`); the rest needs tokio's runtime. The models use only part of each core.
#[cfg(all(test, iothrottle_loom))]
#[allow(dead_code)]
mod dispatcher {
    #[path = "alarm.rs"]
    pub(crate) mod alarm;
    #[path = "bound.rs"]
    pub(crate) mod bound;
    #[path = "fair.rs"]
    pub(crate) mod fair;
}
#[cfg(all(test, not(iothrottle_loom)))]
mod error_tests;
#[cfg(not(iothrottle_loom))]
pub mod keyed;
// Leased mode's atomic core: used by `pg`'s leased mode, and modelled by the loom tests.
#[cfg(any(feature = "postgres", all(test, iothrottle_loom)))]
mod lease_core;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod pg;
mod sync;
// The loom models (`loom-tests/`), compiled inside the crate so that they see its internals.
#[cfg(all(test, iothrottle_loom))]
#[path = "../loom-tests/mod.rs"]
mod loom_tests;
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub mod throttle;

#[cfg(all(feature = "shm", unix, not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
pub use bucket::{error::ShmError, SharedMemoryBucket};
pub use bucket::{BucketConfig, BucketState, Capped, Mode, Rate, SharedTokenBucket, Uncapped};
#[cfg(all(feature = "shm", unix))]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
pub use clock::SystemMonotonicClock;
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use clock::TokioClock;
pub use clock::{Clock, FastClock, ManualClock, MonotonicClock};
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, IoRequest};
// The errors: each is defined with the module that returns it (in a private `error` module) and
// has its one public path here.
pub use bucket::error::{ConfigError, ParseRateError};
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use checkpoint::error::CheckpointError;
pub use clock::error::ClockError;
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use disk::error::{CalibrateError, DiskError, PropertiesError};
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use dispatcher::error::{
    BuildError, ControlError, DispatchError, JoinError, ShutdownError, SpawnError, SubmitError,
};
#[cfg(not(iothrottle_loom))]
pub use keyed::error::{KeyedConfigError, KeyedError};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use pg::error::PgLimitError;
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use throttle::error::{AcquireError, TryAcquireError};
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use throttle::{Permit, Throttle};

/// The README's examples, compiled and run as doctests.
#[cfg(all(doctest, feature = "rt"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
