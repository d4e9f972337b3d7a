//! The bucket the checkpoint store tests save, and a snapshot of it.

use iothrottle::checkpoint::Snapshot;
use iothrottle::{BucketConfig, Rate, SharedTokenBucket};

/// 1,000 tokens a second, a limit of 500.
pub fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000), 500)
}

/// A snapshot of a full [`cfg`] bucket after `used` tokens were taken, at sequence `used + 7`.
pub fn snapshot_after(used: u64) -> Snapshot {
    let b: SharedTokenBucket = SharedTokenBucket::new(cfg()).unwrap();
    b.replenish();
    b.grab(used);
    Snapshot::of(&b, Some(used + 7))
}
