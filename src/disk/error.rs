//! The disk layer's errors: a file operation, an io-properties file, a calibration.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use crate::{DispatchError, SubmitError};

/// A failure of a [`ThrottledFile`](crate::disk::ThrottledFile) or [`AlignedBuf`](crate::disk::AlignedBuf)
/// operation. Every check that can be made before the I/O is made before it: an error of that
/// kind means nothing was read or written.
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
