//! Real I/O: 4 KiB O_DIRECT random reads through `ThrottledFile` (io_uring backend, an
//! unthrottled dispatcher) against the same reads issued directly on an io_uring from the
//! benchmark thread, at queue depth 1 and 32. The ratio is the dispatch overhead per request.
//! `throttled_file_on_shard` issues the depth-1 reads from a task running on the shard, as a
//! thread-per-core engine does (no hop from the caller's thread to the shard and back).
//!
//! ```text
//! cargo bench --bench benches -- disk
//! ```
//!
//! The scratch file (64 MiB) lives under the target directory, which must be on a real disk.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use io_uring::{opcode, types, IoUring};
use iothrottle::disk::{AlignedBuf, Backend, FileOptions, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, IoRequest};
use iothrottle::Rate;

const FILE: u64 = 64 << 20;

struct Rng(u64);
impl Rng {
    fn offset(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % (FILE / ALIGN as u64)) * ALIGN as u64
    }
}

/// `iters` reads kept `depth` deep on a raw ring; returns the elapsed time.
fn direct(
    ring: &mut IoUring,
    fd: i32,
    bufs: &mut [AlignedBuf],
    depth: usize,
    iters: u64,
    rng: &mut Rng,
) -> Duration {
    let start = Instant::now();
    let mut issued = 0u64;
    let mut done = 0u64;
    let mut push = |ring: &mut IoUring, slot: usize, rng: &mut Rng| {
        let e = opcode::Read::new(types::Fd(fd), bufs[slot].as_mut_ptr(), ALIGN as u32)
            .offset(rng.offset())
            .build()
            .user_data(slot as u64);
        // SAFETY: buffer `slot` serves one read at a time and outlives it (we wait for all).
        unsafe { ring.submission().push(&e).unwrap() };
    };
    while issued < iters.min(depth as u64) {
        push(ring, issued as usize, rng);
        issued += 1;
    }
    while done < issued {
        ring.submit_and_wait(1).unwrap();
        let slots: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in slots {
            assert_eq!(res, ALIGN as i32);
            done += 1;
            if issued < iters {
                push(ring, slot as usize, rng);
                issued += 1;
            }
        }
    }
    start.elapsed()
}

/// `iters` reads kept `depth` deep through the dispatcher.
fn throttled(
    rt: &tokio::runtime::Runtime,
    file: &Arc<ThrottledFile>,
    depth: usize,
    iters: u64,
    rng: &mut Rng,
) -> Duration {
    let offsets: Vec<u64> = (0..iters).map(|_| rng.offset()).collect();
    let start = Instant::now();
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        let mut next = 0usize;
        let spawn = |set: &mut tokio::task::JoinSet<AlignedBuf>, buf: AlignedBuf, off: u64| {
            let f = file.clone();
            set.spawn(async move {
                let (buf, n) = f.read_at(buf, off).await.unwrap();
                assert_eq!(n, ALIGN);
                buf
            });
        };
        while next < depth.min(offsets.len()) {
            spawn(&mut set, AlignedBuf::zeroed(ALIGN).unwrap(), offsets[next]);
            next += 1;
        }
        while let Some(buf) = set.join_next().await {
            let buf = buf.unwrap();
            if next < offsets.len() {
                spawn(&mut set, buf, offsets[next]);
                next += 1;
            }
        }
    });
    start.elapsed()
}

/// `iters` reads at depth 1 issued from a task running *on* the shard (thread-per-core use: the
/// engine's code runs on the shards), so no request crosses threads except the completion.
fn on_shard(
    rt: &tokio::runtime::Runtime,
    d: &Dispatcher,
    class: ClassId,
    file: &Arc<ThrottledFile>,
    iters: u64,
    rng: &mut Rng,
) -> Duration {
    let offsets: Vec<u64> = (0..iters).map(|_| rng.offset()).collect();
    let f = file.clone();
    let job = d
        .submit(class, IoRequest::tokens(1), async move {
            let mut buf = AlignedBuf::zeroed(ALIGN).unwrap();
            let start = Instant::now();
            for off in offsets {
                let (b, n) = f.read_at(buf, off).await.unwrap();
                assert_eq!(n, ALIGN);
                buf = b;
            }
            start.elapsed()
        })
        .unwrap();
    rt.block_on(job).unwrap()
}

pub fn disk(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("bench.dat");
    {
        // Write the file once (plain writes, synced): reads then read real blocks.
        let chunk = vec![0x5a_u8; 1 << 20];
        let mut f = std::fs::File::create(&path).unwrap();
        for _ in 0..FILE >> 20 {
            std::io::Write::write_all(&mut f, &chunk).unwrap();
        }
        f.sync_all().unwrap();
    }
    let mut b = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .rate(Rate::per_second(Rate::MAX_PER_SECOND))
        .limit(1 << 50)
        .threshold(1 << 20)
        .batch(1 << 30)
        .disk(DiskModel::new(
            1_000_000_000,
            1_000_000_000,
            100_000,
            100_000,
        ));
    let class = b.add_class(ClassConfig::new("c", 100)).unwrap();
    let dispatcher = Arc::new(b.build().unwrap());
    let opts = FileOptions {
        backend: Backend::IoUring,
        ..FileOptions::default()
    };
    let file = Arc::new(ThrottledFile::open(dispatcher.clone(), class, &path, opts).unwrap());
    let raw = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    let mut ring = IoUring::new(64).unwrap();
    let mut bufs: Vec<AlignedBuf> = (0..32)
        .map(|_| AlignedBuf::zeroed(ALIGN).unwrap())
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rng = Rng(0x1234_5678_9abc_def1);

    let mut g = c.benchmark_group("disk/read_4k");
    for depth in [1usize, 32] {
        g.bench_function(BenchmarkId::new("direct_io_uring", depth), |bch| {
            bch.iter_custom(|iters| {
                direct(
                    &mut ring,
                    raw.as_raw_fd(),
                    &mut bufs,
                    depth,
                    iters,
                    &mut rng,
                )
            })
        });
        g.bench_function(BenchmarkId::new("throttled_file", depth), |bch| {
            bch.iter_custom(|iters| throttled(&rt, &file, depth, iters, &mut rng))
        });
        if depth == 1 {
            g.bench_function(BenchmarkId::new("throttled_file_on_shard", depth), |bch| {
                bch.iter_custom(|iters| on_shard(&rt, &dispatcher, class, &file, iters, &mut rng))
            });
        }
    }
    g.finish();
}

criterion::criterion_group!(benches, disk);
