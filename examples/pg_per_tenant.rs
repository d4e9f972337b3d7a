//! One request rate per tenant, shared by every process of a service, on the PostgreSQL the
//! service already has: leased mode serves most calls locally and leases batches of tokens
//! from the tenant's row; strict mode would make one round trip per call.
//!
//! ```text
//! cargo run --features postgres --example pg_per_tenant -- 'host=127.0.0.1 user=postgres'
//! ```

use iothrottle::pg::{LeaseOptions, PgLeasedLimiter, PgOptions};
use iothrottle::PgLimitError;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), PgLimitError> {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: pg_per_tenant '<connection string>' (a server to install the tables in)");
        std::process::exit(2);
    };
    // Every tenant: 100 requests per second across all processes, bursts of 200; a process
    // holds at most 20 of a tenant's tokens at a time.
    let lease = LeaseOptions::new(100, 200, 20)?;
    let limiter = PgLeasedLimiter::connect(&url, PgOptions::new(), lease).await?;
    limiter.install().await?; // idempotent; a deployment step would run it once

    let (mut served, mut refused) = (0, 0);
    for _ in 0..500 {
        for tenant in ["acme", "globex"] {
            if limiter.try_acquire_one(tenant).await? {
                served += 1; // handle the request
            } else {
                refused += 1; // answer 429 Too Many Requests
            }
        }
    }
    println!("served {served}, refused {refused}");
    // Give the tokens this process still holds back to the tenants' rows.
    limiter.shutdown().await?;
    Ok(())
}
