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

use super::retry::typed;
use super::sql;
use crate::PgLimitError;

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
        sql::fill(sql, &self.quoted())
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

/// The installed schema version, or `None` when nothing is installed in `schema`.
pub async fn installed_version(
    client: &Client,
    schema: &Schema,
) -> Result<Option<i32>, PgLimitError> {
    let meta = format!("{}.meta", schema.quoted());
    let row = client
        .query_one(sql::META_EXISTS, &[&meta])
        .await
        .map_err(typed)?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_opt(&schema.sql(sql::META_VERSION), &[])
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
    let sql = schema.sql(&sql::install_script(schema.name(), SCHEMA_VERSION));
    if let Err(e) = client.batch_execute(&sql).await {
        // Leave the session usable if the failure happened inside the transaction.
        let _ = client.batch_execute(sql::ROLLBACK).await;
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
        .batch_execute(&schema.sql(&sql::classic_function()))
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
        assert!(!s.sql(&sql::install_script(s.name(), 1)).contains('{'));
        assert!(!s.sql(&sql::classic_function()).contains("{s}"));
    }
}
