//! Exactly-once consumption of a RabbitMQ stream: the offset kept in the handler's
//! transaction. The handlers here keep no dedup rows (`dedup = false`): the offset
//! alone must make every message apply once, across restarts, lost connections
//! and a second consumer. Each test runs in a vhost of its own.

use std::collections::HashSet;
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::{idempotent_handler, HandlerError, Outcome, Partitions, Permanent, Publisher, Queue, Topology};
use idemq_example_payments::{ledger, record_payment, PaymentRequested};
use idemq_tests::fixture::{next_attempt, payment, Bed, Running};
use idemq_tests::with_timeout;

/// Applies a payment with no dedup row: only the stream's offset keeps it once.
/// 13 cents is refused for good; 7 cents fails twice before it applies.
#[idempotent_handler(key = "payment_id", name = "stream_ledger", dedup = false)]
async fn stream_ledger(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if msg.amount_cents == 13 {
        return Err(Permanent("thirteen is refused").into());
    }
    if msg.amount_cents == 7 && next_attempt(&msg.payment_id) < 3 {
        return Err(HandlerError::transient("the ledger service is down"));
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// The same effect under another name: a new consumer of the stream.
#[idempotent_handler(key = "payment_id", name = "stream_replay", dedup = false)]
async fn stream_replay(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    diesel::sql_query("INSERT INTO replayed (payment_id) VALUES ($1)")
        .bind::<diesel::sql_types::Text, _>(&msg.payment_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// A bed with a stream of its own, declared.
async fn stream_bed() -> (Bed, String) {
    let bed = Bed::isolated().await;
    let stream = idemq_tests::unique("stream");
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    topology(&stream).declare(&channel).await.expect("declare the stream");
    (bed, stream)
}

fn topology(stream: &str) -> Topology {
    Topology::new().queue(Queue::stream(stream))
}

fn runtime(bed: &Bed, stream: &str) -> idemq::RuntimeBuilder {
    bed.runtime().topology(topology(stream)).batch_size(16).consume(stream, stream_ledger)
}

async fn publish(bed: &Bed, stream: &str, payments: &[PaymentRequested]) {
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let batch = payments.iter().map(|p| idemq::outbox::Outgoing::json("", stream, p).expect("outgoing"));
    publisher.publish_all(batch).await.expect("published");
    publisher.close().await;
}

/// The ledger's payment ids, in the order they were applied.
async fn applied(bed: &Bed) -> Vec<String> {
    let mut conn = bed.db.connect().await;
    ledger::table.select(ledger::payment_id).order(ledger::id).load(&mut conn).await.expect("read the ledger")
}

async fn stored_offset(bed: &Bed, handler: &str) -> i64 {
    bed.db.count(&format!("SELECT last_offset FROM idemq_stream_offsets WHERE handler = '{handler}'")).await
}

fn ids(payments: &[PaymentRequested]) -> Vec<String> {
    payments.iter().map(|p| p.payment_id.clone()).collect()
}

/// Every message is applied once, in stream order, with the offset stored beside
/// it; a second run consumes only what came after (nothing is applied twice,
/// though no dedup row exists).
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_is_applied_once_in_order_and_a_restart_resumes_after_the_stored_offset() {
    let (bed, stream) = stream_bed().await;
    let first: Vec<_> = (0..120).map(|i| payment(1000 + i)).collect();
    publish(&bed, &stream, &first).await;
    let running = Running::start(runtime(&bed, &stream));
    running.wait_settled(first.len()).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&first), "each once, in stream order");
    assert_eq!(stored_offset(&bed, "stream_ledger").await, 119, "the offset of the last message");

    let second: Vec<_> = (0..30).map(|i| payment(2000 + i)).collect();
    publish(&bed, &stream, &second).await;
    let running = Running::start(runtime(&bed, &stream));
    running.wait_settled(second.len()).await;
    // Nothing else comes: what was applied before is not delivered to the handler.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.len(), second.len(), "only the new messages: {events:?}");
    let all: Vec<String> = ids(&first).into_iter().chain(ids(&second)).collect();
    assert_eq!(applied(&bed).await, all);
    assert_eq!(bed.db.count("SELECT count(*) FROM idemq_dedup").await, 0, "no dedup rows: the offset did it");
}

/// Bad input and a permanent failure are dead-lettered with the reason, and the
/// stream moves past them; a transient failure is retried in place, so the stream
/// keeps its order.
#[tokio::test(flavor = "multi_thread")]
async fn failures_are_dead_lettered_or_retried_in_place_and_the_order_is_kept() {
    let (bed, stream) = stream_bed().await;
    let before = payment(100);
    let refused = payment(13);
    let flaky = payment(7);
    let after = payment(200);
    publish(&bed, &stream, &[before.clone(), refused.clone()]).await;
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let not_json = idemq::outbox::Outgoing::bytes("", &stream, b"not json".to_vec()).expect("outgoing");
    publisher.publish_outgoing(not_json).await.expect("published");
    publish(&bed, &stream, &[flaky.clone(), after.clone()]).await;

    let running = Running::start(runtime(&bed, &stream));
    running.wait_settled(5).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&[before, flaky.clone(), after]), "in stream order");
    assert_eq!(idemq_tests::fixture::attempts_of(&flaky.payment_id), 3, "retried in place twice");
    let dead = bed.broker.drain(&format!("{stream}.dlq")).await;
    let kinds: Vec<_> =
        dead.iter().map(|m| idemq_tests::header_str(&m.delivery.properties, "x-idemq-error-kind")).collect();
    assert_eq!(kinds, [Some("handler".to_owned()), Some("decode".to_owned())], "in stream order");
    assert_eq!(stored_offset(&bed, "stream_ledger").await, 4);
}

