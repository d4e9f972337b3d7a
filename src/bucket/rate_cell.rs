//! [`RateCell`]: the rate regime (the rate, the epoch its tokens are counted from, and the rate
//! before it) that many threads read and a few threads change, without locks on the read side.
//!
//! A [`Regime`] is six words, too wide for one atomic. The cell keeps two slots and a sequence
//! word: a writer fills the slot readers are *not* reading, then flips. Readers never wait for
//! a writer in progress; they retry only if a writer finished a flip while they read. Writers
//! ([`RateCell::update`], i.e. `set_rate`) take turns among themselves.
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
//!   whose slot stores we must not overtake, and lets us read the current slot with Relaxed
//!   loads), then a **Release fence** (so a reader that sees any of our slot stores also sees
//!   the odd mark), slot stores **Relaxed**, and `seq = 2k + 2` with **Release** (publishes the
//!   slot).
//!
//! This is the seqlock of Boehm, "Can seqlocks get along with programming language memory
//! models?" (2012), with two slots so that readers do not wait for a writer. `loom-tests/`
//! checks that no reader ever sees a torn regime.

use crate::bucket::rate::RawRate;
use crate::sync::{fence, spin_hint, AtomicU64, Ordering};

/// The rate in force and where its count starts.
///
/// Tokens earned between two instants `a ≤ b` (nanoseconds on the bucket's clock), both at or
/// after `prev_epoch`, are `F(b) − F(a)` where `F` counts at `prev` from `prev_epoch` up to
/// `epoch` and at `rate` from `epoch` on, each piece as `floor(tokens × (t − start) / period)`:
/// see [`earned`](Self::earned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Regime {
    /// The rate from `epoch` on.
    pub(crate) rate: RawRate,
    /// Where `rate`'s count starts.
    pub(crate) epoch: u64,
    /// The rate before `epoch`, from `prev_epoch` on.
    pub(crate) prev: RawRate,
    /// Where `prev`'s count starts; no interval before it can be priced by this regime.
    pub(crate) prev_epoch: u64,
}

impl Regime {
    /// One rate from `epoch` on (and the same rate before, from `epoch`).
    pub(crate) fn new(rate: RawRate, epoch: u64) -> Self {
        Regime {
            rate,
            epoch,
            prev: rate,
            prev_epoch: epoch,
        }
    }

    /// Whole tokens earned from `from` to `to` under this regime: the old rate up to `epoch`,
    /// the new one after it, each counted from its own epoch so that consecutive intervals
    /// telescope. `None` when the interval is empty or starts before `prev_epoch` (a stale
    /// `from`, which this regime cannot price: the caller's CAS on `last` would fail anyway).
    ///
    /// Never overflows: times are below 2^63 and tokens below 2^64, so each product is below
    /// 2^127 and the sum of the two pieces below 2^128.
    #[inline]
    pub(crate) fn earned(&self, from: u64, to: u64) -> Option<u128> {
        if to <= from || from < self.prev_epoch {
            return None;
        }
        if from >= self.epoch {
            return Some(self.rate.count(from - self.epoch, to - self.epoch));
        }
        let pe = self.prev_epoch;
        if to <= self.epoch {
            return Some(self.prev.count(from - pe, to - pe));
        }
        let old = self.prev.count(from - pe, self.epoch - pe);
        Some(old.saturating_add(self.rate.count(0, to - self.epoch)))
    }
}

#[derive(Debug)]
struct Slot {
    tokens: AtomicU64,
    period_ns: AtomicU64,
    epoch: AtomicU64,
    prev_tokens: AtomicU64,
    prev_period_ns: AtomicU64,
    prev_epoch: AtomicU64,
}

impl Slot {
    fn new(r: Regime) -> Self {
        Slot {
            tokens: AtomicU64::new(r.rate.tokens),
            period_ns: AtomicU64::new(r.rate.period_ns),
            epoch: AtomicU64::new(r.epoch),
            prev_tokens: AtomicU64::new(r.prev.tokens),
            prev_period_ns: AtomicU64::new(r.prev.period_ns),
            prev_epoch: AtomicU64::new(r.prev_epoch),
        }
    }

    /// Relaxed loads: the caller validates them (reader) or owns the slot (writer).
    fn load(&self) -> Regime {
        Regime {
            rate: RawRate {
                tokens: self.tokens.load(Ordering::Relaxed),
                period_ns: self.period_ns.load(Ordering::Relaxed),
            },
            epoch: self.epoch.load(Ordering::Relaxed),
            prev: RawRate {
                tokens: self.prev_tokens.load(Ordering::Relaxed),
                period_ns: self.prev_period_ns.load(Ordering::Relaxed),
            },
            prev_epoch: self.prev_epoch.load(Ordering::Relaxed),
        }
    }

    /// Relaxed stores: published by the Release store of `seq` that follows.
    fn store(&self, r: Regime) {
        self.tokens.store(r.rate.tokens, Ordering::Relaxed);
        self.period_ns.store(r.rate.period_ns, Ordering::Relaxed);
        self.epoch.store(r.epoch, Ordering::Relaxed);
        self.prev_tokens.store(r.prev.tokens, Ordering::Relaxed);
        self.prev_period_ns
            .store(r.prev.period_ns, Ordering::Relaxed);
        self.prev_epoch.store(r.prev_epoch, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub(crate) struct RateCell {
    /// `2 × generation + (1 if a writer is active)`.
    seq: AtomicU64,
    slots: [Slot; 2],
}

impl RateCell {
    pub(crate) fn new(regime: Regime) -> Self {
        RateCell {
            seq: AtomicU64::new(0),
            slots: [Slot::new(regime), Slot::new(regime)],
        }
    }

    /// The current regime (never torn).
    pub(crate) fn load(&self) -> Regime {
        loop {
            // Acquire: pairs with the writer's Release store of `seq`, making its slot visible.
            let s1 = self.seq.load(Ordering::Acquire);
            let regime = self.slots[((s1 >> 1) & 1) as usize].load();
            // Acquire fence: if the loads above read a later writer's stores, its Release fence
            // synchronises with this fence and the load below sees its odd mark.
            fence(Ordering::Acquire);
            // Relaxed: ordered after the slot loads by the fence above.
            let s2 = self.seq.load(Ordering::Relaxed);
            if s2 >> 1 == s1 >> 1 {
                return regime;
            }
            spin_hint();
        }
    }

    /// Replaces the regime by `f(current)`. Concurrent writers take turns (`f` runs while this
    /// writer holds the turn, so it sees the regime no other writer can change); readers never
    /// wait for them.
    pub(crate) fn update(&self, f: impl FnOnce(Regime) -> Regime) -> Regime {
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
        let current = self.slots[((s >> 1) & 1) as usize].load();
        let next = f(current);
        // Release fence: a reader that sees any slot store below also sees the odd mark.
        fence(Ordering::Release);
        self.slots[(((s >> 1) + 1) & 1) as usize].store(next);
        // Release: publishes the slot to readers that Acquire-load this value.
        self.seq.store(s + 2, Ordering::Release);
        next
    }
}
