//! The checks made before any work: the flags, the plot's path and the scratch directory.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use iothrottle::dispatcher::DiskModel;

use crate::args::{check_values, Args};
use crate::BoxError;

const TMPFS_MAGIC: u64 = 0x0102_1994;

/// Every flag checked before anything runs; returns the scratch directory's parent.
pub(crate) fn check_args(args: &Args) -> Result<PathBuf, BoxError> {
    check_values(args)?;
    check_plot_path(&args.plot)?;
    if let Some(p) = &args.properties {
        // Parsed now so that a bad file fails before any work.
        DiskModel::from_properties(p)?;
    }
    match &args.dir {
        Some(d) => {
            check_dir(d)?;
            Ok(d.clone())
        }
        None => default_dir(),
    }
}

/// The plot's directory must exist and be writable: tried now, not after the run.
pub(crate) fn check_plot_path(plot: &Path) -> Result<(), BoxError> {
    let existed = plot.exists();
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(plot)
        .map_err(|e| format!("cannot write the plot to {}: {e}", plot.display()))?;
    if !existed {
        let _ = std::fs::remove_file(plot);
    }
    Ok(())
}

pub(crate) fn is_tmpfs(dir: &Path) -> Result<bool, BoxError> {
    let st = rustix::fs::statfs(dir).map_err(|e| format!("statfs {}: {e}", dir.display()))?;
    Ok(st.f_type as u64 == TMPFS_MAGIC)
}

pub(crate) fn check_dir(dir: &Path) -> Result<(), BoxError> {
    if !dir.is_dir() {
        return Err(format!("--dir {} is not a directory", dir.display()).into());
    }
    if is_tmpfs(dir)? {
        return Err(format!(
            "--dir {} is on tmpfs, which has no O_DIRECT and no disk: choose a directory on a real disk",
            dir.display()
        )
        .into());
    }
    Ok(())
}

pub(crate) fn default_dir() -> Result<PathBuf, BoxError> {
    for d in [PathBuf::from("target"), PathBuf::from("/var/tmp")] {
        if d.is_dir() && !is_tmpfs(&d).unwrap_or(true) {
            return Ok(d);
        }
    }
    Err("neither ./target nor /var/tmp is a directory on a real disk: pass --dir".into())
}
