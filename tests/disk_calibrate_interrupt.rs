#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! Calibration interrupted by Ctrl-C leaves no scratch file: a child process (this test binary,
//! running the ignored `calibrating_child`) calibrates, the parent sends it `SIGINT` while its
//! scratch file is open (with no name, or under its scratch name where the file system has no
//! `O_TMPFILE`), and the directory is empty afterwards.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use iothrottle::disk::{calibrate, CalibrateOptions};

const CHILD_DIR: &str = "IOTHROTTLE_CALIBRATE_CHILD_DIR";
const SCRATCH_PREFIX: &str = ".iothrottle-calibrate-";

/// The child: calibrates in the directory the parent names (run only by the parent).
#[test]
#[ignore = "run as a child process by calibration_interrupted_by_sigint_leaves_no_scratch_file"]
fn calibrating_child() {
    // Started any other way (e.g. with every ignored test), there is nothing to do.
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    // The test is of Ctrl-C's default action. A shell without job control starts a background
    // command with SIGINT ignored, and the disposition is inherited down to this process: take
    // the default back, as a program run from a terminal has it.
    // SAFETY: sets the disposition of one signal to its default; no handler is installed.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_DFL) };
    let options = CalibrateOptions {
        seconds: 5,
        file_size: 64 << 20,
        ..CalibrateOptions::default()
    };
    calibrate(&dir, &options).expect("calibration runs until interrupted");
}

/// Whether process `pid` has a file in `dir` open: the scratch file, with no name
/// (`O_TMPFILE`: `dir/#inode (deleted)`) or under its scratch name.
fn has_scratch_open(pid: u32, dir: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .map(|target| target.parent() == Some(dir))
            .unwrap_or(false)
    })
}

fn scratch_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(SCRATCH_PREFIX))
        .collect()
}

#[test]
fn calibration_interrupted_by_sigint_leaves_no_scratch_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["calibrating_child", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_DIR, dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let in_dir = dir.path().canonicalize().unwrap();
    // Wait until the child holds its scratch file open (a liveness bound, not a timing check).
    let mut waited = Duration::ZERO;
    while !has_scratch_open(pid, &in_dir) {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the child ended before calibrating: {status}\n{err}");
        }
        assert!(
            waited < Duration::from_secs(120),
            "calibration never started"
        );
        std::thread::sleep(Duration::from_millis(2));
        waited += Duration::from_millis(2);
    }
    // SAFETY: sends a signal to our own child, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was interrupted: {status}");
    assert_eq!(scratch_files(dir.path()), Vec::<String>::new());
}
