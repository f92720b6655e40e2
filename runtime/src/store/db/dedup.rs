//! The dedup rows: BEGIN with the batch's claim (one round trip), the rows that
//! exist, the results and permanent failures stored with them, and forgetting one.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Nullable, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager,
};

use super::fixed::Fixed;
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

/// The dedup rows of the keys `$2` (`text[]`) of the scope `$1`: `key,
/// fingerprint, result, failed`, one primary-key lookup per key, whatever the
/// planner knows of the table. The plain form (`WHERE handler = $1 AND key =
/// ANY($2)`) is planned from the table's statistics, and a table never analysed
/// (autovacuum off, or a new table before its first analyse) gets a plan that
/// reads every row of the scope and filters the keys: a batch's read grew with
/// the table (3.3 ms against 0.4 ms for 64 keys at 10,000 rows; `EXPLAIN ANALYZE`
/// in BENCHMARKS.md). The `LATERAL` subquery with `OFFSET 0` is not flattened, so
/// each key is an index lookup on `(handler, key)` in every plan.
macro_rules! probe {
    () => {
        "SELECT u.k AS key, NULL::bigint AS xid, d.fingerprint, d.result, d.failed \
         FROM unnest($2::text[]) AS u(k) CROSS JOIN LATERAL \
         (SELECT fingerprint, result, failed FROM idemq_dedup WHERE handler = $1 AND key = u.k OFFSET 0) AS d"
    };
}

/// The claim, one statement for any number of keys (they go as two array
/// parameters: no limit of bind parameters to mind, one cached statement): the
/// rows inserted where absent, in the arrays' order, with the transaction's id
/// (`txid_current()`), and, from the statement's snapshot, the rows that were
/// there before — so a duplicate costs no read of its own. (A data-modifying
/// `WITH` runs to completion once; its rows are not visible to the statement's own
/// read, which therefore returns only the rows applied before.) The read is
/// [`PROBE`]'s, one primary-key lookup per key, for the keys not inserted only: it
/// could not see the others, and their lookups were a quarter of the statement's
/// time on a backlog (0.95 ms against 0.71 for 130 keys, 13 of them duplicates).
const CLAIM: &str = concat!(
    "WITH new AS (\
     INSERT INTO idemq_dedup (handler, key, fingerprint) \
     SELECT $1, k, f FROM unnest($2::text[], $3::bytea[]) AS u(k, f) \
     ON CONFLICT DO NOTHING RETURNING key) \
     SELECT key, txid_current() AS xid, NULL::bytea AS fingerprint, NULL::bytea AS result, false AS failed \
     FROM new \
     UNION ALL ",
    probe!(),
    " WHERE NOT EXISTS (SELECT 1 FROM new WHERE new.key = u.k)"
);

