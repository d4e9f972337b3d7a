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

use tokio_postgres::config::SslMode;
use tokio_postgres::{CancelToken, Client, Config, NoTls};

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
    /// debug level, as `what`).
    pub(crate) async fn connect(
        &self,
        config: &Config,
        what: &'static str,
    ) -> Result<Client, tokio_postgres::Error> {
        match self {
            Tls::Off => {
                let (client, connection) = config.connect(NoTls).await?;
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "{what} connection ended");
                    }
                });
                Ok(client)
            }
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls { make, .. } => {
                let (client, connection) = config.connect(make.clone()).await?;
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "{what} connection ended");
                    }
                });
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
