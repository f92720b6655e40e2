//! idemq's own statements: the dedup row, the checked COMMIT, start marks, copy
//! records, the schema check and the pool's session settings. One place for every
//! table idemq owns and for how its errors are read.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Nullable, Text};
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager,
};
use futures_util::FutureExt;

use crate::base::outgoing::Outgoing;
use crate::store::schema::{idemq_copies, idemq_dedup, idemq_outbox, idemq_started};

/// The `LISTEN`/`NOTIFY` channel relays wake on.
pub(crate) const CHANNEL: &str = "idemq_outbox";

diesel::define_sql_function! {
    /// The current top-level transaction's id (assigning one if it has none yet).
    fn txid_current() -> diesel::sql_types::BigInt;
}

/// Prepared on every pooled connection (see [`SessionLimits::setup_sql`]), so the
/// check below is planned once per connection, not once per COMMIT.
const PREPARE_CHECK: &str = "PREPARE idemq_check(bigint) AS \
     SELECT CASE WHEN txid_current_if_assigned() = $1 THEN 0 \
     ELSE ('idemq_transaction_ended' || coalesce(txid_current_if_assigned()::text, ''))::int END";

/// The check sent with COMMIT, as one simple-query message, so it costs the same
/// round trip as `COMMIT` alone. PostgreSQL runs the statements in order and stops
/// at the first error:
/// - a transaction aborted by a failed statement (whose error the handler ignored)
///   fails the check (25P02) and COMMIT is never sent — without the check, COMMIT
///   would answer `ROLLBACK` and no error, and the delivery would be acked;
/// - if the transaction is no longer the one that wrote the dedup row (its id, `xid`,
///   was returned by the insert) — the handler ran its own COMMIT or ROLLBACK, and
///   maybe began another — the check fails with [`ENDED_MARKER`] in the message
///   (the `ELSE` is evaluated only then: the function is not constant);
/// - otherwise COMMIT runs, and any error it answers is the server's refusal.
fn checked_commit(xid: i64) -> String {
    format!("EXECUTE idemq_check({xid}); COMMIT")
}

/// What the cast error of [`checked_commit`] quotes, whatever the server's language.
const ENDED_MARKER: &str = "idemq_transaction_ended";

/// How long a statement in a batch of several deliveries may wait for a lock. Far
/// below PostgreSQL's `deadlock_timeout` (1 s): two batches that lock the same rows
/// in different orders fail fast, and the runtime re-runs them smaller (a delivery
/// run alone waits with the session's full `lock_timeout`).
pub(crate) const BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// What a transaction's dedup insert found.
#[derive(Debug)]
pub(crate) struct Claim {
    /// The transaction's id if it inserted any row, for [`commit_checked`].
    pub(crate) xid: Option<i64>,
    /// The keys whose rows it inserted: those messages are new. The others were
    /// applied before (their rows are committed).
    pub(crate) inserted: HashSet<String>,
}

diesel::define_sql_function! {
    /// `unnest(text[])`: one row per key.
    #[sql_name = "unnest"]
    fn unnest_text(array: Array<Text>) -> Text;
}

diesel::define_sql_function! {
    /// `unnest(bytea[])`: one row per fingerprint.
    #[sql_name = "unnest"]
    fn unnest_bytea(array: Array<Bytea>) -> Bytea;
}

