//! The main job: does the dispatcher protect foreground reads from a compaction on a **real
//! disk**, and at what bandwidth, compared with no throttling and with a plain rate limiter?
//!
//! ```text
//! cargo run --release --example disk_throttle
//! cargo run --release --example disk_throttle -- --properties io_properties.yaml --dir /data
//! cargo run --release --example disk_throttle -- --modelled      # the modelled-disk demo
//! ```
//!
//! 1. **Disk model**: measured in a few seconds with O_DIRECT (random 4 KiB reads and writes at
//!    queue depth 32, sequential 1 MiB reads and writes at queue depth 4, each after a
//!    discarded ramp), or loaded from a Seastar `io_properties.yaml` (`--properties`).
//! 2. **Six phases**, `--phase-secs` seconds each, run as interleaved one-second slices (one
//!    of each phase per round, so that whatever else the machine does falls on all alike), on
//!    scratch files in a temporary directory under `--dir` (a real disk; tmpfs has no
//!    O_DIRECT), removed at the end, on error and on Ctrl-C:
//!    - `idle`: foreground random 4 KiB O_DIRECT reads alone (`--fg-depth` readers, paced to
//!      `--fg-iops` in total);
//!    - `idle-disp`: the same through the dispatcher (what its path costs, without
//!      compaction; not in the summary line);
//!    - `unthrottled`: the foreground plus a "compaction" of sequential `--bg-kib` O_DIRECT writes,
//!      `--bg-depth` in flight, as fast as the disk takes them;
//!    - `plain`: the compaction through a plain rate limiter at `--plain-rate` (a [`Throttle`],
//!      the RocksDB way);
//!    - `iothrottle`: both through the [`Dispatcher`] with a latency goal (`--goal-us`): the
//!      compaction's writes are split into 4 KiB-aligned pieces, at most the goal's disk
//!      time is in flight, and the compaction holds at most a quarter of it (`--bg-in-flight-us`,
//!      `ClassConfig::with_max_in_flight`), so that writes the host stalls cannot hold the
//!      foreground's share;
//!    - `target`: the same dispatcher in latency-target mode: the foreground declares a p99
//!      target (`--target-us`, `ClassConfig::with_latency_target`) and no class has a rate;
//!      the dispatcher lowers the compaction's share while the target is missed.
//!
//! Every phase issues its I/O the same way: [`ThrottledFile`] on io_uring (or the blocking pool
//! where io_uring is unavailable), so no shard's reactor is ever blocked and the phases compare
//! like with like. `idle`, `unthrottled` and `plain` go through a pass-through dispatcher (a
//! modelled disk far faster than any, uncapped: it never holds a request back) with whole
//! `--bg-kib` writes. Latency is measured end to end by the caller (submission to completion). A row per second, a side-by-side table, an SVG plot with a
//! bandwidth and a latency panel, and one machine-readable `summary:` line.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use iothrottle::disk::{AlignedBuf as DiskBuf, FileOptions, ThrottledFile};
use iothrottle::dispatcher::{
    ClassConfig, ClassId, DiskModel, Dispatcher, DispatcherStats, IoKind, IoRequest,
};
use iothrottle::DiskError;
use iothrottle::{BucketConfig, Rate, Throttle, Uncapped};

/// Foreground reads against a background compaction on a real disk: idle, unthrottled, a
/// plain rate limiter, and the dispatcher with a latency goal.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Directory for the scratch files (a temporary directory is made inside it and removed at
    /// the end). Must be on a real disk, not tmpfs. Default: ./target, else /var/tmp.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Load the disk model from a Seastar io_properties.yaml instead of measuring it.
    #[arg(long)]
    properties: Option<PathBuf>,
    /// Run the modelled-disk demo instead (shares between two classes on a modelled disk).
    #[arg(long)]
    modelled: bool,
    /// Seconds of each phase: the phases run in interleaved one-second slices, this many
    /// rounds.
    #[arg(long, default_value_t = 6)]
    phase_secs: u64,
    /// Foreground readers (reads in flight at most).
    #[arg(long, default_value_t = 4)]
    fg_depth: usize,
    /// Foreground reads per second, all readers together.
    #[arg(long, default_value_t = 2000)]
    fg_iops: u64,
    /// Size of one compaction write, KiB (a multiple of 4, at most 65536).
    #[arg(long, default_value_t = 1024)]
    bg_kib: u64,
    /// Compaction writes in flight.
    #[arg(long, default_value_t = 4)]
    bg_depth: usize,
    /// The plain rate limiter's rate, bytes per second: a number with an optional unit
    /// (50MB/s, 50MiB/s, 50000000).
    #[arg(long, default_value = "50MB/s", value_parser = parse_bytes_rate)]
    plain_rate: u64,
    /// The dispatcher's latency goal, microseconds of disk time in flight.
    #[arg(long, default_value_t = 300)]
    goal_us: u64,
    /// The most disk time one compaction piece may take, microseconds (at most the goal).
    /// Default: the compaction's in-flight bound (half the goal with --no-bg-bound), but at
    /// least one 64 KiB write's and at most the goal.
    #[arg(long)]
    piece_us: Option<u64>,
    /// The most disk time the compaction may hold in flight in the dispatcher, microseconds
    /// (`ClassConfig::with_max_in_flight`; default: a quarter of the goal). The rest of the goal stays
    /// free for the foreground even when the host stalls the compaction's writes.
    #[arg(long)]
    bg_in_flight_us: Option<u64>,
    /// No in-flight bound on the compaction (the dispatcher before the fix, for comparison).
    #[arg(long)]
    no_bg_bound: bool,
    /// The `target` phase: the foreground's p99 latency target, microseconds
    /// (`ClassConfig::with_latency_target`; no rate configured for either class). Default:
    /// 1.5 × the foreground's p99 in the first round's idle and idle-disp slices.
    #[arg(long)]
    target_us: Option<u64>,
    /// Uncapped dispatcher: the goal only sizes the burst, and requests go at the model's rate
    /// whatever completes (Seastar's behaviour); capped (the default) bounds the disk time in
    /// flight by completions.
    #[arg(long)]
    uncapped: bool,
    /// Foreground and compaction shares in the dispatcher, fg:bg.
    #[arg(long, default_value = "1000:100", value_parser = parse_shares)]
    shares: (u32, u32),
    /// Dispatcher shards (threads).
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Size of the foreground's region of the scratch file, MiB.
    #[arg(long, default_value_t = 1024)]
    fg_mib: u64,
    /// Size of the compaction's region, MiB (it cycles over it). Small enough that what the
    /// host caches of it drains in about a second between phases.
    #[arg(long, default_value_t = 256)]
    bg_mib: u64,
    /// Pause after each round (after its unthrottled slice), milliseconds, so that its
    /// write-back does not land in the next round. Measured on this project's VM: with 1 s the
    /// host was still flushing when the next round's slices ran (iothrottle p99 708–904 µs
    /// in four runs), with 3 s it was done (366–503 µs in five runs, same build).
    #[arg(long, default_value_t = 3000)]
    settle_ms: u64,
    /// Where to write the plot (SVG).
    #[arg(long, default_value = "disk_throttle.svg")]
    plot: PathBuf,
    /// Modelled demo only: disk bandwidth, MB/s.
    #[arg(long, default_value_t = 200)]
    rate: u64,
    /// Modelled demo only: disk IOPS.
    #[arg(long, default_value_t = 20_000)]
    iops: u64,
    /// Modelled demo only: run time, seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

