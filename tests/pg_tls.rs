//! TLS (feature `postgres-tls`) against a real throwaway PostgreSQL with a self-signed
//! certificate made by the test: a limiter and a checkpoint over TLS really run encrypted
//! sessions (`pg_stat_ssl`), a client that does not trust the certificate gets a typed error
//! naming the handshake failure, and a configured TLS never falls back to plaintext.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pg::{cluster_or_skip, cluster_with_files_or_skip, error_chain, PgCluster};
// A plaintext administrator session (the cluster accepts both).
use common::pg_session::{client as admin, hold_row_lock, no_backend_waiting, STUCK_AFTER};
use iothrottle::checkpoint::{Checkpoint, PgCheckpoint, Snapshot};
use iothrottle::pg::{PgKeyedLimiter, PgOptions, PgWindowLimiter};
use iothrottle::{BucketConfig, CheckpointError, PgLimitError, Rate, SharedTokenBucket};
use rustls::{ClientConfig, RootCertStore};

/// A self-signed certificate for `127.0.0.1` and `localhost`, whose subject is `CN=cn`:
/// (certificate DER, PEM, key PEM).
fn self_signed(cn: &str) -> (Vec<u8>, String, String) {
    self_signed_for(cn, &["127.0.0.1", "localhost"])
}

/// A self-signed certificate for the names (or addresses) `sans`.
fn self_signed_for(cn: &str, sans: &[&str]) -> (Vec<u8>, String, String) {
    let mut params =
        rcgen::CertificateParams::new(sans.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("certificate parameters");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    let key = rcgen::KeyPair::generate().expect("key pair");
    let cert = params.self_signed(&key).expect("self-signed certificate");
    (cert.der().to_vec(), cert.pem(), key.serialize_pem())
}

/// A rustls client configuration (the `ring` provider) trusting only `root`.
fn trusting(root: &[u8]) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(root.to_vec()))
        .expect("root certificate");
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// A cluster with `ssl=on` and the certificate; returns it with the certificate's DER.
fn tls_cluster(test: &str) -> Option<(PgCluster, Vec<u8>)> {
    tls_cluster_for(test, &["127.0.0.1", "localhost"])
}

/// [`tls_cluster`] with a certificate for `sans`.
fn tls_cluster_for(test: &str, sans: &[&str]) -> Option<(PgCluster, Vec<u8>)> {
    let (der, cert, key) = self_signed_for("iothrottle test server", sans);
    let pg = cluster_with_files_or_skip(
        test,
        &[
            ("ssl", "on"),
            ("ssl_cert_file", "server.crt"),
            ("ssl_key_file", "server.key"),
        ],
        &[
            ("server.crt", cert.as_bytes()),
            ("server.key", key.as_bytes()),
        ],
    )?;
    Some((pg, der))
}

/// `(sessions, encrypted sessions)` of `application_name = app`, seen from another session.
async fn sessions_of(admin: &tokio_postgres::Client, app: &str) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .expect("pg_stat_ssl");
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn the_certificate_setup_gives_encrypted_sessions() {
    let Some((pg, der)) = tls_cluster("the_certificate_setup_gives_encrypted_sessions") else {
        return;
    };
    // The check itself tells the two apart: a plaintext session is `ssl = false`, a session
    // through the same rustls connector the crate uses is `ssl = true`.
    let ssl_of = async |c: &tokio_postgres::Client| -> bool {
        c.query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_ssl")
        .get(0)
    };
    assert!(!ssl_of(&admin(&pg).await).await, "NoTls is plaintext");
    let config = format!("{} sslmode=require", pg.connection_string());
    let make = tokio_postgres_rustls::MakeRustlsConnect::new(trusting(&der));
    let (c, conn) = tokio_postgres::connect(&config, make)
        .await
        .expect("TLS connect");
    tokio::spawn(conn);
    assert!(ssl_of(&c).await, "rustls session is encrypted");
}

