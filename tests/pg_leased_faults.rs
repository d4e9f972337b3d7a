//! Leased mode when something fails, against a real throwaway PostgreSQL: the server restarted
//! while leases are out or stopped under batched load, a process holding leases killed with
//! SIGKILL, the runtime shut down in the middle of a lease or a refill. Each test asserts the
//! bound, or that no lease is lost and no session stays stuck; none asserts a timing.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::pg::{cluster_or_skip, PgCluster};
use common::pg_leased::{global_micro, lease_asked, leased, ms, poll_once};
use iothrottle::pg::{LeaseOptions, PgKeyedLimiter, PgLeasedLimiter, PgOptions};
use iothrottle::{ManualClock, PgLimitError};

#[tokio::test]
async fn postgres_restart_while_leases_are_out() {
    let Some(mut pg) = cluster_or_skip("postgres_restart_while_leases_are_out") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(100, 100, 50).unwrap().with_min_lease(50);
    let l = leased(&pg, opts, &clock).await;
    assert!(l.try_acquire("k", 1).await.unwrap());
    assert_eq!(l.local_tokens("k"), 49);
    pg.stop();
    // The lease keeps serving while the server is down.
    for _ in 0..49 {
        assert!(l.try_acquire("k", 1).await.unwrap());
    }
    // Dry: leasing needs the server. The session is found lost (`Connection`), or a
    // background lease found it lost first and reconnecting now backs off (`Unavailable`).
    let dry = l.try_acquire("k", 1).await;
    assert!(
        matches!(
            dry,
            Err(PgLimitError::Connection { .. }
                | PgLimitError::Connect { .. }
                | PgLimitError::Unavailable { .. })
        ),
        "{dry:?}"
    );
    pg.start_again().unwrap();
    clock.advance(ms(1_000));
    // Reconnected: leasing works again (a background refill may already have leased). A
    // background lease that failed while the server was down started the reconnect back-off:
    // the first call may still be told `Unavailable` with how long to wait.
    let mut first = l.try_acquire("k", 1).await;
    for _ in 0..100 {
        match first {
            Err(PgLimitError::Unavailable { retry_in, .. }) => {
                tokio::time::sleep(retry_in).await;
                first = l.try_acquire("k", 1).await;
            }
            _ => break,
        }
    }
    assert!(first.unwrap(), "reconnected and leased again");
    for _ in 1..60 {
        assert!(
            l.try_acquire("k", 1).await.unwrap(),
            "reconnected and leased again"
        );
    }
    let s = l.stats();
    assert_eq!(s.granted, 110);
    assert_eq!(s.leased, s.granted + l.local_tokens("k"));
    // The row survived the restart: nothing was leased twice. Over the 1 s since the first
    // lease at most burst + rate × 1 s = 200 can have been leased, and the row (as of its
    // last statement) accounts for exactly what was not.
    assert!(s.leased <= 200, "{s:?}");
    let row = global_micro(&pg, "k").await;
    assert!(row >= 0 && (s.leased as i64 * 1_000_000 + row) <= 200_000_000);
}

/// Reads the server's clock.
async fn server_now(pg: &PgCluster) -> SystemTime {
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c.query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0)
}

const HOSTILE_KEYS: usize = 32;

fn hostile_options() -> LeaseOptions {
    LeaseOptions::new(1_000, 100, 20)
        .unwrap()
        .with_trickle_interval(ms(5))
}

/// Stops [`hammer`]'s tasks, waits for them, and returns the most one key may have been
/// granted from `start` to now (the server's clock).
async fn stop_hammer(
    stop: &AtomicBool,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pg: &PgCluster,
    opts: &LeaseOptions,
    start: SystemTime,
) -> u128 {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let end = server_now(pg).await;
    opts.bound(1, end.duration_since(start).unwrap())
}

/// A limiter on `conn` with [`hostile_options`] and two connections.
async fn hostile_limiter(conn: &str) -> Arc<PgLeasedLimiter> {
    Arc::new(
        PgLeasedLimiter::connect(
            conn,
            PgOptions::new().with_connections(2),
            hostile_options(),
        )
        .await
        .unwrap(),
    )
}