/// A batch handler on a stream: each run of new messages in one call (one
/// multi-row insert), 13 cents refused for the whole call.
#[idempotent_handler(key = "payment_id", name = "stream_batch_ledger", dedup = false)]
async fn stream_batch_ledger(
    conn: &mut AsyncPgConnection,
    batch: &mut idemq::Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    if batch.messages().iter().any(|msg| msg.amount_cents == 13) {
        return Err(Permanent("thirteen is refused").into());
    }
    idemq_example_payments::record_payments(conn, batch.messages()).await?;
    Ok(())
}

/// A batch handler consumes a stream: its runs are applied in one call each, in
/// offset order; a call that fails runs again in halves until the failing message
/// is alone, which is dead-lettered, and the rest is applied around it, in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_handler_applies_runs_in_order_and_isolates_a_refused_message() {
    let (bed, stream) = stream_bed().await;
    let mut payments: Vec<_> = (0..60).map(|i| payment(20_000 + i)).collect();
    let refused = payment(13);
    payments.insert(30, refused.clone());
    publish(&bed, &stream, &payments).await;
    let builder =
        bed.runtime().topology(topology(&stream)).batch_size(16).consume(&stream, stream_batch_ledger);
    let running = Running::start(builder);
    let events = running.wait_until("every payment settled", |events| events.len() >= payments.len()).await;
    running.stop().await.expect("clean shutdown");
    let kept: Vec<_> = payments.iter().filter(|p| p.payment_id != refused.payment_id).cloned().collect();
    assert_eq!(applied(&bed).await, ids(&kept), "each once, in stream order, around the refused one");
    assert!(events.iter().any(|e| e.batch > 1), "runs were applied together: {events:?}");
    let dead = bed.broker.drain(&format!("{stream}.dlq")).await;
    assert_eq!(dead.len(), 1, "the refused payment alone is dead-lettered");
    let body: PaymentRequested = serde_json::from_slice(&dead[0].delivery.data).expect("a payment");
    assert_eq!(body.payment_id, refused.payment_id);
    assert_eq!(stored_offset(&bed, "stream_batch_ledger").await, payments.len() as i64 - 1);
}

/// The broker closes every connection while the stream is being consumed: the
/// consumer subscribes again after the stored offset and every payment is applied
/// exactly once — with no dedup row to catch a second application.
#[tokio::test(flavor = "multi_thread")]
async fn a_closed_broker_connection_resumes_after_the_offset_with_nothing_applied_twice() {
    let (bed, stream) = stream_bed().await;
    let payments: Vec<_> = (0..400).map(|i| payment(3000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let running = Running::start(runtime(&bed, &stream).batch_size(4));
    running.wait_until("some applied", |events| events.len() >= 60).await;
    bed.vhost.as_ref().expect("isolated").close_all_connections().await;
    running.wait_settled(payments.len()).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&payments), "each once, in order");
}

