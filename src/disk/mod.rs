//! Real disks: calibration, io-properties files, aligned buffers, and [`ThrottledFile`] —
//! O_DIRECT reads and writes through the [`Dispatcher`](crate::Dispatcher) without blocking
//! its shards (io_uring, or a blocking pool where io_uring is unavailable).
//!
//! ```no_run
//! use std::sync::Arc;
//! use iothrottle::disk::{calibrate, AlignedBuf, CalibrateOptions, FileOptions, ThrottledFile};
//! use iothrottle::dispatcher::{ClassConfig, Dispatcher};
//!
//! // Measure once (or load a file iotune wrote with DiskModel::from_properties).
//! let props = calibrate("/var/lib/data", &CalibrateOptions::default())?;
//! props.write("io_properties.yaml")?;
//! let model = props.disks[0].disk_model();
//!
//! let mut builder = Dispatcher::builder().disk(model).capped(true);
//! let fg = builder.add_class(ClassConfig::new("foreground", 800))?;
//! let dispatcher = Arc::new(builder.build()?);
//! let file = ThrottledFile::open(dispatcher, fg, "/var/lib/data/sst-1", FileOptions::read_write())?;
//! let rt = tokio::runtime::Builder::new_current_thread().build()?;
//! let (res, buf) = rt.block_on(file.write_at(AlignedBuf::zeroed(1 << 20)?, 0));
//! res?;
//! let (n, _buf) = rt.block_on(file.read_at(buf, 0));
//! let n = n?;
//! assert_eq!(n, 1 << 20);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![doc = include_str!("../../docs/disk.md")]

mod backend;
mod buf;
mod calibrate;
mod caller_ring;
pub(crate) mod error;
mod eventfd;
mod file;
mod fs;
mod irq;
mod pool;
mod props;
mod uring;

pub use backend::{Backend, Resolved, BACKEND_ENV};
pub use buf::{AlignedBuf, IoBuf, IoBufMut, ALIGN};
pub use calibrate::{calibrate, calibrate_detailed, CalibrateOptions, Calibration, DepthStep};
pub use caller_ring::wait_for_completions;
pub use file::{BufResult, FileOptions, ThrottledFile};
pub use irq::{completion_cpus, InterruptCpu};
pub use props::{mountpoint_of, DiskProperties, IoProperties};
