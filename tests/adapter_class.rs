#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! `ClassIo`: reads and writes scheduled as tickets of a dispatcher class.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use iothrottle::adapter::ClassIo;
use iothrottle::dispatcher::{ClassConfig, ClassId, DiskModel, Dispatcher, Figures};

fn dispatcher() -> (Arc<Dispatcher>, ClassId, ClassId) {
    let mut b = Dispatcher::builder()
        .shards(1)
        .disk(DiskModel::symmetric(Figures {
            iops: 100_000,
            bandwidth: 1 << 30,
        }))
        .pin_threads(false);
    let fg = b.add_class(ClassConfig::new("reads", 800)).unwrap();
    let bg = b.add_class(ClassConfig::new("compaction", 200)).unwrap();
    (Arc::new(b.build().unwrap()), fg, bg)
}

#[tokio::test(flavor = "current_thread")]
async fn every_byte_is_charged_to_its_class_once() {
    let (d, fg, bg) = dispatcher();
    let mut w = ClassIo::new(std::io::Cursor::new(Vec::new()), d.clone(), bg).unwrap();
    let (max_read, max_write) = w.max_chunks();
    assert!((1..=1 << 20).contains(&max_write));
    let payload: Vec<u8> = (0..(3 << 20) + 123).map(|i: u32| i as u8).collect();
    w.write_all(&payload).await.unwrap();
    w.seek(std::io::SeekFrom::Start(0)).await.unwrap();
    let data = w.into_inner().into_inner();
    assert_eq!(data, payload);
    let mut r = ClassIo::new(&data[..], d.clone(), fg).unwrap();
    let mut back = Vec::new();
    r.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, payload);
    let stats = d.stats().await;
    let written = &stats.classes[bg.index()];
    assert_eq!(
        written.bytes,
        payload.len() as u64,
        "writes charged exactly"
    );
    assert_eq!(
        written.requests,
        (payload.len() as u64).div_ceil(max_write),
        "one ticket per chunk"
    );
    // Reads are charged for the space offered; credit a short read leaves is reused, so at most
    // one chunk is paid and unused (the final read that finds the end of the data).
    let read = &stats.classes[fg.index()];
    assert!(read.bytes >= payload.len() as u64);
    assert!(
        read.bytes <= payload.len() as u64 + max_read,
        "{}",
        read.bytes
    );
    d.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn an_unknown_class_is_an_invalid_input_error() {
    let (d, _, _) = dispatcher();
    let other = {
        let mut b = Dispatcher::builder().shards(1).pin_threads(false);
        b.add_class(ClassConfig::new("a", 1)).unwrap();
        b.add_class(ClassConfig::new("b", 1)).unwrap();
        b.add_class(ClassConfig::new("c", 1)).unwrap()
    };
    let err = ClassIo::new(tokio::io::sink(), d.clone(), other).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    d.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn a_shut_down_dispatcher_fails_the_io() {
    let (d, _, bg) = dispatcher();
    let mut w = ClassIo::new(tokio::io::sink(), d.clone(), bg).unwrap();
    d.shutdown();
    assert!(w.write(&[0u8; 10]).await.is_err());
}

/// Many 1-byte writes through a `BufWriter` of one chunk around the `ClassIo` (as its docs say)
/// cost one ticket per chunk, not one per write, and every byte arrives once.
#[tokio::test(flavor = "current_thread")]
async fn small_writes_through_a_buffer_of_one_chunk_cost_one_ticket_per_chunk() {
    let (d, _, bg) = dispatcher();
    let io = ClassIo::new(Vec::new(), d.clone(), bg).unwrap();
    let (_, max_write) = io.max_chunks();
    let mut w = tokio::io::BufWriter::with_capacity(max_write as usize, io);
    let n: u64 = 3 * max_write + 17;
    for i in 0..n {
        w.write_all(&[i as u8]).await.unwrap();
    }
    w.flush().await.unwrap();
    let data = w.into_inner().into_inner();
    assert_eq!(data.len() as u64, n);
    assert!(data.iter().enumerate().all(|(i, &b)| b == i as u8));
    let stats = d.stats().await;
    let class = &stats.classes[bg.index()];
    assert_eq!(class.bytes, n, "every byte charged once");
    assert_eq!(
        class.requests,
        n.div_ceil(max_write),
        "one ticket per chunk"
    );
    d.shutdown();
}
