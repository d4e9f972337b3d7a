//! Error messages say what failed: the server's SQLSTATE and text for a server error or a
//! killed session (never the driver's bare "db error"), and for a connection that never
//! opened, why (a bad connection string, a refused connection), never "lost".

mod common;

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use common::pg::{cluster_or_skip, error_chain};
use common::pg_session::{
    client, hold_row_lock, no_backend_waiting, t0, waiting_backend, STUCK_AFTER,
};
use iothrottle::pg::{PgKeyedLimiter, PgOptions, PgWindowLimiter, Zone};
use iothrottle::PgLimitError;

#[tokio::test]
async fn terminated_backend_error_shows_sqlstate_and_server_message() {
    let Some(pg) = cluster_or_skip("terminated_backend_error_shows_sqlstate_and_server_message")
    else {
        return;
    };
    let l = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    l.install().await.unwrap();
    l.request_n_at("k", 1, 100, 1, t0()).await.unwrap();
    // Park the limiter's statement on a row lock, then terminate its backend.
    let blocker = hold_row_lock(&pg, "k").await;
    let (res, ()) = tokio::join!(l.request_n_at("k", 1, 100, 1, t0()), async {
        let pid = waiting_backend(&blocker).await;
        blocker
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap();
    });
    let err = res.unwrap_err();
    assert!(matches!(err, PgLimitError::Connection { .. }), "{err:?}");
    let text = error_chain(&err);
    assert!(text.contains("57P01"), "{text}");
    assert!(
        text.contains("terminating connection due to administrator command"),
        "{text}"
    );
    // The server's text comes once, from the cause: the error's own message names only the
    // SQLSTATE, so a reporter that prints the chain (anyhow, eyre) does not repeat it.
    let own = err.to_string();
    assert!(own.contains("57P01"), "{own}");
    assert!(!own.contains("terminating connection"), "{own}");
    assert_eq!(text.matches("terminating connection").count(), 1, "{text}");
}

#[tokio::test]
async fn server_error_shows_sqlstate_and_server_message() {
    let Some(pg) = cluster_or_skip("server_error_shows_sqlstate_and_server_message") else {
        return;
    };
    let l = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    l.install().await.unwrap();
    // A constraint the statement breaks: the server refuses it with 23514.
    client(&pg)
        .await
        .batch_execute("ALTER TABLE iothrottle.token_bucket ADD CONSTRAINT no_k CHECK (id <> 'k')")
        .await
        .unwrap();
    let err = l.request("k", 1, 10).await.unwrap_err();
    let text = error_chain(&err);
    assert!(
        matches!(&err, PgLimitError::Db { sqlstate, .. } if sqlstate == "23514"),
        "{err:?}"
    );
    assert!(text.contains("23514"), "{text}");
    assert!(
        text.contains("violates check constraint \"no_k\""),
        "{text}"
    );
}

/// Before `install()` every statement finds no table or function: the error says so, with
/// the schema looked in, instead of the server's `42P01`/`42883`.
#[tokio::test]
async fn a_call_before_install_is_not_installed() {
    let Some(pg) = cluster_or_skip("a_call_before_install_is_not_installed") else {
        return;
    };
    let opts = PgOptions::new().with_schema("nothing_here");
    let l = PgKeyedLimiter::connect(&pg.connection_string(), opts.clone())
        .await
        .unwrap();
    for err in [
        l.request("k", 1, 10).await.unwrap_err(),
        l.request_n_at("k", 1, 10, 1, t0()).await.unwrap_err(),
        l.peek("k", 1, 10).await.unwrap_err(),
        l.give_back("k", 1, 10, 1).await.unwrap_err(),
    ] {
        assert!(
            matches!(&err, PgLimitError::NotInstalled { schema } if schema == "nothing_here"),
            "{err:?}"
        );
        assert!(err.to_string().contains("install()"), "{err}");
    }
    let w = PgWindowLimiter::connect(&pg.connection_string(), opts)
        .await
        .unwrap();
    let err = w.check("login", "k").await.unwrap_err();
    assert!(matches!(err, PgLimitError::NotInstalled { .. }), "{err:?}");
    // Installed, the same calls work.
    l.install().await.unwrap();
    assert_eq!(l.request("k", 1, 10).await.unwrap(), 9);
}

/// An unparsable connection string is reported as such: nothing was connected, so nothing
/// was lost.
#[tokio::test]
async fn an_invalid_connection_string_says_so() {
    let err = PgKeyedLimiter::connect("host=x port=notaport", PgOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, PgLimitError::InvalidConnectionString { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("invalid PostgreSQL connection string"),
        "{text}"
    );
    assert!(!text.contains("lost"), "{text}");
    assert!(error_chain(&err).contains("port"), "{}", error_chain(&err));
    let err = PgWindowLimiter::connect("postgresql://[", PgOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, PgLimitError::InvalidConnectionString { .. }),
        "{err:?}"
    );
}