/// Two runtimes consume one stream for one handler: one owns it, the other waits;
/// when the owner stops, the other takes over at the stored offset.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_process_waits_and_takes_over_at_the_stored_offset() {
    let (bed, stream) = stream_bed().await;
    let first: Vec<_> = (0..50).map(|i| payment(4000 + i)).collect();
    publish(&bed, &stream, &first).await;
    let owner = Running::start(runtime(&bed, &stream));
    owner.wait_settled(first.len()).await;
    let standby = Running::start(runtime(&bed, &stream));
    let second: Vec<_> = (0..50).map(|i| payment(5000 + i)).collect();
    publish(&bed, &stream, &second).await;
    owner.wait_settled(first.len() + second.len()).await;
    assert!(standby.events().is_empty(), "the standby consumed nothing while the owner ran");
    owner.stop().await.expect("clean shutdown");
    let third: Vec<_> = (0..50).map(|i| payment(6000 + i)).collect();
    publish(&bed, &stream, &third).await;
    with_timeout("the standby takes over", Duration::from_secs(30), standby.wait_settled(third.len())).await;
    standby.stop().await.expect("clean shutdown");
    let all: Vec<String> = [first, second, third].iter().flat_map(|p| ids(p)).collect();
    assert_eq!(applied(&bed).await, all, "each once, in order, across the take-over");
}

/// A new handler name reads the stream from its first message: a replay into a new
/// projection, while the first handler's offset stays where it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_handler_replays_the_stream_from_offset_zero() {
    let (bed, stream) = stream_bed().await;
    let payments: Vec<_> = (0..40).map(|i| payment(7000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let running = Running::start(runtime(&bed, &stream));
    running.wait_settled(payments.len()).await;
    running.stop().await.expect("clean shutdown");
    let mut conn = bed.db.connect().await;
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut conn,
        "CREATE TABLE replayed (id bigserial, payment_id text)",
    )
    .await
    .expect("the projection's table");
    let replay = Running::start(bed.runtime().topology(topology(&stream)).consume(&stream, stream_replay));
    replay.wait_settled(payments.len()).await;
    let events = replay.events();
    replay.stop().await.expect("clean shutdown");
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied));
    let replayed: Vec<String> = diesel::sql_query("SELECT payment_id FROM replayed ORDER BY id")
        .load::<Replayed>(&mut conn)
        .await
        .expect("read")
        .into_iter()
        .map(|r| r.payment_id)
        .collect();
    assert_eq!(replayed, ids(&payments), "every message, from the first");
    assert_eq!(stored_offset(&bed, "stream_ledger").await, 39);
    assert_eq!(stored_offset(&bed, "stream_replay").await, 39);
}

#[derive(diesel::QueryableByName)]
struct Replayed {
    #[diesel(sql_type = diesel::sql_types::Text)]
    payment_id: String,
}

