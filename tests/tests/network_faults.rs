//! The network between the runtime and its services fails, staged with the test kit's
//! [`NetworkProxy`] (a loopback TCP proxy in front of RabbitMQ or PostgreSQL): a black
//! hole to the broker, a black hole to the database, every connection reset during
//! an outbox relay pass. Each runs a stream of payments with duplicates (every fifth
//! published twice); after the fault ends, the books must balance: every payment
//! applied exactly once, nothing dead-lettered, nothing left in the queue.
//!
//! Every test has its own vhost, database and proxies, so they run beside the
//! others: the faults touch only the connections made through their proxies.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::SimpleAsyncConnection;
use idemq::testing::fault::FaultHookExt;
use idemq::testing::fault::{FaultContext, FaultHook, FaultPoint};
use idemq::testing::NetworkProxy;
use idemq::{observe::ConnectionEvent, observe::Observe, Exchange, Outcome, Queue, RuntimeBuilder, Topology};
use idemq_example_payments::{apply_payment, PaymentApplied, PaymentRequested, EVENTS_EXCHANGE};
use idemq_tests::fixture::{publish_stream, slow_payment, slower_payment, Bed, Running};
use idemq_tests::{eventually, in_both_modes, unique, Broker, Mode};

async fn wait_applied(bed: &Bed, at_least: usize) {
    eventually(&format!("{at_least} payments applied"), Duration::from_secs(120), || async {
        bed.ledger_total().await >= at_least as i64
    })
    .await;
}

/// Counts the deliveries a runtime takes in ([`Observe::received`]); with its settled
/// events, what it holds.
#[derive(Clone, Default)]
struct Intake(Arc<AtomicUsize>);

