//! The bucket all shards share, capped or not, behind one type so that the mode can be chosen
//! at run time (`--capped` in the demo).

use std::sync::Arc;
use std::time::Duration;

use crate::bucket::{Capped, SharedTokenBucket, Uncapped};

use super::ArcClock;

/// The shared bucket, in either mode. Behind an `Arc` so that a
/// [`Checkpointer`](crate::checkpoint::Checkpointer) can snapshot the bucket the shards grab
/// from ([`DispatcherBuilder::checkpoint`](super::DispatcherBuilder::checkpoint)).
#[derive(Debug, Clone)]
pub(crate) enum Budget {
    /// Tokens accrue at the rate, up to the limit.
    Uncapped(Arc<SharedTokenBucket<Uncapped, ArcClock>>),
    /// Capped release: completions ([`release`](Self::release)) also bound what accrues.
    Capped(Arc<SharedTokenBucket<Capped, ArcClock>>),
}

/// [`Budget::replenish_at`] in capped mode: one replenish, at a reading moved back so that it
/// adds what a replenish at `now` would add and leaves the rest of the time uncounted (kept).
fn replenish_under_ceil(b: &SharedTokenBucket<Capped, ArcClock>, now: Duration) -> u64 {
    let Some(last) = b.last_replenish() else {
        // The first replenish fills the bucket.
        return b.replenish_at(now);
    };
    if now <= last {
        return 0;
    }
    let rate = b.rate();
    let earned = u64::try_from(rate.tokens_in(now - last)).unwrap_or(u64::MAX);
    let s = b.snapshot();
    let limit = b.limit();
    let Some(ceil) = s.ceil else {
        // Not reached: a capped bucket has a ceil.
        return b.replenish_at(now);
    };
    // What a replenish at `now` adds: up to `ceil`, and never more than the limit in the bucket.
    let room = (ahead(ceil, s.head).max(0) as u64)
        .min(ahead(s.tail.wrapping_add(limit), s.head).max(0) as u64);
    let fill = earned.min(room);
    // The time kept and the tokens in the bucket after the fill are together at most the
    // limit's worth (what lies before is discarded, as an uncapped bucket discards what would
    // overfill it).
    let in_bucket = ahead(s.head.wrapping_add(fill), s.tail).max(0) as u64;
    let most = limit.saturating_sub(in_bucket);
    let keep = if fill == 0 {
        if earned <= most {
            // Nothing fits: all of the time is kept until completions move `ceil`.
            return 0;
        }
        most
    } else {
        // The replenish must still count at least the threshold, or it adds nothing (a room
        // smaller than the threshold then costs the difference).
        earned.saturating_sub(fill.max(b.threshold())).min(most)
    };
    // The time counted earns at least `earned - keep` (`duration_for` rounds up).
    let upto = last.saturating_add(rate.duration_for(earned - keep));
    b.replenish_at(now.min(upto))
}

/// How far `a` is in front of `b` (the rovers wrap).
fn ahead(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

macro_rules! either {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            Budget::Uncapped($b) => $e,
            Budget::Capped($b) => $e,
        }
    };
}

impl Budget {
    #[inline]
    pub(crate) fn grab(&self, n: u64) -> u64 {
        either!(self, b => b.grab(n))
    }

    #[inline]
    pub(crate) fn deficiency(&self, tail: u64) -> u64 {
        either!(self, b => b.deficiency(tail))
    }

    /// Tokens in the bucket now, 0 when reservations are owed tokens.
    #[inline]
    pub(crate) fn available(&self) -> u64 {
        either!(self, b => b.available())
    }

    /// Adds the tokens earned up to `now`; how many were added.
    ///
    /// Capped, the tokens that `ceil` holds back are not discarded: the replenish counts time
    /// only as far as its tokens fit under `ceil` (and is skipped when none fit), and the rest
    /// of the time keeps accruing, so that the tokens are there as soon as completions move
    /// `ceil`. The time kept so and the tokens in the bucket are together at most the limit's
    /// worth, as an uncapped bucket holds at most the limit: over any window the bucket still
    /// issues at most the rate's tokens plus the limit, and `head` never passes `ceil` (the
    /// disk time in flight stays within the limit). Discarding them instead lets every completion that comes back late (a shard
    /// woken late, a disk slower for a moment) cost the class that disk time for good.
    #[inline]
    pub(crate) fn replenish_at(&self, now: Duration) -> u64 {
        match self {
            Budget::Uncapped(b) => b.replenish_at(now),
            Budget::Capped(b) => replenish_under_ceil(b, now),
        }
    }

    pub(crate) fn refund(&self, n: u64) -> u64 {
        either!(self, b => b.refund(n))
    }

    pub(crate) fn duration_for(&self, n: u64) -> Duration {
        either!(self, b => b.duration_for(n))
    }

