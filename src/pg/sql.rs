//! Every SQL text the limiters send, in one place.
//!
//! Texts name the schema as `{s}`; [`fill`] replaces it with the quoted, checked schema name
//! (through [`Schema::sql`](super::Schema::sql), the only way a name reaches SQL text). Keys,
//! zones, counts and times are always bound parameters.
//!
//! The token-bucket upsert is built from parts ([`upsert`]) so that the single-key statement,
//! the batched lease statement and the classic function's body are the same arithmetic by
//! construction:
//!
//! - `micro` = tokens × 10^6 at time `ts`; a rate of `r` tokens per second adds exactly `r`
//!   micro-tokens per microsecond (the resolution of `timestamptz`);
//! - the clock is read once per row, in the inserted row (`excluded.ts`), and `ts` only moves
//!   forward (`greatest(b.ts, excluded.ts)`): a statement whose clock was read before another
//!   committed a later `ts` refills nothing (never negative).
//!
//! The refill and the grant are written out inline rather than calling the installed
//! `refilled`/`take` SQL functions: the planner does not inline a function whose argument is
//! used twice and is itself a function call, and the calls cost about a third of the
//! statement's time.

use super::{MAX_CAPACITY, MAX_KEY_BYTES};

/// `sql` with every `{s}` replaced by `quoted_schema` (already checked and quoted).
pub(crate) fn fill(sql: &str, quoted_schema: &str) -> String {
    sql.replace("{s}", quoted_schema)
}

// ---- The token-bucket upsert -------------------------------------------------------------

/// The tokens granted from `avail` micro-tokens: up to `n` when `partial`, else all `n` or
/// nothing.
fn grant(avail: &str, n: &str, partial: &str) -> String {
    format!(
        "(CASE WHEN {partial} THEN least({n}, ({avail}) / 1000000) \
         WHEN ({avail}) >= {n} * 1000000 THEN {n} ELSE 0 END)"
    )
}

/// The new row of a key seen for the first time: `id`, a full bucket (`cap` micro-tokens)
/// less the grant, the time (`at`, or the server's `clock_timestamp()` read once), the grant.
fn first_row(id: &str, cap: &str, n: &str, partial: &str, at: &str) -> String {
    let first = grant(cap, n, partial);
    format!("{id}, {cap} - {first} * 1000000, coalesce({at}, clock_timestamp()), {first}")
}

/// `INSERT … {rows} ON CONFLICT (id) DO UPDATE … RETURNING {returning}` on the bucket table:
/// `rows` supplies `(id, micro, ts, granted)` for new keys ([`first_row`]); an existing row
/// is refilled at `rate` up to `cap` until `excluded.ts` and grants from `n` (an expression
/// the update arm can see).
fn upsert(rows: &str, rate: &str, cap: &str, n: &str, partial: &str, returning: &str) -> String {
    let avail = format!(
        "least({cap}, b.micro + least(greatest((extract(epoch FROM excluded.ts - b.ts) * 1000000)::bigint, 0), \
         {cap} / {rate} + 1) * {rate})"
    );
    let granted = grant(&avail, n, partial);
    format!(
        "INSERT INTO {{s}}.token_bucket AS b (id, micro, ts, granted)\n\
         {rows}\n\
         ON CONFLICT (id) DO UPDATE SET\n\
         micro = {avail} - {granted} * 1000000,\n\
         ts = greatest(b.ts, excluded.ts),\n\
         granted = {granted}\n\
         RETURNING {returning}"
    )
}

/// The single-key take, with its inputs as SQL expressions: `id` key, `rate` tokens per
/// second, `cap` capacity in micro-tokens, `n` tokens wanted, `partial` ("up to `n`"), `at`
/// the time (NULL: the server's clock). Returns `micro, granted, ts`.
fn take(id: &str, rate: &str, cap: &str, n: &str, partial: &str, at: &str) -> String {
    upsert(
        &format!("VALUES ({})", first_row(id, cap, n, partial, at)),
        rate,
        cap,
        n,
        partial,
        "b.micro, b.granted, b.ts",
    )
}

/// The prepared take: `$1` key, `$2` rate, `$3` capacity, `$4` tokens, and `$5` the time when
/// `at` (else the server's clock). `partial` is a literal, so the planner folds the `CASE`
/// away and each of the four statements is as small as the classic function's.
pub(crate) fn take_statement(partial: bool, at: bool) -> String {
    take(
        "$1::text",
        "$2::bigint",
        "$3::bigint",
        "$4::bigint",
        if partial { "true" } else { "false" },
        if at {
            "$5::timestamptz"
        } else {
            "NULL::timestamptz"
        },
    )
}

