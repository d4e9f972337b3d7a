//! Many OS processes on one key: this test binary re-run as one of its ignored tests, the
//! child, which prints `GRANTED=<n>` on a line of its own; the parent sums them over a window
//! read on the server's clock.

use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use iothrottle::pg::{PgKeyedLimiter, PgOptions};

use super::pg::PgCluster;

/// Installs the schema on `pg`, runs `n` children at once (the test `child` of this binary,
/// with `env` set to tell it what to do), and returns the sum of what they granted and the
/// window on the server's clock, read before the first starts and after the last has exited.
pub async fn granted_by_children(
    pg: &PgCluster,
    child: &str,
    env: (&str, &str),
    n: u64,
) -> (u64, Duration) {
    let setup = PgKeyedLimiter::connect(&pg.connection_string(), PgOptions::new())
        .await
        .unwrap();
    setup.install().await.unwrap();
    let (c, conn) = tokio_postgres::connect(&pg.connection_string(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let clock = "SELECT clock_timestamp()";
    let start: SystemTime = c.query_one(clock, &[]).await.unwrap().get(0);
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..n)
        .map(|_| {
            Command::new(&exe)
                .args([child, "--exact", "--ignored", "--nocapture"])
                .env(env.0, env.1)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut total = 0u64;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        total += text
            .lines()
            .find_map(|l| l.strip_prefix("GRANTED="))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("child output: {text}"))
            .parse::<u64>()
            .unwrap();
    }
    let end: SystemTime = c.query_one(clock, &[]).await.unwrap().get(0);
    (total, end.duration_since(start).unwrap())
}