/// [`hammer`]'s tasks, the flag that stops them, and what they count.
struct Hammer {
    stop: Arc<AtomicBool>,
    /// Per key, the grants.
    granted: Arc<Vec<AtomicU64>>,
    /// The errors seen (each a typed connection or server error).
    errors: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Calls on `HOSTILE_KEYS` keys from 8 tasks until `stop` is set; returns once every key was
/// granted at least once (`what` names that wait if it hangs).
async fn hammer(l: Arc<PgLeasedLimiter>, what: &str) -> Hammer {
    use std::sync::atomic::Ordering::Relaxed;
    let stop = Arc::new(AtomicBool::new(false));
    let granted: Arc<Vec<AtomicU64>> =
        Arc::new((0..HOSTILE_KEYS).map(|_| AtomicU64::new(0)).collect());
    let errors = Arc::new(AtomicU64::new(0));
    let tasks = (0..8)
        .map(|t| {
            let (l, stop, granted, errors) =
                (l.clone(), stop.clone(), granted.clone(), errors.clone());
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    for k in (t..HOSTILE_KEYS).step_by(8) {
                        match l.try_acquire(&format!("h{k}"), 1).await {
                            Ok(true) => {
                                granted[k].fetch_add(1, Relaxed);
                            }
                            Ok(false) => {}
                            Err(
                                PgLimitError::Connection { .. }
                                | PgLimitError::Connect { .. }
                                | PgLimitError::Unavailable { .. }
                                | PgLimitError::Db { .. },
                            ) => {
                                errors.fetch_add(1, Relaxed);
                            }
                            Err(e) => panic!("untyped failure: {e:?}"),
                        }
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    until(what, || counts(&granted).iter().all(|&g| g > 0)).await;
    Hammer {
        stop,
        granted,
        errors,
        tasks,
    }
}

/// Waits (yielding, with a generous guard against a hang) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let guard = std::time::Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(
            std::time::Instant::now() < guard,
            "hung waiting for: {what}"
        );
        tokio::time::sleep(ms(5)).await;
    }
}

fn counts(v: &[std::sync::atomic::AtomicU64]) -> Vec<u64> {
    v.iter()
        .map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
        .collect()
}

/// A new current-thread runtime with every driver (the tests drop one mid-lease).
fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every key has been granted more than it had at `then`.
fn every_key_advanced(v: &[std::sync::atomic::AtomicU64], then: &[u64]) -> bool {
    counts(v).iter().zip(then).all(|(now, then)| now > then)
}

/// Server stopped (fast shutdown) while batches of leases are in flight on 32 hot keys, then
/// started again: every failing call fails with a typed error, none hangs, leasing resumes
/// on every key after the restart, and no key is granted more than
/// `rate × W + burst + max_lease` (one process) over the whole run on the server's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stopped_under_batched_load() {
    use std::sync::atomic::Ordering::Relaxed;
    let Some(pg) = cluster_or_skip("server_stopped_under_batched_load") else {
        return;
    };
    let start = server_now(&pg).await;
    let opts = hostile_options();
    let l = hostile_limiter(&pg.connection_string()).await;
    l.install().await.unwrap();
    let Hammer {
        stop,
        granted,
        errors,
        tasks,
    } = hammer(l.clone(), "every key granted").await;
    let pg = tokio::task::spawn_blocking(move || {
        let mut pg = pg;
        pg.stop();
        pg
    })
    .await
    .unwrap();
    until("calls fail while the server is down", || {
        errors.load(Relaxed) > 0
    })
    .await;
    let mut pg = pg;
    pg.start_again().unwrap();
    let at_restart = counts(&granted);
    until("every key leases again after the restart", || {
        every_key_advanced(&granted, &at_restart)
    })
    .await;
    let bound = stop_hammer(&stop, tasks, &pg, &opts, start).await;
    let s = l.stats();
    eprintln!(
        "granted {:?}, {} errors, {} leases in {} statements, bound {bound} per key",
        counts(&granted),
        errors.load(Relaxed),
        s.leases,
        s.lease_statements
    );
    for (k, g) in counts(&granted).into_iter().enumerate() {
        assert!(g as u128 <= bound, "key h{k}: {g} > {bound}");
    }
}

/// The child of `kill_9_of_a_process_holding_leases`: leases on the hostile keys until it is
/// killed; prints `LEASING` once every key has been granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a child process by kill_9_of_a_process_holding_leases"]
async fn leased_kill_child() {
    let Ok(conn) = std::env::var("IOTHROTTLE_KILL_CHILD") else {
        return;
    };
    // Held while the process waits to be killed: its tasks keep leasing.
    let _hammer = hammer(hostile_limiter(&conn).await, "every key granted").await;
    println!("LEASING");
    std::future::pending::<()>().await;
}

