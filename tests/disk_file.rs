#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `ThrottledFile`: real O_DIRECT I/O through the dispatcher, on io_uring and on the blocking
//! pool; bad input; completions releasing capped tokens.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::disk::{dispatcher, rt};
use iothrottle::disk::{AlignedBuf, Backend, FileOptions, Resolved, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{ClassConfig, DiskModel, Dispatcher, Figures, IoRequest};
use iothrottle::DiskError;

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn options(backend: Backend) -> FileOptions {
    FileOptions {
        backend,
        max_piece: Some(64 * 1024),
        ..FileOptions::read_write()
    }
}

fn round_trip(backend: Backend, expect: Resolved) {
    let dir = scratch();
    let (d, class) = dispatcher(true);
    let f =
        ThrottledFile::open(d.clone(), class, dir.path().join("data"), options(backend)).unwrap();
    assert_eq!(f.backend(), expect);
    let rt = rt();
    let len = 1 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    let buf = AlignedBuf::from_slice(&data).unwrap();
    let (res, buf) = rt.block_on(f.write_at(buf, 8 * ALIGN as u64));
    res.unwrap();
    assert_eq!(buf.len(), len);
    let (n, back) = rt.block_on(f.read_at(AlignedBuf::zeroed(len).unwrap(), 8 * ALIGN as u64));
    assert_eq!(n.unwrap(), len);
    assert!(back[..] == data[..], "read back what was written");
    // Read past the end: short, not an error.
    let (n, _) = rt.block_on(f.read_at(
        AlignedBuf::zeroed(4 * ALIGN).unwrap(),
        (8 * ALIGN + len - ALIGN) as u64,
    ));
    assert_eq!(n.unwrap(), ALIGN);
    // Each 64 KiB piece was its own dispatcher request: 16 + 16 + 1.
    let stats = d.stats_blocking();
    assert_eq!(stats.classes[class.index()].requests, 33);
    // Capped: every completion gave its tokens back.
    rt.block_on(d.stats());
    let s = d.bucket_state();
    assert_eq!(s.ceil.unwrap().wrapping_sub(s.tail), d.limit());
}

#[test]
fn round_trip_on_io_uring() {
    round_trip(Backend::IoUring, Resolved::IoUring);
}

#[test]
fn round_trip_on_the_blocking_pool() {
    round_trip(Backend::Blocking, Resolved::Blocking);
}

#[test]
fn unaligned_offsets_and_pieces_are_refused_before_any_io() {
    let dir = scratch();
    let (d, class) = dispatcher(false);
    let path = dir.path().join("data");
    let f = ThrottledFile::open(d.clone(), class, &path, options(Backend::Auto)).unwrap();
    let rt = rt();
    let err = rt
        .block_on(f.write_at(AlignedBuf::zeroed(ALIGN).unwrap(), 100))
        .0
        .unwrap_err();
    assert!(matches!(
        err,
        DiskError::Unaligned {
            what: "offset",
            value: 100,
            align: 4096
        }
    ));
    let err = rt
        .block_on(f.read_at(AlignedBuf::zeroed(ALIGN).unwrap(), 512))
        .0
        .unwrap_err();
    assert!(matches!(err, DiskError::Unaligned { what: "offset", .. }));
    let err = rt
        .block_on(f.write_at(AlignedBuf::zeroed(ALIGN).unwrap(), u64::MAX - 4095))
        .0
        .unwrap_err();
    assert!(matches!(err, DiskError::OffsetOverflow { .. }));
    // Nothing was written or even submitted.
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    assert_eq!(d.stats_blocking().classes[class.index()].requests, 0);
    // Unaligned buffers cannot be made at all.
    assert!(matches!(
        AlignedBuf::zeroed(1000),
        Err(DiskError::Unaligned {
            what: "buffer length",
            ..
        })
    ));
    let bad_piece = FileOptions {
        max_piece: Some(1000),
        ..FileOptions::read_write()
    };
    assert!(matches!(
        ThrottledFile::open(d, class, &path, bad_piece),
        Err(DiskError::Unaligned {
            what: "max piece size",
            value: 1000,
            ..
        })
    ));
}

#[test]
fn a_piece_too_costly_for_the_dispatcher_is_refused_before_any_write() {
    let dir = scratch();
    let mut b = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .max_cost(200_000)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1_000_000_000,
        }));
    let class = b.add_class(ClassConfig::new("io", 100)).unwrap();
    let d = Arc::new(b.build().unwrap());
    let path = dir.path().join("data");
    // 1 MiB pieces cost ~1 ms of disk time, above the 0.2 ms allowed.
    let opts = FileOptions {
        max_piece: Some(1 << 20),
        ..FileOptions::read_write()
    };
    let f = ThrottledFile::open(d.clone(), class, &path, opts).unwrap();
    let err = rt()
        .block_on(f.write_at(AlignedBuf::zeroed(4 << 20).unwrap(), 0))
        .0
        .unwrap_err();
    assert!(matches!(err, DiskError::Submit(_)), "{err:?}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
}

