//! The main job: does the dispatcher protect foreground reads from a compaction on a **real
//! disk**, and at what bandwidth, compared with no throttling and with a plain rate limiter?
//! This file runs the phases in turn; beside it: the flags (`args.rs`), the checks before any
//! work (`checks.rs`), O_DIRECT buffers and files (`direct.rs`), the quick disk model
//! (`quick_model.rs`), the phases and their drivers (`phases.rs`), where the shards' drivers run
//! (`placement.rs`), the open-loop schedule
//! (`open_loop.rs`), the report (`report.rs`), the plot (`plot.rs`) and the modelled demo
//! (`modelled.rs`); the readers wake at their arrivals on the crate's own timerfd
//! (`src/dispatcher/shard_timer.rs`, compiled in).
//!
//! ```text
//! cargo run --release --example disk_throttle
//! cargo run --release --example disk_throttle -- --saturate      # a spinning thread per core
//! cargo run --release --example disk_throttle -- --properties io_properties.yaml --dir /data
//! cargo run --release --example disk_throttle -- --modelled      # the modelled-disk demo
//! ```
//!
//! 1. **Disk model**: measured in a few seconds with O_DIRECT, or loaded from a Seastar
//!    `io_properties.yaml` (`--properties`). The dispatcher is the builder's defaults plus one
//!    line for the compaction class (docs/disk.md, "Recommended configuration").
//! 2. **Phases**, run as interleaved slices (`--slice-ms`, one of each phase per round,
//!    `--rounds` rounds), on a scratch file under `--dir`, removed at the end:
//!    - `idle`: the foreground alone: random 4 KiB O_DIRECT reads at `--fg-iops`, open loop;
//!    - `unthrottled`: the foreground plus a compaction of `--bg-kib` O_DIRECT writes,
//!      `--bg-depth` in flight, as fast as the disk takes them;
//!    - `plain`: the compaction through a plain rate limiter at `--plain-rate`;
//!    - `iothrottle`: **thread-per-core**: the readers and the compaction run on the
//!      dispatcher's shards (`Dispatcher::spawn_on`), their I/O issued by the shard that runs
//!      them. The readers go to the shards pinned to the CPUs that take the disk's interrupts
//!      (`disk::completion_cpus`, `Dispatcher::shards_on`) and the compaction to the others,
//!      when there is such a split; `--spread` puts both on every shard in turn;
//!    - `cross`: the same dispatcher configuration, the readers and the compaction on a tokio
//!      multi-thread runtime submitting from its threads;
//!    - `target`: thread-per-core in latency-target mode (`ClassConfig::with_latency_target`).
//!
//!    `idle`, `unthrottled` and `plain` issue the same I/O (`ThrottledFile` on io_uring) from
//!    the tokio runtime through a pass-through dispatcher that never holds a request back.
//!    One `ThrottledFile` per dispatcher serves both classes (`read_at_in` / `write_at_in`).
//! 3. **Latency from arrival.** Each of `--fg-depth` readers has a fixed schedule of arrivals
//!    (together `--fg-iops`); a read's latency counts from its scheduled arrival to its
//!    completion, and a reader that falls behind never moves its schedule: the backlog shows as
//!    latency (`open_loop.rs`). A reader wakes for its arrival on a timerfd of its own runtime
//!    (`shard_timer.rs`): tokio's timer ticks in whole milliseconds and would wake it up to 2 ms late,
//!    more on a runtime that parks than on a shard that polls, ten times a 4 KiB read's own
//!    latency. The `lag p99` column (arrival to issue) shows what is left, and `io p99` (issue
//!    to completion, as the reader sees it) the read's own path: the two split a phase's tail
//!    between waking for the arrival and the I/O.
//! 4. `--saturate` runs one spinning thread per core for the whole run.
//!
//! Per slice a row, with the disk's utilisation (`util`), the share of the CPUs' time the
//! hypervisor ran something else while they wanted to run (`steal`, where it reports it) and,
//! for the dispatcher's phases, how often a shard found its core wanted by another thread while
//! it idle-polled and backed off (`b/o`, `ShardStats::idle_poll_backoffs`); per
//! phase the pooled figures, the median over rounds and the worst round;
//! an SVG plot (bandwidth; latency on a log axis); one machine-readable `summary:` line.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::disk::{completion_cpus, FileOptions, ThrottledFile};
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures, IoRequest};
use iothrottle::{BucketConfig, Rate, Throttle, Uncapped};

mod args;
mod checks;
mod direct;
mod modelled;
mod open_loop;
mod phases;
mod placement;
mod plot;
mod quick_model;
mod report;
mod stall;
// The crate's own timerfd (its shards' short sleeps), compiled here for the readers' arrivals.
#[path = "../../src/dispatcher/shard_timer.rs"]
#[allow(dead_code)] // the example arms and awaits it; the shards' helpers stay unused
mod shard_timer;

