//! Statements for upkeep rather than deliveries: the retention sweep's lock and
//! batched deletes, the applied migrations, the exact row counts `idemq status` prints.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

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
pub async fn applied_migrations(conn: &mut AsyncPgConnection) -> QueryResult<Vec<String>> {
    let tracked: bool =
        diesel::select(diesel::dsl::sql::<Bool>("to_regclass('__diesel_schema_migrations') IS NOT NULL"))
            .get_result(conn)
            .await?;
    if !tracked {
        return Ok(Vec::new());
    }
    diesel::dsl::sql::<Text>("SELECT version FROM __diesel_schema_migrations").load(conn).await
}

/// Cuts every later statement of this connection after `limit`
/// (`statement_timeout`): for the CLI's own connection, closed after.
pub async fn limit_statements(conn: &mut AsyncPgConnection, limit: std::time::Duration) -> QueryResult<()> {
    use diesel_async::SimpleAsyncConnection;
    conn.batch_execute(&format!("SET statement_timeout = {}", limit.as_millis().max(1))).await
}

/// The exact number of rows of idemq's table `table` (`idemq_dedup`, `idemq_outbox`),
/// or `None` when the table is not there (no migrations yet). A count reads the whole
/// table: bound it with [`limit_statements`].
pub async fn count_rows(conn: &mut AsyncPgConnection, table: &'static str) -> QueryResult<Option<i64>> {
    let there: bool =
        diesel::select(diesel::dsl::sql::<Bool>(&format!("to_regclass('{table}') IS NOT NULL")))
            .get_result(conn)
            .await?;
    if !there {
        return Ok(None);
    }
    diesel::dsl::sql::<BigInt>(&format!("SELECT count(*) FROM {table}")).get_result(conn).await.map(Some)
}
