//! The shard loop's logic, [`ShardCore`]: a state machine that takes `now` as an argument, so
//! that tests drive several shards on one thread with a [`ManualClock`](crate::ManualClock)
//! and check every token. The shard thread ([`runner`](super::runner)) only adds the channel,
//! the sleeping and the spawning.
//!
//! One [`poll`](ShardCore::poll):
//!
//! 1. Replenish the shared bucket, but only when enough time has passed *locally* since this
//!    shard last did to add at least the threshold (saves the clock read and the CAS).
//! 2. If a reservation is outstanding and the bucket still owes it tokens (`deficiency > 0`),
//!    sleep for `duration_for(deficiency)` (no spinning). Otherwise dispatch its requests, and
//!    refund the cost of those whose handle was dropped meanwhile.
//! 3. Pick the next batch ([`Queues::select`]): what is queued, class by class in fair order
//!    (least virtual time first, and only classes the cross-shard fairness rules allow), up to
//!    the batch target. Grab exactly its cost, and go to 2. Nothing is reserved for requests
//!    that are not queued: a shard at queue depth 1 reserves one request's cost, never a
//!    full-limit batch (the 17× collapse of seastar issue #3201 came from full-limit
//!    reservations).
//!
//! At most one reservation per shard is outstanding. The requests of a reservation are chosen
//! when it is grabbed, and the batch target is small (250 µs of disk time by default), so the
//! order is decided close to dispatch.

use std::marker::PhantomData;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::sync::Arc;

use super::queue::{Entry, Payload, Queues, Selection};
use super::stats::{ClassRecorder, ClassStats};
use super::Shared;

/// Shortest and longest sleep of a shard held back by fairness: it re-checks then (the class it
/// waits for may be slower than the full rate, or may go idle).
const MIN_FAIRNESS_WAIT: Duration = Duration::from_micros(50);
const MAX_FAIRNESS_WAIT: Duration = Duration::from_millis(5);

/// What a shard does after a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing queued: wait for a request.
    Idle,
    /// Poll again after this long (or earlier, when a request arrives).
    WakeAfter(Duration),
    /// The reservation ending at this tail has its tokens but is past the durable checkpoint
    /// mark (strict mode): poll again when the mark moves (or a request arrives).
    WaitDurable(u64),
}

#[derive(Debug)]
struct Reservation<P> {
    /// The bucket position the reservation ends at.
    tail: u64,
    /// The tokens it claimed (the claim is `(tail - tokens, tail]`).
    tokens: u64,
    entries: Vec<Entry<P>>,
    /// Entries found cancelled when the shard last computed what it waits for.
    cancelled: usize,
}

impl<P: Payload> Reservation<P> {
    /// The position the shard waits for: the claim's start plus what its live entries cost.
    /// Cancelled entries are given back as the throttle gives back a cancelled claim: as if
    /// never made, so nobody waits for their tokens to accrue. Their tokens are refunded when
    /// `head` reaches this position (at dispatch: everything before it is then served, so the
    /// refund serves nobody early); with every entry cancelled that is the claim's start.
    fn due(&mut self) -> u64 {
        let (mut live, mut cancelled) = (0u64, 0usize);
        for e in &self.entries {
            if e.payload.is_cancelled() {
                cancelled += 1;
            } else {
                live += e.cost;
            }
        }
        self.cancelled = cancelled;
        self.tail.wrapping_sub(self.tokens).wrapping_add(live)
    }
}

/// One shard's state: its queues, its outstanding reservation, its stats.
#[derive(Debug)]
pub(crate) struct ShardCore<P> {
    shared: Arc<Shared>,
    queues: Queues<P>,
    reservation: Option<Reservation<P>>,
    /// Do not replenish before this (local time of last replenish + time for the threshold).
    next_replenish: Duration,
    replenish_step: Duration,
    /// The dispatcher's control generation this shard last took up (see [`Shared::control`]).
    control: u64,
    stats: Vec<ClassRecorder>,
    shard: usize,
    /// Shard-local: never leaves its thread.
    _local: PhantomData<*const ()>,
}

