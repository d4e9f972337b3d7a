#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `ThrottledFile` as a storage engine uses it: one open file read and written in several
//! classes, the caller's own buffers handed back on every outcome, pieces sized by the
//! dispatcher and the class, and slow disks.

use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::disk::{dispatcher, rt};
use iothrottle::disk::{AlignedBuf, FileOptions, IoBuf, IoBufMut, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{
    ClassConfig, DiskModel, Dispatcher, DispatcherBuilder, Figures, IoKind,
};
use iothrottle::Rate;
use iothrottle::{BuildError, DiskError};

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// A block cache's own buffer: aligned memory, a count of the bytes it holds, and a tag that
/// proves the very same buffer came back.
struct CacheBlock {
    mem: AlignedBuf,
    init: usize,
    tag: u64,
    /// Bytes skipped at the start (0 for an aligned block; 512 makes the address unaligned).
    skew: usize,
}

impl CacheBlock {
    fn new(len: usize, tag: u64) -> Self {
        CacheBlock {
            mem: AlignedBuf::zeroed(len).unwrap(),
            init: 0,
            tag,
            skew: 0,
        }
    }
}

// SAFETY: the memory is an `AlignedBuf`'s heap allocation, stable while the block lives; `init`
// never exceeds what was written (zeroed memory is initialised anyway).
unsafe impl IoBuf for CacheBlock {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: `skew < mem.len()`.
        unsafe { self.mem.as_ptr().add(self.skew) }
    }
    fn bytes_init(&self) -> usize {
        self.init
    }
    fn bytes_total(&self) -> usize {
        self.mem.len() - self.skew
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for CacheBlock {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `skew < mem.len()`.
        unsafe { self.mem.as_mut_ptr().add(self.skew) }
    }
    unsafe fn set_init(&mut self, pos: usize) {
        self.init = self.init.max(pos);
    }
}

fn two_classes(
    builder: DispatcherBuilder,
) -> (Arc<Dispatcher>, [iothrottle::dispatcher::ClassId; 2]) {
    let mut b = builder.shards(1).pin_threads(false);
    let fg = b.add_class(ClassConfig::new("fg", 800)).unwrap();
    let bg = b.add_class(ClassConfig::background("bg", 200)).unwrap();
    (Arc::new(b.build().unwrap()), [fg, bg])
}

const FAST: DiskModel = DiskModel::symmetric(Figures {
    iops: 100_000,
    bandwidth: 1_000_000_000,
});

#[test]
fn one_open_file_serves_requests_of_each_class() {
    let dir = scratch();
    let (d, [fg, bg]) = two_classes(Dispatcher::builder().disk(FAST));
    let f = ThrottledFile::open(
        d.clone(),
        fg,
        dir.path().join("sst"),
        FileOptions::read_write(),
    )
    .unwrap();
    assert_eq!(f.class(), fg);
    let rt = rt();
    let data = AlignedBuf::from_slice(&[7u8; 4 * ALIGN]).unwrap();
    // The compaction writes the SST…
    let (res, data) = rt.block_on(f.write_at_in(bg, data, 0));
    res.unwrap();
    let stats = d.stats_blocking();
    let bg_writes = stats.classes[bg.index()].requests;
    assert!(bg_writes >= 1);
    assert_eq!(
        stats.classes[fg.index()].requests,
        0,
        "nothing charged to fg"
    );
    // …and a query reads it through the same open file, in its own class.
    let (n, back) = rt.block_on(f.read_at_in(fg, AlignedBuf::zeroed(4 * ALIGN).unwrap(), 0));
    assert_eq!(n.unwrap(), 4 * ALIGN);
    assert!(back[..] == data[..]);
    let stats = d.stats_blocking();
    assert_eq!(stats.classes[fg.index()].requests, 1);
    assert_eq!(
        stats.classes[bg.index()].requests,
        bg_writes,
        "nothing more charged to bg"
    );
    // The plain call uses the file's default class.
    let (n, _) = rt.block_on(f.read_at(back, 0));
    n.unwrap();
    assert_eq!(d.stats_blocking().classes[fg.index()].requests, 2);
    // An unknown class (here another dispatcher's third) is a typed error, before anything is
    // submitted, buffer back.
    let other = Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .disk(FAST)
        .class(ClassConfig::new("a", 1))
        .class(ClassConfig::new("b", 1))
        .class(ClassConfig::new("c", 1))
        .build()
        .unwrap();
    let third = other.class_id("c").unwrap();
    let (res, buf) = rt.block_on(f.read_at_in(third, AlignedBuf::zeroed(ALIGN).unwrap(), 0));
    assert!(
        matches!(
            res,
            Err(DiskError::Submit(iothrottle::SubmitError::UnknownClass {
                class: 2,
                classes: 2
            }))
        ),
        "{res:?}"
    );
    assert_eq!(buf.len(), ALIGN);
}

#[test]
fn a_callers_own_buffer_round_trips_and_comes_back_itself() {
    let dir = scratch();
    let (d, class) = dispatcher(true);
    let f =
        ThrottledFile::open(d, class, dir.path().join("data"), FileOptions::read_write()).unwrap();
    let rt = rt();
    let mut block = CacheBlock::new(2 * ALIGN, 41);
    block.mem[..].fill(0x5a);
    block.init = 2 * ALIGN;
    let (res, block) = rt.block_on(f.write_at(block, ALIGN as u64));
    res.unwrap();
    assert_eq!(block.tag, 41, "the caller's own buffer came back");
    // A read fills `bytes_total` and records what it filled with `set_init`.
    let into = CacheBlock::new(2 * ALIGN, 42);
    let before = into.mem.as_ptr();
    let (n, into) = rt.block_on(f.read_at(into, ALIGN as u64));
    assert_eq!(n.unwrap(), 2 * ALIGN);
    assert_eq!((into.tag, into.init), (42, 2 * ALIGN));
    assert_eq!(into.mem.as_ptr(), before, "the same memory, not a copy");
    assert!(into.mem.iter().all(|&b| b == 0x5a));
    // A write writes `bytes_init` bytes only: none at all is an empty buffer.
    let (res, empty) = rt.block_on(f.write_at(CacheBlock::new(ALIGN, 43), 0));
    assert!(matches!(res, Err(DiskError::EmptyBuffer)), "{res:?}");
    assert_eq!(empty.tag, 43);
}

#[test]
fn an_unaligned_callers_buffer_is_a_typed_error_and_comes_back() {
    let dir = scratch();
    let (d, class) = dispatcher(true);
    let f = ThrottledFile::open(
        d.clone(),
        class,
        dir.path().join("data"),
        FileOptions::read_write(),
    )
    .unwrap();
    let rt = rt();
    let mut skewed = CacheBlock::new(3 * ALIGN, 7);
    skewed.skew = 512;
    skewed.init = 2 * ALIGN;
    let (res, skewed) = rt.block_on(f.write_at(skewed, 0));
    match res {
        Err(DiskError::Unaligned {
            what: "buffer address",
            value,
            align: 4096,
        }) => assert_eq!(value % 4096, 512),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(skewed.tag, 7);
    // A length that is not a multiple of 4 KiB (what a read would fill).
    let (res, skewed) = rt.block_on(f.read_at(skewed, 0));
    assert!(
        matches!(
            res,
            Err(DiskError::Unaligned {
                what: "buffer length",
                ..
            })
        ),
        "{res:?}"
    );
    assert_eq!(skewed.tag, 7);
    assert_eq!(d.stats_blocking().classes[class.index()].requests, 0);
}

/// An I/O error from the kernel (here `EBADF`: reading a descriptor opened write-only, as a
/// failing device's `EIO` would come) hands the buffer back with the error.
#[test]
fn a_read_failing_in_the_kernel_hands_the_buffer_back() {
    let dir = scratch();
    let path = dir.path().join("data");
    std::fs::write(&path, vec![1u8; 4 * ALIGN]).unwrap();
    let write_only = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    let (d, class) = dispatcher(true);
    let opts = FileOptions {
        max_piece: Some(ALIGN),
        ..FileOptions::read_write()
    };
    let f = ThrottledFile::from_file(d, class, write_only, &path, opts).unwrap();
    let rt = rt();
    // Several pieces, each failing: every one is waited for, then the buffer comes back.
    let (res, block) = rt.block_on(f.read_at(CacheBlock::new(4 * ALIGN, 9), 0));
    match res {
        Err(DiskError::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EBADF)),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!((block.tag, block.init), (9, 0));
    let own = AlignedBuf::zeroed(ALIGN).unwrap();
    let at = own.as_ptr();
    let (res, own) = rt.block_on(f.read_at(own, 0));
    assert!(res.is_err());
    assert_eq!(own.as_ptr(), at, "the same AlignedBuf, not a copy");
}

/// Pieces cancelled by `shutdown_now` while the first one ran: the call ends with the
/// dispatcher's error and the caller's buffer, after the piece already dispatched completed.
#[test]
fn a_cancelled_transfer_hands_the_buffer_back() {
    let dir = scratch();
    let path = dir.path().join("data");
    std::fs::write(&path, vec![3u8; 4 * ALIGN]).unwrap();
    // 1,000 tokens a second and room for one 4 KiB piece (~14,000 tokens): the first piece
    // goes at once, the next waits ~14 s, long enough to be cancelled while queued.
    let d = Arc::new(
        Dispatcher::builder()
            .shards(1)
            .pin_threads(false)
            .disk(FAST)
            .rate(Rate::per_second(1000))
            .limit(20_000)
            .max_cost(20_000)
            .batch(20_000)
            .class(ClassConfig::new("io", 100))
            .build()
            .unwrap(),
    );
    let class = d.class_id("io").unwrap();
    let opts = FileOptions {
        max_piece: Some(ALIGN),
        ..FileOptions::default()
    };
    let f = ThrottledFile::open(d.clone(), class, &path, opts).unwrap();
    let reader =
        std::thread::spawn(move || rt().block_on(f.read_at(CacheBlock::new(4 * ALIGN, 77), 0)));
    // Wait until the three pieces after the first are all queued (no timing asserted: a bound
    // on the wait). A piece not yet submitted at the shutdown would be refused instead
    // (`DiskError::Submit`), which is the error the transfer then returns.
    let mut waited = Duration::ZERO;
    loop {
        let s = d.stats_blocking();
        if s.classes[class.index()].queued >= 3 {
            break;
        }
        assert!(
            waited < Duration::from_secs(60),
            "the pieces were never all queued"
        );
        std::thread::sleep(Duration::from_millis(5));
        waited += Duration::from_millis(5);
    }
    d.shutdown_now();
    let (res, block) = reader.join().unwrap();
    assert!(matches!(res, Err(DiskError::Dispatch(_))), "{res:?}");
    assert_eq!(block.tag, 77, "the caller's buffer came back");
}

/// A gp3 volume's baseline: 3,000 IOPS, 125 MiB/s. The default `max_cost` (375 µs) fits one
/// 4 KiB write (364 µs) and no more, so the documented 1 MiB write goes as 4 KiB pieces.
#[test]
fn the_documented_one_mib_write_succeeds_on_a_gp3_baseline_disk() {
    let gp3 = DiskModel::symmetric(Figures {
        iops: 3000,
        bandwidth: 125 << 20,
    });
    let (d, [fg, bg]) = two_classes(Dispatcher::builder().disk(gp3));
    assert_eq!(d.max_piece(IoKind::Write), Some(ALIGN as u64));
    let dir = scratch();
    let f = ThrottledFile::open(
        d.clone(),
        bg,
        dir.path().join("sst-7"),
        FileOptions::read_write(),
    )
    .unwrap();
    assert_eq!(f.piece_size(bg, IoKind::Write), Some(ALIGN));
    assert_eq!(f.piece_size(fg, IoKind::Write), Some(ALIGN));
    let rt = rt();
    let data: Vec<u8> = (0..1 << 20).map(|i: usize| (i / ALIGN) as u8).collect();
    let (res, buf) = rt.block_on(f.write_at(AlignedBuf::from_slice(&data).unwrap(), 0));
    res.unwrap();
    let (n, back) = rt.block_on(f.read_at_in(fg, buf, 0));
    assert_eq!(n.unwrap(), 1 << 20);
    assert!(back[..] == data[..]);
    assert_eq!(d.stats_blocking().classes[bg.index()].requests, 256);
}

/// Below ~2,700 IOPS not even one 4 KiB request fits the default goal's `max_cost`: the builder
/// refuses the model, naming a goal that fits, and that goal builds.
#[test]
fn a_disk_no_request_fits_is_refused_at_build_with_the_goal_that_would_fit() {
    let slow = DiskModel::symmetric(Figures {
        iops: 2000,
        bandwidth: 125 << 20,
    });
    let err = Dispatcher::builder()
        .disk(slow)
        .class(ClassConfig::new("io", 100))
        .build()
        .unwrap_err();
    let needed = match &err {
        BuildError::DiskTooSlowForGoal {
            kind: "read",
            cost,
            needed_goal,
            ..
        } => {
            assert_eq!(
                *cost,
                slow.cost(&iothrottle::dispatcher::IoRequest::read(4096))
            );
            *needed_goal
        }
        other => panic!("unexpected {other:?}"),
    };
    let msg = err.to_string();
    assert!(
        msg.contains("latency goal") && msg.contains(&format!("{needed:?}")),
        "{msg}"
    );
    let d = Dispatcher::builder()
        .disk(slow)
        .latency_goal(needed)
        .class(ClassConfig::new("io", 100))
        .build()
        .unwrap();
    assert_eq!(d.max_piece(IoKind::Read), Some(ALIGN as u64));
}

/// A background class's in-flight bound follows the goal it is built with, whatever the order
/// of the builder's calls; a bound of its own wins; an ordinary class has none.
#[test]
fn a_background_class_is_bounded_by_a_part_of_the_goal() {
    let div = ClassConfig::BACKGROUND_GOAL_DIVISOR;
    let bg = ClassConfig::background("bg", 200);
    assert!(bg.is_background() && !ClassConfig::new("fg", 1).is_background());
    assert_eq!(
        bg.max_in_flight(),
        None,
        "resolved when the dispatcher is built"
    );
    for goal in [
        None,
        Some(Duration::from_micros(300)),
        Some(Duration::from_millis(4)),
    ] {
        let mut b = Dispatcher::builder()
            .disk(FAST)
            .shards(1)
            .pin_threads(false);
        let fg = b.add_class(ClassConfig::new("fg", 800)).unwrap();
        let bg = b.add_class(ClassConfig::background("bg", 200)).unwrap();
        let own = b
            .add_class(
                ClassConfig::background("own", 100).with_max_in_flight(Duration::from_micros(7)),
            )
            .unwrap();
        if let Some(g) = goal {
            b = b.latency_goal(g);
        }
        let d = b.build().unwrap();
        let goal = goal.unwrap_or(DispatcherBuilder::DEFAULT_LATENCY_GOAL);
        assert_eq!(d.latency_goal(), goal);
        let bound = |c| d.class_config(c).unwrap().max_in_flight();
        assert_eq!(bound(bg), Some(goal / div), "goal {goal:?}");
        assert_eq!(bound(own), Some(Duration::from_micros(7)));
        assert_eq!(bound(fg), None);
        d.shutdown();
    }
}

/// The piece size follows the class: a class bounded in flight gets pieces within its bound,
/// an unbounded one the dispatcher's `max_piece`; an explicit size wins.
#[test]
fn pieces_are_derived_from_the_class_in_flight_bound() {
    let (d, [fg, bg]) = two_classes(Dispatcher::builder().disk(FAST));
    let dir = scratch();
    let f = ThrottledFile::open(
        d.clone(),
        fg,
        dir.path().join("f"),
        FileOptions::read_write(),
    )
    .unwrap();
    let max = d.max_piece(IoKind::Write).unwrap() as usize;
    assert_eq!(f.piece_size(fg, IoKind::Write), Some(max));
    let bg_piece = f.piece_size(bg, IoKind::Write).unwrap();
    let bound = d.class_config(bg).unwrap().max_in_flight().unwrap();
    assert!(bg_piece < max && bg_piece.is_multiple_of(ALIGN));
    assert!(
        d.disk()
            .disk_time(&iothrottle::dispatcher::IoRequest::write(bg_piece as u64))
            <= bound
    );
    assert!(
        d.disk()
            .disk_time(&iothrottle::dispatcher::IoRequest::write(
                (bg_piece + ALIGN) as u64
            ))
            > bound,
        "the largest aligned piece within the bound"
    );
    let set = FileOptions {
        max_piece: Some(2 * ALIGN),
        ..FileOptions::read_write()
    };
    let g = ThrottledFile::open(d, fg, dir.path().join("g"), set).unwrap();
    assert_eq!(g.piece_size(bg, IoKind::Read), Some(2 * ALIGN));
}
