//! Priority classes and their fairness across shards: [`ClassConfig`], [`ClassId`], and the
//! shared per-class virtual time that every shard consults before it reserves tokens.
//!
//! Each class has a *virtual time* `V`: the tokens it was granted, divided by its shares
//! (scaled by [`SCALE`]). Within a shard the class with the least `V` goes next, as in Seastar.
//! Unlike Seastar, `V` is global: shards charge it with an atomic add when they reserve tokens
//! for a class, and a class may only reserve while its `V` is at most one reservation
//! (`window`) ahead of the slowest *backlogged* class, wherever that class lives. A class on
//! another shard with 5× the shares therefore gets 5× the tokens (Seastar: 1:1, seastar issues
//! #1083 and #1430).
//!
//! A class is backlogged while some shard has requests of it queued and not held back by its
//! bandwidth cap; a counter per class tracks on how many shards. When a class becomes backlogged
//! again its `V` is lifted to at least `min V - idle_credit` over the backlogged classes — or,
//! when none is backlogged at that instant (the other class runs at queue depth 1 and is between
//! two requests), over the *front*, the largest `V` any class reached — so an idle class cannot
//! bank more than a short window of credit.
//!
//! Within a class, each shard's reserved tokens are counted the same way (with a window of one
//! batch), so the shards of one class get equal tokens whatever their request sizes.
//!
//! # Orderings
//!
//! No data is published through these atomics; they are advisory counters that steer fairness
//! decisions, and a stale read only makes one decision slightly less fair (the next corrects
//! it). Still, following the crate's rule of starting strong: read-modify-writes (charges, the
//! backlog counts, the lifts and the fronts' wrapping max) are **AcqRel** (each counter has one
//! modification order, and an activation that reads `V` comes after the charges it saw), loads
//! are **Acquire**, and the per-shard backlog flags are plain **Release** stores. All are free
//! or nearly so on x86.
//! `V` wraps; every comparison is a wrapping signed difference (correct while two classes'
//! `V` are less than 2^63 apart, i.e. for centuries at 10^12 virtual units per second).

use std::fmt;

use crossbeam_utils::CachePadded;

use crate::bucket::{ahead, BucketConfig, Rate, SharedTokenBucket, Uncapped};
use crate::error::BuildError;
use crate::sync::{AtomicU64, Ordering};

use super::ArcClock;

/// Virtual-time units per token for a class of one share is `SCALE`: a class of `s` shares is
/// charged `tokens × SCALE / s`.
pub(crate) const SCALE: u64 = 1000;

/// Identifies a class of a dispatcher: the order in which it was added (0, 1, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub(crate) usize);

impl ClassId {
    /// The class's index (the order of [`add_class`](super::DispatcherBuilder::add_class)).
    pub fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for ClassId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "class#{}", self.0)
    }
}

/// A priority class: a name, shares in `1..=1000`, and an optional bandwidth cap.
///
/// ```
/// use iothrottle::dispatcher::ClassConfig;
///
/// let compaction = ClassConfig::new("compaction", 200).with_bandwidth_cap(50 << 20);
/// assert_eq!(compaction.shares(), 200);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClassConfig {
    name: String,
    shares: u32,
    bandwidth_cap: Option<u64>,
}

impl ClassConfig {
    /// The most shares a class can have.
    pub const MAX_SHARES: u32 = 1000;

    /// A class named `name` with `shares` (checked by the builder: `1..=1000`).
    pub fn new(name: impl Into<String>, shares: u32) -> Self {
        ClassConfig {
            name: name.into(),
            shares,
            bandwidth_cap: None,
        }
    }

    /// Caps the class at `bytes_per_second`, whatever its shares (a per-class token bucket of
    /// bytes, shared by all shards).
    pub fn with_bandwidth_cap(mut self, bytes_per_second: u64) -> Self {
        self.bandwidth_cap = Some(bytes_per_second);
        self
    }

