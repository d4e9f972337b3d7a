#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! The I/O adapters on tokio's paused time and on a manual clock: the rate bound, cancellation,
//! large and short operations, seek pass-through, capped accounting, the blocking wrapper and
//! `request`.

use std::io::{Read, Seek, SeekFrom, Write};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Instant;

use iothrottle::adapter::{BlockingThrottle, ThrottleExt, ThrottleReadExt, ThrottledIo};
use iothrottle::{
    BucketConfig, Capped, Clock, ManualClock, Mode, Rate, SharedTokenBucket, Throttle, TokioClock,
    Uncapped,
};

const RATE: u64 = 1 << 20; // 1 MiB/s
const LIMIT: u64 = 64 << 10; // 64 KiB burst

fn throttle<M: Mode>(rate: u64, limit: u64) -> Throttle<M, TokioClock> {
    Throttle::with_clock(
        BucketConfig::new(Rate::per_second(rate), limit),
        TokioClock::new(),
    )
    .unwrap()
}

/// Every byte that reached it, with tokio's time of arrival.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<(Instant, u64)>>>);

impl Log {
    fn push(&self, n: u64) {
        self.0.lock().unwrap().push((Instant::now(), n));
    }

    /// Checks `bytes(start..=t) ≤ rate × (t - start) + burst` at every arrival; returns the
    /// total.
    fn check_bound(&self, start: Instant, rate: u64, burst: u64) -> u64 {
        let mut total = 0u64;
        for &(at, n) in self.0.lock().unwrap().iter() {
            total += n;
            let t = at.duration_since(start);
            let allowed = Rate::per_second(rate).tokens_in(t) as u64 + burst;
            assert!(
                total <= allowed,
                "{total} bytes after {t:?}, at most {allowed} allowed"
            );
        }
        total
    }
}

/// A sink that logs what it is given.
struct LogSink(Log);

