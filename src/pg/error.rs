//! The PostgreSQL limiters' error.
//! Defined here, re-exported at the crate root (their one public path). `Display` is the
//! error's own message only; a cause is returned by `source()`, so reporters (anyhow, eyre) print
//! each cause once.

/// What went wrong in the PostgreSQL limiters ([`crate::pg`]).
///
/// Bad input is reported before anything is sent to the server. Server errors keep their
/// SQLSTATE; serialization failures and deadlocks are retried first (see
/// [`RetryPolicy`](crate::pg::RetryPolicy)) and only surface as
/// [`RetriesExhausted`](Self::RetriesExhausted).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgLimitError {
    /// The key is the empty string.
    #[error("the key is empty")]
    EmptyKey,
    /// The key is longer than [`MAX_KEY_BYTES`](crate::pg::MAX_KEY_BYTES).
    #[error("the key is {len} bytes long, the maximum is {max}")]
    KeyTooLong {
        /// The key's length in bytes (UTF-8).
        len: usize,
        /// The longest key accepted, in bytes.
        max: usize,
    },
    /// The key contains a NUL character, which PostgreSQL `text` cannot store.
    #[error("the key contains a NUL character")]
    KeyHasNul,
    /// A refill rate of zero or less.
    #[error("the refill rate must be at least 1 token per second, got {rate}")]
    InvalidRate {
        /// The rate, as given.
        rate: i64,
    },
    /// A window (or burst) of zero or less.
    #[error("the window must be at least 1 second, got {window}")]
    InvalidWindow {
        /// The window, as given.
        window: i64,
    },
    /// A burst (bucket capacity) of zero or less.
    #[error("the burst must be at least 1 token, got {burst}")]
    InvalidBurst {
        /// The burst, as given.
        burst: i64,
    },
    /// A request for zero or fewer tokens.
    #[error("the number of tokens requested must be at least 1, got {n}")]
    InvalidCount {
        /// The count, as given.
        n: i64,
    },
    /// A leased-mode request for more tokens than one lease can hold.
    #[error("{n} tokens requested at once, but a lease holds at most {max}")]
    TooManyTokens {
        /// The tokens requested.
        n: u64,
        /// The largest lease.
        max: u64,
    },
    /// The bucket would hold more micro-tokens than the 64-bit arithmetic allows.
    #[error("a bucket of {tokens} tokens is above the maximum of {max} tokens")]
    CapacityTooLarge {
        /// The capacity asked for (window × rate, or the burst), in tokens.
        tokens: i128,
        /// The largest capacity accepted, in tokens.
        max: i64,
    },
    /// A schema or zone name that is not a plain lower-case identifier.
    #[error("invalid {what} {name:?}: {reason}")]
    InvalidName {
        /// What the name is for ("schema", "zone").
        what: &'static str,
        /// The name, as given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// An option that cannot be honoured.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// The option's name.
        name: &'static str,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The sliding-window zone does not exist.
    #[error("no sliding-window zone named {zone:?}")]
    UnknownZone {
        /// The zone asked for.
        zone: String,
    },
    /// The installed schema is newer than this version of the crate knows.
    #[error("schema version {found} is newer than the {supported} this crate supports")]
    SchemaTooNew {
        /// The version found in the database.
        found: i32,
        /// The newest version this crate installs.
        supported: i32,
    },
    /// The limiter's tables are not installed in the schema.
    #[error("the limiter is not installed in schema {schema:?}: call install() first")]
    NotInstalled {
        /// The schema looked in.
        schema: String,
    },
    /// A serialization failure (40001) or deadlock (40P01) persisted through every attempt.
    #[error("gave up after {attempts} attempts, the last failed with SQLSTATE {sqlstate}")]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
        /// The SQLSTATE of the last failure.
        sqlstate: String,
        /// The last failure.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The connection failed or was closed while a statement was in flight. Whether that
    /// statement committed is unknown; the next call reconnects.
    #[error(
        "connection to PostgreSQL lost (the outcome of the call is unknown){}{}",
        .source.code().map(|c| format!(", SQLSTATE {}", c.code())).unwrap_or_default(),
        .closed_by.as_ref().map(|r| format!(" (the server closed the session: {r})")).unwrap_or_default()
    )]
    Connection {
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
        /// For a call queued on a session that the server closed, the server's reason as
        /// another call on that session received it: SQLSTATE, severity and message
        /// (`57P01 FATAL: terminating connection due to administrator command`). `None` when
        /// `source` carries the server's error itself, or the server sent none.
        closed_by: Option<String>,
    },
    /// A call took longer than its timeout; its outcome is unknown, and its connection was
    /// dropped (the next call reconnects).
    #[error("the call took longer than {after:?} (the outcome is unknown)")]
    TimedOut {
        /// The timeout.
        after: std::time::Duration,
    },
    /// The server could not be reached a moment ago; calls fail at once until the reconnect
    /// back-off has passed.
    #[error(
        "PostgreSQL unavailable, next connection attempt in {retry_in:?}; last failure: {why}"
    )]
    Unavailable {
        /// When the next connection attempt will be made.
        retry_in: std::time::Duration,
        /// The last connection failure, as text (SQLSTATE and message, or the socket error).
        why: String,
    },
    /// The connection string does not parse (nothing was sent).
    #[error("invalid PostgreSQL connection string")]
    InvalidConnectionString {
        /// The driver's parse error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server could not be reached (refused, unreachable, timed out, or it closed the
    /// socket before the session started). No statement was sent: nothing was taken.
    #[error("could not connect to the PostgreSQL server")]
    Connect {
        /// The driver's error (the socket error is among its sources).
        #[source]
        source: tokio_postgres::Error,
    },
    /// The TLS handshake failed: the server's certificate is not trusted or names another
    /// host, or the server does not offer TLS. No statement was sent.
    #[error("TLS handshake with the PostgreSQL server failed")]
    Tls {
        /// The driver's error (the TLS library's reason is among its sources).
        #[source]
        source: tokio_postgres::Error,
    },
    /// A caller-given time outside PostgreSQL's `timestamptz` range (4713 BC to 294276 AD).
    #[error("the time {at:?} is outside PostgreSQL's timestamptz range (4713 BC to 294276 AD)")]
    TimeOutOfRange {
        /// The time, as given.
        at: std::time::SystemTime,
    },
    /// Any other error from the server, with its SQLSTATE.
    #[error("PostgreSQL error {sqlstate}")]
    Db {
        /// The SQLSTATE code (five characters), or `"?????"` when the server sent none.
        sqlstate: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// A driver error as text for `Display`: the server's SQLSTATE, severity, message, and detail
/// and hint when present (`57P01 FATAL: terminating connection due to administrator
/// command`); without a server error, the driver's message and its causes (`error connecting
/// to server: Connection refused (os error 111)`).
pub(crate) fn pg_error_text(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!("{} {}: {}", db.code().code(), db.severity(), db.message());
        if let Some(d) = db.detail() {
            s.push_str(" (detail: ");
            s.push_str(d);
            s.push(')');
        }
        if let Some(h) = db.hint() {
            s.push_str(" (hint: ");
            s.push_str(h);
            s.push(')');
        }
        return s;
    }
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(c) = source {
        s.push_str(": ");
        s.push_str(&c.to_string());
        source = c.source();
    }
    s
}
