//! [`MarkGate`]: strict mode's write-ahead reservation as a layer any waiter can use
//! ([`Throttle::with_checkpoint`](crate::Throttle::with_checkpoint)), over the atomic core
//! [`MarkCore`] that loom models.
//!
//! # Orderings
//!
//! - `mark` (the durable high-water mark for `tail`) is written only by the checkpointer, under
//!   its save lock, *after* the store confirmed the save: `store(Release)`. Grabs read it with
//!   `load(Acquire)`: a grab that sees a mark sees a mark that is durable. A stale (lower) mark
//!   only makes a grab wait or ask for a reservation it does not need, never grant past a
//!   non-durable mark.
//! - `requested` is a flag that stops every grab below the low-water line from waking the
//!   checkpointer: `swap(AcqRel)` by grabs and by the checkpointer (clearing it *before* it
//!   reads the tail). The grab's tail `fetch_add` precedes its swap; the checkpointer's clearing
//!   swap reads the raised flag and so acquires that tail: either the checkpointer's tail read
//!   sees the grab, or the grab's swap comes after the clear, finds the flag down, raises it and
//!   wakes the checkpointer again. A request is never lost (loom model `checkpoint_mark`).
//! - The counters are statistics: `fetch_add(Relaxed)`, read with `load(Relaxed)`.

use std::fmt;

use crossbeam_utils::CachePadded;
use tokio::sync::Notify;

use crate::bucket::ahead;
use crate::checkpoint::Durability;
use crate::sync::{AtomicU64, Ordering};

/// The atomic protocol between grabs and the checkpointer: the durable mark and the
/// reservation request. No I/O, no waiting: the caller wakes whoever the results name.
///
/// Invariant: every tail position up to `mark` is covered by a durable reservation; `mark`
/// only moves forward.
pub(crate) struct MarkCore {
    mark: CachePadded<AtomicU64>,
    /// Non-zero while a reservation request is pending.
    requested: AtomicU64,
    /// Ask for a new reservation when fewer than this many tokens are left below the mark.
    low_water: i64,
}

/// What a grab must do after [`MarkCore::on_grab`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GrabCheck {
    /// Tokens of the grab past the durable mark.
    pub(crate) past_mark: u64,
    /// This grab raised the request flag: it must wake the checkpointer.
    pub(crate) wake_checkpointer: bool,
}

impl MarkCore {
    /// A core whose mark is `tail` (nothing reserved) and whose low-water line is half of
    /// `reserve_ahead`.
    pub(crate) fn new(tail: u64, reserve_ahead: u64) -> Self {
        MarkCore {
            mark: CachePadded::new(AtomicU64::new(tail)),
            requested: AtomicU64::new(0),
            low_water: (reserve_ahead / 2).min(i64::MAX as u64) as i64,
        }
    }

    /// The durable mark.
    #[inline]
    pub(crate) fn mark(&self) -> u64 {
        // Acquire: pairs with the Release store in `publish`.
        self.mark.load(Ordering::Acquire)
    }

    /// Tokens up to `tail` that no durable reservation covers.
    #[inline]
    pub(crate) fn past_mark(&self, tail: u64) -> u64 {
        ahead(tail, self.mark()).max(0) as u64
    }

    /// After a grab that ended at `tail`: raises the request when less than the low-water
    /// line is left.
    #[inline]
    pub(crate) fn on_grab(&self, tail: u64) -> GrabCheck {
        let left = ahead(self.mark(), tail);
        if left >= self.low_water {
            return GrabCheck {
                past_mark: 0,
                wake_checkpointer: false,
            };
        }
        GrabCheck {
            past_mark: (-left).max(0) as u64,
            wake_checkpointer: self.request(),
        }
    }

    /// Raises the request; true if this call raised it (its caller wakes the checkpointer).
    #[cold]
    pub(crate) fn request(&self) -> bool {
        // AcqRel: see the module's orderings.
        self.requested.swap(1, Ordering::AcqRel) == 0
    }

    /// Clears the request; the checkpointer calls it *before* reading the tail it reserves
    /// from.
    pub(crate) fn clear_request(&self) {
        // AcqRel swap, not a store: it reads the latest request, and so acquires the tail of
        // the grab that raised it.
        self.requested.swap(0, Ordering::AcqRel);
    }

    /// Whether a request is pending.
    pub(crate) fn is_requested(&self) -> bool {
        // Acquire: as `clear_request`.
        self.requested.load(Ordering::Acquire) != 0
    }

    /// Whether fewer than the low-water line's tokens are left below the mark for `tail`.
    pub(crate) fn low(&self, tail: u64) -> bool {
        ahead(self.mark(), tail) < self.low_water
    }

    /// Publishes `mark`, made durable by the store. Only the checkpointer calls it, one save at
    /// a time; a mark behind the current one is ignored. Returns whether the mark moved.
    pub(crate) fn publish(&self, mark: u64) -> bool {
        if ahead(mark, self.mark()) > 0 {
            // Release: a grab that reads this mark reads a durable one (pairs with Acquire).
            self.mark.store(mark, Ordering::Release);
            true
        } else {
            false
        }
    }
}