    pub(crate) fn threshold(&self) -> u64 {
        either!(self, b => b.threshold())
    }

    pub(crate) fn clock(&self) -> &ArcClock {
        either!(self, b => b.clock())
    }

    pub(crate) fn limit(&self) -> u64 {
        either!(self, b => b.limit())
    }

    /// Completed work: in capped mode `ceil` advances; nothing in uncapped mode.
    #[inline]
    pub(crate) fn release(&self, n: u64) {
        if let Budget::Capped(b) = self {
            b.release(n);
        }
    }

    pub(crate) fn snapshot(&self) -> crate::bucket::BucketState {
        either!(self, b => b.snapshot())
    }

    pub(crate) fn is_capped(&self) -> bool {
        matches!(self, Budget::Capped(_))
    }

    pub(crate) fn rate(&self) -> crate::bucket::Rate {
        either!(self, b => b.rate())
    }

    pub(crate) fn set_rate(&self, rate: crate::bucket::Rate) -> Result<(), crate::ConfigError> {
        either!(self, b => b.set_rate(rate))
    }
}

#[cfg(all(test, not(iothrottle_loom)))]
mod tests {
    use super::*;
    use crate::bucket::{BucketConfig, Rate};
    use crate::clock::ManualClock;

    const LIMIT: u64 = 1000;

    /// A capped budget of one token per nanosecond, a limit of 1,000, a threshold of 10.
    fn capped() -> Budget {
        let clock: ArcClock = Arc::new(ManualClock::new());
        let config = BucketConfig::new(Rate::per_second(1_000_000_000), LIMIT).with_threshold(10);
        Budget::Capped(Arc::new(
            SharedTokenBucket::with_clock(config, clock).unwrap(),
        ))
    }

    fn ns(n: u64) -> Duration {
        Duration::from_nanos(n)
    }

    #[test]
    fn tokens_held_back_by_ceil_are_there_when_completions_move_it() {
        let b = capped();
        assert_eq!(b.replenish_at(ns(1)), LIMIT);
        let tail = b.grab(LIMIT);
        assert_eq!(b.deficiency(tail), 0);
        // Everything is in flight: 500 ns pass with `head` at `ceil`.
        for t in (100..=500).step_by(100) {
            assert_eq!(b.replenish_at(ns(t)), 0);
        }
        // 400 tokens' worth completes: the 400 tokens earned meanwhile go in at once.
        b.release(400);
        assert_eq!(b.replenish_at(ns(500)), 400);
        // And the rest of the 499 ns earned since the first fill is still there for the next
        // completion: nothing earned while `ceil` held it back was discarded.
        b.release(400);
        assert_eq!(b.replenish_at(ns(500)), 99);
        assert_eq!(b.replenish_at(ns(800)), 300);
        assert_eq!(b.snapshot().head, LIMIT + 799);
    }

    #[test]
    fn time_kept_behind_ceil_never_lets_more_than_the_limit_through_at_once() {
        let b = capped();
        assert_eq!(b.replenish_at(ns(1)), LIMIT);
        b.grab(LIMIT);
        // A disk that stalls for a second, then completes everything at once, again and again:
        // what the bucket lets through at that instant is at most the limit, and from then on
        // at most the rate on top of it.
        for t in (1..=1000u64).map(|ms| ms * 1_000_000) {
            assert_eq!(b.replenish_at(ns(t)), 0);
        }
        let start = 1_000_000_000u64;
        let mut issued = 0;
        for step in 0..=1000u64 {
            let now = start + step * 7;
            for _ in 0..3 {
                // Whatever was let through completes at once and is claimed again.
                b.release(LIMIT);
                issued += b.replenish_at(ns(now));
                let available = b.available();
                b.grab(available);
                assert!(
                    issued <= LIMIT + (now - start),
                    "{issued} tokens through in {} ns",
                    now - start
                );
            }
        }
        // Completions were never short: the bucket kept the rate.
        assert!(issued >= 7 * 1000, "{issued}");
    }

    #[test]
    fn tokens_left_in_the_bucket_count_against_the_time_kept() {
        let b = capped();
        // A full bucket nobody claims: `head` is at `ceil`, and a second passes.
        assert_eq!(b.replenish_at(ns(1)), LIMIT);
        assert_eq!(b.replenish_at(ns(1_000_000_000)), 0);
        // Claimed and completed at once, again and again at that instant: the bucket's
        // content went through, and nothing more (it held the limit already).
        let mut through = 0;
        for _ in 0..3 {
            let available = b.available();
            b.grab(available);
            through += available;
            b.release(available);
            b.replenish_at(ns(1_000_000_000));
        }
        assert_eq!(through, LIMIT);
    }
}