/// BEGIN, then the dedup rows of `rows` (key, fingerprint; keys distinct) inserted
/// where absent — pipelined, one round trip for both, one statement for the whole
/// batch (its keys and fingerprints go as two array parameters, so there is no limit
/// of bind parameters to mind). Rows are inserted in key order: two batches sharing
/// keys take their index locks in the same order and cannot deadlock on them.
///
/// `RETURNING` says which keys were inserted (matched by key: its order is not
/// guaranteed). On an error the transaction may be open: roll back (diesel counts it
/// as open from the start, so a connection dropped half-way is never returned to the
/// pool as clean).
pub(crate) async fn begin_and_claim(
    conn: &mut AsyncPgConnection,
    scope: &str,
    rows: &[(&str, &[u8])],
) -> QueryResult<Claim> {
    use diesel::connection::TransactionDepthChange;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::IncreaseDepth)?;
    let mut sorted = rows.to_vec();
    sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
    // Both through shared references, polled together: tokio-postgres sends them
    // back to back in this order, and the server runs them in order.
    let (mut first, mut second) = (&*conn, &*conn);
    let began = first.batch_execute("BEGIN");
    // `txid_current()` is evaluated per inserted row. (Function calls, not SQL
    // literals: a literal would make diesel prepare the statement anew every time.)
    let (began, inserted) = if let [(key, fingerprint)] = sorted.as_slice() {
        // One row: a plain single-row insert (per-message mode's hot path).
        let insert = diesel::insert_into(idemq_dedup::table)
            .values((
                idemq_dedup::handler.eq(scope),
                idemq_dedup::key.eq(*key),
                idemq_dedup::fingerprint.eq(*fingerprint),
            ))
            .on_conflict_do_nothing()
            .returning((idemq_dedup::key, txid_current()))
            .get_results::<(String, i64)>(&mut second);
        futures_util::join!(began, insert)
    } else {
        let keys: Vec<&str> = sorted.iter().map(|(key, _)| *key).collect();
        let fingerprints: Vec<&[u8]> = sorted.iter().map(|(_, fingerprint)| *fingerprint).collect();
        let insert = diesel::insert_into(idemq_dedup::table)
            .values(diesel::select((
                scope.into_sql::<Text>(),
                unnest_text(keys),
                unnest_bytea(fingerprints).nullable(),
            )))
            .into_columns((idemq_dedup::handler, idemq_dedup::key, idemq_dedup::fingerprint))
            .on_conflict_do_nothing()
            .returning((idemq_dedup::key, txid_current()))
            .get_results::<(String, i64)>(&mut second);
        futures_util::join!(began, insert)
    };
    match (began, inserted) {
        (Ok(()), Ok(inserted)) => Ok(Claim {
            xid: <[_]>::first(&inserted).map(|(_, xid)| *xid),
            inserted: inserted.into_iter().map(|(key, _)| key).collect(),
        }),
        (Ok(()), Err(err)) => Err(err),
        (Err(err), Ok(inserted)) if !inserted.is_empty() => {
            // BEGIN failed yet the insert ran, on its own, and committed: a dedup row
            // without its effect would turn the message into a duplicate. (Not seen:
            // a BEGIN fails only with the connection, which fails the insert too.)
            let keys: Vec<String> = inserted.into_iter().map(|(key, _)| key).collect();
            tracing::error!(error = %err, scope, ?keys, "BEGIN failed but the dedup insert committed; deleting the rows");
            diesel::delete(
                idemq_dedup::table
                    .filter(idemq_dedup::handler.eq(scope))
                    .filter(idemq_dedup::key.eq_any(&keys)),
            )
            .execute(conn)
            .await?;
            Err(err)
        }
        (Err(err), _) => Err(err),
    }
}

/// BEGIN and the new transaction's id (pipelined, one round trip), for a handler
/// without dedup rows (`dedup = false`): every delivery of `keys` is new.
pub(crate) async fn begin_without_claim(conn: &mut AsyncPgConnection, keys: &[&str]) -> QueryResult<Claim> {
    use diesel::connection::TransactionDepthChange;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::IncreaseDepth)?;
    let (mut first, mut second) = (&*conn, &*conn);
    let began = first.batch_execute("BEGIN");
    let xid = diesel::select(txid_current()).get_result::<i64>(&mut second);
    let (began, xid) = futures_util::join!(began, xid);
    began?;
    Ok(Claim { xid: Some(xid?), inserted: keys.iter().map(|key| (*key).to_owned()).collect() })
}

