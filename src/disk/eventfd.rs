//! An io_uring with an eventfd registered on it: the kernel adds to the eventfd's count for every
//! completion, so a reaper can sleep on it (a thread, through `poll`) or be woken through it (a
//! task, through the runtime's I/O driver). Shared by the shards' rings (`uring`) and the
//! callers' own rings (`caller_ring`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use io_uring::IoUring;

/// A non-blocking eventfd.
pub(super) struct RingEventFd(OwnedFd);

impl RingEventFd {
    /// A ring of `sq` submission and `cq` completion entries, with a new eventfd registered on
    /// it.
    pub(super) fn ring(sq: u32, cq: u32) -> io::Result<(IoUring, RingEventFd)> {
        let ring = IoUring::builder().setup_cqsize(cq).build(sq)?;
        // SAFETY: plain syscall with no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let eventfd = RingEventFd(unsafe { OwnedFd::from_raw_fd(fd) });
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        Ok((ring, eventfd))
    }

    /// Raises the count, so that whoever sleeps on it wakes.
    pub(super) fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to our own eventfd.
        let _ = unsafe {
            libc::write(
                self.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Resets the count (non-blocking; a zero count is left as it is).
    pub(super) fn drain(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer of 8 bytes.
        let _ = unsafe { libc::read(self.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }

    /// Sleeps until the count is non-zero (or a signal interrupts).
    pub(super) fn wait(&self) {
        let mut pfd = libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live `pollfd`, count 1, no timeout.
        let _ = unsafe { libc::poll(&mut pfd, 1, -1) };
    }
}

impl AsRawFd for RingEventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}
