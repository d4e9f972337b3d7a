//! The database side of leasing: each session's leases go out together, as one statement.
//!
//! A lease asks the [`Leaser`] for up to `ask` tokens of a key; the leases of all keys that
//! the pool routes to one session and that are waiting at the same moment go out as one
//! statement ([`sql::batch_take_statement`]): one commit and one WAL flush per batch instead
//! of per lease. A key appears at most once per statement (a second lease of the same key,
//! from an evicted state, waits for the next one). A batch that fails is retried lease by
//! lease, so each caller gets its own outcome.
//!
//! # Orderings
//!
//! `statements` is a statistic: `Relaxed`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::pg::conn::Conn;
use crate::pg::keyed::{Grant, PgKeyedLimiter};
use crate::pg::sql;
use crate::sync::{Arc, AtomicU64, Ordering};
use crate::PgLimitError;

/// The most leases one batch statement takes.
const MAX_BATCH: usize = 1_024;

/// The leases waiting for one session's next statement.
#[derive(Debug, Default)]
struct Batcher {
    q: Mutex<BatchQueue>,
}

#[derive(Debug, Default)]
struct BatchQueue {
    pending: Vec<Pending>,
    /// A task is running this session's statements (and will take what is pending).
    running: bool,
}

/// One key's lease, waiting for its batch.
#[derive(Debug)]
struct Pending {
    key: String,
    ask: i64,
    at: Option<SystemTime>,
    tx: tokio::sync::oneshot::Sender<Result<Grant, PgLimitError>>,
}

/// Takes leases from the keys' rows, batching them per session.
#[derive(Debug)]
pub(super) struct Leaser {
    /// The strict limiter whose sessions and statements leases use.
    pub(super) db: PgKeyedLimiter,
    /// The global rate, tokens per second.
    rate: i64,
    /// The global capacity, micro-tokens.
    cap_micro: i64,
    /// The batch lease statement, with the schema filled in.
    sql: String,
    /// One batcher per session, by the session's address in the pool (which lives as long
    /// as `db`).
    batchers: Mutex<Vec<(usize, Arc<Batcher>)>>,
    /// Statements that took leases.
    pub(super) statements: AtomicU64,
}

impl Leaser {
    /// Leases from `db`'s rows for a global bucket of `rate` tokens per second and
    /// `cap_micro` micro-tokens.
    pub(super) fn new(db: PgKeyedLimiter, rate: i64, cap_micro: i64) -> Leaser {
        let sql = db.schema().sql(&sql::batch_take_statement());
        Leaser {
            db,
            rate,
            cap_micro,
            sql,
            batchers: Mutex::new(Vec::new()),
            statements: AtomicU64::new(0),
        }
    }

    /// Gives `n` tokens of `key` back to its row.
    pub(super) async fn give_back(
        &self,
        key: &str,
        n: u64,
        at: Option<SystemTime>,
    ) -> Result<(), PgLimitError> {
        self.db
            .give_back_raw(key, self.rate, self.cap_micro, n as i64, at)
            .await
    }