/// Makes the open transaction wait at most [`BATCH_LOCK_TIMEOUT`] for a lock: for a
/// transaction that runs several handlers (one running alone keeps the session's
/// limit, and only its failures are charged as attempts).
pub(crate) async fn limit_batch_lock_waits(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute(&format!("SET LOCAL lock_timeout = {}", BATCH_LOCK_TIMEOUT.as_millis())).await
}

/// What an existing dedup row holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    /// The applied payload's fingerprint (`None`: stored without one).
    pub(crate) fingerprint: Option<Vec<u8>>,
    /// What the handler returned, or a failed request's error reply.
    pub(crate) result: Option<Vec<u8>>,
    /// The row records a request's permanent failure.
    pub(crate) failed: bool,
}

/// The existing dedup rows of `keys`, by key (a key without a row is absent).
pub(crate) async fn stored_rows(
    conn: &mut AsyncPgConnection,
    scope: &str,
    keys: &[&str],
) -> QueryResult<HashMap<String, Stored>> {
    // `key = ANY($2)`: one cached statement for any number of keys, on the primary key.
    #[derive(Queryable)]
    struct Row {
        key: String,
        fingerprint: Option<Vec<u8>>,
        result: Option<Vec<u8>>,
        failed: bool,
    }
    let rows: Vec<Row> = idemq_dedup::table
        .filter(idemq_dedup::handler.eq(scope))
        .filter(idemq_dedup::key.eq_any(keys))
        .select((idemq_dedup::key, idemq_dedup::fingerprint, idemq_dedup::result, idemq_dedup::failed))
        .load(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|Row { key, fingerprint, result, failed }| (key, Stored { fingerprint, result, failed }))
        .collect())
}

/// Stores what the handlers of a batch returned with their (just inserted) dedup
/// rows: one statement for the batch.
pub(crate) async fn store_results(
    conn: &mut AsyncPgConnection,
    scope: &str,
    results: &[(&str, &[u8])],
) -> QueryResult<()> {
    if results.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = results.iter().map(|(key, _)| *key).collect();
    let values: Vec<&[u8]> = results.iter().map(|(_, value)| *value).collect();
    diesel::sql_query(
        "UPDATE idemq_dedup AS d SET result = u.result \
         FROM unnest($2::text[], $3::bytea[]) AS u(key, result) \
         WHERE d.handler = $1 AND d.key = u.key",
    )
    .bind::<Text, _>(scope)
    .bind::<Array<Text>, _>(keys)
    .bind::<Array<Bytea>, _>(values)
    .execute(conn)
    .await
    .map(drop)
}

/// Records a request's permanent failure as its dedup row (holding the error
/// reply), in the caller's transaction. Returns whether the row was new.
pub(crate) async fn store_failure(
    conn: &mut AsyncPgConnection,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    reply: &[u8],
) -> QueryResult<bool> {
    let inserted = diesel::insert_into(idemq_dedup::table)
        .values((
            idemq_dedup::handler.eq(scope),
            idemq_dedup::key.eq(key),
            idemq_dedup::fingerprint.eq(fingerprint),
            idemq_dedup::result.eq(reply),
            idemq_dedup::failed.eq(true),
        ))
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    Ok(inserted == 1)
}

/// Deletes one dedup row.
pub(crate) async fn forget(conn: &mut AsyncPgConnection, scope: &str, key: &str) -> QueryResult<bool> {
    let deleted = diesel::delete(idemq_dedup::table.find((scope, key))).execute(conn).await?;
    Ok(deleted == 1)
}