static GATE_REACHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Applies payments, but holds the one of 8050 cents until the test opens the gate.
#[idempotent_handler(key = "payment_id", name = "stream_gated", dedup = false)]
async fn stream_gated(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    use std::sync::atomic::Ordering;
    if msg.amount_cents == 8050 {
        GATE_REACHED.store(true, Ordering::SeqCst);
        while !std::sync::atomic::AtomicBool::load(&GATE_OPEN, Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// Fencing: while a handler runs, the stored offset is moved past it (as a
/// consumer that took over would): its transaction finds the offset moved, rolls
/// back, and the consumer resumes after the new offset. Nothing between is applied.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_whose_offset_was_moved_rolls_back_and_the_consumer_resumes_after_it() {
    use std::sync::atomic::Ordering;
    let (bed, stream) = stream_bed().await;
    let payments: Vec<_> = (0..100).map(|i| payment(8000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let running = Running::start(
        bed.runtime().topology(topology(&stream)).batch_size(1).consume(&stream, stream_gated),
    );
    idemq_tests::eventually("the handler of offset 50 holds", Duration::from_secs(30), || async {
        std::sync::atomic::AtomicBool::load(&GATE_REACHED, Ordering::SeqCst)
    })
    .await;
    let mut conn = bed.db.connect().await;
    diesel::sql_query("UPDATE idemq_stream_offsets SET last_offset = 89 WHERE handler = 'stream_gated'")
        .execute(&mut conn)
        .await
        .expect("move the offset");
    GATE_OPEN.store(true, Ordering::SeqCst);
    running.wait_until("the last payment applied", |events| events.len() >= 60).await;
    running.stop().await.expect("clean shutdown");
    let expected: Vec<String> = ids(&payments[..50]).into_iter().chain(ids(&payments[90..])).collect();
    assert_eq!(applied(&bed).await, expected, "50..=89 were skipped: the held transaction rolled back");
    assert_eq!(stored_offset(&bed, "stream_gated").await, 99);
}

/// With dedup rows (the default), a message published twice — a publisher's
/// retransmission lands at a second offset — is applied once; what the handler
/// publishes goes through the outbox, once per payment.
#[idempotent_handler(key = "payment_id", name = "stream_events")]
async fn stream_events(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut idemq::Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let event = idemq_example_payments::PaymentApplied {
        payment_id: msg.payment_id.clone(),
        account: msg.account.clone(),
        amount_cents: msg.amount_cents,
    };
    ctx.publish("", &msg.account, &event)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn with_dedup_rows_a_retransmitted_message_is_applied_once_and_its_event_published_once() {
    let (bed, stream) = stream_bed().await;
    let events = idemq_tests::unique("events");
    bed.broker.declare_queue(&events).await;
    let payments: Vec<_> =
        (0..10).map(|i| PaymentRequested { account: events.clone(), ..payment(9000 + i) }).collect();
    let mut published = payments.clone();
    published.insert(4, payments[3].clone());
    published.push(payments[7].clone());
    publish(&bed, &stream, &published).await;
    let running = Running::start(bed.runtime().topology(topology(&stream)).consume(&stream, stream_events));
    running.wait_settled(published.len()).await;
    idemq_tests::eventually("ten events", Duration::from_secs(20), || async {
        bed.broker.message_count(&events).await >= 10
    })
    .await;
    let outcomes: Vec<Outcome> = running.events().into_iter().map(|e| e.outcome).collect();
    running.stop().await.expect("clean shutdown");
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::Duplicate).count(), 2, "{outcomes:?}");
    assert_eq!(applied(&bed).await, ids(&payments), "each once, in order");
    assert_eq!(bed.broker.message_count(&events).await, 10, "one event per payment");
}

/// Every PostgreSQL session of the test's database is killed mid-stream — the
/// pool's, the owner's lock connection, the relay's: the consumer takes its lock
/// again, reads its offset and goes on; each payment is applied once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn killed_database_sessions_lose_and_double_nothing() {
    let (bed, stream) = stream_bed().await;
    let payments: Vec<_> = (0..300).map(|i| payment(10_000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let running = Running::start(runtime(&bed, &stream).batch_size(4));
    running.wait_until("some applied", |events| events.len() >= 40).await;
    let killed = bed.db.kill_sessions().await;
    assert!(killed >= 2, "the lock's connection and the pool's at least: {killed}");
    running.wait_settled(payments.len()).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&payments), "each once, in order");
}

/// The owner is SIGKILLed inside a transaction, its effect written and not
/// committed: the process waiting for the stream takes over at the stored offset
/// and applies the rest, each payment once, in order — with no dedup rows.
#[tokio::test(flavor = "multi_thread")]
async fn a_sigkilled_owner_is_taken_over_at_the_stored_offset_with_nothing_applied_twice() {
    use idemq_tests::fixture::ConsumerProcess;
    const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");
    let (bed, stream) = stream_bed().await;
    let payments: Vec<_> = (0..300).map(|i| payment(11_000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let doomed = payments[150].payment_id.clone();
    let env = [("STREAM", "1"), ("QUEUE", stream.as_str()), ("SLOW_MS", "3")];
    let mut owner = ConsumerProcess::spawn(CONSUMER, &bed, &[env[0], env[1], env[2], ("KILL_ON", &doomed)]);
    idemq_tests::eventually("the first process owns the stream", Duration::from_secs(30), || async {
        !applied(&bed).await.is_empty()
    })
    .await;
    let standby = ConsumerProcess::spawn(CONSUMER, &bed, &env);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while owner.exited().is_none() {
        assert!(std::time::Instant::now() < deadline, "the owner did not kill itself at {doomed}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    idemq_tests::eventually("every payment applied", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= payments.len()
    })
    .await;
    assert!(standby.terminate(Duration::from_secs(20)).await.success());
    assert_eq!(applied(&bed).await, ids(&payments), "each once, in order, across the kill");
}

/// A stream handler's result.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Receipt {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id", name = "stream_quote", dedup = false)]
async fn stream_quote(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<Receipt, HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id })
}

/// A request published to a stream is answered through the outbox, as from a queue.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_on_a_stream_is_answered() {
    let (bed, stream) = stream_bed().await;
    let running = Running::start(bed.runtime().topology(topology(&stream)).consume(&stream, stream_quote));
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let asked = payment(12_000);
    let request = idemq::outbox::Outgoing::json("", &stream, &asked).expect("outgoing");
    let reply = publisher.request_outgoing(request, Duration::from_secs(20)).await.expect("a reply");
    running.stop().await.expect("clean shutdown");
    let receipt: Receipt = serde_json::from_slice(&reply).expect("a receipt");
    assert_eq!(receipt.payment_id, asked.payment_id);
}

#[idempotent_handler(key = "payment_id", name = "stream_quote_once")]
async fn stream_quote_once(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<Receipt, HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id })
}

