//! The bucket in a file mapped `MAP_SHARED`: [`SharedTokenBucket::open`] and [`ShmError`](crate::ShmError).
//!
//! The rovers and the rate regime are atomics and integers fixed at creation (`#[repr(C)]`,
//! see `rovers`), and every protocol on them is lock-free, so they work across processes
//! exactly as across threads: a process killed at any instruction leaves nobody waiting.
//!
//! # File layout (version 1)
//!
//! | offset | what |
//! |---|---|
//! | 0 | magic `IOTHRBKT` |
//! | 8 | layout version (`u32`, little-endian like every field below) |
//! | 12 | mode: 0 uncapped, 1 capped (`u32`) |
//! | 16 | size of the state (`u64`), then its offset (`u64`, [`STATE_OFFSET`]) |
//! | 32 | the creator's configuration: limit, threshold, rate tokens, rate period in ns (`u64`s) |
//! | 64 | clock: 1 = `CLOCK_MONOTONIC` (`u64`), then the boot id (16 bytes) |
//! | 256 | the state: the rovers, each written rover on its own cache line, and the regime |
//!
//! # Creation without a race
//!
//! The creator writes the whole file under a temporary name in the same directory, then
//! hard-links it to the path: `link` fails if the path exists, so exactly one creator wins
//! and nobody ever maps a half-written bucket. The losers (and later processes) attach.
//!
//! # `unsafe`
//!
//! Two places: the mapping itself (memmap2's `map_raw` is `unsafe` because another process
//! may change the file), and viewing the state bytes as the rovers' atomics. The header is
//! copied out through a raw pointer, never borrowed as a slice, since other processes write
//! the state next to it.

use std::fs::{File, OpenOptions};
use std::io;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use super::error::ShmError;
use crate::bucket::mode::Mode;
use crate::bucket::rate::RawRate;
use crate::bucket::rovers::Rovers;
use crate::bucket::BucketConfig;

/// The file's magic bytes.
const MAGIC: [u8; 8] = *b"IOTHRBKT";
/// The layout version this build reads and writes.
pub(crate) const LAYOUT_VERSION: u32 = 1;
/// Where the state starts (a multiple of every cache-line alignment in use).
pub(crate) const STATE_OFFSET: usize = 256;
/// Bytes of the header that carry fields.
const HEADER_LEN: usize = 96;
/// The clock code for `CLOCK_MONOTONIC` in nanoseconds.
const CLOCK_MONOTONIC_NS: u64 = 1;

/// The rovers in a mapped file; the mapping lives as long as this.
pub(crate) struct Mapped<M: Mode> {
    map: MmapRaw,
    path: PathBuf,
    _mode: PhantomData<M>,
}

impl<M: Mode> std::fmt::Debug for Mapped<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapped").field("path", &self.path).finish()
    }
}

impl<M: Mode> Mapped<M> {
    /// The rovers in the mapping.
    #[inline]
    pub(crate) fn rovers(&self) -> &Rovers<M> {
        // SAFETY: `map` is at least STATE_OFFSET + size_of::<Rovers<M>>() bytes (checked when
        // it was created or attached), page-aligned, so the state at STATE_OFFSET is aligned
        // for `Rovers<M>` (checked in `file_len`). Those bytes hold a `Rovers<M>`: written by
        // `create` before the file appeared at its path, or checked by `attach` to carry this
        // build's layout. `Rovers<M>` is `#[repr(C)]` and made of atomics (same layout as
        // `u64`) and integers written once at creation, so other processes changing the
        // atomics concurrently is what atomics are for, and a shared reference is sound. The
        // mapping stays alive while `self` is borrowed.
        unsafe { &*(self.map.as_ptr().add(STATE_OFFSET) as *const Rovers<M>) }
    }

    /// The file the bucket lives in.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// The length of a bucket file for mode `M`.
fn file_len<M: Mode>() -> usize {
    const { assert!(STATE_OFFSET >= HEADER_LEN) };
    assert!(STATE_OFFSET.is_multiple_of(align_of::<Rovers<M>>()));
    STATE_OFFSET + size_of::<Rovers<M>>()
}

/// The header this build writes for `config`.
fn header<M: Mode>(config: &BucketConfig, rate: RawRate, boot: [u8; 16]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(M::CAPPED as u32).to_le_bytes());
    h[16..24].copy_from_slice(&(size_of::<Rovers<M>>() as u64).to_le_bytes());
    h[24..32].copy_from_slice(&(STATE_OFFSET as u64).to_le_bytes());
    h[32..40].copy_from_slice(&config.limit().to_le_bytes());
    h[40..48].copy_from_slice(&config.threshold().to_le_bytes());
    h[48..56].copy_from_slice(&rate.tokens.to_le_bytes());
    h[56..64].copy_from_slice(&rate.period_ns.to_le_bytes());
    h[64..72].copy_from_slice(&CLOCK_MONOTONIC_NS.to_le_bytes());
    h[72..88].copy_from_slice(&boot);
    h
}