fn parse_shares(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("expected fg:bg, like 4:1, got {s:?}"))?;
    let p = |x: &str| {
        let n = x
            .trim()
            .parse::<u32>()
            .map_err(|e| format!("{x:?} is not a number of shares: {e}"))?;
        if (1..=ClassConfig::MAX_SHARES).contains(&n) {
            Ok(n)
        } else {
            Err(format!("shares must be in 1..=1000, got {n}"))
        }
    };
    Ok((p(a)?, p(b)?))
}

/// `50MB/s`, `50 MiB/s`, `1.5GB/s`, `50000000`: bytes per second, positive.
fn parse_bytes_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "kB" | "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (use B, kB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a rate: expected e.g. 50MB/s or 50000000"))?;
    let bytes = n * mult;
    if !(1.0..1e15).contains(&bytes) {
        return Err(format!("the rate must be 1 B/s to 1 PB/s, got {s:?}"));
    }
    Ok(bytes as u64)
}

const READ_BYTES: u64 = 4096;
const ALIGN: usize = 4096;
const MAX_BG_KIB: u64 = 64 * 1024;
const TMPFS_MAGIC: u64 = 0x0102_1994;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let result = if args.modelled {
        modelled::run(&args)
    } else {
        real_disk(&args)
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------------------------
// Checks before any work.

/// Every flag checked before anything runs; returns the scratch directory's parent.
fn check_args(args: &Args) -> Result<PathBuf, BoxError> {
    let positive = [
        ("--phase-secs", args.phase_secs),
        ("--fg-depth", args.fg_depth as u64),
        ("--fg-iops", args.fg_iops),
        ("--bg-kib", args.bg_kib),
        ("--bg-depth", args.bg_depth as u64),
        ("--goal-us", args.goal_us),
        ("--shards", args.shards as u64),
        ("--fg-mib", args.fg_mib),
        ("--bg-mib", args.bg_mib),
    ];
    for (flag, v) in positive {
        if v == 0 {
            return Err(format!("{flag} must be positive").into());
        }
    }
    if args.phase_secs > 600 {
        return Err("--phase-secs must be at most 600".into());
    }
    if !args.bg_kib.is_multiple_of(4) || args.bg_kib > MAX_BG_KIB {
        return Err(format!(
            "--bg-kib must be a multiple of 4 (O_DIRECT) and at most {MAX_BG_KIB}, got {}",
            args.bg_kib
        )
        .into());
    }
    if args.fg_depth > 1024 || args.bg_depth > 256 || args.shards > 64 {
        return Err("--fg-depth is at most 1024, --bg-depth 256, --shards 64".into());
    }
    if args.bg_mib * 1024 < 4 * args.bg_kib || args.bg_mib > 1 << 20 || args.fg_mib > 1 << 20 {
        return Err(format!(
            "--bg-mib must hold at least four compaction writes; --fg-mib and --bg-mib are at most 1 TiB (got {} and {})",
            args.fg_mib, args.bg_mib
        )
        .into());
    }
    if args.settle_ms > 60_000 {
        return Err("--settle-ms must be at most 60000".into());
    }
    if let Some(p) = args.piece_us {
        if p == 0 || p > args.goal_us {
            return Err(format!(
                "--piece-us must be in 1..=--goal-us ({}), got {p}",
                args.goal_us
            )
            .into());
        }
    }
    if args.target_us == Some(0) {
        return Err("--target-us must be positive".into());
    }
    if args.bg_in_flight_us == Some(0) {
        return Err("--bg-in-flight-us must be positive (--no-bg-bound removes the bound)".into());
    }
    if args.fg_iops > 1_000_000 {
        return Err("--fg-iops must be at most 1000000".into());
    }
    check_plot_path(&args.plot)?;
    if let Some(p) = &args.properties {
        // Parsed now so that a bad file fails before any work.
        DiskModel::from_properties(p)?;
    }
    let dir = match &args.dir {
        Some(d) => {
            check_dir(d)?;
            d.clone()
        }
        None => default_dir()?,
    };
    Ok(dir)
}

/// The plot's directory must exist and be writable: tried now, not after the run.
fn check_plot_path(plot: &Path) -> Result<(), BoxError> {
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

fn is_tmpfs(dir: &Path) -> Result<bool, BoxError> {
    let st = rustix::fs::statfs(dir).map_err(|e| format!("statfs {}: {e}", dir.display()))?;
    Ok(st.f_type as u64 == TMPFS_MAGIC)
}

fn check_dir(dir: &Path) -> Result<(), BoxError> {
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

fn default_dir() -> Result<PathBuf, BoxError> {
    for d in [PathBuf::from("target"), PathBuf::from("/var/tmp")] {
        if d.is_dir() && !is_tmpfs(&d).unwrap_or(true) {
            return Ok(d);
        }
    }
    Err("neither ./target nor /var/tmp is a directory on a real disk: pass --dir".into())
}

// ---------------------------------------------------------------------------------------------
// Aligned buffers and O_DIRECT files.

/// A zeroed buffer aligned to 4 KiB, as O_DIRECT needs.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (no aliasing pointers are kept), so moving
// it to another thread or sharing `&AlignedBuf` (read-only access) is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` bytes (a positive multiple of 4 KiB); an error, not an abort, when memory is short.
    fn new(len: usize, fill: u8) -> Result<Self, BoxError> {
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

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then written) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
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

fn open_direct(path: &Path, write: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .create(write)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path)
}

/// Busy time of the block device holding `file`, from /sys (io_ticks, milliseconds).
struct DiskBusy {
    stat: Option<PathBuf>,
}

impl DiskBusy {
    fn new(file: &File) -> Self {
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

    fn busy_ms(&self) -> Option<u64> {
        let s = std::fs::read_to_string(self.stat.as_ref()?).ok()?;
        s.split_whitespace().nth(9)?.parse().ok()
    }
}

// ---------------------------------------------------------------------------------------------
// The disk model: io_properties.yaml, or a quick measurement.

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
fn quick_model(file: &Arc<File>, fg: (u64, u64), bg: (u64, u64)) -> Result<DiskModel, BoxError> {
    let t = Duration::from_millis(500);
    let (read_iops, _) = measure(file, fg, false, true, 4096, 32, t)?;
    let (_, read_bw) = measure(file, fg, false, false, 1 << 20, 4, t)?;
    let (write_iops, _) = measure(file, bg, true, true, 4096, 32, t * 2)?;
    let (_, write_bw) = measure(file, bg, true, false, 1 << 20, 4, t * 2)?;
    let m = DiskModel::new(
        read_bw.max(1.0) as u64,
        write_bw.max(1.0) as u64,
        read_iops.max(1.0) as u64,
        write_iops.max(1.0) as u64,
    );
    m.validate()?;
    Ok(m)
}

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

// ---------------------------------------------------------------------------------------------
// The phases.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    /// The foreground alone, through the dispatcher: what the dispatcher's path costs.
    IdleDispatched,
    Unthrottled,
    Plain,
    IoThrottle,
    /// The dispatcher in latency-target mode: the foreground declares a p99 target.
    Target,
}

impl Phase {
    const ALL: [Phase; 6] = [
        Phase::Idle,
        Phase::IdleDispatched,
        Phase::Unthrottled,
        Phase::Plain,
        Phase::IoThrottle,
        Phase::Target,
    ];

    fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::IdleDispatched => "idle-disp",
            Phase::Unthrottled => "unthrottled",
            Phase::Plain => "plain",
            Phase::IoThrottle => "iothrottle",
            Phase::Target => "target",
        }
    }
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("constant bounds")
}

