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

    #[inline]
    pub(crate) fn replenish_at(&self, now: Duration) -> u64 {
        either!(self, b => b.replenish_at(now))
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
