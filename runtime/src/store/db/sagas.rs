//! The saga table's statements: a transition's lock (with the placeholder row a
//! starting message inserts), its write, and the figures `status` shows.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

/// A saga's row, locked for the transaction.
#[derive(Debug, QueryableByName)]
pub(crate) struct SagaRow {
    /// The state as JSON text; `null` in a row this transaction just inserted.
    #[diesel(sql_type = Text)]
    pub(crate) state: String,
    /// Transitions so far: 0 in a row this transaction just inserted.
    #[diesel(sql_type = BigInt)]
    pub(crate) version: i64,
    #[diesel(sql_type = Array<Text>)]
    pub(crate) timeouts: Vec<String>,
    #[diesel(sql_type = Bool)]
    pub(crate) finished: bool,
}

/// Locks the row of saga `name` with `key` and reads it, waiting for a transaction
/// that holds it: `SELECT … FOR UPDATE`; with `start`, one round trip that inserts an
/// empty row if there is none or else locks the one there (`INSERT … ON CONFLICT DO
/// UPDATE`, a no-op update that takes the row lock): two starting messages racing are
/// settled by the primary key — the second waits for the first's COMMIT and then
/// locks its row.
pub(crate) async fn lock_saga(
    conn: &mut AsyncPgConnection,
    name: &str,
    key: &str,
    start: bool,
) -> QueryResult<Option<SagaRow>> {
    let sql = if start {
        "INSERT INTO idemq_saga AS s (saga, key, state, version) VALUES ($1, $2, 'null', 0) \
         ON CONFLICT (saga, key) DO UPDATE SET version = s.version \
         RETURNING state::text AS state, version, timeouts, finished_at IS NOT NULL AS finished"
    } else {
        "SELECT state::text AS state, version, timeouts, finished_at IS NOT NULL AS finished \
         FROM idemq_saga WHERE saga = $1 AND key = $2 FOR UPDATE"
    };
    diesel::sql_query(sql).bind::<Text, _>(name).bind::<Text, _>(key).get_result(conn).await.optional()
}

/// What a transition leaves of a saga.
pub(crate) enum SagaWrite<'a> {
    /// Still running: the new state and the timeouts it waits for.
    Running { state: &'a str, timeouts: &'a [String] },
    /// Finished, kept `keep` with its last state; its timeouts cancelled.
    Finished { state: &'a str, keep: Duration, timeouts: Vec<String> },
}

/// Writes a transition of the locked row, in the caller's transaction. A finished
/// saga kept for no time is deleted; its scheduled timeouts still waiting in the
/// outbox are deleted with it (never published): how many were, returned.
pub(crate) async fn write_saga(
    conn: &mut AsyncPgConnection,
    name: &str,
    key: &str,
    write: SagaWrite<'_>,
) -> QueryResult<usize> {
    let mut cancelled = 0;
    match write {
        SagaWrite::Running { state, timeouts } => {
            diesel::sql_query(
                "UPDATE idemq_saga SET state = $3::jsonb, version = version + 1, timeouts = $4, updated_at = now() \
                 WHERE saga = $1 AND key = $2",
            )
            .bind::<Text, _>(name)
            .bind::<Text, _>(key)
            .bind::<Text, _>(state)
            .bind::<Array<Text>, _>(timeouts)
            .execute(conn)
            .await?;
        }
        SagaWrite::Finished { state, keep, timeouts } => {
            if !timeouts.is_empty() {
                cancelled = diesel::sql_query("DELETE FROM idemq_outbox WHERE message_id = ANY($1)")
                    .bind::<Array<Text>, _>(&timeouts)
                    .execute(conn)
                    .await?;
            }
            if keep.is_zero() {
                diesel::sql_query("DELETE FROM idemq_saga WHERE saga = $1 AND key = $2")
                    .bind::<Text, _>(name)
                    .bind::<Text, _>(key)
                    .execute(conn)
                    .await?;
            } else {
                let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX).min(MAX_KEEP_MS);
                diesel::sql_query(
                    "UPDATE idemq_saga SET state = $3::jsonb, version = version + 1, timeouts = '{}', \
                     updated_at = now(), finished_at = now(), expires_at = now() + $4 * interval '1 millisecond' \
                     WHERE saga = $1 AND key = $2",
                )
                .bind::<Text, _>(name)
                .bind::<Text, _>(key)
                .bind::<Text, _>(state)
                .bind::<BigInt, _>(keep_ms)
                .execute(conn)
                .await?;
            }
        }
    }
    Ok(cancelled)
}

