//! The local side of leased mode: the key map, the fast and slow paths of a take, how a
//! lease is sized, background refills, eviction. [`PgLeasedLimiter`](super::PgLeasedLimiter)
//! describes the algorithm and the bound it keeps.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime};

use super::batch::Leaser;
use super::key::{KeyState, LeaseCtl};
use super::options::{Counters, DbTime, LeaseOptions};
use crate::clock::Clock;
use crate::pg::check_time;
use crate::sync::{Arc, Ordering};
use crate::PgLimitError;

/// What a detached lease found or did (see `Inner::lease_detached`).
pub(super) enum Leased {
    /// The key was closed (evicted or shut down): look it up again.
    Closed,
    /// Enough tokens were there already; no lease was taken.
    Ready,
    /// A lease was taken: this many tokens (0: none to be had, or trickling).
    Got(u64),
}

/// A leased limiter's state, shared with its key handles and background tasks.
#[derive(Debug)]
pub(super) struct Inner<C: Clock> {
    /// Takes the leases (and holds the strict limiter underneath).
    pub(super) leaser: Arc<Leaser>,
    pub(super) opts: LeaseOptions,
    pub(super) clock: C,
    pub(super) db_time: DbTime,
    pub(super) keys: RwLock<HashMap<String, Arc<KeyState>>>,
    /// Serialises inserts that may evict, so two of them do not both evict.
    pub(super) admit: Mutex<()>,
    pub(super) counters: Counters,
}

