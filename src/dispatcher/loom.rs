//! The loom build of the dispatcher (`--cfg iothrottle_loom`): only its atomic protocols, as
//! small cores that use the crate's `sync` shim, for the models in `loom-tests/`. The rest of
//! the dispatcher needs tokio's runtime and is not part of this build.

#[path = "alarm.rs"]
pub mod alarm;
#[path = "bound.rs"]
pub mod bound;
#[path = "fair.rs"]
pub mod fair;
