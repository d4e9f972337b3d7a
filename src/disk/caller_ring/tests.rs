//! Unit tests of the caller ring.