impl<P: Payload> ShardCore<P> {
    pub(crate) fn new(shared: Arc<Shared>, shard: usize) -> Self {
        let n = shared.classes.len();
        let replenish_step = shared.budget.duration_for(shared.budget.threshold());
        ShardCore {
            queues: Queues::new(&shared.classes, shard),
            reservation: None,
            next_replenish: Duration::ZERO,
            replenish_step,
            control: shared.control(),
            stats: (0..n).map(|_| ClassRecorder::new()).collect(),
            shard,
            shared,
            _local: PhantomData,
        }
    }

    /// Queues a request (its cost is at most `max_cost`, checked at submission).
    pub(crate) fn enqueue(&mut self, entry: Entry<P>) {
        debug_assert!(entry.cost <= self.shared.max_cost);
        #[cfg(feature = "metrics")]
        crate::metrics::class_queued(self.shared.classes.get(entry.class).config.name());
        self.shared.classes.queued_add(entry.class);
        self.queues.push(&self.shared.classes, entry);
    }

    /// Ready when a request of the outstanding reservation was cancelled since the shard last
    /// computed its wait (the wait may now be shorter: see [`Reservation::due`]); registers
    /// `cx` for the cancellations otherwise.
    pub(crate) fn poll_reservation_cancelled(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(res) = &mut self.reservation else {
            return Poll::Pending;
        };
        let mut cancelled = 0;
        for e in &mut res.entries {
            if e.payload.poll_cancelled(cx).is_ready() {
                cancelled += 1;
            }
        }
        if cancelled > res.cancelled {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// A request of `class` that one of the shard's own tasks dispatched at once, without its
    /// queue: recorded as dispatched with no wait.
    pub(crate) fn dispatched_here(&mut self, class: usize, bytes: u64, cost: u64) {
        if let Some(rec) = self.stats.get_mut(class) {
            rec.dispatched(bytes, cost, Duration::ZERO);
        }
    }

    /// Nothing queued, nothing reserved.
    pub(crate) fn is_idle(&self) -> bool {
        self.queues.len() == 0 && self.reservation.is_none()
    }

    /// Advances the shard at time `now`: dispatches what may go (through `dispatch`) and says
    /// when to come back.
    pub(crate) fn poll(&mut self, now: Duration, dispatch: &mut dyn FnMut(Entry<P>)) -> Next {
        let control = self.shared.control();
        if control != self.control {
            // A rate, shares or cap changed: replenish now and at the new rate's pace, and
            // take up the new cap buckets.
            self.control = control;
            self.replenish_step = self
                .shared
                .budget
                .duration_for(self.shared.budget.threshold());
            self.next_replenish = now;
            self.queues.refresh(&self.shared.classes);
        }
        if let Some(lc) = self.shared.classes.latency() {
            lc.tick(now);
        }
        loop {
            if now >= self.next_replenish {
                self.shared.budget.replenish_at(now);
                self.next_replenish = now + self.replenish_step;
            }
            if let Some(res) = &mut self.reservation {
                let due = res.due();
                let d = self.shared.budget.deficiency(due);
                if d > 0 {
                    let until_replenish = self.next_replenish.saturating_sub(now);
                    return Next::WakeAfter(
                        self.shared.budget.duration_for(d).max(until_replenish),
                    );
                }
                if let Some(gate) = self.shared.gate.as_deref().filter(|g| g.blocks(res.tail)) {
                    // Past the durable mark: like a deficiency, but it ends when the
                    // checkpointer publishes a mark, not with time.
                    gate.request();
                    return Next::WaitDurable(res.tail);
                }
                let res = self.reservation.take().expect("checked above");
                self.dispatch(now, res.entries, dispatch);
            }
            match self
                .queues
                .select(&self.shared.classes, self.shared.batch, &mut self.stats)
            {
                Selection::Batch { entries, tokens } => {
                    let tail = self.shared.budget.grab(tokens);
                    if let Some(gate) = &self.shared.gate {
                        gate.on_grab(tail);
                    }
                    self.reservation = Some(Reservation {
                        tail,
                        tokens,
                        entries,
                        cancelled: 0,
                    });
                }
                Selection::Empty => return Next::Idle,
                Selection::Blocked { behind, cap_wait } => {
                    let fair = behind.map(|t| {
                        self.shared
                            .budget
                            .duration_for(t)
                            .clamp(MIN_FAIRNESS_WAIT, MAX_FAIRNESS_WAIT)
                    });
                    let wait = match (fair, cap_wait) {
                        (Some(a), Some(b)) => a.min(b),
                        (a, b) => a.or(b).unwrap_or(MIN_FAIRNESS_WAIT),
                    };
                    return Next::WakeAfter(wait);
                }
            }
        }
    }

    fn dispatch(&mut self, now: Duration, entries: Vec<Entry<P>>, out: &mut dyn FnMut(Entry<P>)) {
        let mut unused = 0u64;
        for e in entries {
            self.shared.classes.queued_sub(e.class);
            let rec = &mut self.stats[e.class];
            if e.payload.is_cancelled() {
                unused += e.cost;
                self.shared.classes.finish(e.class, e.cost);
                rec.cancelled += 1;
                #[cfg(feature = "metrics")]
                crate::metrics::class_unqueued(
                    self.shared.classes.get(e.class).config.name(),
                    true,
                );
                continue;
            }
            rec.dispatched(e.bytes, e.cost, now.saturating_sub(e.submitted));
            #[cfg(feature = "metrics")]
            crate::metrics::class_dispatched(
                self.shared.classes.get(e.class).config.name(),
                e.bytes,
                e.cost,
                now.saturating_sub(e.submitted),
            );
            out(e);
        }
        if unused > 0 {
            self.shared.budget.refund(unused);
        }
    }

    /// Removes every request that has not been dispatched (shutdown): the queued ones and the
    /// reserved ones, whose tokens are refunded.
    pub(crate) fn drain(&mut self) -> Vec<Entry<P>> {
        let mut out = Vec::new();
        if let Some(res) = self.reservation.take() {
            for e in &res.entries {
                self.shared.classes.finish(e.class, e.cost);
            }
            let unused: u64 = res.entries.iter().map(|e| e.cost).sum();
            if unused > 0 {
                self.shared.budget.refund(unused);
            }
            out.extend(res.entries);
        }
        out.extend(self.queues.drain(&self.shared.classes));
        for e in &out {
            self.shared.classes.queued_sub(e.class);
        }
        #[cfg(feature = "metrics")]
        out.iter().for_each(|e| {
            crate::metrics::class_unqueued(self.shared.classes.get(e.class).config.name(), false)
        });
        out
    }

    /// A dispatched request of `class` costing `cost` ended at `now`: records its service time
    /// (since `dispatched`) and end-to-end latency (since `submitted`).
    pub(crate) fn completed(
        &mut self,
        class: usize,
        cost: u64,
        (submitted, dispatched): (Duration, Duration),
        now: Duration,
    ) {
        if let Some(rec) = self.stats.get_mut(class) {
            rec.completed(
                cost,
                now.saturating_sub(dispatched),
                now.saturating_sub(submitted),
            );
        }
    }

    /// Tests: the tokens of the reservation waiting to be dispatched.
    #[cfg(test)]
    pub(crate) fn reserved_tokens(&self) -> u64 {
        self.reservation
            .as_ref()
            .map_or(0, |r| r.entries.iter().map(|e| e.cost).sum())
    }

    /// A copy of this shard's per-class figures.
    pub(crate) fn stats(&self) -> Vec<ClassStats> {
        let mut queued = vec![0u64; self.stats.len()];
        for (c, q) in queued.iter_mut().enumerate() {
            *q = self.queues.class_len(c) as u64;
        }
        if let Some(res) = &self.reservation {
            for e in &res.entries {
                queued[e.class] += 1;
            }
        }
        self.stats
            .iter()
            .zip(self.shared.classes.iter())
            .enumerate()
            .zip(queued)
            .map(|((i, (r, c)), q)| {
                let mut s = r.snapshot(c.config.name(), self.shared.classes.shares(i), q);
                // The requests dispatched on their callers' threads for this shard.
                if let Some(fast) = self.shared.fast_stats(self.shard, i) {
                    s.merge(&fast);
                }
                s
            })
            .collect()
    }
}

impl<P> Drop for ShardCore<P> {
    /// Whatever ends the shard (even a panic), its classes stop counting as backlogged here,
    /// so that the other shards' fairness does not wait for them.
    fn drop(&mut self) {
        self.queues.withdraw(&self.shared.classes);
    }
}
