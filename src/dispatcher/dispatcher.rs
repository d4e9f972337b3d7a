//! [`Dispatcher`]: submission, run-time control, stats and shutdown of a running dispatcher.

use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::oneshot;

use crate::bucket::{BucketState, Rate};
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::{BuildError, ConfigError, ControlError, ShutdownError, SubmitError};

use super::class::{ClassConfig, ClassId};
use super::cost::{self, DiskModel, IoKind, IoRequest, Piece};
use super::fast;
use super::handle::{IoHandle, SplitHandle};
use super::queue::Entry;
use super::runner::{self, Msg, ShutdownMode, StatsReply};
use super::spawn::{self, ShardJoinHandle};
use super::state::Shared;
use super::stats::{self, DispatcherStats, ShardStats};
use super::task::{self, BoxFuture, BoxTask, Completion, InFlight};
use super::timer;
use super::DispatcherBuilder;
use crate::SpawnError;

/// A thread-per-core I/O dispatcher over one shared token bucket. See the
/// [module documentation](crate::dispatcher).
///
/// `Send + Sync`: submit from any thread (share it in an `Arc`). Dropping it shuts it down
/// like [`shutdown_now`](Self::shutdown_now) (without waiting when dropped in async code).
///
/// **Which shutdown to call.** On a plain thread: [`shutdown`](Self::shutdown) (drain) or
/// [`shutdown_now`](Self::shutdown_now) (cancel what is queued); both block until the running
/// futures end. In async code: [`shutdown_async`](Self::shutdown_async), or
/// [`shutdown_timeout`](Self::shutdown_timeout) for a bound.
pub struct Dispatcher {
    pub(super) shared: Arc<Shared>,
    senders: Vec<UnboundedSender<Msg>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The fine timer for the shards' short sleeps, and its thread.
    timer: Arc<timer::FineTimer>,
    timer_thread: Mutex<Option<timer::TimerThread>>,
    /// Round-robin position for submissions from outside the shards.
    next: AtomicU64,
    /// The core each shard's thread pins itself to (`None`: unpinned).
    cores: Vec<Option<usize>>,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("shards", &self.senders.len())
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// A builder with the defaults.
    pub fn builder() -> DispatcherBuilder {
        DispatcherBuilder::new()
    }

    pub(super) fn start(
        shared: Arc<Shared>,
        shards: usize,
        threads: runner::Threads,
    ) -> Result<Self, BuildError> {
        let pin = threads.pin;
        let cores = if pin {
            core_affinity::get_core_ids().filter(|c| !c.is_empty())
        } else {
            None
        };
        if pin && cores.is_none() {
            tracing::warn!("cannot list the cores; shard threads run unpinned");
        }
        let (fine, fine_thread) = timer::FineTimer::start(shards)
            .map_err(|source| BuildError::Spawn { shard: 0, source })?;
        let wake_timer = fine_thread_handle(&fine_thread);
        let mut dispatcher = Dispatcher {
            shared: shared.clone(),
            senders: Vec::with_capacity(shards),
            threads: Mutex::new(Vec::with_capacity(shards)),
            timer: fine.clone(),
            timer_thread: Mutex::new(Some(fine_thread)),
            next: AtomicU64::new(0),
            cores: Vec::with_capacity(shards),
        };
        let id = dispatcher.id();
        for index in 0..shards {
            // I/O: `disk` reaps io_uring completions on the shard's own reactor.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .enable_io()
                .build()
                .map_err(|source| BuildError::Spawn {
                    shard: index,
                    source,
                })?;
            let (tx, rx) = unbounded_channel();
            let core = cores.as_ref().map(|c| c[index % c.len()]);
            dispatcher.cores.push(core.map(|c| c.id));
            let timer = (fine.clone(), wake_timer.clone());
            let (hook, ready) = match &threads.start {
                Some(h) => {
                    let (tx, rx) = std::sync::mpsc::sync_channel(1);
                    (Some((h.clone(), tx)), Some(rx))
                }
                None => (None, None),
            };
            let start = runner::Start {
                core,
                slice: threads.slice,
                hook,
                stop: threads.stop.clone(),
                tx: tx.downgrade(),
            };
            let thread = runner::spawn(index, id, shared.clone(), rx, rt, start, timer).map_err(
                |source| BuildError::Spawn {
                    shard: index,
                    source,
                },
            )?;
            dispatcher.senders.push(tx);
            dispatcher
                .threads
                .get_mut()
                .expect("not shared yet")
                .push(thread);
            if let Some(ready) = ready {
                // A thread that ended without an answer panicked outside the hook's guard.
                let outcome = ready.recv().unwrap_or_else(|_| {
                    Err(std::io::Error::other(
                        "the shard thread ended before its start hook ran",
                    ))
                });
                // Dropping `dispatcher` on the way out stops the shards already started.
                outcome.map_err(|source| BuildError::ShardStart {
                    shard: index,
                    source,
                })?;
            }
        }
        Ok(dispatcher)
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.senders.len()
    }