impl Observe for Intake {
    fn received(&self, _queue: &str) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Runs `builder`, counting what it takes in.
fn start(builder: RuntimeBuilder) -> (Running, Intake) {
    let intake = Intake::default();
    (Running::start(builder.observe(intake.clone())), intake)
}

/// Waits until the fault is absorbed: the runtime holds no delivery (each one it took
/// in is settled) and none is ready in the queue. Twice, a second apart: a message on
/// its way from the broker is in neither count for a moment. (The runtime's own
/// counts, not `rabbitmqctl list_queues`, which reports a quorum queue's count as of
/// its last metrics tick, seen here up to 5 s old.)
async fn wait_drained(bed: &Bed, running: &Running, intake: &Intake) {
    for _ in 0..2 {
        eventually("every delivery settled, none ready", Duration::from_secs(90), || async {
            intake.0.load(Ordering::SeqCst) == running.events().len()
                && bed.broker.message_count(&bed.queue).await == 0
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The books after the runtime stopped: each payment once, nothing left anywhere.
async fn assert_books_balance(bed: &Bed, payments: &[PaymentRequested]) {
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice");
    assert_eq!(bed.ledger_total().await, payments.len() as i64, "every payment applied");
    for p in payments.iter().step_by(41) {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{}", p.payment_id);
    }
    // A fresh client, straight to the broker.
    let broker = Broker::connect(&bed.amqp_url).await;
    assert_eq!(broker.message_count(&bed.queue).await, 0, "nothing left in the queue");
    assert_eq!(broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
}

fn lost(running: &Running) -> usize {
    running.connection_events().iter().filter(|e| matches!(e, ConnectionEvent::Lost { .. })).count()
}

/// A query of one `bigint` on the bed's database (0 if it fails).
async fn count(bed: &Bed, sql: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    let mut conn = bed.db.connect().await;
    diesel::dsl::sql::<diesel::sql_types::BigInt>(sql).get_result(&mut conn).await.unwrap_or(0)
}

/// A fault hook that black-holes `proxy` once the `nth` delivery is applied: its
/// transaction has committed, and its ack (its batch's) is not yet sent.
fn black_hole_at_commit(proxy: &Arc<NetworkProxy>, nth: u64) -> FaultHook {
    let (proxy, applied) = (Arc::clone(proxy), Arc::new(AtomicU64::new(0)));
    Arc::new(move |ctx: FaultContext| {
        if ctx.point == FaultPoint::AfterCommit
            && ctx.outcome == Outcome::Applied
            && applied.fetch_add(1, Ordering::SeqCst) + 1 == nth
        {
            proxy.black_hole();
        }
        Box::pin(async {})
    })
}

in_both_modes! {
/// The network to RabbitMQ black-holes mid-batch — a batch has committed, its acks
/// are not yet sent (a fault hook starts the black hole there, once the 150th
/// payment is applied) — and stays silent until both ends have given the connection
/// up: the runtime by its heartbeats (1 s: two missed and it is lost), the broker by
/// its own (it drops the consumer and requeues the unacked deliveries). Meanwhile
/// the runtime's reconnects hang (the proxy accepts them and forwards nothing). Once
/// the network is back it reconnects, the batch's lost acks bring its deliveries
/// back, and they are found as duplicates. After: every payment applied once,
/// nothing dead-lettered, the queue drained.
async fn a_broker_black_holed_mid_batch_past_two_heartbeats_loses_and_doubles_nothing() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, 600).await;
    let proxy = Arc::new(NetworkProxy::in_front_of(&bed.amqp_url).await.expect("start the proxy"));
    let (running, intake) = start(
        bed.runtime()
            .amqp_url(proxy.url_for(&bed.amqp_url))
            .heartbeat(Duration::from_secs(1))
            .reconnect_max_backoff(Duration::from_millis(500))
            .fault_hook(black_hole_at_commit(&proxy, 150))
            .consume(&bed.queue, slow_payment),
    );
    eventually("the black hole started after a commit", Duration::from_secs(60), || async {
        proxy.is_black_holed()
    })
    .await;
    eventually("the runtime gave up the silent connection", Duration::from_secs(30), || async {
        lost(&running) >= 1
    })
    .await;
    // The test's own client goes straight to the broker.
    eventually("the broker gave up the silent consumer", Duration::from_secs(60), || async {
        bed.broker.consumer_count(&bed.queue).await == 0
    })
    .await;
    proxy.restore();

    wait_applied(&bed, payments.len()).await;
    wait_drained(&bed, &running, &intake).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    let lost_acks = events.iter().filter(|e| e.redelivered && e.outcome == Outcome::Duplicate).count();
    assert!(lost_acks >= 1, "the batch whose acks went into the black hole came back as duplicates");
    assert_books_balance(&bed, &payments).await;
}
}

/// Every COMMIT that includes `payment_id`'s ledger row sleeps 3 s on the server (a
/// deferred trigger), so the test can see it in progress and black-hole it.
fn slow_commit_of(payment_id: &str) -> String {
    format!(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.payment_id = '{payment_id}' THEN PERFORM pg_sleep(3); END IF; RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();"
    )
}

in_both_modes! {
/// The network to PostgreSQL black-holes while a COMMIT is in progress on the
/// server (a deferred trigger makes one payment's COMMIT take 3 s) and other
/// transactions are open, and stays silent past that COMMIT's end (the server
/// commits; the black hole holds its answer) and for three times `handler_timeout`
/// (1 s); the runtime's new connections hang too. Once the network is back: every
/// payment applied once (the one whose COMMIT landed unanswered too), nothing
/// dead-lettered, the queue drained.
async fn a_database_black_holed_past_the_handler_timeout_with_a_commit_in_flight_loses_and_doubles_nothing() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, 600).await;
    let trigger = &payments[60];
    bed.db.connect().await.batch_execute(&slow_commit_of(&trigger.payment_id)).await.expect("the trigger");
    let proxy = NetworkProxy::in_front_of(&bed.db.url()).await.expect("start the proxy");
    let handler_timeout = Duration::from_secs(1);
    // Batches of 8 (not 64): the stream is still flowing when the slow COMMIT comes.
    let builder = match Mode::current() {
        Mode::GroupCommit => bed.runtime().batch_size(8),
        Mode::PerMessage => bed.runtime(),
    };
    let (running, intake) = start(
        builder
            .database_url(proxy.url_for(&bed.db.url()))
            .handler_timeout(handler_timeout)
            .consume(&bed.queue, slower_payment),
    );

    let sessions = format!(
        "FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid()",
        bed.db.name()
    );
    let committing = format!("SELECT count(*) {sessions} AND state = 'active' AND query LIKE '%COMMIT'");
    let in_flight = format!(
        "SELECT count(*) {sessions} AND (state LIKE 'idle in transaction%' \
         OR (state = 'active' AND query NOT LIKE '%COMMIT'))"
    );
    eventually("a COMMIT in progress beside open transactions", Duration::from_secs(60), || async {
        count(&bed, &committing).await > 0 && count(&bed, &in_flight).await > 0
    })
    .await;
    proxy.black_hole();
    let black_holed = Instant::now();
    // Held past the slow COMMIT's end on the server (its answer waits in the black
    // hole) and past the handler timeout, several times over.
    eventually("the COMMIT finished on the server", Duration::from_secs(30), || async {
        count(&bed, &committing).await == 0
    })
    .await;
    tokio::time::sleep((handler_timeout * 3).saturating_sub(black_holed.elapsed())).await;
    proxy.restore();

    wait_applied(&bed, payments.len()).await;
    wait_drained(&bed, &running, &intake).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.ledger_rows(&trigger.payment_id).await, 1, "the landed COMMIT's payment once");
    assert_books_balance(&bed, &payments).await;
}
}

/// The faults of the runtime's in-process transaction retries
/// ([`Observe::infrastructure_retry`]).
#[derive(Clone, Default)]
struct Retries(Arc<std::sync::Mutex<Vec<String>>>);

impl Observe for Retries {
    fn infrastructure_retry(&self, retry: &idemq::observe::InfrastructureRetry<'_>) {
        self.0.lock().unwrap().push(retry.fault.to_owned());
    }
}

in_both_modes! {
/// A half-open database: the network to PostgreSQL black-holes (sockets stay open,
/// the proxy's kernel keeps answering TCP keepalives, as a pooler or a hung server
/// would) while transactions are open and handlers are in their statements. idemq's
/// own statements give up after the server's `statement_timeout` and a margin (no
/// answer by then means the network is gone) and run again on a fresh connection —
/// the delivery is not held for the whole outage; a handler cut off by its timeout
/// whose cancel request PostgreSQL cannot even receive is an outage too, not a failed
/// attempt. Held until such a give-up is seen, then restored: every payment applied
/// once, no attempt charged (no retry copy), nothing dead-lettered.
async fn a_half_open_database_gives_idemqs_statements_up_and_charges_no_attempt() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, 300).await;
    let proxy = NetworkProxy::in_front_of(&bed.db.url()).await.expect("start the proxy");
    let retries = Retries::default();
    let (running, intake) = start(
        bed.runtime()
            .database_url(proxy.url_for(&bed.db.url()))
            .handler_timeout(Duration::from_secs(1))
            .observe(retries.clone())
            .consume(&bed.queue, slower_payment),
    );
    let in_flight = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid() \
         AND (state LIKE 'idle in transaction%' OR state = 'active')",
        bed.db.name()
    );
    eventually("transactions open", Duration::from_secs(60), || async {
        bed.ledger_total().await > 20 && count(&bed, &in_flight).await > 0
    })
    .await;
    proxy.black_hole();
    // The statement deadline is handler_timeout + 15 s here.
    eventually("a statement given up for want of an answer", Duration::from_secs(90), || async {
        retries.0.lock().unwrap().iter().any(|fault| fault.contains("no answer from PostgreSQL"))
    })
    .await;
    proxy.restore();

    wait_applied(&bed, payments.len()).await;
    wait_drained(&bed, &running, &intake).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    let charged: Vec<_> = events.iter().filter(|e| matches!(e.outcome, Outcome::Retry { .. })).collect();
    assert!(charged.is_empty(), "an outage charged handler attempts: {charged:?}");
    assert_books_balance(&bed, &payments).await;
}
}

