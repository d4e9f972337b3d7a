//! Installing and upgrading the limiter's tables and functions.
//!
//! Everything lives in one schema chosen by the user. The schema name is the only identifier
//! that ever goes into SQL text, and only after [`Schema::new`] has checked it is a plain
//! lower-case identifier (it is double-quoted as well); keys, zones and every other value are
//! bound parameters.
//!
//! [`install`] is idempotent and safe to run concurrently (it holds a transaction-level
//! advisory lock): tables are created if missing, migrations newer than the recorded version
//! are applied, functions are replaced, and the version is recorded in `meta`.

use tokio_postgres::Client;

use super::keyed::take_sql;
use super::retry::typed;
use super::{MAX_CAPACITY, MAX_KEY_BYTES};
use crate::error::PgLimitError;

/// The schema version this crate installs.
pub const SCHEMA_VERSION: i32 = 1;

/// A checked schema name.
///
/// ```
/// use iothrottle::pg::Schema;
///
/// assert_eq!(Schema::new("limits")?.name(), "limits");
/// assert!(Schema::new("Limits").is_err());
/// assert!(Schema::new("x; drop table y").is_err());
/// assert!(Schema::new("pg_temp").is_err());
/// # Ok::<(), iothrottle::PgLimitError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Schema {
    name: String,
}