    /// The CPU shard `shard`'s thread is pinned to ([`pin_threads`], the default), or `None`
    /// when the shards run unpinned or there is no such shard. Shard `i` takes the `i`-th core
    /// `core_affinity` lists, wrapping when there are more shards than cores; a thread the
    /// kernel refuses to pin logs a `tracing` warning and runs anywhere.
    ///
    /// [`pin_threads`]: DispatcherBuilder::pin_threads
    pub fn shard_cpu(&self, shard: usize) -> Option<usize> {
        self.cores.get(shard).copied().flatten()
    }

    /// The shards pinned to one of `cpus`, in shard order: with
    /// [`completion_cpus`](crate::disk::completion_cpus), the shards where a disk's completions
    /// arrive without crossing CPUs, the place for reads that must be fast. Empty when the
    /// shards run unpinned or none is pinned to these CPUs.
    pub fn shards_on(&self, cpus: &[usize]) -> Vec<usize> {
        (0..self.shards())
            .filter(|&s| self.shard_cpu(s).is_some_and(|c| cpus.contains(&c)))
            .collect()
    }

    /// The shard the calling thread runs, if it is one of this dispatcher's.
    pub fn current_shard(&self) -> Option<usize> {
        spawn::current_index(self.id())
    }

    /// Whether `class` was made with [`ClassConfig::background`] (an unknown class is not).
    pub(crate) fn is_background(&self, class: ClassId) -> bool {
        class.0 < self.classes() && self.shared.classes.get(class.0).config.is_background()
    }

    /// Sends `fut` to shard `shard`, to run there to its end counted among the shard's running
    /// futures, so that a shutdown waits for it. `Err(fut)` when the dispatcher is shutting
    /// down, or the shard is gone: the caller runs it itself.
    pub(crate) fn run_on(&self, shard: usize, fut: BoxFuture) -> Result<(), BoxFuture> {
        // Acquire: pairs with the Release in `signal`; a shard that sees the shutdown first
        // still runs what it receives (see `runner`).
        if self.shared.closed.load(Ordering::Acquire) != 0 {
            return Err(fut);
        }
        match self.senders.get(shard) {
            Some(tx) => tx.send(Msg::Run(fut)).map_err(|e| match e.0 {
                Msg::Run(fut) => fut,
                _ => unreachable!("sent a Run"),
            }),
            None => Err(fut),
        }
    }

    /// The number of classes.
    pub fn classes(&self) -> usize {
        self.shared.classes.len()
    }

    /// The class named `name`.
    pub fn class_id(&self, name: &str) -> Option<ClassId> {
        self.shared
            .classes
            .iter()
            .position(|c| c.config.name() == name)
            .map(ClassId)
    }

    /// A class's configuration now: its current shares and cap.
    pub fn class_config(&self, class: ClassId) -> Option<ClassConfig> {
        (class.0 < self.classes()).then(|| self.shared.classes.config(class.0))
    }

    /// The disk model.
    pub fn disk(&self) -> DiskModel {
        self.shared.disk
    }

    /// What `request` costs, in tokens.
    pub fn cost(&self, request: &IoRequest) -> u64 {
        self.shared.disk.cost(request)
    }

    /// The most one request may cost.
    pub fn max_cost(&self) -> u64 {
        self.shared.max_cost
    }

