//! The first thing to run: a foreground class of random 4 KiB reads and a background
//! "compaction" of large sequential writes share a (modelled) disk through the dispatcher, on
//! real file I/O in a scratch directory.
//!
//! ```text
//! cargo run --release --example disk_throttle
//! cargo run --release --example disk_throttle -- --shares 1:1 --seconds 5 --capped
//! ```
//!
//! The foreground runs the whole time; the compaction starts after a fifth of the run and stops
//! a fifth before the end. While both run, the disk time (tokens) splits by the shares. Each
//! second a table row shows MB/s, IOPS and the 99th percentile queue wait per class; at the end
//! a plot of per-class throughput and disk-time share over time is written as SVG.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use iothrottle::dispatcher::{
    ClassConfig, ClassStats, DiskModel, Dispatcher, DispatcherStats, IoRequest,
};

/// Throttle a foreground reader and a background compaction on one disk, and plot it.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Disk bandwidth to model, MB/s (reads and writes). The dispatcher keeps the disk at
    /// exactly this much work.
    #[arg(long, default_value_t = 200)]
    rate: u64,
    /// Disk IOPS to model (reads and writes).
    #[arg(long, default_value_t = 20_000)]
    iops: u64,
    /// How long to run, seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Shards (threads); default: the available cores.
    #[arg(long)]
    shards: Option<usize>,
    /// Shares of foreground:background, each in 1..=1000.
    #[arg(long, default_value = "4:1", value_parser = parse_shares)]
    shares: (u32, u32),
    /// Capped release: tokens come back only as the I/O completes.
    #[arg(long)]
    capped: bool,
    /// Where to write the plot (SVG).
    #[arg(long, default_value = "disk_throttle.svg")]
    plot: PathBuf,
    /// Foreground reads kept in flight.
    #[arg(long, default_value_t = 32)]
    fg_depth: usize,
    /// Compaction writes kept in flight.
    #[arg(long, default_value_t = 4)]
    bg_depth: usize,
    /// Size of one compaction write, KiB (split into pieces the bucket can hold).
    #[arg(long, default_value_t = 1024)]
    bg_kib: u64,
}

fn parse_shares(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("expected fg:bg, like 4:1, got {s:?}"))?;
    let p = |x: &str| {
        x.trim()
            .parse::<u32>()
            .map_err(|e| format!("{x:?} is not a number of shares: {e}"))
    };
    Ok((p(a)?, p(b)?))
}

const DATA_FILE_BYTES: u64 = 64 << 20;
const COMPACTION_FILE_BYTES: u64 = 256 << 20;
const READ_BYTES: u64 = 4096;

const SAMPLES_PER_SECOND: u64 = 4;
const SAMPLE: Duration = Duration::from_millis(1000 / SAMPLES_PER_SECOND);

/// One sample's figures.
struct Row {
    /// End of the sample, seconds since the start.
    t: f64,
    /// Length of the sample, seconds.
    dt: f64,
    fg: ClassStats,
    bg: ClassStats,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    if args.seconds == 0 || args.rate == 0 || args.iops == 0 {
        return Err("--seconds, --rate and --iops must be positive".into());
    }

    // The disk and the dispatcher.
    let bw = args.rate * 1_000_000;
    let disk = DiskModel::new(bw, bw, args.iops, args.iops);
    // Pieces of at most 500 µs of disk time: a foreground read never waits behind more than
    // one such piece per shard of compaction.
    let mut builder = Dispatcher::builder()
        .disk(disk)
        .capped(args.capped)
        .max_cost(DiskModel::TOKENS_PER_SECOND / 2000)
        .class(ClassConfig::new("foreground", args.shares.0))
        .class(ClassConfig::new("compaction", args.shares.1));
    if let Some(n) = args.shards {
        builder = builder.shards(n);
    }
    let d = Arc::new(builder.build()?);
    let (fg, bg) = (d.class_id("foreground"), d.class_id("compaction"));
    let (fg, bg) = (fg.expect("configured above"), bg.expect("configured above"));

