//! [`RateCell`]: the rate regime (the rate, the epoch its tokens are counted from, and the rate
//! before it) that many threads read and a few threads change, lock-free on both sides.
//!
//! A [`Regime`] is six 64-bit words, too wide for one atomic, and the cell may live in memory
//! shared by processes, any of which can be killed at any instruction. So no step may wait
//! for another participant to finish: a writer that stops forever (killed, or descheduled)
//! between any two of its instructions must leave every other reader and writer able to
//! complete. The cell therefore keeps [`SLOTS`] record slots and one control word:
//!
//! - `ctl` packs `cur` (the ticket of the published record) and `nxt` (the next ticket to hand
//!   out), 32 bits each, wrapping.
//! - A record is written into slot `ticket % SLOTS`. Each 64-bit field is stored as two words,
//!   each holding 32 bits of the value and the 32-bit ticket of its writer (the *tag*). A word
//!   is only ever replaced by a CAS that checks the tag it replaces is older than the writer's
//!   ticket, so a writer that lost its slot to a newer ticket can never overwrite it, and a
//!   record is whole exactly when all its tags equal its ticket.
//!
//! A writer takes a ticket (one CAS on `ctl`, skipping the ticket whose slot holds `cur`),
//! writes its record, and publishes it with a CAS of `cur` from the ticket its regime was
//! computed from. A ticket can be published only while fewer than `SLOTS` tickets were handed
//! out after it (`nxt − ticket ≤ SLOTS`, checked by that same CAS), so the ticket that reuses
//! its slot can exist only once it can no longer be published; and the slot of `cur` is never
//! handed out. A writer whose ticket fell out of that window takes a new one. A reader loads
//! `cur` and the record's words; if a tag differs, `cur` has moved on since (the slot of the
//! current record is never written), and it reads again.
//!
//! Progress: a failed CAS on `ctl` means another participant took a ticket or published; a
//! reader retries only after a publication; a writer is pushed out of its window only by
//! more than `SLOTS` newer ticket numbers. With fewer than `SLOTS / 2` writers running at one
//! instant, some writer always publishes: lock-free. A dead writer costs nothing but the ticket it held.
//! Tags compare by wrapping 32-bit difference: a writer must not stall across 2^31 rate
//! changes.
//!
//! # Orderings
//!
//! - `ctl`: the ticket CAS and the publishing CAS are **AcqRel** (the publishing Release makes
//!   the record's words, written before it, visible to a reader whose Acquire load reads that
//!   `cur` or a later value; the Acquire side orders a writer after the publication it computes
//!   from). Failed CASes are **Acquire**: the writer goes on from the value they read.
//! - Record words are **Relaxed** everywhere: their CASes rely only on each word's own
//!   modification order (coherence), and they are published by `ctl`'s Release. A reader that
//!   Acquire-read `cur = t` sees the words of record `t` as published, or later values, whose
//!   tags then differ.
//! - [`RateCell::load`] begins with an **Acquire fence**, so that a caller's earlier Relaxed
//!   load that read a Release store (the replenish time `last`, moved after a publication)
//!   synchronises with it: the `cur` read next is then at least the one published before that
//!   store (see `rovers`).
//!
//! `loom-tests/` checks that no reader sees a torn regime, and that a writer stopped forever
//! after any step leaves other writers and readers able to complete.

use crate::bucket::rate::RawRate;
use crate::sync::{fence, spin_hint, AtomicU64, Ordering};

/// Record slots. Fewer than `SLOTS / 2` writers running `set_rate` at one instant are
/// guaranteed progress (a ticket may skip one number, so each newer writer moves `nxt` by at
/// most 2); more still make progress unless they keep pushing each other out of the window.
pub(crate) const SLOTS: usize = 8;

/// Words in a record: six 64-bit fields, two tagged words each.
const WORDS: usize = 12;

/// A point of a rate change where a participant may stop forever (loom models and the
/// process tests stop one there to show the others complete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The writer holds a ticket and wrote nothing yet.
    Ticket,
    /// The writer wrote this many words of its record (1..=12).
    Word(usize),
    /// The record is published; the old rate's interval is not closed yet.
    Published,
}

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

/// A step as a number (loom models name steps this way): `Ticket` 0, `Word(k)` k,
/// `Published` 13.
#[cfg(any(all(test, iothrottle_loom), feature = "shm-test-hooks"))]
pub(crate) fn step_code(step: Step) -> u32 {
    match step {
        Step::Ticket => 0,
        Step::Word(k) => k as u32,
        Step::Published => WORDS as u32 + 1,
    }
}

