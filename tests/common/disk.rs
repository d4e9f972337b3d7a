//! The modelled disks the dispatcher tests state, and the dispatcher and runtime the `disk_*`
//! tests run their real I/O on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use iothrottle::disk::{AlignedBuf, IoBuf, ALIGN};
use iothrottle::dispatcher::{
    ClassConfig, ClassId, DiskModel, Dispatcher, DispatcherBuilder, Figures,
};

/// A fast NVMe drive (2 GB/s reads, 1 GB/s writes, 400k read IOPS, 100k write IOPS), stated
/// explicitly: there is no default disk.
pub const NVME: DiskModel = DiskModel::new(
    Figures {
        iops: 400_000,
        bandwidth: 2_000_000_000,
    },
    Figures {
        iops: 100_000,
        bandwidth: 1_000_000_000,
    },
);

/// One unpinned shard over a fast modelled disk (1 GB/s, 100k IOPS), one class `io`.
pub fn builder(capped: bool) -> DispatcherBuilder {
    Dispatcher::builder()
        .shards(1)
        .pin_threads(false)
        .capped(capped)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1_000_000_000,
        }))
        .class(ClassConfig::new("io", 100))
}

/// Builds `builder` (which has the class `io`) and returns it with that class.
pub fn build(builder: DispatcherBuilder) -> (Arc<Dispatcher>, ClassId) {
    let d = builder.build().unwrap();
    let class = d.class_id("io").unwrap();
    (Arc::new(d), class)
}

/// [`builder`], built, and its class.
pub fn dispatcher(capped: bool) -> (Arc<Dispatcher>, ClassId) {
    build(builder(capped))
}

/// A current-thread runtime with timers and an I/O driver: a caller whose file pieces may go on
/// its own ring.
pub fn rt_io() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A current-thread runtime with timers, for the callers' side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// The two ends (read, write) of an O_DIRECT pipe whose one-page buffer is full: the next
/// write to the write end stays in flight until the read end is read.
pub fn full_pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_DIRECT | libc::O_CLOEXEC) },
        0
    );
    // SAFETY: both descriptors were just made and are owned by nothing else.
    let (rd, mut wr) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    // SAFETY: plain fcntl on our own descriptor.
    assert!(unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, ALIGN as libc::c_int) } >= 0);
    std::io::Write::write_all(&mut wr, &[1u8; ALIGN]).unwrap();
    (rd, wr)
}

/// A caller's buffer that records when it is dropped.
pub struct Watched {
    buf: AlignedBuf,
    dropped: Arc<AtomicBool>,
}

impl Watched {
    /// One page of `byte`, and the flag its drop sets.
    pub fn page(byte: u8) -> (Watched, Arc<AtomicBool>) {
        Watched::of(&[byte; ALIGN])
    }

    /// `bytes` (a multiple of [`ALIGN`] long), and the flag its drop sets.
    pub fn of(bytes: &[u8]) -> (Watched, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        let buf = Watched {
            buf: AlignedBuf::from_slice(bytes).unwrap(),
            dropped: dropped.clone(),
        };
        (buf, dropped)
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// Blocks shard 0's thread until the returned sender is dropped.
pub fn block_shard(d: &Dispatcher) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (started_tx, started) = std::sync::mpsc::channel();
    drop(d.spawn_on(0, move || async move {
        started_tx.send(()).unwrap();
        let _ = rx.recv();
    }));
    started.recv().unwrap();
    tx
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

// SAFETY: delegates to the `AlignedBuf` it owns, whose memory does not move with `Watched`.
unsafe impl IoBuf for Watched {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.buf.bytes_init()
    }
    fn bytes_total(&self) -> usize {
        self.buf.bytes_total()
    }
}

/// Reads the page that filled a [`full_pipe`] and the page written after it, which must be all
/// `byte`: the write in flight then completes.
pub fn drain_full_pipe(rd: &mut std::fs::File, byte: u8) {
    let mut page = vec![0u8; ALIGN];
    std::io::Read::read_exact(rd, &mut page).unwrap();
    std::io::Read::read_exact(rd, &mut page).unwrap();
    assert!(page.iter().all(|&b| b == byte), "the write's bytes");
}

/// Capped mode: some of the bucket's tokens are held (by a write in flight).
pub fn assert_tokens_held(d: &Dispatcher) {
    let s = d.bucket_state();
    assert!(
        s.ceil.unwrap().wrapping_sub(s.tail) < d.limit(),
        "the write's tokens are held while it is in flight"
    );
}

/// Block `i`'s bytes: four pages, every 512 bytes a different value.
pub fn stamp(i: usize) -> Vec<u8> {
    (0..4 * ALIGN).map(|b| (i * 31 + b / 512) as u8).collect()
}

/// Writes block `i` ([`stamp`], at `i` × 16 KiB) through `f` and reads it back.
pub async fn write_and_read_back(f: &iothrottle::disk::ThrottledFile, i: usize) {
    let at = (i * 4 * ALIGN) as u64;
    let (res, _) = f
        .write_at(AlignedBuf::from_slice(&stamp(i)).unwrap(), at)
        .await;
    res.unwrap();
    let (n, back) = f.read_at(AlignedBuf::zeroed(4 * ALIGN).unwrap(), at).await;
    assert_eq!(n.unwrap(), 4 * ALIGN);
    assert!(back[..] == stamp(i)[..], "block {i} read back");
}

/// A `ThrottledFile` of `d`'s `class` on the write end of a [`full_pipe`] (the next write stays
/// in flight until the read end is read), and the read end.
pub fn full_pipe_file(
    d: &Arc<Dispatcher>,
    class: ClassId,
) -> (std::fs::File, iothrottle::disk::ThrottledFile) {
    let (rd, wr) = full_pipe();
    let opts = iothrottle::disk::FileOptions {
        backend: iothrottle::disk::Backend::IoUring,
        write: true,
        reserve_writes: false,
        ..iothrottle::disk::FileOptions::default()
    };
    let f = iothrottle::disk::ThrottledFile::from_file(d.clone(), class, wr, "pipe", opts).unwrap();
    (rd, f)
}
