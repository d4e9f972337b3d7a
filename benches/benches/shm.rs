//! The bucket in shared memory against the in-process bucket (feature `shm`).
//!
//! Ids (`shm/<case>/<who>`), one op = `grab(1)` + `deficiency`, a `replenish()` every 64:
//!
//! | case | bucket |
//! |---|---|
//! | `local_grab_deficiency` | `SharedTokenBucket::new` (this process's memory) |
//! | `shm_grab_deficiency` | `SharedMemoryBucket::open` on a file in `/dev/shm` (or the temp dir) |
//!
//! `1t`: the bench thread. `2t`: two threads of this process on one bucket. `2p`: this
//! process and a second one (this binary re-run with `IOTHROTTLE_BENCH_SHM_CHILD`), each
//! running the ops on the one file from a common start on `CLOCK_MONOTONIC`, set once the
//! second process is up; the slower one's time is reported (per op of one process). Both run on the highest rate and largest limit,
//! so nothing ever throttles: the cases measure where the state lives, nothing else.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion};

use iothrottle::{
    BucketConfig, Clock, Rate, SharedMemoryBucket, SharedTokenBucket, SystemMonotonicClock,
    Uncapped,
};

use crate::threads::two_threads;

const REPLENISH_EVERY: u64 = 64;

fn cfg() -> BucketConfig {
    BucketConfig::new(
        Rate::per_second(Rate::MAX_PER_SECOND),
        BucketConfig::MAX_LIMIT,
    )
}

fn op<C: Clock>(b: &SharedTokenBucket<Uncapped, C>, i: u64) {
    if i.is_multiple_of(REPLENISH_EVERY) {
        b.replenish();
    }
    let tail = b.grab(1);
    black_box(b.deficiency(tail));
}

fn now_ns() -> u64 {
    SystemMonotonicClock.now().as_nanos() as u64
}

/// Spins until `start`, runs `iters` ops, returns the time they took.
fn timed(b: &SharedMemoryBucket, iters: u64, start: u64) -> Duration {
    while now_ns() < start {
        std::hint::spin_loop();
    }
    let t = SystemMonotonicClock.now();
    for i in 0..iters {
        op(b, i);
    }
    SystemMonotonicClock.now() - t
}

/// In the second process of a `2p` case: runs the ops and prints their time. Returns
/// whether this process was one (then `main` must not run the benchmarks).
pub fn child_if_asked() -> bool {
    let Ok(spec) = std::env::var("IOTHROTTLE_BENCH_SHM_CHILD") else {
        return false;
    };
    let (path, iters) = spec.split_once('|').expect("path|iters");
    let b = SharedMemoryBucket::<Uncapped>::open(path, cfg()).expect("open the bench bucket");
    // Ready: the first process then sends the common start time.
    println!("ready");
    let mut start = String::new();
    std::io::stdin().read_line(&mut start).unwrap();
    let elapsed = timed(&b, iters.parse().unwrap(), start.trim().parse().unwrap());
    println!("{}", elapsed.as_nanos());
    true
}

fn two_processes(b: &SharedMemoryBucket, path: &Path, iters: u64) -> Duration {
    use std::io::{BufRead as _, Write as _};
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(
            "IOTHROTTLE_BENCH_SHM_CHILD",
            format!("{}|{iters}", path.display()),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the second process");
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    // Both start together, once the second process is up and waiting.
    let start = now_ns() + 2_000_000;
    writeln!(child.stdin.take().unwrap(), "{start}").unwrap();
    let mine = timed(b, iters, start);
    line.clear();
    out.read_line(&mut line).unwrap();
    child.wait().unwrap();
    let theirs: u64 = line.trim().parse().unwrap();
    mine.max(Duration::from_nanos(theirs))
}

fn bucket_file() -> (Option<tempfile::TempDir>, PathBuf) {
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .expect("a scratch directory");
    let path = dir.path().join("bench.bucket");
    (Some(dir), path)
}

/// The `shm` group.
pub fn shm(c: &mut Criterion) {
    let mut g = c.benchmark_group("shm");
    let local = Arc::new(SharedTokenBucket::<Uncapped>::new(cfg()).unwrap());
    let (_dir, path) = bucket_file();
    let mapped = Arc::new(SharedMemoryBucket::<Uncapped>::open(&path, cfg()).unwrap());
    local.replenish();
    mapped.replenish();
    let mut i = 0u64;
    g.bench_function(BenchmarkId::new("local_grab_deficiency", "1t"), |b| {
        b.iter(|| {
            op(&local, i);
            i = i.wrapping_add(1);
        })
    });
    g.bench_function(BenchmarkId::new("shm_grab_deficiency", "1t"), |b| {
        b.iter(|| {
            op(&mapped, i);
            i = i.wrapping_add(1);
        })
    });
    g.bench_function(BenchmarkId::new("local_grab_deficiency", "2t"), |b| {
        b.iter_custom(|iters| {
            two_threads(false, |_| {
                let b = Arc::clone(&local);
                move || {
                    for i in 0..iters {
                        op(&b, i);
                    }
                }
            })
        })
    });
    g.bench_function(BenchmarkId::new("shm_grab_deficiency", "2t"), |b| {
        b.iter_custom(|iters| {
            two_threads(false, |_| {
                let b = Arc::clone(&mapped);
                move || {
                    for i in 0..iters {
                        op(&b, i);
                    }
                }
            })
        })
    });
    g.bench_function(BenchmarkId::new("shm_grab_deficiency", "2p"), |b| {
        b.iter_custom(|iters| two_processes(&mapped, &path, iters))
    });
    g.finish();
}

criterion::criterion_group!(benches, shm);
