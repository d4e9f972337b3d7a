//! A shard's own queues, one per class, and the choice of what goes into the next reservation.
//!
//! Everything here belongs to one shard and is touched only by its thread (`!Send` users hold
//! it in a `RefCell`); the only shared state it reads or writes is the classes' virtual time and
//! backlog counters ([`Classes`]) and their bandwidth-cap buckets.

use std::collections::VecDeque;
use std::time::Duration;

use crate::bucket::ahead;
use crate::sync::Arc;

use super::class::{CapBucket, Classes};
use super::stats::ClassRecorder;

/// How long a shard waits at most before it looks again at a class held back by its in-flight
/// bound (the class's completions wake it sooner; this only guards against a lost wake-up).
const IN_FLIGHT_BACKSTOP: Duration = Duration::from_millis(1);

/// The most entries [`Queues::select`] allocates room for up front (more grow the list): a
/// deep queue with a small batch target takes few of its entries, and should not pay for a
/// list sized for all of them.
const MAX_BATCH_ENTRIES: usize = 32;

/// What the dispatcher carries for a request: the user's future, or a test's marker.
pub(crate) trait Payload {
    /// `true` when nobody waits for the result any more (the handle was dropped): the request
    /// is skipped and its tokens given back.
    fn is_cancelled(&self) -> bool;
}

/// A queued request.
#[derive(Debug)]
pub(crate) struct Entry<P> {
    pub(crate) class: usize,
    /// Tokens it costs.
    pub(crate) cost: u64,
    /// Bytes it moves (for stats and the class's bandwidth cap).
    pub(crate) bytes: u64,
    /// When it was submitted, on the dispatcher's clock.
    pub(crate) submitted: Duration,
    pub(crate) payload: P,
}

#[derive(Debug)]
struct ClassQueue<P> {
    entries: VecDeque<Entry<P>>,
    /// Counted in the class's shared backlog: non-empty and not held back by the cap.
    active: bool,
    /// Cap bucket position claimed for the head entry, its bytes not there yet.
    cap_wait: Option<u64>,
    /// Counted in the class's shared `cap_waiting`: non-empty and `cap_wait` is set.
    waiting: bool,
    /// The head entry's cap bytes are there.
    head_paid: bool,
    /// The head entry waits for the class's in-flight bound: like a cap wait, the class does
    /// not compete meanwhile (its stalled requests must not hold the other classes back
    /// through fairness).
    bound_wait: bool,
    /// This shard's copy of the class's cap bucket (refreshed by [`Queues::refresh`]).
    cap: Option<Arc<CapBucket>>,
}

/// What [`Queues::select`] found.
#[derive(Debug)]
pub(crate) enum Selection<P> {
    /// Requests to reserve for, in dispatch order, and their total cost.
    Batch { entries: Vec<Entry<P>>, tokens: u64 },
    /// Nothing queued.
    Empty,
    /// Requests are queued but none may go now.
    Blocked {
        /// Fairness: tokens the slowest backlogged class must get first (the least over this
        /// shard's classes).
        behind: Option<u64>,
        /// Bandwidth caps: the soonest a capped class's bytes are there.
        cap_wait: Option<Duration>,
    },
}

/// A shard's queues.
#[derive(Debug)]
pub(crate) struct Queues<P> {
    classes: Vec<ClassQueue<P>>,
    /// Scratch for `select`: classes skipped this round.
    skipped: Vec<bool>,
    len: usize,
    /// This shard's index.
    shard: usize,
}

impl<P> Queues<P> {
    /// Takes every class out of the shared backlog counts (the shard is going away).
    pub(crate) fn withdraw(&mut self, shared: &Classes) {
        for c in 0..self.classes.len() {
            let q = &mut self.classes[c];
            if q.active {
                q.active = false;
                shared.deactivate(c, self.shard);
            }
            if q.waiting {
                q.waiting = false;
                shared.cap_waiting(c, false);
            }
        }
    }
}

impl<P: Payload> Queues<P> {
    pub(crate) fn new(shared: &Classes, shard: usize) -> Self {
        let classes = shared.len();
        Queues {
            classes: (0..classes)
                .map(|c| ClassQueue {
                    entries: VecDeque::new(),
                    active: false,
                    cap_wait: None,
                    waiting: false,
                    head_paid: false,
                    bound_wait: false,
                    cap: shared.cap(c),
                })
                .collect(),
            skipped: vec![false; classes],
            len: 0,
            shard,
        }
    }