/// [`CLAIM`]'s read alone (see [`probe!`]).
const PROBE: &str = probe!();

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
            let claim = diesel::sql_query(CLAIM)
                .bind::<Text, _>(scope)
                .bind::<Array<Text>, _>(&keys)
                .bind::<Array<Bytea>, _>(&fingerprints);
            Fixed(claim).load::<ClaimRow>(&mut second).await
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
            crate::base::log::error!(error = %err, scope, ?keys, "BEGIN failed but the dedup insert committed; deleting the rows");
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
    // One cached statement for any number of keys, a primary-key lookup each.
    let rows: Vec<ClaimRow> =
        diesel::sql_query(PROBE).bind::<Text, _>(scope).bind::<Array<Text>, _>(keys).load(conn).await?;
    Ok(rows
        .into_iter()
        .map(|ClaimRow { key, fingerprint, result, failed, .. }| {
            (key, Stored { fingerprint, result, failed })
        })
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
        // Each row found by a primary-key lookup, then updated by its ctid (see
        // [`probe!`]: joined on `(handler, key)`, a table never analysed is read whole).
        // The rows are this transaction's own: nothing moves them meanwhile.
        "UPDATE idemq_dedup AS d SET result = u.result \
         FROM unnest($2::text[], $3::bytea[]) AS u(key, result) CROSS JOIN LATERAL \
         (SELECT ctid AS row FROM idemq_dedup WHERE handler = $1 AND key = u.key OFFSET 0) AS x \
         WHERE d.ctid = x.row",
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

#[cfg(test)]
mod tests {
    use diesel::sql_types::Text;
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

    use super::{CLAIM, PROBE};

    /// One line of `EXPLAIN (FORMAT JSON)`: the whole plan.
    #[derive(diesel::QueryableByName)]
    struct Plan {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        json: String,
    }

    /// Rows of `idemq_dedup` the plan's scans of it read: returned, and removed by
    /// a filter or a recheck (each times its loops).
    fn dedup_rows_read(node: &serde_json::Value) -> f64 {
        let number = |name: &str| node.get(name).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        let own = if node.get("Relation Name").and_then(serde_json::Value::as_str) == Some("idemq_dedup")
            && node.get("Node Type").and_then(serde_json::Value::as_str) != Some("ModifyTable")
        {
            (number("Actual Rows")
                + number("Rows Removed by Filter")
                + number("Rows Removed by Index Recheck"))
                * number("Actual Loops").max(1.0)
        } else {
            0.0
        };
        let children = node
            .get("Plans")
            .and_then(serde_json::Value::as_array)
            .map_or(0.0, |plans| plans.iter().map(dedup_rows_read).sum());
        own + children
    }

    async fn rows_read(conn: &mut diesel_async::AsyncPgConnection, execute: &str) -> f64 {
        let plan: Plan = diesel::sql_query(format!("EXPLAIN (ANALYZE, FORMAT JSON) {execute}"))
            .get_result(conn)
            .await
            .expect("explain");
        let plan: serde_json::Value = serde_json::from_str(&plan.json).expect("json");
        dedup_rows_read(&plan[0]["Plan"])
    }

    /// The batch's read of the dedup rows (in the claim, and alone) looks up its own
    /// keys and nothing else, in a table the planner knows nothing about: 64 keys
    /// among 10,000 rows of their scope, never analysed (as with autovacuum off, or a
    /// new table before its first analyse), read 64 rows, not the scope's 10,000.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_batch_reads_only_its_own_dedup_rows_in_a_table_never_analysed() {
        let admin = crate::config::env_url("DATABASE_URL", crate::config::DEFAULT_DATABASE_URL).expect("url");
        let name = format!("idemq_probe_{}_{}", std::process::id(), fastrand::u32(..));
        let mut conn = crate::store::db::connect(&admin).await.expect("the test database server");
        conn.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create");
        let mut url = url::Url::parse(&admin).expect("url");
        url.set_path(&name);
        let checked = async {
            crate::store::migrate::migrate(url.as_str()).await.expect("migrate");
            let mut db = crate::store::db::connect(url.as_str()).await.expect("connect");
            db.batch_execute(
                "INSERT INTO idemq_dedup (handler, key) SELECT 'payments', 'pay-' || i FROM generate_series(1, 10000) i",
            )
            .await
            .expect("rows");
            db.batch_execute(&format!("PREPARE probe(text, text[]) AS {PROBE}")).await.expect("prepare");
            db.batch_execute(&format!("PREPARE claim(text, text[], bytea[]) AS {CLAIM}"))
                .await
                .expect("prepare");
            let keys: Vec<String> = (1..=6400).step_by(100).map(|i| format!("pay-{i}")).collect();
            let keys = format!("ARRAY['{}']", keys.join("','"));
            // The first runs of a prepared statement are planned for their values
            // (custom plans), the ones that went wrong; later ones may be generic.
            for run in 0..7 {
                let probe = rows_read(&mut db, &format!("EXECUTE probe('payments', {keys})")).await;
                assert_eq!(probe, 64.0, "run {run}: the read alone looked at {probe} rows for 64 keys");
                db.batch_execute("BEGIN").await.expect("begin");
                let claim = rows_read(
                    &mut db,
                    &format!("EXECUTE claim('payments', {keys}, array_fill(NULL::bytea, ARRAY[64]))"),
                )
                .await;
                db.batch_execute("ROLLBACK").await.expect("rollback");
                assert_eq!(claim, 64.0, "run {run}: the claim looked at {claim} rows for 64 keys");
            }
        };
        let outcome = futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(checked)).await;
        conn.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await.expect("drop");
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
}
