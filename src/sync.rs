//! The one place that chooses between `std` and [loom] primitives.
//!
//! Every other module takes its atomics, `Arc` and spin hints from here, so that building with
//! `RUSTFLAGS="--cfg iothrottle_loom"` model-checks the real code instead of a copy of it. The cfg
//! is specific to this crate (not `cfg(test)` or `cfg(loom)`), so dependencies stay in their normal
//! build and the loom tests in `loom-tests/` see the loom build of the library.
//!
//! [loom]: https://docs.rs/loom

#[cfg(iothrottle_loom)]
mod imp {
    pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
    pub(crate) use loom::sync::Arc;
    pub(crate) use loom::sync::{Mutex, MutexGuard};
    // The dispatcher's fine timer (feature `rt`).
    #[cfg(feature = "rt")]
    pub(crate) use loom::thread;

    /// Backs off inside a retry loop; under loom this lets the other threads run.
    pub(crate) fn spin_hint() {
        loom::thread::yield_now();
    }
}

#[cfg(not(iothrottle_loom))]
mod imp {
    pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
    pub(crate) use std::sync::Arc;
    // Used by the bucket's deferred give-backs and the checkpoint's protocol core.
    pub(crate) use std::sync::{Mutex, MutexGuard};
    // The dispatcher's fine timer (feature `rt`).
    #[cfg(feature = "rt")]
    pub(crate) use std::thread;

    /// Backs off inside a retry loop.
    pub(crate) fn spin_hint() {
        std::hint::spin_loop();
    }
}

pub(crate) use imp::*;
