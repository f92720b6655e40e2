//! Migrations run by several processes starting at the same moment on one fresh
//! database (a deployment rolling out N consumers at once).

use std::time::Duration;

use idemq_tests::{with_timeout, TestDb};

/// How many runs race; each has its own connection, as separate processes would.
const RUNNERS: usize = 8;

/// Runs `RUNNERS` copies of `migrate` on `db` at once and asserts that all succeed.
async fn all_at_once<F, Fut, E>(db: &TestDb, migrate: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let runs = (0..RUNNERS).map(|_| migrate(db.url()));
    let results = with_timeout(
        "the concurrent migrations",
        Duration::from_secs(60),
        futures_util::future::join_all(runs),
    )
    .await;
    for (i, result) in results.iter().enumerate() {
        if let Err(err) = result {
            panic!("run {i} failed: {err}");
        }
    }
}

/// Stages eight `idemq::migrate` calls at once on a fresh database (without a lock,
/// two of them fail with a duplicate key on `pg_type_typname_nsp_index`). All must
/// return Ok, leaving one dedup table and each migration recorded once.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_migrations_on_a_fresh_database_all_succeed() {
    let db = TestDb::create().await;
    all_at_once(&db, |url| async move { idemq::migrate(&url).await }).await;
    assert_eq!(db.count("SELECT count(*) FROM pg_tables WHERE tablename = 'idemq_dedup'").await, 1);
    let versions = "SELECT count(*) FROM __diesel_schema_migrations";
    let distinct = "SELECT count(DISTINCT version) FROM __diesel_schema_migrations";
    assert!(db.count(versions).await >= 1, "no migration recorded");
    assert_eq!(db.count(versions).await, db.count(distinct).await, "a migration recorded twice");
    // The lock is released: nothing holds it once every run returned.
    let held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
    assert_eq!(db.count(held).await, 0, "the migration lock is still held");
}

/// The demo's `migrate` (idemq's migrations, then its own `CREATE TABLE IF NOT
/// EXISTS` tables) run eight times at once on a fresh database: all succeed, each
/// table exists once.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_demo_migrations_on_a_fresh_database_all_succeed() {
    let db = TestDb::create().await;
    all_at_once(&db, |url| async move { idemq_example_payments::migrate(&url).await }).await;
    let tables = "SELECT count(*) FROM pg_tables WHERE tablename IN ('idemq_dedup', 'ledger', 'accounts')";
    assert_eq!(db.count(tables).await, 3);
}