/// Writes outbox rows (each with its message id set) in the caller's transaction:
/// one statement for any number (every column an array parameter).
pub(crate) async fn insert_outbox(conn: &mut AsyncPgConnection, rows: &[Outgoing]) -> QueryResult<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|row| row.message_id.as_deref().unwrap_or_default()).collect();
    let exchanges: Vec<&str> = rows.iter().map(|row| row.exchange.as_str()).collect();
    let routing_keys: Vec<&str> = rows.iter().map(|row| row.routing_key.as_str()).collect();
    let bodies: Vec<&[u8]> = rows.iter().map(|row| row.body.as_slice()).collect();
    let content_types: Vec<Option<&str>> = rows.iter().map(|row| row.content_type.as_deref()).collect();
    let correlation_ids: Vec<Option<&str>> = rows.iter().map(|row| row.correlation_id.as_deref()).collect();
    let headers: Vec<Option<String>> = rows
        .iter()
        .map(|row| (!row.headers.is_empty()).then(|| serde_json::to_string(&row.headers).unwrap_or_default()))
        .collect();
    let mandatory: Vec<bool> = rows.iter().map(|row| row.mandatory).collect();
    let replies: Vec<bool> = rows.iter().map(|row| row.reply.is_some()).collect();
    // A reply's own window, from now (the transaction's start: about when its request
    // was consumed); NULL for events and for requests without an `expiration`.
    let windows: Vec<Option<i64>> = rows
        .iter()
        .map(|row| row.reply.and_then(|reply| reply.within).map(|within| millis(within, MAX_WINDOW)))
        .collect();
    diesel::sql_query(
        "INSERT INTO idemq_outbox \
         (message_id, exchange, routing_key, body, content_type, correlation_id, headers, mandatory, reply, \
          expires_at) \
         SELECT m, e, r, b, c, k, h, y, p, now() + w * interval '1 millisecond' \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::text[], \
                     $8::bool[], $9::bool[], $10::bigint[]) AS u(m, e, r, b, c, k, h, y, p, w)",
    )
    .bind::<Array<Text>, _>(ids)
    .bind::<Array<Text>, _>(exchanges)
    .bind::<Array<Text>, _>(routing_keys)
    .bind::<Array<Bytea>, _>(bodies)
    .bind::<Array<Nullable<Text>>, _>(content_types)
    .bind::<Array<Nullable<Text>>, _>(correlation_ids)
    .bind::<Array<Nullable<Text>>, _>(headers)
    .bind::<Array<Bool>, _>(mandatory)
    .bind::<Array<Bool>, _>(replies)
    .bind::<Array<Nullable<BigInt>>, _>(windows)
    .execute(conn)
    .await
    .map(drop)
}

/// The longest window a duration is bound as (100 years, in ms): what PostgreSQL's
/// timestamps can be moved by without overflowing (`Duration::MAX` means "never").
const MAX_WINDOW: i64 = 100 * 365 * 86_400 * 1000;

/// `duration` in whole milliseconds, at most `max`.
fn millis(duration: Duration, max: i64) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX).min(max)
}

/// An outbox row as the relay publishes it.
#[derive(Debug, QueryableByName)]
pub(crate) struct OutboxRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) message_id: String,
    #[diesel(sql_type = Text)]
    pub(crate) exchange: String,
    #[diesel(sql_type = Text)]
    pub(crate) routing_key: String,
    #[diesel(sql_type = Bytea)]
    pub(crate) body: Vec<u8>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) content_type: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) correlation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) headers: Option<String>,
    #[diesel(sql_type = Bool)]
    pub(crate) mandatory: bool,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub(crate) attempts: i32,
    /// Why its last publish failed.
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) last_error: Option<String>,
    /// A reply past its expiry: deleted, never published.
    #[diesel(sql_type = Bool)]
    pub(crate) expired: bool,
}

/// When a reply row expires: its request's own deadline or `created_at` plus the
/// reply TTL (`$ttl`, ms), whichever comes first (`least` skips a NULL); NULL for an
/// event, which never expires.
fn reply_expiry(ttl: &str) -> String {
    format!("CASE WHEN reply THEN least(expires_at, created_at + {ttl} * interval '1 millisecond') END")
}

