//! Least privilege: `migrate` runs as the tables' owner, `run` as a role with only
//! SELECT, INSERT, UPDATE and DELETE on the tables (`docs/security.md`, *Least privilege*
//! grants), with the payments app run as a child process, as an operator runs it.

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemq_example_payments::EVENTS_QUEUE;
use idemq_tests::app::{declare_topology, publish_payments, wait_applied, App};
use idemq_tests::{eventually, unique, Broker, TestDb, TestVhost};

const APP: &str = env!("CARGO_BIN_EXE_payments-app");

/// A LOGIN role of the cluster (roles are cluster-wide: uniquely named, so parallel
/// runs never share one) with the grants of docs/security.md on one database and nothing else.
/// Dropped, with its privileges, on drop.
struct AppRole {
    name: String,
    db_url: String,
    url: String,
}

impl AppRole {
    /// Creates the role and grants it what `run` needs on `db`: CONNECT, USAGE on the
    /// schema, and SELECT, INSERT, UPDATE, DELETE on every table — nothing more.
    async fn create(db: &TestDb) -> AppRole {
        let name = unique("idemq_app");
        let role = AppRole { url: with_user(&db.url(), &name), db_url: db.url(), name };
        let mut owner = db.connect().await;
        for sql in [
            format!("CREATE ROLE {} LOGIN", role.name),
            format!("GRANT CONNECT ON DATABASE {} TO {}", db.name(), role.name),
            format!("GRANT USAGE ON SCHEMA public TO {}", role.name),
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}", role.name),
        ] {
            diesel::sql_query(&sql).execute(&mut owner).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        role
    }

    /// Runs `sql` as the tables' owner.
    async fn as_owner(&self, sql: &str) {
        let mut owner = AsyncPgConnection::establish(&self.db_url).await.expect("connect as the owner");
        diesel::sql_query(sql).execute(&mut owner).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

impl Drop for AppRole {
    fn drop(&mut self) {
        // Drop cannot be async: a thread with its own runtime, as TestDb's drop.
        let (name, db_url) = (self.name.clone(), self.db_url.clone());
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let mut owner = AsyncPgConnection::establish(&db_url).await?;
                for sql in [
                    format!(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"
                    ),
                    // Its privileges here and on the database (a shared object) go with it.
                    format!("DROP OWNED BY {name}"),
                    format!("DROP ROLE {name}"),
                ] {
                    diesel::sql_query(sql).execute(&mut owner).await?;
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("warning: could not drop the test role {}: {dropped:?}", self.name);
        }
    }
}

/// `url` (`postgres://user@host/db`) with its user replaced by `user` (no password:
/// the test server trusts local connections).
fn with_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{host}")
}

/// A fresh database migrated by `payments migrate` as its owner (the test's admin
/// user), a vhost with the app's topology, and the app's role.
async fn migrated() -> (TestDb, TestVhost, Broker, AppRole) {
    let db = TestDb::create().await;
    let (status, stderr) =
        App::spawn(APP, &["migrate"], &[("DATABASE_URL", &db.url())]).exit(Duration::from_secs(60)).await;
    assert!(status.success(), "migrate as the owner failed: {stderr}");
    let vhost = TestVhost::create().await;
    let broker = Broker::connect(&vhost.amqp_url()).await;
    declare_topology(&broker).await;
    let role = AppRole::create(&db).await;
    (db, vhost, broker, role)
}

/// After `migrate` as the owner, `payments run` as a role with only SELECT, INSERT,
/// UPDATE and DELETE on the tables (no CREATE, no sequence privileges, not a
/// superuser) starts, applies every payment exactly once (duplicates acked), and its
/// outbox relay publishes every payment's event; it exits 0 on SIGTERM. The role
/// itself cannot create a table: the grants are least privilege.
#[tokio::test(flavor = "multi_thread")]
async fn run_works_as_a_role_with_only_dml_grants() {
    let (db, vhost, broker, role) = migrated().await;
    let payments = publish_payments(&broker, 40).await;

    let mut app = App::spawn(APP, &["run"], &[("DATABASE_URL", &role.url), ("AMQP_URL", &vhost.amqp_url())]);
    wait_applied(&mut app, &db, payments.len()).await;
    eventually("every payment's event published", Duration::from_secs(60), || {
        app.assert_running();
        async { broker.message_count(EVENTS_QUEUE).await == payments.len() as u32 }
    })
    .await;
    let (status, stderr) = app.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "run exited {status}; its stderr:\n{stderr}");
    assert!(!stderr.contains("permission denied"), "{stderr}");

    let doubled =
        "SELECT count(*) FROM (SELECT payment_id FROM ledger GROUP BY payment_id HAVING count(*) > 1) d";
    assert_eq!(db.count(doubled).await, 0, "a payment applied twice");
    assert_eq!(db.count("SELECT count(*) FROM idemq_dedup").await, payments.len() as i64);
    assert_eq!(db.count("SELECT count(*) FROM idemq_outbox").await, 0, "the outbox is drained");
    assert_eq!(broker.message_count(idemq_example_payments::QUEUE).await, 0);

    let mut as_role = AsyncPgConnection::establish(&role.url).await.expect("connect as the role");
    let created = diesel::sql_query("CREATE TABLE idemq_probe (x int)").execute(&mut as_role).await;
    let Err(err) = created else { panic!("the role could create a table: not least privilege") };
    assert!(err.to_string().contains("permission denied"), "{err}");
}

/// Starts `payments run` as the role after `revoke` (run as the owner) and expects it
/// to exit 1 within seconds — not to wait, nor to retry — with `fix` in its message.
async fn fails_fast_with(revoke: &str, fix: &str) {
    let (_db, vhost, _broker, role) = migrated().await;
    role.as_owner(&revoke.replace("{role}", &role.name)).await;
    let app = App::spawn(APP, &["run"], &[("DATABASE_URL", &role.url), ("AMQP_URL", &vhost.amqp_url())]);
    let (status, stderr) = app.exit(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(1), "run must fail; its stderr:\n{stderr}");
    let fix = fix.replace("{role}", &role.name);
    assert!(stderr.contains(&fix), "expected {fix:?} in:\n{stderr}");
}

/// Without SELECT on `__diesel_schema_migrations` (where the start-up check reads
/// which migrations are applied), `run` fails fast naming the GRANT to run, not with
/// the server's bare "permission denied".
#[tokio::test(flavor = "multi_thread")]
async fn run_without_select_on_the_migrations_record_fails_fast_naming_the_grant() {
    fails_fast_with(
        "REVOKE SELECT ON __diesel_schema_migrations FROM {role}",
        "run GRANT SELECT ON __diesel_schema_migrations TO {role}",
    )
    .await;
}

/// Without DELETE on one of idemq's tables, `run` fails fast naming the GRANT to run.
#[tokio::test(flavor = "multi_thread")]
async fn run_without_a_grant_on_an_idemq_table_fails_fast_naming_the_grant() {
    fails_fast_with(
        "REVOKE DELETE ON idemq_copies FROM {role}",
        "run GRANT SELECT, INSERT, UPDATE, DELETE ON idemq_copies TO {role}",
    )
    .await;
}