    /// The class's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The class's shares.
    pub fn shares(&self) -> u32 {
        self.shares
    }

    /// The bandwidth cap, bytes per second.
    pub fn bandwidth_cap(&self) -> Option<u64> {
        self.bandwidth_cap
    }

    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        if !(1..=Self::MAX_SHARES).contains(&self.shares) {
            return Err(BuildError::SharesOutOfRange {
                class: self.name.clone(),
                shares: self.shares,
            });
        }
        if self.bandwidth_cap == Some(0) {
            return Err(BuildError::ZeroBandwidthCap {
                class: self.name.clone(),
            });
        }
        Ok(())
    }
}

/// One class's shared state.
pub(crate) struct ClassShared {
    pub(crate) config: ClassConfig,
    /// Virtual time: `Σ tokens × SCALE / shares`, wrapping. Charged by every shard.
    vtime: CachePadded<AtomicU64>,
    /// On how many shards the class is backlogged (queued and not held back by its cap).
    backlogged: CachePadded<AtomicU64>,
    /// Per shard: tokens reserved for this class (wrapping). Shards of one class are kept
    /// token-fair with these, as classes are share-fair with `vtime`.
    shard_tokens: Box<[CachePadded<AtomicU64>]>,
    /// Per shard: 1 while the class is backlogged there.
    shard_backlogged: Box<[CachePadded<AtomicU64>]>,
    /// The largest `shard_tokens` any shard reached when charged (wrapping max): a shard
    /// waking up when no other shard of the class is backlogged is lifted relative to this.
    shard_front: CachePadded<AtomicU64>,
    /// How far ahead of the class's slowest backlogged shard a shard may reserve (tokens).
    shard_window: u64,
    /// How far ahead of the slowest backlogged class this class may reserve (virtual units).
    window: u64,
    /// How much credit a class waking from idle keeps (virtual units).
    idle_credit: u64,
    /// The bandwidth cap: a bucket of bytes.
    pub(crate) cap: Option<SharedTokenBucket<Uncapped, ArcClock>>,
}

impl fmt::Debug for ClassShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClassShared")
            .field("config", &self.config)
            .field("vtime", &self.vtime())
            .finish_non_exhaustive()
    }
}

impl ClassShared {
    fn vtime(&self) -> u64 {
        // Acquire: see the module's `# Orderings`.
        self.vtime.load(Ordering::Acquire)
    }

    fn backlogged(&self) -> bool {
        // Acquire: see the module's `# Orderings`.
        self.backlogged.load(Ordering::Acquire) > 0
    }

    /// Held back by its bandwidth cap right now (its cap bucket owes bytes): such a class
    /// cannot use its share, so it must not hold the others back.
    fn cap_bound(&self) -> bool {
        self.cap.as_ref().is_some_and(|c| c.available() == 0)
    }

    /// Competes for fairness: backlogged and not bound by its cap.
    fn competing(&self) -> bool {
        self.backlogged() && !self.cap_bound()
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

/// All classes' shared state, and the fairness rules over it.
#[derive(Debug)]
pub(crate) struct Classes {
    classes: Box<[ClassShared]>,
    /// The front of virtual time: the largest `V` any class reached when charged (wrapping
    /// max). A class waking up when no other is backlogged (say, the other runs at queue depth
    /// 1 and is between requests) is lifted relative to this, so it cannot bank the time it
    /// was idle while the others worked.
    front: CachePadded<AtomicU64>,
}

/// Raises `cell` to `to` if `to` is ahead of it (wrapping).
fn raise(cell: &AtomicU64, to: u64) {
    // AcqRel on success / Acquire on failure: see the module's `# Orderings`.
    let _ = cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        (ahead(to, v) > 0).then_some(to)
    });
}

/// Why a class may not reserve now: how many tokens the slowest backlogged class must be granted
/// before it may (at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ahead {
    pub(crate) tokens: u64,
}