fn u32_at(h: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(h: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"))
}

/// This boot's id (Linux: `/proc/sys/kernel/random/boot_id`), zeros where there is none.
fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("0");
            id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
    }
    id
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ShmError + 'a {
    move |source| ShmError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn map(file: &File, len: usize, path: &Path) -> Result<MmapRaw, ShmError> {
    // memmap2's `map_raw` is safe to call: it hands out a raw pointer, and every access
    // through it is ours to justify (see `Mapped::rovers` and `read_header`).
    MmapOptions::new()
        .len(len)
        .map_raw(file)
        .map_err(io_err("map", path))
}

/// Copies the header out of the mapping.
fn read_header(map: &MmapRaw) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    // SAFETY: the mapping is at least HEADER_LEN bytes (the caller checked the file length
    // and mapped that much); the header is written once, before the file appears at its path,
    // and never after, so nobody writes these bytes while we copy them. A raw copy, so no
    // reference to shared memory is formed.
    unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), h.as_mut_ptr(), HEADER_LEN) };
    h
}

/// Opens the bucket at `path`, creating it (as `Rovers::new(…, now)`) if it does not exist.
pub(crate) fn open<M: Mode>(
    path: &Path,
    config: &BucketConfig,
    now: u64,
) -> Result<Mapped<M>, ShmError> {
    config.validate()?;
    let rate = config.rate().raw()?;
    loop {
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => return attach(file, path, config, rate),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("open", path)(e)),
        }
        if let Some(mapped) = create::<M>(path, config, rate, now)? {
            return Ok(mapped);
        }
        // Another process linked its bucket first: attach to it.
    }
}