/// Locks up to `limit` rows that are due, oldest first, skipping rows another
/// relay holds (in the caller's transaction: held until it ends). A reply older than
/// `reply_ttl`, or past its request's own deadline, comes back `expired`.
pub(crate) async fn claim_outbox(
    conn: &mut AsyncPgConnection,
    limit: i64,
    reply_ttl: Duration,
) -> QueryResult<Vec<OutboxRow>> {
    diesel::sql_query(format!(
        "SELECT id, message_id, exchange, routing_key, body, content_type, correlation_id, headers, mandatory, \
                attempts, last_error, coalesce({} <= now(), false) AS expired \
         FROM idemq_outbox WHERE available_at <= now() ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        reply_expiry("$2")
    ))
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(millis(reply_ttl, MAX_WINDOW))
    .load(conn)
    .await
}

/// Deletes rows whose messages were published.
pub(crate) async fn delete_outbox(conn: &mut AsyncPgConnection, ids: &[i64]) -> QueryResult<()> {
    if ids.is_empty() {
        return Ok(());
    }
    diesel::delete(idemq_outbox::table.filter(idemq_outbox::id.eq_any(ids))).execute(conn).await.map(drop)
}

/// Puts a row whose publish failed back for later, after `delay` — a reply no later
/// than when it expires (with `reply_ttl`), so it is deleted then, not a backoff later.
pub(crate) async fn postpone_outbox(
    conn: &mut AsyncPgConnection,
    id: i64,
    delay: Duration,
    error: &str,
    reply_ttl: Duration,
) -> QueryResult<()> {
    diesel::sql_query(format!(
        "UPDATE idemq_outbox SET attempts = attempts + 1, \
         available_at = least(now() + $2 * interval '1 millisecond', {}), last_error = $3 WHERE id = $1",
        reply_expiry("$4")
    ))
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(millis(delay, MAX_WINDOW))
    .bind::<Text, _>(error)
    .bind::<BigInt, _>(millis(reply_ttl, MAX_WINDOW))
    .execute(conn)
    .await
    .map(drop)
}

/// Rows waiting in the outbox (due or not).
pub(crate) async fn outbox_backlog(conn: &mut AsyncPgConnection) -> QueryResult<i64> {
    idemq_outbox::table.count().get_result(conn).await
}

/// Takes the sweep's transaction-scoped advisory lock if it is free.
pub(crate) async fn try_gc_lock(conn: &mut AsyncPgConnection, key: i64) -> QueryResult<bool> {
    diesel::select(pg_try_advisory_xact_lock(key)).get_result(conn).await
}

diesel::define_sql_function! {
    /// `pg_try_advisory_xact_lock(bigint)`: held until the transaction ends.
    fn pg_try_advisory_xact_lock(key: BigInt) -> Bool;
}

/// Runs one of the retention's batched deletes (`$1`: age in ms, `$2`: limit).
pub(crate) async fn delete_older(
    conn: &mut AsyncPgConnection,
    sql: &'static str,
    older_than_ms: i64,
    limit: i64,
) -> QueryResult<u64> {
    let deleted = diesel::sql_query(sql)
        .bind::<BigInt, _>(older_than_ms)
        .bind::<BigInt, _>(limit)
        .execute(conn)
        .await?;
    Ok(u64::try_from(deleted).unwrap_or(0))
}

/// The versions of the applied migrations (none before the first).
pub(crate) async fn applied_migrations(conn: &mut AsyncPgConnection) -> QueryResult<Vec<String>> {
    let tracked: bool =
        diesel::select(diesel::dsl::sql::<Bool>("to_regclass('__diesel_schema_migrations') IS NOT NULL"))
            .get_result(conn)
            .await?;
    if !tracked {
        return Ok(Vec::new());
    }
    diesel::dsl::sql::<Text>("SELECT version FROM __diesel_schema_migrations").load(conn).await
}

/// The dedup table's row estimate (the planner's: counting a large table takes
/// long) and the outbox's backlog (counted).
#[cfg(feature = "cli")]
pub(crate) async fn table_sizes(conn: &mut AsyncPgConnection) -> QueryResult<(i64, i64)> {
    let dedup: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
        "COALESCE((SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass('idemq_dedup')), 0)",
    ))
    .get_result(conn)
    .await?;
    Ok((dedup, outbox_backlog(conn).await?))
}

