//! The main job's flags, and the checks that need no disk (also compiled into
//! `tests/disk_throttle_main.rs`).

use std::path::PathBuf;

use clap::Parser;

/// Foreground reads against a background compaction on a real disk: idle, unthrottled, a
/// plain rate limiter, and the dispatcher (thread-per-core, cross-thread, latency target).
#[derive(Debug, Parser)]
#[command(version)]
pub struct Args {
    /// Directory for the scratch files (a temporary directory is made inside it and removed at
    /// the end). Must be on a real disk, not tmpfs. Default: ./target, else /var/tmp.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Load the disk model from a Seastar io_properties.yaml instead of measuring it.
    #[arg(long)]
    pub properties: Option<PathBuf>,
    /// Run the modelled-disk demo instead (shares between two classes on a modelled disk).
    #[arg(long)]
    pub modelled: bool,
    /// Rounds: each round runs one slice of every phase, interleaved, so that whatever else
    /// the machine does falls on all phases alike (`--phase-secs` is another name for it).
    #[arg(long, visible_alias = "phase-secs", default_value_t = 6)]
    pub rounds: u64,
    /// Length of one slice, milliseconds (a phase runs `--rounds` slices).
    #[arg(long, default_value_t = 1000)]
    pub slice_ms: u64,
    /// Foreground readers: each has its own fixed schedule of arrivals; a read is issued when
    /// its reader is free, and its latency counts from its scheduled arrival.
    #[arg(long, default_value_t = 4)]
    pub fg_depth: usize,
    /// Foreground reads per second, all readers together (open loop: the schedule never
    /// waits for the reads).
    #[arg(long, default_value_t = 2000)]
    pub fg_iops: u64,
    /// Size of one compaction write, KiB (a multiple of 4, at most 65536).
    #[arg(long, default_value_t = 1024)]
    pub bg_kib: u64,
    /// Compaction writes in flight; 0 runs the foreground alone (each route's own cost, with
    /// no compaction beside it).
    #[arg(long, default_value_t = 4)]
    pub bg_depth: usize,
    /// The plain rate limiter's rate, bytes per second: a number with an optional unit
    /// (50MB/s, 50MiB/s, 50000000).
    #[arg(long, default_value = "50MB/s", value_parser = parse_bytes_rate)]
    pub plain_rate: u64,
    /// The dispatcher's latency goal, microseconds. Default: the builder's
    /// (`DispatcherBuilder::DEFAULT_LATENCY_GOAL`), the recommended configuration.
    #[arg(long)]
    pub goal_us: Option<u64>,
    /// The most disk time the compaction may hold in flight, microseconds
    /// (`ClassConfig::with_max_in_flight`). Default: a background class's bound, the goal
    /// divided by `ClassConfig::BACKGROUND_GOAL_DIVISOR` (the recommended configuration).
    #[arg(long)]
    pub bg_in_flight_us: Option<u64>,
    /// No in-flight bound on the compaction (for comparison).
    #[arg(long)]
    pub no_bg_bound: bool,
    /// The `target` phase: the foreground's p99 latency target, microseconds
    /// (`ClassConfig::with_latency_target`). Default: 1.5 × the first round's idle p99.
    #[arg(long)]
    pub target_us: Option<u64>,
    /// The shards' idle poll, microseconds (`DispatcherBuilder::idle_poll`; 0 turns it off).
    /// Default: the builder's (`DispatcherBuilder::DEFAULT_IDLE_POLL`).
    #[arg(long)]
    pub idle_poll_us: Option<u64>,
    /// Uncapped dispatcher (the goal only sizes the burst).
    #[arg(long)]
    pub uncapped: bool,
    /// Foreground and compaction shares in the dispatcher, fg:bg.
    #[arg(long, default_value = "1000:100", value_parser = parse_shares)]
    pub shares: (u32, u32),
    /// Dispatcher shards (threads). Default: the builder's (one per core).
    #[arg(long)]
    pub shards: Option<usize>,
    /// Thread-per-core phases: readers and compaction on every shard in turn, wherever the
    /// disk's interrupts arrive. Default: the readers on the shards pinned to the CPUs that
    /// take them, the compaction on the others.
    #[arg(long)]
    pub spread: bool,
    /// One spinning thread per core for the whole run (every phase): protection must hold when
    /// the cores are busy.
    #[arg(long)]
    pub saturate: bool,
    /// Watch the machine: a thread pinned to each CPU sleeps 5 ms at a time, and each slice
    /// reports how late they woke (`stall`): a machine that did not run the job. Off by
    /// default: its 200 wake-ups a second per CPU preempt what the phases measure.
    #[arg(long)]
    pub stall_watch: bool,
    /// Size of the foreground's region of the scratch file, MiB.
    #[arg(long, default_value_t = 1024)]
    pub fg_mib: u64,
    /// Size of the compaction's region, MiB (it cycles over it).
    #[arg(long, default_value_t = 256)]
    pub bg_mib: u64,
    /// Pause after each round (after its unthrottled slice), milliseconds, so that its
    /// write-back does not land in the next round.
    #[arg(long, default_value_t = 3000)]
    pub settle_ms: u64,
    /// Where to write the plot (SVG).
    #[arg(long, default_value = "disk_throttle.svg")]
    pub plot: PathBuf,
    /// Modelled demo only: disk bandwidth, MB/s.
    #[arg(long, default_value_t = 200)]
    pub rate: u64,
    /// Modelled demo only: disk IOPS.
    #[arg(long, default_value_t = 20_000)]
    pub iops: u64,
    /// Modelled demo only: run time, seconds.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
}