    /// The latency goal the dispatcher was built with (see
    /// [`DispatcherBuilder::latency_goal`]).
    pub fn latency_goal(&self) -> Duration {
        self.shared.latency_goal
    }

    /// The largest piece of `kind` that [`submit_split`](Self::submit_split) issues: a
    /// multiple of [`SPLIT_ALIGN`](super::SPLIT_ALIGN) costing at most [`max_cost`](Self::max_cost), or `None`
    /// when not even one aligned block fits.
    pub fn max_piece(&self, kind: IoKind) -> Option<u64> {
        self.shared
            .disk
            .max_aligned_bytes_within(kind, self.shared.max_cost)
    }

    /// `true` in capped-release mode.
    pub fn is_capped(&self) -> bool {
        self.shared.budget.is_capped()
    }

    /// The bucket's limit.
    pub fn limit(&self) -> u64 {
        self.shared.budget.limit()
    }

    /// The shared bucket's rovers (see [`SharedTokenBucket::snapshot`](crate::bucket::SharedTokenBucket::snapshot)). In capped mode, once
    /// nothing is queued or running, `ceil - tail` equals the limit again: every token grabbed
    /// was released or refunded exactly once.
    pub fn bucket_state(&self) -> BucketState {
        self.shared.budget.snapshot()
    }

    /// The bucket's rate.
    pub fn rate(&self) -> Rate {
        self.shared.budget.rate()
    }

    /// Changes the bucket's rate, on every shard within one replenish period: the tokens
    /// earned before the call count at the old rate, later ones at the new rate (the bucket's
    /// [`set_rate`](crate::bucket::SharedTokenBucket::set_rate)), and every shard is woken to re-compute its
    /// wait, so a request waiting for tokens is served at the new rate's pace.
    pub fn set_rate(&self, rate: Rate) -> Result<(), ConfigError> {
        self.shared.set_rate(rate)?;
        self.wake_shards();
        Ok(())
    }

    /// Changes a class's shares (`1..=1000`) while running, like Seastar's
    /// `update_shares_for_class`: its later reservations count at the new shares (its virtual
    /// time so far stays). Every shard is woken, so the change holds within one replenish
    /// period.
    pub fn set_shares(&self, class: ClassId, shares: u32) -> Result<(), ControlError> {
        self.shared.set_shares(class, shares)?;
        self.wake_shards();
        Ok(())
    }

    /// Sets, changes or removes (`None`) a class's bandwidth cap while running; `rate` counts
    /// bytes (`Rate::per_second(50 << 20)` is 50 MiB/s). Setting the cap the class already has
    /// (the same rate, however written) changes nothing. A cap set on an uncapped class starts
    /// with a full burst (100 ms of it), as at build; a changed cap starts with what the old one
    /// held (at most its own burst), so changing it often never adds bursts; a request waiting
    /// for bytes of the old cap claims them again from the new one. Every shard is woken on a
    /// change, so it holds within one replenish period.
    pub fn set_bandwidth_cap(&self, class: ClassId, cap: Option<Rate>) -> Result<(), ControlError> {
        if self.shared.set_bandwidth_cap(class, cap)? {
            self.wake_shards();
        }
        Ok(())
    }

    /// Makes every shard poll again (after a run-time change).
    fn wake_shards(&self) {
        for tx in &self.senders {
            // A shard that stopped needs no wake-up.
            let _ = tx.send(Msg::Wake);
        }
    }