/// `ctl` from `cur` and `nxt`.
#[inline]
fn join(cur: u32, nxt: u32) -> u64 {
    (cur as u64) << 32 | nxt as u64
}

/// `(cur, nxt)` from `ctl`.
#[inline]
fn split(ctl: u64) -> (u32, u32) {
    ((ctl >> 32) as u32, ctl as u32)
}

/// Whether ticket `a` was handed out after ticket `b` (wrapping).
#[inline]
fn newer(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

#[inline]
fn slot_of(ticket: u32) -> usize {
    ticket as usize % SLOTS
}

/// Whether ticket `t` may still be published while `ctl` holds `(cur, nxt)`: it is newer than
/// `cur`, and the ticket that reuses its slot (`t + SLOTS`) was not handed out.
#[inline]
fn publishable(t: u32, cur: u32, nxt: u32) -> bool {
    newer(t, cur) && nxt.wrapping_sub(t) <= SLOTS as u32
}

/// The record's six fields, in word order.
#[inline]
fn fields(r: &Regime) -> [u64; WORDS / 2] {
    [
        r.rate.tokens,
        r.rate.period_ns,
        r.epoch,
        r.prev.tokens,
        r.prev.period_ns,
        r.prev_epoch,
    ]
}

/// Word `i` of a record with these fields, tagged `ticket`.
#[inline]
fn word(f: &[u64; WORDS / 2], i: usize, ticket: u32) -> u64 {
    let half = if i.is_multiple_of(2) {
        f[i / 2] >> 32
    } else {
        f[i / 2] & u32::MAX as u64
    };
    half << 32 | ticket as u64
}

/// One record: twelve tagged words (value half in the high 32 bits, ticket in the low 32).
#[derive(Debug)]
#[repr(C)]
struct Slot {
    words: [AtomicU64; WORDS],
}

impl Slot {
    /// A slot holding `r` under `ticket`.
    fn new(r: &Regime, ticket: u32) -> Self {
        let f = fields(r);
        Slot {
            words: std::array::from_fn(|i| AtomicU64::new(word(&f, i, ticket))),
        }
    }

    /// The record, if every word is tagged `ticket`.
    fn read(&self, ticket: u32) -> Option<Regime> {
        let mut f = [0u64; WORDS / 2];
        for (i, w) in self.words.iter().enumerate() {
            // Relaxed: published by `ctl`'s Release, which the caller's Acquire load of `cur`
            // read (see the module doc); a later overwrite shows as a different tag.
            let w = w.load(Ordering::Relaxed);
            if w as u32 != ticket {
                return None;
            }
            f[i / 2] |= (w >> 32) << if i.is_multiple_of(2) { 32 } else { 0 };
        }
        Some(Regime {
            rate: RawRate {
                tokens: f[0],
                period_ns: f[1],
            },
            epoch: f[2],
            prev: RawRate {
                tokens: f[3],
                period_ns: f[4],
            },
            prev_epoch: f[5],
        })
    }

    /// Writes `r` under `ticket`, word by word, each by a CAS that replaces only an older tag.
    /// `false` when a newer ticket owns a word (this writer lost the slot); `None` when `stop`
    /// stopped the writer.
    fn write(&self, r: &Regime, ticket: u32, stop: &impl Fn(Step) -> bool) -> Option<bool> {
        let f = fields(r);
        for (i, w) in self.words.iter().enumerate() {
            let new = word(&f, i, ticket);
            // Relaxed: only this word's modification order matters here; `ctl`'s Release
            // publishes the record.
            let mut old = w.load(Ordering::Relaxed);
            loop {
                if newer(old as u32, ticket) {
                    return Some(false);
                }
                // Relaxed (both): as above; on failure we look at the tag again.
                match w.compare_exchange_weak(old, new, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => break,
                    Err(actual) => old = actual,
                }
            }
            if stop(Step::Word(i + 1)) {
                return None;
            }
        }
        Some(true)
    }
}

/// The regime, readable and replaceable by any number of threads or processes without locks.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct RateCell {
    /// `cur << 32 | nxt`: the published ticket and the next one to hand out.
    ctl: AtomicU64,
    slots: [Slot; SLOTS],
}

