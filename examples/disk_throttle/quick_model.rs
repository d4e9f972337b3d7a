//! The quick disk model: a few seconds of O_DIRECT measurement, when no `--properties` file
//! is given.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iothrottle::dispatcher::{DiskModel, Figures};

use crate::direct::{AlignedBuf, Rng};
use crate::BoxError;

/// `depth` threads doing `size`-byte O_DIRECT I/O (random within `region` if `random`, else
/// sequential) for `RAMP + time`: operations and bytes per second after the ramp, which is
/// discarded (a virtio disk's host cache absorbs the first fraction of a second of writes
/// faster than it sustains them).
fn measure(
    file: &Arc<File>,
    region: (u64, u64),
    write: bool,
    random: bool,
    size: usize,
    depth: usize,
    time: Duration,
) -> Result<(f64, f64), BoxError> {
    let ops = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let slots = (region.1 / size as u64).max(1);
    let start = Instant::now() + QUICK_RAMP;
    let end = start + time;
    let mut threads = Vec::new();
    for t in 0..depth {
        let (file, ops, next) = (file.clone(), ops.clone(), next.clone());
        let mut buf = AlignedBuf::new(size, 0x5A)?;
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut rng = Rng(0x1234_5678 + t as u64 * 7919);
            while Instant::now() < end {
                let slot = if random {
                    rng.below(slots)
                } else {
                    // Relaxed: a lone counter handing out positions.
                    next.fetch_add(1, Ordering::Relaxed) % slots
                };
                let off = region.0 + slot * size as u64;
                if write {
                    file.write_all_at(buf.as_slice(), off)?;
                } else {
                    file.read_exact_at(buf.as_mut_slice(), off)?;
                }
                if Instant::now() >= start {
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        }));
    }
    for t in threads {
        t.join().map_err(|_| "a measuring thread panicked")??;
    }
    let secs = start.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed) as f64;
    Ok((n / secs, n * size as f64 / secs))
}

/// The ramp of each quick measurement, discarded.
const QUICK_RAMP: Duration = Duration::from_millis(250);

/// The quick disk model: random 4 KiB reads and writes at depth 32, sequential 1 MiB reads
/// and writes at depth 4, each after a discarded ramp of 250 ms (a virtio disk's host cache
/// absorbs the first fraction of a second of writes faster than it sustains them); the reads
/// measured for 0.5 s, the writes for 1 s.
pub(crate) fn quick_model(
    file: &Arc<File>,
    fg: (u64, u64),
    bg: (u64, u64),
) -> Result<DiskModel, BoxError> {
    let t = Duration::from_millis(500);
    let (read_iops, _) = measure(file, fg, false, true, 4096, 32, t)?;
    let (_, read_bw) = measure(file, fg, false, false, 1 << 20, 4, t)?;
    let (write_iops, _) = measure(file, bg, true, true, 4096, 32, t * 2)?;
    let (_, write_bw) = measure(file, bg, true, false, 1 << 20, 4, t * 2)?;
    let m = DiskModel::new(
        Figures {
            iops: read_iops.max(1.0) as u64,
            bandwidth: read_bw.max(1.0) as u64,
        },
        Figures {
            iops: write_iops.max(1.0) as u64,
            bandwidth: write_bw.max(1.0) as u64,
        },
    );
    m.validate()?;
    Ok(m)
}