impl Schema {
    /// `name` must match `[a-z_][a-z0-9_]*`, be at most 63 bytes, and not start with `pg_`.
    pub fn new(name: &str) -> Result<Schema, PgLimitError> {
        let bad = |reason| PgLimitError::InvalidName {
            what: "schema",
            name: name.to_owned(),
            reason,
        };
        check_ident(name).map_err(bad)?;
        if name.starts_with("pg_") {
            return Err(bad("names starting with pg_ are reserved by PostgreSQL"));
        }
        Ok(Schema {
            name: name.to_owned(),
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `"name"`, for SQL text.
    pub(crate) fn quoted(&self) -> String {
        format!("\"{}\"", self.name)
    }

    /// `sql` with every `{s}` replaced by the quoted schema name, e.g.
    /// `"SELECT {s}.rate_limiting_request($1)"`. The only way a name reaches SQL text.
    pub fn sql(&self, sql: &str) -> String {
        sql.replace("{s}", &self.quoted())
    }
}

/// `[a-z_][a-z0-9_]*`, 1 to 63 bytes.
pub(crate) fn check_ident(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > 63 {
        return Err("longer than 63 bytes");
    }
    let mut chars = name.chars();
    let first = chars.next().expect("not empty");
    if !(first.is_ascii_lowercase() || first == '_') {
        return Err("must start with a lower-case ASCII letter or _");
    }
    if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err("only lower-case ASCII letters, digits and _ are allowed");
    }
    Ok(())
}

/// Migration `i` takes the schema from version `i` to `i + 1`. Each is idempotent.
const MIGRATIONS: &[&str] = &[
    // 0 -> 1
    r#"
CREATE TABLE IF NOT EXISTS {s}.token_bucket (
    id      text PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND {max_key}),
    micro   bigint NOT NULL CHECK (micro >= 0),
    ts      timestamptz NOT NULL,
    granted bigint NOT NULL
);
COMMENT ON TABLE {s}.token_bucket IS
    'iothrottle token buckets: micro = tokens x 10^6 at ts; granted = tokens given by the last statement';
CREATE TABLE IF NOT EXISTS {s}.window_zone (
    id             text PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND 63),
    description    text NOT NULL DEFAULT '',
    rate           integer NOT NULL CHECK (rate > 0),
    window_seconds integer NOT NULL CHECK (window_seconds > 0)
);
CREATE TABLE IF NOT EXISTS {s}.window_key (
    zone text NOT NULL REFERENCES {s}.window_zone (id) ON DELETE CASCADE,
    key  text NOT NULL CHECK (octet_length(key) BETWEEN 1 AND {max_key}),
    PRIMARY KEY (zone, key)
);
CREATE TABLE IF NOT EXISTS {s}.window_log (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    zone       text NOT NULL,
    key        text NOT NULL,
    blocked    boolean NOT NULL,
    created_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS window_log_allowed ON {s}.window_log (zone, key, created_at)
    WHERE NOT blocked;
CREATE INDEX IF NOT EXISTS window_log_created ON {s}.window_log (created_at);
"#,
];

/// Functions, replaced on every install.
const FUNCTIONS: &str = r#"
-- Micro-tokens in a bucket that held `micro` at `ts`, refilled at `rate` tokens per second
-- (= micro-tokens per microsecond) up to `now`, capped at `cap`. A `now` before `ts` (a
-- statement whose clock was read before another committed) refills nothing.
CREATE OR REPLACE FUNCTION {s}.refilled(micro bigint, ts timestamptz, now timestamptz,
                                        rate bigint, cap bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $f$
    SELECT least(cap, micro + least(greatest((extract(epoch FROM now - ts) * 1000000)::bigint, 0),
                                   cap / rate + 1) * rate)
$f$;
-- Tokens granted from `avail` micro-tokens: all `n` or nothing, or (partial) up to `n`.
CREATE OR REPLACE FUNCTION {s}.take(avail bigint, n bigint, partial boolean)
RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $f$
    SELECT CASE WHEN partial THEN least(n, avail / 1000000)
                WHEN avail >= n * 1000000 THEN n
                ELSE 0 END
$f$;
-- The sliding-window check: lock the key's row, count the allowed attempts in the window,
-- log this attempt. One round trip.
CREATE OR REPLACE FUNCTION {s}.window_check(p_zone text, p_key text, p_at timestamptz,
    OUT blocked boolean, OUT attempt_id bigint, OUT rate integer, OUT window_seconds integer)
LANGUAGE plpgsql AS $f$
DECLARE
    t timestamptz;
    used bigint;
BEGIN
    SELECT z.rate, z.window_seconds INTO rate, window_seconds
        FROM {s}.window_zone z WHERE z.id = p_zone;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no sliding-window zone %', p_zone USING ERRCODE = 'P0002';
    END IF;
    -- Takes (or creates) the key's row lock; held until commit, so checks of one key are
    -- serialised and each counts the attempts of the previous one.
    INSERT INTO {s}.window_key AS k (zone, key) VALUES (p_zone, p_key)
        ON CONFLICT (zone, key) DO UPDATE SET key = k.key;
    -- The clock is read after the lock: attempts of one key are logged in lock order.
    t := coalesce(p_at, clock_timestamp());
    SELECT count(*) INTO used FROM {s}.window_log l
        WHERE l.zone = p_zone AND l.key = p_key AND NOT l.blocked
          AND l.created_at > t - make_interval(secs => window_seconds);
    blocked := used >= rate;
    INSERT INTO {s}.window_log (zone, key, blocked, created_at)
        VALUES (p_zone, p_key, blocked, t) RETURNING id INTO attempt_id;
END
$f$;
"#;

/// The classic `rate_limiting_request(text, int, int) returns int`, on this crate's table.
const CLASSIC_FUNCTION: &str = r#"
CREATE OR REPLACE FUNCTION {s}.rate_limiting_request(rate_id text, refill_per_sec integer DEFAULT 2,
                                                     window_seconds integer DEFAULT 60)
RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE
    cap bigint;
    left_micro bigint;
    got bigint;
    t_at timestamptz;
BEGIN
    IF rate_id IS NULL OR octet_length(rate_id) NOT BETWEEN 1 AND {max_key} THEN
        RAISE EXCEPTION 'rate_id must be 1 to {max_key} bytes' USING ERRCODE = '22023';
    END IF;
    IF refill_per_sec IS NULL OR refill_per_sec < 1 THEN
        RAISE EXCEPTION 'refill_per_sec must be at least 1' USING ERRCODE = '22023';
    END IF;
    IF window_seconds IS NULL OR window_seconds < 1 THEN
        RAISE EXCEPTION 'window_seconds must be at least 1' USING ERRCODE = '22023';
    END IF;
    -- Like the Rust API (MAX_CAPACITY): the micro-token arithmetic stays inside bigint for
    -- every later call, however long the key was idle.
    IF window_seconds::bigint * refill_per_sec > {max_capacity} THEN
        RAISE EXCEPTION 'window_seconds x refill_per_sec = % tokens is above the maximum of {max_capacity}',
            window_seconds::bigint * refill_per_sec USING ERRCODE = '22023';
    END IF;
    cap := window_seconds::bigint * refill_per_sec * 1000000;
    {take_statement}
    INTO left_micro, got, t_at;
    IF got = 1 THEN
        RETURN least(left_micro / 1000000, 2147483647)::integer;
    END IF;
    RETURN -1;
END
$f$;
"#;

fn render(schema: &Schema, sql: &str) -> String {
    let classic_take = take_sql(
        "rate_id",
        "refill_per_sec::bigint",
        "cap",
        "1::bigint",
        "false",
        "NULL::timestamptz",
    );
    schema.sql(
        &sql.replace("{take_statement}", &classic_take)
            .replace("{max_key}", &MAX_KEY_BYTES.to_string())
            .replace("{max_capacity}", &MAX_CAPACITY.to_string()),
    )
}

/// The installed schema version, or `None` when nothing is installed in `schema`.
pub async fn installed_version(
    client: &Client,
    schema: &Schema,
) -> Result<Option<i32>, PgLimitError> {
    let meta = format!("{}.meta", schema.quoted());
    let row = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&meta])
        .await
        .map_err(typed)?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_opt(&schema.sql("SELECT version FROM {s}.meta"), &[])
        .await
        .map_err(typed)?;
    Ok(row.map(|r| r.get(0)))
}

