//! What all shards of a dispatcher share ([`Shared`]: the bucket, the classes, the
//! configuration, the run-time control generation) and the latch that counts the shard threads
//! still running ([`ExitLatch`]).

use std::fmt;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::bucket::Rate;
use crate::checkpoint::MarkGate;
use crate::clock::Clock;
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::{ConfigError, ControlError, SubmitError};

use super::budget::Budget;
use super::class::{self, ClassId, Classes};
use super::cost::{DiskModel, IoRequest};
use super::stats::{ClassRecorder, ClassStats, ShardStats};
use super::DispatcherBuilder;

/// The clock every part of a dispatcher reads.
pub(crate) type ArcClock = Arc<dyn Clock>;

/// What all shards share: the bucket, the classes' fairness state, the configuration.
pub(crate) struct Shared {
    pub(crate) budget: Budget,
    /// The checkpoint layer ([`DispatcherBuilder::checkpoint`]): in strict mode a shard
    /// dispatches a reservation only once the durable mark covers it. `None`: no checkpoint,
    /// and the shards' hot path is unchanged.
    pub(crate) gate: Option<Arc<MarkGate>>,
    pub(crate) classes: Classes,
    pub(crate) disk: DiskModel,
    /// The most tokens one request (or piece) may cost; at most the bucket's limit.
    pub(crate) max_cost: u64,
    /// The latency goal: the disk time (tokens) the bucket's limit was sized for.
    pub(crate) latency_goal: Duration,
    /// A shard's reservation target: the tokens it reserves at once when it has that much
    /// queued (a request costing more is reserved alone).
    pub(crate) batch: u64,
    pub(crate) clock: ArcClock,
    /// Each shard's stats as it stopped, for [`Dispatcher::stats`] after shutdown.
    pub(crate) final_stats: Mutex<Vec<Option<ShardStats>>>,
    /// The control generation: bumped after every run-time change (rate, shares, cap); a
    /// shard that sees a new value re-reads what it caches (its replenish pace, the cap
    /// buckets). The change itself is published by its own atomics or lock; this counter
    /// only says "look again".
    control: AtomicU64,
    /// User futures whose `poll` or `drop` panicked (caught on the shards).
    pub(crate) panics: AtomicU64,
    /// Counts the shard threads still running, for a bounded or async shutdown.
    pub(crate) exits: ExitLatch,
    /// One per shard: notified when a completion gives capacity back (capped mode), so that a
    /// shard waiting for it re-polls at once instead of at its next timed check.
    pub(crate) released: Vec<tokio::sync::Notify>,
    /// How long an idle shard keeps polling after its last activity before it parks
    /// ([`DispatcherBuilder::idle_poll`]).
    pub(crate) idle_poll: Duration,
    /// Run a submitted future from the caller's thread when its request can go at once
    /// ([`DispatcherBuilder::caller_dispatch`] set to `true`).
    pub(crate) caller_dispatch: bool,
    /// Issue a `ThrottledFile` piece that can go at once on the caller's own ring
    /// ([`DispatcherBuilder::caller_dispatch`] not set to `false`).
    pub(crate) caller_files: bool,
    /// Per shard and class (`shard * classes + class`): the requests dispatched on their
    /// callers' threads on behalf of the shard, merged into its stats.
    pub(crate) fast: Box<[Mutex<ClassRecorder>]>,
    /// 1 once shutdown started: no new request or task is taken.
    pub(crate) closed: AtomicU64,
    /// One per shard: its spawned tasks not yet ended (see `spawn::Live`).
    pub(crate) spawned: Vec<AtomicU64>,
    /// One per shard: the tasks ever handed to it by `spawn_on` (see `spawn::Live`).
    pub(crate) tasks_spawned: Vec<AtomicU64>,
    /// One per shard: the times it found its core contended while idle-polling and backed off
    /// (written by the shard's thread only).
    pub(crate) poll_backoffs: Vec<AtomicU64>,
    /// One per shard: how many times its thread parked with nothing queued. Counted only in
    /// the crate's own unit tests (of the idle poll): release builds carry no such field.
    #[cfg(test)]
    pub(crate) parks: Vec<AtomicU64>,
    /// One per shard: its short sleeps, `[on its own timerfd, on the timer thread]`. Counted
    /// only in the crate's own unit tests.
    #[cfg(test)]
    pub(crate) short_sleeps: Vec<[AtomicU64; 2]>,
}

