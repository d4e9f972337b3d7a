//! Which mechanism runs a [`ThrottledFile`](super::ThrottledFile)'s operations: io_uring (a
//! ring per thread, [`uring`](super::uring)), or a small blocking pool where io_uring is
//! unavailable ([`pool`](super::pool)); and [`run`], which runs one operation on either. The
//! caller's future waits on a oneshot channel, so a shard's current-thread runtime never
//! blocks.

use std::fs::File;
use std::io;

use super::buf::AlignedBuf;
use super::pool::pool_submit;
pub(crate) use super::uring::io_task;
use super::uring::{uring_available, uring_submit};
use crate::sync::Arc;

/// `blocking` forces the blocking pool, `io_uring` insists on io_uring, anything else (or
/// unset) means automatic.
pub const BACKEND_ENV: &str = "IOTHROTTLE_IO_BACKEND";

/// Which mechanism runs a [`ThrottledFile`](super::ThrottledFile)'s reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// io_uring when the kernel allows it, else the blocking pool; the environment variable
    /// [`BACKEND_ENV`] can force either.
    #[default]
    Auto,
    /// io_uring only: opening fails when the kernel refuses it.
    IoUring,
    /// The blocking pool (`pread`/`pwrite` on a few helper threads), never io_uring.
    Blocking,
}

/// The backend actually used, once [`Backend::Auto`] is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// io_uring.
    IoUring,
    /// The blocking pool.
    Blocking,
}

impl Backend {
    /// Resolves the choice: reads [`BACKEND_ENV`] for `Auto`, and checks that io_uring works
    /// (once per process) when it is wanted.
    pub fn resolve(self) -> io::Result<Resolved> {
        let wanted = match self {
            Backend::Auto => match std::env::var(BACKEND_ENV).as_deref() {
                Ok("blocking") => Backend::Blocking,
                Ok("io_uring") => Backend::IoUring,
                _ => Backend::Auto,
            },
            b => b,
        };
        match wanted {
            Backend::Blocking => Ok(Resolved::Blocking),
            Backend::IoUring => uring_available().map(|()| Resolved::IoUring),
            Backend::Auto => Ok(match uring_available() {
                Ok(()) => Resolved::IoUring,
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); using the blocking pool");
                    Resolved::Blocking
                }
            }),
        }
    }
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Read,
    Write,
    /// Reserve `len` bytes at `offset` (`fallocate` with `FALLOC_FL_KEEP_SIZE`: blocks are
    /// allocated, the size is left to the write, so a failed reservation changes nothing the
    /// file's readers can see).
    Fallocate,
}

/// One positional operation and everything it needs kept alive while the kernel works.
///
/// Invariant: `buf`, when present, covers `start..start + len`, and no other operation nor any
/// reference to the buffer's bytes exists for that range while this one is in flight (the
/// callers split one buffer into disjoint ranges and do not look at it until every operation
/// has completed).
pub(crate) struct RawIo {
    pub(crate) kind: OpKind,
    pub(crate) file: Arc<File>,
    pub(crate) buf: Option<Arc<AlignedBuf>>,
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) offset: u64,
}

impl RawIo {
    pub(super) fn ptr(&self) -> *mut u8 {
        match &self.buf {
            // SAFETY: pointer arithmetic only; `start + len <= buf.len()` (type invariant), so
            // the result stays inside the allocation.
            Some(b) => unsafe { b.raw().add(self.start) },
            None => std::ptr::null_mut(),
        }
    }
}

/// Runs `io` on `backend`; resolves to the kernel's byte count (or 0 for a reservation).
pub(crate) async fn run(backend: Resolved, io: RawIo) -> io::Result<usize> {
    let rx = match backend {
        Resolved::IoUring => match uring_submit(io) {
            Ok(rx) => rx,
            Err((e, Some(io))) => {
                tracing::warn!("io_uring submission failed ({e}); running on the blocking pool");
                pool_submit(io)?
            }
            Err((e, None)) => return Err(e),
        },
        Resolved::Blocking => pool_submit(io)?,
    };
    let res = rx
        .await
        .map_err(|_| io::Error::other("the I/O backend dropped the operation"))?;
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}
