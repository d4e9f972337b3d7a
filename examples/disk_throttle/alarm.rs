//! Waking a reader at its arrival: a timerfd on the reader's runtime. The kernel's timer wakes
//! the runtime's reactor at the arrival; tokio's own timer counts in whole milliseconds (a
//! sleep ends at the first millisecond tick at or after its deadline, seen when the reactor
//! next wakes), which would add up to 2 ms to every read's latency from arrival, and more
//! for a runtime that parks than for one that polls.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// A non-blocking `CLOCK_MONOTONIC` timerfd registered with the current runtime.
pub(crate) struct Alarm(AsyncFd<OwnedFd>);

impl Alarm {
    /// A new alarm on the calling task's runtime (it needs the I/O driver).
    pub(crate) fn new() -> io::Result<Alarm> {
        // SAFETY: plain syscall with no pointers.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by timerfd_create and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the `AsyncFd` owns the timerfd, so it stays open for as long as it is
        // registered, and it is never replaced.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        registered.map(Alarm).map_err(io::Error::from)
    }

    /// Returns at `at` (at once when `at` has passed).
    pub(crate) async fn until(&self, at: Instant) -> io::Result<()> {
        let wait = at.saturating_duration_since(Instant::now());
        if wait.is_zero() {
            return Ok(());
        }
        self.arm(wait)?;
        loop {
            let mut ready = self.0.readable().await?;
            let mut expirations = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a live local buffer of 8 bytes.
            let n = unsafe {
                libc::read(
                    self.0.as_raw_fd(),
                    expirations.as_mut_ptr().cast(),
                    expirations.len(),
                )
            };
            if n == 8 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(e);
            }
            ready.clear_ready();
        }
    }

    /// Arms the timer to expire once, `wait` (positive) from now.
    fn arm(&self, wait: Duration) -> io::Result<()> {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: wait.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(wait.subsec_nanos() as i32),
            },
        };
        // SAFETY: our own timerfd, a live `itimerspec`, no old value asked for.
        let r =
            unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