#[tokio::test]
async fn limiters_over_tls_trusting_the_certificate() {
    let Some((pg, der)) = tls_cluster("limiters_over_tls_trusting_the_certificate") else {
        return;
    };
    let opts = PgOptions::new()
        .with_connections(2)
        .with_tls(trusting(&der));
    let l = PgKeyedLimiter::connect(&pg.connection_string(), opts.clone())
        .await
        .expect("connect over TLS");
    l.install().await.expect("install over TLS");
    // Keys spread over both sessions: each call runs on its key's session.
    for i in 0..16 {
        assert_eq!(l.request(&format!("k{i}"), 2, 60).await.unwrap(), 119);
    }
    assert_eq!(l.request("k0", 2, 60).await.unwrap(), 118);
    let w = PgWindowLimiter::connect(&pg.url(), opts)
        .await
        .expect("window limiter over TLS");
    w.install().await.expect("install");

    let admin = admin(&pg).await;
    let (all, encrypted) = sessions_of(&admin, "iothrottle").await;
    assert_eq!(all, 3, "two keyed sessions and the window limiter's");
    assert_eq!(encrypted, all, "every limiter session is encrypted");
    assert_eq!(l.stats().connects, 2);
}

#[tokio::test]
async fn checkpoint_over_tls_trusting_the_certificate() {
    let Some((pg, der)) = tls_cluster("checkpoint_over_tls_trusting_the_certificate") else {
        return;
    };
    let config = format!("{} application_name=ckpt-tls", pg.connection_string());
    let store = PgCheckpoint::new(&config, "disk-tls")
        .unwrap()
        .with_tls(trusting(&der));
    store.install().await.expect("install over TLS");
    assert_eq!(store.load().await.unwrap(), None);
    let b: SharedTokenBucket =
        SharedTokenBucket::new(BucketConfig::new(Rate::per_second(1_000), 500)).unwrap();
    b.replenish();
    b.grab(123);
    let s = Snapshot::of(&b, Some(130));
    store.save(s).await.expect("save over TLS");
    assert_eq!(store.load().await.unwrap(), Some(s));

    let (all, encrypted) = sessions_of(&admin(&pg).await, "ckpt-tls").await;
    assert_eq!(all, 1, "the store's one session");
    assert_eq!(encrypted, 1, "and it is encrypted");
}

#[tokio::test]
async fn untrusted_certificate_is_a_typed_tls_error() {
    let Some((pg, _der)) = tls_cluster("untrusted_certificate_is_a_typed_tls_error") else {
        return;
    };
    // Trusts another self-signed certificate (another issuer), not the server's.
    let (other, _, _) = self_signed("someone else");
    let err = match PgKeyedLimiter::connect(
        &pg.connection_string(),
        PgOptions::new().with_tls(trusting(&other)),
    )
    .await
    {
        Ok(_) => panic!("connected although the certificate is not trusted"),
        Err(e) => e,
    };
    let text = error_chain(&err);
    assert!(matches!(err, PgLimitError::Tls { .. }), "typed: {err:?}");
    assert!(
        err.to_string().contains("TLS handshake"),
        "its own message names TLS, not a lost connection: {err}"
    );
    assert!(
        text.contains("TLS handshake") && text.contains("UnknownIssuer"),
        "names the TLS failure: {text}"
    );

    let store = PgCheckpoint::new(&pg.connection_string(), "disk-untrusted")
        .unwrap()
        .with_tls(trusting(&other));
    match store.load().await {
        Err(CheckpointError::Postgres { op, message }) => {
            assert_eq!(op, "connect");
            assert!(
                message.contains("TLS handshake") && message.contains("UnknownIssuer"),
                "names the TLS failure: {message}"
            );
        }
        other => panic!("expected a TLS connect failure, got {other:?}"),
    }
    // Nothing got through in plaintext either.
    let (all, _) = sessions_of(&admin(&pg).await, "iothrottle").await;
    assert_eq!(all, 0);
}

