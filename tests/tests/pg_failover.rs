//! PostgreSQL failover (issue 25): the primary SIGKILLed mid-stream and its standby
//! promoted, with consumers on libpq's multi-host URL
//! (`postgres://…@primary,standby/app?target_session_attrs=read-write`).
//!
//! - With **synchronous** replication every payment is applied exactly once, nothing
//!   is dead-lettered and the queue drains: a COMMIT the primary acknowledged was on
//!   the standby, and a COMMIT the failover cut off was never acked, so the dedup row
//!   on the new primary decides.
//! - With **asynchronous** replication the same staging loses payments idemq has
//!   acked. The test stages the loss deterministically (the standby's replication
//!   link black-holed before the payments), counts it, and shows that the start-up
//!   check said so: refused with `ReplicationCheck::Refuse`.
//! - The outbox relay publishing across a failover sends every event under one
//!   `message_id`.
//!
//! Each test starts a private primary and standby of its own (`PostgresPair`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::testing::{PostgresPair, Replication};
use idemq::ReplicationCheck;
use idemq_tests::fixture::{payment, Bed, ConsumerProcess, Running};
use idemq_tests::{eventually, with_timeout};

/// The database each test creates on its pair.
const DATABASE: &str = "app";
/// How long starting a pair may take.
const START: Duration = Duration::from_secs(120);

async fn pair(replication: Replication, through_proxy: bool) -> PostgresPair {
    idemq_tests::init_tracing();
    let mut builder = PostgresPair::builder().replication(replication);
    if through_proxy {
        builder = builder.replication_through_proxy();
    }
    let pair = with_timeout("start a primary and a standby", START, builder.start())
        .await
        .expect("start a primary and a standby");
    pair.create_database(DATABASE).await.expect("create the test database");
    idemq_example_payments::migrate(&pair.url(DATABASE)).await.expect("migrate on the primary");
    pair
}

/// `sql` (one `bigint`) on whichever server is the primary now.
async fn count(pair: &PostgresPair, sql: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    let mut conn = idemq::connect::database(&pair.url(DATABASE)).await.expect("connect to the primary");
    diesel::dsl::sql::<diesel::sql_types::BigInt>(sql)
        .get_result(&mut conn)
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"))
}

/// Publishes `payments` in a task of its own, each once and every fifth a second
/// time, so that consumers work while it publishes.
fn publish_with_duplicates(
    bed: &Arc<Bed>,
    payments: &[idemq_example_payments::PaymentRequested],
) -> tokio::task::JoinHandle<()> {
    let (bed, payments) = (Arc::clone(bed), payments.to_vec());
    tokio::spawn(async move {
        for (i, payment) in payments.iter().enumerate() {
            bed.publish(payment).await;
            if i % 5 == 0 {
                bed.publish(payment).await;
            }
        }
    })
}