/// With dedup rows, a request sent twice (the client retried: a second message
/// with the same key, at another offset) is applied once and both are answered
/// with the same reply, the second from the stored result.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicated_request_on_a_stream_gets_the_stored_reply() {
    let (bed, stream) = stream_bed().await;
    let running =
        Running::start(bed.runtime().topology(topology(&stream)).consume(&stream, stream_quote_once));
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let asked = payment(12_500);
    let mut replies = Vec::new();
    for _ in 0..2 {
        let request = idemq::outbox::Outgoing::json("", &stream, &asked).expect("outgoing");
        replies.push(publisher.request_outgoing(request, Duration::from_secs(20)).await.expect("a reply"));
    }
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(replies[0], replies[1], "the same reply, byte for byte");
    let receipt: Receipt = serde_json::from_slice(&replies[1]).expect("a receipt");
    assert_eq!(receipt.payment_id, asked.payment_id);
    let outcomes: Vec<_> = events.iter().map(|e| e.outcome.clone()).collect();
    assert_eq!(outcomes, [Outcome::Applied, Outcome::Duplicate]);
    assert_eq!(applied(&bed).await, vec![asked.payment_id], "applied once");
}

/// Publishes each payment to its partition (routed by its key).
async fn publish_partitioned(bed: &Bed, partitions: &Partitions, payments: &[PaymentRequested]) {
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let batch = payments.iter().map(|p| {
        idemq::outbox::Outgoing::json(partitions.name(), partitions.routing_key(&p.payment_id), p)
            .expect("outgoing")
    });
    publisher.publish_all(batch).await.expect("published");
    publisher.close().await;
}

/// Which process (pid) applied each payment, by partition: (partition, pid) pairs.
async fn handled(bed: &Bed, partitions: &Partitions, payments: &[PaymentRequested]) -> HashSet<(u16, i64)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        payment_id: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pid: i64,
    }
    let mut conn = bed.db.connect().await;
    let rows: Vec<Row> = diesel::sql_query("SELECT payment_id, pid FROM handled_by")
        .load(&mut conn)
        .await
        .expect("handled_by");
    let wanted: HashSet<&str> = payments.iter().map(|p| p.payment_id.as_str()).collect();
    rows.into_iter()
        .filter(|row| wanted.contains(row.payment_id.as_str()))
        .map(|row| (partitions.partition_of(&row.payment_id), row.pid))
        .collect()
}

/// The ledger holds each of `all` once, and each partition's payments in the order
/// they were published to it.
async fn each_once_in_its_streams_order(bed: &Bed, partitions: &Partitions, all: &[PaymentRequested]) {
    let ledger = applied(bed).await;
    assert_eq!(ledger.len(), all.len(), "each payment once");
    for partition in 0..partitions.count() {
        let of = |ids: Vec<String>| -> Vec<String> {
            ids.into_iter().filter(|id| partitions.partition_of(id) == partition).collect()
        };
        assert_eq!(of(ledger.clone()), of(ids(all)), "stream {partition}'s payments once each, in its order");
    }
}

/// How many processes (told apart by their connections' `application_name`) hold
/// a stream's owner lock in the test's database.
async fn owning_processes(bed: &Bed) -> i64 {
    bed.db
        .count(
            "SELECT count(DISTINCT a.application_name) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND a.datname = current_database()",
        )
        .await
}

