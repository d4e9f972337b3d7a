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
use super::sql;
use super::{Isolation, PgOptions};
use crate::sync::Arc;
use crate::PgLimitError;

/// A session's client: connected by the crate, or checked out of the caller's pool.
pub(crate) enum SessionClient {
    /// Connected by the crate; its task is watched ([`SessionEnd`]).
    Own(Client),
    /// Checked out of the caller's `deadpool_postgres::Pool` (feature `postgres-pool`) and
    /// never given back: it carries the limiter's session settings, and after a timed-out
    /// call its statement may still run. Dropping it detaches it from the pool
    /// (`Object::take`) and closes it; the pool opens a new session when it needs one.
    #[cfg(feature = "postgres-pool")]
    Pooled(Option<deadpool_postgres::Object>),
}

impl std::ops::Deref for SessionClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        match self {
            SessionClient::Own(c) => c,
            #[cfg(feature = "postgres-pool")]
            SessionClient::Pooled(o) => o.as_ref().expect("present until dropped"),
        }
    }
}

impl Drop for SessionClient {
    fn drop(&mut self) {
        #[cfg(feature = "postgres-pool")]
        if let SessionClient::Pooled(o) = self {
            if let Some(o) = o.take() {
                drop(deadpool_postgres::Object::take(o));
            }
        }
    }
}

impl std::fmt::Debug for SessionClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionClient::Own(_) => f.write_str("Own"),
            #[cfg(feature = "postgres-pool")]
            SessionClient::Pooled(_) => f.write_str("Pooled"),
        }
    }
}

/// Where a [`Conn`]'s sessions come from.
enum Source {
    /// Connected by the crate with this configuration (and the TLS option).
    Config(Box<Config>),
    /// Checked out of the caller's pool.
    #[cfg(feature = "postgres-pool")]
    Pool(deadpool_postgres::Pool),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Config(c) => f.debug_tuple("Config").field(c).finish(),
            #[cfg(feature = "postgres-pool")]
            Source::Pool(p) => f.debug_tuple("Pool").field(&p.status()).finish(),
        }
    }
}

/// A live connection and the statements prepared on it.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) client: SessionClient,
    /// The few statements (at most a dozen) a limiter prepares, searched linearly: a lookup
    /// compares lengths and then bytes, where a hash map hashed the whole text (about 2 KB for
    /// the strict upsert) on every call.
    stmts: Mutex<Vec<(String, Statement)>>,
    /// Calls in flight, and why and whether the session ended (shared with the connection's
    /// task).
    end: Arc<SessionEnd>,
}

/// What the calls of one session and its connection's task know about its end.
#[derive(Debug, Default)]
pub(crate) struct SessionEnd {
    state: Mutex<Closing>,
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Closing {
    in_flight: usize,
    /// The server's reason for closing the session, from the first call or the connection's
    /// task that received it.
    reason: Option<String>,
    /// The connection's task has ended.
    ended: bool,
}

impl SessionEnd {
    /// For a session whose connection's task is not ours to watch (a pooled one): its end
    /// is known only through the calls.
    #[cfg(feature = "postgres-pool")]
    fn unwatched() -> SessionEnd {
        SessionEnd {
            state: Mutex::new(Closing {
                ended: true,
                ..Closing::default()
            }),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut Closing)) {
        f(&mut self.state.lock().expect("session state"));
        self.changed.notify_waiters();
    }

    /// For a call that saw a bare connection loss on this session: the server's reason once
    /// some call or the connection's task has received it, or `None` once the task has ended
    /// without one and no other call on the session is left to report one.
    pub(crate) async fn reason_after_loss(&self) -> Option<String> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a change between the look and the wait wakes us.
            changed.as_mut().enable();
            {
                let c = self.state.lock().expect("session state");
                if let Some(reason) = &c.reason {
                    return Some(reason.clone());
                }
                if c.in_flight == 0 && c.ended {
                    return None;
                }
            }
            changed.await;
        }
    }
}

impl super::tls::SessionWatch for SessionEnd {
    fn reason(&self, text: String) {
        self.update(|c| {
            c.reason.get_or_insert(text);
        });
    }

    fn ended(&self) {
        self.update(|c| c.ended = true);
    }
}

/// One call in flight on a [`Live`]; dropping it (the call finished or was cancelled) takes
/// the call off the session's count.
struct InFlight<'a>(&'a Live);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.end.update(|c| c.in_flight -= 1);
    }
}