use args::Args;
use checks::check_args;
use direct::{open_direct, AlignedBuf, DiskBusy};
use phases::{run_slice, settle, warm_up, Ctx, Io, Phase, Route};
use placement::Placement;
use quick_model::quick_model;
use report::{fmt_d, print_header, q, PhaseResult};
use stall::StallWatch;

const READ_BYTES: u64 = 4096;

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

/// One spinning thread per core until dropped (`--saturate`).
struct Spinners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    fn start() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    // Relaxed: a flag polled until set; nothing else is published with it.
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        // Relaxed: see the spinning loop.
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
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
    // The cross-thread phase's submitters, and the idle/plain/unthrottled drivers.
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
    let result = rt.block_on(real_disk_inner(
        args,
        dir.path(),
        (bg_bytes, region_bytes, bg_region_len),
        interrupted,
    ));
    // The scratch directory goes whatever happened (TempDir's drop; said explicitly here).
    let path = dir.path().to_owned();
    if let Err(e) = dir.close() {
        eprintln!("could not remove {}: {e}", path.display());
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

/// The recommended configuration (docs/disk.md): the builder's defaults, the compaction a
/// background class (its disk time in flight bounded by the goal). The flags only override what
/// they name.
fn dispatcher(
    args: &Args,
    disk: DiskModel,
    target: Option<Duration>,
    file: &File,
    path: &Path,
) -> Result<(Arc<Dispatcher>, Arc<Io>), BoxError> {
    let mut b = Dispatcher::builder().disk(disk).capped(!args.uncapped);
    if let Some(us) = args.goal_us {
        b = b.latency_goal(Duration::from_micros(us));
    }
    if let Some(s) = args.shards {
        b = b.shards(s);
    }
    if let Some(us) = args.idle_poll_us {
        b = b.idle_poll(Duration::from_micros(us));
    }
    let mut fg = ClassConfig::new("foreground", args.shares.0);
    if let Some(t) = target {
        fg = fg.with_latency_target(t);
    }
    let bg = match (args.no_bg_bound, args.bg_in_flight_us) {
        (true, _) => ClassConfig::new("compaction", args.shares.1),
        (false, Some(us)) => ClassConfig::background("compaction", args.shares.1)
            .with_max_in_flight(Duration::from_micros(us)),
        (false, None) => ClassConfig::background("compaction", args.shares.1),
    };
    let fg = b.add_class(fg)?;
    let bg = b.add_class(bg)?;
    let d = Arc::new(b.build()?);
    let io = open_io(&d, (fg, bg), file, path)?;
    Ok((d, io))
}

fn open_io(
    d: &Arc<Dispatcher>,
    (fg, bg): (ClassId, ClassId),
    file: &File,
    path: &Path,
) -> Result<Arc<Io>, BoxError> {
    let options = FileOptions {
        write: true,
        // The scratch file was written in full: nothing to reserve.
        reserve_writes: false,
        ..FileOptions::default()
    };
    let file = ThrottledFile::from_file(d.clone(), fg, file.try_clone()?, path, options)?;
    Ok(Arc::new(Io { file, fg, bg }))
}

async fn real_disk_inner(
    args: &Args,
    dir: &Path,
    (bg_bytes, region_bytes, bg_region_len): (u64, u64, u64),
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
        "iothrottle disk_throttle: foreground 4 KiB O_DIRECT random reads (open loop, from arrival) vs a compaction of {} KiB O_DIRECT writes",
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
        disk.read.iops as f64,
        disk.read.bandwidth as f64 / 1e6,
        disk.write.iops as f64,
        disk.write.bandwidth as f64 / 1e6
    );
    let (d, io) = dispatcher(args, disk, None, &file, &path)?;
    let (d_cross, cross_io) = dispatcher(args, disk, None, &file, &path)?;
    // Thread-per-core placement: the reads where the disk's completions arrive.
    let irq: Vec<usize> = completion_cpus(&path)?.iter().map(|c| c.cpu).collect();
    let placement = Arc::new(Placement::new(d.shards(), &d.shards_on(&irq), args.spread));
    // Built when the target is known (after the first idle slice, unless given).
    let mut target: Option<(Duration, Arc<Dispatcher>, Arc<Io>)> = None;
    if let Some(us) = args.target_us {
        let t = Duration::from_micros(us);
        let (dt, io) = dispatcher(args, disk, Some(t), &file, &path)?;
        target = Some((t, dt, io));
    }
    // The idle, unthrottled and plain phases' engine: io_uring through a dispatcher that never
    // holds a request back (a modelled disk a thousand times faster than any, uncapped).
    let engine = Arc::new(
        Dispatcher::builder()
            .disk(DiskModel::symmetric(Figures {
                iops: 1 << 30,
                bandwidth: 1 << 40,
            }))
            .capped(false)
            .class(ClassConfig::new("all", 1))
            .build()?,
    );
    let all = engine.class_id("all").expect("configured above");
    let direct = open_io(&engine, (all, all), &file, &path)?;
    if direct.file.backend() != io.file.backend() {
        return Err("the pass-through and the throttled files use different I/O backends".into());
    }
    println!(
        "  I/O on {:?}, {} shards; dispatcher: latency goal {} ({}), compaction in flight at most {}, pieces of {} KiB (compaction) and {} KiB (foreground); one 4 KiB read costs {}, one {} KiB write {}",
        io.file.backend(),
        d.shards(),
        fmt_d(d.latency_goal()),
        if args.uncapped { "uncapped" } else { "capped" },
        d.class_config(io.bg)
            .and_then(|c| c.max_in_flight())
            .map_or("unbounded".to_owned(), fmt_d),
        io.file.piece_size(io.bg, iothrottle::dispatcher::IoKind::Write).unwrap_or(0) / 1024,
        io.file.piece_size(io.fg, iothrottle::dispatcher::IoKind::Read).unwrap_or(0) / 1024,
        fmt_d(disk.disk_time(&IoRequest::read(READ_BYTES))),
        args.bg_kib,
        fmt_d(disk.disk_time(&IoRequest::write(bg_bytes))),
    );
    println!(
        "  foreground: {} readers, {} reads/s in total, open loop; compaction: {} writes in flight; plain limiter at {:.1} MB/s; {} rounds of {} ms slices{}",
        args.fg_depth,
        args.fg_iops,
        args.bg_depth,
        args.plain_rate as f64 / 1e6,
        args.rounds,
        args.slice_ms,
        if args.saturate { "; a spinning thread per core (--saturate)" } else { "" },
    );
    println!(
        "  thread-per-core: {}; the disk interrupts CPUs {irq:?}\n  cross-thread: the compaction's transfers run on shards {:?}\n",
        placement.describe(),
        cross_io.file.background_shards(),
    );

    let ctx = Ctx {
        busy: DiskBusy::new(&file),
        stall: args.stall_watch.then(StallWatch::start),
        file: file.clone(),
        fg_region,
        bg_region,
        bg_bytes,
        interrupted,
    };
    let spinners = args.saturate.then(Spinners::start);
    warm_up(&ctx, &[&direct, &io, &cross_io]).await?;
    print_header();
    let mut rows = Vec::new();
    let mut results: Vec<PhaseResult> = Phase::ALL.iter().map(|p| PhaseResult::empty(*p)).collect();
    for (round, phase) in (1..=args.rounds).flat_map(|r| Phase::ALL.map(|p| (r, p))) {
        let route = match phase {
            Phase::Idle | Phase::Unthrottled => Route::Direct(direct.clone()),
            Phase::Plain => {
                let cfg = BucketConfig::new(
                    Rate::per_second(args.plain_rate),
                    bg_bytes.max(args.plain_rate / 100),
                );
                Route::Plain(Throttle::<Uncapped>::new(cfg)?, direct.clone())
            }
            Phase::IoThrottle => Route::Dispatched {
                d: d.clone(),
                io: io.clone(),
                on: Some(placement.clone()),
            },
            Phase::Cross => Route::Dispatched {
                d: d_cross.clone(),
                io: cross_io.clone(),
                on: None,
            },
            Phase::Target => {
                if target.is_none() {
                    let idle = &results[Phase::Idle.index()].fg;
                    let t = q(idle, 0.99).mul_f64(1.5).max(Duration::from_micros(100));
                    let (dt, tio) = dispatcher(args, disk, Some(t), &file, &path)?;
                    warm_up(&ctx, &[&tio]).await?;
                    println!("  (latency target {})", fmt_d(t));
                    target = Some((t, dt, tio));
                }
                let (_, dt, tio) = target.as_ref().expect("built above");
                Route::Dispatched {
                    d: dt.clone(),
                    io: tio.clone(),
                    on: Some(placement.clone()),
                }
            }
        };
        if phase == Phase::Idle {
            settle(&ctx, args).await?;
        }
        let row = run_slice(&ctx, args, (phase, round), route).await?;
        results[phase.index()].add(&row);
        rows.push(row);
    }
    drop(spinners);
    let panics = d.panics() + d_cross.panics();
    d.shutdown();
    d_cross.shutdown();
    engine.shutdown();
    let target_p99 = match &target {
        Some((t, dt, _)) => {
            dt.shutdown();
            *t
        }
        None => return Err("the target phase did not run".into()),
    };
    if panics > 0 {
        return Err(format!("{panics} tasks panicked on the shards").into());
    }

    report::print_phases(&results, target_p99);
    report::print_outliers(&rows, args.stall_watch);
    plot::plot_real(args, &rows)?;
    println!("plot written to {}", args.plot.display());
    report::print_summary(&results);
    std::io::stdout().flush()?;
    Ok(())
}
