//! Opening a bucket in shared memory: sharing, typed errors for every kind of bad file, a
//! race-free creation, and the clock every process agrees on.
#![cfg(all(feature = "shm", target_os = "linux"))]

use std::fs;
use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use iothrottle::{
    BucketConfig, Capped, Clock, ManualClock, Rate, SharedMemoryBucket, SharedTokenBucket,
    ShmError, SystemMonotonicClock, Uncapped,
};

fn cfg() -> BucketConfig {
    BucketConfig::new(Rate::per_second(1_000_000), 10_000).with_threshold(10)
}

fn open(path: &Path, cfg: BucketConfig) -> Result<SharedMemoryBucket, ShmError> {
    SharedMemoryBucket::<Uncapped>::open(path, cfg)
}

#[test]
fn two_handles_on_one_path_share_rovers_and_rate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b");
    let a = open(&path, cfg()).unwrap();
    let b = open(&path, cfg()).unwrap();
    assert_eq!(a.shared_path(), Some(path.as_path()));
    a.grab(7);
    b.grab(5);
    assert_eq!(a.snapshot().tail, 12);
    b.refund(3);
    assert_eq!(a.snapshot().head, b.snapshot().head);
    a.set_rate(Rate::per_second(123)).unwrap();
    assert_eq!(b.rate(), Rate::per_second(123));
    // No temporary file is left beside it.
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

/// Two handles on one bucket file in `dir`, and the manual clock both read (set to the system's
/// monotonic time).
fn two_handles(
    dir: &tempfile::TempDir,
) -> (
    ManualClock,
    SharedTokenBucket<Uncapped, ManualClock>,
    SharedTokenBucket<Uncapped, ManualClock>,
) {
    let path = dir.path().join("b");
    let clock = ManualClock::new();
    clock.set(SystemMonotonicClock.now()).unwrap();
    let open =
        || SharedTokenBucket::<Uncapped, _>::open_with_clock(&path, cfg(), clock.clone()).unwrap();
    let (a, b) = (open(), open());
    (clock, a, b)
}

#[test]
fn replenish_through_one_handle_is_seen_by_the_other_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (clock, a, b) = two_handles(&dir);
    assert_eq!(a.replenish(), 10_000); // the first fill
    let t = b.grab(10_000 + 2_500);
    assert_eq!(a.deficiency(t), 2_500);
    clock.advance(Duration::from_micros(2_500));
    assert_eq!(b.replenish(), 2_500);
    assert_eq!(a.deficiency(t), 0);
}

#[test]
fn a_rate_changed_through_one_handle_prices_the_other_handles_next_replenish() {
    // Each handle keeps its own cache of the shared rate for its replenishes: a change through
    // one handle must reach the other's next replenish, whose cache holds the old rate.
    let dir = tempfile::tempdir().unwrap();
    let (clock, a, b) = two_handles(&dir);
    assert_eq!(a.replenish(), 10_000); // the first fill
    a.grab(10_000);
    clock.advance(Duration::from_micros(100));
    assert_eq!(a.replenish(), 100); // 1 per µs, now in `a`'s cache
    b.set_rate(Rate::per_second(3_000_000)).unwrap();
    clock.advance(Duration::from_micros(100));
    assert_eq!(a.replenish(), 300);
    assert_eq!(b.replenish(), 0);
    // And back, through the other handle.
    a.set_rate(Rate::per_second(1_000_000)).unwrap();
    clock.advance(Duration::from_micros(100));
    assert_eq!(b.replenish(), 100);
}