/// Wakes the relays listening on [`CHANNEL`] (outside any transaction).
pub(crate) async fn notify_relays(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute(&format!("NOTIFY {CHANNEL}")).await
}

/// Why the checked COMMIT did not commit.
#[derive(Debug)]
pub(crate) enum CommitFailure {
    /// A statement in the handler failed and its error was ignored: rolled back.
    Aborted,
    /// The handler ended idemq's transaction itself (COMMIT, ROLLBACK): rolled back
    /// whatever it began after.
    Ended,
    /// The server refused the COMMIT (deferred constraint, serialization failure,
    /// deadlock): rolled back. `contention` for the ones worth running again at once.
    Refused { error: DieselError, contention: bool },
    /// The connection failed: the COMMIT may or may not have landed.
    Unknown(DieselError),
    /// The check's prepared statement is gone (the handler ran `DISCARD ALL` or
    /// `DEALLOCATE`): rolled back once the connection, left open in diesel's eyes, is
    /// dropped.
    CheckMissing,
}

/// COMMITs the open top-level transaction `xid`, refusing one that is aborted or is
/// not the one the dedup row was written in (see [`checked_commit`]). On any refusal the
/// transaction is rolled back and the connection stays usable; on
/// [`CommitFailure::Unknown`] it must be dropped.
pub(crate) async fn commit_checked(conn: &mut AsyncPgConnection, xid: i64) -> Result<(), CommitFailure> {
    match conn.batch_execute(&checked_commit(xid)).await {
        Ok(()) => {
            // The COMMIT went out by hand, so diesel's bookkeeping must be told; a
            // connection it believes to be in a transaction is discarded by the pool.
            left_transaction(conn).map_err(CommitFailure::Unknown)?;
            Ok(())
        }
        Err(error) if is_connection_error(&error) => Err(CommitFailure::Unknown(error)),
        Err(DieselError::DatabaseError(_, info)) if info.message().contains("\"idemq_check\"") => {
            Err(CommitFailure::CheckMissing)
        }
        Err(error) => {
            let failure = match &error {
                DieselError::DatabaseError(_, info) if info.message().contains(ENDED_MARKER) => {
                    CommitFailure::Ended
                }
                DieselError::DatabaseError(_, info)
                    if info.message().starts_with("current transaction is aborted") =>
                {
                    CommitFailure::Aborted
                }
                _ => CommitFailure::Refused { contention: is_contention(&error), error },
            };
            // The aborted transaction, or the one the handler began after ending
            // ours, or nothing (COMMIT's failure ended it; ROLLBACK only warns).
            match AnsiTransactionManager::rollback_transaction(conn).await {
                // NotInTransaction: the handler ended it through diesel, which knows.
                Ok(()) | Err(DieselError::NotInTransaction) => Err(failure),
                Err(rollback_error) => Err(CommitFailure::Unknown(rollback_error)),
            }
        }
    }
}

/// Records in diesel's transaction manager that the top-level transaction ended.
fn left_transaction(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    use diesel::connection::TransactionDepthChange;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::DecreaseDepth)
}

/// Counts a handler start of a redelivered message, committed on its own before the
/// handler runs (so it survives the crash it may cause); returns the starts so far,
/// this one included.
pub(crate) async fn mark_start(conn: &mut AsyncPgConnection, scope: &str, key: &str) -> QueryResult<i32> {
    diesel::insert_into(idemq_started::table)
        .values((idemq_started::handler.eq(scope), idemq_started::key.eq(key), idemq_started::starts.eq(1)))
        .on_conflict((idemq_started::handler, idemq_started::key))
        .do_update()
        .set((
            idemq_started::starts.eq(idemq_started::starts + 1),
            idemq_started::last_started_at.eq(diesel::dsl::now),
        ))
        .returning(idemq_started::starts)
        .get_result(conn)
        .await
}