/// A server that refuses the connection: "could not connect", with the socket's reason among
/// the causes; never "connection lost (the outcome is unknown)".
#[tokio::test]
async fn a_refused_connection_says_it_could_not_connect() {
    // A port nobody listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = format!("host=127.0.0.1 port={port} user=nobody connect_timeout=5");
    let err = PgKeyedLimiter::connect(&config, PgOptions::new())
        .await
        .unwrap_err();
    assert!(matches!(err, PgLimitError::Connect { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("could not connect"), "{text}");
    assert!(
        !text.contains("lost") && !text.contains("unknown"),
        "{text}"
    );
    let chain = error_chain(&err);
    assert!(chain.to_lowercase().contains("refused"), "{chain}");
}

/// A caller-given time outside `timestamptz` (4713 BC to 294276 AD) is refused before it
/// reaches the driver, whose conversion would overflow (a panic with overflow checks) or wrap
/// (a far-future time stored as the key's, so the key never refills again).
#[tokio::test]
async fn an_out_of_range_time_is_a_typed_error() {
    let Some(pg) = cluster_or_skip("an_out_of_range_time_is_a_typed_error") else {
        return;
    };
    let l = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    l.install().await.unwrap();
    let far = UNIX_EPOCH + Duration::from_secs(20_000_000_000_000);
    // Inside the driver's 64-bit microseconds, but after 294276 AD.
    let year_300000 = UNIX_EPOCH + Duration::from_secs(9_400_000_000_000);
    let before_4713_bc = UNIX_EPOCH - Duration::from_secs(211_000_000_000);
    for at in [far, year_300000, before_4713_bc] {
        let err = l.request_n_at("k", 10, 10, 1, at).await.unwrap_err();
        assert!(
            matches!(err, PgLimitError::TimeOutOfRange { at: a } if a == at),
            "{err:?}"
        );
        assert!(err.to_string().contains("timestamptz"), "{err}");
        let err = l.peek_at("k", 10, 10, at).await.unwrap_err();
        assert!(
            matches!(err, PgLimitError::TimeOutOfRange { .. }),
            "{err:?}"
        );
        let err = l.take("k", 10, 10, 1, true, Some(at)).await.unwrap_err();
        assert!(
            matches!(err, PgLimitError::TimeOutOfRange { .. }),
            "{err:?}"
        );
    }
    // Nothing was written: the key is new, and refills normally from t0.
    assert_eq!(l.request_n_at("k", 10, 10, 100, t0()).await.unwrap(), 0);
    assert_eq!(
        l.request_n_at("k", 10, 10, 10, t0() + Duration::from_secs(1))
            .await
            .unwrap(),
        0
    );
    let w = PgWindowLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    let err = w.check_at("login", "k", far).await.unwrap_err();
    assert!(
        matches!(err, PgLimitError::TimeOutOfRange { .. }),
        "{err:?}"
    );
    let err = w.purge(10, Some(far)).await.unwrap_err();
    assert!(
        matches!(err, PgLimitError::TimeOutOfRange { .. }),
        "{err:?}"
    );
}

/// `purge(0)` names the purge's batch size, not a number of tokens.
#[tokio::test]
async fn purge_of_zero_rows_names_the_batch_size() {
    let Some(pg) = cluster_or_skip("purge_of_zero_rows_names_the_batch_size") else {
        return;
    };
    let w = PgWindowLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    for batch in [0, -5] {
        let err = w.purge(batch, None).await.unwrap_err();
        assert!(
            matches!(err, PgLimitError::InvalidOption { name: "batch", .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(text.contains("purge batch size"), "{text}");
        assert!(!text.contains("tokens"), "{text}");
    }
}

/// A fast shutdown under load: calls in flight are told why (57P01 from the terminated
/// backends, 57P03 while the server shuts down, or the socket's error once it is gone), and
/// no error reads as the driver's bare "db error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_stopped_under_load_errors_say_why() {
    let Some(mut pg) = cluster_or_skip("server_stopped_under_load_errors_say_why") else {
        return;
    };
    let keyed = Arc::new(
        PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
            .await
            .unwrap(),
    );
    keyed.install().await.unwrap();
    let window = Arc::new(
        PgWindowLimiter::connect(&pg.connection_string(), PgOptions::new())
            .await
            .unwrap(),
    );
    window
        .upsert_zone(&Zone {
            id: "login".into(),
            description: String::new(),
            rate: 1_000_000,
            window_seconds: 60,
        })
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (keyed, window) = (keyed.clone(), window.clone());
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            while errors.len() < 3 {
                let r = if i % 2 == 0 {
                    keyed.request(&format!("k{i}"), 1_000, 60).await.map(|_| ())
                } else {
                    window.check("login", "u").await.map(|_| ())
                };
                if let Err(e) = r {
                    errors.push(error_chain(&e));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            errors
        }));
    }
    // Let the load start, then stop the server under it.
    while keyed.stats().calls < 50 || window.stats().calls < 50 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    pg.stop();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    eprintln!("{all:#?}");
    for e in &all {
        assert!(!e.ends_with("db error"), "{e}");
        let says_why = [
            "57P01",
            "57P03",
            "08",
            "refused",
            "closed",
            "reset",
            "broken pipe",
        ]
        .iter()
        .any(|w| e.to_lowercase().contains(&w.to_lowercase()));
        assert!(says_why, "{e}");
    }
    // A call in flight lost its session and says which shutdown the server gave as the reason:
    // 57P01 (its backend terminated) or 57P03 (shutting down); one CI dry run saw only 57P03.
    assert!(
        all.iter()
            .any(|e| e.starts_with("connection to PostgreSQL lost")
                && (e.contains("57P01") || e.contains("57P03"))),
        "a call in flight saw the shutdown: {all:#?}"
    );
}

/// Per-call timeouts: a call stuck on a row lock fails with `TimedOut` after its timeout
/// (whatever the server does), and the next call runs on a fresh session.
#[tokio::test]
async fn a_stuck_call_times_out_and_the_next_one_reconnects() {
    let Some(pg) = cluster_or_skip("a_stuck_call_times_out_and_the_next_one_reconnects") else {
        return;
    };
    let opts = PgOptions::new()
        .with_connections(1)
        .with_call_timeout(Some(STUCK_AFTER));
    let l = PgKeyedLimiter::connect(&pg.connection_string(), opts)
        .await
        .unwrap();
    l.install().await.unwrap();
    l.request_n_at("k", 1, 100, 1, t0()).await.unwrap();
    let blocker = hold_row_lock(&pg, "k").await;
    let err = l.request_n_at("k", 1, 100, 1, t0()).await.unwrap_err();
    assert!(
        matches!(err, PgLimitError::TimedOut { after } if after == STUCK_AFTER),
        "{err:?}"
    );
    // The limiter asked the server to cancel the stuck statement: it stops waiting.
    no_backend_waiting(&blocker).await;
    blocker.batch_execute("ROLLBACK").await.unwrap();
    // The cancelled statement took nothing; the next call runs on a new session.
    assert_eq!(l.request_n_at("k", 1, 100, 1, t0()).await.unwrap(), 98);
    assert_eq!(l.stats().connects, 2);
    assert!(matches!(
        PgKeyedLimiter::connect(
            &pg.connection_string(),
            PgOptions::new().with_call_timeout(Some(Duration::ZERO))
        )
        .await,
        Err(PgLimitError::InvalidOption {
            name: "call_timeout",
            ..
        })
    ));
    for n in [0, iothrottle::pg::MAX_CONNECTIONS + 1] {
        assert!(matches!(
            PgKeyedLimiter::connect(
                &pg.connection_string(),
                PgOptions::new().with_connections(n)
            )
            .await,
            Err(PgLimitError::InvalidOption {
                name: "connections",
                ..
            })
        ));
    }
}

/// Reconnecting backs off: while the server is down, a failed connect makes the calls of the
/// next moment fail at once with `Unavailable` (saying why), instead of each trying again.
#[tokio::test]
async fn reconnecting_backs_off_and_says_why() {
    let Some(mut pg) = cluster_or_skip("reconnecting_backs_off_and_says_why") else {
        return;
    };
    let l = PgKeyedLimiter::connect(
        &pg.connection_string(),
        PgOptions::new().with_connections(1),
    )
    .await
    .unwrap();
    l.install().await.unwrap();
    l.request("k", 10, 10).await.unwrap();
    pg.stop();
    // The call that finds the session gone, then the connect that is refused.
    let mut errors = Vec::new();
    let unavailable = loop {
        match l.request("k", 10, 10).await {
            Err(e @ PgLimitError::Unavailable { .. }) => break e,
            Err(e) => errors.push(error_chain(&e)),
            Ok(_) => panic!("the server is down"),
        }
        assert!(errors.len() < 10, "{errors:#?}");
    };
    let text = error_chain(&unavailable);
    assert!(text.to_lowercase().contains("refused"), "{text}");
    match unavailable {
        PgLimitError::Unavailable { retry_in, .. } => {
            assert!(retry_in > Duration::ZERO && retry_in <= Duration::from_secs(2))
        }
        _ => unreachable!(),
    }
    pg.start_again().unwrap();
    // Back once the back-off has passed.
    loop {
        match l.request("k", 10, 10).await {
            Ok(_) => break,
            Err(PgLimitError::Unavailable { retry_in, .. }) => tokio::time::sleep(retry_in).await,
            Err(e) => panic!("after the restart: {e}"),
        }
    }
}

/// How the server closes the session in [`queued_calls_say_why`].
#[derive(Clone, Copy, Debug)]
enum CloseBy {
    /// `pg_terminate_backend` of the limiter's session.
    Terminate,
    /// An immediate shutdown of the whole server (`pg_ctl stop -m immediate`: SIGQUIT to
    /// the postmaster; every session gets a `57P01` warning and is cut).
    StopImmediate,
}

/// Calls pipelined on a session behind the statement that received the server's `57P01` say
/// more than "connection closed". Three calls on one session: the first waits on
/// a row lock, two more are queued behind it; the server closes the session. Every call must
/// say why: the first through the server's error itself, the queued ones through
/// `closed_by`.
async fn queued_calls_say_why(name: &str, how: CloseBy) {
    let Some(pg) = cluster_or_skip(name) else {
        return;
    };
    let l = Arc::new(
        PgKeyedLimiter::connect(
            &pg.connection_string(),
            PgOptions::new().with_connections(1),
        )
        .await
        .unwrap(),
    );
    l.install().await.unwrap();
    for k in ["k", "q1", "q2"] {
        l.request_n_at(k, 1, 100, 1, t0()).await.unwrap();
    }
    let blocker = hold_row_lock(&pg, "k").await;
    let first = {
        let l = l.clone();
        tokio::spawn(async move { l.request_n_at("k", 1, 100, 1, t0()).await })
    };
    let pid = waiting_backend(&blocker).await;
    let queued: Vec<_> = ["q1", "q2"]
        .into_iter()
        .map(|k| {
            let l = l.clone();
            tokio::spawn(async move { l.request_n_at(k, 1, 100, 1, t0()).await })
        })
        .collect();
    // Both queued calls have started (counted) and, once they had their turn on the
    // runtime, been written to the session behind the blocked statement.
    while l.stats().calls < 6 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    match how {
        CloseBy::Terminate => {
            let killer = client(&pg).await;
            killer
                .execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .unwrap();
        }
        CloseBy::StopImmediate => {
            let pid = std::fs::read_to_string(pg.data_dir().join("postmaster.pid")).unwrap();
            let pid = pid.lines().next().unwrap().trim().to_owned();
            let quit = std::process::Command::new("kill")
                .args(["-QUIT", &pid])
                .status()
                .unwrap();
            assert!(quit.success());
        }
    }
    let first = first.await.unwrap().unwrap_err();
    let text = error_chain(&first);
    eprintln!("{how:?}, the blocked call: {text}");
    match how {
        CloseBy::Terminate => assert!(
            matches!(
                first,
                PgLimitError::Connection {
                    closed_by: None,
                    ..
                }
            ),
            "{first:?}"
        ),
        CloseBy::StopImmediate => assert!(
            matches!(
                first,
                PgLimitError::Connection {
                    closed_by: Some(_),
                    ..
                }
            ),
            "{first:?}"
        ),
    }
    assert!(text.contains("57P01"), "{text}");
    for q in queued {
        let e = q.await.unwrap().unwrap_err();
        let text = error_chain(&e);
        eprintln!("{how:?}, a queued call: {text}");
        match &e {
            PgLimitError::Connection {
                closed_by: Some(reason),
                ..
            } => assert!(
                reason.starts_with("57P01 ") && reason.contains("terminating connection"),
                "{reason}"
            ),
            other => panic!("a queued call must carry the server's reason: {other:?} ({text})"),
        }
        assert!(text.contains("57P01"), "{text}");
        assert!(text.contains("the server closed the session"), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_carry_the_reason_of_a_terminated_session() {
    queued_calls_say_why(
        "queued_calls_carry_the_reason_of_a_terminated_session",
        CloseBy::Terminate,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_carry_the_reason_of_an_immediate_server_stop() {
    queued_calls_say_why(
        "queued_calls_carry_the_reason_of_an_immediate_server_stop",
        CloseBy::StopImmediate,
    )
    .await;
}