impl<C: Clock + Clone + std::fmt::Debug + 'static> Inner<C> {
    /// Takes `n` local tokens if they are there, and starts a background lease when few are
    /// left. No round trip, no lock. `Some(false)`: refused at once (trickling, nothing
    /// local); `None`: go to the slow path.
    pub(super) fn fast_take(
        self: &Arc<Self>,
        key: &str,
        ks: &Arc<KeyState>,
        n: u64,
    ) -> Option<bool> {
        let now = self.clock.now();
        ks.touch(now);
        if !ks.try_take(n) {
            // Relaxed: a hint (see the field).
            let until = ks.trickle_until.load(Ordering::Relaxed);
            return ((now.as_nanos() as u64) < until).then_some(false);
        }
        if ks.low() {
            self.refill_in_background(key, ks);
        }
        Some(true)
    }

    /// The slow path: lease under the key's mutex (or wait for the lease in flight), then
    /// try again. Returns the outcome and the key's current state (a new one if `ks` was
    /// evicted meanwhile).
    pub(super) async fn slow_take(
        self: &Arc<Self>,
        key: &str,
        mut ks: Arc<KeyState>,
        n: u64,
    ) -> Result<(bool, Arc<KeyState>), PgLimitError> {
        for _ in 0..4 {
            ks.touch(self.clock.now());
            if ks.try_take(n) {
                return Ok((true, ks));
            }
            let dry = self.clock.now().as_nanos() as u64 + 1;
            // Relaxed: an estimate (see the field); the first caller to find the key dry wins.
            let _ = ks
                .dry_since
                .compare_exchange(0, dry, Ordering::Relaxed, Ordering::Relaxed);
            let leased = match self.lease_detached(key, &ks, n).await? {
                Leased::Closed => {
                    ks = self.key_state(key).await; // evicted meanwhile: look the key up again
                    continue;
                }
                Leased::Ready => continue, // tokens were there: take them (or race again)
                Leased::Got(got) => got,
            };
            if ks.tokens.is_closed() {
                continue; // evicted during the lease (which gave its tokens back): look up again
            }
            if ks.try_take(n) {
                return Ok((true, ks));
            }
            if leased > 0 {
                continue; // other callers took this lease first
            }
            // Relaxed: statistics.
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            return Ok((false, ks));
        }
        // Relaxed: statistics.
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        Ok((false, ks))
    }

    /// Leases for `key` on a task of its own, under the key's mutex, and waits for it. The
    /// lease is never cancelled with its caller: a caller dropped mid-lease leaves the lease to
    /// finish and deposit its tokens (under the mutex, so `held ≤ max_lease` still holds and
    /// no tokens are taken from the row without landing in the key): a cancelled acquire never
    /// loses the tokens of its lease in flight.
    async fn lease_detached(
        self: &Arc<Self>,
        key: &str,
        ks: &Arc<KeyState>,
        n: u64,
    ) -> Result<Leased, PgLimitError> {
        let (me, ks, key) = (self.clone(), ks.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            let mut ctl = ks.ctl.lock().await;
            if ks.tokens.is_closed() {
                return Ok(Leased::Closed);
            }
            if ks.tokens.held() >= n {
                return Ok(Leased::Ready);
            }
            me.lease(&key, &ks, &mut ctl, n, true)
                .await
                .map(Leased::Got)
        });
        match task.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down: no lease.
            Err(_) => Ok(Leased::Got(0)),
        }
    }

    /// How long a key whose lease came back short waits before asking again: the trickle
    /// interval, or a quarter of `burst / rate` if sooner (waiting longer would let the
    /// global bucket overflow its burst and discard refill).
    fn trickle_every(&self) -> Duration {
        let burst_time = Duration::from_secs_f64(self.opts.burst as f64 / self.opts.rate as f64);
        self.opts.trickle_interval.min(burst_time / 4)
    }

    /// The time of a database statement: `None` for the server's clock.
    pub(super) fn at(&self) -> Result<Option<SystemTime>, PgLimitError> {
        match self.db_time {
            DbTime::Server => Ok(None),
            DbTime::Clock { origin } => {
                let at = origin
                    .checked_add(self.clock.now())
                    .ok_or(PgLimitError::TimeOutOfRange { at: origin })?;
                check_time(at)?;
                Ok(Some(at))
            }
        }
    }

    /// A lease covers the key's consumption for `lease_period`, or for twice the time a lease
    /// takes when that is longer: the next lease starts when half is left (the low-water
    /// line), so what is left must last a lease's round trip or the key runs dry and its row
    /// accumulates what the process could not lease in time. (A lease that waits longer than
    /// it takes to consume is also why the measured consumption lags the demand.)
    fn lease_size(&self, ctl: &LeaseCtl) -> u64 {
        let cover = self.opts.lease_period.max(ctl.latency_est * 2);
        let want = (ctl.rate_est * cover.as_secs_f64()).ceil();
        (want as u64).clamp(self.opts.min_lease, self.opts.max_lease)
    }

    /// The key's state, created (evicting if full) when missing.
    pub(super) async fn key_state(&self, key: &str) -> Arc<KeyState> {
        if let Some(k) = self.keys.read().expect("key map").get(key) {
            return k.clone();
        }
        let evicted = {
            let _one = self.admit.lock().expect("admit");
            if let Some(k) = self.keys.read().expect("key map").get(key) {
                return k.clone();
            }
            let mut keys = self.keys.write().expect("key map");
            let mut evicted = Vec::new();
            if keys.len() >= self.opts.max_keys {
                let now = self.clock.now().as_nanos() as u64;
                let idle = self.opts.idle_timeout.as_nanos() as u64;
                // Relaxed: estimates (see module doc).
                let idle_keys: Vec<String> = keys
                    .iter()
                    .filter(|(_, k)| {
                        now.saturating_sub(k.last_used.load(Ordering::Relaxed)) >= idle
                    })
                    .map(|(n, _)| n.clone())
                    .collect();
                for n in idle_keys {
                    evicted.extend(keys.remove(&n).map(|k| (n, k.tokens.close())));
                }
                if keys.len() >= self.opts.max_keys {
                    let lru = keys
                        .iter()
                        // Relaxed: an estimate (see module doc).
                        .min_by_key(|(_, k)| k.last_used.load(Ordering::Relaxed))
                        .map(|(n, _)| n.clone())
                        .expect("the map is full, so not empty");
                    evicted.extend(keys.remove(&lru).map(|k| (lru, k.tokens.close())));
                }
            }
            let ks = Arc::new(self.new_key_state());
            keys.insert(key.to_owned(), ks.clone());
            (ks, evicted)
        };
        let (ks, evicted) = evicted;
        // Relaxed: statistics.
        self.counters
            .evictions
            .fetch_add(evicted.len() as u64, Ordering::Relaxed);
        for (name, n) in evicted {
            if let Err(e) = self.give_back(&name, n).await {
                tracing::warn!(key = %name, error = %e, "giving back an evicted key's tokens failed");
            }
        }
        ks
    }

    fn new_key_state(&self) -> KeyState {
        KeyState::new(self.clock.now())
    }

    /// Takes a lease for `key` (the caller holds `ctl`); returns the tokens leased. `dry`:
    /// a caller found no local token, so the last lease was too small.
    async fn lease(
        self: &Arc<Self>,
        key: &str,
        ks: &KeyState,
        ctl: &mut LeaseCtl,
        at_least: u64,
        dry: bool,
    ) -> Result<u64, PgLimitError> {
        let now = self.clock.now();
        if let Some(t) = ctl.not_before {
            if now < t {
                return Ok(0); // trickling: the global bucket was empty a moment ago
            }
        }
        // Update the consumption estimate (tokens per second since the last lease landed),
        // over the time the key had tokens: up to when a caller found it dry, if one did.
        // At least 1 ms (so that a key that is hot from its first call ramps up within a
        // few leases instead of leasing min_lease per call until a millisecond has passed).
        // Relaxed: an estimate (see the field).
        let dry_at = ks.dry_since.load(Ordering::Relaxed);
        let active_until = match dry_at {
            0 => now,
            d => Duration::from_nanos(d - 1).min(now),
        };
        let elapsed = active_until
            .saturating_sub(ctl.sampled_at)
            .max(Duration::from_millis(1));
        let consumed = ctl.leased_total - ks.tokens.held().min(ctl.leased_total);
        if consumed > ctl.consumed_then || now >= ctl.sampled_at + Duration::from_millis(1) {
            let rate = (consumed - ctl.consumed_then) as f64 / elapsed.as_secs_f64();
            ctl.rate_est = if ctl.rate_est == 0.0 {
                rate
            } else {
                0.5 * ctl.rate_est + 0.5 * rate
            };
            ctl.sampled_at = now;
            ctl.consumed_then = consumed;
        }
        let room = ks.room(self.opts.max_lease);
        let mut want = self.lease_size(ctl).max(at_least);
        if dry && ctl.not_before.is_none() {
            // Running dry while the global bucket is not short: the consumption estimate is
            // held down by the leases themselves (a key cannot consume faster than it is
            // leased to), so grow geometrically, like a slow start.
            want = want.max(ctl.last_ask.saturating_mul(2));
        }
        if ctl.not_before.is_some() {
            // The last lease was short: the global bucket is the limit (other processes, or
            // demand above the rate). Ask for at most one asking interval of the global
            // rate: after a stall the row holds a lump, and a process that took it all would
            // hold what the others are waiting for (and give it back unspent at shutdown); a
            // remainder left in the row makes the next lease full, and full leases follow
            // each other without waiting.
            let every = self.trickle_every().max(ctl.latency_est);
            let share = (self.opts.rate as f64 * every.as_secs_f64()).ceil() as u64;
            want = want.min(share.max(self.opts.min_lease).max(at_least));
        }
        let ask = want.min(self.opts.max_lease).min(room);
        if ask == 0 {
            return Ok(0);
        }
        // Relaxed: statistics.
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        self.counters
            .largest_lease
            .fetch_max(ask, Ordering::Relaxed);
        let g = self.leaser.take(key, ask, self.at()?).await?;
        let landed = self.clock.now();
        let took = landed.saturating_sub(now);
        ctl.latency_est = if ctl.latency_est.is_zero() {
            took
        } else {
            (ctl.latency_est + took) / 2
        };
        let got = g.granted.max(0) as u64;
        if got > 0 {
            // Relaxed: statistics.
            self.counters.leased.fetch_add(got, Ordering::Relaxed);
            // Only this lease adds (the caller holds `ctl`) and takes only lower `held`, so
            // `held + got ≤ max_lease`.
            if let Err(back) = ks.tokens.deposit(got) {
                // The key was evicted meanwhile: these tokens were never usable here.
                self.give_back(key, back).await?;
                return Ok(0);
            }
            ctl.leased_total += got;
            // The estimate's next interval starts now, with tokens in hand.
            ctl.sampled_at = landed;
            ctl.consumed_then = ctl.leased_total - ks.tokens.held().min(ctl.leased_total);
            // Relaxed: an estimate (see the field).
            ks.dry_since.store(0, Ordering::Relaxed);
        }
        if got < ask {
            // Relaxed: statistics.
            self.counters.short_leases.fetch_add(1, Ordering::Relaxed);
            // Ask again when about a quarter of the burst has accrued, or after the trickle
            // interval if sooner: waiting longer would let the global bucket overflow its
            // burst and discard refill (the rate would not be held).
            let until = now + self.trickle_every();
            ctl.not_before = Some(until);
            // Relaxed: a hint for refusing without the mutex; the mutex-held copy decides.
            ks.trickle_until
                .store(until.as_nanos() as u64, Ordering::Relaxed);
        } else {
            ctl.not_before = None;
            // Relaxed: as above.
            ks.trickle_until.store(0, Ordering::Relaxed);
        }
        ctl.last_ask = ask;
        // Relaxed: an estimate read by the fast path.
        ks.low
            .store(ask.max(self.lease_size(ctl)) / 2, Ordering::Relaxed);
        Ok(got)
    }

    /// Leases for `key` on a background task, unless a refill is already running (which
    /// re-checks after it lets go of the flag, so this call's take is not forgotten).
    fn refill_in_background(self: &Arc<Self>, key: &str, ks: &Arc<KeyState>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !ks.refilling.claim() {
            return;
        }
        let (me, ks, key) = (self.clone(), ks.clone(), key.to_owned());
        /// Lets go of the flag if the refill task ends while holding it (its runtime shut
        /// down): otherwise no take could ever start a background refill of the key again.
        struct Holding(Arc<KeyState>, bool);
        impl Drop for Holding {
            fn drop(&mut self) {
                if self.1 {
                    self.0.refilling.release(|| false);
                }
            }
        }
        rt.spawn(async move {
            let mut holding = Holding(ks.clone(), true);
            loop {
                let mut ctl = ks.ctl.lock().await;
                let mut got = 0;
                if ks.low() {
                    match me.lease(&key, &ks, &mut ctl, 1, false).await {
                        Ok(n) => got = n,
                        Err(e) => {
                            tracing::debug!(key = %key, error = %e, "background lease failed")
                        }
                    }
                }
                drop(ctl);
                // A refill that got nothing (trickling, an error, closed) stops: the next take
                // that finds the key low claims the flag again.
                holding.1 = false;
                if !ks.refilling.release(|| got > 0 && ks.low()) {
                    break;
                }
                holding.1 = true; // claimed again by the re-check
            }
        });
    }

    /// Gives `n` tokens of `key` back to the database; returns `n`.
    pub(super) async fn give_back(&self, key: &str, n: u64) -> Result<u64, PgLimitError> {
        if n == 0 {
            return Ok(0);
        }
        self.leaser.give_back(key, n, self.at()?).await?;
        // Relaxed: statistics.
        self.counters.returned.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }
}