impl Live {
    fn new(client: SessionClient, end: Arc<SessionEnd>) -> Live {
        Live {
            client,
            stmts: Mutex::new(Vec::new()),
            end,
        }
    }

    fn begin(&self) -> InFlight<'_> {
        self.end.update(|c| c.in_flight += 1);
        InFlight(self)
    }

    /// The result of a call that ran on this session (`call` counted it in flight).
    ///
    /// When the server closes a session it sends its reason (`57P01` administrator shutdown,
    /// `57P02`, …) once: as the answer to the statement it was running, or to nobody (an
    /// idle session, or the warning of an immediate shutdown), when the connection's task
    /// receives it. The calls pipelined behind that statement only see "connection closed".
    /// So a call that received the reason records it, and a call that got a bare connection
    /// loss waits until the reason is known, or until no call on the session is left to
    /// report one and the connection's task has ended (the connection is gone, so both happen
    /// at once), then carries the reason in [`PgLimitError::Connection::closed_by`].
    async fn finish<T>(&self, call: InFlight<'_>, r: Result<T, RunError>) -> Result<T, RunError> {
        let e = match r {
            Err(RunError::Pg(e)) if classify(&e) == Class::Connection => e,
            other => return other,
        };
        if e.as_db_error().is_some() {
            let text = crate::pg::error::pg_error_text(&e);
            self.end.update(|c| {
                c.reason.get_or_insert(text);
            });
            drop(call);
            return Err(RunError::Pg(e));
        }
        drop(call);
        match self.end.reason_after_loss().await {
            Some(reason) => Err(RunError::Typed(PgLimitError::Connection {
                source: e,
                closed_by: Some(reason),
            })),
            None => Err(RunError::Pg(e)),
        }
    }

    /// The prepared form of `sql`, prepared once per connection.
    pub(crate) async fn prepared(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.cached(sql) {
            return Ok(s);
        }
        let s = self.client.prepare(sql).await?;
        let mut stmts = self.stmts.lock().expect("statement cache");
        // Two calls may have prepared it at once; keep the first.
        if let Some((_, first)) = stmts.iter().find(|(t, _)| t == sql) {
            return Ok(first.clone());
        }
        stmts.push((sql.to_owned(), s.clone()));
        Ok(s)
    }

    fn cached(&self, sql: &str) -> Option<Statement> {
        let stmts = self.stmts.lock().expect("statement cache");
        stmts
            .iter()
            .find(|(t, _)| t.len() == sql.len() && t == sql)
            .map(|(_, s)| s.clone())
    }
}

/// A failure to open a session that carries no SQLSTATE: [`PgLimitError::Tls`] when the
/// TLS handshake failed, else [`PgLimitError::Connect`]. The driver's error kinds are
/// private; its `Display` names the kind (`error performing TLS handshake: …`), without the
/// cause's text.
fn connect_failure(source: tokio_postgres::Error) -> PgLimitError {
    if source
        .to_string()
        .starts_with("error performing TLS handshake")
    {
        PgLimitError::Tls { source }
    } else {
        PgLimitError::Connect { source }
    }
}

/// A server error that says the limiter's tables, functions or schema are missing:
/// `42P01` undefined table, `42883` undefined function, `3F000` invalid schema name.
fn means_not_installed(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::UNDEFINED_TABLE
            || *c == SqlState::UNDEFINED_FUNCTION
            || *c == SqlState::INVALID_SCHEMA_NAME
    })
}