    /// Requests queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Takes up the classes' current cap buckets (after `set_bandwidth_cap`). A head that was
    /// waiting for bytes of a replaced bucket claims them again from the new one (or goes at
    /// once when the cap was removed); a head already paid stays paid.
    pub(crate) fn refresh(&mut self, shared: &Classes) {
        for c in 0..self.classes.len() {
            let cap = shared.cap(c);
            let q = &mut self.classes[c];
            let same = match (&q.cap, &cap) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if same {
                continue;
            }
            q.cap = cap;
            q.cap_wait = None;
            self.sync_active(shared, c);
        }
    }

    /// Requests of class `c` queued.
    pub(crate) fn class_len(&self, c: usize) -> usize {
        self.classes.get(c).map_or(0, |q| q.entries.len())
    }

    /// Queues `entry` at the back of its class.
    pub(crate) fn push(&mut self, shared: &Classes, entry: Entry<P>) {
        let c = entry.class;
        self.classes[c].entries.push_back(entry);
        self.len += 1;
        self.sync_active(shared, c);
    }

    /// Removes every queued request (shutdown), giving back the cap bytes claimed for heads.
    pub(crate) fn drain(&mut self, shared: &Classes) -> Vec<Entry<P>> {
        let mut out = Vec::with_capacity(self.len);
        for c in 0..self.classes.len() {
            self.release_head_cap(c);
            out.extend(self.classes[c].entries.drain(..));
            self.sync_active(shared, c);
        }
        self.len = 0;
        out
    }

    /// Picks requests for the next reservation, `target` tokens' worth (at least one request,
    /// possibly overshooting by less than the last one's cost): each time the class with the
    /// least virtual time that may go, charging its virtual time as it is picked.
    pub(crate) fn select(
        &mut self,
        shared: &Classes,
        target: u64,
        stats: &mut [ClassRecorder],
    ) -> Selection<P> {
        self.skipped.iter_mut().for_each(|s| *s = false);
        // Sized once (a queue 32 deep is taken whole when the batch allows): growing it one
        // push at a time reallocated it six times for 32 requests.
        let mut entries = Vec::with_capacity(self.len.min(MAX_BATCH_ENTRIES));
        let mut tokens = 0u64;
        let mut behind: Option<u64> = None;
        let mut cap_wait: Option<Duration> = None;
        while tokens < target {
            let Some(c) = self.least_virtual_time(shared) else {
                break;
            };
            let q = &mut self.classes[c];
            let head = q.entries.front().expect("picked classes are non-empty");
            if head.payload.is_cancelled() {
                self.release_head_cap(c);
                self.classes[c].entries.pop_front();
                self.len -= 1;
                stats[c].cancelled += 1;
                #[cfg(feature = "metrics")]
                crate::metrics::class_unqueued(shared.get(c).config.name(), true);
                self.sync_active(shared, c);
                continue;
            }
            if let Err(wait) = self.cap_ready(shared, c) {
                self.skipped[c] = true;
                cap_wait = Some(cap_wait.map_or(wait, |w| w.min(wait)));
                continue;
            }
            if let Err(a) = shared.may_reserve(c, self.shard) {
                self.skipped[c] = true;
                behind = Some(behind.map_or(a.tokens, |b| b.min(a.tokens)));
                continue;
            }
            // The class's bound on its disk time in flight: wait for its completions (they
            // wake the shard; the backstop only guards against a lost wake-up).
            let cost = self.classes[c].entries.front().expect("non-empty").cost;
            if !shared.try_start(c, cost) {
                if !self.classes[c].bound_wait {
                    self.classes[c].bound_wait = true;
                    self.sync_active(shared, c);
                }
                self.skipped[c] = true;
                cap_wait = Some(cap_wait.map_or(IN_FLIGHT_BACKSTOP, |w| w.min(IN_FLIGHT_BACKSTOP)));
                continue;
            }
            self.classes[c].bound_wait = false;
            // Latency-target mode: the other classes draw from the controller's budget (last,
            // so nothing is taken for a request that does not go).
            if let Some(lc) = shared.latency().filter(|lc| !lc.is_protected(c)) {
                if let Err(wait) = lc.take(cost) {
                    shared.finish(c, cost);
                    self.sync_active(shared, c);
                    self.skipped[c] = true;
                    cap_wait = Some(cap_wait.map_or(wait, |w| w.min(wait)));
                    continue;
                }
            }
            let q = &mut self.classes[c];
            let e = q.entries.pop_front().expect("non-empty");
            q.head_paid = false;
            self.len -= 1;
            shared.charge(c, self.shard, e.cost);
            tokens = tokens.saturating_add(e.cost);
            entries.push(e);
            self.sync_active(shared, c);
        }
        if !entries.is_empty() {
            Selection::Batch { entries, tokens }
        } else if self.len == 0 {
            Selection::Empty
        } else {
            Selection::Blocked { behind, cap_wait }
        }
    }