/// The lease statement for many keys at once: the take in its "up to N" form over
/// `unnest($1 keys, $2 tokens wanted, $3 times)`, `$4` the rate and `$5` the capacity in
/// micro-tokens; returns `micro, granted, ts, id` per row. One statement, one commit (one WAL
/// flush) for the whole batch; the rows are locked in key order, so two batches from
/// different processes cannot deadlock on each other.
///
/// The update arm cannot see `r`: it reads the wanted count as `excluded.granted`, the
/// first-call grant `least(n, cap)`. Since the available amount never exceeds `cap`,
/// `least(least(n, cap), available) = least(n, available)`, the single-key statement's grant.
pub(crate) fn batch_take_statement() -> String {
    let rows = format!(
        "SELECT {}\nFROM unnest($1::text[], $2::bigint[], $3::timestamptz[]) AS r(id, n, at)\n\
         ORDER BY r.id",
        first_row("r.id", "$5::bigint", "r.n", "true", "r.at")
    );
    upsert(
        &rows,
        "$4::bigint",
        "$5::bigint",
        "excluded.granted",
        "true",
        "b.micro, b.granted, b.ts, b.id",
    )
}

/// Read-only: `$1` key, `$2` rate, `$3` capacity, `$4` time.
pub(crate) const PEEK: &str = r#"
SELECT {s}.refilled(b.micro, b.ts, coalesce($4::timestamptz, clock_timestamp()), $2::bigint, $3::bigint)
FROM {s}.token_bucket b WHERE b.id = $1::text
"#;

/// Gives back `$4` tokens: `$1` key, `$2` rate, `$3` capacity, `$5` time.
pub(crate) const GIVE_BACK: &str = r#"
UPDATE {s}.token_bucket AS b SET
    micro = least($3::bigint, {s}.refilled(b.micro, b.ts, c.now, $2::bigint, $3::bigint)
                              + $4::bigint * 1000000),
    ts = greatest(b.ts, c.now),
    granted = 0
FROM (SELECT coalesce($5::timestamptz, clock_timestamp()) AS now) c
WHERE b.id = $1::text
"#;

// ---- The sliding-window log --------------------------------------------------------------

/// One check: `$1` zone, `$2` key, `$3` time.
pub(crate) const WINDOW_CHECK: &str =
    "SELECT blocked, attempt_id, rate, window_seconds FROM {s}.window_check($1::text, $2::text, $3::timestamptz)";

/// Creates or updates a zone: `$1` id, `$2` description, `$3` rate, `$4` window seconds.
pub(crate) const WINDOW_ZONE: &str = r#"
INSERT INTO {s}.window_zone (id, description, rate, window_seconds) VALUES ($1, $2, $3, $4)
ON CONFLICT (id) DO UPDATE SET description = excluded.description, rate = excluded.rate,
    window_seconds = excluded.window_seconds
"#;

/// Deletes up to `$1` log rows older than their zone's window (or of deleted zones) at `$2`.
pub(crate) const WINDOW_PURGE_LOG: &str = r#"
DELETE FROM {s}.window_log WHERE id IN (
    SELECT l.id FROM {s}.window_log l LEFT JOIN {s}.window_zone z ON z.id = l.zone
    WHERE z.id IS NULL
       OR l.created_at <= coalesce($2::timestamptz, clock_timestamp())
                          - make_interval(secs => z.window_seconds)
    LIMIT $1::bigint)
"#;

/// Deletes up to `$1` key rows that have no log rows left and are not locked by a check.
pub(crate) const WINDOW_PURGE_KEYS: &str = r#"
DELETE FROM {s}.window_key WHERE ctid IN (
    SELECT k.ctid FROM {s}.window_key k
    WHERE NOT EXISTS (SELECT 1 FROM {s}.window_log l WHERE l.zone = k.zone AND l.key = k.key)
    LIMIT $1::bigint FOR UPDATE SKIP LOCKED)
"#;

// ---- Sessions ----------------------------------------------------------------------------

/// The session's `synchronous_commit`.
pub(crate) const SHOW_SYNCHRONOUS_COMMIT: &str = "SHOW synchronous_commit";

/// A setting of the session: `$1` its name.
pub(crate) const CURRENT_SETTING: &str = "SELECT current_setting($1)";

