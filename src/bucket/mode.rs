//! The two release modes, as types: [`Uncapped`] and [`Capped`].

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU64, Ordering};

/// How the bucket's fill is capped: [`Uncapped`] or [`Capped`]. Sealed.
pub trait Mode: private::Sealed + Send + Sync + 'static {
    /// Whether completions must be reported with `release` (the `ceil` rover exists).
    const CAPPED: bool;
}

/// The bucket holds at most `limit` tokens; completions are not reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Uncapped;

/// Capped release: besides the limit, the bucket never fills past `ceil`, which only
/// [`release`](crate::SharedTokenBucket::release) (completions) and
/// [`refund`](crate::SharedTokenBucket::refund) (unused grabs) advance. At most `limit` tokens'
/// worth of work is then in flight: the rate follows what the disk really completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Capped;

impl Mode for Uncapped {
    const CAPPED: bool = false;
}

impl Mode for Capped {
    const CAPPED: bool = true;
}

pub(crate) mod private {
    use super::*;

    /// The mode-specific part of the rovers: the `ceil` rover, or nothing.
    pub trait Sealed {
        #[doc(hidden)]
        type Ceil: CeilRover;
    }

    impl Sealed for Uncapped {
        type Ceil = NoCeil;
    }

    impl Sealed for Capped {
        type Ceil = CeilCounter;
    }

    /// What the rovers ask of the `ceil` rover.
    pub trait CeilRover: Send + Sync + std::fmt::Debug {
        #[doc(hidden)]
        fn new(start: u64) -> Self;
        /// The current `ceil`, if the mode has one.
        #[doc(hidden)]
        fn get(&self) -> Option<u64>;
        /// Advances `ceil` by `n` (capped mode), before `head` takes a refund.
        #[doc(hidden)]
        fn advance(&self, n: u64);
    }

    /// Uncapped mode: no `ceil`, zero bytes.
    #[derive(Debug)]
    #[repr(C)]
    pub struct NoCeil;

    impl CeilRover for NoCeil {
        fn new(_start: u64) -> Self {
            NoCeil
        }
        #[inline]
        fn get(&self) -> Option<u64> {
            None
        }
        #[inline]
        fn advance(&self, _n: u64) {}
    }

    /// Capped mode: the `ceil` rover on its own cache line (completions come from every core).
    #[derive(Debug)]
    #[repr(C)]
    pub struct CeilCounter(CachePadded<AtomicU64>);

    impl CeilRover for CeilCounter {
        fn new(start: u64) -> Self {
            CeilCounter(CachePadded::new(AtomicU64::new(start)))
        }
        #[inline]
        fn get(&self) -> Option<u64> {
            // Acquire: pairs with the AcqRel `advance`; a replenish that sees a released ceil
            // comes after the release (a stale value only makes the replenish add less).
            Some(self.0.load(Ordering::Acquire))
        }
        #[inline]
        fn advance(&self, n: u64) {
            // AcqRel: a read-modify-write of a rover, ordered like the others (see `rovers`).
            self.0.fetch_add(n, Ordering::AcqRel);
        }
    }
}