/// Counts the shard threads still running; each decrements it as it ends (even by a panic).
#[derive(Debug)]
pub(crate) struct ExitLatch {
    running: Mutex<usize>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl ExitLatch {
    pub(crate) fn new(running: usize) -> Self {
        ExitLatch {
            running: Mutex::new(running),
            cv: Condvar::new(),
            notify: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn running(&self) -> usize {
        *self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A shard thread ended.
    pub(crate) fn exited(&self) {
        let mut n = self.running.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        drop(n);
        self.cv.notify_all();
        self.notify.notify_waiters();
    }

    /// Blocks until every shard ended or `timeout` passed; the shards still running.
    pub(crate) fn wait_timeout(&self, timeout: Duration) -> usize {
        let n = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let (n, _) = self
            .cv
            .wait_timeout_while(n, timeout, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
        *n
    }

    /// Waits, without blocking the thread, until every shard ended.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("budget", &self.budget)
            .field("classes", &self.classes)
            .field("disk", &self.disk)
            .field("max_cost", &self.max_cost)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn new(
        budget: Budget,
        classes: Classes,
        disk: DiskModel,
        (max_cost, batch): (u64, u64),
        latency_goal: Duration,
        clock: ArcClock,
        shards: usize,
    ) -> Self {
        let classes_len = classes.len();
        Shared {
            budget,
            gate: None,
            classes,
            disk,
            max_cost,
            latency_goal,
            batch,
            clock,
            final_stats: Mutex::new(vec![None; shards]),
            control: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            exits: ExitLatch::new(shards),
            released: (0..shards).map(|_| tokio::sync::Notify::new()).collect(),
            idle_poll: DispatcherBuilder::DEFAULT_IDLE_POLL,
            #[cfg(test)]
            parks: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            #[cfg(test)]
            short_sleeps: (0..shards)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
            caller_dispatch: false,
            caller_files: false,
            fast: (0..shards * classes_len)
                .map(|_| Mutex::new(ClassRecorder::new()))
                .collect(),
            closed: AtomicU64::new(0),
            spawned: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            tasks_spawned: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            poll_backoffs: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Checks a request before it is queued: the dispatcher is open, the class exists, the
    /// request fits in [`max_cost`](Self::max_cost); its cost.
    pub(crate) fn admit(&self, class: ClassId, request: &IoRequest) -> Result<u64, SubmitError> {
        // Acquire: pairs with the Release store that starts shutdown; a submit that sees 0 may
        // still race with a shutdown, which the shard then handles (see `runner`).
        if self.closed.load(Ordering::Acquire) != 0 {
            return Err(SubmitError::ShutDown);
        }
        if class.0 >= self.classes.len() {
            return Err(SubmitError::UnknownClass {
                class: class.0,
                classes: self.classes.len(),
            });
        }
        let cost = self.disk.cost(request);
        if cost > self.max_cost {
            return Err(self.too_large(request, cost));
        }
        Ok(cost)
    }

    /// The error for `request`, which costs `cost`, more than [`max_cost`](Self::max_cost).
    pub(crate) fn too_large(&self, request: &IoRequest, cost: u64) -> SubmitError {
        SubmitError::TooLarge {
            cost,
            max_cost: self.max_cost,
            max_bytes: request
                .kind()
                .and_then(|k| self.disk.max_bytes_within(k, self.max_cost)),
        }
    }

    /// Whether a request of `class` costing `cost`, submitted from outside the shards for
    /// `shard`, goes at once from the caller's thread, and if so takes its tokens and charges
    /// its class. It goes only when nothing could tell it apart from a request the shard
    /// dispatched at once: no request of its class waits anywhere (FIFO within the class), the
    /// cross-shard fairness rules let its class reserve now and no class with requests waiting
    /// is behind it in virtual time (the shares between classes: it takes no tokens its shard
    /// would give a waiting class first), its
    /// in-flight bound has room, and the bucket holds its tokens now (nobody's reservation is
    /// owed tokens). Not with a checkpoint gate, latency targets or a bandwidth cap on the
    /// class: those keep the shard's path.
    pub(crate) fn try_fast(&self, class: usize, shard: usize, cost: u64, now: Duration) -> bool {
        if !(self.caller_dispatch || self.caller_files)
            || self.gate.is_some()
            || self.classes.latency().is_some()
            || self.classes.any_queued(class)
            || self.classes.has_cap(class)
            || self.classes.may_go_now(class, shard).is_err()
            || !self.classes.first_among_waiting(class)
        {
            return false;
        }
        self.budget.replenish_at(now);
        if self.budget.available() < cost || !self.classes.try_start(class, cost) {
            return false;
        }
        // Another thread may have grabbed since `available`: then this request goes at most
        // its own cost early, and the bucket's tail carries the debt (later grabs wait for
        // it), so the rate stays exact.
        self.budget.grab(cost);
        self.classes.charge(class, shard, cost);
        true
    }

    /// The recorder of the requests dispatched on their callers' threads for `shard`.
    pub(crate) fn fast_recorder(
        &self,
        shard: usize,
        class: usize,
    ) -> MutexGuard<'_, ClassRecorder> {
        let i = shard * self.classes.len() + class;
        self.fast[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A snapshot of [`fast_recorder`](Self::fast_recorder), when any request was dispatched
    /// so.
    pub(crate) fn fast_stats(&self, shard: usize, class: usize) -> Option<ClassStats> {
        let r = self.fast_recorder(shard, class);
        (r.requests > 0).then(|| {
            r.snapshot(
                self.classes.get(class).config.name(),
                self.classes.shares(class),
                0,
            )
        })
    }

    /// The control generation (see the field).
    pub(crate) fn control(&self) -> u64 {
        // Acquire: pairs with the AcqRel increment in `changed`, so a shard that sees the new
        // generation also sees the change made before it.
        self.control.load(Ordering::Acquire)
    }

    pub(crate) fn changed(&self) {
        // AcqRel: publishes the change made before it to the shards' Acquire loads.
        self.control.fetch_add(1, Ordering::AcqRel);
    }

    /// Changes the bucket's rate (the shards then need a wake-up).
    pub(crate) fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        self.budget.set_rate(rate)?;
        self.changed();
        Ok(())
    }

    fn check_class(&self, class: ClassId) -> Result<(), ControlError> {
        if class.0 < self.classes.len() {
            Ok(())
        } else {
            Err(ControlError::UnknownClass {
                class: class.0,
                classes: self.classes.len(),
            })
        }
    }

    /// Changes a class's shares (the shards then need a wake-up).
    pub(crate) fn set_shares(&self, class: ClassId, shares: u32) -> Result<(), ControlError> {
        self.check_class(class)?;
        let name = self.classes.get(class.0).config.name();
        class::check_shares(name, shares).map_err(|_| ControlError::SharesOutOfRange {
            class: name.to_owned(),
            shares,
        })?;
        self.classes.set_shares(class.0, shares);
        self.changed();
        Ok(())
    }

    /// Changes a class's cap; returns whether it changed (the shards then need a wake-up).
    /// Re-applying the cap the class has is a no-op; a changed cap carries over what the old
    /// one held (see [`class::next_cap_bucket`]).
    pub(crate) fn set_bandwidth_cap(
        &self,
        class: ClassId,
        cap: Option<Rate>,
    ) -> Result<bool, ControlError> {
        self.check_class(class)?;
        let changed = self.classes.update_cap(class.0, |old| match (cap, old) {
            (None, None) => Ok(None),
            (None, Some(_)) => Ok(Some(None)),
            (Some(rate), old) => Ok::<_, ControlError>(
                class::next_cap_bucket(rate, &self.clock, old)?.map(|b| Some(Arc::new(b))),
            ),
        })?;
        if changed {
            self.changed();
        }
        Ok(changed)
    }
}