/// `kill -9` of a process that holds leases on 32 hot keys and has batches in flight, while
/// this process leases the same keys: the survivor keeps leasing every key (the killed
/// backend's row locks go with its session) and never grants more than the bound for one
/// process, `rate × W + burst + max_lease` on the server's clock; the killed process's
/// tokens are lost (under-use), not granted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_process_holding_leases() {
    use std::io::BufRead;
    use std::sync::atomic::Ordering::Relaxed;
    let Some(pg) = cluster_or_skip("kill_9_of_a_process_holding_leases") else {
        return;
    };
    let setup = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    setup.install().await.unwrap();
    let start = server_now(&pg).await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["leased_kill_child", "--exact", "--ignored", "--nocapture"])
        .env("IOTHROTTLE_KILL_CHILD", pg.connection_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let ready = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            if line.contains("LEASING") {
                return true;
            }
            line.clear();
        }
        false
    })
    .await
    .unwrap();
    assert!(ready, "the child leased");
    let opts = hostile_options();
    let l = hostile_limiter(&pg.connection_string()).await;
    let Hammer {
        stop,
        granted,
        errors,
        tasks,
    } = hammer(l.clone(), "both processes lease every key").await;
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let at_kill = counts(&granted);
    until("the survivor leases every key after the kill", || {
        every_key_advanced(&granted, &at_kill)
    })
    .await;
    let bound = stop_hammer(&stop, tasks, &pg, &opts, start).await;
    eprintln!(
        "survivor granted {:?}; bound {bound} per key",
        counts(&granted)
    );
    assert_eq!(errors.load(Relaxed), 0, "the survivor saw no error");
    for (k, g) in counts(&granted).into_iter().enumerate() {
        assert!(g as u128 <= bound, "key h{k}: {g} > {bound}");
    }
}

/// A runtime shut down while a lease's batch is under way drops the task that runs the
/// session's batches. The session must not stay marked as having one running (its next
/// lease would wait forever): used from a new runtime, the limiter reconnects and leases.
#[test]
fn runtime_shut_down_mid_lease_leaves_no_batch_stuck() {
    let Some(pg) = cluster_or_skip("runtime_shut_down_mid_lease_leaves_no_batch_stuck") else {
        return;
    };
    let clock = ManualClock::new();
    let opts = LeaseOptions::new(10, 100, 10).unwrap().with_min_lease(10);
    let first = current_thread_runtime();
    let l = first.block_on(async {
        let l = leased(&pg, opts, &clock).await;
        assert!(l.try_acquire("warm", 1).await.unwrap());
        {
            let mut call = std::pin::pin!(l.try_acquire("k", 1));
            assert!(poll_once(call.as_mut()).await.is_none());
            lease_asked(&l, 2).await; // queued in its session's batch
        }
        l
    });
    drop(first);
    current_thread_runtime().block_on(async {
        let next = tokio::time::timeout(Duration::from_secs(30), l.try_acquire("k", 1)).await;
        assert!(
            matches!(next, Ok(Ok(true))),
            "the next lease failed or hung: {next:?}"
        );
    });
}

/// A runtime shut down while a key's background refill is under way must not leave the key's
/// refill flag held: used from a new runtime, a take that leaves the key low starts a
/// background lease again (before, the flag stayed claimed by the dropped task and the key
/// only ever leased from its callers' slow path, after running dry).
#[test]
fn runtime_shut_down_mid_refill_leaves_the_refill_flag_free() {
    let Some(pg) = cluster_or_skip("runtime_shut_down_mid_refill_leaves_the_refill_flag_free")
    else {
        return;
    };
    let clock = ManualClock::new();
    // Leases of 10; the low-water line is half a lease.
    let opts = LeaseOptions::new(10, 100, 10).unwrap().with_min_lease(10);
    let first = current_thread_runtime();
    let l = first.block_on(async {
        let l = leased(&pg, opts, &clock).await;
        assert!(l.try_acquire("k", 1).await.unwrap()); // leased 10 (slow path), 9 left
        assert!(l.try_acquire("k", 5).await.unwrap()); // fast path: 4 left, low
        lease_asked(&l, 2).await; // the background refill's lease is under way
        l
    });
    drop(first);
    current_thread_runtime().block_on(async {
        let before = l.stats().leases;
        assert_eq!(l.local_tokens("k"), 4);
        assert!(l.try_acquire("k", 1).await.unwrap()); // fast path, 3 left: still low
        until("a background refill leases again", || {
            l.stats().leases > before
        })
        .await;
        until("its tokens land", || l.local_tokens("k") > 3).await;
    });
}
