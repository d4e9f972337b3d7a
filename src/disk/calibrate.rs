//! Calibration: measure the disk under a directory, as Seastar's iotune does, in seconds.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use crate::{CalibrateError, DiskError};

use super::buf::{AlignedBuf, ALIGN};
use super::file::open_direct;
use super::fs::memory_fs;
use super::props::{mountpoint_of, DiskProperties, IoProperties};

/// What [`calibrate`] does and for how long.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// Time for the four measurements, in seconds (5..=60, default 30). Writing the scratch file
    /// once comes on top (about `file_size / write bandwidth`).
    pub seconds: u64,
    /// Size of the scratch file (default 1 GiB, at least 64 MiB): large, so that random requests
    /// rarely hit a cache below the guest.
    pub file_size: u64,
    /// Size of the random requests (default 4 KiB).
    pub random_size: usize,
    /// Size of the sequential requests (default 1 MiB).
    pub sequential_size: usize,
    /// Queue depth of the sequential measurements (default 8).
    pub sequential_depth: u32,
    /// The deepest queue tried for random requests (default 128).
    pub max_depth: u32,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            seconds: 30,
            file_size: 1 << 30,
            random_size: 4096,
            sequential_size: 1 << 20,
            sequential_depth: 8,
            max_depth: 128,
        }
    }
}

/// The ladder always goes at least this deep (virtio and NVMe disks saturate at 16–64).
const MIN_LADDER_DEPTH: u32 = 32;

/// One step of a queue-depth ladder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DepthStep {
    /// Requests kept in flight.
    pub depth: u32,
    /// Requests completed per second.
    pub iops: f64,
}

/// Everything [`calibrate_detailed`] measured.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The io-properties (one disk, the directory's mount point).
    pub properties: IoProperties,
    /// The queue depth the random reads saturated at (the figure is measured there).
    pub read_depth: u32,
    /// The queue depth the random writes saturated at.
    pub write_depth: u32,
    /// Random reads per second at each depth tried.
    pub read_ladder: Vec<DepthStep>,
    /// Random writes per second at each depth tried.
    pub write_ladder: Vec<DepthStep>,
    /// Time to write the scratch file once.
    pub fill: Duration,
    /// Wall time of the whole calibration.
    pub elapsed: Duration,
}

/// Measures the disk under `dir` and returns its io-properties: random reads and writes of
/// [`random_size`](CalibrateOptions::random_size) at increasing queue depths until the IOPS
/// stop growing (two depths in a row add less than 5%, going at least to depth 32), then
/// sequential reads and writes of [`sequential_size`](CalibrateOptions::sequential_size). All
/// I/O is O_DIRECT on a scratch file
/// of [`file_size`](CalibrateOptions::file_size) that is reserved (`fallocate`), written once
/// in full (so that no figure measures the file system's unwritten extents: a write to one also
/// rewrites the extent tree, a read of one returns zeros without reaching the disk), measured
/// with time-based runs, and never left behind (a file with no name, `O_TMPFILE`, so that
/// not even Ctrl-C or `SIGKILL` leaves it; on a file system without `O_TMPFILE`, unlinked as
/// soon as it is open); every phase that writes is flushed
/// (`fdatasync`, outside the figures) before the next one starts and before calibration returns,
/// so that no figure starts with an earlier phase's writes unflushed. Each figure is a sustained
/// one, as fio measures it: a ramp of up to one second is discarded (a virtio disk's host cache
/// absorbs the first second of random writes at up to twice the rate it sustains), then the rest
/// of the figure's share of [`seconds`](CalibrateOptions::seconds) is measured (at the default
/// 30 s, at least 5 s for each figure). One thread keeps the queue depth with io_uring.
///
/// Errors: a memory file system ([`DiskError::NotADisk`]), no O_DIRECT, a full disk
/// ([`DiskError::NoSpace`] before anything is written), io_uring unavailable, bad options.
pub fn calibrate(
    dir: impl AsRef<Path>,
    options: &CalibrateOptions,
) -> Result<IoProperties, CalibrateError> {
    calibrate_detailed(dir, options).map(|c| c.properties)
}