    /// Takes up to `ask` tokens of `key` from its row, in the next batch statement of the
    /// key's session (see [`sql::batch_take_statement`]).
    pub(super) async fn take(
        self: &Arc<Self>,
        key: &str,
        ask: u64,
        at: Option<SystemTime>,
    ) -> Result<Grant, PgLimitError> {
        // The batcher of the session the pool gives this key now (the address identifies it;
        // the pool lives as long as `db`). Any session can run any key's lease: this only
        // groups the leases that go out together.
        let id = {
            let conn = self.db.pool().for_key(key);
            &*conn as *const Conn as usize
        };
        let b = {
            let mut all = self.batchers.lock().expect("batchers");
            match all.iter().find(|(c, _)| *c == id) {
                Some((_, b)) => b.clone(),
                None => {
                    let b = Arc::new(Batcher::default());
                    all.push((id, b.clone()));
                    b
                }
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start = {
            let mut q = b.q.lock().expect("lease batch");
            q.pending.push(Pending {
                key: key.to_owned(),
                ask: ask as i64,
                at,
                tx,
            });
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            tokio::spawn(self.clone().run_batches(b));
        }
        rx.await.unwrap_or_else(|_| {
            Err(PgLimitError::Unavailable {
                retry_in: Duration::ZERO,
                why: "the lease batch was dropped (runtime shutting down)".into(),
            })
        })
    }

    /// Runs one session's batch statements while leases are waiting: each takes every
    /// pending key once (a key's second lease, from an evicted state, waits for the next).
    async fn run_batches(self: Arc<Self>, b: Arc<Batcher>) {
        /// If this task ends early (a panic, or its runtime shutting down), lets the next
        /// lease start a new one, and fails the leases queued meanwhile (their senders are
        /// dropped) instead of leaving them waiting forever.
        struct Stopped(Arc<Batcher>, bool);
        impl Drop for Stopped {
            fn drop(&mut self) {
                if self.1 {
                    return; // ended normally, with `running` reset under the queue's lock
                }
                if let Ok(mut q) = self.0.q.lock() {
                    q.running = false;
                    q.pending.clear();
                }
            }
        }
        let mut stopped = Stopped(b.clone(), false);
        loop {
            // Let the leases that are ready to ask (a wave of keys running dry together)
            // join this batch rather than wait a whole statement for the next one.
            tokio::task::yield_now().await;
            let mut batch = {
                let mut q = b.q.lock().expect("lease batch");
                if q.pending.is_empty() {
                    q.running = false;
                    stopped.1 = true;
                    return;
                }
                let mut seen = HashSet::new();
                let (mut now, mut later) = (Vec::new(), Vec::new());
                for p in q.pending.drain(..) {
                    if now.len() < MAX_BATCH && seen.insert(p.key.clone()) {
                        now.push(p);
                    } else {
                        later.push(p);
                    }
                }
                q.pending = later;
                now
            };
            // Relaxed: statistics.
            self.statements.fetch_add(1, Ordering::Relaxed);
            let mut alone = Vec::new();
            if batch.len() == 1 {
                alone = batch;
            } else {
                match self.run_batch(&batch).await {
                    Ok(mut rows) => {
                        for p in batch.drain(..) {
                            match rows.remove(&p.key) {
                                Some(g) => {
                                    let _ = p.tx.send(Ok(g));
                                }
                                None => alone.push(p),
                            }
                        }
                    }
                    // Each lease on its own, so that each caller gets its own error (a lost
                    // connection may have committed the batch: those tokens are then lost,
                    // under-use, never a second grant).
                    Err(_) => alone = batch,
                }
            }
            for p in alone {
                let r = self
                    .db
                    .take_raw(&p.key, self.rate, self.cap_micro, p.ask, true, p.at)
                    .await;
                let _ = p.tx.send(r);
            }
        }
    }

    async fn run_batch(&self, batch: &[Pending]) -> Result<HashMap<String, Grant>, PgLimitError> {
        let ids: Vec<&str> = batch.iter().map(|p| p.key.as_str()).collect();
        let asks: Vec<i64> = batch.iter().map(|p| p.ask).collect();
        let ats: Vec<Option<SystemTime>> = batch.iter().map(|p| p.at).collect();
        let (ids, asks, ats) = (&ids, &asks, &ats);
        let (rate, cap) = (&self.rate, &self.cap_micro);
        let sql = self.sql.as_str();
        self.db
            .pool()
            .for_key(ids[0])
            .run(|live| async move {
                let st = live.prepared(sql).await?;
                let rows = live.client.query(&st, &[ids, asks, ats, rate, cap]).await?;
                Ok(rows
                    .into_iter()
                    .map(|r| {
                        (
                            r.get::<_, String>(3),
                            Grant {
                                micro_left: r.get(0),
                                granted: r.get(1),
                                at: r.get(2),
                            },
                        )
                    })
                    .collect())
            })
            .await
    }
}