/// Three consumers (two processes and this one), a stream of payments with
/// duplicates, the primary SIGKILLed a third of the way in and the standby
/// promoted: every payment once, nothing dead-lettered, the queue drained. What the
/// failover cost is printed: the pause (the kill to the first COMMIT on the new
/// primary) and, from this process's consumer, the payments published once that it
/// answered as duplicates (COMMITs cut off by the kill that had in fact committed).
#[tokio::test(flavor = "multi_thread")]
async fn with_synchronous_replication_a_failover_mid_stream_loses_and_doubles_nothing() {
    const PAYMENTS: usize = 1500;
    let pair = pair(Replication::Synchronous, false).await;
    let bed = Arc::new(Bed::new().await);
    let url = pair.url(DATABASE);
    let env = [("DATABASE_URL", url.as_str()), ("SLOW_MS", "2"), ("CONCURRENCY", "4")];
    let consumers: Vec<_> =
        (0..2).map(|_| ConsumerProcess::spawn(env!("CARGO_BIN_EXE_consumer"), &bed, &env)).collect();
    let here = Running::start(
        bed.runtime()
            .database_url(url.clone())
            .concurrency(4)
            .consume(&bed.queue, idemq_tests::fixture::ledger_payment),
    );
    let payments: Vec<_> = (0..PAYMENTS).map(|i| payment(100 + i as i64)).collect();
    let publishing = publish_with_duplicates(&bed, &payments);

    let third = (PAYMENTS / 3) as i64;
    eventually("a third of the payments applied", Duration::from_secs(120), || async {
        count(&pair, "SELECT count(*) FROM ledger").await >= third
    })
    .await;
    let before = count(&pair, "SELECT count(*) FROM ledger").await;
    assert!(before < PAYMENTS as i64, "the primary must die mid-stream ({before} applied already)");
    pair.kill_primary().await.expect("kill the primary");
    let killed = Instant::now();
    pair.promote_standby().await.expect("promote the standby");
    let promoted = killed.elapsed();
    let after = count(&pair, "SELECT count(*) FROM ledger").await;
    eventually("a COMMIT on the new primary", Duration::from_secs(120), || async {
        count(&pair, "SELECT count(*) FROM ledger").await > after
    })
    .await;
    let paused = killed.elapsed();
    eventually("every payment applied on the new primary", Duration::from_secs(180), || async {
        count(&pair, "SELECT count(DISTINCT payment_id) FROM ledger").await == PAYMENTS as i64
    })
    .await;
    let resumed = killed.elapsed();
    publishing.await.expect("every payment published");
    eventually("the queue drained", Duration::from_secs(60), || async {
        bed.broker.message_count(&bed.queue).await == 0
    })
    .await;
    drop(consumers);
    let events = here.events();
    here.stop().await.expect("clean shutdown");

    assert_eq!(count(&pair, "SELECT count(*) FROM ledger").await, PAYMENTS as i64, "every payment once");
    let doubled = count(
        &pair,
        "SELECT count(*) FROM (SELECT payment_id FROM ledger GROUP BY payment_id HAVING count(*) > 1) d",
    )
    .await;
    assert_eq!(doubled, 0);
    let expected: i64 = payments.iter().map(|p| p.amount_cents).sum();
    let total = count(&pair, "SELECT coalesce(sum(amount_cents), 0)::bigint FROM ledger").await;
    assert_eq!(total, expected);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
    let published_once: HashSet<&str> =
        payments.iter().enumerate().filter(|(i, _)| i % 5 != 0).map(|(_, p)| p.payment_id.as_str()).collect();
    let in_doubt = events
        .iter()
        .filter(|e| e.outcome == idemq::Outcome::Duplicate)
        .filter(|e| e.key.as_deref().is_some_and(|key| published_once.contains(key)))
        .count();
    eprintln!(
        "failover: {before} of {PAYMENTS} payments applied when the primary was killed; the standby promoted \
         {promoted:?} later; the first COMMIT on it {paused:?} after the kill; every payment applied {resumed:?} \
         after the kill; this process's consumer settled {} deliveries, {in_doubt} of them payments published \
         once answered as duplicates (their COMMIT, cut off, had committed)",
        events.len()
    );
}