/// Sessions of the bed's database holding outbox rows a relay pass claimed (`FOR
/// UPDATE SKIP LOCKED`), or took as handed over (`DELETE … WHERE id = ANY(…)`), then
/// publishing: idle in its transaction.
async fn relay_passes_open(bed: &Bed) -> i64 {
    count(
        bed,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' \
             AND state LIKE 'idle in transaction%' \
             AND (query LIKE '%idemq_outbox%SKIP LOCKED%' OR query LIKE 'DELETE FROM idemq_outbox WHERE id = ANY%')",
            bed.db.name()
        ),
    )
    .await
}

in_both_modes! {
/// Every connection of the runtime — consumers, publisher, outbox relay, database
/// pool — is reset at once while the relay is in a pass: it has claimed rows and
/// published them, and waits for the broker's confirms with its claim (or the
/// delete of the rows it was handed) open. (To catch it there, a fault hook black-holes the broker once the 100th
/// payment is applied, until such a pass is seen: it cannot end first.) The
/// payments handler publishes an event per payment through the outbox. After: every
/// payment applied once, nothing dead-lettered, the queue and the outbox drained,
/// and every payment's event published with one message id (a row re-sent after the
/// reset repeats its id).
async fn every_connection_reset_during_an_outbox_relay_pass_loses_and_doubles_nothing() {
    let bed = Bed::isolated().await;
    let events = unique("events");
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    Topology::new()
        .exchange(Exchange::fanout(EVENTS_EXCHANGE))
        .queue(Queue::new(events.clone()).bind(EVENTS_EXCHANGE, ""))
        .declare(&channel)
        .await
        .expect("declare the events exchange and queue");
    let payments = publish_stream(&bed, 400).await;
    let broker = Arc::new(NetworkProxy::in_front_of(&bed.amqp_url).await.expect("start the broker's proxy"));
    let database = NetworkProxy::in_front_of(&bed.db.url()).await.expect("start the database's proxy");
    let (running, intake) = start(
        bed.runtime()
            .amqp_url(broker.url_for(&bed.amqp_url))
            .database_url(database.url_for(&bed.db.url()))
            .reconnect_max_backoff(Duration::from_millis(500))
            .fault_hook(black_hole_at_commit(&broker, 100))
            .consume(&bed.queue, apply_payment),
    );
    eventually("the black hole started after a commit", Duration::from_secs(60), || async {
        broker.is_black_holed()
    })
    .await;
    eventually("a relay pass waits for its confirms", Duration::from_secs(30), || async {
        relay_passes_open(&bed).await > 0
    })
    .await;
    broker.reset_all();
    database.reset_all();
    broker.restore();

    wait_applied(&bed, payments.len()).await;
    eventually("the outbox drained", Duration::from_secs(60), || async {
        count(&bed, "SELECT count(*) FROM idemq_outbox").await == 0
    })
    .await;
    wait_drained(&bed, &running, &intake).await;
    let (lost, connections) = (lost(&running), running.connection_events());
    running.stop().await.expect("clean shutdown");
    assert!(lost >= 1, "the consumers' connections were reset: {connections:?}");
    assert_books_balance(&bed, &payments).await;

    let delivered = bed.broker.drain(&events).await;
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for message in &delivered {
        let event: PaymentApplied = serde_json::from_slice(&message.delivery.data).expect("an event");
        let id = message.delivery.properties.message_id().as_ref().map(|id| id.to_string());
        ids.entry(event.payment_id).or_default().insert(id.expect("a message id"));
    }
    let expected: BTreeSet<&str> = payments.iter().map(|p| p.payment_id.as_str()).collect();
    assert_eq!(ids.keys().map(String::as_str).collect::<BTreeSet<_>>(), expected, "every payment's event");
    let doubled: Vec<_> = ids.iter().filter(|(_, ids)| ids.len() != 1).collect();
    assert!(doubled.is_empty(), "one message id per payment's event: {doubled:?}");
    assert!(delivered.len() >= payments.len(), "{} events for {} payments", delivered.len(), payments.len());
}
}
