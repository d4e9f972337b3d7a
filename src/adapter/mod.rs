//! One line at the call site: I/O adapters that throttle every read and write, and a
//! RocksDB-style [`request`](crate::Throttle::request) that never fails on a large cost.
//!
//! - [`ThrottledIo`] wraps any `tokio::io::AsyncRead` / `AsyncWrite` (and `AsyncSeek`, passed
//!   through) so that each byte costs one token of a [`Throttle`](crate::Throttle):
//!   `ThrottledIo::new(file, throttle.clone())`, or `file.throttled(&throttle)` with
//!   [`ThrottleExt`] (any `AsyncWrite`; `reader.throttled_read(&throttle)` with
//!   [`ThrottleReadExt`] for objects that only read). (Feature `rt`.)
//! - [`ClassIo`] does the same through a [`Dispatcher`](crate::Dispatcher) class: each
//!   operation is a ticket dispatched in the class's turn, so classes share the disk by their
//!   shares. (Feature `rt`.)
//! - [`BlockingThrottled`] does the same for `std::io::Read` / `Write` on plain threads, over a
//!   [`BlockingThrottle`] that sleeps the thread (no runtime needed).
//! - [`Throttle::request`](crate::Throttle::request) and [`BlockingThrottle::request`] take any
//!   number of tokens: a cost above the bucket's limit is waited for piece by piece (each piece
//!   at most the limit) instead of failing, as RocksDB's `RateLimiter::Request` does. The strict
//!   [`Throttle::acquire`](crate::Throttle::acquire) still refuses such a cost.
//!
//! The long-form description (the accounting rules, cancellation, what a capped bucket means
//! here) is `docs/adapters.md`, included below; its examples run as doctests.
// Its examples use the tokio layers: without feature `rt` (docs.rs has it) it is left out.
#![cfg_attr(feature = "rt", doc = include_str!("../../docs/adapters.md"))]

mod blocking;
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
mod class;
#[cfg(feature = "rt")]
mod io;
#[cfg(feature = "rt")]
mod request;

pub use blocking::{BlockingThrottle, BlockingThrottled};
#[cfg(all(feature = "rt", not(iothrottle_loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use class::ClassIo;
#[cfg(feature = "rt")]
#[cfg_attr(docsrs, doc(cfg(feature = "rt")))]
pub use io::{ThrottleExt, ThrottleReadExt, ThrottledIo};

/// The largest piece one read or write is granted at once when none is configured: 1 MiB (and
/// never more than the bucket's limit).
pub const DEFAULT_MAX_CHUNK: u64 = 1 << 20;
