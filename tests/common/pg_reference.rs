//! The classic SQL token bucket, reproduced for comparison only (tests and the load
//! generator; not part of the crate).
//!
//! Written from its published description (see `docs/postgres.md`): an integer `tk`, `ts`
//! reset to `now()` on every call while the refill is measured with `clock_timestamp()`,
//! UPDATE-then-INSERT. It has the defects this crate's strict mode fixes: each call's refill
//! is rounded to the *nearest* whole token (calls at least half a token apart over-grant,
//! calls less than half a token apart never refill; test
//! `reference_function_rounds_to_the_nearest_token`), and two first calls for a new key race
//! to a unique-key violation under READ COMMITTED. It lives in its own table
//! (`reference_token_bucket`) and is called `reference_rate_limiting_request`, so it never
//! collides with the crate's `install_classic_function`.

use iothrottle::pg::Schema;
use tokio_postgres::Client;

const REFERENCE_SQL: &str = r#"
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.reference_token_bucket (
    id text PRIMARY KEY,
    tk bigint NOT NULL,
    ts timestamptz NOT NULL
);
CREATE OR REPLACE FUNCTION {s}.reference_rate_limiting_request(rate_id text,
    refill_per_sec integer DEFAULT 2, window_seconds integer DEFAULT 60)
RETURNS integer LANGUAGE plpgsql AS $f$
DECLARE
    tokens integer;
BEGIN
    UPDATE {s}.reference_token_bucket SET
        tk = greatest(least(tk - 1 + refill_per_sec * extract(epoch FROM clock_timestamp() - ts),
                            window_seconds * refill_per_sec), -1),
        ts = now()
    WHERE id = rate_id
    RETURNING tk INTO tokens;
    IF NOT FOUND THEN
        INSERT INTO {s}.reference_token_bucket (id, tk, ts)
            VALUES (rate_id, window_seconds * refill_per_sec - 1, now())
            RETURNING tk INTO tokens;
    END IF;
    RETURN tokens;
END
$f$;
"#;

/// Installs `reference_rate_limiting_request(text, int, int)` and its table in `schema`.
/// For benchmarks and tests that compare against the classic function.
pub async fn install_reference_function(
    client: &Client,
    schema: &Schema,
) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&schema.sql(REFERENCE_SQL)).await
}