/// A connection that is opened lazily and again after it was lost.
#[derive(Debug)]
pub(crate) struct Conn {
    source: Source,
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
            .map_err(|source| PgLimitError::InvalidConnectionString { source })?;
        options.tls.apply(&mut parsed);
        Ok(Conn::new(Source::Config(Box::new(parsed)), options))
    }

    /// Sessions from the caller's pool; checks one out on first use.
    #[cfg(feature = "postgres-pool")]
    pub(crate) fn pooled(
        pool: deadpool_postgres::Pool,
        options: PgOptions,
    ) -> Result<Conn, PgLimitError> {
        options.validate()?;
        Ok(Conn::new(Source::Pool(pool), options))
    }

    fn new(source: Source, options: PgOptions) -> Conn {
        Conn {
            source,
            options,
            live: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            down: Mutex::new(None),
            stats: Stats::default(),
        }
    }

    /// Records a failed connect (or checkout): calls fail at once until the back-off,
    /// doubling from [`BACKOFF_MIN`] to [`BACKOFF_MAX`], has passed. Returns the back-off.
    fn record_down(&self, why: String) -> Duration {
        let mut down = self.down.lock().expect("back-off");
        let backoff = down
            .as_ref()
            .map_or(BACKOFF_MIN, |d| (d.backoff * 2).min(BACKOFF_MAX));
        *down = Some(Down {
            until: Instant::now() + backoff,
            backoff,
            why,
        });
        backoff
    }

    /// A new session: connected by the crate, or checked out of the caller's pool.
    async fn open(&self) -> Result<(SessionClient, Arc<SessionEnd>), RunError> {
        let e = match &self.source {
            Source::Config(config) => {
                let end = Arc::new(SessionEnd::default());
                let watch: Arc<dyn super::tls::SessionWatch> = end.clone();
                match self
                    .options
                    .tls
                    .connect_watched(config, "postgres", Some(watch))
                    .await
                {
                    Ok(c) => return Ok((SessionClient::Own(c), end)),
                    Err(e) => e,
                }
            }
            #[cfg(feature = "postgres-pool")]
            Source::Pool(pool) => match pool.get().await {
                Ok(o) => {
                    let end = Arc::new(SessionEnd::unwatched());
                    return Ok((SessionClient::Pooled(Some(o)), end));
                }
                Err(deadpool_postgres::PoolError::Backend(e)) => e,
                Err(e) => {
                    let why = format!("connection pool: {e}");
                    let retry_in = self.record_down(why.clone());
                    return Err(RunError::Typed(PgLimitError::Unavailable { retry_in, why }));
                }
            },
        };
        self.record_down(crate::pg::error::pg_error_text(&e));
        // Without a SQLSTATE the server was not reached or refused at the transport level
        // (socket, TLS handshake, a server without TLS under `require`): no statement was
        // sent, so this is a failure to connect, never a lost connection.
        if e.code().is_none() {
            return Err(RunError::Typed(connect_failure(e)));
        }
        Err(e.into())
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
        let (client, end) = self.open().await?;
        *self.down.lock().expect("back-off") = None;
        self.stats.count_connect();
        let iso = match self.options.isolation {
            Isolation::ReadCommitted => "read committed",
            Isolation::Serializable => "serializable",
        };
        // synchronous_commit: `false` turns it off for this session; `true` makes sure it is
        // not off (the server, database or role may have it off), keeping a stronger
        // `remote_*` setting when there is one.
        let sync = if !self.options.synchronous_commit {
            "SET synchronous_commit TO off;"
        } else {
            let row = client.query_one(sql::SHOW_SYNCHRONOUS_COMMIT, &[]).await?;
            if row.get::<_, &str>(0) == "off" {
                "SET synchronous_commit TO on;"
            } else {
                ""
            }
        };
        client
            .batch_execute(&sql::session_settings(iso, sync))
            .await?;
        let live = Arc::new(Live::new(client, end));
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
            let in_flight = live.begin();
            let r = f(live.clone()).await;
            let r = live.finish(in_flight, r).await;
            if matches!(r, Err(RunError::Typed(PgLimitError::Connection { .. }))) {
                self.stats.count_connection_error();
            }
            r
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
                if means_not_installed(&e) {
                    return Err(PgLimitError::NotInstalled {
                        schema: self.options.schema.clone(),
                    });
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

/// Refuses a caller's pool that cannot give the limiter the sessions it keeps checked out:
/// keys routed to a session the pool never opens would time out on every call.
#[cfg(feature = "postgres-pool")]
pub(crate) fn check_pool_size(
    pool: &deadpool_postgres::Pool,
    options: &PgOptions,
) -> Result<(), PgLimitError> {
    if pool.status().max_size < options.connections {
        return Err(PgLimitError::InvalidOption {
            name: "connections",
            reason: "the pool's max_size is smaller than PgOptions::with_connections",
        });
    }
    Ok(())
}

/// Several connections with key affinity while a key is busy: all calls of a key that are
/// in flight at once run on one session (so they keep their order and queue on the key's row
/// lock in one backend, never in several), and a key with no call in flight goes to the
/// session with the fewest calls in flight (ties: the key's hash decides, so a key keeps its
/// session while the limiter is idle). A hot key therefore stays on one session, while
/// distinct keys called at once spread over distinct sessions (with a fixed hash of the key,
/// about a third of 8 keys shared a session with another key of the 8 sessions, and queued
/// behind its commits).
#[derive(Debug)]
pub(crate) struct Pool {
    conns: Vec<Conn>,
    busy: Mutex<Busy>,
}

/// Which session each key with calls in flight uses, and the calls in flight per session.
#[derive(Debug, Default)]
struct Busy {
    /// key → (session, calls in flight); a key leaves when its last call ends.
    keys: HashMap<Box<str>, (usize, usize)>,
    /// Calls in flight per session.
    load: Vec<usize>,
}

/// The session of a key for the length of one call (see [`Pool::for_key`]); the key's
/// claim on it ends when this is dropped (the call finished or was cancelled).
#[derive(Debug)]
pub(crate) struct KeyConn<'a> {
    pool: &'a Pool,
    key: Option<Box<str>>,
    idx: usize,
}

impl std::ops::Deref for KeyConn<'_> {
    type Target = Conn;

    fn deref(&self) -> &Conn {
        &self.pool.conns[self.idx]
    }
}