/// [`calibrate`] with the ladders, depths and timings.
pub fn calibrate_detailed(
    dir: impl AsRef<Path>,
    options: &CalibrateOptions,
) -> Result<Calibration, CalibrateError> {
    let started = Instant::now();
    let dir = dir.as_ref();
    check_options(options)?;
    if let Some(fs) = memory_fs(dir) {
        return Err(DiskError::NotADisk {
            path: dir.to_owned(),
            fs,
        }
        .into());
    }
    let mountpoint = mountpoint_of(dir).map_err(|source| crate::PropertiesError::Mountpoint {
        path: dir.to_owned(),
        source,
    })?;
    let path = dir.join(format!(".iothrottle-calibrate-{}.tmp", std::process::id()));
    // A file with no name (`O_TMPFILE`): the kernel frees its blocks when the descriptor
    // closes, however the process ends (Ctrl-C, SIGKILL, a panic that aborts), and there is
    // no moment at which it has a name to leave behind.
    let file = match open_unnamed(dir) {
        Some(file) => file,
        None => {
            // A file system without `O_TMPFILE`: created under a name and unlinked at once.
            // The guard removes it if this returns in between; only a kill in those few
            // instructions leaves it.
            let scratch = Scratch(path.clone());
            let file = open_direct(&path, true, true)?;
            std::fs::remove_file(&path).map_err(|source| DiskError::Io {
                op: "unlink the scratch file",
                path: path.clone(),
                source,
            })?;
            drop(scratch);
            file
        }
    };
    let fd = file.as_raw_fd();
    let io_err = |op: &'static str| {
        let path = path.clone();
        move |source: io::Error| -> CalibrateError {
            match source.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::EDQUOT) => DiskError::NoSpace {
                    offset: 0,
                    len: options.file_size,
                    source,
                }
                .into(),
                _ => DiskError::Io { op, path, source }.into(),
            }
        }
    };
    reserve(fd, options.file_size).map_err(io_err("reserve (fallocate)"))?;

    let depth_max = options.max_depth.max(options.sequential_depth);
    let mut ring =
        IoUring::new(depth_max.next_power_of_two().max(8)).map_err(CalibrateError::NoIoUring)?;
    let mut bench = Bench {
        ring: &mut ring,
        fd,
        file_size: options.file_size,
        rng: 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id()),
        bufs: Vec::new(),
    };

    let total = Duration::from_secs(options.seconds);
    let (rand, seq) = shares(total);
    let mut fill = Duration::ZERO;
    let (mut read_depth, mut read_ladder, mut read_iops) = (0, Vec::new(), 0.0);
    let (mut write_depth, mut write_ladder, mut write_iops) = (0, Vec::new(), 0.0);
    let (mut read_bandwidth, mut write_bandwidth) = (0.0, 0.0);
    for &phase in PLAN {
        let op = phase.op();
        let err = io_err(match op {
            Some(Op::Read) => "read",
            Some(Op::Write) => "write",
            None => "flush (fdatasync)",
        });
        match phase {
            Phase::Fill => {
                let t = Instant::now();
                bench
                    .fill(options.sequential_size, options.sequential_depth)
                    .map_err(err)?;
                fill = t.elapsed();
            }
            Phase::Flush => file.sync_data().map_err(err)?,
            Phase::Random(op) => {
                let ladder = bench
                    .ladder(op, options.random_size, options.max_depth, rand)
                    .map_err(err)?;
                match op {
                    Op::Read => (read_depth, read_ladder, read_iops) = ladder,
                    Op::Write => (write_depth, write_ladder, write_iops) = ladder,
                }
            }
            Phase::Sequential(op) => {
                let bw = bench
                    .run(
                        op,
                        options.sequential_size,
                        options.sequential_depth,
                        Pattern::Sequential,
                        Stop::sustained(seq),
                    )
                    .map_err(err)?
                    .bytes_per_second();
                match op {
                    Op::Read => read_bandwidth = bw,
                    Op::Write => write_bandwidth = bw,
                }
            }
        }
    }
    drop(file);

    let figure = |v: f64, phase: &'static str| {
        let v = v.round();
        if v >= 1.0 {
            Ok(v as u64)
        } else {
            Err(CalibrateError::NothingMeasured { phase })
        }
    };
    let disk = DiskProperties {
        mountpoints: vec![mountpoint.to_string_lossy().into_owned()],
        read_iops: figure(read_iops, "random read")?,
        read_bandwidth: figure(read_bandwidth, "sequential read")?,
        write_iops: figure(write_iops, "random write")?,
        write_bandwidth: figure(write_bandwidth, "sequential write")?,
        read_saturation_length: None,
        write_saturation_length: None,
    };
    Ok(Calibration {
        properties: IoProperties { disks: vec![disk] },
        read_depth,
        write_depth,
        read_ladder,
        write_ladder,
        fill,
        elapsed: started.elapsed(),
    })
}