    /// Submits `request` of `class`: `fut` runs on a shard once the request's tokens are there,
    /// and the handle resolves to its output. From a shard thread the request stays on that
    /// shard; from elsewhere shards take turns.
    ///
    /// The future must not be polled before: it is the I/O itself. In capped mode its tokens are
    /// released when it ends.
    pub fn submit<F>(
        &self,
        class: ClassId,
        request: IoRequest,
        fut: F,
    ) -> Result<IoHandle<F::Output>, SubmitError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.submit_to(self.pick_shard(), class, request, fut)
    }

    /// [`submit`](Self::submit) to a given shard.
    pub fn submit_to<F>(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        fut: F,
    ) -> Result<IoHandle<F::Output>, SubmitError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        if self.shared.caller_dispatch && self.current_shard().is_none() {
            self.check(shard, class)?;
            let cost = self.shared.disk.cost(&request);
            if cost > self.shared.max_cost {
                return Err(self.too_large(&request, cost));
            }
            let now = self.shared.clock.now();
            if self.shared.try_fast(class.0, shard, cost, now) {
                let sizes = (cost, request.bytes());
                let tx = &self.senders[shard];
                return Ok(fast::dispatch(
                    &self.shared,
                    tx,
                    shard,
                    class.0,
                    sizes,
                    now,
                    fut,
                ));
            }
        }
        let (task, handle) = task::task(fut);
        self.submit_task_to(shard, class, request, task)?;
        Ok(handle)
    }

    fn submit_task_to(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        let cost = self.shared.disk.cost(&request);
        self.submit_costed_to(shard, class, request, cost, task)
    }

    /// [`submit`](Self::submit) of a task that delivers its own result (the disk module's
    /// operations, which need no future on the shard), for a request whose cost the caller
    /// has computed already ([`cost`](Self::cost) of `request`: the disk module checks it
    /// before it submits anything).
    #[cfg(test)]
    pub(crate) fn submit_costed(
        &self,
        class: ClassId,
        request: IoRequest,
        cost: u64,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        self.submit_costed_to(self.pick_shard(), class, request, cost, task)
    }

    pub(crate) fn submit_costed_to(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        cost: u64,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        debug_assert_eq!(cost, self.shared.disk.cost(&request));
        self.check(shard, class)?;
        if cost > self.shared.max_cost {
            return Err(self.too_large(&request, cost));
        }
        self.send(shard, class, cost, request.bytes(), task)
    }

    /// Submits a request that may be split: `make` is called once per piece (in order, at
    /// submission) with the byte range the piece covers, and its future runs once that piece's
    /// tokens are there. Each piece costs at most [`max_cost`](Self::max_cost).
    /// The handle resolves to the pieces' outputs in order.
    ///
    /// Pieces are as few as `max_cost` allows and about equal; each starts at a multiple of
    /// [`SPLIT_ALIGN`](super::SPLIT_ALIGN) (4 KiB) from the request's start and all but the last are a multiple of
    /// it long ([`max_piece`](Self::max_piece) is the longest), so that with an aligned offset
    /// and buffer every piece can be issued with `O_DIRECT`.
    ///
    /// A raw token cost ([`IoRequest::tokens`]) cannot be split, nor a request of which not
    /// even one 4 KiB block fits in `max_cost`: both are [`SubmitError::TooLarge`]. A request
    /// of more than [`MAX_SPLIT_PIECES`](super::MAX_SPLIT_PIECES) pieces is
    /// [`SubmitError::TooManyPieces`] (each piece is a task made at submission; nothing is
    /// allocated for such a request).
    pub fn submit_split<F, Fut>(
        &self,
        class: ClassId,
        request: IoRequest,
        make: F,
    ) -> Result<SplitHandle<Fut::Output>, SubmitError>
    where
        F: FnMut(Piece) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.submit_split_to(self.pick_shard(), class, request, make)
    }

    /// [`submit_split`](Self::submit_split) to a given shard.
    pub fn submit_split_to<F, Fut>(
        &self,
        shard: usize,
        class: ClassId,
        request: IoRequest,
        mut make: F,
    ) -> Result<SplitHandle<Fut::Output>, SubmitError>
    where
        F: FnMut(Piece) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.check(shard, class)?;
        let cost = self.shared.disk.cost(&request);
        let (split, max) = match request.kind() {
            _ if cost <= self.shared.max_cost => (cost::split(request.bytes(), u64::MAX), u64::MAX),
            None => return Err(self.too_large(&request, cost)),
            Some(kind) => match self.max_piece(kind) {
                Some(max) => (cost::split(request.bytes(), max), max),
                None => return Err(self.too_large(&request, cost)),
            },
        };
        let pieces = split.map_err(|pieces| SubmitError::TooManyPieces {
            pieces,
            max_pieces: cost::MAX_SPLIT_PIECES,
            max_bytes: max.saturating_mul(cost::MAX_SPLIT_PIECES),
        })?;
        let mut handles = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let bytes = piece.len();
            let piece_req = match request.kind() {
                Some(IoKind::Read) => IoRequest::read(bytes),
                Some(IoKind::Write) => IoRequest::write(bytes),
                None => request,
            };
            let piece_cost = self.shared.disk.cost(&piece_req);
            let (task, handle) = task::task(make(piece));
            self.send(shard, class, piece_cost, bytes, task)?;
            handles.push(handle);
        }
        Ok(SplitHandle::new(handles))
    }

    /// Whether [caller dispatch](DispatcherBuilder::caller_dispatch) is on for `ThrottledFile`
    /// pieces.
    pub(crate) fn caller_files(&self) -> bool {
        self.shared.caller_files
    }

    /// The tokens of a request of `class` costing `cost` (checked by the caller: at most
    /// [`max_cost`](Self::max_cost)) that goes at once from the caller's thread for `shard`
    /// ([`Shared::try_fast`]), its dispatch recorded; `None` when it must go through the shard
    /// (caller dispatch off, called on a shard, shut down, or it cannot go at once). The disk
    /// module issues such a request's operation on the caller's own ring and drops the permit
    /// when the kernel completes it.
    pub(crate) fn try_fast_costed(
        &self,
        shard: usize,
        class: ClassId,
        request: &IoRequest,
        cost: u64,
    ) -> Option<fast::FastDone> {
        if !self.shared.caller_files
            || self.current_shard().is_some()
            || self.check(shard, class).is_err()
            || cost > self.shared.max_cost
        {
            return None;
        }
        let now = self.shared.clock.now();
        self.shared.try_fast(class.0, shard, cost, now).then(|| {
            fast::FastDone::start(&self.shared, shard, class.0, (cost, request.bytes()), now)
        })
    }

    /// The calling thread's shard of this dispatcher and its running requests, for
    /// [`try_fast_here`](Self::try_fast_here): `None` off this dispatcher's shards, before the
    /// shard's loop started, and once a shutdown started there.
    pub(crate) fn shard_here(&self) -> Option<ShardHere> {
        spawn::inflight_here(self.id())
    }

    /// The tokens of a request of `class` costing `cost` (checked by the caller: at most
    /// [`max_cost`](Self::max_cost)) submitted by a task running on shard `here` (from
    /// [`shard_here`](Self::shard_here)), when it may go at once ([`Shared::try_fast`]: nothing of its class waits, its
    /// class is first among those waiting, its bound has room, the bucket holds its tokens):
    /// its dispatch recorded in the shard's stats and counted among the shard's running
    /// requests until the returned [`Completion`] is dropped. `None` with caller dispatch off
    /// or when it must queue. The disk
    /// module issues such a request's operation on the shard's ring from the submitting task
    /// itself: no message to the shard's loop, no task of its own.
    pub(crate) fn try_fast_here(
        &self,
        (shard, inflight): ShardHere,
        class: ClassId,
        request: &IoRequest,
        cost: u64,
    ) -> Option<Completion> {
        if !self.shared.caller_files || cost > self.shared.max_cost {
            return None;
        }
        self.check(shard, class).ok()?;
        let now = self.shared.clock.now();
        self.shared
            .try_fast(class.0, shard, cost, now)
            .then(|| Completion::start_here(inflight, class.0, (cost, request.bytes()), now))
    }

    fn check(&self, shard: usize, class: ClassId) -> Result<(), SubmitError> {
        // Acquire: pairs with the Release in `signal`; a submit that sees 0 may still race
        // with a shutdown, which the shard then handles (see `runner`).
        if self.shared.closed.load(Ordering::Acquire) != 0 {
            return Err(SubmitError::ShutDown);
        }
        if shard >= self.senders.len() {
            return Err(SubmitError::UnknownShard {
                shard,
                shards: self.senders.len(),
            });
        }
        if class.0 >= self.classes() {
            return Err(SubmitError::UnknownClass {
                class: class.0,
                classes: self.classes(),
            });
        }
        Ok(())
    }

    fn too_large(&self, request: &IoRequest, cost: u64) -> SubmitError {
        self.shared.too_large(request, cost)
    }

    /// One of `shards` in turn (the next of all shards when `shards` is empty).
    pub(crate) fn pick_among(&self, shards: &[usize]) -> usize {
        match shards.len() {
            0 => self.next_shard(),
            n => shards[self.turn(n)],
        }
    }

    /// The shard a request submitted now goes to: the calling shard, else the next in turn.
    pub(crate) fn pick_shard(&self) -> usize {
        self.current_shard().unwrap_or_else(|| self.next_shard())
    }

    /// The next shard in turn, for a caller that knows it is not on one.
    pub(crate) fn next_shard(&self) -> usize {
        self.turn(self.senders.len())
    }

    /// The next of `n > 0` choices in turn, shared by every caller.
    fn turn(&self, n: usize) -> usize {
        // Relaxed: a lone counter; any interleaving spreads the requests.
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        (k % n as u64) as usize
    }

    fn send(
        &self,
        shard: usize,
        class: ClassId,
        cost: u64,
        bytes: u64,
        task: BoxTask,
    ) -> Result<(), SubmitError> {
        let entry = Entry {
            class: class.0,
            cost,
            bytes,
            submitted: self.shared.clock.now(),
            payload: task,
        };
        // Waiting from now: a request of its class submitted after it does not overtake it
        // from its caller's thread (the shard uncounts it from the channel once queued).
        self.shared.classes.queued_add(class.0);
        self.senders[shard].send(Msg::Submit(entry)).map_err(|_| {
            self.shared.classes.queued_sub(class.0);
            SubmitError::ShutDown
        })
    }

    /// Runs a task of the engine's own on shard `shard`: `f` is sent there and called on the
    /// shard's thread, and the future it returns runs on the shard's `LocalSet`, beside the
    /// requests the shard dispatches, so it may be `!Send` (an `Rc`, a `RefCell`, a
    /// thread-local). As tokio-util's `LocalPoolHandle::spawn_pinned` and glommio's
    /// executors do.
    ///
    /// The task is not charged tokens (only the I/O it submits is). I/O it submits (through
    /// [`current_shard`](super::current_shard), or this dispatcher's `submit`) goes to its own
    /// shard's queue, dispatched on the same thread. A panic in `f` or in the future is caught
    /// and counted in [`panics`](Self::panics); the handle resolves to
    /// [`JoinError::Panicked`](crate::JoinError::Panicked) and the shard keeps running.
    ///
    /// **Shutdown cancels spawned tasks.** Any shutdown ([`shutdown`](Self::shutdown),
    /// [`shutdown_now`](Self::shutdown_now), the async and timed forms, a drop) drops every
    /// task still running on the shards as soon as each shard sees it (at the task's next
    /// await); their handles resolve to [`JoinError::Cancelled`](crate::JoinError::Cancelled).
    /// The requests they had submitted then follow the shutdown's mode: drained (`shutdown`)
    /// or failed (`shutdown_now`); a queued one whose handle the dropped task held is
    /// cancelled, and its tokens go back. So a shutdown never waits for a task that does not
    /// end on its own (a server loop); a task that must finish its work is awaited (its
    /// handle) before shutting down.
    pub fn spawn_on<F, Fut>(
        &self,
        shard: usize,
        f: F,
    ) -> Result<ShardJoinHandle<Fut::Output>, SpawnError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future + 'static,
        Fut::Output: Send + 'static,
    {
        // Acquire: pairs with the Release in `signal`.
        if self.shared.closed.load(Ordering::Acquire) != 0 {
            return Err(SpawnError::ShutDown);
        }
        let Some(tx) = self.senders.get(shard) else {
            return Err(SpawnError::UnknownShard {
                shard,
                shards: self.senders.len(),
            });
        };
        let (job, handle) = spawn::job(f, spawn::Live::new(self.shared.clone(), shard));
        tx.send(Msg::Spawn(job)).map_err(|_| SpawnError::ShutDown)?;
        Ok(handle)
    }

    /// [`spawn_on`](Self::spawn_on) the least loaded shard: the one with the fewest spawned
    /// tasks still running (a task counts from this call until it ends), ties going round-robin.
    pub fn spawn<F, Fut>(&self, f: F) -> Result<ShardJoinHandle<Fut::Output>, SpawnError>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future + 'static,
        Fut::Output: Send + 'static,
    {
        self.spawn_on(self.least_loaded(), f)
    }

    /// The shard with the fewest live spawned tasks, searched from the round-robin position.
    fn least_loaded(&self) -> usize {
        let n = self.senders.len();
        // Relaxed: a lone counter; any interleaving spreads the ties.
        let start = (self.next.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
        (0..n)
            .map(|i| (start + i) % n)
            // Relaxed: a load figure; a stale one only makes a less even choice.
            .min_by_key(|&s| self.shared.spawned[s].load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// A snapshot of the figures of every shard and class. After shutdown, the figures each
    /// shard had when it stopped.
    pub async fn stats(&self) -> DispatcherStats {
        let mut waiting = Vec::with_capacity(self.senders.len());
        for (i, tx) in self.senders.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            let sent = tx.send(Msg::Stats(StatsReply::Async(reply))).is_ok();
            waiting.push((i, sent.then_some(rx)));
        }
        let mut shards = Vec::with_capacity(waiting.len());
        for (i, rx) in waiting {
            let got = match rx {
                Some(rx) => rx.await.ok(),
                None => None,
            };
            shards.push(got.unwrap_or_else(|| self.final_stats(i)));
        }
        DispatcherStats::from_shards(shards)
    }

    /// [`stats`](Self::stats), blocking the calling thread (do not call it from a shard's
    /// future: the shard would wait for itself).
    pub fn stats_blocking(&self) -> DispatcherStats {
        let (reply, rx) = std::sync::mpsc::channel();
        let mut asked = vec![false; self.senders.len()];
        for (i, tx) in self.senders.iter().enumerate() {
            asked[i] = tx
                .send(Msg::Stats(StatsReply::Blocking(reply.clone())))
                .is_ok();
        }
        drop(reply);
        let mut shards: Vec<Option<ShardStats>> = vec![None; self.senders.len()];
        // Ends when every shard answered or dropped our request (it stopped).
        while let Ok(s) = rx.recv() {
            let i = s.shard;
            shards[i] = Some(s);
        }
        let shards = shards
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.unwrap_or_else(|| self.final_stats(i)))
            .collect();
        DispatcherStats::from_shards(shards)
    }

    fn final_stats(&self, shard: usize) -> ShardStats {
        let saved = self
            .shared
            .final_stats
            .lock()
            .ok()
            .and_then(|s| s[shard].clone());
        saved.unwrap_or_else(|| {
            let classes = self
                .shared
                .classes
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    stats::ClassRecorder::new().snapshot(
                        c.config.name(),
                        self.shared.classes.shares(i),
                        0,
                    )
                })
                .collect();
            ShardStats::new(&self.shared, shard, classes)
        })
    }

    /// User futures whose `poll` or `drop` panicked, and stop hooks
    /// ([`DispatcherBuilder::on_shard_stop`]) that panicked. Each panic was caught on its
    /// shard, which kept running; a panic in `poll` (or in `drop` after completing) reaches the
    /// request's handle as [`DispatchError::Panicked`](crate::DispatchError::Panicked);
    /// one in the `drop` of a cancelled request has no handle to reach and is only counted, as
    /// is a stop hook's.
    pub fn panics(&self) -> u64 {
        // Relaxed: a statistic; the shards add to it after each step.
        self.shared.panics.load(Ordering::Relaxed)
    }

    /// Stops taking requests, dispatches everything already queued (at the configured rate),
    /// waits for all futures to finish and joins the shard threads. Idempotent.
    ///
    /// **Blocks the calling thread** until the last running future ends. From async code,
    /// where a running future may wait for the very task that calls this (a deadlock), use
    /// [`shutdown_async`](Self::shutdown_async) or [`shutdown_timeout`](Self::shutdown_timeout).
    ///
    /// Called from one of this dispatcher's own shards it only starts the shutdown (a shard
    /// cannot join itself); the threads are joined when the dispatcher is dropped elsewhere.
    pub fn shutdown(&self) {
        // Joining cannot time out.
        let _ = self.stop(ShutdownMode::Drain, Wait::Join);
    }

    /// Stops taking requests, fails everything not yet dispatched with
    /// [`DispatchError::ShutDown`](crate::DispatchError::ShutDown) (their tokens go
    /// back), waits for the futures already running and joins the shard threads. Idempotent.
    ///
    /// **Blocks the calling thread** like [`shutdown`](Self::shutdown).
    pub fn shutdown_now(&self) {
        // Joining cannot time out.
        let _ = self.stop(ShutdownMode::Cancel, Wait::Join);
    }

    /// [`shutdown`](Self::shutdown), waiting at most `timeout` for the running futures. On
    /// time out the shards keep draining in the background (detached) and the error says how
    /// many still run; calling it again (or [`shutdown_async`](Self::shutdown_async)) waits
    /// more. Bounded, so safe to call from async code (it still blocks for up to `timeout`).
    pub fn shutdown_timeout(&self, timeout: Duration) -> Result<(), ShutdownError> {
        self.stop(ShutdownMode::Drain, Wait::Timeout(timeout))
    }

    /// [`shutdown`](Self::shutdown) for async code: the waiting is `.await`ed, never blocking
    /// the runtime's thread, so futures on the shards that wait for the caller's own tasks can
    /// finish. Cancelling it (dropping the future) leaves the shards draining in the
    /// background.
    pub async fn shutdown_async(&self) {
        self.signal(ShutdownMode::Drain);
        if self.current_shard().is_some() {
            return;
        }
        self.shared.exits.wait().await;
        self.join();
    }

    fn signal(&self, mode: ShutdownMode) {
        // Release: pairs with the Acquire in `check` and `Shared::admit`.
        self.shared.closed.store(1, Ordering::Release);
        for tx in &self.senders {
            let _ = tx.send(Msg::Shutdown(mode));
        }
    }

    fn stop(&self, mode: ShutdownMode, wait: Wait) -> Result<(), ShutdownError> {
        self.signal(mode);
        if self.current_shard().is_some() {
            return Ok(());
        }
        match wait {
            Wait::Join => {}
            Wait::Timeout(t) => {
                let running = self.shared.exits.wait_timeout(t);
                if running > 0 {
                    return Err(ShutdownError::TimedOut { running });
                }
            }
            Wait::Detach => return Ok(()),
        }
        self.join();
        Ok(())
    }

    /// Joins the shard threads and stops the timer thread.
    fn join(&self) {
        let threads = match self.threads.lock() {
            Ok(mut t) => std::mem::take(&mut *t),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a dispatcher shard thread panicked");
            }
        }
        let timer = match self.timer_thread.lock() {
            Ok(mut t) => t.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(mut t) = timer {
            t.stop(&self.timer);
        }
    }
}

