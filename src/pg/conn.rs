//! One reconnecting connection with a cache of prepared statements.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_postgres::{Client, Config, NoTls, Statement};

use super::retry::{classify, typed, with_retries, Class, RunError, Stats};
use super::{Isolation, PgOptions};
use crate::error::PgLimitError;
use crate::sync::Arc;

/// A live connection and the statements prepared on it.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) client: Client,
    stmts: Mutex<HashMap<String, Statement>>,
}

impl Live {
    /// The prepared form of `sql`, prepared once per connection.
    pub(crate) async fn prepared(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.stmts.lock().expect("statement cache").get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql).await?;
        self.stmts
            .lock()
            .expect("statement cache")
            .insert(sql.to_owned(), s.clone());
        Ok(s)
    }
}

/// A connection that is opened lazily and again after it was lost.
#[derive(Debug)]
pub(crate) struct Conn {
    config: Config,
    options: PgOptions,
    live: Mutex<Option<Arc<Live>>>,
    connecting: tokio::sync::Mutex<()>,
    pub(crate) stats: Stats,
}

impl Conn {
    /// Parses `config` (a libpq-style string or a URL) and connects once.
    pub(crate) async fn connect(config: &str, options: PgOptions) -> Result<Conn, PgLimitError> {
        let parsed: Config = config
            .parse()
            .map_err(|e| PgLimitError::Connection { source: e })?;
        let conn = Conn {
            config: parsed,
            options,
            live: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            stats: Stats::default(),
        };
        conn.live().await.map_err(PgLimitError::from)?;
        Ok(conn)
    }

    fn current(&self) -> Option<Arc<Live>> {
        let g = self.live.lock().expect("connection slot");
        g.as_ref().filter(|l| !l.client.is_closed()).cloned()
    }

    /// The live connection, connecting first if there is none or it was closed.
    pub(crate) async fn live(&self) -> Result<Arc<Live>, RunError> {
        if let Some(l) = self.current() {
            return Ok(l);
        }
        let _one = self.connecting.lock().await;
        if let Some(l) = self.current() {
            return Ok(l);
        }
        let (client, connection) = self.config.connect(NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        self.stats.count_connect();
        let iso = match self.options.isolation {
            Isolation::ReadCommitted => "read committed",
            Isolation::Serializable => "serializable",
        };
        // plan_cache_mode: the limiter's statements have one good plan (a primary-key probe);
        // left to `auto`, the server keeps re-planning the upsert for every call (custom
        // plans), which costs about as much as running it.
        // synchronous_commit: `false` turns it off for this session; `true` makes sure it is
        // not off (the server, database or role may have it off), keeping a stronger
        // `remote_*` setting when there is one.
        let sync = if !self.options.synchronous_commit {
            "SET synchronous_commit TO off;"
        } else {
            let row = client.query_one("SHOW synchronous_commit", &[]).await?;
            if row.get::<_, &str>(0) == "off" {
                "SET synchronous_commit TO on;"
            } else {
                ""
            }
        };
        client
            .batch_execute(&format!(
                "SET default_transaction_isolation TO '{iso}'; SET application_name TO 'iothrottle'; \
                 SET plan_cache_mode TO force_generic_plan; {sync}"
            ))
            .await?;
        let live = Arc::new(Live {
            client,
            stmts: Mutex::new(HashMap::new()),
        });
        *self.live.lock().expect("connection slot") = Some(live.clone());
        Ok(live)
    }

    /// Forgets the current connection, so that the next call reconnects.
    fn drop_live(&self) {
        *self.live.lock().expect("connection slot") = None;
    }

    /// Runs `f` on the live connection with the retry policy; a lost connection is dropped
    /// (the next call reconnects) and returned as [`PgLimitError::Connection`].
    pub(crate) async fn run<T, F, Fut>(&self, f: F) -> Result<T, PgLimitError>
    where
        F: Fn(Arc<Live>) -> Fut,
        Fut: std::future::Future<Output = Result<T, RunError>>,
    {
        let policy = self.options.retry;
        let f = &f;
        let r = with_retries(&policy, &self.stats, move || async move {
            let live = self.live().await?;
            f(live).await
        })
        .await;
        match r {
            Ok(v) => Ok(v),
            Err(RunError::Pg(e)) => {
                if classify(&e) == Class::Connection {
                    self.drop_live();
                }
                Err(typed(e))
            }
            Err(RunError::Typed(e)) => {
                if matches!(e, PgLimitError::Connection { .. }) {
                    self.drop_live();
                }
                Err(e)
            }
        }
    }
}