    // Scratch files.
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
    let read_cost = d.cost(&IoRequest::read(READ_BYTES));
    let write_cost = d.cost(&IoRequest::write(bg_bytes));
    let total = args.seconds as f64;
    let bg_window = (total / 5.0, total - total / 5.0);
    println!(
        "iothrottle disk_throttle: {} s on a modelled disk of {} MB/s and {} IOPS",
        args.seconds, args.rate, args.iops
    );
    println!(
        "  {} shards, {} mode, scratch files in {}",
        d.shards(),
        if d.is_capped() { "capped" } else { "uncapped" },
        dir.path().display()
    );
    println!(
        "  foreground: random 4 KiB reads, {} in flight, {} shares; one read costs {:.1} µs of disk time",
        args.fg_depth,
        args.shares.0,
        read_cost as f64 / 1e3
    );
    println!(
        "  compaction: sequential {} KiB writes, {} in flight, {} shares, from {:.0} s to {:.0} s; one write costs {:.2} ms (pieces of at most {:.2} ms)",
        args.bg_kib,
        args.bg_depth,
        args.shares.1,
        bg_window.0,
        bg_window.1,
        write_cost as f64 / 1e6,
        d.max_cost() as f64 / 1e6,
    );
    let fg_share = args.shares.0 as f64 / (args.shares.0 + args.shares.1) as f64;
    println!(
        "  while both run, the foreground should get {:.0}% of the disk time\n",
        fg_share * 100.0
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let rows = rt.block_on(async {
        let mut drivers = Vec::new();
        // Foreground readers.
        for worker in 0..args.fg_depth {
            let (d, data, stop) = (d.clone(), data.clone(), stop.clone());
            drivers.push(tokio::spawn(async move {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (worker as u64 + 1);
                while !stop.load(Ordering::Relaxed) {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let offset = (rng % (DATA_FILE_BYTES / READ_BYTES)) * READ_BYTES;
                    let data = data.clone();
                    let h = d.submit(fg, IoRequest::read(READ_BYTES), async move {
                        let mut buf = [0u8; READ_BYTES as usize];
                        data.read_at(&mut buf, offset)
                    });
                    match h {
                        Ok(h) => match h.await {
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => eprintln!("read failed: {e}"),
                            Err(_) => return,
                        },
                        Err(_) => return,
                    }
                }
            }));
        }
        // Compaction writers.
        let next_write = Arc::new(AtomicU64::new(0));
        let buf = Arc::new(vec![0xC0u8; bg_bytes as usize]);
        for _ in 0..args.bg_depth {
            let (d, out, stop) = (d.clone(), out.clone(), stop.clone());
            let (next_write, buf) = (next_write.clone(), buf.clone());
            drivers.push(tokio::spawn(async move {
                let begin = start + Duration::from_secs_f64(bg_window.0);
                let end = start + Duration::from_secs_f64(bg_window.1);
                tokio::time::sleep_until(begin.into()).await;
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    let n = next_write.fetch_add(1, Ordering::Relaxed);
                    let base = (n * bg_bytes) % COMPACTION_FILE_BYTES;
                    let h = d.submit_split(bg, IoRequest::write(bg_bytes), |piece| {
                        let (out, buf) = (out.clone(), buf.clone());
                        async move {
                            let r = piece.range;
                            out.write_all_at(&buf[r.start as usize..r.end as usize], base + r.start)
                        }
                    });
                    match h {
                        Ok(h) => match h.await {
                            Ok(results) => {
                                if let Some(Err(e)) = results.into_iter().find(|r| r.is_err()) {
                                    eprintln!("write failed: {e}");
                                }
                            }
                            Err(_) => return,
                        },
                        Err(e) => {
                            eprintln!("cannot submit the compaction write: {e}");
                            return;
                        }
                    }
                }
            }));
        }

        // One row per second.
        println!(
            "{:>5} | {:>8} {:>8} {:>10} | {:>8} {:>8} {:>10} | {:>8} {:>6}",
            "t (s)",
            "fg MB/s",
            "fg IOPS",
            "fg p99",
            "bg MB/s",
            "bg IOPS",
            "bg p99",
            "fg disk",
            "busy"
        );
        // The table has a row per second; the plot a point per quarter second.
        let mut rows = Vec::new();
        let mut last_sample: DispatcherStats = d.stats().await;
        let mut last_second = last_sample.clone();
        let (mut last_t, mut last_second_t) = (start, start);
        for tick in 1..=args.seconds * SAMPLES_PER_SECOND {
            let at = start + SAMPLE * tick as u32;
            tokio::time::sleep_until(at.into()).await;
            let now_stats = d.stats().await;
            let now = Instant::now();
            let delta = now_stats.since(&last_sample);
            rows.push(Row {
                t: (now - start).as_secs_f64(),
                dt: (now - last_t).as_secs_f64(),
                fg: delta.classes[fg.index()].clone(),
                bg: delta.classes[bg.index()].clone(),
            });
            last_sample = now_stats.clone();
            last_t = now;
            if tick % SAMPLES_PER_SECOND != 0 {
                continue;
            }
            let dt = (now - last_second_t).as_secs_f64();
            let delta = now_stats.since(&last_second);
            let (f, b) = (&delta.classes[fg.index()], &delta.classes[bg.index()]);
            let tokens = (f.tokens + b.tokens).max(1) as f64;
            println!(
                "{:>5} | {:>8.1} {:>8.0} {:>10} | {:>8.1} {:>8.0} {:>10} | {:>7.1}% {:>5.0}%",
                tick / SAMPLES_PER_SECOND,
                f.bytes as f64 / dt / 1e6,
                f.requests as f64 / dt,
                fmt_wait(f.queue_wait_p99()),
                b.bytes as f64 / dt / 1e6,
                b.requests as f64 / dt,
                fmt_wait(b.queue_wait_p99()),
                f.tokens as f64 / tokens * 100.0,
                tokens / dt / DiskModel::TOKENS_PER_SECOND as f64 * 100.0,
            );
            last_second = now_stats;
            last_second_t = now;
        }
        stop.store(true, Ordering::Relaxed);
        for t in drivers {
            let _ = t.await;
        }
        rows
    });
    d.shutdown();
    let total_stats = d.stats_blocking();

