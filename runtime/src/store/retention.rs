//! Dedup retention: deleting dedup rows (and copy records, stale start marks) older
//! than the retention, in small batches, one sweeper at a time across processes.
//!
//! A dedup row is what makes a redelivery a duplicate: deleted too early, a late
//! copy of an applied message would be applied again. So the retention must exceed
//! the longest time a copy can still arrive: the longest retry horizon (a message's
//! retry copies come back up to the sum of its delays later) *plus* the window in
//! which a dead letter may be replayed (a `conflict` dead letter replayed after its
//! key's row is gone would apply a second payment). [`Retention::check`] refuses a
//! shorter one, and [`sweep`] takes only what that check let through
//! ([`CheckedRetention`]): there is no way to sweep with a retention `build` would
//! refuse.
//!
//! One sweeper at a time: each batch runs in a transaction that first takes
//! `pg_try_advisory_xact_lock(`[`GC_LOCK`]`)` — transaction-scoped, so it can never
//! stay behind on a pooled connection (a session lock would). A sweeper that does
//! not get it stops: another is sweeping.

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};

use crate::base::observe::Sweep;
use crate::base::retry::RetryPolicy;
use crate::base::BoxFuture;
use crate::error::Error;

/// The advisory lock key a sweep holds per batch (the bytes spell `idemq_gc`).
pub const GC_LOCK: i64 = 0x6964_656d_715f_6763;

/// How long dedup rows are kept, and how the sweep runs.
///
/// ```
/// use std::time::Duration;
/// use idemq::store::Retention;
/// use idemq::RetryPolicy;
///
/// let retention = Retention::keep(Duration::from_secs(30 * 86_400)).replay_window(Duration::from_secs(7 * 86_400));
/// assert!(retention.check([&RetryPolicy::default()]).is_ok());
/// // Not longer than the retry horizon plus the (default, 7 day) replay window: refused.
/// assert!(Retention::keep(Duration::from_secs(86_400)).check([&RetryPolicy::default()]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Retention {
    keep: Duration,
    replay_window: Duration,
    batch: i64,
    every: Duration,
}

impl Retention {
    /// Keep dedup rows for `keep` (at least the retry horizon plus the replay window:
    /// see [`Retention::check`]). The replay window defaults to 7 days; the sweep runs
    /// every hour (in a runtime), deleting 5,000 rows per transaction.
    pub fn keep(keep: Duration) -> Self {
        Self {
            keep,
            replay_window: Duration::from_secs(7 * 86_400),
            batch: 5_000,
            every: Duration::from_secs(3600),
        }
    }

    /// How long after a message was dead-lettered it may still be replayed from the
    /// DLQ (default 7 days). Replaying one older than that can apply it twice.
    pub fn replay_window(mut self, window: Duration) -> Self {
        self.replay_window = window;
        self
    }

    /// Rows deleted per transaction (default 5,000; at least 1).
    pub fn batch(mut self, rows: usize) -> Self {
        self.batch = i64::try_from(rows.max(1)).unwrap_or(i64::MAX);
        self
    }

    /// How often a runtime sweeps (default 1 h).
    pub fn every(mut self, interval: Duration) -> Self {
        self.every = interval.max(Duration::from_secs(1));
        self
    }

    /// The retention.
    pub fn kept(&self) -> Duration {
        self.keep
    }

    pub(crate) fn interval(&self) -> Duration {
        self.every
    }

    /// Refuses a retention no longer than the longest retry horizon of `policies`
    /// plus the replay window; what it lets through is what [`sweep`] takes. Give it
    /// the retry policy of every consumer whose dedup rows the sweep deletes (the
    /// effective ones: a handler's `retry(..)` or `consume_with`'s policy where given,
    /// else the runtime's): [`RuntimeBuilder::build`](crate::RuntimeBuilder::build)
    /// runs this same check with them, so both refuse the same retentions with the
    /// same error.
    ///
    /// # Errors
    /// [`Error::Config`] saying which lower bound and why.
    pub fn check<'a>(
        &self,
        policies: impl IntoIterator<Item = &'a RetryPolicy>,
    ) -> Result<CheckedRetention, Error> {
        let horizon = policies.into_iter().map(RetryPolicy::horizon).max().unwrap_or_default();
        let floor = horizon + self.replay_window;
        if self.keep <= floor {
            let show =
                |d: Duration| crate::base::duration::human(Duration::from_secs(d.as_secs())).to_string();
            return Err(Error::Config(format!(
                "a retention of {} is too short: a copy of a message can still arrive {} after its first \
                 delivery (the longest retry horizon) and a dead letter may be replayed for {} (the replay \
                 window), so rows deleted sooner would let a late copy apply twice; keep rows longer than {}, or \
                 shorten the replay window",
                show(self.keep),
                show(horizon),
                show(self.replay_window),
                show(floor + Duration::from_secs(1)),
            )));
        }
        Ok(CheckedRetention { retention: *self })
    }
}

