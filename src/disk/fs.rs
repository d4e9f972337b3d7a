//! File-system facts: which file system a path is on.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// `statfs`'s file-system type of `path`, or `None` when it cannot be read.
fn fs_magic(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statfs` is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a live, writable `statfs`.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    (r == 0).then_some(st.f_type as i64)
}

/// `Some("tmpfs")` or `Some("ramfs")` when `path` is on a memory file system.
pub(crate) fn memory_fs(path: &Path) -> Option<&'static str> {
    match fs_magic(path)? {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        _ => None,
    }
}

/// A readable name for the file system of `path`.
pub(crate) fn fs_name(path: &Path) -> String {
    match fs_magic(path) {
        Some(0xEF53) => "ext4".into(),
        Some(0x5846_5342) => "xfs".into(),
        Some(0x9123_683E) => "btrfs".into(),
        Some(TMPFS_MAGIC) => "tmpfs".into(),
        Some(RAMFS_MAGIC) => "ramfs".into(),
        Some(0x794C_7630) => "overlayfs".into(),
        Some(0x6573_5546) => "fuse".into(),
        Some(0x6969) => "nfs".into(),
        Some(0x9FA0) => "proc".into(),
        Some(0x6265_6572) => "sysfs".into(),
        Some(m) => format!("file system type {m:#x}"),
        None => "unknown file system".into(),
    }
}