/// Partitioning: two processes consume two partitioned streams with one handler.
/// The first, alone, owns both; once the second starts, the first gives one up and
/// each owns one (each stream's payments of the next wave are applied by one
/// process, the two streams' by different ones); when one is SIGKILLed, the other
/// takes its stream over at the stored offset. Every payment is applied once, each
/// stream's in its publish order, with no dedup rows.
#[tokio::test(flavor = "multi_thread")]
async fn two_processes_share_two_partitioned_streams_and_one_takes_both_when_the_other_dies() {
    use idemq_tests::fixture::ConsumerProcess;
    const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");
    let bed = Bed::isolated().await;
    let name = idemq_tests::unique("partitioned");
    let partitions = Partitions::new(name.as_str(), 2);
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    Topology::new().partitions(partitions.clone()).declare(&channel).await.expect("declare the partitions");
    let mut conn = bed.db.connect().await;
    diesel_async::SimpleAsyncConnection::batch_execute(
        &mut conn,
        "CREATE TABLE handled_by (payment_id text PRIMARY KEY, pid bigint NOT NULL)",
    )
    .await
    .expect("the handled_by table");
    // Told apart in `pg_stat_activity` by their connections' application_name.
    let spawn = |tag: &str| {
        let url = format!("{}?application_name={tag}", bed.db.url());
        let env = [("STREAM", "1"), ("PARTITIONS", "2"), ("QUEUE", name.as_str()), ("SLOW_MS", "2")];
        ConsumerProcess::spawn(
            CONSUMER,
            &bed,
            &[env[0], env[1], env[2], env[3], ("DATABASE_URL", url.as_str())],
        )
    };
    let wave = |from: i64, n: i64| (0..n).map(|i| payment(from + i)).collect::<Vec<_>>();

    let mut first = spawn("first");
    let alone = wave(30_000, 100);
    publish_partitioned(&bed, &partitions, &alone).await;
    idemq_tests::eventually("the first process applied the first wave", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= alone.len()
    })
    .await;
    let first_pid = i64::from(first.id());
    assert_eq!(
        handled(&bed, &partitions, &alone).await,
        HashSet::from([(0, first_pid), (1, first_pid)]),
        "alone, it owns both"
    );

    let second = spawn("second");
    let second_pid = i64::from(second.id());
    idemq_tests::eventually("each process owns one stream", Duration::from_secs(60), || async {
        owning_processes(&bed).await == 2
    })
    .await;
    let shared = wave(31_000, 200);
    publish_partitioned(&bed, &partitions, &shared).await;
    idemq_tests::eventually("the second wave applied", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= alone.len() + shared.len()
    })
    .await;
    let by_partition = handled(&bed, &partitions, &shared).await;
    assert_eq!(by_partition.len(), 2, "each stream's wave applied by one process: {by_partition:?}");
    let pids: HashSet<i64> = by_partition.iter().map(|(_, pid)| *pid).collect();
    assert_eq!(pids, HashSet::from([first_pid, second_pid]), "one stream each: {by_partition:?}");

    first.kill();
    let survivor = wave(32_000, 100);
    publish_partitioned(&bed, &partitions, &survivor).await;
    idemq_tests::eventually("the third wave applied by the survivor", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= alone.len() + shared.len() + survivor.len()
    })
    .await;
    assert_eq!(
        handled(&bed, &partitions, &survivor).await,
        HashSet::from([(0, second_pid), (1, second_pid)]),
        "the survivor took the dead one's stream over"
    );
    assert!(second.terminate(Duration::from_secs(20)).await.success());

    let all: Vec<PaymentRequested> = alone.into_iter().chain(shared).chain(survivor).collect();
    each_once_in_its_streams_order(&bed, &partitions, &all).await;
    assert_eq!(
        bed.db.count("SELECT count(*) FROM idemq_dedup").await,
        0,
        "no dedup rows: the offsets did it"
    );
}

// ---------------------------------------------------------------------------
// Stream ownership follows the broker (issue 34, item 3): a process that reaches
// PostgreSQL but not RabbitMQ must not hold a stream's lock, or the stream stalls
// behind it while a healthy process waits.

/// The release bound of these tests: short, so that a take-over is quick.
const RELEASE: Duration = Duration::from_secs(2);

/// `/readyz` of a runtime serving on `addr`.
async fn readyz(addr: std::net::SocketAddr) -> String {
    tokio::task::spawn_blocking(move || idemq_tests::http_get(addr, "/readyz")).await.expect("GET /readyz")
}