#[test]
fn a_different_configuration_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b");
    let _a = open(&path, cfg()).unwrap();
    let cases = [
        (
            BucketConfig::new(Rate::per_second(1_000_000), 20_000).with_threshold(10),
            "limit",
        ),
        (
            BucketConfig::new(Rate::per_second(1_000_000), 10_000).with_threshold(11),
            "threshold",
        ),
        (
            BucketConfig::new(Rate::per_second(999_999), 10_000).with_threshold(10),
            "rate",
        ),
    ];
    for (other, setting) in cases {
        match open(&path, other) {
            Err(ShmError::Incompatible {
                setting: s,
                ours,
                theirs,
                ..
            }) => {
                assert_eq!(s, setting);
                assert_ne!(ours, theirs);
            }
            other => panic!("{setting}: {other:?}"),
        }
    }
    match SharedMemoryBucket::<Capped>::open(&path, cfg()) {
        Err(
            e @ ShmError::Incompatible {
                setting: "mode", ..
            },
        ) => {
            let msg = e.to_string();
            assert!(msg.contains("uncapped") && msg.contains("capped"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    // An invalid configuration is the configuration's error, before any file is touched.
    let bad = BucketConfig::new(Rate::per_second(1), 0);
    assert!(matches!(
        open(&dir.path().join("c"), bad),
        Err(ShmError::Config(_))
    ));
    assert!(!dir.path().join("c").exists());
}

#[test]
fn files_that_are_not_buckets_get_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    drop(open(&good, cfg()).unwrap());
    let bytes = fs::read(&good).unwrap();
    let write = |name: &str, data: &[u8]| {
        let p = dir.path().join(name);
        fs::File::create(&p).unwrap().write_all(data).unwrap();
        p
    };
    // Empty, short, and foreign files.
    for (name, data) in [
        ("empty", &b""[..]),
        ("short", &b"IOT"[..]),
        ("text", &[b'x'; 4096][..]),
    ] {
        let p = write(name, data);
        assert!(
            matches!(open(&p, cfg()), Err(ShmError::NotABucket { .. })),
            "{name}"
        );
    }
    // A bucket cut short, in its header and in its state.
    for cut in [40, bytes.len() - 1] {
        let p = write(&format!("cut{cut}"), &bytes[..cut]);
        match open(&p, cfg()) {
            Err(ShmError::Truncated { len, need, .. }) => {
                assert_eq!(len, cut as u64);
                assert_eq!(need, bytes.len() as u64);
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    // Another layout version.
    let mut v2 = bytes.clone();
    v2[8..12].copy_from_slice(&2u32.to_le_bytes());
    let p = write("v2", &v2);
    assert!(matches!(
        open(&p, cfg()),
        Err(ShmError::Version {
            found: 2,
            expected: 1,
            ..
        })
    ));
    // Another state size (a build for another cache-line size).
    let mut other = bytes.clone();
    other[16..24].copy_from_slice(&1u64.to_le_bytes());
    let p = write("layout", &other);
    assert!(matches!(
        open(&p, cfg()),
        Err(ShmError::Layout { found_size: 1, .. })
    ));
    // Another boot: its clock readings mean nothing now.
    let mut boot = bytes.clone();
    boot[72] ^= 0xff;
    let p = write("boot", &boot);
    assert!(matches!(open(&p, cfg()), Err(ShmError::OtherBoot { .. })));
    // A directory, and a path in a missing directory: I/O errors naming the file.
    assert!(matches!(open(dir.path(), cfg()), Err(ShmError::Io { .. })));
    let missing = dir.path().join("no/such/dir/b");
    match open(&missing, cfg()) {
        Err(e @ ShmError::Io { .. }) => assert!(e.to_string().contains("no/such/dir")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn racing_creators_all_get_the_one_bucket() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let path = Arc::new(dir.path().join(format!("b{round}")));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let path = Arc::clone(&path);
                std::thread::spawn(move || {
                    let b = open(&path, cfg()).unwrap();
                    b.grab(1);
                    b
                })
            })
            .collect();
        let buckets: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for b in &buckets {
            assert_eq!(
                b.snapshot().tail,
                4,
                "round {round}: a creator got its own bucket"
            );
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}

/// Runs only when started by `the_clock_agrees_across_processes`: prints its reading.
#[test]
#[ignore = "started as a child process by the_clock_agrees_across_processes"]
fn clock_child() {
    if std::env::var("IOTHROTTLE_SHM_CLOCK_CHILD").is_ok() {
        println!("NOW={}", SystemMonotonicClock.now().as_nanos());
    }
}

#[test]
fn the_clock_agrees_across_processes() {
    // A child's reading falls between two of ours: one time base for every process (an
    // `Instant`-based clock would count from each process's own origin).
    let before = SystemMonotonicClock.now().as_nanos();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["clock_child", "--exact", "--ignored", "--nocapture"])
        .env("IOTHROTTLE_SHM_CLOCK_CHILD", "1")
        .output()
        .unwrap();
    let after = SystemMonotonicClock.now().as_nanos();
    let text = String::from_utf8_lossy(&out.stdout);
    let child: u128 = text
        .lines()
        .find_map(|l| l.strip_prefix("NOW="))
        .unwrap_or_else(|| panic!("child output: {text}"))
        .parse()
        .unwrap();
    assert!(
        before <= child && child <= after,
        "{before} <= {child} <= {after}"
    );
}
