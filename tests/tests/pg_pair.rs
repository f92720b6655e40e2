//! The test kit's PostgreSQL primary and streaming standby (`PostgresPair`): a
//! failover it stages — the primary SIGKILLed, the standby promoted — keeps what
//! synchronous replication promises and loses what asynchronous replication does
//! not, and idemq's own connections find the promoted standby through libpq's
//! multi-host URL. Each test starts a pair of its own (about 3 s) and a database
//! `app` on it.

use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemq::testing::{PostgresPair, Replication};
use idemq_tests::with_timeout;

/// The database each test creates on its pair (the pair is its own).
const DATABASE: &str = "app";
/// How long starting a pair may take.
const START: Duration = Duration::from_secs(120);
/// How long one step of a test (a statement, a kill, a promotion) may take.
const STEP: Duration = Duration::from_secs(60);

/// A pair with `app` created on it, started as `builder` says.
async fn pair(builder: idemq::testing::PostgresPairBuilder) -> PostgresPair {
    idemq_tests::init_tracing();
    let pair = with_timeout("start a primary and a standby", START, builder.start())
        .await
        .expect("start a primary and a standby");
    pair.create_database(DATABASE).await.expect("create the test database");
    pair
}

/// A connection made as idemq makes its own (`idemq::connect::database`: the path of
/// the pool, the migrations and the CLI).
async fn connect(url: &str) -> AsyncPgConnection {
    with_timeout("connect", STEP, idemq::connect::database(url))
        .await
        .unwrap_or_else(|err| panic!("connect to {url}: {err}"))
}

async fn execute(conn: &mut AsyncPgConnection, sql: &str) {
    with_timeout(sql, STEP, diesel::sql_query(sql).execute(conn))
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"));
}

async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    diesel::dsl::sql::<BigInt>(sql).get_result(conn).await.unwrap_or_else(|err| panic!("{sql}: {err}"))
}

/// The port of the server `conn` is connected to.
async fn server_port(conn: &mut AsyncPgConnection) -> u16 {
    let port: i32 = diesel::dsl::sql::<Integer>("SELECT inet_server_port()")
        .get_result(conn)
        .await
        .expect("the server's port");
    u16::try_from(port).expect("a port")
}

async fn in_recovery(conn: &mut AsyncPgConnection) -> bool {
    diesel::dsl::sql::<Bool>("SELECT pg_is_in_recovery()").get_result(conn).await.expect("pg_is_in_recovery")
}

/// Stages the loss of a primary with a synchronous standby: a row committed on the
/// primary (its COMMIT returned), the primary SIGKILLed at once — no wait for the
/// standby to replay — and the standby promoted. The row must be on the promoted
/// standby, and the promoted standby must take writes (the kit cleared its
/// `synchronous_standby_names`, or a COMMIT there would wait for ever).
#[tokio::test]
async fn a_commit_acknowledged_with_synchronous_replication_survives_the_primary_killed_and_the_standby_promoted(
) {
    let pair = pair(PostgresPair::builder().replication(Replication::Synchronous)).await;
    let mut primary = connect(&pair.primary_url(DATABASE)).await;
    execute(&mut primary, "CREATE TABLE payments (id text PRIMARY KEY)").await;
    execute(&mut primary, "INSERT INTO payments VALUES ('p-1')").await;
    // The standby carries the setting too, as a configuration shared by both would:
    // once promoted, it must be cleared.
    // (Its `postgres` database: `app` is flushed there, maybe not replayed yet.)
    let mut standby = connect(&pair.standby_url("postgres")).await;
    let names: String = diesel::dsl::sql::<Text>("SHOW synchronous_standby_names")
        .get_result(&mut standby)
        .await
        .expect("SHOW");
    assert_eq!(names, "standby1");
    drop(standby);

    with_timeout("kill the primary", STEP, pair.kill_primary()).await.expect("kill the primary");
    with_timeout("promote the standby", STEP, pair.promote_standby()).await.expect("promote the standby");

    let mut promoted = connect(&pair.standby_url(DATABASE)).await;
    assert!(!in_recovery(&mut promoted).await, "the standby is read-write once promoted");
    assert_eq!(count(&mut promoted, "SELECT count(*) FROM payments WHERE id = 'p-1'").await, 1);
    execute(&mut promoted, "INSERT INTO payments VALUES ('p-2')").await;
    assert_eq!(count(&mut promoted, "SELECT count(*) FROM payments").await, 2);
}

