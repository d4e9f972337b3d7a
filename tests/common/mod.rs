//! Helpers shared by the integration tests. Each test binary uses a part of them.
#![allow(dead_code, unreachable_pub)]

pub mod disk;
pub mod pg;
#[cfg(feature = "postgres")]
pub mod pg_children;
#[cfg(all(feature = "postgres", feature = "test-util"))]
pub mod pg_leased;
#[cfg(feature = "postgres")]
pub mod pg_reference;
#[cfg(feature = "postgres")]
pub mod pg_session;
pub mod polls;
#[cfg(feature = "rt")]
pub mod snapshot;
