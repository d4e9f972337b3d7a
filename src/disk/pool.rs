//! The blocking pool: `pread`/`pwrite`/`fallocate` on a few helper threads, where io_uring is
//! unavailable.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Mutex, OnceLock};

use tokio::sync::oneshot;

use super::backend::{OpKind, RawIo};
use crate::sync::Arc;

/// Threads of the blocking pool.
const POOL_THREADS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

fn pool() -> io::Result<&'static Mutex<std::sync::mpsc::Sender<Job>>> {
    static POOL: OnceLock<Result<Mutex<std::sync::mpsc::Sender<Job>>, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..POOL_THREADS {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("iothrottle-io-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        Ok(Mutex::new(tx))
    })
    .as_ref()
    .map_err(|e| io::Error::other(e.clone()))
}

pub(super) fn pool_submit(io: RawIo) -> io::Result<oneshot::Receiver<i32>> {
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let res = blocking(&io);
        // Drop our hold on the buffer before waking the owner.
        drop(io);
        let _ = tx.send(res);
    });
    pool()?
        .lock()
        .map_err(|_| io::Error::other("the blocking pool is poisoned"))?
        .send(job)
        .map_err(|_| io::Error::other("the blocking pool is gone"))?;
    Ok(rx)
}

/// Runs one operation with a blocking syscall; the result as io_uring reports it (`-errno` on
/// failure).
fn blocking(io: &RawIo) -> i32 {
    let fd: RawFd = io.file.as_raw_fd();
    let Ok(offset) = libc::off_t::try_from(io.offset) else {
        return -libc::EINVAL;
    };
    let Ok(len) = libc::off_t::try_from(io.len) else {
        return -libc::EINVAL;
    };
    loop {
        // SAFETY: `ptr()` is valid for `len` bytes of this operation's exclusive range of a live
        // buffer (`RawIo` invariant); the file descriptor is kept open by `io.file`.
        let r = unsafe {
            match io.kind {
                OpKind::Read => libc::pread(fd, io.ptr().cast(), io.len, offset) as i64,
                OpKind::Write => libc::pwrite(fd, io.ptr().cast(), io.len, offset) as i64,
                OpKind::Fallocate => {
                    match libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, offset, len) {
                        0 => 0,
                        _ => -1,
                    }
                }
            }
        };
        if r >= 0 {
            return i32::try_from(r).unwrap_or(i32::MAX);
        }
        let errno = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return -errno;
        }
    }
}