/// What the drivers record: foreground end-to-end latencies (ns) and compaction bytes.
struct Recorder {
    /// (whole phase, current second).
    fg: Mutex<(Histogram<u64>, Histogram<u64>)>,
    fg_errors: AtomicU64,
    bg_bytes: AtomicU64,
    bg_errors: AtomicU64,
}

impl Recorder {
    fn new() -> Self {
        Recorder {
            fg: Mutex::new((new_hist(), new_hist())),
            fg_errors: AtomicU64::new(0),
            bg_bytes: AtomicU64::new(0),
            bg_errors: AtomicU64::new(0),
        }
    }

    fn fg_latency(&self, d: Duration) {
        let ns = (d.as_nanos() as u64).max(1);
        if let Ok(mut h) = self.fg.lock() {
            h.0.saturating_record(ns);
            h.1.saturating_record(ns);
        }
    }
}

/// One second of one phase.
struct Row {
    phase: Phase,
    /// Seconds since the first phase started.
    t: f64,
    fg_iops: f64,
    fg_p50: Duration,
    fg_p99: Duration,
    /// Queue wait in the dispatcher (iothrottle phase only).
    fg_queue_p99: Option<Duration>,
    bg_mb_s: f64,
    busy: Option<f64>,
}

/// One phase's totals.
struct PhaseResult {
    phase: Phase,
    fg: Histogram<u64>,
    /// Seconds measured.
    elapsed: f64,
    bg_bytes: u64,
    /// Milliseconds the disk was busy (None if /sys cannot tell).
    busy_ms: Option<u64>,
    fg_errors: u64,
    bg_errors: u64,
}

impl PhaseResult {
    fn empty(phase: Phase) -> Self {
        PhaseResult {
            phase,
            fg: new_hist(),
            elapsed: 0.0,
            bg_bytes: 0,
            busy_ms: Some(0),
            fg_errors: 0,
            bg_errors: 0,
        }
    }

    fn add(&mut self, o: &PhaseResult) {
        self.fg.add(&o.fg).expect("same bounds");
        self.elapsed += o.elapsed;
        self.bg_bytes += o.bg_bytes;
        self.busy_ms = self.busy_ms.zip(o.busy_ms).map(|(a, b)| a + b);
        self.fg_errors += o.fg_errors;
        self.bg_errors += o.bg_errors;
    }

    fn fg_iops(&self) -> f64 {
        self.fg.len() as f64 / self.elapsed.max(1e-9)
    }

    fn bg_mb_s(&self) -> f64 {
        self.bg_bytes as f64 / self.elapsed.max(1e-9) / 1e6
    }

    fn busy(&self) -> Option<f64> {
        self.busy_ms
            .map(|b| b as f64 / (self.elapsed.max(1e-9) * 1000.0))
    }
}

fn q(h: &Histogram<u64>, q: f64) -> Duration {
    if h.is_empty() {
        Duration::ZERO
    } else {
        Duration::from_nanos(h.value_at_quantile(q))
    }
}

/// The foreground's and the compaction's files of one I/O path (io_uring, through a
/// dispatcher).
type Files = Arc<(ThrottledFile, ThrottledFile)>;

/// How the drivers issue their I/O in a phase. Every route runs its I/O on io_uring through
/// `ThrottledFile`: `Direct` and `Plain` on a pass-through dispatcher (a disk model far faster
/// than any disk, so it never holds a request back), `Dispatched` on a throttling one.
#[derive(Debug, Clone)]
enum Route {
    Direct(Files),
    Plain(Throttle<Uncapped>, Files),
    /// The dispatcher, the foreground's class (for its stats), the files.
    Dispatched(Arc<Dispatcher>, ClassId, Files),
}

impl Route {
    fn files(&self) -> &Files {
        match self {
            Route::Direct(f) | Route::Plain(_, f) | Route::Dispatched(_, _, f) => f,
        }
    }
}

struct Ctx {
    file: Arc<File>,
    fg_region: (u64, u64),
    bg_region: (u64, u64),
    bg_bytes: u64,
    interrupted: Arc<AtomicBool>,
    busy: DiskBusy,
}

/// A buffer of `len` bytes, each `fill`, for `ThrottledFile`.
fn disk_buf(len: u64, fill: u8) -> Result<DiskBuf, BoxError> {
    let mut b = DiskBuf::zeroed(len as usize)?;
    b.fill(fill);
    Ok(b)
}

/// The dispatcher stopped: the phase is over for this driver.
fn is_shutdown(e: &DiskError) -> bool {
    matches!(e, DiskError::Dispatch(_) | DiskError::Submit(_))
}

