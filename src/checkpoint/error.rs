//! The checkpoint stores' error.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

use crate::ConfigError;

/// A checkpoint that cannot be saved, loaded or restored.
///
/// Returned by the [`Checkpoint`](crate::checkpoint::Checkpoint) stores, by explicit saves of the
/// [`Checkpointer`](crate::checkpoint::Checkpointer) and by restores. A corrupt or truncated file
/// is never trusted: the documented fallback is an *empty* bucket
/// ([`restore_or_empty`](crate::checkpoint::CheckpointedBucket::restore_or_empty)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("checkpoint file {path}: {op} failed")]
    Io {
        /// The file (or directory) concerned.
        path: std::path::PathBuf,
        /// What was being done: "write", "fsync", "rename", ...
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter (or longer) than its format version says.
    #[error("checkpoint is truncated or has trailing bytes: {len} bytes, expected {expected}")]
    Truncated {
        /// Bytes found.
        len: usize,
        /// Bytes the format needs.
        expected: usize,
    },
    /// The file does not start with the checkpoint magic bytes: not a checkpoint.
    #[error("not an iothrottle checkpoint (bad magic bytes)")]
    BadMagic,
    /// A format version this build cannot read.
    #[error("checkpoint format version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
        /// The version this build reads and writes.
        supported: u32,
    },
    /// The checksum does not match the content: the file is corrupt.
    #[error("checkpoint checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The CRC-32 stored in the file.
        stored: u32,
        /// The CRC-32 of the content.
        computed: u32,
    },
    /// The content decodes but no bucket can be in that state.
    #[error("invalid checkpoint: {reason}")]
    InvalidSnapshot {
        /// Which rule the snapshot breaks.
        reason: &'static str,
    },
    /// The bucket configuration (or the restored state) is rejected by the bucket.
    #[error("cannot restore the bucket")]
    Config(#[from] ConfigError),
    /// The Postgres store failed (connection refused or dropped, SQL error).
    #[error("postgres checkpoint: {op} failed: {message}")]
    Postgres {
        /// What was being done: "connect", "create table", "upsert", "select".
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The connection string does not parse.
    #[error("invalid postgres connection string: {message}")]
    ConnectionString {
        /// The driver's message.
        message: String,
    },
    /// A bucket name that cannot be a row key (empty, longer than 200 bytes, or with a NUL
    /// character, which PostgreSQL `text` cannot store).
    #[error("invalid bucket name {name:?}: {reason}")]
    InvalidName {
        /// The name, as given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A checkpointer or durability setting that cannot work (a zero interval, a zero
    /// reservation, a back-off that shrinks).
    #[error("invalid checkpoint configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// The store holds a newer save: a save never replaces a higher
    /// [`seq`](crate::checkpoint::Snapshot::seq) (saves are totally ordered in the store).
    #[error("checkpoint save {seq} refused: the store already holds save {stored}")]
    Superseded {
        /// The refused save's sequence number.
        seq: u64,
        /// The stored snapshot's sequence number.
        stored: u64,
    },
    /// The background checkpointer has stopped (its task ended or panicked).
    #[error("the checkpointer has stopped")]
    Stopped,
}
