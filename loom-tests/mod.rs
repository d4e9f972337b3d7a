//! Loom models of the crate's atomic protocols, one submodule per protocol: the bucket's (and
//! its replenish's price cache, `price_cache`), the bucket's deferred give-backs
//! (`throttle_deferred`), the strict checkpoint's mark/request protocol (`checkpoint_mark`),
//! the dispatcher's fairness counters and fine timer (`dispatcher_*`).
//!
//! The models are compiled inside the crate (`src/lib.rs` declares this directory as the private
//! module `loom_tests` under `cfg(all(test, iothrottle_loom))`), so they reach the crate's
//! internals through `pub(crate)` items and nothing is made public for them. Run with
//!
//! ```text
//! RUSTFLAGS="--cfg iothrottle_loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
//!   cargo test --release --lib loom_tests
//! ```
//!
//! (the separate `CARGO_TARGET_DIR` keeps the normal build intact).
//!
//! Each model runs the real `SharedTokenBucket` (its atomics come from `crate::sync`, which is
//! loom's under `cfg(iothrottle_loom)`) with at most three threads, the main thread included.
//! Invariants are checked inside the threads while the others run, and exact results after
//! the joins.
//!
//! Four crate-private hooks exist only in this build: `loom_claim_at` and `loom_fill` (the two
//! halves of a replenish, so that a model can stall a replenisher between its CAS on the
//! replenish time and its `head` update), `loom_set_rate_at` (a rate change at a given time,
//! returning what it added when it closed the old rate's interval) and
//! `loom_set_rate_stopping_at` (a rate change whose thread stops for ever at a given step, as
//! a killed process would).
//!
//! A note on `snapshot()`: it reads `tail` before `head`, so a snapshot taken while grabbers run
//! may show `head > tail + limit` (tail read, then a grab and a replenish). The sound in-thread
//! check is `s1.head ≤ s2.tail + limit` with `s2` taken after `s1`, which `common::check_bounds`
//! does.

mod common;

mod capped;
mod checkpoint_mark;
mod dispatcher_bound;
mod dispatcher_fair;
mod dispatcher_timer;
mod fresh;
mod grab;
mod leased;
mod mixed;
mod price_cache;
mod rate;
mod rate_crash;
mod replenish;
mod throttle_deferred;
