//! The cross-shard fairness counters, [`Fairness`]: per class a virtual time, a backlog count,
//! per-shard token counts, and the rules every shard applies before it reserves tokens.
//!
//! This is the dispatcher's one cross-shard protocol besides the bucket. It uses only atomics
//! from `crate::sync`, so the loom build compiles it (without tokio) and the models in
//! `loom-tests/dispatcher_fair.rs` check it.
//!
//! Each class has a *virtual time* `V`: the tokens it was granted, divided by its shares
//! (scaled by [`SCALE`]). Within a shard the class with the least `V` goes next, as in Seastar.
//! Unlike Seastar, `V` is global: shards charge it with an atomic add when they reserve tokens
//! for a class, and a class may only reserve while its `V` is at most one reservation
//! (`window`) ahead of the slowest *competing* class of its tier, wherever that class lives.
//!
//! **Tiers.** A class is [`Priority::Normal`](super::Priority) or `High`. High classes are
//! compared only with each other; a normal class may not reserve while a high class competes
//! anywhere (it waits about one batch and re-checks).
//!
//! **Competing** means backlogged on some shard (requests queued) and not waiting for its
//! bandwidth cap on any shard.
//!
//! **No banking.** When a class becomes backlogged again its `V` is lifted to at least
//! `min V − idle_credit` over the competing classes of its tier — or, when none competes, over
//! the tier's *front* (the largest `V` any class of the tier reached).
//!
//! **Wrap safety.** `V` and the token counts are `u64` and wrap (a 1-share class at 10^9
//! tokens/s wraps `V` every ~213 days). Every comparison is a wrapping signed difference
//! ([`ahead`]), which is right while the two values are less than 2^63 apart. Nothing keeps an
//! idle class's `V` close to the others by itself, so the counters are *renormalised*: each
//! time a tier's front crosses a multiple of [`RENORM_STEP`] (2^60), the charging thread lifts
//! every class of the tier to at least `front − 2^61` (and likewise each shard's token count
//! relative to the class's shard front). A charge adds at most [`MAX_CHARGE`] (2^59), so
//! between two renormalisations no counter falls more than `2^61 + 2^60 + 2^59 < 2^62` behind
//! its front: the signed comparisons stay exact for the life of the process, however long.
//! A lift of `2^61` is far more than any real backlog (26 days of a 1-share class's disk time
//! at 10^9 tokens/s), so it never changes a decision.
//!
//! # Orderings
//!
//! No data is published through these atomics; they are advisory counters that steer fairness
//! decisions, and a stale read only makes one decision slightly less fair (the next corrects
//! it). Each counter has one modification order, and every update that must not lose another
//! (charges, lifts, fronts, backlog counts) is a read-modify-write. Following the crate's rule of
//! starting strong, read-modify-writes are **AcqRel**, loads are **Acquire**, and the per-shard
//! flags are **Release** stores; all are free or nearly so on x86. The loom models check the
//! counting (no charge lost to a concurrent lift, backlog counts back to 0, fronts monotone).

use crossbeam_utils::CachePadded;

use crate::bucket::ahead;
use crate::sync::{AtomicU64, Ordering};

/// Virtual-time units per token for a class of one share is `SCALE`: a class of `s` shares is
/// charged `tokens × SCALE / s`.
pub(crate) const SCALE: u64 = 1000;

/// Fronts crossing a multiple of this trigger a renormalisation of their tier (or class).
pub(crate) const RENORM_STEP: u64 = 1 << 60;

/// How far behind its front a counter is lifted by a renormalisation.
const RENORM_LAG: u64 = 1 << 61;

/// The most one charge adds to a virtual time or token count (a request costing more is
/// accounted as costing this much: 6.7 days of disk time at 10^9 tokens/s).
pub(crate) const MAX_CHARGE: u64 = 1 << 59;

/// The number of tiers (normal, high).
const TIERS: usize = 2;

