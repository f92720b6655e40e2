//! Statements for upkeep rather than deliveries: the retention sweep's lock and
//! batched deletes, the applied migrations, the table sizes `idemq status` prints.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

#[cfg(feature = "cli")]
use super::outbox::outbox_backlog;

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
