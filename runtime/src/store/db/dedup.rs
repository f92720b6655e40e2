//! The dedup rows: BEGIN with the batch's claim (one round trip), the rows that
//! exist, the results and permanent failures stored with them, and forgetting one.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Nullable, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager,
};

use crate::store::schema::idemq_dedup;

diesel::define_sql_function! {
    /// The current top-level transaction's id (assigning one if it has none yet).
    fn txid_current() -> diesel::sql_types::BigInt;
}

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
    /// The rows applied before, read by the same statement, by key. A key neither
    /// inserted nor here was committed by another transaction while the insert
    /// waited for it (after the statement's snapshot), or was claimed alone (a plain
    /// insert, which reads nothing): read it with [`stored_rows`].
    pub(crate) stored: HashMap<String, Stored>,
}

/// One row of [`CLAIM`]: a key this transaction inserted (`xid` set) or a row that
/// was there before it.
#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    xid: Option<i64>,
    #[diesel(sql_type = Nullable<Bytea>)]
    fingerprint: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Bytea>)]
    result: Option<Vec<u8>>,
    #[diesel(sql_type = Bool)]
    failed: bool,
}

/// The claim, one statement for any number of keys (they go as two array
/// parameters: no limit of bind parameters to mind, one cached statement): the
/// rows inserted where absent, in the arrays' order, with the transaction's id
/// (`txid_current()`), and, from the statement's snapshot, the rows that were
/// there before — so a duplicate costs no read of its own. (A data-modifying
/// `WITH` runs to completion once; its rows are not visible to the statement's own
/// read, which therefore returns only the rows applied before.)
const CLAIM: &str = "WITH new AS (\
     INSERT INTO idemq_dedup (handler, key, fingerprint) \
     SELECT $1, k, f FROM unnest($2::text[], $3::bytea[]) AS u(k, f) \
     ON CONFLICT DO NOTHING RETURNING key) \
     SELECT key, txid_current() AS xid, NULL::bytea AS fingerprint, NULL::bytea AS result, false AS failed \
     FROM new \
     UNION ALL \
     SELECT key, NULL, fingerprint, result, failed FROM idemq_dedup WHERE handler = $1 AND key = ANY($2)";

/// BEGIN, then the claim of `rows` (key, fingerprint; keys distinct; [`CLAIM`],
/// or for one row a plain insert),
/// then — for a batch of several — the batch's limit on lock waits
/// ([`BATCH_LOCK_TIMEOUT`], for the statements after the insert: the handlers') —
/// pipelined, one round trip for all. Rows are inserted in key order: two batches
/// sharing keys take their index locks in the same order and cannot deadlock on
/// them.
///
/// On an error the transaction may be open: roll back (diesel counts it as open
/// from the start, so a connection dropped half-way is never returned to the pool
/// as clean).
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
    let keys: Vec<&str> = sorted.iter().map(|(key, _)| *key).collect();
    let fingerprints: Vec<&[u8]> = sorted.iter().map(|(_, fingerprint)| *fingerprint).collect();
    // All through shared references, polled together: tokio-postgres sends them
    // back to back in this order, and the server runs them in order. (On a
    // connection's first claim the statement is prepared first, a round trip, and
    // the limit overtakes it: that once, the claim itself waits at most the batch's
    // limit, and a batch refused for it runs in halves.)
    let (mut first, mut second, mut third) = (&*conn, &*conn, &*conn);
    let began = first.batch_execute("BEGIN");
    let claim = async {
        if let [(key, fingerprint)] = sorted.as_slice() {
            // One row (per-message mode's hot path): a plain single-row insert, ~10%
            // cheaper for the server than [`CLAIM`] (pgbench, BEGIN + claim +
            // ROLLBACK); a duplicate's row is then read by a statement of its own.
            let inserted = diesel::insert_into(idemq_dedup::table)
                .values((
                    idemq_dedup::handler.eq(scope),
                    idemq_dedup::key.eq(*key),
                    idemq_dedup::fingerprint.eq(*fingerprint),
                ))
                .on_conflict_do_nothing()
                .returning((idemq_dedup::key, txid_current()))
                .get_results::<(String, i64)>(&mut second)
                .await?;
            Ok(inserted
                .into_iter()
                .map(|(key, xid)| ClaimRow {
                    key,
                    xid: Some(xid),
                    fingerprint: None,
                    result: None,
                    failed: false,
                })
                .collect())
        } else {
            diesel::sql_query(CLAIM)
                .bind::<Text, _>(scope)
                .bind::<Array<Text>, _>(&keys)
                .bind::<Array<Bytea>, _>(&fingerprints)
                .load::<ClaimRow>(&mut second)
                .await
        }
    };
    let limited = limit_lock_waits(&mut third, sorted.len());
    let (began, claimed, limited) = futures_util::join!(began, claim, limited);
    // After a failed insert the limit fails too (the transaction is aborted): the
    // insert's error is the one to report.
    let claimed = claimed.and_then(|claimed| limited.map(|()| claimed));
    let mut claim = Claim { xid: None, inserted: HashSet::new(), stored: HashMap::new() };
    match (began, claimed) {
        (Ok(()), Ok(rows)) => {
            for ClaimRow { key, xid, fingerprint, result, failed } in rows {
                match xid {
                    Some(xid) => {
                        claim.xid = Some(xid);
                        claim.inserted.insert(key);
                    }
                    None => {
                        claim.stored.insert(key, Stored { fingerprint, result, failed });
                    }
                }
            }
            Ok(claim)
        }
        (Ok(()), Err(err)) => Err(err),
        (Err(err), Ok(rows)) if rows.iter().any(|row| row.xid.is_some()) => {
            // BEGIN failed yet the insert ran, on its own, and committed: a dedup row
            // without its effect would turn the message into a duplicate. (Not seen:
            // a BEGIN fails only with the connection, which fails the insert too.)
            let keys: Vec<String> =
                rows.into_iter().filter(|row| row.xid.is_some()).map(|row| row.key).collect();
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
    let (mut first, mut second, mut third) = (&*conn, &*conn, &*conn);
    let began = first.batch_execute("BEGIN");
    let xid = diesel::select(txid_current()).get_result::<i64>(&mut second);
    let limited = limit_lock_waits(&mut third, keys.len());
    let (began, xid, limited) = futures_util::join!(began, xid, limited);
    began?;
    let xid = xid?;
    limited?;
    Ok(Claim {
        xid: Some(xid),
        inserted: keys.iter().map(|key| (*key).to_owned()).collect(),
        stored: HashMap::new(),
    })
}

/// Makes the open transaction wait at most [`BATCH_LOCK_TIMEOUT`] for a lock when
/// it holds `deliveries` > 1 (one running alone keeps the session's limit, and only
/// its failures are charged as attempts); sent in the pipeline after BEGIN and the
/// claim, it costs no round trip of its own.
async fn limit_lock_waits(conn: &mut &AsyncPgConnection, deliveries: usize) -> QueryResult<()> {
    if deliveries > 1 {
        conn.batch_execute(&format!("SET LOCAL lock_timeout = {}", BATCH_LOCK_TIMEOUT.as_millis())).await
    } else {
        Ok(())
    }
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
