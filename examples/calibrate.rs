//! Measures the disk under a directory and writes an io-properties file in Seastar's format.
//!
//! `cargo run --release --example calibrate -- --dir PATH [--out io_properties.yaml] [--seconds N]`
//!
//! Random 4 KiB O_DIRECT reads and writes at growing queue depths until saturation, sequential
//! 1 MiB reads and writes, on a 1 GiB scratch file that is written once and removed. The
//! result loads with `DiskModel::from_properties`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use iothrottle::disk::{calibrate_detailed, CalibrateOptions};

#[derive(Parser, Debug)]
#[command(about = "Measure a disk like Seastar's iotune and write io_properties.yaml")]
struct Args {
    /// A directory on the disk to measure (a scratch file is created there and removed).
    #[arg(long)]
    dir: PathBuf,
    /// Where to write the io-properties file.
    #[arg(long, default_value = "io_properties.yaml")]
    out: PathBuf,
    /// Seconds of measurement (5..=60); writing the scratch file once comes on top.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Scratch file size in MiB (at least 64; keep it at or above 1024 so caches matter less).
    #[arg(long, default_value_t = 1024)]
    file_mib: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let options = CalibrateOptions {
        seconds: args.seconds,
        file_size: args.file_mib << 20,
        ..CalibrateOptions::default()
    };
    let cal = match calibrate_detailed(&args.dir, &options) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("calibrate: {e}");
            return ExitCode::FAILURE;
        }
    };
    let d = &cal.properties.disks[0];
    let ladder = |l: &[iothrottle::disk::DepthStep]| {
        l.iter()
            .map(|s| format!("qd{}={:.0}", s.depth, s.iops))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!("mountpoint: {}", d.mountpoint());
    println!("random read ladder:  {}", ladder(&cal.read_ladder));
    println!("random write ladder: {}", ladder(&cal.write_ladder));
    println!(
        "read_iops={} (qd {}) write_iops={} (qd {}) read_bandwidth={} write_bandwidth={}",
        d.read_iops,
        cal.read_depth,
        d.write_iops,
        cal.write_depth,
        d.read_bandwidth,
        d.write_bandwidth
    );
    println!(
        "calibrate: read_qd={} write_qd={} fill_s={:.2} wall_s={:.2}",
        cal.read_depth,
        cal.write_depth,
        cal.fill.as_secs_f64(),
        cal.elapsed.as_secs_f64()
    );
    if let Err(e) = cal.properties.write(&args.out) {
        eprintln!("calibrate: cannot write {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    println!("wrote {}", args.out.display());
    ExitCode::SUCCESS
}
