//! The modelled-disk demo (`--modelled`): shares between two classes on a modelled disk.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use iothrottle::dispatcher::{
    ClassConfig, DiskModel, Dispatcher, DispatcherBuilder, Figures, IoRequest,
};

use crate::args::{Args, MAX_BG_KIB};
use crate::checks::check_plot_path;
use crate::direct::Rng;
use crate::report::fmt_d;
use crate::{BoxError, READ_BYTES};

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
        return Err("--seconds, --rate, --iops, --fg-depth and --bg-depth must be positive".into());
    }
    if args.bg_kib == 0 || args.bg_kib > MAX_BG_KIB {
        return Err(format!("--bg-kib must be in 1..={MAX_BG_KIB}").into());
    }
    check_plot_path(&args.plot)?;
    let bw = args.rate * 1_000_000;
    let disk = DiskModel::symmetric(Figures {
        iops: args.iops,
        bandwidth: bw,
    });
    let d = Arc::new(
        Dispatcher::builder()
            .disk(disk)
            .latency_goal(args.goal_us.map_or(
                DispatcherBuilder::DEFAULT_LATENCY_GOAL,
                Duration::from_micros,
            ))
            .shards(args.shards.unwrap_or(1))
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
            "t (s)", "fg MB/s", "fg qwait p99", "fg e2e p99", "bg MB/s", "bg e2e p99", "fg disk"
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
