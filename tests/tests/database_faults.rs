//! PostgreSQL failing under a running stream: sessions killed, the server restarted.
//! Database faults are not handler failures: nothing may be dead-lettered, no
//! attempt burned, nothing lost, nothing doubled.
//!
//! A test that restarts or stops PostgreSQL does it to a server of its own
//! (`idemq::testing::PostgresServer`: the same binaries as the machine's, a private
//! data directory and port), and one that kills sessions kills only its own
//! database's: they run beside the suite's other tests, and the machine's server,
//! which every test shares, is never restarted.

use std::collections::HashSet;
use std::time::Duration;

use idemq::observe::{Settled, StatsSnapshot};
use idemq::testing::PostgresServer;
use idemq::Outcome;
use idemq_tests::fixture::{publish_stream, slower_payment, stream_deliveries, Bed, Running};
use idemq_tests::in_both_modes;
use idemq_tests::Mode;

/// Streams 400 payments (+20% duplicates) and runs `fault` once 60 have settled;
/// returns the runtime's counters after everything settled. The handler takes 25 ms a
/// payment and group commit runs batches of 8, so the stream is still flowing when
/// the fault lands (with a 3 ms handler and batches of 64 the whole stream had been
/// applied before a restart began).
async fn stream_through<F: std::future::Future<Output = ()>>(bed: &Bed, fault: F) -> StatsSnapshot {
    let payments = publish_stream(bed, 400).await;
    let total = stream_deliveries(payments.len());
    // Batches of 8, not 64: with 64, the 480 deliveries settle in one wave (8 slots ×
    // 64), and a fault after the first 60 lands on an idle stream.
    let builder = match Mode::current() {
        Mode::GroupCommit => bed.runtime().batch_size(8),
        Mode::PerMessage => bed.runtime(),
    };
    let running = Running::start(builder.consume(&bed.queue, slower_payment));
    running.wait_settled(60).await;
    fault.await;
    idemq_tests::with_timeout("every delivery settled after the fault", Duration::from_secs(120), async {
        while running.events().len() < total {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    let unexpected: Vec<_> =
        events.iter().filter(|e| !matches!(e.outcome, Outcome::Applied | Outcome::Duplicate)).collect();
    assert!(unexpected.is_empty(), "only applied or duplicate outcomes: {unexpected:?}");
    let applied: HashSet<_> =
        events.iter().filter(|e| e.outcome == Outcome::Applied).filter_map(|e| e.key.clone()).collect();
    assert_eq!(applied.len(), payments.len(), "each payment applied once");
    assert_eq!(bed.ledger_total().await, payments.len() as i64, "nothing doubled in the ledger");
    for p in payments.iter().step_by(37) {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{}", p.payment_id);
    }
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0, "nothing left behind");
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
    assert_eq!(stats.retried, 0, "no handler attempt was burned by the database fault");
    assert!(stats.infrastructure_retries > 0, "the fault hit transactions in flight: {stats:?}");
    stats
}

/// A private PostgreSQL server for one test.
async fn private_postgres() -> PostgresServer {
    idemq_tests::with_timeout(
        "start a private PostgreSQL",
        Duration::from_secs(120),
        PostgresServer::builder().start(),
    )
    .await
    .expect("start a private PostgreSQL server")
}

/// Restarts `server` (fast shutdown: every session ends) and waits until it
/// accepts connections again.
async fn restart_postgres(server: &PostgresServer) {
    server.restart().await.expect("restart the private PostgreSQL server");
}

in_both_modes! {
/// PostgreSQL kills the consumer's sessions (`pg_terminate_backend`) three times
/// mid-stream: in-flight transactions fail, their deliveries stay unacked and are
/// retried in-process on fresh connections.
async fn killed_database_sessions_mid_stream_lose_nothing_and_double_nothing() {
    // Only the test's own database's sessions: the machine's server will do.
    let bed = Bed::new().await;
    let stats = stream_through(&bed, async {
        for _ in 0..3 {
            bed.db.kill_sessions().await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    })
    .await;
    eprintln!("after 3 session kills: {stats:?}");
}
}

in_both_modes! {
/// The PostgreSQL server restarts mid-stream. Every pooled connection is dead
/// afterwards; the runtime rides it out without a handler failure.
async fn a_postgres_restart_mid_stream_loses_nothing_and_doubles_nothing() {
    let server = private_postgres().await;
    let bed = Bed::on_postgres(&server, false).await;
    let stats = stream_through(&bed, async {
        restart_postgres(&server).await;
    })
    .await;
    eprintln!("after a PostgreSQL restart: {stats:?}");
}
}

in_both_modes! {
/// PostgreSQL stops mid-stream and stays down for longer than `database_retry_limit`
/// (2 s here). The deliveries in flight are held for the limit, then returned to the
/// queue (`Requeued`): nothing is dead-lettered while the database is down, nothing
/// is acked but what committed before it went down, and no handler attempt is
/// burned. Once PostgreSQL is back, every payment is
/// applied exactly once.
async fn the_database_staying_down_past_the_retry_limit_returns_deliveries_to_the_queue() {
    let server = private_postgres().await;
    let bed = Bed::on_postgres(&server, false).await;
    let payments = publish_stream(&bed, 200).await;
    let total = stream_deliveries(payments.len());
    let limit = Duration::from_secs(2);
    // Batches of 8 in group commit, as in `stream_through`: with the default batch
    // size the 240 deliveries settle in one wave, and the stop lands on an idle stream.
    let builder = match Mode::current() {
        Mode::GroupCommit => bed.runtime().batch_size(8),
        Mode::PerMessage => bed.runtime(),
    };
    let running = Running::start(builder.consume(&bed.queue, slower_payment).database_retry_limit(limit));
    running.wait_settled(30).await;

    server.stop().await.expect("stop the private PostgreSQL server");
    let stopped = std::time::Instant::now();
    // A transaction that committed just before the stop may still be acked now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let from = running.events().len();
    // Down for three limits: every held delivery comes back at least once.
    tokio::time::sleep(limit * 3).await;
    let while_down = running.events()[from..].to_vec();
    restart_postgres(&server).await;

    assert!(!while_down.is_empty(), "deliveries were returned while the database was down");
    for settled in &while_down {
        // A delivery decided before the stop (its transaction committed, or its
        // claim read a committed row) is acked with its batch, once the batch's other
        // deliveries are decided: its neighbours may be held for the retry limit,
        // so the ack lands inside this window. Seen in CI for both a duplicate and
        // an applied payment (began before the stop, settled 2.2 s later). Acking it
        // loses nothing: its effect is committed, and nothing can commit while the
        // database is down.
        let decided_before_the_stop = matches!(settled.outcome, Outcome::Applied | Outcome::Duplicate)
            && settled.began_at.is_some_and(|began| began <= stopped);
        assert!(
            decided_before_the_stop
                || matches!(&settled.outcome, Outcome::Requeued { error } if error.contains("stayed unavailable")),
            "only Requeued while the database is down: {settled:?}"
        );
        assert!(settled.settled_with_broker, "the nack reached the broker: {settled:?}");
    }

    idemq_tests::with_timeout(
        "every payment applied once PostgreSQL is back",
        Duration::from_secs(120),
        async {
            while bed.ledger_total().await < payments.len() as i64 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        },
    )
    .await;
    idemq_tests::eventually("the queue drained", Duration::from_secs(30), || async {
        bed.broker.message_count(&bed.queue).await == 0
    })
    .await;
    // An empty queue counts ready messages only: the last duplicates may still be in
    // flight (delivered, not yet settled). Every delivery settles for good once
    // (applied or duplicate); a requeued one comes back and settles again, so the
    // settled events are the deliveries plus the requeues. (Not plus `while_down`:
    // what was decided before the stop is acked in that window and never comes back.)
    idemq_tests::eventually("the requeued deliveries came back and settled", Duration::from_secs(30), || async {
        settled_for_good(&running.events()) >= total
    })
    .await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    let unexpected: Vec<_> = events
        .iter()
        .filter(|e| !matches!(e.outcome, Outcome::Applied | Outcome::Duplicate | Outcome::Requeued { .. }))
        .collect();
    assert!(unexpected.is_empty(), "applied, duplicate or requeued only: {unexpected:?}");
    let applied: HashSet<_> =
        events.iter().filter(|e| e.outcome == Outcome::Applied).filter_map(|e| e.key.clone()).collect();
    assert_eq!(applied.len(), payments.len(), "each payment applied once");
    assert!(settled_for_good(&events) >= total, "the requeued deliveries came back and settled");
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "nothing doubled in the ledger");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
    assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "no handler attempt burned: {stats:?}");
    assert!(stats.requeued > 0, "{stats:?}");
}
}

/// How many deliveries settled for good: every settled event but the requeues.
fn settled_for_good(events: &[Settled]) -> usize {
    events.iter().filter(|e| !matches!(e.outcome, Outcome::Requeued { .. })).count()
}

/// A stream's payments, applied with no dedup row (the offset keeps them once),
/// 10 ms each, so the stream is still flowing when the fault lands.
#[idemq::idempotent_handler(key = "payment_id", name = "stream_ledger", dedup = false)]
async fn stream_ledger(
    conn: &mut diesel_async::AsyncPgConnection,
    msg: idemq_example_payments::PaymentRequested,
) -> Result<(), diesel::result::Error> {
    idemq_example_payments::record_payment(conn, &msg).await?;
    tokio::time::sleep(Duration::from_millis(10)).await;
    Ok(())
}

/// PostgreSQL restarts while a stream is consumed: every pooled connection and the
/// owner's lock connection die. The consumer runs its transaction again, takes its
/// lock again and resumes after the stored offset: each payment once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_restart_mid_stream_loses_and_doubles_nothing_on_a_stream() {
    use diesel::prelude::*;
    use diesel_async::RunQueryDsl;
    let server = private_postgres().await;
    let bed = Bed::on_postgres(&server, true).await;
    let stream = idemq_tests::unique("stream");
    let topology = idemq::Topology::new().queue(idemq::Queue::stream(&stream));
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    topology.declare(&channel).await.expect("declare the stream");
    let payments: Vec<_> = (0..300).map(|i| idemq_tests::fixture::payment(20_000 + i)).collect();
    let publisher = idemq::Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let batch = payments.iter().map(|p| idemq::outbox::Outgoing::json("", &stream, p).expect("outgoing"));
    publisher.publish_all(batch).await.expect("published");
    let running =
        Running::start(bed.runtime().topology(topology).batch_size(4).consume(&stream, stream_ledger));
    running.wait_settled(60).await;
    restart_postgres(&server).await;
    idemq_tests::with_timeout("every payment settled after the restart", Duration::from_secs(120), async {
        while running.events().len() < payments.len() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let mut conn = bed.db.connect().await;
    let applied: Vec<String> = idemq_example_payments::ledger::table
        .select(idemq_example_payments::ledger::payment_id)
        .order(idemq_example_payments::ledger::id)
        .load(&mut conn)
        .await
        .expect("read the ledger");
    let expected: Vec<String> = payments.iter().map(|p| p.payment_id.clone()).collect();
    assert_eq!(applied, expected, "each once, in order, across the restart");
}