/// A [`Retention`] that passed [`Retention::check`]: longer than the retry horizon
/// plus the replay window it was checked against. Only the check makes one, and
/// [`sweep`] takes nothing else.
///
/// ```compile_fail,E0308
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) {
/// use std::time::Duration;
/// // An unchecked retention does not compile: `sweep` takes a `CheckedRetention`.
/// idemq::store::sweep(conn, &idemq::store::Retention::keep(Duration::from_secs(1))).await;
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedRetention {
    retention: Retention,
}

impl CheckedRetention {
    /// The retention that was checked.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }
}

/// Deletes what is older than `retention` on `conn`, batch by batch, until nothing
/// is left or another sweeper takes over. It takes only a [`CheckedRetention`]:
/// [`Retention::check`] it against the consumers' retry policies first, the check
/// [`RuntimeBuilder::build`](crate::RuntimeBuilder::build) and the CLI's `gc` make,
/// so no sweep deletes the rows that late copies still need.
///
/// ```no_run
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idemq::store::Retention;
/// use idemq::RetryPolicy;
///
/// // The consumers' retry policies (here: every one on the default).
/// let retention = Retention::keep(Duration::from_secs(30 * 86_400)).check([&RetryPolicy::default()])?;
/// let swept = idemq::store::sweep(conn, &retention).await?;
/// println!("{} dedup rows deleted", swept.dedup_rows);
/// # Ok(())
/// # }
/// ```
///
/// # Cancel safety
/// Each batch is its own transaction: a sweep dropped half-way keeps what it deleted
/// in the batches before (dropping one mid-batch leaves that transaction open on
/// `conn`: drop the connection too).
///
/// # Errors
/// The database's.
pub fn sweep<'a>(
    conn: &'a mut AsyncPgConnection,
    retention: &'a CheckedRetention,
) -> BoxFuture<'a, diesel::QueryResult<Sweep>> {
    Box::pin(sweep_now(conn, retention))
}

async fn sweep_now(conn: &mut AsyncPgConnection, retention: &CheckedRetention) -> diesel::QueryResult<Sweep> {
    let retention = &retention.retention;
    let mut total = Sweep::default();
    let keep_ms = i64::try_from(retention.keep.as_millis()).unwrap_or(i64::MAX);
    for table in [Table::Dedup, Table::Copies, Table::Starts, Table::Sagas] {
        loop {
            let batch = retention.batch;
            let deleted = conn
                .transaction::<Option<u64>, diesel::result::Error, _>(async |conn| {
                    if !crate::store::db::try_gc_lock(conn, GC_LOCK).await? {
                        return Ok(None);
                    }
                    table.delete(conn, keep_ms, batch).await.map(Some)
                })
                .await?;
            let Some(deleted) = deleted else {
                total.yielded = true;
                return Ok(total);
            };
            *table.counter(&mut total) += deleted;
            if deleted < u64::try_from(batch).unwrap_or(u64::MAX) {
                break;
            }
        }
    }
    Ok(total)
}

#[derive(Debug, Clone, Copy)]
enum Table {
    Dedup,
    Copies,
    Starts,
    /// Finished sagas past their `keep_finished`.
    Sagas,
}

impl Table {
    /// Deletes at most `batch` of the oldest rows past the retention, `keep_ms` old; a
    /// finished saga by its own expiry (its saga's `keep_finished`) instead.
    async fn delete(
        self,
        conn: &mut AsyncPgConnection,
        keep_ms: i64,
        batch: i64,
    ) -> diesel::QueryResult<u64> {
        let sql = match self {
            Self::Dedup => {
                "DELETE FROM idemq_dedup WHERE ctid = ANY(ARRAY(SELECT ctid FROM idemq_dedup \
                 WHERE processed_at < now() - $1 * interval '1 millisecond' LIMIT $2))"
            }
            Self::Copies => {
                "DELETE FROM idemq_copies WHERE ctid = ANY(ARRAY(SELECT ctid FROM idemq_copies \
                 WHERE copied_at < now() - $1 * interval '1 millisecond' LIMIT $2))"
            }
            Self::Starts => {
                "DELETE FROM idemq_started WHERE ctid = ANY(ARRAY(SELECT ctid FROM idemq_started \
                 WHERE last_started_at < now() - $1 * interval '1 millisecond' LIMIT $2))"
            }
            Self::Sagas => return crate::store::db::delete_expired_sagas(conn, batch).await,
        };
        crate::store::db::delete_older(conn, sql, keep_ms, batch).await
    }

    fn counter(self, sweep: &mut Sweep) -> &mut u64 {
        match self {
            Self::Dedup => &mut sweep.dedup_rows,
            Self::Copies => &mut sweep.copy_records,
            Self::Starts => &mut sweep.start_marks,
            Self::Sagas => &mut sweep.finished_sagas,
        }
    }
}
