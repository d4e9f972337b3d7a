//! The per-shard I/O hook: the I/O layer a shard's futures submit to (the disk module's
//! io_uring ring) registers, on the shard's thread, a function that a polling shard calls each
//! round, so that completions reach their futures without waiting for the runtime's I/O driver.
//! The dispatcher does not know what it drives.

use std::cell::Cell;

/// Drives the calling shard's I/O once: submits what is queued, hands the completions already
/// posted to their futures when at most `max_in_flight` operations are in flight, and returns
/// how deep the I/O runs (the operations in flight, or as many as the last completion batch
/// held if that is more).
pub(crate) type ShardIo = fn(max_in_flight: usize) -> usize;

thread_local! {
    /// The calling shard's I/O hook, if its I/O layer registered one.
    static HOOK: Cell<Option<ShardIo>> = const { Cell::new(None) };
}

/// Registers `io` as the calling shard's I/O hook (replacing any earlier one). Returns `false`
/// off a dispatcher shard, where nothing would call it.
pub(crate) fn register(io: ShardIo) -> bool {
    if !super::spawn::on_any_shard() {
        return false;
    }
    HOOK.try_with(|h| h.set(Some(io))).is_ok()
}

/// Runs the calling shard's I/O hook; 0 when none is registered.
pub(crate) fn poll(max_in_flight: usize) -> usize {
    match HOOK.try_with(Cell::get) {
        Ok(Some(io)) => io(max_in_flight),
        _ => 0,
    }
}
