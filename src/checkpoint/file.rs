//! [`FileCheckpoint`]: one bucket's snapshot in a local file, replaced atomically.
//!
//! # Orderings
//!
//! The only atomic is the temp-file sequence number: `fetch_add(Relaxed)`, a lone counter that
//! just makes names unique.
//!
//! # Format (version 1, 86 bytes, little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `b"IOTCKPT\0"` |
//! | 8 | 4 | format version (`1`) |
//! | 12 | 8 | tail |
//! | 20 | 8 | head |
//! | 28 | 1 | has ceil (0/1) |
//! | 29 | 8 | ceil |
//! | 37 | 1 | has reservation mark (0/1) |
//! | 38 | 8 | reservation mark |
//! | 46 | 8 | wall time, ns since the Unix epoch |
//! | 54 | 8 | rate: tokens |
//! | 62 | 8 | rate: period in ns |
//! | 70 | 8 | limit |
//! | 78 | 4 | padding (zero) |
//! | 82 | 4 | CRC-32 (IEEE) of bytes 0..82 |

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use crate::bucket::{BucketState, Rate};
use crate::checkpoint::{Checkpoint, Snapshot, FORMAT_VERSION};
use crate::error::CheckpointError;
use crate::sync::{Arc, AtomicU64, Ordering};

const MAGIC: &[u8; 8] = b"IOTCKPT\0";
/// Size of a version-1 checkpoint file.
pub(crate) const FILE_LEN: usize = 86;

/// A bucket's snapshot in a local file: the embedded default store.
///
/// A save writes a temp file in the same directory, fsyncs it, renames it over the target and
/// fsyncs the directory: after a crash at any point the file holds the old snapshot or the new
/// one, whole. The format is versioned and checksummed (see the module docs).
///
/// A missing file is a first start (`load` returns `Ok(None)`); a corrupt, truncated or
/// foreign file is a typed [`CheckpointError`], never a guess. The documented fallback for such
/// a file is an empty bucket ([`CheckpointedBucket::restore_or_empty`]), never a full one.
///
/// [`CheckpointedBucket::restore_or_empty`]: crate::checkpoint::CheckpointedBucket::restore_or_empty
///
/// ```
/// use iothrottle::checkpoint::FileCheckpoint;
///
/// let dir = tempfile::tempdir()?;
/// let store = FileCheckpoint::new(dir.path().join("disk0.ckpt"));
/// assert!(store.load_blocking()?.is_none()); // first start
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct FileCheckpoint {
    path: Arc<PathBuf>,
    seq: Arc<AtomicU64>,
}

impl FileCheckpoint {
    /// A store at `path`. Nothing is touched until the first save or load.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileCheckpoint {
            path: Arc::new(path.into()),
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Saves `snapshot` durably (blocking I/O: temp file, fsync, rename, fsync the directory).
    pub fn save_blocking(&self, snapshot: &Snapshot) -> Result<(), CheckpointError> {
        let bytes = encode(snapshot);
        let path: &Path = &self.path;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "checkpoint".into());
        // Relaxed: only makes the temp name unique.
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
        let io = |op, p: &Path| {
            let p = p.to_path_buf();
            move |source| CheckpointError::Io {
                path: p,
                op,
                source,
            }
        };
        let result = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(io("create temp file", &tmp))?;
            f.write_all(&bytes).map_err(io("write", &tmp))?;
            f.sync_all().map_err(io("fsync", &tmp))?;
            drop(f);
            fs::rename(&tmp, path).map_err(io("rename", path))?;
            File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(io("fsync directory", &dir))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Loads the snapshot: `Ok(None)` if the file does not exist (first start), an error if it
    /// cannot be read or trusted.
    pub fn load_blocking(&self) -> Result<Option<Snapshot>, CheckpointError> {
        match fs::read(&*self.path) {
            Ok(bytes) => decode(&bytes).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CheckpointError::Io {
                path: self.path.to_path_buf(),
                op: "read",
                source,
            }),
        }
    }
}

impl Checkpoint for FileCheckpoint {
    async fn save(&self, snapshot: Snapshot) -> Result<(), CheckpointError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.save_blocking(&snapshot))
            .await
            .map_err(|_| CheckpointError::Stopped)?
    }

    async fn load(&self) -> Result<Option<Snapshot>, CheckpointError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.load_blocking())
            .await
            .map_err(|_| CheckpointError::Stopped)?
    }
}

/// The version-1 bytes of `s`.
pub(crate) fn encode(s: &Snapshot) -> [u8; FILE_LEN] {
    let mut b = [0u8; FILE_LEN];
    b[0..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..20].copy_from_slice(&s.state.tail.to_le_bytes());
    b[20..28].copy_from_slice(&s.state.head.to_le_bytes());
    b[28] = s.state.ceil.is_some() as u8;
    b[29..37].copy_from_slice(&s.state.ceil.unwrap_or(0).to_le_bytes());
    b[37] = s.reserved.is_some() as u8;
    b[38..46].copy_from_slice(&s.reserved.unwrap_or(0).to_le_bytes());
    b[46..54].copy_from_slice(&s.wall_nanos().to_le_bytes());
    b[54..62].copy_from_slice(&s.rate.tokens().to_le_bytes());
    let period = u64::try_from(s.rate.period().as_nanos()).unwrap_or(u64::MAX);
    b[62..70].copy_from_slice(&period.to_le_bytes());
    b[70..78].copy_from_slice(&s.limit.to_le_bytes());
    let crc = crc32fast::hash(&b[..82]);
    b[82..86].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes and checks a checkpoint file's bytes.
pub(crate) fn decode(b: &[u8]) -> Result<Snapshot, CheckpointError> {
    if b.len() < 12 {
        return Err(CheckpointError::Truncated {
            len: b.len(),
            expected: FILE_LEN,
        });
    }
    if &b[0..8] != MAGIC {
        return Err(CheckpointError::BadMagic);
    }
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(CheckpointError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if b.len() != FILE_LEN {
        return Err(CheckpointError::Truncated {
            len: b.len(),
            expected: FILE_LEN,
        });
    }
    let stored = u32::from_le_bytes(b[82..86].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&b[..82]);
    if stored != computed {
        return Err(CheckpointError::ChecksumMismatch { stored, computed });
    }
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let flag = |at: usize, v: u64| match b[at] {
        0 => Ok(None),
        1 => Ok(Some(v)),
        _ => Err(CheckpointError::InvalidSnapshot {
            reason: "a presence flag is neither 0 nor 1",
        }),
    };
    let snapshot = Snapshot {
        state: BucketState {
            tail: u(12),
            head: u(20),
            ceil: flag(28, u(29))?,
        },
        reserved: flag(37, u(38))?,
        wall: UNIX_EPOCH + Duration::from_nanos(u(46)),
        rate: Rate::new(u(54), Duration::from_nanos(u(62))),
        limit: u(70),
    };
    snapshot.validate()?;
    Ok(snapshot)
}