/// Forgets the starts of a message that reached an outcome.
pub(crate) async fn clear_starts(conn: &mut AsyncPgConnection, scope: &str, key: &str) -> QueryResult<()> {
    diesel::delete(idemq_started::table.find((scope, key))).execute(conn).await.map(drop)
}

/// Whether the broker confirmed a copy with this id before.
pub(crate) async fn copy_recorded(conn: &mut AsyncPgConnection, copy_id: &str) -> QueryResult<bool> {
    diesel::select(diesel::dsl::exists(idemq_copies::table.find(copy_id))).get_result(conn).await
}

/// Records a copy the broker confirmed.
pub(crate) async fn record_copy(conn: &mut AsyncPgConnection, copy_id: &str) -> QueryResult<()> {
    diesel::insert_into(idemq_copies::table)
        .values(idemq_copies::copy_id.eq(copy_id))
        .on_conflict_do_nothing()
        .execute(conn)
        .await
        .map(drop)
}

/// The connection failed (closed, could not send): the server's answer is unknown.
pub(crate) fn is_connection_error(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(
            DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
            _
        ) | DieselError::BrokenTransactionManager
    )
}

/// Whether an error's text says the transaction collided with another: a lock wait
/// over `lock_timeout`, a deadlock, a serialization failure. (diesel-async gives no
/// SQLSTATE for most of these; PostgreSQL's English messages are matched.)
pub(crate) fn is_contention_message(message: &str) -> bool {
    ["lock timeout", "deadlock detected", "could not serialize access"].iter().any(|m| message.contains(m))
}

/// A serialization failure or a deadlock: running the transaction again may succeed.
fn is_contention(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        // 40P01 has no kind of its own in diesel-async (it maps to Unknown).
        DieselError::DatabaseError(_, info) => info.message().starts_with("deadlock detected"),
        _ => false,
    }
}

/// Session limits of every pooled connection, so that nothing idemq starts can hold
/// locks for long past the handler timeout, even when its client is gone: a
/// statement, a lock wait and an idle open transaction are each ended by the server.
/// Set, with the COMMIT check's prepared statement, when a connection is made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionLimits {
    pub(crate) statement: Duration,
    pub(crate) idle_in_transaction: Duration,
}

impl SessionLimits {
    /// Derived from the handler timeout: a statement or lock wait may take as long
    /// as the handler may, plus a margin; an open transaction may sit idle a little
    /// longer (the handler may await other things between statements).
    pub(crate) fn for_handler_timeout(handler_timeout: Duration) -> Self {
        Self {
            statement: handler_timeout + Duration::from_secs(10),
            idle_in_transaction: handler_timeout + Duration::from_secs(30),
        }
    }

    /// How long idemq waits on the client for one of its own statements: the
    /// server's `statement_timeout` and a margin. By then the server has answered,
    /// if only with its timeout error; no answer means the network to it is gone.
    pub(crate) fn client_deadline(self) -> Duration {
        self.statement + Duration::from_secs(5)
    }

    /// What every pooled connection runs once: the limits, and the COMMIT check.
    fn setup_sql(self) -> String {
        let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX as u128);
        format!(
            "SET statement_timeout = {}; SET lock_timeout = {}; SET idle_in_transaction_session_timeout = {}; {PREPARE_CHECK}",
            ms(self.statement),
            ms(self.statement),
            ms(self.idle_in_transaction)
        )
    }
}

/// The pool every delivery takes its connection from.
pub(crate) fn build_pool(
    database_url: &str,
    size: usize,
    limits: SessionLimits,
) -> Result<Pool<AsyncPgConnection>, deadpool::managed::BuildError> {
    let mut config = ManagerConfig::default();
    // Broken connections are detected and dropped by the delivery state machine, so
    // the per-checkout `SELECT 1` of `Verified` buys nothing but latency.
    config.recycling_method = RecyclingMethod::Fast;
    let setup_sql = limits.setup_sql();
    config.custom_setup = Box::new(move |url| {
        let setup_sql = setup_sql.clone();
        let url = url.to_owned();
        async move {
            let mut conn = establish(&url).await?;
            conn.batch_execute(&setup_sql)
                .await
                .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        }
        .boxed()
    });
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
}

