#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! A background class's transfer from outside the shards runs on a shard as one task: it waits
//! for a blocked shard where a foreground transfer does not, the caller's own buffer goes there
//! and comes back, a caller that drops its future leaves the transfer to end there, and a
//! shutdown ends it with the buffer handed back.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use iothrottle::disk::{AlignedBuf, Backend, FileOptions, ThrottledFile, ALIGN};
use iothrottle::dispatcher::{ClassConfig, ClassId, Dispatcher};
use iothrottle::{DiskError, SubmitError};

mod common;

use common::disk::{block_shard, rt_io, stamp, Watched};

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// One unpinned shard with caller dispatch, the foreground class `io` and a background class,
/// and a file on it whose pieces are 16 KiB.
fn file(dir: &tempfile::TempDir) -> (Arc<Dispatcher>, ThrottledFile, ClassId, ClassId) {
    let mut b = common::disk::builder(true).caller_dispatch(true);
    let bg = b
        .add_class(ClassConfig::background("compaction", 100))
        .unwrap();
    let (d, fg) = common::disk::build(b);
    let options = FileOptions {
        backend: Backend::IoUring,
        max_piece: Some(4 * ALIGN),
        ..FileOptions::read_write()
    };
    let f = ThrottledFile::open(d.clone(), fg, dir.path().join("data"), options).unwrap();
    (d, f, fg, bg)
}

/// Polls `f` once (which hands a background transfer over to its shard); it must still be
/// pending, since its shard is blocked.
async fn poll_once_pending<F: Future>(f: Pin<&mut F>) {
    let mut f = f;
    std::future::poll_fn(|cx| {
        assert!(f.as_mut().poll(cx).is_pending(), "ended without its shard");
        Poll::Ready(())
    })
    .await;
}

/// Four blocks of [`stamp`]s: 64 KiB, four pieces.
fn blocks() -> Vec<u8> {
    (0..4).flat_map(stamp).collect()
}

#[test]
fn a_background_transfer_from_a_runtime_runs_on_a_shard_and_a_foreground_one_does_not() {
    let dir = scratch();
    let (d, f, fg, bg) = file(&dir);
    let f = Arc::new(f);
    assert_eq!(f.background_shards(), &[0], "one unpinned shard");
    let rt = rt_io();
    let blocked = block_shard(&d);
    let writer = f.clone();
    // One piece, which the caller's ring could issue at once.
    let background = rt.spawn(async move {
        let (res, buf) = writer
            .write_at_in(bg, AlignedBuf::from_slice(&stamp(0)).unwrap(), 0)
            .await;
        res.map(|()| buf)
    });
    // The foreground goes from the caller's own ring: it completes with the shard blocked.
    rt.block_on(async {
        let at = 8 * 4 * ALIGN as u64;
        let (res, _) = f
            .write_at_in(fg, AlignedBuf::from_slice(&stamp(9)).unwrap(), at)
            .await;
        res.unwrap();
        let (n, back) = f
            .read_at_in(fg, AlignedBuf::zeroed(4 * ALIGN).unwrap(), at)
            .await;
        assert_eq!(n.unwrap(), 4 * ALIGN);
        assert!(back[..] == stamp(9)[..]);
    });
    // The background transfer runs on the blocked shard: it cannot have ended.
    assert!(!background.is_finished(), "ended without its shard");
    drop(blocked);
    let buf = rt.block_on(background).unwrap().unwrap();
    assert!(buf[..] == stamp(0)[..], "the buffer came back as it went");
    let (n, back) = rt.block_on(f.read_at_in(fg, AlignedBuf::zeroed(4 * ALIGN).unwrap(), 0));
    assert_eq!(n.unwrap(), 4 * ALIGN);
    assert!(
        back[..] == stamp(0)[..],
        "the background write is on the disk"
    );
    // Four pieces after it, with the shard free.
    let (res, _) = rt.block_on(f.write_at_in(bg, AlignedBuf::from_slice(&blocks()).unwrap(), 0));
    res.unwrap();
    let stats = rt.block_on(d.stats());
    assert_eq!(
        stats.classes[bg.index()].requests,
        5,
        "one piece, then four, of the background class"
    );
    d.shutdown();
}

#[test]
fn a_callers_own_buffer_goes_to_the_shard_and_comes_back_from_a_background_transfer() {
    let dir = scratch();
    let (d, f, _, bg) = file(&dir);
    let rt = rt_io();
    let (buf, dropped) = Watched::of(&blocks());
    let (res, buf) = rt.block_on(f.write_at_in(bg, buf, 4 * ALIGN as u64));
    res.unwrap();
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the caller's buffer is handed back"
    );
    assert!(buf.bytes() == &blocks()[..], "unchanged");
    // Read back in the background class too: the read goes to the shard and back.
    let (n, back) = rt.block_on(f.read_at_in(
        bg,
        AlignedBuf::zeroed(16 * ALIGN).unwrap(),
        4 * ALIGN as u64,
    ));
    assert_eq!(n.unwrap(), 16 * ALIGN);
    assert!(back[..] == blocks()[..]);
    drop(buf);
    assert!(dropped.load(Ordering::SeqCst));
    d.shutdown();
}

#[test]
fn a_background_transfer_whose_caller_went_away_still_runs_to_its_end() {
    let dir = scratch();
    let (d, f, fg, bg) = file(&dir);
    let rt = rt_io();
    let blocked = block_shard(&d);
    rt.block_on(async {
        let write = f.write_at_in(bg, AlignedBuf::from_slice(&blocks()).unwrap(), 0);
        tokio::pin!(write);
        // Polled once (handed over to the blocked shard), then dropped.
        poll_once_pending(write.as_mut()).await;
    });
    drop(blocked);
    // Polled, not timed: the test runner's timeout catches a transfer that never ends.
    loop {
        // The file is empty until the write lands: the read comes back short.
        let (n, back) = rt.block_on(f.read_at_in(fg, AlignedBuf::zeroed(16 * ALIGN).unwrap(), 0));
        let written = n.unwrap() == 16 * ALIGN && back[..] == blocks()[..];
        let s = d.bucket_state();
        let returned = s.ceil.unwrap().wrapping_sub(s.tail) == d.limit();
        if written && returned {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    d.shutdown();
}

#[test]
fn a_shutdown_ends_a_handed_over_transfer_and_its_buffer_comes_back() {
    let dir = scratch();
    let (d, f, _, bg) = file(&dir);
    let rt = rt_io();
    let blocked = block_shard(&d);
    let (buf, dropped) = Watched::of(&blocks());
    let (res, buf) = rt.block_on(async {
        let write = f.write_at_in(bg, buf, 0);
        tokio::pin!(write);
        poll_once_pending(write.as_mut()).await;
        // The shutdown begins while the transfer waits for its shard (which cannot stop while
        // blocked, however long it is given).
        assert!(d.shutdown_timeout(Duration::from_millis(1)).is_err());
        drop(blocked);
        write.await
    });
    assert!(
        matches!(res, Err(DiskError::Submit(SubmitError::ShutDown))),
        "{res:?}"
    );
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the caller's buffer is handed back"
    );
    assert!(buf.bytes() == &blocks()[..]);
    d.shutdown();
    // Nothing of it was written: its pieces were refused.
    let on_disk = std::fs::read(dir.path().join("data")).unwrap();
    assert!(on_disk.iter().all(|&b| b == 0), "no piece went");
}