#[test]
fn file_systems_without_o_direct_are_a_typed_error() {
    let (d, class) = dispatcher(false);
    // procfs refuses O_DIRECT with EINVAL, as FUSE file systems and old tmpfs do.
    let err = ThrottledFile::open(d, class, "/proc/version", FileOptions::default()).unwrap_err();
    match err {
        DiskError::DirectIoUnsupported { path, fs } => {
            assert_eq!(path, Path::new("/proc/version"));
            assert_eq!(fs, "proc");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn memory_file_systems_are_not_disks() {
    let shm = Path::new("/dev/shm");
    let dir = tempfile::tempdir_in(shm).expect("/dev/shm is a tmpfs here");
    let (d, class) = dispatcher(false);
    let path = dir.path().join("data");
    let err = ThrottledFile::open(d, class, &path, FileOptions::read_write()).unwrap_err();
    assert!(
        matches!(err, DiskError::NotADisk { fs: "tmpfs", .. }),
        "{err:?}"
    );
    assert!(!path.exists(), "nothing created");
}

/// The I/O runs without blocking the shard: a write that cannot complete yet (into a full
/// pipe) is in flight on the only shard while another request on that shard runs to the end;
/// and in capped mode its tokens are held until the write completes, then released.
#[test]
fn io_in_flight_does_not_block_the_shard_and_holds_capped_tokens() {
    let (mut rd, wr) = common::disk::full_pipe();
    let (d, class) = dispatcher(true);
    let opts = FileOptions {
        backend: Backend::IoUring,
        write: true,
        reserve_writes: false, // a pipe has no blocks to reserve
        ..FileOptions::default()
    };
    let f = Arc::new(ThrottledFile::from_file(d.clone(), class, wr, "pipe", opts).unwrap());
    let rt = rt();
    rt.block_on(async {
        let writer = f.clone();
        let write = tokio::spawn(async move {
            writer
                .write_at(AlignedBuf::from_slice(&[9u8; ALIGN]).unwrap(), 0)
                .await
                .0
        });
        tokio::task::yield_now().await;
        // Another request on the same (only) shard runs to completion meanwhile. Were the write
        // blocking the shard's thread this would never finish (the guard fails the test
        // instead of hanging).
        let other = d
            .submit(class, IoRequest::read(4096), async { 42 })
            .unwrap();
        let v = tokio::time::timeout(Duration::from_secs(60), other)
            .await
            .expect("the shard is blocked")
            .unwrap();
        assert_eq!(v, 42);
        assert!(
            !write.is_finished(),
            "the write cannot have completed: the pipe is full"
        );
        // Capped: the write's tokens are held while it is in flight.
        d.stats().await;
        let s = d.bucket_state();
        let free = s.ceil.unwrap().wrapping_sub(s.tail);
        assert!(
            free < d.limit(),
            "tokens of the in-flight write held: {free} < {}",
            d.limit()
        );
        // Make room: the write completes.
        let mut page = vec![0u8; ALIGN];
        std::io::Read::read_exact(&mut rd, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == 1));
        write.await.unwrap().unwrap();
        std::io::Read::read_exact(&mut rd, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == 9));
        d.stats().await;
        let s = d.bucket_state();
        assert_eq!(
            s.ceil.unwrap().wrapping_sub(s.tail),
            d.limit(),
            "released at completion"
        );
    });
}

#[test]
fn from_file_needs_o_direct() {
    let dir = scratch();
    let path = dir.path().join("plain");
    let plain = std::fs::File::create(&path).unwrap();
    let (d, class) = dispatcher(false);
    assert!(matches!(
        ThrottledFile::from_file(d, class, plain, &path, FileOptions::default()),
        Err(DiskError::NotDirect { .. })
    ));
}

/// Every block of the file stamped with its index (its first 8 bytes).
fn stamped_file(path: &Path, blocks: usize) {
    let mut data = vec![0u8; blocks * ALIGN];
    for (i, block) in data.chunks_mut(ALIGN).enumerate() {
        block[..8].copy_from_slice(&(i as u64).to_le_bytes());
        block[8..].fill(i as u8);
    }
    std::fs::write(path, &data).unwrap();
}

/// Reads of 1 to 4 blocks at random places, `depth` in flight, from tasks `spawn` starts; each
/// checks that it got its own blocks, whole, and its own byte count: a completion handed to
/// another request's handle (the ring's operations are keyed by a slot used again once its
/// completion is reaped) would resolve that handle early, with another size or before its
/// blocks arrived.
async fn deep_reads_see_their_own_blocks(
    f: Arc<ThrottledFile>,
    blocks: usize,
    reads: usize,
    depth: usize,
    spawn: impl Fn(
        &mut tokio::task::JoinSet<()>,
        std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    ),
) {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..reads {
        if set.len() >= depth {
            set.join_next().await.unwrap().unwrap();
        }
        let n = 1 + (next() % 4) as usize;
        let first = (next() % (blocks - n + 1) as u64) as usize;
        let f = f.clone();
        spawn(
            &mut set,
            Box::pin(async move {
                let buf = AlignedBuf::zeroed(n * ALIGN).unwrap();
                let (got, buf) = f.read_at(buf, (first * ALIGN) as u64).await;
                let got = got.unwrap();
                assert_eq!(got, n * ALIGN, "another request's byte count");
                for (k, block) in buf.chunks(ALIGN).enumerate() {
                    let i = first + k;
                    assert_eq!(block[..8], (i as u64).to_le_bytes(), "block {i}");
                    assert!(block[8..].iter().all(|&b| b == i as u8), "block {i} whole");
                }
            }),
        );
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

#[test]
fn deep_concurrent_reads_each_get_their_own_blocks_off_and_on_the_shard() {
    let dir = scratch();
    let path = dir.path().join("stamped");
    let blocks = 1024;
    stamped_file(&path, blocks);
    let (d, class) = dispatcher(true);
    let opts = FileOptions {
        max_piece: Some(2 * ALIGN),
        ..options(Backend::IoUring)
    };
    let f = Arc::new(ThrottledFile::open(d.clone(), class, &path, opts).unwrap());
    // Off the shard: the caller's tasks on an ordinary runtime. (A liveness bound, not a
    // speed check: a completion lost to another handle leaves its own waiting forever.)
    let rt = rt();
    rt.block_on(async {
        let reads = deep_reads_see_their_own_blocks(f.clone(), blocks, 3000, 64, |set, fut| {
            set.spawn(fut);
        });
        tokio::time::timeout(Duration::from_secs(60), reads)
            .await
            .expect("a read never completed")
    });
    // On the shard: the reads' tasks run on its own runtime.
    let on_shard = {
        let f = f.clone();
        d.submit(class, IoRequest::tokens(1), async move {
            deep_reads_see_their_own_blocks(f, blocks, 3000, 64, |set, fut| {
                set.spawn_local(fut);
            })
            .await
        })
        .unwrap()
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), on_shard).await })
        .expect("a read never completed")
        .unwrap();
    // Capped: every completion gave its tokens back (the probe's own once it ended: a round
    // trip through the shard orders after that).
    rt.block_on(d.stats());
    let s = d.bucket_state();
    assert_eq!(s.ceil.unwrap().wrapping_sub(s.tail), d.limit());
}