/// With synchronous replication a COMMIT waits for the standby: the replication link
/// black-holed by the kit's proxy, an INSERT on the primary does not return; once
/// the link is restored it returns, and the row is on the standby.
#[tokio::test]
async fn with_synchronous_replication_a_commit_waits_while_the_standby_cannot_hear_the_primary() {
    let pair =
        pair(PostgresPair::builder().replication(Replication::Synchronous).replication_through_proxy()).await;
    let mut primary = connect(&pair.primary_url(DATABASE)).await;
    execute(&mut primary, "CREATE TABLE payments (id text PRIMARY KEY)").await;
    let link = pair.replication_proxy().expect("the replication link's proxy");

    link.black_hole();
    let insert = tokio::spawn(async move {
        diesel::sql_query("INSERT INTO payments VALUES ('p-1')").execute(&mut primary).await
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!insert.is_finished(), "the COMMIT returned while the standby heard nothing");

    link.restore();
    with_timeout("the COMMIT once the link is back", STEP, insert)
        .await
        .expect("the insert's task")
        .expect("the insert commits once the standby has it");
    with_timeout("the standby's replay", STEP, pair.wait_for_standby()).await.expect("the standby replays");
    let mut standby = connect(&pair.standby_url(DATABASE)).await;
    assert_eq!(count(&mut standby, "SELECT count(*) FROM payments WHERE id = 'p-1'").await, 1);
}

/// Stages what asynchronous replication loses, deterministically: the replication
/// link black-holed by the kit's proxy, a row committed on the primary (its COMMIT
/// returned at once), the primary SIGKILLed and the standby promoted. What the
/// standby had before the black hole is there; the acknowledged row is not.
#[tokio::test]
async fn with_asynchronous_replication_a_commit_the_standby_never_received_is_lost_by_the_promotion() {
    let pair =
        pair(PostgresPair::builder().replication(Replication::Asynchronous).replication_through_proxy())
            .await;
    let mut primary = connect(&pair.primary_url(DATABASE)).await;
    execute(&mut primary, "CREATE TABLE payments (id text PRIMARY KEY)").await;
    execute(&mut primary, "INSERT INTO payments VALUES ('p-before')").await;
    with_timeout("the standby's replay", STEP, pair.wait_for_standby()).await.expect("the standby replays");

    pair.replication_proxy().expect("the replication link's proxy").black_hole();
    execute(&mut primary, "INSERT INTO payments VALUES ('p-lost')").await;
    assert_eq!(count(&mut primary, "SELECT count(*) FROM payments").await, 2, "committed on the primary");

    with_timeout("kill the primary", STEP, pair.kill_primary()).await.expect("kill the primary");
    with_timeout("promote the standby", STEP, pair.promote_standby()).await.expect("promote the standby");

    let mut promoted = connect(&pair.standby_url(DATABASE)).await;
    assert_eq!(count(&mut promoted, "SELECT count(*) FROM payments WHERE id = 'p-before'").await, 1);
    assert_eq!(
        count(&mut promoted, "SELECT count(*) FROM payments WHERE id = 'p-lost'").await,
        0,
        "the acknowledged COMMIT the standby never received is gone"
    );
}

/// libpq's multi-host URL with `target_session_attrs=read-write`, through idemq's own
/// connect path (`idemq::connect::database`, `idemq::migrate`) and diesel-async's
/// (`AsyncPgConnection::establish`, tokio-postgres's `Config::connect`): it reaches
/// the primary while it lives; with the primary killed and the standby not yet
/// promoted it is refused (the standby is read-only); after the promotion the same
/// URL reaches the promoted standby, read-write, with idemq's tables migrated
/// through it before the failover.
#[tokio::test]
async fn the_multi_host_url_reaches_whichever_server_is_read_write_before_and_after_the_failover() {
    let pair = pair(PostgresPair::builder().replication(Replication::Asynchronous)).await;
    let url = pair.url(DATABASE);

    let mut conn = connect(&url).await;
    assert_eq!(server_port(&mut conn).await, pair.primary_port(), "the primary, listed first");
    drop(conn);
    with_timeout("migrate", STEP, idemq::migrate(&url)).await.expect("idemq's migrations through the URL");
    with_timeout("the standby's replay", STEP, pair.wait_for_standby()).await.expect("the standby replays");
    let mut standby = connect(&pair.standby_url(DATABASE)).await;
    let migrations = count(&mut standby, "SELECT count(*) FROM __diesel_schema_migrations").await;
    assert!(migrations > 0, "idemq's migrations are on the standby");
    drop(standby);

    with_timeout("kill the primary", STEP, pair.kill_primary()).await.expect("kill the primary");
    match with_timeout("connect", STEP, idemq::connect::database(&url)).await {
        Ok(_) => panic!("connected to a read-only standby with target_session_attrs=read-write"),
        Err(idemq::Error::DatabaseConnect { message, .. }) => {
            assert!(message.contains("does not allow writes"), "the standby's refusal: {message}");
        }
        Err(other) => panic!("expected a connection failure, got: {other}"),
    }

    with_timeout("promote the standby", STEP, pair.promote_standby()).await.expect("promote the standby");
    let mut conn = connect(&url).await;
    assert_eq!(server_port(&mut conn).await, pair.standby_port(), "the promoted standby");
    assert!(!in_recovery(&mut conn).await);
    assert_eq!(count(&mut conn, "SELECT count(*) FROM __diesel_schema_migrations").await, migrations);
    execute(&mut conn, "CREATE TABLE after_failover (id int)").await;

    let mut diesel_own = with_timeout("establish", STEP, AsyncPgConnection::establish(&url))
        .await
        .expect("diesel-async's own connect with the multi-host URL");
    assert_eq!(server_port(&mut diesel_own).await, pair.standby_port());
}
