//! [`Throttle::request`]: any cost, waited for piece by piece.

use crate::bucket::Mode;
use crate::clock::Clock;
use crate::throttle::Throttle;
use crate::AcquireError;

/// Tokens granted to an unfinished [`Throttle::request`] (uncapped mode): refunded if the
/// request is dropped or fails before its last piece.
struct Granted<'a, M: Mode, C: Clock> {
    throttle: &'a Throttle<M, C>,
    tokens: u64,
}

impl<M: Mode, C: Clock> Drop for Granted<'_, M, C> {
    fn drop(&mut self) {
        // Through the throttle: the waiters behind are woken for the tokens that came back.
        self.throttle.refund_unused(self.tokens);
    }
}

impl<M: Mode, C: Clock + 'static> Throttle<M, C> {
    /// Waits until `cost` tokens were granted, whatever the cost: RocksDB's
    /// `RateLimiter::Request`. A cost above the bucket's limit is split into pieces of at most
    /// the limit, each waited for in line; it never fails for its size (the strict
    /// [`acquire`](Self::acquire) refuses it with [`AcquireError::CostExceedsLimit`]).
    ///
    /// Returns no permit: the tokens are spent. In [`Capped`](crate::Capped) mode each piece
    /// counts as completed as soon as it is granted (a request larger than the limit could
    /// otherwise never get its last piece); use `acquire` to keep work in flight under the cap.
    ///
    /// Cancel-safe: dropping the future gives back the piece in line and, in uncapped mode,
    /// the pieces already granted (nothing moved for them). The only error is
    /// [`AcquireError::Closed`], with the same give-backs.
    ///
    /// ```
    /// use std::time::Duration;
    /// use iothrottle::{BucketConfig, Rate, Throttle, TokioClock, Uncapped};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let throttle: Throttle<Uncapped, TokioClock> =
    ///     Throttle::with_clock(BucketConfig::new(Rate::per_second(1_000), 100), TokioClock::new())?;
    /// let start = tokio::time::Instant::now();
    /// assert!(throttle.acquire(1_100).await.is_err()); // more than the bucket holds
    /// throttle.request(1_100).await?; // the full bucket, then 1,000 more tokens: 1 s
    /// assert_eq!(start.elapsed(), Duration::from_secs(1));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn request(&self, cost: u64) -> Result<(), AcquireError> {
        let bucket = self.bucket();
        let limit = bucket.limit();
        let mut granted = Granted {
            throttle: self,
            tokens: 0,
        };
        let mut left = cost;
        while left > 0 {
            let piece = left.min(limit);
            let tokens = self.acquire(piece).await?.into_tokens();
            if M::CAPPED {
                bucket.complete(tokens);
            } else {
                granted.tokens += tokens;
            }
            left -= piece;
        }
        // Done: the tokens are spent.
        granted.tokens = 0;
        Ok(())
    }
}