#[tokio::test]
async fn tls_never_falls_back_to_plaintext() {
    // A server without TLS: tokio-postgres's default `sslmode=prefer` would quietly run the
    // session in plaintext; a configured TLS makes that a connection error.
    let Some(pg) = cluster_or_skip("tls_never_falls_back_to_plaintext") else {
        return;
    };
    let (der, _, _) = self_signed("iothrottle test server");
    let err = match PgKeyedLimiter::connect(
        &pg.connection_string(),
        PgOptions::new().with_tls(trusting(&der)),
    )
    .await
    {
        Ok(_) => panic!("connected in plaintext although TLS was configured"),
        Err(e) => e,
    };
    assert!(matches!(err, PgLimitError::Tls { .. }), "typed: {err:?}");
    assert!(
        error_chain(&err).contains("server does not support TLS"),
        "says why: {err}"
    );
    let store = PgCheckpoint::new(&pg.connection_string(), "disk-plain")
        .unwrap()
        .with_tls(trusting(&der));
    assert!(
        matches!(
            store.load().await,
            Err(CheckpointError::Postgres { op: "connect", .. })
        ),
        "the checkpoint refuses plaintext too"
    );
    // An explicit `sslmode=disable` still turns TLS off.
    let plain = PgKeyedLimiter::connect(
        &format!("{} sslmode=disable", pg.connection_string()),
        PgOptions::new().with_tls(trusting(&der)),
    )
    .await
    .expect("sslmode=disable connects in plaintext");
    plain.install().await.unwrap();
    let (all, encrypted) = sessions_of(&admin(&pg).await, "iothrottle").await;
    assert_eq!((all, encrypted), (1, 0));
}

#[tokio::test]
async fn a_certificate_for_another_host_is_refused() {
    // Trusted issuer, wrong name: the certificate is for `db.invalid`, the client connects to
    // 127.0.0.1.
    let Some((pg, der)) =
        tls_cluster_for("a_certificate_for_another_host_is_refused", &["db.invalid"])
    else {
        return;
    };
    let err = match PgKeyedLimiter::connect(
        &pg.connection_string(),
        PgOptions::new().with_tls(trusting(&der)),
    )
    .await
    {
        Ok(_) => panic!("connected although the certificate names another host"),
        Err(e) => e,
    };
    assert!(matches!(err, PgLimitError::Tls { .. }), "typed: {err:?}");
    assert!(
        error_chain(&err).contains("not valid for name \"127.0.0.1\""),
        "names the failure: {err}"
    );
}

#[tokio::test]
async fn a_stuck_call_over_tls_is_cancelled_over_tls() {
    let Some((pg, der)) = tls_cluster("a_stuck_call_over_tls_is_cancelled_over_tls") else {
        return;
    };
    let opts = PgOptions::new()
        .with_connections(1)
        .with_call_timeout(Some(STUCK_AFTER))
        .with_tls(trusting(&der));
    let l = PgKeyedLimiter::connect(&pg.connection_string(), opts)
        .await
        .unwrap();
    l.install().await.unwrap();
    assert_eq!(l.request("k", 1, 100).await.unwrap(), 99);
    let blocker = hold_row_lock(&pg, "k").await;
    let err = l.request("k", 1, 100).await.unwrap_err();
    assert!(matches!(err, PgLimitError::TimedOut { .. }), "{err:?}");
    // The cancel request goes over TLS too (the session requires it): the stuck statement
    // stops waiting on the row lock while the blocker still holds it. (Bounded so that a
    // cancel that never arrives fails the test instead of hanging it.)
    let cancelled =
        tokio::time::timeout(Duration::from_secs(60), no_backend_waiting(&blocker)).await;
    assert!(cancelled.is_ok(), "the stuck statement was never cancelled");
    blocker.batch_execute("ROLLBACK").await.unwrap();
    // The next call reconnects, over TLS.
    assert!(l.request("k", 1, 100).await.unwrap() >= 97);
    assert_eq!(l.stats().connects, 2);
    // The timed-out session was closed by the limiter; its backend leaves on its own time.
    let a = admin(&pg).await;
    let settled = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let seen = sessions_of(&a, "iothrottle").await;
            if seen.0 <= 1 {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(settled.ok(), Some((1, 1)), "one session, encrypted");
}