/// The settings a limiter's session runs with: its isolation level (`"read committed"` or
/// `"serializable"`), and `sync`, an extra `SET synchronous_commit …;` or nothing.
///
/// `plan_cache_mode`: the limiter's statements have one good plan (a primary-key probe); left
/// to `auto`, the server keeps re-planning the upsert for every call (custom plans), which
/// costs about as much as running it.
pub(crate) fn session_settings(isolation: &str, sync: &str) -> String {
    format!(
        "SET default_transaction_isolation TO '{isolation}'; SET application_name TO 'iothrottle'; \
         SET plan_cache_mode TO force_generic_plan; {sync}"
    )
}

// ---- Installation ------------------------------------------------------------------------

/// Whether `$1` (`"schema".meta`) exists.
pub(crate) const META_EXISTS: &str = "SELECT to_regclass($1) IS NOT NULL";

/// The installed version.
pub(crate) const META_VERSION: &str = "SELECT version FROM {s}.meta";

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

/// `sql` with the installation's placeholders filled in (the schema's `{s}` is left to the
/// caller): the classic function's take, the key and capacity limits.
fn render(sql: &str) -> String {
    let classic_take = take(
        "rate_id",
        "refill_per_sec::bigint",
        "cap",
        "1::bigint",
        "false",
        "NULL::timestamptz",
    );
    sql.replace("{take_statement}", &classic_take)
        .replace("{max_key}", &MAX_KEY_BYTES.to_string())
        .replace("{max_capacity}", &MAX_CAPACITY.to_string())
}

/// The whole installation as one transaction, for schema `name` (a checked identifier, so
/// safe inside a string literal too): an advisory lock per schema, the schema, `meta`, every
/// migration (all idempotent, so running them all under the lock is correct even if another
/// process installed meanwhile), the functions, and `version` recorded in `meta`.
pub(crate) fn install_script(name: &str, version: i32) -> String {
    let mut sql = String::from("BEGIN;\n");
    sql.push_str(&format!(
        "SELECT pg_advisory_xact_lock(1769895028, hashtext('{name}'));\n"
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
        "INSERT INTO {{s}}.meta (one, version) VALUES (true, {version}) \
         ON CONFLICT (one) DO UPDATE SET version = greatest({{s}}.meta.version, excluded.version);\n"
    ));
    sql.push_str("COMMIT;\n");
    render(&sql)
}

/// The classic function, ready for its schema.
pub(crate) fn classic_function() -> String {
    render(CLASSIC_FUNCTION)
}

/// The rollback after a failed installation.
pub(crate) const ROLLBACK: &str = "ROLLBACK";

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch statement is the single-key upsert over `unnest`, with the wanted count in
    /// the update arm read through `excluded.granted` (the update arm cannot see `r`).
    #[test]
    fn batch_statement_has_the_upserts_shape() {
        let sql = batch_take_statement();
        assert!(sql.contains("FROM unnest($1::text[], $2::bigint[], $3::timestamptz[])"));
        assert!(sql.contains("ORDER BY r.id\nON CONFLICT (id) DO UPDATE"));
        assert!(sql.ends_with("RETURNING b.micro, b.granted, b.ts, b.id"));
        let (insert, update) = sql.split_once("ON CONFLICT").unwrap();
        assert!(insert.contains("r.n") && !insert.contains("excluded."));
        assert!(update.contains("excluded.granted") && !update.contains("r.n"));
        assert!(!sql.contains('\u{1}'), "a placeholder was left");
    }

    /// The batch and the single-key statement share the update arm's arithmetic: with the
    /// single statement's `n` read as `excluded.granted`, and the prepared parameters
    /// renumbered, the two update arms are the same text.
    #[test]
    fn batch_and_single_key_updates_are_the_same_arithmetic() {
        let single = take(
            "$1::text",
            "$4::bigint",
            "$5::bigint",
            "excluded.granted",
            "true",
            "NULL::timestamptz",
        );
        let batch = batch_take_statement();
        let arm = |s: &str| {
            let from = s.find("ON CONFLICT").unwrap();
            let to = s.find("RETURNING").unwrap();
            s[from..to].to_owned()
        };
        assert_eq!(arm(&single), arm(&batch));
    }

    #[test]
    fn installation_placeholders_are_all_filled() {
        let script = install_script("lim", 1);
        assert!(!script.contains("{max_key}") && !script.contains("{max_capacity}"));
        assert!(!fill(&script, "\"lim\"").contains('{'));
        assert!(!fill(&classic_function(), "\"lim\"").contains("{s}"));
        assert!(!fill(&render(MIGRATIONS[0]), "\"lim\"").contains('{'));
    }
}