impl RateCell {
    pub(crate) fn new(regime: Regime) -> Self {
        // Slot 0 holds the regime under ticket 0; slot k is tagged k − SLOTS (older than the
        // first ticket that will use it), so every first write finds an older tag.
        RateCell {
            ctl: AtomicU64::new(join(0, 1)),
            slots: std::array::from_fn(|k| {
                let tag = if k == 0 {
                    0
                } else {
                    (k as u32).wrapping_sub(SLOTS as u32)
                };
                Slot::new(&regime, tag)
            }),
        }
    }

    /// The current regime (never torn).
    pub(crate) fn load(&self) -> Regime {
        self.load_ticketed().1
    }

    /// The current regime and the ticket it was published under (never torn).
    pub(crate) fn load_ticketed(&self) -> (u32, Regime) {
        // Acquire fence: a caller's Relaxed load just before this call that read a Release
        // store synchronises with it, so `cur` below is at least what was published before
        // that store (see `rovers`).
        fence(Ordering::Acquire);
        loop {
            // Acquire: pairs with the publishing AcqRel CAS; the record's words are visible.
            let (cur, _) = split(self.ctl.load(Ordering::Acquire));
            if let Some(r) = self.slots[slot_of(cur)].read(cur) {
                return (cur, r);
            }
            // `cur` moved on while we read (its slot is only reused after that): read again.
            spin_hint();
        }
    }

    /// The ticket of the regime published now: the one [`load`](Self::load) would read at
    /// this point (with the same leading Acquire fence), without reading it. A cache of the
    /// regime published under this ticket holds exactly what `load` would return.
    #[inline]
    pub(crate) fn published(&self) -> u32 {
        // Acquire fence: as in `load_ticketed`.
        fence(Ordering::Acquire);
        // Acquire: as in `load_ticketed` (the caller's cache is validated by this ticket).
        split(self.ctl.load(Ordering::Acquire)).0
    }

    /// Replaces the regime by `f(current)`; returns the regime published. `f` may run more
    /// than once (whenever another writer published first, with the regime it published);
    /// the result of its last run is published only if no other writer published since its
    /// `current` was read. Readers never wait for writers, and writers never wait for each
    /// other: a writer stopped forever anywhere in here holds back nobody.
    ///
    /// `stop` is asked at each [`Step`]; `true` makes the writer stop there as if it had died
    /// (`None` is returned). Production passes `|_| false`.
    pub(crate) fn update(
        &self,
        mut f: impl FnMut(Regime) -> Regime,
        stop: &impl Fn(Step) -> bool,
    ) -> Option<Regime> {
        // Acquire: we read the current record through `cur`.
        let mut ctl = self.ctl.load(Ordering::Acquire);
        'ticket: loop {
            let ticket = loop {
                let (cur, nxt) = split(ctl);
                // The slot of `cur` is never handed out: skip its ticket.
                let t = if slot_of(nxt) == slot_of(cur) {
                    nxt.wrapping_add(1)
                } else {
                    nxt
                };
                let taken = join(cur, t.wrapping_add(1));
                // AcqRel on success: a ctl RMW like the publication (orders us after what we
                // read); Acquire on failure: we go on from the value read.
                match self.ctl.compare_exchange_weak(
                    ctl,
                    taken,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        ctl = taken;
                        break t;
                    }
                    Err(actual) => ctl = actual,
                }
            };
            if stop(Step::Ticket) {
                return None;
            }
            loop {
                let (cur, nxt) = split(ctl);
                if !publishable(ticket, cur, nxt) {
                    continue 'ticket;
                }
                let Some(current) = self.slots[slot_of(cur)].read(cur) else {
                    // `cur` moved on since we read `ctl`: read it again.
                    // Acquire: as above.
                    ctl = self.ctl.load(Ordering::Acquire);
                    continue;
                };
                let next = f(current);
                match self.slots[slot_of(ticket)].write(&next, ticket, stop) {
                    None => return None,
                    Some(false) => {
                        // A newer ticket owns our slot: we are out of the window.
                        // Acquire: as above.
                        ctl = self.ctl.load(Ordering::Acquire);
                        continue 'ticket;
                    }
                    Some(true) => {}
                }
                // AcqRel on success: Release publishes the record's words (written above) to
                // readers that Acquire `cur`. Acquire on failure: we go on from the value read.
                match self.ctl.compare_exchange(
                    ctl,
                    join(ticket, nxt),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        if stop(Step::Published) {
                            return None;
                        }
                        return Some(next);
                    }
                    Err(actual) => ctl = actual,
                }
            }
        }
    }
}