/// The largest compaction write, KiB.
pub const MAX_BG_KIB: u64 = 64 * 1024;

/// Every value checked before anything runs (the checks that need no file system).
pub fn check_values(args: &Args) -> Result<(), String> {
    let positive = [
        ("--rounds", args.rounds),
        ("--slice-ms", args.slice_ms),
        ("--fg-depth", args.fg_depth as u64),
        ("--fg-iops", args.fg_iops),
        ("--bg-kib", args.bg_kib),
        ("--fg-mib", args.fg_mib),
        ("--bg-mib", args.bg_mib),
    ];
    for (flag, v) in positive {
        if v == 0 {
            return Err(format!("{flag} must be positive"));
        }
    }
    for (flag, v) in [
        ("--goal-us", args.goal_us),
        ("--target-us", args.target_us),
        ("--shards", args.shards.map(|s| s as u64)),
    ] {
        if v == Some(0) {
            return Err(format!("{flag} must be positive"));
        }
    }
    if args.bg_in_flight_us == Some(0) {
        return Err("--bg-in-flight-us must be positive (--no-bg-bound removes the bound)".into());
    }
    if args.rounds > 600 || args.slice_ms > 60_000 {
        return Err("--rounds is at most 600, --slice-ms 60000".into());
    }
    if !args.bg_kib.is_multiple_of(4) || args.bg_kib > MAX_BG_KIB {
        return Err(format!(
            "--bg-kib must be a multiple of 4 (O_DIRECT) and at most {MAX_BG_KIB}, got {}",
            args.bg_kib
        ));
    }
    if args.fg_depth > 1024 || args.bg_depth > 256 || args.shards.is_some_and(|s| s > 64) {
        return Err("--fg-depth is at most 1024, --bg-depth 256, --shards 64".into());
    }
    if args.bg_mib * 1024 < 4 * args.bg_kib || args.bg_mib > 1 << 20 || args.fg_mib > 1 << 20 {
        return Err(format!(
            "--bg-mib must hold at least four compaction writes; --fg-mib and --bg-mib are at most 1 TiB (got {} and {})",
            args.fg_mib, args.bg_mib
        ));
    }
    if args.settle_ms > 60_000 {
        return Err("--settle-ms must be at most 60000".into());
    }
    if args.fg_iops > 1_000_000 {
        return Err("--fg-iops must be at most 1000000".into());
    }
    Ok(())
}

/// `fg:bg` shares, each in 1..=1000.
pub fn parse_shares(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("expected fg:bg, like 4:1, got {s:?}"))?;
    let p = |x: &str| {
        let n = x
            .trim()
            .parse::<u32>()
            .map_err(|e| format!("{x:?} is not a number of shares: {e}"))?;
        if (1..=1000).contains(&n) {
            Ok(n)
        } else {
            Err(format!("shares must be in 1..=1000, got {n}"))
        }
    };
    Ok((p(a)?, p(b)?))
}

/// `50MB/s`, `50 MiB/s`, `1.5GB/s`, `50000000`: bytes per second, positive.
pub fn parse_bytes_rate(s: &str) -> Result<u64, String> {
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