impl AsyncWrite for LogSink {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.0.push(buf.len() as u64);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn bytes_through_the_adapter_stay_within_rate_times_t_plus_burst() {
    let t = throttle::<Uncapped>(RATE, LIMIT);
    let log = Log::default();
    let start = Instant::now();
    // Two writers with different buffer sizes and a reader, all on one throttle.
    let mut tasks = Vec::new();
    for size in [3_000usize, 200_000] {
        let mut w = LogSink(log.clone()).throttled(&t);
        tasks.push(tokio::spawn(async move {
            let buf = vec![7u8; size];
            loop {
                w.write_all(&buf).await.unwrap();
            }
        }));
    }
    let log_r = log.clone();
    let mut r = tokio::io::repeat(1).throttled_read(&t);
    tasks.push(tokio::spawn(async move {
        let mut buf = vec![0u8; 10_000];
        loop {
            let n = r.read(&mut buf).await.unwrap();
            log_r.push(n as u64);
        }
    }));
    let run = Duration::from_secs(10);
    tokio::time::sleep(run).await;
    for t in &tasks {
        t.abort();
    }
    let total = log.check_bound(start, RATE, LIMIT);
    let ideal = RATE * 10 + LIMIT;
    assert!(
        total as f64 >= 0.99 * ideal as f64,
        "{total} bytes in 10 s, ideal {ideal}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_write_larger_than_the_limit_is_split_and_takes_exactly_its_time() {
    let t = throttle::<Uncapped>(1_000, 100);
    let log = Log::default();
    let mut w = LogSink(log.clone()).throttled(&t);
    let start = Instant::now();
    // One poll_write moves at most one limit.
    let n = w.write(&[0u8; 1_000]).await.unwrap();
    assert_eq!(n, 100);
    // write_all of 10 limits: the first 100 bytes were the full bucket, the next 1,000 take 1 s.
    w.write_all(&[0u8; 1_000]).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(log.check_bound(start, 1_000, 100), 1_100);
    assert!(log.0.lock().unwrap().iter().all(|&(_, n)| n <= 100));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn max_chunk_is_clamped_to_the_limit_and_to_one() {
    let t = throttle::<Uncapped>(1_000, 100);
    assert_eq!(tokio::io::sink().throttled(&t).max_chunk(), 100);
    assert_eq!(
        tokio::io::sink()
            .throttled(&t)
            .with_max_chunk(10_000)
            .max_chunk(),
        100
    );
    assert_eq!(
        tokio::io::sink()
            .throttled(&t)
            .with_max_chunk(0)
            .max_chunk(),
        1
    );
    let mut w = tokio::io::sink().throttled(&t).with_max_chunk(7);
    assert_eq!(w.write(&[0u8; 50]).await.unwrap(), 7);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_write_cancelled_while_waiting_gives_its_tokens_back_in_order() {
    let t = throttle::<Uncapped>(1_000, 100);
    let mut w = tokio::io::sink().throttled(&t);
    let start = Instant::now();
    w.write_all(&[0u8; 100]).await.unwrap(); // empties the bucket
                                             // Needs 50 ms; cancelled after 10 ms, mid-wait.
    let cancelled = tokio::time::timeout(Duration::from_millis(10), w.write_all(&[0u8; 50])).await;
    assert!(cancelled.is_err());
    drop(w);
    // Another writer gets 50 bytes 50 ms after the bucket was emptied: the cancelled claim left
    // no trace (it would have taken until 100 ms).
    let mut w2 = tokio::io::sink().throttled(&t);
    w2.write_all(&[0u8; 50]).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(50));
}

/// A writer that says `Pending` (and wakes itself) on every other poll, and takes at most
/// `max` bytes per write.
struct Stutter {
    pending_next: bool,
    max: usize,
    got: Vec<u8>,
}

impl AsyncWrite for Stutter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let pend = self.pending_next;
        self.pending_next = !pend;
        if pend {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let n = buf.len().min(self.max);
        self.got.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Stutter {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let pend = self.pending_next;
        self.pending_next = !pend;
        if pend {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let n = buf.remaining().min(self.max);
        buf.put_slice(&vec![9u8; n]);
        Poll::Ready(Ok(()))
    }
}

fn stutter(max: usize) -> Stutter {
    Stutter {
        pending_next: true,
        max,
        got: Vec::new(),
    }
}

/// Drives one `poll_write` of the adapter by hand.
fn poll_write_once<T: AsyncWrite + Unpin, M: Mode>(
    io: &mut ThrottledIo<T, M, TokioClock>,
    buf: &[u8],
) -> Poll<std::io::Result<usize>> {
    let waker = futures_noop_waker();
    let mut cx = Context::from_waker(&waker);
    Pin::new(io).poll_write(&mut cx, buf)
}

fn futures_noop_waker() -> std::task::Waker {
    std::task::Waker::noop().clone()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn dropping_the_adapter_while_the_inner_write_is_pending_refunds_the_grant() {
    let t = throttle::<Uncapped>(1_000, 100);
    t.bucket().replenish();
    assert_eq!(t.bucket().available(), 100);
    let mut w = stutter(usize::MAX).throttled(&t);
    // Granted 60 tokens, then the inner writer said Pending: the adapter holds the credit.
    assert!(poll_write_once(&mut w, &[0u8; 60]).is_pending());
    assert_eq!(t.bucket().available(), 40);
    drop(w);
    assert_eq!(t.bucket().available(), 100);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn credit_held_across_pending_is_reused_and_short_writes_refund_the_rest() {
    let t = throttle::<Uncapped>(1_000, 100);
    t.bucket().replenish();
    let mut w = stutter(10).throttled(&t);
    assert!(poll_write_once(&mut w, &[1u8; 60]).is_pending());
    assert_eq!(t.bucket().available(), 40);
    // Retried with a smaller buffer: no second grant; the writer takes 10, 50 go back.
    match poll_write_once(&mut w, &[2u8; 30]) {
        Poll::Ready(Ok(10)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(t.bucket().available(), 90);
    assert_eq!(w.get_ref().got, vec![2u8; 10]);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn short_reads_and_end_of_file_refund_what_they_did_not_fill() {
    let t = throttle::<Uncapped>(1_000, 100);
    t.bucket().replenish();
    let mut r = stutter(10).throttled(&t);
    let mut buf = [0u8; 80];
    assert_eq!(r.read(&mut buf).await.unwrap(), 10);
    assert_eq!(t.bucket().available(), 90);
    let mut eof = tokio::io::empty().throttled_read(&t);
    assert_eq!(eof.read(&mut buf).await.unwrap(), 0);
    assert_eq!(t.bucket().available(), 90);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn async_seek_passes_through() {
    let t = throttle::<Uncapped>(1_000, 100);
    let mut io = std::io::Cursor::new(Vec::new()).throttled(&t);
    io.write_all(b"hello, throttled world").await.unwrap();
    assert_eq!(io.seek(SeekFrom::Start(7)).await.unwrap(), 7);
    let mut s = String::new();
    io.read_to_string(&mut s).await.unwrap();
    assert_eq!(s, "throttled world");
    assert_eq!(io.stream_position().await.unwrap(), 22);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_closed_throttle_fails_the_io_with_an_error() {
    let t = throttle::<Uncapped>(1_000, 100);
    t.close();
    let err = tokio::io::sink()
        .throttled(&t)
        .write(&[0u8; 10])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn capped_adapter_releases_every_token_exactly_once() {
    let t = throttle::<Capped>(1_000, 100);
    let limit = t.bucket().limit();
    // A leak would stall the capped bucket for ever: bound the run (virtual time).
    tokio::time::timeout(Duration::from_secs(60), async {
        let mut w = stutter(7).throttled(&t);
        w.write_all(&[0u8; 500]).await.unwrap();
        let mut r = stutter(13).throttled(&t);
        let mut buf = [0u8; 90];
        for _ in 0..10 {
            assert_eq!(r.read(&mut buf).await.unwrap(), 13);
        }
        // Cancel one in line and drop one holding credit.
        let cancelled = tokio::time::timeout(Duration::from_micros(10), async {
            let mut w = tokio::io::sink().throttled(&t);
            w.write_all(&[0u8; 300]).await
        })
        .await;
        assert!(cancelled.is_err());
        let mut held = stutter(1).throttled(&t);
        let _ = poll_write_once(&mut held, &[0u8; 20]);
    })
    .await
    .expect("the capped bucket stalled: tokens leaked");
    let s = t.bucket().snapshot();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        limit,
        "every grabbed token was released or refunded exactly once: {s:?}"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn request_splits_a_cost_above_the_limit_and_refunds_when_cancelled() {
    let t = throttle::<Uncapped>(1_000, 100);
    let start = Instant::now();
    t.request(350).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(250));
    // 1,000 tokens need 1 s; cancelled after 500 ms the granted pieces go back.
    let cancelled = tokio::time::timeout(Duration::from_millis(500), t.request(1_000)).await;
    assert!(cancelled.is_err());
    // As if nothing had been asked: the bucket refills to its limit by 100 ms later.
    tokio::time::sleep(Duration::from_millis(100)).await;
    t.bucket().replenish();
    assert_eq!(t.bucket().available(), 100);
    t.close();
    assert!(t.request(10).await.is_err());
}

/// A writer that logs each write with the manual clock's time.
struct ClockLog {
    clock: ManualClock,
    log: Vec<(Duration, u64)>,
    data: Vec<u8>,
}

impl Write for ClockLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.log.push((self.clock.now(), buf.len() as u64));
        self.data.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn blocking_wrapper_on_a_manual_clock_keeps_the_rate_exactly() {
    let clock = ManualClock::new();
    let bucket = SharedTokenBucket::<Uncapped, _>::with_clock(
        BucketConfig::new(Rate::per_second(1_000), 100),
        clock.clone(),
    )
    .unwrap();
    let c = clock.clone();
    let throttle =
        BlockingThrottle::from_bucket(Arc::new(bucket)).with_sleep(move |d| c.advance(d));
    let mut w = throttle.wrap(ClockLog {
        clock: clock.clone(),
        log: Vec::new(),
        data: Vec::new(),
    });
    let payload: Vec<u8> = (0..2_100u32).map(|i| i as u8).collect();
    w.write_all(&payload).unwrap();
    // 100 at once, 2,000 more at 1,000/s.
    assert_eq!(clock.now(), Duration::from_secs(2));
    let inner = w.into_inner();
    assert_eq!(inner.data, payload);
    let mut total = 0;
    for &(t, n) in &inner.log {
        assert!(n <= 100);
        total += n;
        assert!(total <= Rate::per_second(1_000).tokens_in(t) as u64 + 100);
    }
    // Reads through the same throttle: the bucket is empty, 500 bytes take 0.5 s.
    let mut r = throttle.wrap(std::io::Cursor::new(payload.clone()));
    r.seek(SeekFrom::Start(100)).unwrap();
    let mut buf = vec![0u8; 500];
    r.read_exact(&mut buf).unwrap();
    assert_eq!(&buf[..], &payload[100..600]);
    assert_eq!(clock.now(), Duration::from_millis(2_500));
    // A read at end of file refunds its grant.
    let mut eof = throttle.wrap(std::io::empty());
    clock.advance(Duration::from_secs(1));
    throttle.bucket().replenish();
    let before = throttle.bucket().available();
    assert_eq!(before, 100);
    assert_eq!(eof.read(&mut buf).unwrap(), 0);
    assert_eq!(throttle.bucket().available(), before);
}

#[test]
fn blocking_threads_share_one_bucket_within_the_bound() {
    // Real time, no timing assertion: 4 threads × 40 KiB through a 10 MiB/s bucket all finish
    // and every byte arrives.
    let throttle =
        BlockingThrottle::new(BucketConfig::new(Rate::per_second(10 << 20), 16 << 10)).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let t = throttle.clone();
            std::thread::spawn(move || {
                let mut w = t.wrap(Vec::new());
                w.write_all(&vec![1u8; 40 << 10]).unwrap();
                w.into_inner().len()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 40 << 10);
    }
}

#[test]
fn blocking_request_on_a_capped_bucket_completes_every_piece() {
    let clock = ManualClock::new();
    let bucket = SharedTokenBucket::<Capped, _>::with_clock(
        BucketConfig::new(Rate::per_second(1_000), 100),
        clock.clone(),
    )
    .unwrap();
    let c = clock.clone();
    let throttle =
        BlockingThrottle::from_bucket(Arc::new(bucket)).with_sleep(move |d| c.advance(d));
    throttle.request(1_050);
    assert_eq!(clock.now(), Duration::from_millis(950));
    let s = throttle.bucket().snapshot();
    assert_eq!(s.ceil.unwrap().wrapping_sub(s.tail), 100);
}

/// A write cancelled by `timeout` while the writer lives on (kept for later) holds no claim in
/// line: another user's `acquire(100)` waits for its own 100 tokens (100 ms), not behind the
/// cancelled 1,000 (1.1 s). The writer works afterwards, in line behind that user.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_write_cancelled_while_the_writer_lives_leaves_no_claim_in_line() {
    let t = throttle::<Uncapped>(1_000, 1_000);
    let mut w = tokio::io::sink().throttled(&t);
    let start = Instant::now();
    w.write_all(&[0u8; 1_000]).await.unwrap(); // empties the bucket
    let cancelled =
        tokio::time::timeout(Duration::from_millis(10), w.write_all(&[0u8; 1_000])).await;
    assert!(cancelled.is_err());
    let _p = t.acquire(100).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    // The writer, used again: 1,000 more tokens after the 1,100 claimed so far.
    w.write_all(&[0u8; 1_000]).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(1_100));
}

/// A read granted 1,000 tokens that moved 10 bytes gives 990 back at once, and the waiter
/// behind it is woken for them: served when the bytes came (500 ms), not at its own timer
/// (1 s).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_short_read_wakes_the_waiter_behind_it() {
    let t = throttle::<Uncapped>(1_000, 1_000);
    let start = Instant::now();
    let (mut tx, rx) = tokio::io::duplex(64);
    let mut r = rx.throttled(&t);
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 1_000];
        r.read(&mut buf).await.unwrap()
    });
    // The reader holds the full bucket while its inner read waits for data.
    while t.bucket().available() != 0 || t.bucket().snapshot().tail == 0 {
        tokio::task::yield_now().await;
    }
    let t2 = t.clone();
    let waiter = tokio::spawn(async move {
        let _p = t2.acquire(1_000).await.unwrap();
        start.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    tx.write_all(&[1u8; 10]).await.unwrap();
    assert_eq!(reader.await.unwrap(), 10);
    // 500 tokens accrued + 990 given back ≥ the waiter's 1,000.
    assert_eq!(waiter.await.unwrap(), Duration::from_millis(500));
}

/// Another crate's `.throttled()` on every type: with `ThrottleExt` and `ThrottleReadExt` in
/// scope, a value that is no I/O object still resolves to it (the adapters' traits are
/// implemented for `AsyncWrite` and `AsyncRead` only; were they on every type, this would not
/// compile: "multiple applicable items in scope").
trait OtherThrottled {
    fn throttled(&self) -> &'static str {
        "other"
    }
    fn throttled_read(&self) -> &'static str {
        "other"
    }
}
impl<T> OtherThrottled for T {}

/// Whether `T` has `ThrottleExt` (an inherent const wins over the trait's fallback only when
/// the bound holds).
struct Probe<T>(std::marker::PhantomData<T>);
trait Fallback {
    const WRITE: bool = false;
    const READ: bool = false;
}
impl<T> Fallback for Probe<T> {}
impl<T: ThrottleExt> Probe<T> {
    const WRITE: bool = true;
}
struct ReadProbe<T>(std::marker::PhantomData<T>);
impl<T> Fallback for ReadProbe<T> {}
impl<T: ThrottleReadExt> ReadProbe<T> {
    const READ: bool = true;
}

#[test]
fn the_throttled_methods_are_only_on_io_objects() {
    assert_eq!(5u32.throttled(), "other");
    assert_eq!(String::new().throttled_read(), "other");
    // Checked at compile time.
    const {
        assert!(!Probe::<u32>::WRITE && !ReadProbe::<u32>::READ);
        assert!(!Probe::<tokio::io::Repeat>::WRITE, "Repeat only reads");
        assert!(ReadProbe::<tokio::io::Repeat>::READ);
        assert!(Probe::<tokio::io::Sink>::WRITE && !ReadProbe::<tokio::io::Sink>::READ);
        assert!(
            Probe::<tokio::io::DuplexStream>::WRITE && ReadProbe::<tokio::io::DuplexStream>::READ
        );
    }
}

/// Writers and readers on one capped throttle, each operation given up after a seeded random
/// timeout (while asleep without a claim, while in line, or never), the adapters kept and
/// reused or dropped at random: the bytes stay within `rate × t + limit`, and once every adapter
/// is gone every grabbed token was released or refunded exactly once (`ceil = tail + limit`).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn random_cancellations_of_adapter_operations_leak_nothing() {
    let t = throttle::<Capped>(10_000, 1_000);
    let log = Log::default();
    let start = Instant::now();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut writers: Vec<_> = (0..4)
        .map(|_| LogSink(log.clone()).throttled(&t).with_max_chunk(400))
        .collect();
    let mut readers: Vec<_> = (0..2)
        .map(|_| tokio::io::repeat(1).throttled_read(&t).with_max_chunk(300))
        .collect();
    let mut buf = vec![0u8; 700];
    for _ in 0..400 {
        let r = next();
        let timeout = Duration::from_micros(r % 200_000);
        let len = 1 + (r >> 20) as usize % 700;
        if r & 1 == 0 {
            let w = &mut writers[(r >> 8) as usize % 4];
            let _ = tokio::time::timeout(timeout, w.write_all(&buf[..len])).await;
        } else {
            let rd = &mut readers[(r >> 8) as usize % 2];
            if let Ok(n) = tokio::time::timeout(timeout, rd.read(&mut buf[..len])).await {
                log.push(n.unwrap() as u64);
            }
        }
        if (r >> 40) % 16 == 0 {
            // Replace one writer: a dropped adapter gives back whatever it held.
            writers[(r >> 44) as usize % 4] =
                LogSink(log.clone()).throttled(&t).with_max_chunk(400);
        }
    }
    let moved = log.check_bound(start, 10_000, 1_000);
    // The cancellations cost no throughput: the bucket was kept busy (virtual time, exact).
    let elapsed = start.elapsed();
    assert!(
        moved as f64 >= 0.9 * 10_000.0 * elapsed.as_secs_f64(),
        "{moved} bytes in {elapsed:?}"
    );
    drop(writers);
    drop(readers);
    let s = t.bucket().snapshot();
    assert_eq!(
        s.ceil.unwrap().wrapping_sub(s.tail),
        1_000,
        "every grabbed token was released or refunded exactly once: {s:?}"
    );
    assert_eq!(t.bucket().deferred_give_backs(), 0);
}