/// Writes a new bucket under a temporary name and links it to `path`. `None` if `path`
/// appeared meanwhile.
fn create<M: Mode>(
    path: &Path,
    config: &BucketConfig,
    rate: RawRate,
    now: u64,
) -> Result<Option<Mapped<M>>, ShmError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "bucket".into(), |n| n.to_string_lossy().into_owned());
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".{name}.{}.{stamp}.tmp", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    let result = (|| {
        let len = file_len::<M>();
        file.set_len(len as u64).map_err(io_err("size", &tmp))?;
        let map = map(&file, len, &tmp)?;
        let h = header::<M>(config, rate, boot_id());
        let rovers = Rovers::<M>::new(rate, config.limit(), config.threshold(), 0, now);
        // SAFETY: the mapping is `len` bytes, fresh, page-aligned and private to us until the
        // link below publishes the file: nobody else reads or writes it. The header fits
        // before STATE_OFFSET, and the state at STATE_OFFSET is aligned and sized for
        // `Rovers<M>` (`file_len`).
        unsafe {
            std::ptr::copy_nonoverlapping(h.as_ptr(), map.as_mut_ptr(), HEADER_LEN);
            std::ptr::write(map.as_mut_ptr().add(STATE_OFFSET) as *mut Rovers<M>, rovers);
        }
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(Some(Mapped {
                map,
                path: path.to_owned(),
                _mode: PhantomData,
            })),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(io_err("link", path)(e)),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Maps an existing file and checks it is a bucket this build can share with `config`.
fn attach<M: Mode>(
    file: File,
    path: &Path,
    config: &BucketConfig,
    rate: RawRate,
) -> Result<Mapped<M>, ShmError> {
    let len = file.metadata().map_err(io_err("stat", path))?.len();
    let at = || path.to_owned();
    if len < 8 {
        return Err(ShmError::NotABucket { path: at() });
    }
    let need = file_len::<M>() as u64;
    let map = map(&file, (len.min(need) as usize).max(8), path)?;
    let mut magic = [0u8; 8];
    // SAFETY: the mapping is at least 8 bytes; the magic is written before the file appears
    // at its path and never after. A raw copy.
    unsafe { std::ptr::copy_nonoverlapping(map.as_ptr(), magic.as_mut_ptr(), 8) };
    if magic != MAGIC {
        return Err(ShmError::NotABucket { path: at() });
    }
    if len < HEADER_LEN as u64 {
        return Err(ShmError::Truncated {
            path: at(),
            len,
            need,
        });
    }
    let h = read_header(&map);
    let version = u32_at(&h, 8);
    if version != LAYOUT_VERSION {
        return Err(ShmError::Version {
            path: at(),
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let mode = |capped: bool| if capped { "capped" } else { "uncapped" }.to_owned();
    let capped = u32_at(&h, 12);
    if capped != M::CAPPED as u32 {
        return Err(ShmError::Incompatible {
            path: at(),
            setting: "mode",
            ours: mode(M::CAPPED),
            theirs: mode(capped == 1),
        });
    }
    let (size, offset) = (u64_at(&h, 16), u64_at(&h, 24));
    if size != size_of::<Rovers<M>>() as u64 || offset != STATE_OFFSET as u64 {
        return Err(ShmError::Layout {
            path: at(),
            found_size: size,
            found_offset: offset,
            expected_size: size_of::<Rovers<M>>() as u64,
            expected_offset: STATE_OFFSET as u64,
        });
    }
    if len < need {
        return Err(ShmError::Truncated {
            path: at(),
            len,
            need,
        });
    }
    if u64_at(&h, 64) != CLOCK_MONOTONIC_NS || h[72..88] != boot_id() {
        return Err(ShmError::OtherBoot { path: at() });
    }
    let differs = |setting, ours: String, theirs: String| ShmError::Incompatible {
        path: at(),
        setting,
        ours,
        theirs,
    };
    if u64_at(&h, 32) != config.limit() {
        return Err(differs(
            "limit",
            config.limit().to_string(),
            u64_at(&h, 32).to_string(),
        ));
    }
    if u64_at(&h, 40) != config.threshold() {
        return Err(differs(
            "threshold",
            config.threshold().to_string(),
            u64_at(&h, 40).to_string(),
        ));
    }
    let theirs = RawRate {
        tokens: u64_at(&h, 48),
        period_ns: u64_at(&h, 56),
    };
    if theirs != rate {
        return Err(differs(
            "rate",
            rate.to_rate().to_string(),
            theirs.to_rate().to_string(),
        ));
    }
    let mapped = Mapped {
        map,
        path: path.to_owned(),
        _mode: PhantomData,
    };
    // The state's fixed integers must agree with the header (a corrupt file otherwise).
    let r = mapped.rovers();
    if r.limit() != config.limit() || r.threshold() != config.threshold() {
        return Err(ShmError::Layout {
            path: at(),
            found_size: size,
            found_offset: offset,
            expected_size: size_of::<Rovers<M>>() as u64,
            expected_offset: STATE_OFFSET as u64,
        });
    }
    Ok(mapped)
}

/// Test-only pauses (feature `shm-test-hooks`): a process whose `IOTHROTTLE_SHM_PAUSE` names
/// a step prints `parked <step>` on stdout and sleeps for ever there, for a test to kill it.
#[cfg(feature = "shm-test-hooks")]
pub(crate) mod hooks {
    use std::io::Write as _;

    use crate::bucket::mode::Mode;
    use crate::bucket::price::PriceCache;
    use crate::bucket::rate::RawRate;
    use crate::bucket::rate_cell::{step_code, Step};
    use crate::bucket::rovers::Rovers;

    /// Parks for ever if `IOTHROTTLE_SHM_PAUSE` is `name`.
    fn pause(name: &str) {
        if std::env::var("IOTHROTTLE_SHM_PAUSE").is_ok_and(|v| v == name) {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "parked {name}");
            let _ = out.flush();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }

    /// A replenish that may park between its claim of the interval and its fill
    /// (`replenish.claimed`).
    pub(crate) fn replenish<M: Mode>(rovers: &Rovers<M>, now: u64, cache: &PriceCache) -> u64 {
        match rovers.claim(now, cache) {
            Some(extra) => {
                pause("replenish.claimed");
                rovers.fill(extra)
            }
            None => 0,
        }
    }

    /// A rate change that may park at a step: `set_rate.<code>` (0: ticket, 1..=12: words,
    /// 13: published, see `rate_cell::step_code`).
    pub(crate) fn set_rate<M: Mode>(rovers: &Rovers<M>, rate: RawRate, now: u64) -> u64 {
        rovers
            .set_rate_stopping(rate, now, &|step: Step| {
                pause(&format!("set_rate.{}", step_code(step)));
                false
            })
            .unwrap_or(0)
    }
}