/// Runs one slice of `phase`, `secs` seconds long, with a row per second.
async fn run_phase(
    ctx: &Ctx,
    args: &Args,
    (phase, round): (Phase, u64),
    path: Route,
    secs: u64,
    rows: &mut Vec<Row>,
) -> Result<PhaseResult, BoxError> {
    let rec = Arc::new(Recorder::new());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    // Foreground readers, paced.
    let interval = Duration::from_secs_f64(args.fg_depth as f64 / args.fg_iops as f64);
    let start = Instant::now();
    for w in 0..args.fg_depth {
        let (rec, stop, path) = (rec.clone(), stop.clone(), path.clone());
        let region = ctx.fg_region;
        let mut buf = Some(disk_buf(READ_BYTES, 0)?);
        // The readers' first reads spread over one interval.
        let stagger = interval.mul_f64(w as f64 / args.fg_depth as f64);
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1).wrapping_mul(0x1000_0001));
            let slots = region.1 / READ_BYTES;
            let mut next = start + stagger;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                next += interval;
                let now = Instant::now();
                if next < now {
                    next = now;
                }
                let off = region.0 + rng.below(slots) * READ_BYTES;
                let b = match buf.take() {
                    Some(b) => b,
                    None => match disk_buf(READ_BYTES, 0) {
                        Ok(b) => b,
                        Err(_) => return,
                    },
                };
                let began = Instant::now();
                let r = path.files().0.read_at(b, off).await;
                rec.fg_latency(began.elapsed());
                match r {
                    Ok((b, n)) => {
                        if n != READ_BYTES as usize {
                            rec.fg_errors.fetch_add(1, Ordering::Relaxed);
                        }
                        buf = Some(b);
                    }
                    Err(e) if is_shutdown(&e) => return,
                    Err(_) => {
                        rec.fg_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Compaction writers.
    if !matches!(phase, Phase::Idle | Phase::IdleDispatched) {
        let next_write = Arc::new(AtomicU64::new(0));
        let slots = ctx.bg_region.1 / ctx.bg_bytes;
        for _ in 0..args.bg_depth {
            let (rec, stop, path) = (rec.clone(), stop.clone(), path.clone());
            let next_write = next_write.clone();
            let (base, bg_bytes) = (ctx.bg_region.0, ctx.bg_bytes);
            let mut buf = Some(disk_buf(bg_bytes, 0xC0)?);
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    // Relaxed: a lone counter handing out positions.
                    let n = next_write.fetch_add(1, Ordering::Relaxed) % slots;
                    let off = base + n * bg_bytes;
                    // The plain limiter: the write's bytes first, held while it runs.
                    let _permit = match &path {
                        Route::Plain(t, _) => match t.acquire(bg_bytes).await {
                            Ok(p) => Some(p),
                            Err(_) => return,
                        },
                        _ => None,
                    };
                    let b = match buf.take() {
                        Some(b) => b,
                        None => match disk_buf(bg_bytes, 0xC0) {
                            Ok(b) => b,
                            Err(_) => return,
                        },
                    };
                    let ok = match path.files().1.write_at(b, off).await {
                        Ok(b) => {
                            buf = Some(b);
                            true
                        }
                        Err(e) if is_shutdown(&e) => return,
                        Err(e) => {
                            eprintln!("compaction write: {e}");
                            false
                        }
                    };
                    if ok {
                        rec.bg_bytes.fetch_add(bg_bytes, Ordering::Relaxed);
                    } else {
                        rec.bg_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }

    // A row per second.
    let dispatcher = match &path {
        Route::Dispatched(d, fg, _) => Some((d.clone(), *fg)),
        _ => None,
    };
    let stats0 = match &dispatcher {
        Some((d, ..)) => Some(d.stats().await),
        None => None,
    };
    let mut last_stats: Option<DispatcherStats> = stats0.clone();
    let busy0 = ctx.busy.busy_ms();
    let (mut last_busy, mut last_t, mut last_bg) = (busy0, start, 0u64);
    for sec in 1..=secs {
        let at = start + Duration::from_secs(sec);
        while Instant::now() < at {
            if ctx.interrupted.load(Ordering::Relaxed) {
                stop.store(true, Ordering::Relaxed);
                return Err("interrupted".into());
            }
            let left = at.saturating_duration_since(Instant::now());
            tokio::time::sleep(left.min(Duration::from_millis(100))).await;
        }
        let now = Instant::now();
        let dt = (now - last_t).as_secs_f64();
        let second = {
            let mut h = rec.fg.lock().map_err(|_| "poisoned")?;
            std::mem::replace(&mut h.1, new_hist())
        };
        let fg_count = second.len();
        let bg = rec.bg_bytes.load(Ordering::Relaxed);
        let busy = ctx.busy.busy_ms();
        let fg_queue_p99 = match &dispatcher {
            Some((d, fg)) => {
                let s = d.stats().await;
                let delta = s.since(last_stats.as_ref().expect("set with the dispatcher"));
                last_stats = Some(s);
                Some(delta.classes[fg.index()].queue_wait_p99())
            }
            None => None,
        };
        let row = Row {
            phase,
            t: (round - 1 + sec) as f64,
            fg_iops: fg_count as f64 / dt,
            fg_p50: q(&second, 0.5),
            fg_p99: q(&second, 0.99),
            fg_queue_p99,
            bg_mb_s: (bg - last_bg) as f64 / dt / 1e6,
            busy: match (busy, last_busy) {
                (Some(b), Some(l)) => Some((b - l) as f64 / (dt * 1000.0)),
                _ => None,
            },
        };
        print_row(&row, round - 1 + sec);
        rows.push(row);
        last_busy = busy;
        last_t = now;
        last_bg = bg;
    }
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let bg_total = rec.bg_bytes.load(Ordering::Relaxed);
    let busy_end = ctx.busy.busy_ms();
    for t in tasks {
        let _ = t.await;
    }
    let fg = rec.fg.lock().map_err(|_| "poisoned")?.0.clone();
    Ok(PhaseResult {
        phase,
        fg,
        elapsed,
        bg_bytes: bg_total,
        busy_ms: busy_end.zip(busy0).map(|(b, l)| b - l),
        fg_errors: rec.fg_errors.load(Ordering::Relaxed),
        bg_errors: rec.bg_errors.load(Ordering::Relaxed),
    })
}

/// A few hundred reads by each route, not recorded: the rings' and the shards' first
/// wake-ups are not what the phases measure.
async fn warm_up(ctx: &Ctx, routes: &[&Files]) -> Result<(), BoxError> {
    let mut buf = disk_buf(READ_BYTES, 0)?;
    let slots = ctx.fg_region.1 / READ_BYTES;
    let mut rng = Rng(42);
    for i in 0..200 * routes.len() {
        let off = rng.below(slots) * READ_BYTES;
        let (b, _) = routes[i % routes.len()].0.read_at(buf, off).await?;
        buf = b;
    }
    Ok(())
}

/// Flushes and pauses, so that the previous step's write-back does not land in the next phase.
async fn settle(ctx: &Ctx, args: &Args) -> Result<(), BoxError> {
    let f = ctx.file.clone();
    tokio::task::spawn_blocking(move || f.sync_data()).await??;
    let end = Instant::now() + Duration::from_millis(args.settle_ms);
    while Instant::now() < end {
        if ctx.interrupted.load(Ordering::Relaxed) {
            return Err("interrupted".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn fmt_d(d: Duration) -> String {
    if d >= Duration::from_millis(10) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else if d >= Duration::from_millis(1) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.0} µs", d.as_secs_f64() * 1e6)
    }
}

fn print_header() {
    println!(
        "{:<11} {:>3} | {:>7} {:>12} {:>12} {:>14} | {:>8} | {:>5}",
        "phase", "s", "fg IOPS", "fg e2e p50", "fg e2e p99", "fg qwait p99", "bg MB/s", "util"
    );
}

fn print_row(r: &Row, sec: u64) {
    println!(
        "{:<11} {:>3} | {:>7.0} {:>12} {:>12} {:>14} | {:>8.1} | {:>5}",
        r.phase.name(),
        sec,
        r.fg_iops,
        fmt_d(r.fg_p50),
        fmt_d(r.fg_p99),
        r.fg_queue_p99.map_or("–".to_owned(), fmt_d),
        r.bg_mb_s,
        r.busy
            .map_or("?".to_owned(), |b| format!("{:.0}%", b * 100.0)),
    );
}

fn real_disk(args: &Args) -> Result<(), BoxError> {
    let parent = check_args(args)?;
    let bg_bytes = args.bg_kib * 1024;
    let region_bytes = args.fg_mib << 20;
    // The compaction cycles over whole writes of its region.
    let bg_region_len = (args.bg_mib << 20) / bg_bytes * bg_bytes;
    // Checked before the run: the buffers can be had.
    drop(AlignedBuf::new(bg_bytes as usize, 0)?);

    let dir = tempfile::Builder::new()
        .prefix("disk_throttle-")
        .tempdir_in(&parent)
        .map_err(|e| {
            format!(
                "cannot make a scratch directory in {}: {e}",
                parent.display()
            )
        })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        rt.spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("\ninterrupted: stopping and removing the scratch files");
                interrupted.store(true, Ordering::Relaxed);
            }
        });
    }
    let result = rt.block_on(async {
        let run = real_disk_inner(
            args,
            dir.path(),
            bg_bytes,
            region_bytes,
            bg_region_len,
            interrupted,
        );
        run.await
    });
    // The scratch directory goes whatever happened (TempDir's drop; said explicitly here).
    let path = dir.path().to_owned();
    if let Err(e) = dir.close() {
        eprintln!("could not remove {}: {e}", path.display());
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

async fn real_disk_inner(
    args: &Args,
    dir: &Path,
    bg_bytes: u64,
    region_bytes: u64,
    bg_region_len: u64,
    interrupted: Arc<AtomicBool>,
) -> Result<(), BoxError> {
    let path = dir.join("data");
    let file = Arc::new(open_direct(&path, true).map_err(|e| {
        format!(
            "cannot open {} with O_DIRECT: {e} (is --dir on a file system that supports it?)",
            path.display()
        )
    })?);
    let fg_region = (0, region_bytes);
    let bg_region = (region_bytes, bg_region_len);
    println!(
        "iothrottle disk_throttle: foreground 4 KiB O_DIRECT random reads vs a compaction of {} KiB O_DIRECT writes",
        args.bg_kib
    );
    println!(
        "  scratch file {} ({} MiB read by the foreground, {} MiB written by the compaction)",
        path.display(),
        args.fg_mib,
        args.bg_mib
    );
    // Write the whole file once (unwritten extents would read as zeros without touching the disk).
    let t = Instant::now();
    {
        let file = file.clone();
        let total = region_bytes + bg_region_len;
        let interrupted = interrupted.clone();
        tokio::task::spawn_blocking(move || -> Result<(), BoxError> {
            let buf = AlignedBuf::new(4 << 20, 0xA5)?;
            let mut off = 0;
            while off < total {
                if interrupted.load(Ordering::Relaxed) {
                    return Err("interrupted".into());
                }
                let n = (total - off).min(buf.len as u64) as usize;
                file.write_all_at(&buf.as_slice()[..n], off)
                    .map_err(|e| format!("writing the scratch file: {e}"))?;
                off += n as u64;
            }
            file.sync_all()?;
            Ok(())
        })
        .await??;
    }
    println!(
        "  wrote {} MiB in {:.1} s",
        (region_bytes + bg_region_len) >> 20,
        t.elapsed().as_secs_f64()
    );

    let disk = match &args.properties {
        Some(p) => {
            let m = DiskModel::from_properties(p)?;
            println!("  disk model from {}", p.display());
            m
        }
        None => {
            let t = Instant::now();
            let f = file.clone();
            let m = tokio::task::spawn_blocking(move || quick_model(&f, fg_region, bg_region))
                .await??;
            println!("  disk model measured in {:.1} s (O_DIRECT, 4 KiB random at depth 32, 1 MiB sequential at depth 4)", t.elapsed().as_secs_f64());
            m
        }
    };
    println!(
        "  reads {:.0} IOPS, {:.0} MB/s; writes {:.0} IOPS, {:.0} MB/s",
        disk.read_iops as f64,
        disk.read_bw as f64 / 1e6,
        disk.write_iops as f64,
        disk.write_bw as f64 / 1e6
    );
    let goal = Duration::from_micros(args.goal_us);
    // Pieces: at most the compaction's in-flight bound (below), but at least one 64 KiB write (a
    // slow disk would otherwise get tiny pieces, or none), never more than the goal.
    let smallest = disk.disk_time(&IoRequest::write(4096));
    if smallest > goal {
        return Err(format!(
            "the disk model says one 4 KiB write takes {} of disk time, more than the latency goal {}: raise --goal-us",
            fmt_d(smallest),
            fmt_d(goal)
        )
        .into());
    }
    // The compaction's bound: a quarter of the goal by default. The foreground's p99 grows by
    // about the real disk time of the compaction in flight ahead of a read, and a piece's
    // service took 1.5–1.9× its modelled disk time on this disk (p50 206–276 µs for 139–147 µs
    // modelled, load 2–3): at half the goal that was ~200–260 µs ahead of reads whose idle p99
    // is 300–400 µs, p99 1.45–1.59× idle (quiet machine) — at the target's edge. A quarter
    // halves it.
    let bg_bound = match (args.no_bg_bound, args.bg_in_flight_us) {
        (true, _) => None,
        (false, Some(us)) => Some(Duration::from_micros(us)),
        (false, None) => Some(goal / 4),
    };
    // A piece no larger than the compaction's bound (one piece alone always goes, so a larger
    // one would exceed the bound); without a bound, half the goal.
    let piece = match args.piece_us {
        Some(us) => Duration::from_micros(us),
        None => bg_bound
            .unwrap_or(goal / 2)
            .max(disk.disk_time(&IoRequest::write(64 << 10)))
            .min(goal),
    };
    let file_options = |max_piece: u64| FileOptions {
        write: true,
        create: false,
        max_piece: max_piece as usize,
        // The scratch file was written in full: nothing to reserve.
        reserve_writes: false,
        ..FileOptions::default()
    };
    let files = |d: &Arc<Dispatcher>, fg: ClassId, bg: ClassId| -> Result<Files, BoxError> {
        let piece = d
            .max_piece(IoKind::Write)
            .ok_or("the dispatcher's max cost is below one 4 KiB write")?
            .min(bg_bytes);
        let open = |class, piece| -> Result<ThrottledFile, BoxError> {
            let f = file.try_clone()?;
            Ok(ThrottledFile::from_file(
                d.clone(),
                class,
                f,
                &path,
                file_options(piece),
            )?)
        };
        Ok(Arc::new((open(fg, READ_BYTES)?, open(bg, piece)?)))
    };
    // One dispatcher for the iothrottle slices, an identical one for idle-disp (so that each
    // one's stats cover its own phase), and one in latency-target mode.
    let build = |target: Option<Duration>| -> Result<(Arc<Dispatcher>, ClassId, Files), BoxError> {
        let mut fg = ClassConfig::new("foreground", args.shares.0);
        if let Some(t) = target {
            fg = fg.with_latency_target(t);
        }
        let mut bg = ClassConfig::new("compaction", args.shares.1);
        if let Some(b) = bg_bound {
            bg = bg.with_max_in_flight(b);
        }
        let d = Dispatcher::builder()
            .disk(disk)
            .shards(args.shards)
            .pin_threads(false)
            .latency_goal(goal)
            .capped(!args.uncapped)
            .max_cost(piece.as_nanos() as u64)
            .class(fg)
            .class(bg)
            .build()?;
        let (fg, bg) = (d.class_id("foreground"), d.class_id("compaction"));
        let (fg, bg) = (fg.expect("configured above"), bg.expect("configured above"));
        let d = Arc::new(d);
        let f = files(&d, fg, bg)?;
        Ok((d, fg, f))
    };
    let (d, fg_class, io_files) = build(None)?;
    let (d_idle, _, idle_files) = build(None)?;
    // Built when the target is known (after the first idle slice, unless given).
    let mut target: Option<(Duration, Arc<Dispatcher>, Files)> = None;
    let build_target = |t: Duration| -> Result<(Duration, Arc<Dispatcher>, Files), BoxError> {
        let (d, _, f) = build(Some(t))?;
        Ok((t, d, f))
    };
    if let Some(us) = args.target_us {
        target = Some(build_target(Duration::from_micros(us))?);
    }
    // The unthrottled and plain phases' engine: io_uring through a dispatcher that never holds
    // a request back (a modelled disk a thousand times faster than any, uncapped), one class,
    // whole writes.
    let engine = Arc::new(
        Dispatcher::builder()
            .disk(DiskModel::new(1 << 40, 1 << 40, 1 << 30, 1 << 30))
            .shards(args.shards)
            .pin_threads(false)
            .capped(false)
            .class(ClassConfig::new("all", 1))
            .build()?,
    );
    let all = engine.class_id("all").expect("configured above");
    let direct_files = files(&engine, all, all)?;
    if direct_files.0.backend() != io_files.0.backend() {
        return Err("the pass-through and the throttled files use different I/O backends".into());
    }
    println!(
        "  I/O on {:?}; one 4 KiB read costs {} of disk time, one {} KiB write {}; latency goal {} ({}), pieces of at most {} KiB, compaction in flight at most {}",
        io_files.0.backend(),
        fmt_d(disk.disk_time(&IoRequest::read(READ_BYTES))),
        args.bg_kib,
        fmt_d(disk.disk_time(&IoRequest::write(bg_bytes))),
        fmt_d(goal),
        if args.uncapped { "uncapped" } else { "capped" },
        d.max_piece(IoKind::Write).map_or(0, |b| b / 1024),
        bg_bound.map_or("unbounded".to_owned(), fmt_d),
    );
    println!(
        "  foreground: {} readers, {} reads/s in total; compaction: {} writes in flight; plain limiter at {:.1} MB/s; {} s per phase\n",
        args.fg_depth,
        args.fg_iops,
        args.bg_depth,
        args.plain_rate as f64 / 1e6,
        args.phase_secs
    );

    let ctx = Ctx {
        busy: DiskBusy::new(&file),
        file: file.clone(),
        fg_region,
        bg_region,
        bg_bytes,
        interrupted,
    };
    warm_up(&ctx, &[&direct_files, &idle_files, &io_files]).await?;
    print_header();
    let mut rows = Vec::new();
    let mut results: Vec<PhaseResult> = Phase::ALL.iter().map(|p| PhaseResult::empty(*p)).collect();
    // Interleaved one-second slices, round after round, so that whatever else the machine does
    // falls on all phases alike; the unthrottled slice last, then a pause for its write-back.
    let order = [
        Phase::Idle,
        Phase::IdleDispatched,
        Phase::Plain,
        Phase::IoThrottle,
        Phase::Target,
        Phase::Unthrottled,
    ];
    for (round, phase) in (1..=args.phase_secs).flat_map(|r| order.map(|p| (r, p))) {
        let path = match phase {
            Phase::Idle | Phase::Unthrottled => Route::Direct(direct_files.clone()),
            Phase::Plain => {
                let cfg = BucketConfig::new(
                    Rate::per_second(args.plain_rate),
                    bg_bytes.max(args.plain_rate / 100),
                );
                Route::Plain(Throttle::<Uncapped>::new(cfg)?, direct_files.clone())
            }
            Phase::IoThrottle => Route::Dispatched(d.clone(), fg_class, io_files.clone()),
            Phase::IdleDispatched => {
                Route::Dispatched(d_idle.clone(), fg_class, idle_files.clone())
            }
            Phase::Target => {
                if target.is_none() {
                    // Both foreground-alone slices of the first round (idle and idle-disp,
                    // 2 × --fg-iops samples): one slice's p99 swings from slice to slice (on
                    // a shared machine one run's idle slices ranged from 0.3 to 4.5 ms).
                    let mut idle = results[0].fg.clone();
                    idle.add(&results[1].fg).expect("same bounds");
                    let t = q(&idle, 0.99).mul_f64(1.5).max(Duration::from_micros(100));
                    target = Some(build_target(t)?);
                }
                let (t, d, f) = target.as_ref().expect("built above");
                if round == 1 {
                    println!("  (latency target {})", fmt_d(*t));
                }
                Route::Dispatched(d.clone(), fg_class, f.clone())
            }
        };
        if phase == Phase::Idle {
            settle(&ctx, args).await?;
        }
        let r = run_phase(&ctx, args, (phase, round), path, 1, &mut rows).await?;
        let i = Phase::ALL.iter().position(|p| *p == phase).expect("listed");
        results[i].add(&r);
    }
    let bg_class = d.class_id("compaction").expect("configured above");
    d.shutdown();
    d_idle.shutdown();
    let (target_p99, d_target) = match &target {
        Some((t, d, _)) => (*t, d.clone()),
        None => return Err("the target phase did not run".into()),
    };
    d_target.shutdown();
    engine.shutdown();
    let stats_of = |d: &Dispatcher| {
        let s = d.stats_blocking();
        (
            s.classes[fg_class.index()].clone(),
            s.classes[bg_class.index()].clone(),
        )
    };
    let (io_fg, io_bg) = stats_of(&d);
    let (idle_fg, _) = stats_of(&d_idle);
    let (target_fg, target_bg) = stats_of(&d_target);

    // Side by side.
    println!();
    println!(
        "{:<11} | {:>10} {:>10} {:>10} {:>8} | {:>8} | {:>5} | {:>18}",
        "phase",
        "fg p50",
        "fg p99",
        "fg p999",
        "fg IOPS",
        "bg MB/s",
        "util",
        "dispatcher qwait p99"
    );
    println!(
        "{:<11} | {:>41} | {:>8} | {:>5} |",
        "", "foreground latency, end to end", "", ""
    );
    for r in &results {
        println!(
            "{:<11} | {:>10} {:>10} {:>10} {:>8.0} | {:>8.1} | {:>5} | {:>18}",
            r.phase.name(),
            fmt_d(q(&r.fg, 0.5)),
            fmt_d(q(&r.fg, 0.99)),
            fmt_d(q(&r.fg, 0.999)),
            r.fg_iops(),
            r.bg_mb_s(),
            r.busy()
                .map_or("?".to_owned(), |b| format!("{:.0}%", b * 100.0)),
            match r.phase {
                Phase::IoThrottle => format!("fg {}", fmt_d(io_fg.queue_wait_p99())),
                Phase::IdleDispatched => format!("fg {}", fmt_d(idle_fg.queue_wait_p99())),
                Phase::Target => format!(
                    "fg {} (target {})",
                    fmt_d(target_fg.queue_wait_p99()),
                    fmt_d(target_p99)
                ),
                _ => "–".to_owned(),
            },
        );
        if r.fg_errors + r.bg_errors > 0 {
            println!(
                "  ({} foreground and {} compaction I/O errors)",
                r.fg_errors, r.bg_errors
            );
        }
    }
    for (name, f, b) in [
        ("idle-disp", &idle_fg, None),
        ("iothrottle", &io_fg, Some(&io_bg)),
        ("target", &target_fg, Some(&target_bg)),
    ] {
        println!(
            "{name}, from the dispatcher's stats: fg queue wait p99 {}, service p99 {}, end to end p99 {}{}",
            fmt_d(f.queue_wait_p99()),
            fmt_d(f.service_p99()),
            fmt_d(f.latency_p99()),
            b.map_or(String::new(), |b| format!(
                "; compaction pieces {} (end to end p99 {}; modelled disk time {} each on average, service p50 {} p99 {})",
                b.requests,
                fmt_d(b.latency_p99()),
                fmt_d(Duration::from_nanos(b.tokens / b.requests.max(1))),
                fmt_d(b.service_p50()),
                fmt_d(b.service_p99()),
            )),
        );
    }
    let p99 = |p: Phase| {
        results
            .iter()
            .find(|r| r.phase == p)
            .map_or(Duration::ZERO, |r| q(&r.fg, 0.99))
    };
    let bw = |p: Phase| {
        results
            .iter()
            .find(|r| r.phase == p)
            .map_or(0.0, |r| r.bg_mb_s())
    };
    let (idle, io, plain) = (p99(Phase::Idle), p99(Phase::IoThrottle), p99(Phase::Plain));
    println!(
        "targets: iothrottle fg p99 / idle p99 = {:.2} (≤ 1.5); iothrottle compaction / plain = {:.2}× (≥ 3, with plain's p99 {} iothrottle's)",
        io.as_secs_f64() / idle.as_secs_f64().max(1e-9),
        bw(Phase::IoThrottle) / bw(Phase::Plain).max(1e-9),
        if plain > io { "worse than" } else { "NOT worse than" },
    );
    plot_real(args, &rows)?;
    println!("plot written to {}", args.plot.display());
    let us = |d: Duration| d.as_micros();
    println!(
        "summary: idle_p99_us={} unthrottled_p99_us={} unthrottled_bg_mb_s={:.0} plain_p99_us={} plain_bg_mb_s={:.0} iothrottle_p99_us={} iothrottle_bg_mb_s={:.0} target_p99_us={} target_bg_mb_s={:.0}",
        us(idle),
        us(p99(Phase::Unthrottled)),
        bw(Phase::Unthrottled),
        us(plain),
        bw(Phase::Plain),
        us(io),
        bw(Phase::IoThrottle),
        us(p99(Phase::Target)),
        bw(Phase::Target),
    );
    std::io::stdout().flush()?;
    Ok(())
}

fn phase_color(p: Phase) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match p {
        Phase::Idle => RGBColor(44, 160, 44),
        Phase::IdleDispatched => RGBColor(148, 103, 189),
        Phase::Unthrottled => RGBColor(214, 39, 40),
        Phase::Plain => RGBColor(255, 127, 14),
        Phase::IoThrottle => RGBColor(31, 119, 180),
        Phase::Target => RGBColor(23, 190, 207),
    }
}

fn plot_real(args: &Args, rows: &[Row]) -> Result<(), BoxError> {
    use plotters::prelude::*;

    let root = SVGBackend::new(&args.plot, (1000, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(380);
    let x_max = args.phase_secs as f64 + 0.5;
    let bw_max = rows.iter().map(|r| r.bg_mb_s).fold(1.0, f64::max) * 1.3;
    let lat_max = rows
        .iter()
        .map(|r| r.fg_p99.as_secs_f64() * 1e3)
        .fold(0.1, f64::max)
        * 1.3;
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "disk_throttle: compaction bandwidth by phase ({} KiB O_DIRECT writes)",
                args.bg_kib
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..x_max, 0.0..bw_max)?;
    chart
        .configure_mesh()
        .x_desc("round (one second of each phase per round)")
        .y_desc("compaction MB/s")
        .draw()?;
    for p in Phase::ALL {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.phase == p)
            .map(|r| (r.t, r.bg_mb_s))
            .collect();
        let c = phase_color(p);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(p.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            "foreground 4 KiB read latency, end to end, p99 per second",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..x_max, 0.0..lat_max)?;
    chart
        .configure_mesh()
        .x_desc("round (one second of each phase per round)")
        .y_desc("ms")
        .draw()?;
    for p in Phase::ALL {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.phase == p)
            .map(|r| (r.t, r.fg_p99.as_secs_f64() * 1e3))
            .collect();
        let c = phase_color(p);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(format!("{} p99", p.name()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The modelled-disk demo (`--modelled`).

mod modelled {
    use super::*;

    const DATA_FILE_BYTES: u64 = 64 << 20;
    const COMPACTION_FILE_BYTES: u64 = 256 << 20;

    /// Two classes on a modelled disk (`--rate`, `--iops`): the foreground runs the whole time,
    /// the compaction from a fifth of the run to a fifth before its end; while both run, the
    /// disk time splits by the shares. Buffered I/O on the blocking pool.
    pub(super) fn run(args: &Args) -> Result<(), BoxError> {
        if args.seconds == 0
            || args.rate == 0
            || args.iops == 0
            || args.fg_depth == 0
            || args.bg_depth == 0
        {
            return Err(
                "--seconds, --rate, --iops, --fg-depth and --bg-depth must be positive".into(),
            );
        }
        if args.bg_kib == 0 || args.bg_kib > MAX_BG_KIB {
            return Err(format!("--bg-kib must be in 1..={MAX_BG_KIB}").into());
        }
        check_plot_path(&args.plot)?;
        let bw = args.rate * 1_000_000;
        let disk = DiskModel::symmetric(bw, args.iops);
        let d = Arc::new(
            Dispatcher::builder()
                .disk(disk)
                .latency_goal(Duration::from_micros(args.goal_us))
                .shards(args.shards)
                .class(ClassConfig::new("foreground", args.shares.0))
                .class(ClassConfig::new("compaction", args.shares.1))
                .build()?,
        );
        let (fg, bg) = (d.class_id("foreground"), d.class_id("compaction"));
        let (fg, bg) = (fg.expect("configured above"), bg.expect("configured above"));
        let dir = tempfile::tempdir()?;
        let data_path = dir.path().join("data");
        {
            let mut f = File::create(&data_path)?;
            let chunk: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
            for _ in 0..DATA_FILE_BYTES / chunk.len() as u64 {
                f.write_all(&chunk)?;
            }
            f.sync_all()?;
        }
        let data = Arc::new(File::open(&data_path)?);
        let out = Arc::new(
            OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(dir.path().join("compaction-output"))?,
        );
        let bg_bytes = args.bg_kib * 1024;
        let total = args.seconds as f64;
        let bg_window = (total / 5.0, total - total / 5.0);
        let fg_share = args.shares.0 as f64 / (args.shares.0 + args.shares.1) as f64;
        println!(
            "modelled disk of {} MB/s and {} IOPS, {} s, shares {}:{} (fg should get {:.0}% of the disk time while both run)",
            args.rate, args.iops, args.seconds, args.shares.0, args.shares.1, fg_share * 100.0
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        rt.block_on(async {
            let mut drivers = Vec::new();
            for worker in 0..args.fg_depth {
                let (d, data, stop) = (d.clone(), data.clone(), stop.clone());
                drivers.push(tokio::spawn(async move {
                    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (worker as u64 + 1));
                    while !stop.load(Ordering::Relaxed) {
                        let offset = rng.below(DATA_FILE_BYTES / READ_BYTES) * READ_BYTES;
                        let data = data.clone();
                        let h = d.submit(fg, IoRequest::read(READ_BYTES), async move {
                            tokio::task::spawn_blocking(move || {
                                let mut buf = [0u8; READ_BYTES as usize];
                                data.read_at(&mut buf, offset)
                            })
                            .await
                        });
                        match h {
                            Ok(h) => {
                                if h.await.is_err() {
                                    return;
                                }
                            }
                            Err(_) => return,
                        }
                    }
                }));
            }
            let next_write = Arc::new(AtomicU64::new(0));
            let buf = Arc::new(vec![0xC0u8; bg_bytes as usize]);
            for _ in 0..args.bg_depth {
                let (d, out, stop) = (d.clone(), out.clone(), stop.clone());
                let (next_write, buf) = (next_write.clone(), buf.clone());
                drivers.push(tokio::spawn(async move {
                    tokio::time::sleep_until((start + Duration::from_secs_f64(bg_window.0)).into())
                        .await;
                    let end = start + Duration::from_secs_f64(bg_window.1);
                    while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                        let n = next_write.fetch_add(1, Ordering::Relaxed);
                        let base = (n * bg_bytes) % COMPACTION_FILE_BYTES;
                        let h = d.submit_split(bg, IoRequest::write(bg_bytes), |piece| {
                            let (out, buf) = (out.clone(), buf.clone());
                            async move {
                                tokio::task::spawn_blocking(move || {
                                    let r = piece.range;
                                    out.write_all_at(
                                        &buf[r.start as usize..r.end as usize],
                                        base + r.start,
                                    )
                                })
                                .await
                            }
                        });
                        match h {
                            Ok(h) => {
                                if h.await.is_err() {
                                    return;
                                }
                            }
                            Err(e) => {
                                eprintln!("cannot submit the compaction write: {e}");
                                return;
                            }
                        }
                    }
                }));
            }
            println!(
                "{:>5} | {:>8} {:>14} {:>14} | {:>8} {:>14} | {:>8}",
                "t (s)",
                "fg MB/s",
                "fg qwait p99",
                "fg e2e p99",
                "bg MB/s",
                "bg e2e p99",
                "fg disk"
            );
            let mut last = d.stats().await;
            let mut last_t = start;
            for sec in 1..=args.seconds {
                tokio::time::sleep_until((start + Duration::from_secs(sec)).into()).await;
                let now_stats = d.stats().await;
                let now = Instant::now();
                let dt = (now - last_t).as_secs_f64();
                let delta = now_stats.since(&last);
                let (f, b) = (&delta.classes[fg.index()], &delta.classes[bg.index()]);
                let tokens = (f.tokens + b.tokens).max(1) as f64;
                println!(
                    "{:>5} | {:>8.1} {:>14} {:>14} | {:>8.1} {:>14} | {:>7.1}%",
                    sec,
                    f.bytes as f64 / dt / 1e6,
                    fmt_d(f.queue_wait_p99()),
                    fmt_d(f.latency_p99()),
                    b.bytes as f64 / dt / 1e6,
                    fmt_d(b.latency_p99()),
                    f.tokens as f64 / tokens * 100.0,
                );
                last = now_stats;
                last_t = now;
            }
            stop.store(true, Ordering::Relaxed);
            for t in drivers {
                let _ = t.await;
            }
        });
        d.shutdown();
        Ok(())
    }
}
