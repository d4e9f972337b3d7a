//! [`FileCheckpoint`]: one bucket's snapshot in a local file, replaced atomically.
//!
//! # Orderings
//!
//! Two atomics, neither publishing data: the temp-file counter (`fetch_add(Relaxed)`, a lone
//! counter that just makes names unique) and the "stale temp files removed" flag (`Relaxed`:
//! removing them twice is harmless; the lock file orders the removal against saves).
//!
//! # Saves are totally ordered
//!
//! A save holds an exclusive `flock` on the lock file `.<name>.lock` (next to the checkpoint)
//! from reading the stored [`seq`](crate::checkpoint::Snapshot::seq) to the rename and the
//! directory fsync: a save whose `seq` is lower than the stored one is refused
//! ([`CheckpointError::Superseded`]) and never renamed over it. Every `FileCheckpoint` on the
//! same path, in this process or another, takes the same lock. (On non-Unix targets there is no
//! lock: saves there are ordered only by the [`Checkpointer`]'s own save lock.)
//!
//! [`Checkpointer`]: crate::checkpoint::Checkpointer
//!
//! # Temp files
//!
//! Each save writes `.<name>.<pid>-<n>.tmp`, created with `create_new` (never truncating
//! another writer's file). A temp file left by a killed save is removed by the first save or
//! load of a `FileCheckpoint` on that path (under the lock, when no save is in flight).
//!
//! # Format (version 2, 94 bytes, little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `b"IOTCKPT\0"` |
//! | 8 | 4 | format version (`2`) |
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
//! | 78 | 8 | save sequence number (`seq`) |
//! | 86 | 4 | padding (zero) |
//! | 90 | 4 | CRC-32 (IEEE) of bytes 0..90 |
//!
//! Version 1 (86 bytes) is the same up to offset 78, then 4 bytes of padding and the CRC-32 of
//! bytes 0..82; it loads with `seq` 0.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use crate::bucket::{BucketState, Rate};
use crate::checkpoint::{Checkpoint, Snapshot, FORMAT_VERSION};
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::CheckpointError;

const MAGIC: &[u8; 8] = b"IOTCKPT\0";
/// Size of a version-2 checkpoint file (the version this build writes).
pub(crate) const FILE_LEN: usize = 94;
/// Size of a version-1 checkpoint file (no `seq`).
pub(crate) const FILE_LEN_V1: usize = 86;

/// A bucket's snapshot in a local file: the embedded default store.
///
/// A save writes a temp file in the same directory, fsyncs it, renames it over the target and
/// fsyncs the directory: after a crash at any point the file holds the old snapshot or the new
/// one, whole. The format is versioned and checksummed (see the module docs). Saves are totally
/// ordered by [`Snapshot::seq`] under a file lock: a save never replaces a newer one, even when
/// it was started earlier and its write lands later (e.g. a cancelled save whose blocking write
/// still runs). A temp file left by a killed save is removed at the first save or load.
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
    /// Makes temp names unique (with the process id and `create_new`).
    tmp_seq: Arc<AtomicU64>,
    /// 1 once the stale temp files were removed.
    cleaned: Arc<AtomicU64>,
}