impl Classes {
    /// The classes, each allowed to run `window_tokens` (converted to its own virtual time)
    /// ahead of the slowest backlogged class, and to keep `idle_credit_tokens` of credit.
    pub(crate) fn new(
        configs: Vec<ClassConfig>,
        shards: usize,
        window_tokens: u64,
        idle_credit_tokens: u64,
        clock: &ArcClock,
    ) -> Result<Self, BuildError> {
        let mut classes = Vec::with_capacity(configs.len());
        for config in configs {
            config.validate()?;
            let cap = match config.bandwidth_cap {
                None => None,
                Some(bps) => {
                    // Burst: 100 ms of the cap; replenish in steps of 1 ms.
                    let limit = (bps / 10).max(1);
                    let threshold = (bps / 1000).clamp(1, limit);
                    let cfg =
                        BucketConfig::new(Rate::per_second(bps), limit).with_threshold(threshold);
                    Some(SharedTokenBucket::with_clock(cfg, clock.clone())?)
                }
            };
            let shares = config.shares as u64;
            let counters = || {
                (0..shards)
                    .map(|_| CachePadded::new(AtomicU64::new(0)))
                    .collect::<Box<[_]>>()
            };
            classes.push(ClassShared {
                config,
                vtime: CachePadded::new(AtomicU64::new(0)),
                backlogged: CachePadded::new(AtomicU64::new(0)),
                shard_tokens: counters(),
                shard_backlogged: counters(),
                shard_front: CachePadded::new(AtomicU64::new(0)),
                shard_window: window_tokens,
                window: virtual_of(window_tokens, shares),
                idle_credit: virtual_of(idle_credit_tokens, shares),
                cap,
            });
        }
        Ok(Classes {
            classes: classes.into_boxed_slice(),
            front: CachePadded::new(AtomicU64::new(0)),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.classes.len()
    }

    pub(crate) fn get(&self, class: usize) -> &ClassShared {
        &self.classes[class]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &ClassShared> {
        self.classes.iter()
    }

    /// The class's virtual time.
    pub(crate) fn vtime(&self, class: usize) -> u64 {
        self.classes[class].vtime()
    }

    /// Charges `tokens` reserved by `shard` for `class`.
    pub(crate) fn charge(&self, class: usize, shard: usize, tokens: u64) {
        let c = &self.classes[class];
        let dv = virtual_of(tokens, c.config.shares as u64);
        // AcqRel: see the module's `# Orderings`.
        let v = c.vtime.fetch_add(dv, Ordering::AcqRel).wrapping_add(dv);
        raise(&self.front, v);
        // AcqRel: see the module's `# Orderings`.
        let t = c.shard_tokens[shard]
            .fetch_add(tokens, Ordering::AcqRel)
            .wrapping_add(tokens);
        raise(&c.shard_front, t);
    }

    /// The least virtual time among backlogged classes other than `except`, if any.
    fn min_backlogged(&self, except: Option<usize>) -> Option<u64> {
        let mut min: Option<u64> = None;
        for (i, c) in self.classes.iter().enumerate() {
            if Some(i) == except || !c.competing() {
                continue;
            }
            let v = c.vtime();
            min = Some(match min {
                Some(m) if ahead(m, v) <= 0 => m,
                _ => v,
            });
        }
        min
    }

    /// `shard` has `class` backlogged. The shard's token count for the class is lifted to
    /// `min - window` over the class's other backlogged shards, and when it is the class's first
    /// backlogged shard, the class's virtual time is lifted to `min - idle_credit` over the other
    /// backlogged classes: no banking of idle time.
    pub(crate) fn activate(&self, class: usize, shard: usize) {
        let c = &self.classes[class];
        // Release: a plain flag; see the module's `# Orderings`.
        c.shard_backlogged[shard].store(1, Ordering::Release);
        // Acquire: see the module's `# Orderings`.
        let reference = c
            .slowest_other_shard(shard)
            .unwrap_or_else(|| c.shard_front.load(Ordering::Acquire));
        raise(
            &c.shard_tokens[shard],
            reference.wrapping_sub(c.shard_window),
        );
        // AcqRel: see the module's `# Orderings`.
        if c.backlogged.fetch_add(1, Ordering::AcqRel) != 0 {
            return;
        }
        // Acquire: see the module's `# Orderings`.
        let reference = self
            .min_backlogged(Some(class))
            .unwrap_or_else(|| self.front.load(Ordering::Acquire));
        raise(&c.vtime, reference.wrapping_sub(c.idle_credit));
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

    /// Whether `shard` may reserve for `class` now: the class's virtual time is at most its
    /// window ahead of the slowest competing class, and the shard's tokens for the class at
    /// most one window ahead of the class's slowest backlogged shard. Otherwise, how many
    /// tokens the slowest must get first.
    pub(crate) fn may_reserve(&self, class: usize, shard: usize) -> Result<(), Ahead> {
        let c = &self.classes[class];
        if let Some(min) = c.slowest_other_shard(shard) {
            let lead = ahead(c.shard_tokens(shard), min);
            if lead > c.shard_window as i64 {
                return Err(Ahead {
                    tokens: lead as u64 - c.shard_window,
                });
            }
        }
        let v = c.vtime();
        let mut worst: Option<(u64, u64)> = None; // (vtime, shares) of the slowest
        for (i, other) in self.classes.iter().enumerate() {
            if i == class || !other.competing() {
                continue;
            }
            let ov = other.vtime();
            if worst.is_none_or(|(w, _)| ahead(ov, w) < 0) {
                worst = Some((ov, other.config.shares as u64));
            }
        }
        let Some((min, min_shares)) = worst else {
            return Ok(());
        };
        let lead = ahead(v, min);
        if lead <= c.window as i64 {
            return Ok(());
        }
        let behind = (lead as u64) - c.window;
        // The slowest class catches up after `behind × shares / SCALE` tokens.
        let tokens = (behind as u128 * min_shares as u128).div_ceil(SCALE as u128);
        Err(Ahead {
            tokens: u64::try_from(tokens).unwrap_or(u64::MAX).max(1),
        })
    }
}

/// `tokens` in the virtual time of a class with `shares`.
fn virtual_of(tokens: u64, shares: u64) -> u64 {
    let v = tokens as u128 * SCALE as u128 / shares as u128;
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::sync::Arc;

    fn classes(shares: &[u32], window: u64, idle: u64) -> Classes {
        let clock: ArcClock = Arc::new(ManualClock::new());
        let cfgs = shares
            .iter()
            .enumerate()
            .map(|(i, s)| ClassConfig::new(format!("c{i}"), *s))
            .collect();
        Classes::new(cfgs, 2, window, idle, &clock).unwrap()
    }

    #[test]
    fn shares_are_checked() {
        let clock: ArcClock = Arc::new(ManualClock::new());
        for bad in [0, 1001] {
            let err = Classes::new(vec![ClassConfig::new("x", bad)], 1, 1, 1, &clock).unwrap_err();
            assert!(matches!(err, BuildError::SharesOutOfRange { shares, .. } if shares == bad));
        }
        let err = Classes::new(
            vec![ClassConfig::new("x", 1).with_bandwidth_cap(0)],
            1,
            1,
            1,
            &clock,
        )
        .unwrap_err();
        assert!(matches!(err, BuildError::ZeroBandwidthCap { .. }));
    }

    #[test]
    fn a_class_ahead_waits_for_the_slowest() {
        let c = classes(&[5, 1], 100, 100);
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
        let c = classes(&[1], 100, 100);
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
        assert_eq!(c.get(0).shard_tokens(0), 11_000 - 100);
        c.deactivate(0, 0);
        c.deactivate(0, 1);
    }

    #[test]
    fn an_idle_class_does_not_block_others_and_banks_little() {
        let c = classes(&[1, 1], 10, 10);
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
}