/// With asynchronous replication, a failover loses what the standby had not
/// received: payments idemq applied and acked are gone from the promoted standby.
/// The start-up check named the risk: with `ReplicationCheck::Refuse` the runtime
/// does not start.
#[tokio::test(flavor = "multi_thread")]
async fn with_asynchronous_replication_a_failover_loses_acked_payments_and_the_check_said_so() {
    const PAYMENTS: usize = 40;
    let pair = pair(Replication::Asynchronous, true).await;
    let bed = Bed::new().await;
    let url = pair.url(DATABASE);

    let refused = with_timeout(
        "the refusing runtime's start",
        Duration::from_secs(60),
        bed.runtime()
            .database_url(url.clone())
            .consume(&bed.queue, idemq_tests::fixture::ledger_payment)
            .replication_check(ReplicationCheck::Refuse)
            .build()
            .expect("build")
            .run(idemq::CancellationToken::new()),
    )
    .await;
    let err = refused.expect_err("refused: asynchronous standbys");
    assert!(matches!(err, idemq::Error::Replication { .. }), "{err:?}");
    assert!(err.to_string().contains("asynchronously"), "{err}");

    // The standby hears nothing more from the primary, then the payments come.
    pair.wait_for_standby().await.expect("the standby caught up");
    pair.replication_proxy().expect("asked for").black_hole();
    let running = Running::start(
        bed.runtime().database_url(url).consume(&bed.queue, idemq_tests::fixture::ledger_payment),
    );
    let payments: Vec<_> = (0..PAYMENTS).map(|i| payment(100 + i as i64)).collect();
    for payment in &payments {
        bed.publish(payment).await;
    }
    running.wait_settled(PAYMENTS).await;
    eventually("every payment acked", Duration::from_secs(30), || async {
        bed.broker.message_count(&bed.queue).await == 0
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let applied = count(&pair, "SELECT count(*) FROM ledger").await;
    assert_eq!(applied, PAYMENTS as i64, "applied and acked on the primary");

    pair.kill_primary().await.expect("kill the primary");
    pair.promote_standby().await.expect("promote the standby");
    let kept = count(&pair, "SELECT count(*) FROM ledger").await;
    let lost = PAYMENTS as i64 - kept;
    eprintln!("asynchronous replication: {lost} of {PAYMENTS} acked payments lost by the failover");
    assert_eq!(lost, PAYMENTS as i64, "every payment after the link went dark is gone, though acked");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0, "and the broker has none of them any more");
}

/// The outbox relay publishing while the primary is killed and the standby
/// promoted: every applied payment's event is published, each under one
/// `message_id` (a row published again after the failover keeps its id).
#[tokio::test(flavor = "multi_thread")]
async fn a_failover_while_the_relay_publishes_sends_each_event_under_one_message_id() {
    const PAYMENTS: usize = 600;
    let pair = pair(Replication::Synchronous, false).await;
    // A vhost of its own: the consumers declare the events queue, the vhost goes with it.
    let bed = Bed::isolated().await;
    let events = format!("{}.events", bed.queue);
    let url = pair.url(DATABASE);
    let env = [("DATABASE_URL", url.as_str()), ("NEXT_QUEUE", events.as_str()), ("CONCURRENCY", "4")];
    let consumers: Vec<_> =
        (0..2).map(|_| ConsumerProcess::spawn(env!("CARGO_BIN_EXE_consumer"), &bed, &env)).collect();
    let payments: Vec<_> = (0..PAYMENTS).map(|i| payment(100 + i as i64)).collect();
    for payment in &payments {
        bed.publish(payment).await;
    }
    eventually("a third of the events published", Duration::from_secs(120), || async {
        bed.broker.queue_exists(&events).await
            && bed.broker.message_count(&events).await >= (PAYMENTS / 3) as u32
    })
    .await;
    pair.kill_primary().await.expect("kill the primary");
    pair.promote_standby().await.expect("promote the standby");
    eventually("every payment applied", Duration::from_secs(180), || async {
        count(&pair, "SELECT count(DISTINCT payment_id) FROM ledger").await == PAYMENTS as i64
    })
    .await;
    eventually("the outbox emptied", Duration::from_secs(120), || async {
        count(&pair, "SELECT count(*) FROM idemq_outbox").await == 0
    })
    .await;
    drop(consumers);

    let mut ids: HashMap<String, HashSet<String>> = HashMap::new();
    let published = bed.broker.drain(&events).await;
    for message in &published {
        let event: serde_json::Value = serde_json::from_slice(&message.delivery.data).expect("an event");
        let payment_id = event["payment_id"].as_str().expect("its payment").to_owned();
        let id = message.delivery.properties.message_id().as_ref().expect("an id").to_string();
        ids.entry(payment_id).or_default().insert(id);
    }
    assert_eq!(ids.len(), PAYMENTS, "an event for every payment");
    let several: Vec<_> = ids.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(several.is_empty(), "events of one payment under several ids: {several:?}");
    eprintln!("relay across a failover: {} events for {PAYMENTS} payments, one id each", published.len());
}

/// A payment handler that keeps no dedup rows: its own INSERT is the transaction's
/// first write, so on a standby it is the handler that meets the read-only error.
#[idemq::idempotent_handler(key = "payment_id", name = "ledger_without_dedup", dedup = false)]
async fn ledger_without_dedup(
    conn: &mut diesel_async::AsyncPgConnection,
    msg: idemq_example_payments::PaymentRequested,
) -> Result<(), diesel::result::Error> {
    idemq_example_payments::record_payment(conn, &msg).await
}

/// A runtime whose URL reaches a standby (one host, no `target_session_attrs`): its
/// writes are refused as read-only (25006) — the dedup row's for one handler, the
/// handler's own for one without dedup rows. Neither is the message's failure: the
/// delivery is held and its transaction retried on fresh connections, no attempt
/// charged, and applied once the standby is promoted. The start-up check warned.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_refusing_writes_charges_no_attempt_and_the_payment_is_applied_after_the_promotion() {
    let pair = pair(Replication::Asynchronous, false).await;
    pair.wait_for_standby().await.expect("the standby has the tables");
    let bed = Bed::new().await;
    let standby = pair.standby_url(DATABASE);
    let running =
        Running::start(bed.runtime().database_url(standby).consume(&bed.queue, ledger_without_dedup));
    let first = payment(100);
    bed.publish(&first).await;
    // Long enough for several refused attempts on fresh connections.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(running.events().is_empty(), "held, not settled: {:?}", running.events());
    pair.kill_primary().await.expect("kill the primary");
    pair.promote_standby().await.expect("promote the standby");
    let events = running.wait_for_end(&first.payment_id).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].outcome, idemq::Outcome::Applied, "{events:#?}");
    assert_eq!(events[0].attempt, 1, "no attempt charged for the standby's refusals");
    assert_eq!(
        count(&pair, &format!("SELECT count(*) FROM ledger WHERE payment_id = '{}'", first.payment_id)).await,
        1
    );
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
