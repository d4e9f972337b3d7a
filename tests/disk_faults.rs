#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! Faults on real file systems: a full disk (a small loop-mounted ext4), tmpfs, bad options.
//!
//! The full-disk tests mount an 8 MiB ext4 image on a loop device, which needs root (CI and the
//! development machines run as root). Set `IOTHROTTLE_SKIP_MOUNT_TESTS=1` to skip them elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::disk::{dispatcher, rt};
use iothrottle::disk::{calibrate, AlignedBuf, CalibrateOptions, FileOptions, ThrottledFile};
use iothrottle::{CalibrateError, DiskError};

/// A small ext4 file system on a loop device, unmounted on drop.
struct SmallFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl SmallFs {
    fn mount(mib: u64) -> Option<SmallFs> {
        if std::env::var("IOTHROTTLE_SKIP_MOUNT_TESTS").as_deref() == Ok("1") {
            eprintln!("skipped: IOTHROTTLE_SKIP_MOUNT_TESTS=1");
            return None;
        }
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let img = dir.path().join("fs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        std::fs::File::create(&img)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        run("mkfs.ext4", &["-q", "-F", img.to_str().unwrap()]);
        run(
            "mount",
            &["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()],
        );
        Some(SmallFs { _dir: dir, mnt })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("{cmd}: {e} (needs e2fsprogs and root; IOTHROTTLE_SKIP_MOUNT_TESTS=1 skips)")
    });
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed (needs root; IOTHROTTLE_SKIP_MOUNT_TESTS=1 skips): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: all-zero is a valid statvfs; `c` is NUL-terminated and `st` writable.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

/// A write larger than the free space fails with `NoSpace` before any byte is written: the
/// reservation fails, no piece is submitted, the file keeps its size.
#[test]
fn full_disk_fails_the_write_before_writing_anything() {
    let Some(fs) = SmallFs::mount(8) else { return };
    let (d, class) = dispatcher(true);
    let path = fs.mnt.join("data");
    let f = ThrottledFile::open(d.clone(), class, &path, FileOptions::read_write()).unwrap();
    let rt = rt();
    // Some data first, which must survive untouched.
    let head = AlignedBuf::from_slice(&[5u8; 4096]).unwrap();
    rt.block_on(f.write_at(head, 0)).unwrap();
    let too_big = (free_bytes(&fs.mnt) as usize + (4 << 20)).next_multiple_of(4096);
    let requests_before = d.stats_blocking().classes[class.index()].requests;
    let err = rt
        .block_on(f.write_at(AlignedBuf::from_slice(&vec![7u8; too_big]).unwrap(), 4096))
        .unwrap_err();
    match &err {
        DiskError::NoSpace {
            offset: 4096,
            len,
            source,
        } => {
            assert_eq!(*len, too_big as u64);
            assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("no space"), "{err}");
    // Nothing of it was written: same size, no piece submitted, the old data intact.
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096);
    assert_eq!(
        d.stats_blocking().classes[class.index()].requests,
        requests_before
    );
    let (back, n) = rt
        .block_on(f.read_at(AlignedBuf::zeroed(8192).unwrap(), 0))
        .unwrap();
    assert_eq!(n, 4096);
    assert!(back[..4096].iter().all(|&b| b == 5));
}

/// Why writes are reserved first: without the reservation the same write stops half-way, some
/// pieces on disk and some not. (The regression this guards against.)
#[test]
fn without_reservation_a_full_disk_leaves_a_half_written_write() {
    let Some(fs) = SmallFs::mount(8) else { return };
    let (d, class) = dispatcher(true);
    let path = fs.mnt.join("data");
    let opts = FileOptions {
        reserve_writes: false,
        ..FileOptions::read_write()
    };
    let f = ThrottledFile::open(d, class, &path, opts).unwrap();
    let too_big = (free_bytes(&fs.mnt) as usize + (4 << 20)).next_multiple_of(4096);
    let err = rt()
        .block_on(f.write_at(AlignedBuf::from_slice(&vec![7u8; too_big]).unwrap(), 0))
        .unwrap_err();
    assert!(
        matches!(
            err,
            DiskError::NoSpace { .. } | DiskError::ShortWrite { .. }
        ),
        "{err:?}"
    );
    assert!(
        std::fs::metadata(&path).unwrap().len() > 0,
        "some pieces were written"
    );
}

#[test]
fn calibrating_a_full_disk_is_a_typed_error_and_leaves_nothing() {
    let Some(fs) = SmallFs::mount(8) else { return };
    let options = CalibrateOptions {
        seconds: 5,
        file_size: 64 << 20,
        ..CalibrateOptions::default()
    };
    let err = calibrate(&fs.mnt, &options).unwrap_err();
    assert!(
        matches!(err, CalibrateError::Disk(DiskError::NoSpace { .. })),
        "{err:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&fs.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "lost+found")
        .collect();
    assert!(left.is_empty(), "scratch file removed: {left:?}");
}

#[test]
fn calibrating_tmpfs_is_refused() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("/dev/shm is a tmpfs here");
    let err = calibrate(dir.path(), &CalibrateOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            CalibrateError::Disk(DiskError::NotADisk { fs: "tmpfs", .. })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("tmpfs"), "{err}");
}

#[test]
fn bad_calibration_options_are_refused() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for bad in [
        CalibrateOptions {
            seconds: 61,
            ..CalibrateOptions::default()
        },
        CalibrateOptions {
            seconds: 0,
            ..CalibrateOptions::default()
        },
        CalibrateOptions {
            file_size: 1 << 20,
            ..CalibrateOptions::default()
        },
        CalibrateOptions {
            random_size: 1000,
            ..CalibrateOptions::default()
        },
        CalibrateOptions {
            max_depth: 0,
            ..CalibrateOptions::default()
        },
    ] {
        assert!(
            matches!(calibrate(dir.path(), &bad), Err(CalibrateError::Options(_))),
            "{bad:?}"
        );
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