/// Creates or upgrades the limiter's tables and functions in `schema`. Idempotent, safe to
/// run from several processes at once.
///
/// Errors: [`PgLimitError::SchemaTooNew`] when a newer crate installed the schema; server
/// errors (e.g. no `CREATE` privilege) as [`PgLimitError::Db`].
pub async fn install(client: &Client, schema: &Schema) -> Result<(), PgLimitError> {
    let found = installed_version(client, schema).await?.unwrap_or(0);
    if found > SCHEMA_VERSION {
        return Err(PgLimitError::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    // All migrations are idempotent, so running them all under the lock is correct even if
    // another process installed between our read and the lock.
    let mut sql = String::from("BEGIN;\n");
    // The schema name is a checked identifier, so it is safe inside a string literal too.
    sql.push_str(&format!(
        "SELECT pg_advisory_xact_lock(1769895028, hashtext('{}'));\n",
        schema.name()
    ));
    sql.push_str("CREATE SCHEMA IF NOT EXISTS {s};\n");
    sql.push_str(
        "CREATE TABLE IF NOT EXISTS {s}.meta (one boolean PRIMARY KEY DEFAULT true CHECK (one), \
         version integer NOT NULL);\n",
    );
    for m in MIGRATIONS {
        sql.push_str(m);
    }
    sql.push_str(FUNCTIONS);
    sql.push_str(&format!(
        "INSERT INTO {{s}}.meta (one, version) VALUES (true, {SCHEMA_VERSION}) \
         ON CONFLICT (one) DO UPDATE SET version = greatest({{s}}.meta.version, excluded.version);\n"
    ));
    sql.push_str("COMMIT;\n");
    let sql = render(schema, &sql);
    if let Err(e) = client.batch_execute(&sql).await {
        // Leave the session usable if the failure happened inside the transaction.
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(typed(e));
    }
    Ok(())
}

/// Installs `rate_limiting_request(rate_id text, refill_per_sec int default 2,
/// window_seconds int default 60) returns int` in `schema`, on this crate's table, so SQL
/// callers of the classic function keep working (with fractional refill and no first-call
/// race). Requires [`install`] first.
pub async fn install_classic_function(
    client: &Client,
    schema: &Schema,
) -> Result<(), PgLimitError> {
    if installed_version(client, schema).await?.is_none() {
        return Err(PgLimitError::NotInstalled {
            schema: schema.name().to_owned(),
        });
    }
    client
        .batch_execute(&render(schema, CLASSIC_FUNCTION))
        .await
        .map_err(typed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        assert!(Schema::new("iothrottle").is_ok());
        assert!(Schema::new("_x9").is_ok());
        for bad in ["", "9x", "A", "a-b", "a\"b", "a b", "ü", "pg_catalog"] {
            assert!(
                matches!(
                    Schema::new(bad),
                    Err(PgLimitError::InvalidName { what: "schema", .. })
                ),
                "{bad:?}"
            );
        }
        assert!(Schema::new(&"a".repeat(63)).is_ok());
        assert!(Schema::new(&"a".repeat(64)).is_err());
    }

    #[test]
    fn rendering_quotes_the_schema() {
        let s = Schema::new("lim").unwrap();
        assert_eq!(s.sql("SELECT * FROM {s}.t"), "SELECT * FROM \"lim\".t");
        assert!(!render(&s, MIGRATIONS[0]).contains('{'));
        assert!(!render(&s, CLASSIC_FUNCTION).contains("{s}"));
    }
}