/// The longest a finished saga is kept (100 years, in ms): what a timestamp can
/// be moved by.
const MAX_KEEP_MS: i64 = 100 * 365 * 86_400 * 1000;

/// Deletes finished sagas past their retention, at most `batch` (the retention
/// sweep's, under its lock).
pub(crate) async fn delete_expired_sagas(conn: &mut AsyncPgConnection, batch: i64) -> QueryResult<u64> {
    let deleted = diesel::sql_query(
        "DELETE FROM idemq_saga WHERE ctid = ANY(ARRAY(SELECT ctid FROM idemq_saga \
         WHERE expires_at < now() LIMIT $1))",
    )
    .bind::<BigInt, _>(batch)
    .execute(conn)
    .await?;
    Ok(deleted as u64)
}

/// Sagas by name, as `status` shows them.
#[derive(Debug, Clone, QueryableByName)]
pub struct SagaCount {
    /// The saga's name.
    #[diesel(sql_type = Text)]
    pub saga: String,
    /// Running (not finished).
    #[diesel(sql_type = BigInt)]
    pub running: i64,
    /// Finished, kept for their retention.
    #[diesel(sql_type = BigInt)]
    pub finished: i64,
    /// How long the oldest running one has run, in whole seconds.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub oldest_seconds: Option<i64>,
}

/// Running and finished sagas by name, and the oldest running one's age.
///
/// # Errors
/// The database's.
pub async fn count_sagas(conn: &mut AsyncPgConnection) -> QueryResult<Vec<SagaCount>> {
    diesel::sql_query(
        "SELECT saga, count(*) FILTER (WHERE finished_at IS NULL) AS running, \
         count(*) FILTER (WHERE finished_at IS NOT NULL) AS finished, \
         floor(extract(epoch FROM now() - min(started_at) FILTER (WHERE finished_at IS NULL)))::bigint \
         AS oldest_seconds FROM idemq_saga GROUP BY saga ORDER BY saga",
    )
    .load(conn)
    .await
}

/// One saga as `saga show` prints it.
#[derive(Debug, Clone, QueryableByName)]
pub struct SagaShown {
    /// The state, pretty-printed JSON.
    #[diesel(sql_type = Text)]
    pub state: String,
    /// Transitions so far.
    #[diesel(sql_type = BigInt)]
    pub version: i64,
    /// The message ids of the timeouts it waits for.
    #[diesel(sql_type = Array<Text>)]
    pub timeouts: Vec<String>,
    /// When it started, updated, finished and will be deleted (RFC 3339, UTC).
    #[diesel(sql_type = Text)]
    pub started_at: String,
    #[diesel(sql_type = Text)]
    #[allow(missing_docs)]
    pub updated_at: String,
    #[diesel(sql_type = Nullable<Text>)]
    #[allow(missing_docs)]
    pub finished_at: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    #[allow(missing_docs)]
    pub expires_at: Option<String>,
}

/// The saga `name` with `key`, if there is one.
///
/// # Errors
/// The database's.
pub async fn show_saga(
    conn: &mut AsyncPgConnection,
    name: &str,
    key: &str,
) -> QueryResult<Option<SagaShown>> {
    const UTC: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'";
    diesel::sql_query(format!(
        "SELECT jsonb_pretty(state) AS state, version, timeouts, \
         to_char(started_at AT TIME ZONE 'UTC', {UTC}) AS started_at, \
         to_char(updated_at AT TIME ZONE 'UTC', {UTC}) AS updated_at, \
         to_char(finished_at AT TIME ZONE 'UTC', {UTC}) AS finished_at, \
         to_char(expires_at AT TIME ZONE 'UTC', {UTC}) AS expires_at \
         FROM idemq_saga WHERE saga = $1 AND key = $2"
    ))
    .bind::<Text, _>(name)
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .optional()
}
