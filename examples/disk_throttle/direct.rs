//! O_DIRECT plumbing: aligned buffers, opening a file with O_DIRECT, the block device's busy
//! time, and the random positions.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::BoxError;

const ALIGN: usize = 4096;

/// A zeroed buffer aligned to 4 KiB, as O_DIRECT needs.
pub(crate) struct AlignedBuf {
    pub(crate) ptr: std::ptr::NonNull<u8>,
    pub(crate) len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (no aliasing pointers are kept), so moving
// it to another thread or sharing `&AlignedBuf` (read-only access) is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (a positive multiple of 4 KiB); an error, not an abort, when memory is short.
    pub(crate) fn new(len: usize, fill: u8) -> Result<Self, BoxError> {
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|e| format!("buffer of {len} bytes: {e}"))?;
        if len == 0 {
            return Err("empty buffer".into());
        }
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| format!("out of memory for a buffer of {len} bytes"))?;
        let mut b = AlignedBuf { ptr, len };
        b.as_mut_slice().fill(fill);
        Ok(b)
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then written) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("checked at allocation");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

pub(crate) fn open_direct(path: &Path, write: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .create(write)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

/// Busy time of the block device holding `file`, from /sys (io_ticks, milliseconds).
pub(crate) struct DiskBusy {
    pub(crate) stat: Option<PathBuf>,
}

impl DiskBusy {
    pub(crate) fn new(file: &File) -> Self {
        let stat = file.metadata().ok().and_then(|m| {
            let dev = m.dev();
            let p = PathBuf::from(format!(
                "/sys/dev/block/{}:{}/stat",
                rustix::fs::major(dev),
                rustix::fs::minor(dev)
            ));
            p.exists().then_some(p)
        });
        DiskBusy { stat }
    }

    pub(crate) fn busy_ms(&self) -> Option<u64> {
        let s = std::fs::read_to_string(self.stat.as_ref()?).ok()?;
        s.split_whitespace().nth(9)?.parse().ok()
    }
}

/// Clock ticks of all CPUs so far: `(stolen, all)`, where stolen is the time the hypervisor
/// ran something else while a CPU wanted to run (`steal` in `/proc/stat`). `None` where there is
/// no such file.
pub(crate) fn cpu_ticks() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    // "cpu  user nice system idle iowait irq softirq steal guest guest_nice"; guest time is
    // counted in user already.
    let ticks: Vec<u64> = s
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    Some((*ticks.get(7)?, ticks.iter().sum()))
}

/// xorshift64.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