/// A shard of a dispatcher that the calling thread runs, and its running requests
/// ([`Dispatcher::shard_here`]).
pub(crate) type ShardHere = (usize, std::rc::Rc<InFlight>);

/// How [`Dispatcher::stop`] waits for the shard threads.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// Until they end.
    Join,
    /// At most this long.
    Timeout(Duration),
    /// Not at all: they end on their own.
    Detach,
}

fn fine_thread_handle(t: &timer::TimerThread) -> std::thread::Thread {
    t.thread().clone()
}

impl Drop for Dispatcher {
    /// Shuts down like [`shutdown_now`](Dispatcher::shutdown_now). On a thread that runs a
    /// tokio runtime (async code) it does not wait: the running futures may need that very
    /// thread, so the shards finish them in the background and end on their own.
    fn drop(&mut self) {
        let wait = if tokio::runtime::Handle::try_current().is_ok() {
            Wait::Detach
        } else {
            Wait::Join
        };
        let _ = self.stop(ShutdownMode::Cancel, wait);
        // Dropped on one of its own shards: the threads could not be joined; at least let the
        // timer thread end (the shards fall back to tokio's timer).
        if let Ok(mut t) = self.timer_thread.lock() {
            if let Some(t) = t.take() {
                t.signal_stop(&self.timer);
            }
        }
    }
}