impl FileCheckpoint {
    /// A store at `path`. Nothing is touched until the first save or load.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileCheckpoint {
            path: Arc::new(path.into()),
            tmp_seq: Arc::new(AtomicU64::new(0)),
            cleaned: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory and the file name of the checkpoint.
    fn dir_and_name(&self) -> (PathBuf, String) {
        let path: &Path = &self.path;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "checkpoint".into());
        (dir, name)
    }

    /// Takes the exclusive lock of this path (released when the returned file is closed), and
    /// on the first call removes the temp files of killed saves: none is in flight while we
    /// hold the lock.
    fn lock(&self, dir: &Path, name: &str) -> Result<File, CheckpointError> {
        let lock_path = dir.join(format!(".{name}.lock"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io("open lock file", &lock_path))?;
        #[cfg(unix)]
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io("lock", &lock_path)(e.into()))?;
        // Relaxed: see the module's orderings.
        if self.cleaned.swap(1, Ordering::Relaxed) == 0 {
            remove_stale_temp_files(dir, name);
        }
        Ok(file)
    }

    /// Saves `snapshot` durably (blocking I/O: temp file, fsync, rename, fsync the directory),
    /// unless the file holds a snapshot with a higher [`seq`](Snapshot::seq):
    /// [`CheckpointError::Superseded`], and the file is left alone.
    pub fn save_blocking(&self, snapshot: &Snapshot) -> Result<(), CheckpointError> {
        let bytes = encode(snapshot);
        let path: &Path = &self.path;
        let (dir, name) = self.dir_and_name();
        // Held until the end of the save: read seq, compare, write, fsync, rename, fsync.
        let _lock = self.lock(&dir, &name)?;
        // A file that cannot be read or trusted is replaced, as if missing.
        if let Ok(Some(stored)) = self.read() {
            if stored.seq > snapshot.seq {
                return Err(CheckpointError::Superseded {
                    seq: snapshot.seq,
                    stored: stored.seq,
                });
            }
        }
        let (tmp, mut f) = self.create_temp(&dir, &name)?;
        let result = (|| {
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

    /// Creates a new temp file with a name no other writer uses (`create_new`: an existing file
    /// is never truncated; on a clash the next number is tried).
    fn create_temp(&self, dir: &Path, name: &str) -> Result<(PathBuf, File), CheckpointError> {
        let pid = std::process::id();
        loop {
            // Relaxed: only makes the temp name unique.
            let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!(".{name}.{pid}-{n}.tmp"));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => return Ok((tmp, f)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io("create temp file", &tmp)(e)),
            }
        }
    }

    /// Loads the snapshot: `Ok(None)` if the file does not exist (first start), an error if it
    /// cannot be read or trusted.
    pub fn load_blocking(&self) -> Result<Option<Snapshot>, CheckpointError> {
        // Relaxed: see the module's orderings.
        if self.cleaned.load(Ordering::Relaxed) == 0 {
            let (dir, name) = self.dir_and_name();
            // Only to remove stale temp files; a directory we cannot lock in is reported by
            // the read below or by the next save.
            drop(self.lock(&dir, &name));
        }
        self.read()
    }

    fn read(&self) -> Result<Option<Snapshot>, CheckpointError> {
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

/// An I/O error on `p` while doing `op`.
fn io(op: &'static str, p: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let p = p.to_path_buf();
    move |source| CheckpointError::Io {
        path: p,
        op,
        source,
    }
}

/// Whether `file` is a temp file of a save of checkpoint `name`: `.<name>.<digits>-<digits>.tmp`
/// (or `.<name>.<digits>.<digits>.tmp`, the names of earlier versions).
fn is_temp_of(file: &str, name: &str) -> bool {
    let Some(middle) = file
        .strip_prefix('.')
        .and_then(|f| f.strip_prefix(name))
        .and_then(|f| f.strip_prefix('.'))
        .and_then(|f| f.strip_suffix(".tmp"))
    else {
        return false;
    };
    let Some((a, b)) = middle.split_once(['-', '.']) else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    digits(a) && digits(b)
}

/// Removes the temp files that killed saves of checkpoint `name` left in `dir` (best effort:
/// a file that cannot be removed is logged and left).
fn remove_stale_temp_files(dir: &Path, name: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        if file.to_str().is_some_and(|f| is_temp_of(f, name)) {
            let p = entry.path();
            match fs::remove_file(&p) {
                Ok(()) => {
                    tracing::info!(path = %p.display(), "removed a stale checkpoint temp file")
                }
                Err(e) => tracing::warn!(path = %p.display(), error = %e,
                    "cannot remove a stale checkpoint temp file"),
            }
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

/// The version-2 bytes of `s`.
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
    b[78..86].copy_from_slice(&s.seq.to_le_bytes());
    let crc = crc32fast::hash(&b[..90]);
    b[90..94].copy_from_slice(&crc.to_le_bytes());
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
    let len = match version {
        1 => FILE_LEN_V1,
        FORMAT_VERSION => FILE_LEN,
        _ => {
            return Err(CheckpointError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            })
        }
    };
    if b.len() != len {
        return Err(CheckpointError::Truncated {
            len: b.len(),
            expected: len,
        });
    }
    let stored = u32::from_le_bytes(b[len - 4..len].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&b[..len - 4]);
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
        seq: if version == 1 { 0 } else { u(78) },
    };
    snapshot.validate()?;
    Ok(snapshot)
}