fn check_options(o: &CalibrateOptions) -> Result<(), CalibrateError> {
    let bad = |s: String| Err(CalibrateError::Options(s));
    if !(5..=60).contains(&o.seconds) {
        return bad(format!("seconds must be in 5..=60, got {}", o.seconds));
    }
    if o.file_size < 64 << 20 || !o.file_size.is_multiple_of(ALIGN as u64) {
        return bad(format!(
            "file_size must be a multiple of 4096 of at least 64 MiB, got {}",
            o.file_size
        ));
    }
    for (name, v) in [
        ("random_size", o.random_size),
        ("sequential_size", o.sequential_size),
    ] {
        if v == 0 || v % ALIGN != 0 || v as u64 > o.file_size / 16 || v > 64 << 20 {
            return bad(format!("{name} must be a positive multiple of 4096 of at most file_size/16 and 64 MiB, got {v}"));
        }
    }
    for (name, v) in [
        ("sequential_depth", o.sequential_depth),
        ("max_depth", o.max_depth),
    ] {
        if !(1..=1024).contains(&v) {
            return bad(format!("{name} must be in 1..=1024, got {v}"));
        }
    }
    Ok(())
}

/// Reserves `size` bytes for the scratch file (`fallocate`): the blocks are allocated but
/// unwritten, so that a full disk fails here, before anything is written. Unwritten blocks are
/// not what calibration measures ([`Bench::fill`] writes them all before the first figure).
fn reserve(fd: i32, size: u64) -> io::Result<()> {
    let size =
        libc::off_t::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: plain syscall on our own open file, no pointers.
    if unsafe { libc::fallocate(fd, 0, 0, size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An O_DIRECT file with no name in `dir` (`O_TMPFILE`), `None` where the file system or the
/// kernel has none, or refuses it with O_DIRECT (the named way then reports why).
fn open_unnamed(dir: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE | libc::O_DIRECT | libc::O_CLOEXEC)
        .open(dir)
        .ok()
}

/// Removes the scratch file if calibration ends between creating and unlinking it.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

/// One step of a calibration, in the order of [`PLAN`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Write the scratch file once (timed as [`Calibration::fill`], not a figure).
    Fill,
    /// `fdatasync`: the device is asked to make everything written so far durable (its volatile
    /// write cache, a virtio disk's host page cache, flushed) before the next phase starts. Not
    /// part of any figure.
    Flush,
    /// A queue-depth ladder of random requests, then the sustained IOPS figure.
    Random(Op),
    /// The sustained bandwidth figure of sequential requests.
    Sequential(Op),
}

impl Phase {
    /// The I/O this phase issues (none for a flush).
    fn op(self) -> Option<Op> {
        match self {
            Phase::Fill => Some(Op::Write),
            Phase::Flush => None,
            Phase::Random(op) | Phase::Sequential(op) => Some(op),
        }
    }
}

/// What calibration does, in order. Every phase that writes is followed by a [`Phase::Flush`]
/// before the next measured phase and at the end, so that a figure does not depend on what ran
/// before it and whatever runs after calibration does not pay for its writes. On this project's
/// virtio disk a flush takes about 0.2 ms, yet fio's sequential reads (three pairs of 6 s runs,
/// the same file) averaged 1.48 GB/s straight after 4 s of random writes at depth 128 and
/// 1.57 GB/s when those writes ended with an fsync.
const PLAN: &[Phase] = &[
    Phase::Fill,
    Phase::Flush,
    Phase::Random(Op::Read),
    Phase::Random(Op::Write),
    Phase::Flush,
    Phase::Sequential(Op::Read),
    Phase::Sequential(Op::Write),
    Phase::Flush,
];

#[derive(Clone, Copy)]
enum Pattern {
    Random,
    Sequential,
}

#[derive(Clone, Copy)]
enum Stop {
    /// Run `ramp + measure`; only the completions after `ramp` count (fio's `ramp_time`).
    Timed {
        ramp: Duration,
        measure: Duration,
    },
    Bytes(u64),
}

/// The ramp of a sustained measurement: fio's `ramp_time=1` (one second), but at most a fifth
/// of a short window.
const RAMP: Duration = Duration::from_secs(1);

impl Stop {
    /// A short ladder step: a tenth of it ramps.
    fn step(d: Duration) -> Stop {
        Stop::Timed {
            ramp: d / 10,
            measure: d - d / 10,
        }
    }

    /// A figure's final measurement over `window`: a ramp of [`RAMP`] (at most a fifth of the
    /// window), discarded, so that the queue fills and a burst that a cache absorbs at the
    /// start is not what is measured; the rest is measured.
    fn sustained(window: Duration) -> Stop {
        let ramp = RAMP.min(window / 5);
        Stop::Timed {
            ramp,
            measure: window - ramp,
        }
    }
}

struct Measure {
    ops: u64,
    bytes: u64,
    elapsed: Duration,
}

impl Measure {
    fn per_second(&self, n: u64) -> f64 {
        n as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    fn iops(&self) -> f64 {
        self.per_second(self.ops)
    }
    fn bytes_per_second(&self) -> f64 {
        self.per_second(self.bytes)
    }
}

/// The time of each random figure (ladder and sustained run) and of each sequential figure:
/// 30% and 20% of the total. At the default 30 s every figure's sustained window is fio's
/// reference one (a 1 s ramp, then at least 5 s measured), so the two measure alike; a shorter
/// calibration shortens the windows in proportion.
fn shares(total: Duration) -> (Duration, Duration) {
    (total.mul_f64(0.30), total.mul_f64(0.20))
}

/// A ladder step: 3.5% of a random figure's budget, so that eight depths take at most 28%.
fn ladder_step(budget: Duration) -> Duration {
    budget.mul_f64(0.035)
}

/// The depth a random figure is measured at: the deepest step within 10% of the best. Past
/// saturation the IOPS stay flat and noise alone picks the best among them, while a deeper queue
/// is surely saturated: a noisy shallow step must not set the depth of the figure.
fn saturated_depth(ladder: &[DepthStep]) -> Option<u32> {
    let best = ladder.iter().map(|s| s.iops).fold(0.0, f64::max);
    ladder
        .iter()
        .filter(|s| s.iops >= best * 0.9)
        .map(|s| s.depth)
        .max()
}

struct Bench<'r> {
    ring: &'r mut IoUring,
    fd: i32,
    file_size: u64,
    rng: u64,
    bufs: Vec<AlignedBuf>,
}

impl Bench<'_> {
    fn next_random(&mut self, size: usize) -> u64 {
        // xorshift64*: fast and uniform enough to spread requests over the file.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let slots = self.file_size / size as u64;
        (r % slots) * size as u64
    }

    /// Writes every block of the file once, sequentially, `size` bytes at a time with `depth`
    /// in flight. A block that `fallocate` reserved and nothing wrote is an unwritten extent:
    /// a read of it returns zeros without reaching the disk, and the first write to it also
    /// rewrites the file system's extent tree (in ext4, an extent split and a journal entry), so
    /// random 4 KiB writes on a reserved-only file measured 0.4–0.6× those on a written one
    /// (fio, this project's virtio disk). Every figure is measured on written blocks only.
    fn fill(&mut self, size: usize, depth: u32) -> io::Result<()> {
        let stop = Stop::Bytes(self.file_size);
        self.run(Op::Write, size, depth, Pattern::Sequential, stop)
            .map(drop)
    }

    /// Random requests at depths 1, 2, 4, … (at least to [`MIN_LADDER_DEPTH`]) until two depths
    /// in a row add less than 5% to the best, each for a short step (3.5% of `budget`, at most
    /// 28% for eight depths); then the deepest depth within 10% of the best is measured again, sustained
    /// ([`Stop::sustained`]), for the rest of `budget` (at least 72%, as long as fio's 1 s ramp
    /// and 4 s run in a 20 s calibration): the figure is that sustained one, not the step's.
    fn ladder(
        &mut self,
        op: Op,
        size: usize,
        max: u32,
        budget: Duration,
    ) -> io::Result<(u32, Vec<DepthStep>, f64)> {
        let step = ladder_step(budget);
        let mut ladder = Vec::new();
        let mut best = DepthStep {
            depth: 1,
            iops: 0.0,
        };
        let started = Instant::now();
        let mut depth = 1;
        // Depths that did not beat the best by 5% in a row: two end the ladder (one alone may
        // be noise).
        let mut misses = 0;
        while depth <= max {
            let m = self.run(op, size, depth, Pattern::Random, Stop::step(step))?;
            let s = DepthStep {
                depth,
                iops: m.iops(),
            };
            ladder.push(s);
            if s.iops >= best.iops * 1.05 {
                misses = 0;
            } else {
                misses += 1;
            }
            if s.iops > best.iops {
                best = s;
            }
            // Shallow queues never end the ladder: on a shared machine a noisy step at depth 2
            // or 4 would otherwise stop it far below saturation.
            if misses >= 2 && depth >= MIN_LADDER_DEPTH {
                break;
            }
            depth *= 2;
        }
        let depth = saturated_depth(&ladder).unwrap_or(best.depth);
        let rest = budget.saturating_sub(started.elapsed()).max(step);
        let m = self.run(op, size, depth, Pattern::Random, Stop::sustained(rest))?;
        Ok((depth, ladder, m.iops()))
    }

    /// Keeps `depth` requests of `size` in flight until `stop`.
    fn run(
        &mut self,
        op: Op,
        size: usize,
        depth: u32,
        pattern: Pattern,
        stop: Stop,
    ) -> io::Result<Measure> {
        let depth = depth as usize;
        while self.bufs.len() < depth || self.bufs.first().is_some_and(|b| b.len() < size) {
            if self.bufs.first().is_some_and(|b| b.len() < size) {
                self.bufs.clear();
            }
            let mut b = AlignedBuf::zeroed(size).map_err(io::Error::other)?;
            // Incompressible data, in case something below compresses or deduplicates.
            for chunk in b.chunks_mut(8) {
                let r = self.next_random(ALIGN).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                chunk.copy_from_slice(&r.to_le_bytes()[..chunk.len()]);
            }
            self.bufs.push(b);
        }
        let started = Instant::now();
        // Time-based runs count from the end of their ramp, as fio's `ramp_time` does: the
        // queue fills and the device settles first.
        let ramp = match stop {
            Stop::Timed { ramp, .. } => ramp,
            Stop::Bytes(_) => Duration::ZERO,
        };
        let mut counting_from = None;
        let mut next_seq = 0u64;
        let mut issued_bytes = 0u64;
        let mut m = Measure {
            ops: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
        };
        let mut in_flight = 0usize;
        let more = |issued: u64, now: Instant| match stop {
            Stop::Timed { ramp, measure } => now.duration_since(started) < ramp + measure,
            Stop::Bytes(b) => issued < b,
        };
        let mut next_offset = |this: &mut Self| match pattern {
            Pattern::Random => this.next_random(size),
            Pattern::Sequential => {
                let o = next_seq;
                next_seq = (next_seq + size as u64) % this.file_size;
                o
            }
        };
        for slot in 0..depth {
            if !more(issued_bytes, Instant::now()) {
                break;
            }
            let off = next_offset(self);
            self.push(op, slot, size, off)?;
            issued_bytes += size as u64;
            in_flight += 1;
        }
        let mut done = [(0u64, 0i32); 64];
        while in_flight > 0 {
            self.ring.submit_and_wait(1)?;
            let mut n = 0;
            for c in self.ring.completion().take(done.len()) {
                done[n] = (c.user_data(), c.result());
                n += 1;
            }
            let now = Instant::now();
            let counting = match counting_from {
                Some(_) => true,
                None if now.duration_since(started) >= ramp => {
                    counting_from = Some(now);
                    ramp.is_zero()
                }
                None => false,
            };
            for &(slot, res) in &done[..n] {
                in_flight -= 1;
                if res < 0 {
                    // Drain what is still in flight before reporting: the buffers must outlive it.
                    self.drain(in_flight)?;
                    return Err(io::Error::from_raw_os_error(-res));
                }
                if counting {
                    m.ops += 1;
                    m.bytes += res as u64;
                }
                if more(issued_bytes, now) {
                    let off = next_offset(self);
                    self.push(op, slot as usize, size, off)?;
                    issued_bytes += size as u64;
                    in_flight += 1;
                }
            }
        }
        m.elapsed = counting_from.map_or(Duration::ZERO, |t| t.elapsed());
        Ok(m)
    }

    fn drain(&mut self, mut in_flight: usize) -> io::Result<()> {
        while in_flight > 0 {
            self.ring.submit_and_wait(1)?;
            in_flight -= self.ring.completion().count();
        }
        Ok(())
    }

    fn push(&mut self, op: Op, slot: usize, size: usize, offset: u64) -> io::Result<()> {
        let fd = types::Fd(self.fd);
        let ptr = self.bufs[slot].raw();
        let entry = match op {
            Op::Read => opcode::Read::new(fd, ptr, size as u32)
                .offset(offset)
                .build(),
            Op::Write => opcode::Write::new(fd, ptr, size as u32)
                .offset(offset)
                .build(),
        }
        .user_data(slot as u64);
        // Submitted by the next `submit_and_wait` of `run`/`drain`.
        // SAFETY: buffer `slot` (at least `size` bytes) is used by this one request only and
        // outlives it: `run` and `drain` wait for every request before returning, and
        // `self.bufs` is not touched while requests are in flight.
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            self.ring.submit()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every figure is measured at least as long as fio's reference (1 s of ramp and 5 s) at
    /// the default length and longer: measured over what the ladder leaves (2.2 s in a 20 s
    /// calibration) after a ramp of 0.25 s, the random-write figure would catch the first
    /// seconds of writes that a virtio disk's host cache absorbs at up to twice the rate it
    /// sustains (1.45× fio's figure); and 2.4 s after a 0.6 s ramp, half of fio's window, is too
    /// short on a disk whose bandwidth drifts ±15% from one second to the next.
    #[test]
    fn every_figure_is_measured_as_long_as_fio_at_the_default_length() {
        let default = CalibrateOptions::default().seconds;
        for seconds in [default, 45, 60] {
            let (rand, seq) = shares(Duration::from_secs(seconds));
            // The longest ladder: eight depths (1..=128).
            let rest = rand - ladder_step(rand) * 8;
            for (figure, window) in [("random", rest), ("sequential", seq)] {
                let Stop::Timed { ramp, measure } = Stop::sustained(window) else {
                    panic!("timed");
                };
                assert_eq!(ramp, Duration::from_secs(1), "{figure}, {seconds} s");
                assert!(
                    measure >= Duration::from_secs(5),
                    "{figure}, {seconds} s: {measure:?}"
                );
            }
            // The four figures fit the time asked for.
            assert!(rand * 2 + seq * 2 <= Duration::from_secs(seconds));
        }
        // A short calibration still ramps a fifth of its window.
        let Stop::Timed { ramp, measure } = Stop::sustained(Duration::from_secs(2)) else {
            panic!("timed");
        };
        assert_eq!(
            (ramp, measure),
            (Duration::from_millis(400), Duration::from_millis(1600))
        );
    }

    /// Every measured phase starts with nothing written and unflushed, each figure is measured
    /// once, and calibration ends flushed: a sequential read straight after seconds of
    /// unflushed random writes at depth 128 is about 6% slower than after a flush (by fio), and
    /// whatever runs after calibration must not inherit its unflushed writes.
    #[test]
    fn no_phase_is_measured_while_an_earlier_write_is_unflushed() {
        let mut unflushed = None;
        let mut measured = Vec::new();
        for &phase in PLAN {
            if matches!(phase, Phase::Random(_) | Phase::Sequential(_)) {
                assert_eq!(unflushed, None, "{phase:?} starts with writes unflushed");
                measured.push(phase);
            }
            match phase.op() {
                Some(Op::Write) => unflushed = Some(phase),
                Some(Op::Read) => {}
                None => unflushed = None,
            }
        }
        assert_eq!(unflushed, None, "calibration ends with writes unflushed");
        for figure in [
            Phase::Random(Op::Read),
            Phase::Random(Op::Write),
            Phase::Sequential(Op::Read),
            Phase::Sequential(Op::Write),
        ] {
            let n = measured.iter().filter(|&&p| p == figure).count();
            assert_eq!(n, 1, "{figure:?} measured {n} times");
        }
        assert_eq!(
            PLAN.first(),
            Some(&Phase::Fill),
            "the file is written first"
        );
    }

    /// The start of the first hole at or after `offset` (`lseek(SEEK_HOLE)`): ext4 and XFS
    /// report a reserved block that nothing wrote (an unwritten extent) as a hole.
    fn first_hole(fd: i32, offset: u64) -> u64 {
        // SAFETY: plain syscall on an open file, no pointers.
        let at = unsafe { libc::lseek(fd, offset as libc::off_t, libc::SEEK_HOLE) };
        assert!(at >= 0, "lseek: {}", io::Error::last_os_error());
        at as u64
    }

    /// Calibration measures written blocks only: after [`Bench::fill`] the scratch file has no
    /// unwritten extent left. A reserved-only file is what fio lays out for a write-only job,
    /// and its random writes convert extents instead of measuring the disk.
    #[test]
    fn the_fill_leaves_no_unwritten_block_in_the_scratch_file() {
        // On the disk that holds the build (the temporary directory may be a memory file
        // system, which refuses O_DIRECT).
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        let dir = tempfile::tempdir_in(target).unwrap();
        let path = dir.path().join("scratch");
        let file = open_direct(&path, true, true).unwrap();
        let fd = file.as_raw_fd();
        let options = CalibrateOptions {
            file_size: 64 << 20,
            ..CalibrateOptions::default()
        };
        reserve(fd, options.file_size).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            options.file_size,
            "reserved in full"
        );
        // The check sees unwritten extents: every reserved block is one.
        assert_eq!(first_hole(fd, 0), 0, "a reserved block reads as a hole");
        let mut ring = IoUring::new(8).unwrap();
        let mut bench = Bench {
            ring: &mut ring,
            fd,
            file_size: options.file_size,
            rng: 1,
            bufs: Vec::new(),
        };
        bench
            .fill(options.sequential_size, options.sequential_depth)
            .unwrap();
        file.sync_data().unwrap();
        assert_eq!(
            first_hole(fd, 0),
            options.file_size,
            "an unwritten block is left in the scratch file"
        );
    }

    /// The figure is not measured at the best step's depth: one noisy step at depth 8 on a
    /// shared machine would set the depth of the whole figure, far below saturation.
    #[test]
    fn a_noisy_shallow_best_step_does_not_set_the_depth() {
        let ladder: Vec<DepthStep> = [(8, 100.0), (16, 60.0), (32, 95.0), (64, 91.0), (128, 80.0)]
            .into_iter()
            .map(|(depth, iops)| DepthStep { depth, iops })
            .collect();
        assert_eq!(saturated_depth(&ladder), Some(64));
        assert_eq!(saturated_depth(&[]), None);
    }
}
