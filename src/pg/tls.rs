//! How a connection is secured: not at all (the default, `tokio_postgres::NoTls`), or with
//! rustls (feature `postgres-tls`), shared by the limiters ([`PgOptions::with_tls`]) and
//! [`PgCheckpoint`](crate::checkpoint::PgCheckpoint).
//!
//! With TLS configured, `sslmode=prefer` (tokio-postgres's default, which falls back to a
//! plaintext session when the server declines TLS) is raised to `require`: a configured TLS
//! never silently becomes plaintext. An explicit `sslmode=disable` still turns it off.
//!
//! [`PgOptions::with_tls`]: super::PgOptions::with_tls

use std::fmt;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::DbError;
use tokio_postgres::{AsyncMessage, CancelToken, Client, Config, Connection, NoTls};

use crate::sync::Arc;

/// Told by a connection's task why the server closed the session, and when the task ended.
pub(crate) trait SessionWatch: Send + Sync + 'static {
    /// The server's reason (`57P01 FATAL: terminating connection due to …`).
    fn reason(&self, text: String);
    /// The connection's task has ended (after any [`reason`](Self::reason)).
    fn ended(&self);
}

/// SQLSTATE, severity and message of a server error or notice.
fn db_text(e: &DbError) -> String {
    format!("{} {}: {}", e.code().code(), e.severity(), e.message())
}

/// Whether `e` says the session is being closed: `57P01`–`57P03` or class `08`.
fn closes_session(e: &DbError) -> bool {
    let c = e.code().code();
    c.starts_with("57P") || c.starts_with("08")
}

/// Runs a connection to its end, reporting to `watch` (see [`Tls::connect_watched`]).
async fn drive<S, T>(
    mut connection: Connection<S, T>,
    what: &'static str,
    watch: Option<Arc<dyn SessionWatch>>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notice(n))) => {
                if closes_session(&n) {
                    if let Some(w) = &watch {
                        w.reason(db_text(&n));
                    }
                }
                tracing::debug!(notice = %db_text(&n), "{what} connection notice");
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                if let (Some(w), Some(db)) = (&watch, e.as_db_error()) {
                    if closes_session(db) {
                        w.reason(db_text(db));
                    }
                }
                tracing::debug!(error = %e, "{what} connection ended");
                break;
            }
            None => break,
        }
    }
    if let Some(w) = &watch {
        w.ended();
    }
}

/// The TLS choice of a connection.
#[derive(Clone, Default)]
pub(crate) enum Tls {
    /// Plain TCP or Unix sockets.
    #[default]
    Off,
    /// rustls with the caller's configuration (roots, client certificates, provider).
    #[cfg(feature = "postgres-tls")]
    Rustls {
        /// Kept for equality (by identity).
        config: crate::sync::Arc<rustls::ClientConfig>,
        make: tokio_postgres_rustls::MakeRustlsConnect,
    },
}

impl Tls {
    /// rustls with `config`.
    #[cfg(feature = "postgres-tls")]
    pub(crate) fn rustls(config: rustls::ClientConfig) -> Tls {
        Tls::Rustls {
            config: crate::sync::Arc::new(config.clone()),
            make: tokio_postgres_rustls::MakeRustlsConnect::new(config),
        }
    }

    /// Raises `sslmode=prefer` to `require` when TLS is configured (see the module docs).
    pub(crate) fn apply(&self, config: &mut Config) {
        if !matches!(self, Tls::Off) && config.get_ssl_mode() == SslMode::Prefer {
            config.ssl_mode(SslMode::Require);
        }
    }

    /// Connects with `config` and spawns the connection's task (which logs how it ended at
    /// debug level, as `what`), telling `watch` the server's reason when it closes the
    /// session (an error or notice with SQLSTATE class `57P` or `08` that no statement
    /// received, e.g. `57P01` on an idle session or the `WARNING` an immediate shutdown
    /// sends) and, after that, that the connection's task has ended.
    pub(crate) async fn connect_watched(
        &self,
        config: &Config,
        what: &'static str,
        watch: Option<Arc<dyn SessionWatch>>,
    ) -> Result<Client, tokio_postgres::Error> {
        match self {
            Tls::Off => {
                let (client, connection) = config.connect(NoTls).await?;
                tokio::spawn(drive(connection, what, watch));
                Ok(client)
            }
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls { make, .. } => {
                let (client, connection) = config.connect(make.clone()).await?;
                tokio::spawn(drive(connection, what, watch));
                Ok(client)
            }
        }
    }

    /// Asks the server, in the background, to cancel the statement running on `token`'s
    /// session (over the same kind of connection).
    pub(crate) fn cancel(&self, token: CancelToken) {
        let tls = self.clone();
        tokio::spawn(async move {
            let r = match tls {
                Tls::Off => token.cancel_query(NoTls).await,
                #[cfg(feature = "postgres-tls")]
                Tls::Rustls { make, .. } => token.cancel_query(make).await,
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "cancelling a timed-out call failed");
            }
        });
    }
}

impl PartialEq for Tls {
    fn eq(&self, other: &Tls) -> bool {
        match (self, other) {
            (Tls::Off, Tls::Off) => true,
            #[cfg(feature = "postgres-tls")]
            (Tls::Rustls { config: a, .. }, Tls::Rustls { config: b, .. }) => {
                crate::sync::Arc::ptr_eq(a, b)
            }
            #[cfg(feature = "postgres-tls")]
            _ => false,
        }
    }
}

impl Eq for Tls {}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tls::Off => f.write_str("NoTls"),
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls { .. } => f.write_str("Rustls"),
        }
    }
}