impl Drop for KeyConn<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let mut busy = self.pool.busy.lock().expect("session assignment");
        busy.load[self.idx] -= 1;
        if let Some(e) = busy.keys.get_mut(&key) {
            e.1 -= 1;
            if e.1 == 0 {
                busy.keys.remove(&key);
            }
        }
    }
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
        Ok(Pool::of(conns))
    }

    /// Sessions from the caller's pool: the first one checked out now (to report a bad pool
    /// at once), the others on first use.
    #[cfg(feature = "postgres-pool")]
    pub(crate) async fn from_pool(
        pool: deadpool_postgres::Pool,
        options: PgOptions,
    ) -> Result<Pool, PgLimitError> {
        let first = Conn::pooled(pool.clone(), options.clone())?;
        check_pool_size(&pool, &options)?;
        first.live().await?;
        let mut conns = vec![first];
        for _ in 1..options.connections {
            conns.push(Conn::pooled(pool.clone(), options.clone())?);
        }
        Ok(Pool::of(conns))
    }

    fn of(conns: Vec<Conn>) -> Pool {
        let busy = Mutex::new(Busy {
            keys: HashMap::new(),
            load: vec![0; conns.len()],
        });
        Pool { conns, busy }
    }

    /// The connection of `key` for one call: the session its calls in flight use, or else
    /// the least busy one. Hold the result for the whole call (e.g.
    /// `pool.for_key(k).run(…).await` in one expression).
    pub(crate) fn for_key(&self, key: &str) -> KeyConn<'_> {
        let n = self.conns.len();
        if n == 1 {
            return KeyConn {
                pool: self,
                key: None,
                idx: 0,
            };
        }
        let mut busy = self.busy.lock().expect("session assignment");
        let idx = match busy.keys.get_mut(key) {
            Some(e) => {
                e.1 += 1;
                e.0
            }
            None => {
                // A fixed hash: the first session looked at, so an idle limiter keeps each
                // key on the same session.
                let h = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
                let start = (h % n as u64) as usize;
                let idx = (0..n)
                    .map(|i| (start + i) % n)
                    .min_by_key(|&i| busy.load[i])
                    .expect("at least one session");
                busy.keys.insert(key.into(), (idx, 1));
                idx
            }
        };
        busy.load[idx] += 1;
        KeyConn {
            pool: self,
            key: Some(key.into()),
            idx,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> Pool {
        let conns = (0..n)
            .map(|_| Conn::lazy("host=127.0.0.1 user=nobody", PgOptions::new()).unwrap())
            .collect();
        Pool::of(conns)
    }

    #[test]
    fn keys_in_flight_share_a_session_others_take_the_least_busy() {
        let p = pool(4);
        let a1 = p.for_key("a");
        let a2 = p.for_key("a");
        assert_eq!(
            a1.idx, a2.idx,
            "one key's calls in flight share its session"
        );
        let others: Vec<_> = ["b", "c", "d"].iter().map(|k| p.for_key(k)).collect();
        let mut used: Vec<usize> = others.iter().map(|c| c.idx).collect();
        used.push(a1.idx);
        used.sort();
        used.dedup();
        assert_eq!(used.len(), 4, "four keys at once on four sessions");
        // A fifth key shares the least busy session: not a's (two calls).
        let e = p.for_key("e");
        assert_ne!(e.idx, a1.idx);
        drop((a1, a2, others, e));
        let busy = p.busy.lock().unwrap();
        assert!(busy.keys.is_empty(), "{:?}", busy.keys);
        assert!(busy.load.iter().all(|&l| l == 0), "{:?}", busy.load);
    }

    #[test]
    fn an_idle_limiter_keeps_a_key_on_one_session() {
        let p = pool(8);
        let first = p.for_key("k").idx;
        for _ in 0..10 {
            assert_eq!(p.for_key("k").idx, first);
        }
    }
}