/// Why a class may not reserve now: how many tokens the slowest competing class must be
/// granted before it may (at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ahead {
    /// Tokens the slowest competing class must be granted first.
    pub(crate) tokens: u64,
}

/// One class's counters.
#[derive(Debug)]
struct ClassCounters {
    /// The tier: 0 normal, 1 high.
    tier: usize,
    /// Current shares, `1..=1000` (changed at run time by `set_shares`).
    shares: AtomicU64,
    /// Virtual time: `Σ tokens × SCALE / shares`, wrapping, kept within 2^62 of the tier's
    /// front (see *Wrap safety*).
    vtime: CachePadded<AtomicU64>,
    /// On how many shards the class is backlogged.
    backlogged: CachePadded<AtomicU64>,
    /// On how many shards the class's head request waits for its bandwidth cap.
    cap_waiting: CachePadded<AtomicU64>,
    /// Per shard: tokens reserved for this class (wrapping, within 2^62 of `shard_front`).
    shard_tokens: Box<[CachePadded<AtomicU64>]>,
    /// Per shard: 1 while the class is backlogged there.
    shard_backlogged: Box<[CachePadded<AtomicU64>]>,
    /// The largest `shard_tokens` any shard reached when charged (wrapping max).
    shard_front: CachePadded<AtomicU64>,
}

impl ClassCounters {
    fn shares(&self) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.shares.load(Ordering::Acquire)
    }

    fn vtime(&self) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.vtime.load(Ordering::Acquire)
    }

    fn competing(&self) -> bool {
        // Acquire: see the module's `# Orderings`.
        self.backlogged.load(Ordering::Acquire) > 0 && self.cap_waiting.load(Ordering::Acquire) == 0
    }

    fn shard_tokens(&self, shard: usize) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.shard_tokens[shard].load(Ordering::Acquire)
    }

    fn shard_backlogged(&self, shard: usize) -> bool {
        // Acquire: see the module's `# Orderings`.
        self.shard_backlogged[shard].load(Ordering::Acquire) != 0
    }

    /// The least tokens among the other shards where the class is backlogged.
    fn slowest_other_shard(&self, shard: usize) -> Option<u64> {
        let mut min: Option<u64> = None;
        for s in 0..self.shard_tokens.len() {
            if s == shard || !self.shard_backlogged(s) {
                continue;
            }
            let t = self.shard_tokens(s);
            if min.is_none_or(|m| ahead(t, m) < 0) {
                min = Some(t);
            }
        }
        min
    }
}

/// Raises `cell` to `to` if `to` is ahead of it (wrapping); returns the value before.
pub(crate) fn raise(cell: &AtomicU64, to: u64) -> u64 {
    // AcqRel on success / Acquire on failure: see the module's `# Orderings`.
    match cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        (ahead(to, v) > 0).then_some(to)
    }) {
        Ok(v) | Err(v) => v,
    }
}

/// `true` when going from `before` to `after` crosses a multiple of [`RENORM_STEP`].
fn crosses(before: u64, after: u64) -> bool {
    before / RENORM_STEP != after / RENORM_STEP
}

/// `tokens` in the virtual time of a class with `shares`, at most [`MAX_CHARGE`].
pub(crate) fn virtual_of(tokens: u64, shares: u64) -> u64 {
    let v = match tokens.checked_mul(SCALE) {
        Some(t) => t / shares.max(1),
        None => u64::try_from(tokens as u128 * SCALE as u128 / shares.max(1) as u128)
            .unwrap_or(u64::MAX),
    };
    v.min(MAX_CHARGE)
}

/// The fairness counters of all classes of a dispatcher.
#[derive(Debug)]
pub(crate) struct Fairness {
    classes: Box<[ClassCounters]>,
    /// Per tier: the largest `V` any of its classes reached when charged (wrapping max).
    fronts: [CachePadded<AtomicU64>; TIERS],
    /// How far ahead of the slowest a class (in its own virtual time) or a shard may reserve,
    /// in tokens.
    window: u64,
    /// How much credit a class or shard waking from idle keeps, in tokens.
    idle_credit: u64,
}

