//! [`RateCell`]: a rate that many threads read and a few threads change, without locks on the
//! read side.
//!
//! A rate is two words (tokens, period), too wide for one atomic. The cell keeps two slots and a
//! sequence word: writers fill the slot readers are *not* reading, then flip. Readers never wait
//! for a writer in progress; they retry only if a writer finished a flip while they read.
//!
//! # Orderings
//!
//! The sequence `seq` is even when no writer is active and odd while one writes. The slot that
//! readers use is `(seq >> 1) & 1`; a writer that starts at `seq = 2k` writes slot `(k + 1) & 1`
//! and publishes it with `seq = 2k + 2`.
//!
//! - Reader: `seq` load **Acquire** (pairs with the Release store that published the slot, so the
//!   slot's values are visible), slot loads **Relaxed**, **Acquire fence**, `seq` load
//!   **Relaxed**. If a slot load saw a store of a later writer, that writer's Release fence
//!   synchronises with our Acquire fence, so the second `seq` load sees at least its odd mark and
//!   we retry.
//! - Writer: the odd mark is taken with a CAS (**Acquire**: orders us after the previous writer,
//!   whose slot stores we must not overtake), then a **Release fence** (so a reader that sees any
//!   of our slot stores also sees the odd mark), slot stores **Relaxed**, and `seq = 2k + 2` with
//!   **Release** (publishes the slot).
//!
//! This is the seqlock of Boehm, "Can seqlocks get along with programming language memory
//! models?" (2012), with two slots so that readers do not wait for a writer. `loom-tests/`
//! checks that no reader ever sees a torn rate.

use crate::bucket::rate::RawRate;
use crate::sync::{fence, spin_hint, AtomicU64, Ordering};

#[derive(Debug)]
struct Slot {
    tokens: AtomicU64,
    period_ns: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct RateCell {
    /// `2 × generation + (1 if a writer is active)`.
    seq: AtomicU64,
    slots: [Slot; 2],
}

impl RateCell {
    pub(crate) fn new(rate: RawRate) -> Self {
        let slot = || Slot {
            tokens: AtomicU64::new(rate.tokens),
            period_ns: AtomicU64::new(rate.period_ns),
        };
        RateCell {
            seq: AtomicU64::new(0),
            slots: [slot(), slot()],
        }
    }

    /// The current rate and its generation (the number of completed [`store`](Self::store)s).
    pub(crate) fn load(&self) -> (RawRate, u64) {
        loop {
            // Acquire: pairs with the writer's Release store of `seq`, making its slot visible.
            let s1 = self.seq.load(Ordering::Acquire);
            let slot = &self.slots[((s1 >> 1) & 1) as usize];
            // Relaxed: validated by the fence and the second `seq` load below.
            let tokens = slot.tokens.load(Ordering::Relaxed);
            let period_ns = slot.period_ns.load(Ordering::Relaxed);
            // Acquire fence: if the loads above read a later writer's stores, its Release fence
            // synchronises with this fence and the load below sees its odd mark.
            fence(Ordering::Acquire);
            // Relaxed: ordered after the slot loads by the fence above.
            let s2 = self.seq.load(Ordering::Relaxed);
            if s2 >> 1 == s1 >> 1 {
                return (RawRate { tokens, period_ns }, s1 >> 1);
            }
            spin_hint();
        }
    }

    /// Replaces the rate. Concurrent writers take turns; readers never wait for them.
    pub(crate) fn store(&self, rate: RawRate) {
        // Relaxed: only a hint for the CAS below, which does the ordering.
        let mut s = self.seq.load(Ordering::Relaxed);
        loop {
            if s & 1 == 1 {
                spin_hint();
                // Relaxed: as above.
                s = self.seq.load(Ordering::Relaxed);
                continue;
            }
            // Acquire on success: we come after the previous writer's slot stores.
            // Relaxed on failure: we only retry.
            match self
                .seq
                .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(actual) => s = actual,
            }
        }
        // Release fence: a reader that sees any slot store below also sees the odd mark.
        fence(Ordering::Release);
        let slot = &self.slots[(((s >> 1) + 1) & 1) as usize];
        // Relaxed: published by the Release store of `seq` below.
        slot.tokens.store(rate.tokens, Ordering::Relaxed);
        slot.period_ns.store(rate.period_ns, Ordering::Relaxed);
        // Release: publishes the slot to readers that Acquire-load this value.
        self.seq.store(s + 2, Ordering::Release);
    }
}