impl fmt::Debug for MarkCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MarkCore")
            .field("mark", &self.mark())
            .field("requested", &self.is_requested())
            .finish()
    }
}

/// Counters, each on the hot path's side or the checkpointer's.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) saves: AtomicU64,
    pub(crate) save_failures: AtomicU64,
    pub(crate) consecutive_failures: AtomicU64,
    pub(crate) last_save_unix_nanos: AtomicU64,
    pub(crate) grabs_past_mark: AtomicU64,
}

/// The checkpoint layer of a bucket: what its waiters must check after each grab.
///
/// In [`Durability::Periodic`] mode it does nothing. In [`Durability::Strict`] mode a grab
/// reports its new tail ([`on_grab`](Self::on_grab): one atomic load, and a wake-up of the
/// checkpointer when less than half a reservation is left), and the grabbed tokens may be used
/// only once a durable reservation covers them ([`blocks`](Self::blocks); with `fail_open` they
/// never block). A waiter whose tokens are past the mark sleeps until the checkpointer publishes
/// a new mark ([`wait_durable`](Self::wait_durable)): no polling.
///
/// One gate belongs to one [`CheckpointedBucket`](crate::checkpoint::CheckpointedBucket); its
/// [`Checkpointer`](crate::checkpoint::Checkpointer) moves the mark.
pub struct MarkGate {
    durability: Durability,
    core: MarkCore,
    pub(crate) counters: Counters,
    /// Wakes the checkpointer: a reservation is needed.
    pub(crate) wake: Notify,
    /// Wakes the waiters for the mark.
    mark_moved: Notify,
}

impl MarkGate {
    /// A gate for a bucket whose tail is `tail` (nothing reserved yet).
    pub(crate) fn new(durability: Durability, tail: u64) -> Self {
        let reserve_ahead = match durability {
            Durability::Strict { reserve_ahead, .. } => reserve_ahead,
            Durability::Periodic => 0,
        };
        MarkGate {
            durability,
            core: MarkCore::new(tail, reserve_ahead),
            counters: Counters::default(),
            wake: Notify::new(),
            mark_moved: Notify::new(),
        }
    }

    /// The durability mode.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    fn is_strict(&self) -> bool {
        matches!(self.durability, Durability::Strict { .. })
    }

    /// Whether grabs past the mark wait (strict mode without `fail_open`).
    fn waits(&self) -> bool {
        matches!(
            self.durability,
            Durability::Strict {
                fail_open: false,
                ..
            }
        )
    }

    /// To be called after every grab on the bucket, with the grab's new tail. In strict mode:
    /// counts a grab past the mark and asks the checkpointer for a reservation when less than
    /// half of one is left. Never waits.
    #[inline]
    pub fn on_grab(&self, tail: u64) {
        if self.is_strict() {
            let check = self.core.on_grab(tail);
            if check.past_mark > 0 {
                // Relaxed: a statistic.
                self.counters
                    .grabs_past_mark
                    .fetch_add(1, Ordering::Relaxed);
            }
            if check.wake_checkpointer {
                self.wake.notify_one();
            }
        }
    }

    /// Tokens up to `tail` that no durable reservation covers (0 in periodic mode).
    #[inline]
    pub fn past_mark(&self, tail: u64) -> u64 {
        if self.is_strict() {
            self.core.past_mark(tail)
        } else {
            0
        }
    }

    /// Whether the tokens up to `tail` must wait for a reservation: strict mode without
    /// `fail_open`, and `tail` past the durable mark.
    #[inline]
    pub fn blocks(&self, tail: u64) -> bool {
        self.waits() && self.core.past_mark(tail) > 0
    }

    /// Waits until a durable reservation covers `tail` (at once in periodic or fail-open mode).
    /// Sleeps on the mark's wake-up, no polling. Cancel safe: it holds nothing.
    pub async fn wait_durable(&self, tail: u64) {
        loop {
            let moved = self.mark_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if !self.blocks(tail) {
                return;
            }
            self.request();
            moved.await;
        }
    }

    /// A registration for the next mark move (enable it before checking [`blocks`]).
    pub(crate) fn mark_moved(&self) -> tokio::sync::futures::Notified<'_> {
        self.mark_moved.notified()
    }

    /// Asks the checkpointer for a reservation now.
    pub(crate) fn request(&self) {
        if self.core.request() {
            self.wake.notify_one();
        }
    }

    /// The durable mark (strict mode).
    pub fn mark(&self) -> u64 {
        self.core.mark()
    }

    pub(crate) fn clear_request(&self) {
        self.core.clear_request();
    }

    pub(crate) fn low(&self, tail: u64) -> bool {
        self.is_strict() && self.core.low(tail)
    }

    /// Publishes a mark the store made durable and wakes the waiters for it.
    pub(crate) fn publish_mark(&self, mark: u64) {
        self.core.publish(mark);
        self.mark_moved.notify_waiters();
    }
}

impl fmt::Debug for MarkGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MarkGate")
            .field("durability", &self.durability)
            .field("core", &self.core)
            .finish()
    }
}