    // Summary.
    println!();
    for (name, c) in [
        ("foreground", &total_stats.classes[fg.index()]),
        ("compaction", &total_stats.classes[bg.index()]),
    ] {
        println!(
            "{name:>10}: {:>8} requests, {:>7.1} MB, queue wait p50 {} p99 {} max {}",
            c.requests,
            c.bytes as f64 / 1e6,
            fmt_wait(c.queue_wait_p50()),
            fmt_wait(c.queue_wait_p99()),
            fmt_wait(c.queue_wait_max()),
        );
    }
    let both: Vec<&Row> = rows
        .iter()
        .filter(|r| r.t - r.dt >= bg_window.0 + 0.5 && r.t <= bg_window.1)
        .collect();
    if !both.is_empty() {
        let f: u64 = both.iter().map(|r| r.fg.tokens).sum();
        let b: u64 = both.iter().map(|r| r.bg.tokens).sum();
        println!(
            "while both ran: foreground got {:.1}% of the disk time (shares say {:.1}%)",
            f as f64 / (f + b).max(1) as f64 * 100.0,
            fg_share * 100.0
        );
    }
    plot(&args, &rows, fg_share, bg_window)?;
    println!("plot written to {}", args.plot.display());
    Ok(())
}

fn fmt_wait(d: Duration) -> String {
    if d >= Duration::from_millis(1) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.0} µs", d.as_secs_f64() * 1e6)
    }
}

fn plot(
    args: &Args,
    rows: &[Row],
    fg_share: f64,
    bg_window: (f64, f64),
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;

    let root = SVGBackend::new(&args.plot, (1000, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(380);
    let x_max = args.seconds as f64;
    let mbps = |c: &ClassStats, dt: f64| c.bytes as f64 / dt / 1e6;
    let mut series_fg = Vec::new();
    let mut series_bg = Vec::new();
    let mut share_fg = Vec::new();
    let mut share_bg = Vec::new();
    for r in rows {
        let dt = r.dt.max(1e-3);
        series_fg.push((r.t, mbps(&r.fg, dt)));
        series_bg.push((r.t, mbps(&r.bg, dt)));
        let tokens = (r.fg.tokens + r.bg.tokens).max(1) as f64;
        share_fg.push((r.t, r.fg.tokens as f64 / tokens * 100.0));
        share_bg.push((r.t, r.bg.tokens as f64 / tokens * 100.0));
    }
    let y_max = series_fg
        .iter()
        .chain(&series_bg)
        .map(|p| p.1)
        .fold(1.0, f64::max)
        * 1.45;

    let fg_color = RGBColor(31, 119, 180);
    let bg_color = RGBColor(255, 127, 14);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!(
                "disk_throttle: {} MB/s, {} IOPS disk, shares {}:{}, {}",
                args.rate,
                args.iops,
                args.shares.0,
                args.shares.1,
                if args.capped { "capped" } else { "uncapped" }
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("MB/s")
        .draw()?;
    chart
        .draw_series(LineSeries::new(series_fg, fg_color.stroke_width(2)))?
        .label("foreground 4 KiB reads, MB/s")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], fg_color));
    chart
        .draw_series(LineSeries::new(series_bg, bg_color.stroke_width(2)))?
        .label("compaction writes, MB/s")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], bg_color));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;

    let mut chart = ChartBuilder::on(&bottom)
        .caption("share of disk time (tokens)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..135.0)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("% of disk time")
        .draw()?;
    chart
        .draw_series(LineSeries::new(share_fg, fg_color.stroke_width(2)))?
        .label("foreground")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], fg_color));
    chart
        .draw_series(LineSeries::new(share_bg, bg_color.stroke_width(2)))?
        .label("compaction")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], bg_color));
    for (i, (share, color)) in [(fg_share, fg_color), (1.0 - fg_share, bg_color)]
        .into_iter()
        .enumerate()
    {
        let y = share * 100.0;
        let series = chart.draw_series(DashedLineSeries::new(
            vec![(bg_window.0, y), (bg_window.1, y)],
            6,
            4,
            color.mix(0.7).stroke_width(1),
        ))?;
        if i == 0 {
            series
                .label("by the shares (dashed)")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.5)));
        }
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