/// The pieces of one transfer all go to one shard; the next transfer from outside the shards
/// goes to the next shard.
#[test]
fn every_piece_of_a_transfer_goes_to_one_shard() {
    let dir = scratch();
    // Through the shards' queues (no caller dispatch), so that each piece is counted by the
    // shard it went to.
    let (d, class) =
        common::disk::build(common::disk::builder(true).shards(2).caller_dispatch(false));
    let f = ThrottledFile::open(
        d.clone(),
        class,
        dir.path().join("data"),
        options(Backend::IoUring),
    )
    .unwrap();
    let rt = rt();
    let per_shard = |rt: &tokio::runtime::Runtime| -> Vec<u64> {
        let s = rt.block_on(d.stats());
        s.shards
            .iter()
            .map(|sh| sh.classes[class.index()].requests)
            .collect()
    };
    // 1 MiB in pieces of 64 KiB: 16 pieces.
    let (res, buf) = rt.block_on(f.write_at(AlignedBuf::zeroed(1 << 20).unwrap(), 0));
    res.unwrap();
    let first = per_shard(&rt);
    assert_eq!(first.iter().sum::<u64>(), 16, "{first:?}");
    assert!(first.contains(&16), "all 16 pieces on one shard: {first:?}");
    let (res, _buf) = rt.block_on(f.write_at(buf, 1 << 20));
    res.unwrap();
    assert_eq!(
        per_shard(&rt),
        vec![16, 16],
        "the second transfer on the other shard"
    );
    d.shutdown();
}
