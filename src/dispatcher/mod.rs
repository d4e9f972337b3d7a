//! The thread-per-core I/O dispatcher: [`Dispatcher`].
//!
//! A storage engine submits reads and writes with [`Dispatcher::submit`]; each request's future
//! runs on a shard (a pinned OS thread with its own tokio current-thread runtime) once the
//! shared token bucket has its tokens, so that the disk is never oversubscribed. Priority
//! classes share the disk by their shares, across shards too.
//!
//! ```
//! use iothrottle::dispatcher::{ClassConfig, Dispatcher, DiskModel, Figures, IoRequest};
//!
//! // Your disk, measured (fio, iotune) or loaded from an io_properties.yaml: 200 MB/s, 20k IOPS.
//! let disk = DiskModel::symmetric(Figures { iops: 20_000, bandwidth: 200_000_000 });
//! // At most 0.75 ms of disk time in flight (the default latency goal); reads get 4× the
//! // disk time of compaction.
//! let dispatcher = Dispatcher::builder()
//!     .shards(2)
//!     .disk(disk)
//!     .class(ClassConfig::new("foreground", 800))
//!     .class(ClassConfig::new("compaction", 200))
//!     .build()?;
//! let fg = dispatcher.class_id("foreground").ok_or("no such class")?;
//! let bg = dispatcher.class_id("compaction").ok_or("no such class")?;
//!
//! // The future runs on a shard once its tokens are there; the handle resolves to its output.
//! let read = dispatcher.submit(fg, IoRequest::read(4096), async { /* pread */ 4096 })?;
//! // 1 MiB is 5 ms of this disk's time: split into 4 KiB-aligned pieces within the goal.
//! let write = dispatcher.submit_split(bg, IoRequest::write(1 << 20), |piece| async move {
//!     /* pwrite piece.range */
//!     piece.len()
//! })?;
//! let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! assert_eq!(rt.block_on(read)?, 4096);
//! assert_eq!(rt.block_on(write)?.iter().sum::<u64>(), 1 << 20);
//!
//! let stats = dispatcher.stats_blocking();
//! assert_eq!(stats.classes[fg.index()].requests, 1);
//! println!("read p99 end to end: {:?}", stats.classes[fg.index()].latency_p99());
//! dispatcher.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The long-form description (the shard loop, the cost model, cross-shard fairness and what we
//! do differently from Seastar) follows.
#![doc = include_str!("../../docs/dispatcher.md")]

pub(crate) mod alarm;
pub(crate) mod bound;
mod budget;
mod builder;
mod class;
mod cost;
#[allow(clippy::module_inception)] // the `Dispatcher` type's own file, beside its builder's
mod dispatcher;
pub(crate) mod error;
pub(crate) mod fair;
mod fast;
mod handle;
mod latency;
mod queue;
mod runner;
mod shard;
pub(crate) mod shard_io;
#[cfg(target_os = "linux")]
mod shard_timer;
mod slice;
mod spawn;
mod state;
mod stats;
pub(crate) mod task;
mod timer;

#[cfg(test)]
mod tests;

pub use builder::DispatcherBuilder;
pub use class::{ClassConfig, ClassId, Priority};
pub use cost::{DiskModel, Figures, IoKind, IoRequest, Piece, MAX_SPLIT_PIECES, SPLIT_ALIGN};
pub use dispatcher::Dispatcher;
pub(crate) use dispatcher::ShardHere;
pub use handle::{IoHandle, SplitHandle};
pub use spawn::{current_shard, ShardHandle, ShardJoinHandle};
pub use stats::{ClassStats, DispatcherStats, ShardStats};

pub(crate) use fast::FastDone;
pub(crate) use spawn::on_any_shard;
pub(crate) use state::{ArcClock, Shared};