/// Stages the owner of a stream cut from the broker only (its broker link
/// black-holed by a proxy; its database link untouched) while a standby that reaches
/// both waits: the owner must give the stream up after the release bound and say so
/// on `/readyz` (503, waiting for the broker); the standby takes over at the stored
/// offset and applies what follows. Every payment is applied once, in order, though
/// no dedup row exists; once the link heals the former owner stays a standby.
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_cut_from_the_broker_gives_the_stream_up_and_a_standby_takes_over() {
    let (bed, stream) = stream_bed().await;
    let proxy = idemq::testing::NetworkProxy::in_front_of(&bed.amqp_url).await.expect("a proxy");
    let addr = idemq_tests::free_addr();
    let owner = Running::start(
        runtime(&bed, &stream)
            .amqp_url(proxy.url_for(&bed.amqp_url))
            .release_streams_after(RELEASE)
            .http_addr(addr),
    );
    let first: Vec<_> = (0..50).map(|i| payment(7000 + i)).collect();
    publish(&bed, &stream, &first).await;
    owner.wait_settled(first.len()).await;
    idemq_tests::eventually(
        "the owner's /readyz says it owns the stream",
        Duration::from_secs(20),
        || async { readyz(addr).await.contains(&format!("stream {stream} (stream_ledger): owned")) },
    )
    .await;
    let standby = Running::start(runtime(&bed, &stream).release_streams_after(RELEASE));

    proxy.black_hole();
    let second: Vec<_> = (0..50).map(|i| payment(8000 + i)).collect();
    publish(&bed, &stream, &second).await;
    with_timeout("the standby takes over", Duration::from_secs(60), standby.wait_settled(second.len())).await;
    let ready = readyz(addr).await;
    assert!(
        ready.contains(" 503")
            && ready.contains(&format!("stream {stream} (stream_ledger): waiting for the broker")),
        "the cut-off owner is not ready: {ready}"
    );

    proxy.restore();
    let third: Vec<_> = (0..50).map(|i| payment(9000 + i)).collect();
    publish(&bed, &stream, &third).await;
    with_timeout(
        "the standby goes on",
        Duration::from_secs(30),
        standby.wait_settled(second.len() + third.len()),
    )
    .await;
    assert_eq!(owner.events().len(), first.len(), "the former owner applied nothing after it was cut off");
    standby.stop().await.expect("clean shutdown");
    owner.stop().await.expect("clean shutdown");
    let all: Vec<String> = [first, second, third].iter().flat_map(|p| ids(p)).collect();
    assert_eq!(applied(&bed).await, all, "each once, in order, across the take-over");
}

/// Stages a process started while its broker link is black-holed, beside nothing
/// yet: it must not take the stream's lock (it could not consume). A healthy process
/// started after it owns the stream and applies every payment; the first one's
/// `/readyz` says it waits for the broker.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_started_during_a_broker_outage_never_holds_the_stream() {
    let (bed, stream) = stream_bed().await;
    let proxy = idemq::testing::NetworkProxy::in_front_of(&bed.amqp_url).await.expect("a proxy");
    proxy.black_hole();
    let addr = idemq_tests::free_addr();
    let stuck = Running::start(
        runtime(&bed, &stream)
            .amqp_url(proxy.url_for(&bed.amqp_url))
            .release_streams_after(RELEASE)
            .http_addr(addr),
    );
    idemq_tests::eventually("the stuck process waits for the broker", Duration::from_secs(20), || async {
        readyz(addr).await.contains(" 503")
    })
    .await;
    let payments: Vec<_> = (0..200).map(|i| payment(10_000 + i)).collect();
    publish(&bed, &stream, &payments).await;
    let healthy = Running::start(runtime(&bed, &stream).release_streams_after(RELEASE));
    with_timeout(
        "the healthy process applies the stream",
        Duration::from_secs(60),
        healthy.wait_settled(payments.len()),
    )
    .await;
    let ready = readyz(addr).await;
    assert!(ready.contains(&format!("stream {stream} (stream_ledger): waiting for the broker")), "{ready}");
    assert!(stuck.events().is_empty());
    healthy.stop().await.expect("clean shutdown");
    proxy.restore();
    stuck.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&payments), "each once, in order");
}