impl Fairness {
    /// Counters for classes given as `(shares, high priority)`, on `shards` shards.
    pub(crate) fn new(
        classes: &[(u32, bool)],
        shards: usize,
        window: u64,
        idle_credit: u64,
    ) -> Self {
        let counters = || {
            (0..shards)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect::<Box<[_]>>()
        };
        Fairness {
            classes: classes
                .iter()
                .map(|&(shares, high)| ClassCounters {
                    tier: usize::from(high),
                    shares: AtomicU64::new(u64::from(shares)),
                    vtime: CachePadded::new(AtomicU64::new(0)),
                    backlogged: CachePadded::new(AtomicU64::new(0)),
                    cap_waiting: CachePadded::new(AtomicU64::new(0)),
                    shard_tokens: counters(),
                    shard_backlogged: counters(),
                    shard_front: CachePadded::new(AtomicU64::new(0)),
                })
                .collect(),
            fronts: std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0))),
            window,
            idle_credit,
        }
    }

    /// Tests: starts every counter at `origin` (e.g. just below a wrap).
    #[cfg(test)]
    pub(crate) fn start_at(&self, origin: u64) {
        for c in self.classes.iter() {
            c.vtime.store(origin, Ordering::Release);
            c.shard_front.store(origin, Ordering::Release);
            for t in c.shard_tokens.iter() {
                t.store(origin, Ordering::Release);
            }
        }
        for f in &self.fronts {
            f.store(origin, Ordering::Release);
        }
    }

    /// The class's current shares.
    pub(crate) fn shares(&self, class: usize) -> u64 {
        self.classes[class].shares()
    }

    /// Changes the class's shares: its later charges count at the new shares; its virtual
    /// time so far stays.
    pub(crate) fn set_shares(&self, class: usize, shares: u32) {
        // Release: see the module's `# Orderings`.
        self.classes[class]
            .shares
            .store(u64::from(shares), Ordering::Release);
    }

    /// `true` for a class of the high tier.
    pub(crate) fn is_high(&self, class: usize) -> bool {
        self.classes[class].tier == 1
    }

    /// The class's virtual time.
    pub(crate) fn vtime(&self, class: usize) -> u64 {
        self.classes[class].vtime()
    }

    /// The tier's front.
    pub(crate) fn front(&self, tier: usize) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.fronts[tier].load(Ordering::Acquire)
    }

    /// The class's token count on `shard`.
    #[cfg(test)]
    pub(crate) fn shard_tokens(&self, class: usize, shard: usize) -> u64 {
        self.classes[class].shard_tokens(shard)
    }

    /// On how many shards the class is backlogged.
    #[cfg(all(test, iothrottle_loom))]
    pub(crate) fn backlogged(&self, class: usize) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.classes[class].backlogged.load(Ordering::Acquire)
    }

    /// Charges `tokens` reserved by `shard` for `class`.
    pub(crate) fn charge(&self, class: usize, shard: usize, tokens: u64) {
        let c = &self.classes[class];
        let dv = virtual_of(tokens, c.shares());
        // AcqRel: see the module's `# Orderings`.
        let v = c.vtime.fetch_add(dv, Ordering::AcqRel).wrapping_add(dv);
        let before = raise(&self.fronts[c.tier], v);
        if ahead(v, before) > 0 && crosses(before, v) {
            self.renormalise_tier(c.tier, v);
        }
        let dt = tokens.min(MAX_CHARGE);
        // AcqRel: see the module's `# Orderings`.
        let t = c.shard_tokens[shard]
            .fetch_add(dt, Ordering::AcqRel)
            .wrapping_add(dt);
        let before = raise(&c.shard_front, t);
        if ahead(t, before) > 0 && crosses(before, t) {
            for s in c.shard_tokens.iter() {
                raise(s, t.wrapping_sub(RENORM_LAG));
            }
        }
    }

    /// Lifts every class of `tier` to at least `front − 2^61`.
    fn renormalise_tier(&self, tier: usize, front: u64) {
        let floor = front.wrapping_sub(RENORM_LAG);
        for c in self.classes.iter().filter(|c| c.tier == tier) {
            raise(&c.vtime, floor);
        }
    }

    /// The least virtual time among competing classes of `tier` other than `except`, and the
    /// shares of that class.
    fn slowest(&self, tier: usize, except: usize) -> Option<(u64, u64)> {
        let mut min: Option<(u64, u64)> = None;
        for (i, c) in self.classes.iter().enumerate() {
            if i == except || c.tier != tier || !c.competing() {
                continue;
            }
            let v = c.vtime();
            if min.is_none_or(|(m, _)| ahead(v, m) < 0) {
                min = Some((v, c.shares()));
            }
        }
        min
    }

    /// `shard` has `class` backlogged. The shard's token count for the class is lifted to
    /// `min − window` over the class's other backlogged shards, and when it is the class's
    /// first backlogged shard, the class's virtual time is lifted to `min − idle_credit` over
    /// the other competing classes of its tier (or the tier's front): no banking of idle time.
    pub(crate) fn activate(&self, class: usize, shard: usize) {
        let c = &self.classes[class];
        // Release: a plain flag; see the module's `# Orderings`.
        c.shard_backlogged[shard].store(1, Ordering::Release);
        // Acquire: see the module's `# Orderings`.
        let reference = c
            .slowest_other_shard(shard)
            .unwrap_or_else(|| c.shard_front.load(Ordering::Acquire));
        raise(&c.shard_tokens[shard], reference.wrapping_sub(self.window));
        // AcqRel: see the module's `# Orderings`.
        if c.backlogged.fetch_add(1, Ordering::AcqRel) != 0 {
            return;
        }
        let reference = self
            .slowest(c.tier, class)
            .map_or_else(|| self.front(c.tier), |(v, _)| v);
        raise(
            &c.vtime,
            reference.wrapping_sub(virtual_of(self.idle_credit, c.shares())),
        );
    }

    /// Whether a request of `class`, which is backlogged nowhere, may be dispatched at once
    /// from the caller's thread on behalf of `shard` ([`may_reserve`](Self::may_reserve)), after
    /// the lift a class gets when it becomes backlogged: its virtual time is raised to
    /// `min − idle_credit` over the competing classes of its tier (or the tier's front), so a
    /// class served without queueing banks no idle time either.
    pub(crate) fn may_go_now(&self, class: usize, shard: usize) -> Result<(), Ahead> {
        let c = &self.classes[class];
        let reference = self
            .slowest(c.tier, class)
            .map_or_else(|| self.front(c.tier), |(v, _)| v);
        raise(
            &c.vtime,
            reference.wrapping_sub(virtual_of(self.idle_credit, c.shares())),
        );
        self.may_reserve(class, shard)
    }

    /// Whether no other class of `class`'s tier for which `waiting` holds (it has requests
    /// queued) has a smaller virtual time: a shard would serve `class` no later than them, so a
    /// request of it dispatched from its caller overtakes nobody the shares put first.
    pub(crate) fn first_among(&self, class: usize, waiting: impl Fn(usize) -> bool) -> bool {
        let c = &self.classes[class];
        let v = c.vtime();
        self.classes
            .iter()
            .enumerate()
            .all(|(i, o)| i == class || o.tier != c.tier || !waiting(i) || ahead(v, o.vtime()) <= 0)
    }

    /// `shard` no longer has `class` backlogged.
    pub(crate) fn deactivate(&self, class: usize, shard: usize) {
        let c = &self.classes[class];
        // Release: a plain flag; see the module's `# Orderings`.
        c.shard_backlogged[shard].store(0, Ordering::Release);
        // AcqRel: see the module's `# Orderings`.
        let before = c.backlogged.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "deactivating a class that was not backlogged");
    }

    /// A shard's head request of `class` starts (`true`) or stops (`false`) waiting for the
    /// class's bandwidth cap; a class waiting for its cap does not compete.
    pub(crate) fn cap_waiting(&self, class: usize, waiting: bool) {
        let c = &self.classes[class].cap_waiting;
        // AcqRel: see the module's `# Orderings`.
        if waiting {
            c.fetch_add(1, Ordering::AcqRel);
        } else {
            c.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Whether `shard` may reserve for `class` now: no high class competes if `class` is
    /// normal, the class's virtual time is at most its window ahead of the slowest competing
    /// class of its tier, and the shard's tokens for the class at most one window ahead of the
    /// class's slowest backlogged shard. Otherwise, how many tokens the slowest must get first.
    pub(crate) fn may_reserve(&self, class: usize, shard: usize) -> Result<(), Ahead> {
        let c = &self.classes[class];
        if c.tier == 0 && self.classes.iter().any(|o| o.tier == 1 && o.competing()) {
            return Err(Ahead {
                tokens: self.window.max(1),
            });
        }
        if let Some(min) = c.slowest_other_shard(shard) {
            let lead = ahead(c.shard_tokens(shard), min);
            if lead > self.window as i64 {
                return Err(Ahead {
                    tokens: lead as u64 - self.window,
                });
            }
        }
        let Some((min, min_shares)) = self.slowest(c.tier, class) else {
            return Ok(());
        };
        let window = virtual_of(self.window, c.shares());
        let lead = ahead(c.vtime(), min);
        if lead <= window as i64 {
            return Ok(());
        }
        let behind = (lead as u64) - window;
        // The slowest class catches up after `behind × shares / SCALE` tokens.
        let tokens = (behind as u128 * min_shares as u128).div_ceil(SCALE as u128);
        Err(Ahead {
            tokens: u64::try_from(tokens).unwrap_or(u64::MAX).max(1),
        })
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;

    fn fair(shares: &[u32], window: u64, idle: u64) -> Fairness {
        let specs: Vec<_> = shares.iter().map(|&s| (s, false)).collect();
        Fairness::new(&specs, 2, window, idle)
    }

    #[test]
    fn a_class_ahead_waits_for_the_slowest() {
        let c = fair(&[5, 1], 100, 100);
        c.activate(0, 0);
        c.activate(1, 1);
        // Class 1 (1 share) takes 1000 tokens: V = 1_000_000, window = 100_000.
        c.charge(1, 1, 1000);
        let ahead = c.may_reserve(1, 1).unwrap_err();
        // Class 0 must catch up 900_000 virtual units at 5 shares: 4500 tokens.
        assert_eq!(ahead.tokens, 4500);
        assert_eq!(c.may_reserve(0, 0), Ok(()));
        c.charge(0, 0, 4500);
        assert_eq!(c.may_reserve(1, 1), Ok(()));
        c.deactivate(0, 0);
        c.deactivate(1, 1);
    }

    #[test]
    fn shards_of_one_class_are_token_fair() {
        let c = fair(&[1], 100, 100);
        c.activate(0, 0);
        c.activate(0, 1);
        c.charge(0, 1, 1000);
        assert_eq!(c.may_reserve(0, 1), Err(Ahead { tokens: 900 }));
        assert_eq!(c.may_reserve(0, 0), Ok(()));
        c.charge(0, 0, 900);
        assert_eq!(c.may_reserve(0, 1), Ok(()));
        // Shard 0 goes idle: shard 1 is alone and free.
        c.deactivate(0, 0);
        c.charge(0, 1, 10_000);
        assert_eq!(c.may_reserve(0, 1), Ok(()));
        // Back from idle, shard 0 is lifted to one window behind.
        c.activate(0, 0);
        assert_eq!(c.shard_tokens(0, 0), 11_000 - 100);
        c.deactivate(0, 0);
        c.deactivate(0, 1);
    }

    #[test]
    fn an_idle_class_does_not_block_others_and_banks_little() {
        let c = fair(&[1, 1], 10, 10);
        c.activate(0, 0);
        c.charge(0, 0, 1_000_000);
        // Class 1 idle: class 0 is alone.
        assert_eq!(c.may_reserve(0, 0), Ok(()));
        c.activate(1, 1);
        // Lifted to V0 - idle credit (10 tokens × 1000).
        assert_eq!(c.vtime(1), c.vtime(0) - 10_000);
        c.deactivate(1, 1);
        c.deactivate(0, 0);
    }

    #[test]
    fn a_class_waiting_for_its_cap_does_not_compete() {
        let c = fair(&[1, 1], 10, 10);
        c.activate(0, 0);
        c.activate(1, 1);
        c.charge(0, 0, 1_000_000);
        assert!(c.may_reserve(0, 0).is_err());
        c.cap_waiting(1, true);
        assert_eq!(c.may_reserve(0, 0), Ok(()));
        c.cap_waiting(1, false);
        assert!(c.may_reserve(0, 0).is_err());
        c.deactivate(0, 0);
        c.deactivate(1, 1);
    }

    #[test]
    fn a_high_class_holds_back_normal_ones_and_ignores_them() {
        let c = Fairness::new(&[(1000, false), (1, true)], 2, 10, 10);
        c.activate(0, 0);
        c.activate(1, 1);
        // The high class, though it has 1 share and a far larger V, may always go.
        c.charge(1, 1, 1_000_000);
        assert_eq!(c.may_reserve(1, 1), Ok(()));
        assert_eq!(c.may_reserve(0, 0), Err(Ahead { tokens: 10 }));
        c.deactivate(1, 1);
        assert_eq!(c.may_reserve(0, 0), Ok(()));
        c.deactivate(0, 0);
    }

    #[test]
    fn changed_shares_count_from_the_next_charge() {
        let c = fair(&[100, 100], 10, 10);
        c.charge(0, 0, 1000);
        assert_eq!(c.vtime(0), 10_000);
        c.set_shares(0, 1000);
        c.charge(0, 0, 1000);
        assert_eq!(c.vtime(0), 11_000);
        assert_eq!(c.shares(0), 1000);
    }

    /// Virtual time wraps after ~107 days (2^63 units; 1 share at 10^9 tokens/s); a class idle
    /// all along must not then look 2^63 *ahead* of the busy one (its lift on waking would be
    /// refused and it would starve). Virtual times stay within 2^62 of the front whatever the
    /// elapsed time.
    #[test]
    fn an_idle_class_is_not_starved_after_virtual_time_wraps() {
        let c = fair(&[1, 1], 250_000, 250_000);
        c.activate(0, 0);
        // 2^40 tokens per charge at 1 share: 2^50 virtual units; 2^14 charges per wrap.
        // Three full wraps of the busy class's V (centuries at 10^9 tokens/s); the other class
        // wakes after each three quarters of a wrap (2^63 and more behind: where wrapping would bite).
        let step = 1u64 << 40;
        for round in 0..4 {
            for _ in 0..(3 << 12) {
                c.charge(0, 0, step);
            }
            c.activate(1, 1);
            let lead = ahead(c.vtime(1), c.vtime(0));
            assert!(
                (-(virtual_of(250_000, 1) as i64)..=0).contains(&lead),
                "round {round}: the woken class is {lead} ahead of the busy one"
            );
            assert_eq!(c.may_reserve(1, 1), Ok(()), "round {round}");
            c.deactivate(1, 1);
        }
        c.deactivate(0, 0);
    }

    #[test]
    fn counters_stay_within_2_62_of_their_front() {
        let c = fair(&[1, 1000], 10, 10);
        for _ in 0..(1 << 15) {
            c.charge(0, 0, 1 << 40);
            for class in 0..2 {
                let lag = ahead(c.front(0), c.vtime(class));
                assert!((0..1 << 62).contains(&lag), "class {class} lags {lag}");
                let lag = ahead(c.shard_tokens(0, 0), c.shard_tokens(class, 1));
                if class == 0 {
                    assert!((0..1 << 62).contains(&lag), "shard lags {lag}");
                }
            }
        }
    }
}
