//! Migrations run by several processes starting at the same moment on one fresh
//! database (a deployment rolling out N consumers at once).

use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel::QueryableByName;
use diesel_async::RunQueryDsl;
use idemq_tests::{with_timeout, TestDb};

/// How many runs race; each has its own connection, as separate processes would.
const RUNNERS: usize = 8;

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    let mut conn = db.connect().await;
    diesel::sql_query(sql).get_result::<Count>(&mut conn).await.expect(sql).n
}

/// Stages eight `idemq::migrate` calls at once on a fresh database (without a lock,
/// two of them fail with a duplicate key on `pg_type_typname_nsp_index`). All must
/// return Ok, leaving one dedup table and each migration recorded once.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_migrations_on_a_fresh_database_all_succeed() {
    let db = TestDb::create().await;
    let url = db.url();
    let runs = (0..RUNNERS).map(|_| idemq::migrate(&url));
    let results = with_timeout(
        "the concurrent migrations",
        Duration::from_secs(60),
        futures_util::future::join_all(runs),
    )
    .await;
    for (i, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "run {i} failed: {}", result.as_ref().unwrap_err());
    }
    assert_eq!(count(&db, "SELECT count(*) AS n FROM pg_tables WHERE tablename = 'idemq_dedup'").await, 1);
    let versions = "SELECT count(*) AS n FROM __diesel_schema_migrations";
    let distinct = "SELECT count(DISTINCT version) AS n FROM __diesel_schema_migrations";
    assert!(count(&db, versions).await >= 1, "no migration recorded");
    assert_eq!(count(&db, versions).await, count(&db, distinct).await, "a migration recorded twice");
    // The lock is released: nothing holds it once every run returned.
    let held = "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
    assert_eq!(count(&db, held).await, 0, "the migration lock is still held");
}

/// The demo's `migrate` (idemq's migrations, then its own `CREATE TABLE IF NOT
/// EXISTS` tables) run eight times at once on a fresh database: all succeed, each
/// table exists once.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_demo_migrations_on_a_fresh_database_all_succeed() {
    let db = TestDb::create().await;
    let url = db.url();
    let runs = (0..RUNNERS).map(|_| idemq_example_payments::migrate(&url));
    let results = with_timeout(
        "the concurrent migrations",
        Duration::from_secs(60),
        futures_util::future::join_all(runs),
    )
    .await;
    for (i, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "run {i} failed: {}", result.as_ref().unwrap_err());
    }
    let tables =
        "SELECT count(*) AS n FROM pg_tables WHERE tablename IN ('idemq_dedup', 'ledger', 'accounts')";
    assert_eq!(count(&db, tables).await, 3);
}