/// Partitions: two processes share two partitioned streams, one each; one of them
/// is cut from the broker only. It must give its stream up *and* stop counting
/// among the processes sharing them, so that the other's share grows to both and it
/// takes the stream over. Every payment is applied once, each stream's in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_partition_owner_cut_from_the_broker_gives_its_stream_to_the_other_process() {
    let bed = Bed::isolated().await;
    let partitions = Partitions::new(idemq_tests::unique("partitioned").as_str(), 2);
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    Topology::new().partitions(partitions.clone()).declare(&channel).await.expect("declare the partitions");
    let proxy = idemq::testing::NetworkProxy::in_front_of(&bed.amqp_url).await.expect("a proxy");
    let partitioned = |bed: &Bed| {
        bed.runtime()
            .topology(Topology::new().partitions(partitions.clone()))
            .batch_size(16)
            .release_streams_after(RELEASE)
            .consume_partitions(&partitions, stream_ledger)
    };
    // Told apart in `pg_stat_activity` by their connections' application_name.
    let named = |tag: &str| format!("{}?application_name={tag}", bed.db.url());
    let cut =
        Running::start(partitioned(&bed).amqp_url(proxy.url_for(&bed.amqp_url)).database_url(named("cut")));
    let healthy = Running::start(partitioned(&bed).database_url(named("healthy")));
    idemq_tests::eventually("each process owns one stream", Duration::from_secs(60), || async {
        owning_processes(&bed).await == 2
    })
    .await;
    let shared: Vec<_> = (0..100).map(|i| payment(11_000 + i)).collect();
    publish_partitioned(&bed, &partitions, &shared).await;
    idemq_tests::eventually("the first wave applied", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= shared.len()
    })
    .await;
    assert!(!cut.events().is_empty() && !healthy.events().is_empty(), "each applied its stream's share");

    proxy.black_hole();
    let after: Vec<_> = (0..100).map(|i| payment(12_000 + i)).collect();
    publish_partitioned(&bed, &partitions, &after).await;
    // The cut process cannot read either stream now: whatever of the second wave is
    // applied, the healthy process applied. (Counting its events from here would
    // race: it may apply some of its own stream's share before they are counted.)
    let all: Vec<PaymentRequested> = shared.into_iter().chain(after).collect();
    idemq_tests::eventually("the healthy process takes both streams", Duration::from_secs(60), || async {
        applied(&bed).await.len() >= all.len()
    })
    .await;
    healthy.stop().await.expect("clean shutdown");
    proxy.restore();
    cut.stop().await.expect("clean shutdown");

    each_once_in_its_streams_order(&bed, &partitions, &all).await;
}

static LAG_GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Applies payments once the test opens its gate.
#[idempotent_handler(key = "payment_id", name = "stream_held", dedup = false)]
async fn stream_held(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    while !std::sync::atomic::AtomicBool::load(&LAG_GATE_OPEN, std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// Each stream lag the runtime reports.
#[derive(Default)]
struct Lags(std::sync::Mutex<Vec<(String, i64)>>);

impl idemq::observe::Observe for Lags {
    fn stream_lag(&self, lag: &idemq::observe::StreamLag<'_>) {
        self.0.lock().unwrap().push((lag.stream.to_owned(), lag.messages));
    }
}

/// The consumer reads its stream's end when it starts (and every 15 s): held at
/// its first message, it reports the whole backlog as its lag, on the metrics and
/// to observers; then it applies all of it.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_consumer_held_at_its_first_message_reports_the_backlog_as_its_lag() {
    let (bed, stream) = stream_bed().await;
    let backlog: Vec<_> = (0..40).map(|i| payment(9000 + i)).collect();
    publish(&bed, &stream, &backlog).await;
    let lags = std::sync::Arc::new(Lags::default());
    let addr = idemq_tests::free_addr();
    let builder = bed
        .runtime()
        .topology(topology(&stream))
        .consume(&stream, stream_held)
        .observe(std::sync::Arc::clone(&lags))
        .http_addr(addr);
    let running = Running::start(builder);
    idemq_tests::eventually("the lag read", Duration::from_secs(30), || async {
        lags.0.lock().unwrap().iter().any(|(_, messages)| *messages > 0)
    })
    .await;
    assert_eq!(lags.0.lock().unwrap()[0], (stream.clone(), 40), "the backlog, nothing applied yet");
    let metrics = idemq_tests::http_get(addr, "/metrics");
    let series = format!("idemq_stream_lag_messages{{stream=\"{stream}\",handler=\"stream_held\"}} 40");
    assert!(metrics.contains(&series), "{series} in:\n{metrics}");
    LAG_GATE_OPEN.store(true, std::sync::atomic::Ordering::SeqCst);
    running.wait_settled(backlog.len()).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(applied(&bed).await, ids(&backlog));
}