    /// The non-empty, not yet skipped class with the least virtual time, high tier first.
    fn least_virtual_time(&self, shared: &Classes) -> Option<usize> {
        let mut best: Option<(bool, u64, usize)> = None;
        for (c, q) in self.classes.iter().enumerate() {
            if q.entries.is_empty() || self.skipped[c] {
                continue;
            }
            let (high, v) = (shared.is_high(c), shared.vtime(c));
            let better = match best {
                None => true,
                Some((bh, bv, _)) => (high && !bh) || (high == bh && ahead(v, bv) < 0),
            };
            if better {
                best = Some((high, v, c));
            }
        }
        best.map(|(_, _, c)| c)
    }

    /// Whether the head of `c` has its cap bytes (always, for an uncapped class); otherwise
    /// how long until they are there. Claims them the first time it is asked.
    fn cap_ready(&mut self, shared: &Classes, c: usize) -> Result<(), Duration> {
        let q = &mut self.classes[c];
        let Some(cap) = q.cap.clone() else {
            return Ok(());
        };
        if q.head_paid {
            return Ok(());
        }
        cap.replenish();
        let tail = match q.cap_wait {
            Some(tail) => tail,
            None => cap.grab(q.entries.front().expect("non-empty").bytes),
        };
        let d = cap.deficiency(tail);
        if d == 0 {
            q.cap_wait = None;
            q.head_paid = true;
            self.sync_active(shared, c);
            Ok(())
        } else {
            let first_time = q.cap_wait.is_none();
            q.cap_wait = Some(tail);
            if first_time {
                self.sync_active(shared, c);
            }
            Err(cap_wait_for(&cap, d))
        }
    }

    /// The head of `c` leaves without being dispatched: give back its claimed cap bytes.
    fn release_head_cap(&mut self, c: usize) {
        let q = &mut self.classes[c];
        if q.head_paid || q.cap_wait.is_some() {
            if let (Some(cap), Some(head)) = (q.cap.as_ref(), q.entries.front()) {
                cap.refund(head.bytes);
            }
        }
        q.head_paid = false;
        q.cap_wait = None;
    }

    /// Keeps the class's shared backlog count in step with this queue.
    fn sync_active(&mut self, shared: &Classes, c: usize) {
        let q = &mut self.classes[c];
        let held = q.cap_wait.is_some() || q.bound_wait;
        let waiting = !q.entries.is_empty() && held;
        if waiting != q.waiting {
            q.waiting = waiting;
            shared.cap_waiting(c, waiting);
        }
        let want = !q.entries.is_empty() && !held;
        if want != q.active {
            q.active = want;
            if want {
                shared.activate(c, self.shard);
            } else {
                shared.deactivate(c, self.shard);
            }
        }
    }
}

/// How long until the cap bucket can cover `missing` bytes: it must have earned them since its
/// last replenish, and it adds bytes only in steps of its threshold (1 ms of the cap), so
/// waking sooner than a threshold after the last replenish finds nothing new (it would
/// busy-poll).
fn cap_wait_for(cap: &CapBucket, missing: u64) -> Duration {
    use crate::clock::Clock;
    let need = cap
        .duration_for(missing)
        .max(cap.duration_for(cap.threshold()));
    let now = cap.clock().now();
    match cap.last_replenish() {
        Some(last) if last + need > now => last + need - now,
        _ => need,
    }
}