/// How long a connection may hear nothing from PostgreSQL's host before its first
/// keepalive probe; then one every [`KEEPALIVE_INTERVAL`].
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// The interval between keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection is given up (where `TCP_USER_TIMEOUT`
/// does not decide it first).
const KEEPALIVE_RETRIES: u32 = 4;
/// How long sent data (a request, a probe) may stay unacknowledged before the
/// connection is given up (`TCP_USER_TIMEOUT`, Linux).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects like `AsyncPgConnection::establish`, with TLS as the URL's libpq
/// parameters say (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`: see
/// [`crate::tls::postgres`]) and dead-peer detection on the socket. Every connection
/// idemq makes goes through here: the pools, the relay's `LISTEN`, migrations, the
/// CLI, the test kit.
///
/// A PostgreSQL host that vanishes without a word (a partition, a lost machine, a
/// NAT or firewall that forgot the flow: no FIN, no RST) leaves the socket half-open,
/// and a connection waiting on it — for a COMMIT's answer, for the BEGIN of a
/// pooled connection — waits until TCP notices. Once the request was acknowledged
/// nothing is retransmitted, so only a keepalive can notice, and tokio-postgres's
/// first goes out after 2 h of silence (libpq's default too): the delivery and its
/// slot would be held far past `handler_timeout`, `database_retry_limit` (the
/// statements never fail, so the retry loop never gets control back) and the
/// broker's `consumer_timeout`. With these settings the kernel gives such a
/// connection up about 30 s after the host last answered; the statement waiting on
/// it fails as a lost connection, which the delivery state machine already handles
/// (a fresh connection, the dedup row decides a COMMIT's fate). `keepalives`,
/// `keepalives_idle`, `keepalives_interval`, `keepalives_retries` or
/// `tcp_user_timeout` given in the URL win.
///
/// It does not help when the socket's peer stays up and what is behind it goes
/// silent (a pooler such as PgBouncer, a proxy, a hung server): that peer's kernel
/// answers the probes (`tests/tests/network_faults.rs` stages this with a proxy).
pub(crate) async fn establish(url: &str) -> diesel::ConnectionResult<AsyncPgConnection> {
    connect(url).await.map_err(|err| match err {
        crate::error::Error::DatabaseConnect { message, .. } => {
            diesel::ConnectionError::BadConnection(message)
        }
        other => diesel::ConnectionError::BadConnection(other.to_string()),
    })
}

/// [`establish`] with a typed error: [`Error::Tls`](crate::Error::Tls) and
/// [`Error::Config`](crate::Error::Config) as they are, the driver's error as
/// [`Error::DatabaseConnect`](crate::Error::DatabaseConnect) (the server's message, or
/// the client's error).
pub(crate) async fn connect(url: &str) -> Result<AsyncPgConnection, crate::error::Error> {
    use crate::tls::postgres::ConnectFailure;
    let failed = |message: String| crate::error::Error::DatabaseConnect {
        url: crate::base::redact::redact(url),
        message,
    };
    let (client, connection) = crate::tls::postgres::connect(url, |config| {
        // tokio-postgres's defaults, which the URL did not change.
        if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            config.keepalives_idle(KEEPALIVE_IDLE);
        }
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if config.get_keepalives_retries().is_none() {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
    })
    .await
    .map_err(|failure| match failure {
        ConnectFailure::Refused(err) => err,
        ConnectFailure::Driver(err) => {
            failed(err.as_db_error().map_or_else(|| err.to_string(), |db| db.message().to_owned()))
        }
    })?;
    AsyncPgConnection::try_from_client_and_connection(client, connection)
        .await
        .map_err(|err| failed(err.to_string()))
}
