//! Reconnecting connections with a cache of prepared statements, and a set of them that
//! spreads keys over several server sessions.
//!
//! A [`Conn`] connects lazily and again after it was lost, with a back-off: after a failed
//! connect, calls fail at once (with the last failure's text) until the back-off has passed,
//! doubling from 50 ms up to 2 s, so a server that is down is not hammered by every call. Every
//! call has an optional timeout ([`PgOptions::with_call_timeout`]); a call that times out
//! drops its connection (its outcome is unknown).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Config, Statement};

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
    /// After a failed connect: when to try again, the current back-off, and why it failed.
    down: Mutex<Option<Down>>,
    pub(crate) stats: Stats,
}

#[derive(Debug, Clone)]
struct Down {
    until: Instant,
    backoff: Duration,
    why: String,
}

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

impl Conn {
    /// Parses `config` (a libpq-style string or a URL) and connects once.
    pub(crate) async fn connect(config: &str, options: PgOptions) -> Result<Conn, PgLimitError> {
        let conn = Conn::lazy(config, options)?;
        conn.live().await.map_err(PgLimitError::from)?;
        Ok(conn)
    }

    /// Parses `config`; connects on first use.
    pub(crate) fn lazy(config: &str, options: PgOptions) -> Result<Conn, PgLimitError> {
        options.validate()?;
        let mut parsed: Config = config
            .parse()
            .map_err(|e| PgLimitError::Connection { source: e })?;
        options.tls.apply(&mut parsed);
        Ok(Conn {
            config: parsed,
            options,
            live: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            down: Mutex::new(None),
            stats: Stats::default(),
        })
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
        if let Some(d) = self.down.lock().expect("back-off").clone() {
            let now = Instant::now();
            if now < d.until {
                return Err(RunError::Typed(PgLimitError::Unavailable {
                    retry_in: d.until - now,
                    why: d.why,
                }));
            }
        }
        let client = match self.options.tls.connect(&self.config, "postgres").await {
            Ok(c) => c,
            Err(e) => {
                let mut down = self.down.lock().expect("back-off");
                let backoff = down
                    .as_ref()
                    .map_or(BACKOFF_MIN, |d| (d.backoff * 2).min(BACKOFF_MAX));
                *down = Some(Down {
                    until: Instant::now() + backoff,
                    backoff,
                    why: crate::error::pg_error_text(&e),
                });
                // Without a SQLSTATE the server was not reached or refused at the transport
                // level (socket, TLS handshake, a server without TLS under `require`): a
                // connection error, whatever the driver's inner error type.
                if e.code().is_none() {
                    return Err(RunError::Typed(PgLimitError::Connection { source: e }));
                }
                return Err(e.into());
            }
        };
        *self.down.lock().expect("back-off") = None;
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
        let call = with_retries(&policy, &self.stats, move || async move {
            let live = self.live().await?;
            f(live).await
        });
        let r = match self.options.call_timeout {
            None => call.await,
            Some(after) => match tokio::time::timeout(after, call).await {
                Ok(r) => r,
                Err(_) => {
                    // The statement may still run on the server: ask the server to cancel it
                    // (it may have committed already: the outcome is unknown) and start the
                    // next call on a fresh session.
                    if let Some(live) = self.current() {
                        self.options.tls.cancel(live.client.cancel_token());
                    }
                    self.drop_live();
                    return Err(PgLimitError::TimedOut { after });
                }
            },
        };
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

/// Several connections; each key always uses the same one, so one key's statements keep
/// their order and queue on its row lock in one session, while different keys' statements
/// (and their commits' WAL flushes) run in parallel on the server.
#[derive(Debug)]
pub(crate) struct Pool {
    conns: Vec<Conn>,
}

impl Pool {
    /// Connects the first connection now (to report a bad configuration at once); the others
    /// connect on first use.
    pub(crate) async fn connect(config: &str, options: PgOptions) -> Result<Pool, PgLimitError> {
        let n = options.connections;
        let mut conns = vec![Conn::connect(config, options.clone()).await?];
        for _ in 1..n {
            conns.push(Conn::lazy(config, options.clone())?);
        }
        Ok(Pool { conns })
    }

    /// The connection of `key`.
    pub(crate) fn for_key(&self, key: &str) -> &Conn {
        if self.conns.len() == 1 {
            return &self.conns[0];
        }
        // A fixed hash: a key keeps its connection for the life of the pool.
        let h = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        &self.conns[(h % self.conns.len() as u64) as usize]
    }

    /// The first connection (installation, settings).
    pub(crate) fn first(&self) -> &Conn {
        &self.conns[0]
    }

    /// The counters of all connections together.
    pub(crate) fn stats(&self) -> super::PgStats {
        self.conns
            .iter()
            .map(|c| c.stats.snapshot())
            .fold(super::PgStats::default(), |a, b| a.merge(b))
    }
}
