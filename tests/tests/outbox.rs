//! The transactional outbox: a handler's messages are published exactly when its
//! transaction commits, at least once with one stable message id, by the relay.
//! Each test runs in a vhost of its own, so its target queues go with it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use idemq::{idempotent_handler, Context, HandlerError, Permanent};
use idemq_example_payments::{record_payment, PaymentApplied, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, in_both_modes, Broker};
use lapin::message::BasicGetMessage;

/// Where the test handlers publish: a queue named in the payment's account.
#[idempotent_handler(key = "payment_id", name = "notify")]
async fn record_and_notify(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let event = PaymentApplied {
        payment_id: msg.payment_id.clone(),
        account: msg.account.clone(),
        amount_cents: msg.amount_cents,
    };
    ctx.publish("", &msg.account, &event)?;
    if msg.amount_cents < 0 {
        // Published, then failed: the rollback takes the outbox row with it.
        return Err(Permanent("negative amount").into());
    }
    Ok(())
}

/// A payment whose event goes to `target`.
fn payment_to(target: &str, amount_cents: i64) -> PaymentRequested {
    PaymentRequested { account: target.to_owned(), ..payment(amount_cents) }
}

/// The events in `queue`, taken off it: payment id → message ids seen.
async fn take_events(broker: &Broker, queue: &str) -> (usize, BTreeMap<String, BTreeSet<String>>) {
    let messages = broker.drain(queue).await;
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for message in &messages {
        let event: PaymentApplied = serde_json::from_slice(&message.delivery.data).expect("an event");
        ids.entry(event.payment_id).or_default().insert(message_id(message));
    }
    (messages.len(), ids)
}

fn message_id(message: &BasicGetMessage) -> String {
    message.delivery.properties.message_id().as_ref().map(|id| id.to_string()).expect("a message id")
}

/// The outbox's rows: routing key, failed attempts, last error.
async fn outbox_rows(bed: &Bed) -> Vec<(String, i32, Option<String>)> {
    use diesel::prelude::*;
    use diesel_async::RunQueryDsl;
    use idemq::store::schema::idemq_outbox::dsl::*;
    let mut conn = bed.db.connect().await;
    idemq_outbox
        .select((routing_key, attempts, last_error))
        .order(id)
        .load(&mut conn)
        .await
        .expect("read the outbox")
}

async fn backlog(bed: &Bed) -> i64 {
    let mut conn = bed.db.connect().await;
    idemq::outbox::backlog(&mut conn).await.expect("count the outbox")
}

in_both_modes! {
    /// Ten payments, every other one published twice: ten events, one per payment,
    /// each with its own message id; the outbox is empty afterwards.
    async fn each_applied_message_publishes_its_event_once() {
        let bed = Bed::isolated().await;
        let target = idemq_tests::unique("events");
        bed.broker.declare_queue(&target).await;
        let payments: Vec<_> = (0..10).map(|i| payment_to(&target, 100 + i)).collect();
        for (i, payment) in payments.iter().enumerate() {
            bed.publish(payment).await;
            if i % 2 == 0 {
                bed.publish(payment).await;
            }
        }
        let running = Running::start(bed.runtime().consume(&bed.queue, record_and_notify));
        running.wait_settled(15).await;
        eventually("ten events published", Duration::from_secs(20), || async {
            bed.broker.message_count(&target).await >= 10
        })
        .await;
        running.stop().await.expect("clean shutdown");
        let (copies, ids) = take_events(&bed.broker, &target).await;
        assert_eq!(copies, 10, "one event per payment, none for the duplicates");
        assert_eq!(ids.len(), 10);
        let distinct: BTreeSet<&String> = ids.values().flatten().collect();
        assert_eq!(distinct.len(), 10, "each event has its own message id: {ids:?}");
        assert_eq!(backlog(&bed).await, 0, "sent rows are deleted");
    }
}

in_both_modes! {
    /// A handler that publishes and then fails rolls its outbox row back with its
    /// effect: the failing payment has no event; its neighbours (in group commit,
    /// in its batch) have exactly one each.
    async fn a_handler_that_rolls_back_publishes_nothing() {
        let bed = Bed::isolated().await;
        let target = idemq_tests::unique("events");
        bed.broker.declare_queue(&target).await;
        let good: Vec<_> = (0..4).map(|i| payment_to(&target, 100 + i)).collect();
        let bad = payment_to(&target, -1);
        for payment in good.iter().take(2).chain([&bad]).chain(good.iter().skip(2)) {
            bed.publish(payment).await;
        }
        let running = Running::start(bed.runtime().consume(&bed.queue, record_and_notify));
        running.wait_settled(5).await;
        eventually("four events published", Duration::from_secs(20), || async {
            bed.broker.message_count(&target).await >= 4
        })
        .await;
        running.stop().await.expect("clean shutdown");
        let (copies, ids) = take_events(&bed.broker, &target).await;
        assert_eq!(copies, 4);
        assert!(!ids.contains_key(&bad.payment_id), "the rolled-back handler's event was published");
        assert_eq!(bed.broker.message_count(&bed.dlq).await, 1, "the failing payment is dead-lettered");
        assert_eq!(backlog(&bed).await, 0);
    }
}

/// Committed but not yet relayed (the runtime's relay is off: as if the process
/// died right after COMMIT): the rows wait in the outbox, nothing is published;
/// a relay started later publishes each exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn rows_committed_before_a_crash_are_published_once_by_the_next_relay() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    for i in 0..6 {
        bed.publish(&payment_to(&target, 100 + i)).await;
    }
    let running = Running::start(bed.runtime().relay(false).consume(&bed.queue, record_and_notify));
    running.wait_settled(6).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(backlog(&bed).await, 6, "every committed event waits in the outbox");
    assert_eq!(bed.broker.message_count(&target).await, 0, "nothing is published before a relay runs");

    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = idemq::outbox::Relay::builder()
        .amqp_url(&bed.amqp_url)
        .database_url(bed.db.url())
        .build()
        .expect("a valid relay");
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    eventually("the relay empties the outbox", Duration::from_secs(20), || async {
        backlog(&bed).await == 0
    })
    .await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay run");
    let (copies, ids) = take_events(&bed.broker, &target).await;
    assert_eq!((copies, ids.len()), (6, 6), "each row published once");
}

/// The broker confirmed the publish but the relay could not delete the row (as if
/// it crashed between the two): the row is published again, with the same message
/// id, so a consumer keyed on it applies it once.
#[tokio::test(flavor = "multi_thread")]
async fn a_resent_row_carries_the_same_message_id() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let mut conn = bed.db.connect().await;
    // Deleting outbox rows fails while `hold_outbox` has a row.
    conn.batch_execute(
        "CREATE TABLE hold_outbox (x int);
         INSERT INTO hold_outbox VALUES (1);
         CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF EXISTS (SELECT 1 FROM hold_outbox) THEN RAISE EXCEPTION 'lost before the delete'; END IF;
           RETURN OLD;
         END $$;
         CREATE TRIGGER refuse_delete BEFORE DELETE ON idemq_outbox FOR EACH ROW EXECUTE FUNCTION refuse_delete();",
    )
    .await
    .expect("install the trigger");
    bed.publish(&payment_to(&target, 100)).await;
    let running = Running::start(
        bed.runtime().relay_poll_interval(Duration::from_millis(50)).consume(&bed.queue, record_and_notify),
    );
    eventually("the event published twice", Duration::from_secs(30), || async {
        bed.broker.message_count(&target).await >= 2
    })
    .await;
    conn.batch_execute("DELETE FROM hold_outbox").await.expect("release the delete");
    eventually("the outbox emptied", Duration::from_secs(30), || async { backlog(&bed).await == 0 }).await;
    running.stop().await.expect("clean shutdown");
    let (copies, ids) = take_events(&bed.broker, &target).await;
    assert!(copies >= 2, "re-sent: {copies}");
    assert_eq!(ids.len(), 1);
    assert_eq!(ids.values().next().map(BTreeSet::len), Some(1), "every copy has one message id: {ids:?}");
}

/// A message no queue is bound for is returned (`mandatory`), not dropped: it stays
/// in the outbox with the reason, retried with backoff, and goes out once its queue
/// exists. A row for a missing exchange waits too, without holding up the others.
#[tokio::test(flavor = "multi_thread")]
async fn an_unroutable_message_waits_in_the_outbox_until_it_can_be_routed() {
    let bed = Bed::isolated().await;
    let missing = idemq_tests::unique("later");
    let present = idemq_tests::unique("events");
    bed.broker.declare_queue(&present).await;
    let mut conn = bed.db.connect().await;
    idemq::outbox::enqueue(
        &mut conn,
        idemq::outbox::Outgoing::json("", &missing, &serde_json::json!({"n": 1})).unwrap(),
    )
    .await
    .expect("enqueue");
    idemq::outbox::enqueue(
        &mut conn,
        idemq::outbox::Outgoing::json("no-such-exchange", "x", &serde_json::json!({"n": 2})).unwrap(),
    )
    .await
    .expect("enqueue");
    let given = idemq::outbox::enqueue(
        &mut conn,
        idemq::outbox::Outgoing::json("", &present, &1).unwrap().message_id("given-id"),
    )
    .await
    .expect("enqueue");
    assert_eq!(given, "given-id");
    let running = Running::start(
        bed.runtime().relay_poll_interval(Duration::from_millis(50)).consume(&bed.queue, record_and_notify),
    );
    eventually("the routable row published", Duration::from_secs(20), || async {
        bed.broker.message_count(&present).await == 1
    })
    .await;
    eventually("both failures recorded", Duration::from_secs(20), || async {
        outbox_rows(&bed).await.iter().all(|(_, attempts, _)| *attempts >= 1)
    })
    .await;
    let rows = outbox_rows(&bed).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows[0].2.as_deref().is_some_and(|e| e.contains("unroutable")), "{rows:?}");
    assert!(rows[1].2.as_deref().is_some_and(|e| e.contains("does not exist")), "{rows:?}");
    assert_eq!(message_id(&bed.broker.get(&present).await.expect("the event")), "given-id");

    bed.broker.declare_queue(&missing).await;
    eventually("the unroutable row published once its queue exists", Duration::from_secs(30), || async {
        backlog(&bed).await == 1
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.broker.message_count(&missing).await, 1);
}

/// Events committed together, some of them unroutable: the relay takes the rows it
/// is handed in one pass (deleted at once, published from memory); as not every one
/// is confirmed, the pass rolls back and records what the broker said. Every
/// routable event goes out once — none again after the rollback — and each
/// unroutable one stays in the outbox with the reason. (The relay polls once an hour
/// here: no claim of due rows runs beside the pass.)
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_of_handed_over_rows_with_one_refused_publishes_the_rest_once() {
    let bed = Bed::isolated().await;
    let routable = idemq_tests::unique("events");
    let unroutable = idemq_tests::unique("nowhere");
    bed.broker.declare_queue(&routable).await;
    let payments: Vec<PaymentRequested> =
        (1..=12).map(|i| payment_to(if i % 4 == 0 { &unroutable } else { &routable }, i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let running = Running::start(
        bed.runtime().relay_poll_interval(Duration::from_secs(3600)).consume(&bed.queue, record_and_notify),
    );
    running.wait_settled(payments.len()).await;
    eventually("the refused rows recorded", Duration::from_secs(20), || async {
        let rows = outbox_rows(&bed).await;
        rows.len() == 3 && rows.iter().all(|(_, attempts, _)| *attempts >= 1)
    })
    .await;
    running.stop().await.expect("clean shutdown");

    let (copies, ids) = take_events(&bed.broker, &routable).await;
    assert_eq!(copies, 9, "each routable event once: {ids:?}");
    assert_eq!(ids.len(), 9);
    for (key, error) in outbox_rows(&bed).await.iter().map(|(key, _, error)| (key, error)) {
        assert_eq!(key, &unroutable);
        assert!(error.as_deref().is_some_and(|e| e.contains("unroutable")), "{error:?}");
    }
}

static FAIL_REQUESTS: AtomicBool = AtomicBool::new(false);

/// The reply: what the handler returned. The `run` is new on every run of the
/// handler, so a reply made by a second run would differ.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Receipt {
    payment_id: String,
    run: String,
}

#[idempotent_handler(key = "payment_id", name = "quote")]
async fn answer(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<Receipt, HandlerError> {
    if FAIL_REQUESTS.load(Ordering::SeqCst) && msg.amount_cents == 13 {
        return Err(Permanent("thirteen is refused").into());
    }
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id, run: idemq_tests::unique("run") })
}

async fn request(bed: &Bed, payment: &PaymentRequested, reply_to: &str, correlation_id: &str) {
    request_with(bed, payment, reply_to, correlation_id, lapin::BasicProperties::default()).await;
}

/// A request with more `props` (an `expiration`, say).
async fn request_with(
    bed: &Bed,
    payment: &PaymentRequested,
    reply_to: &str,
    correlation_id: &str,
    props: lapin::BasicProperties,
) {
    let body = serde_json::to_vec(payment).expect("serialize");
    let props = props
        .with_content_type("application/json".into())
        .with_reply_to(reply_to.into())
        .with_correlation_id(correlation_id.into());
    bed.broker.publish_bytes(&bed.queue, &body, props).await;
}

async fn replies(bed: &Bed, queue: &str, n: u32) -> Vec<BasicGetMessage> {
    eventually(&format!("{n} replies"), Duration::from_secs(20), || async {
        bed.broker.message_count(queue).await >= n
    })
    .await;
    bed.broker.drain(queue).await
}

fn status(reply: &BasicGetMessage) -> Option<String> {
    idemq_tests::header_str(&reply.delivery.properties, idemq::outbox::STATUS_HEADER)
}

in_both_modes! {
    /// A request sent twice is answered twice with byte-identical replies (same
    /// body, same correlation id, same message id), and its handler ran once.
    async fn a_duplicated_request_gets_a_byte_identical_reply() {
        let bed = Bed::isolated().await;
        let reply_queue = idemq_tests::unique("replies");
        bed.broker.declare_queue(&reply_queue).await;
        let payment = payment(100);
        request(&bed, &payment, &reply_queue, "c-1").await;
        let running = Running::start(bed.runtime().consume(&bed.queue, answer));
        running.wait_settled(1).await;
        let first = replies(&bed, &reply_queue, 1).await;
        request(&bed, &payment, &reply_queue, "c-1").await;
        running.wait_settled(2).await;
        let second = replies(&bed, &reply_queue, 1).await;
        running.stop().await.expect("clean shutdown");
        let (first, second) = (&first[0], &second[0]);
        assert_eq!(first.delivery.data, second.delivery.data, "the same reply bytes");
        let receipt: Receipt = serde_json::from_slice(&first.delivery.data).expect("a receipt");
        assert_eq!(receipt.payment_id, payment.payment_id);
        for reply in [first, second] {
            let props = &reply.delivery.properties;
            assert_eq!(props.correlation_id().as_ref().map(|c| c.as_str()), Some("c-1"));
            assert_eq!(status(reply).as_deref(), Some("ok"));
        }
        assert_eq!(message_id(first), message_id(second));
        assert_eq!(bed.ledger_rows(&payment.payment_id).await, 1, "the handler ran once");
    }
}

/// A request that fails permanently commits its failure: it is answered with an
/// error reply (and dead-lettered), a duplicate gets the same error reply without
/// the handler running, and once the key is forgotten the fixed handler applies it.
#[tokio::test(flavor = "multi_thread")]
async fn a_permanently_failed_request_is_answered_the_same_way_until_forgotten() {
    let bed = Bed::isolated().await;
    let reply_queue = idemq_tests::unique("replies");
    bed.broker.declare_queue(&reply_queue).await;
    let payment = payment(13);
    FAIL_REQUESTS.store(true, Ordering::SeqCst);
    request(&bed, &payment, &reply_queue, "c-13").await;
    let running = Running::start(bed.runtime().consume(&bed.queue, answer));
    running.wait_settled(1).await;
    let first = replies(&bed, &reply_queue, 1).await;
    assert_eq!(status(&first[0]).as_deref(), Some("error"));
    let error: serde_json::Value = serde_json::from_slice(&first[0].delivery.data).expect("JSON");
    assert!(error["error"].as_str().is_some_and(|e| e.contains("thirteen is refused")), "{error}");
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 1, "the failure is dead-lettered too");

    // The handler is fixed; the duplicate still gets the stored answer.
    FAIL_REQUESTS.store(false, Ordering::SeqCst);
    request(&bed, &payment, &reply_queue, "c-13").await;
    running.wait_settled(2).await;
    let second = replies(&bed, &reply_queue, 1).await;
    assert_eq!(first[0].delivery.data, second[0].delivery.data);
    assert_eq!(bed.ledger_rows(&payment.payment_id).await, 0);

    let mut conn = bed.db.connect().await;
    assert!(idemq::store::forget(&mut conn, "quote", &payment.payment_id).await.expect("forget"));
    request(&bed, &payment, &reply_queue, "c-13").await;
    running.wait_settled(3).await;
    let third = replies(&bed, &reply_queue, 1).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(status(&third[0]).as_deref(), Some("ok"));
    assert_eq!(bed.ledger_rows(&payment.payment_id).await, 1, "applied once after the fix");
}

/// A reply to RabbitMQ's direct reply-to reaches a requester that is waiting for it
/// (best effort: published without `mandatory`, never retried).
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_to_direct_reply_to_reaches_the_waiting_requester() {
    use futures_util::StreamExt;
    let bed = Bed::isolated().await;
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    let mut replies = channel
        .basic_consume(
            "amq.rabbitmq.reply-to".into(),
            "requester".into(),
            lapin::options::BasicConsumeOptions { no_ack: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume direct reply-to");
    let payment = payment(100);
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_reply_to("amq.rabbitmq.reply-to".into())
        .with_correlation_id("direct-1".into());
    // On the consuming channel, as direct reply-to requires.
    channel
        .basic_publish(
            "".into(),
            bed.queue.as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            &serde_json::to_vec(&payment).expect("serialize"),
            props,
        )
        .await
        .expect("publish the request");
    let running = Running::start(bed.runtime().consume(&bed.queue, answer));
    let reply = idemq_tests::with_timeout("the direct reply", Duration::from_secs(20), replies.next())
        .await
        .expect("a reply")
        .expect("a delivery");
    running.stop().await.expect("clean shutdown");
    let receipt: Receipt = serde_json::from_slice(&reply.data).expect("a receipt");
    assert_eq!(receipt.payment_id, payment.payment_id);
    assert_eq!(reply.properties.correlation_id().as_ref().map(|c| c.as_str()), Some("direct-1"));
    assert_eq!(backlog(&bed).await, 0, "a best-effort reply leaves no row behind");
}

/// A runtime whose relay is off (relays run elsewhere) wakes them with a throttled
/// `NOTIFY` after its commits: a relay polling only once a minute still publishes
/// within seconds, woken through its `LISTEN` connection.
#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_without_a_relay_wakes_the_relays_elsewhere() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = idemq::outbox::Relay::builder()
        .amqp_url(&bed.amqp_url)
        .database_url(bed.db.url())
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("a valid relay");
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    // The relay's first pass (at start) finds nothing; only a NOTIFY wakes it now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let running = Running::start(bed.runtime().relay(false).consume(&bed.queue, record_and_notify));
    bed.publish(&payment_to(&target, 100)).await;
    running.wait_settled(1).await;
    eventually("the event published well before the next poll", Duration::from_secs(15), || async {
        bed.broker.message_count(&target).await == 1
    })
    .await;
    running.stop().await.expect("clean shutdown");
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay run");
    assert_eq!(backlog(&bed).await, 0);
}

/// A row the broker refuses by closing the connection (a header frame over
/// `frame_max`) does not hold up the rows behind it: it is postponed, they go out.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_that_breaks_the_connection_does_not_block_the_others() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let mut conn = bed.db.connect().await;
    // `enqueue` refuses such headers; a row written another way still must not block.
    let huge = idemq::outbox::Outgoing::json("", &target, &1).unwrap().header("x-huge", "h".repeat(140_000));
    assert!(matches!(
        idemq::outbox::enqueue(&mut conn, huge).await,
        Err(idemq::PublishError::TooLong { .. })
    ));
    let written = diesel::sql_query(format!(
        "INSERT INTO idemq_outbox (message_id, exchange, routing_key, body, headers) \
         VALUES ('huge', '', '{target}', '1', '{{\"x-huge\": \"{}\"}}')",
        "h".repeat(140_000)
    ));
    diesel_async::RunQueryDsl::execute(written, &mut conn).await.expect("write the oversized row");
    for i in 0..3 {
        idemq::outbox::enqueue(&mut conn, idemq::outbox::Outgoing::json("", &target, &i).unwrap())
            .await
            .expect("enqueue");
    }
    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = idemq::outbox::Relay::builder()
        .amqp_url(&bed.amqp_url)
        .database_url(bed.db.url())
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("a valid relay");
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    eventually("the three good rows published", Duration::from_secs(30), || async {
        bed.broker.message_count(&target).await == 3
    })
    .await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay run");
    let rows = outbox_rows(&bed).await;
    assert_eq!(rows.len(), 1, "only the oversized row is left: {rows:?}");
    assert!(rows[0].1 >= 1 && rows[0].2.is_some(), "postponed with its error: {rows:?}");
}

/// The name of a reply queue whose requester is gone: declared exclusive on a
/// connection of its own, which is then closed (the queue goes with it, as auto-delete
/// and exclusive reply queues do when their client leaves).
async fn gone_reply_queue(bed: &Bed) -> String {
    let name = idemq_tests::unique("replies");
    let requester = lapin::Connection::connect(&bed.amqp_url, lapin::ConnectionProperties::default())
        .await
        .expect("the requester connects");
    let channel = requester.create_channel().await.expect("a channel");
    let exclusive = lapin::options::QueueDeclareOptions { exclusive: true, ..Default::default() };
    channel
        .queue_declare(name.as_str().into(), exclusive, lapin::types::FieldTable::default())
        .await
        .expect("declare the reply queue");
    requester.close(200, "the requester leaves".into()).await.expect("close the requester");
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    eventually("the reply queue went with its requester", Duration::from_secs(20), || async {
        vhost.unsettled(&name).await == u64::MAX
    })
    .await;
    name
}

/// Counts the replies the relay deleted unpublished.
#[derive(Default)]
struct ExpiredReplies(AtomicUsize);

impl idemq::observe::Observe for ExpiredReplies {
    fn relay(&self, pass: &idemq::observe::RelayPass) {
        self.0.fetch_add(pass.expired, Ordering::SeqCst);
    }
}

impl ExpiredReplies {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Stages a requester that is gone (its exclusive reply queue went with its
/// connection) before its request is answered: the reply is returned (312 NO_ROUTE) on
/// every try, and without an end would stay in the outbox, retried, for ever. It must
/// be kept and retried while young, deleted unpublished once older than the reply TTL,
/// and counted once; an event written behind it is published meanwhile, and one
/// written after its end too.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_to_a_requester_that_is_gone_expires_after_the_reply_ttl_and_the_rows_behind_it_publish() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let reply_queue = gone_reply_queue(&bed).await;
    let expired = Arc::new(ExpiredReplies::default());
    let builder = bed
        .runtime()
        .reply_ttl(Duration::from_secs(5))
        .relay_poll_interval(Duration::from_millis(100))
        .observe(Arc::clone(&expired))
        .consume(&bed.queue, answer);
    let running = Running::start(builder);
    let payment = payment(100);
    request(&bed, &payment, &reply_queue, "c-gone").await;
    running.wait_for_end(&payment.payment_id).await;
    eventually("the reply returned as unroutable, kept and retried", Duration::from_secs(20), || async {
        outbox_rows(&bed).await.iter().any(|(to, attempts, error)| {
            *to == reply_queue && *attempts >= 1 && error.as_deref().is_some_and(|e| e.contains("unroutable"))
        })
    })
    .await;
    let mut conn = bed.db.connect().await;
    idemq::outbox::enqueue(&mut conn, idemq::outbox::Outgoing::json("", &target, &1).unwrap())
        .await
        .expect("enqueue");
    eventually("the event behind the stuck reply published", Duration::from_secs(20), || async {
        bed.broker.message_count(&target).await == 1
    })
    .await;
    eventually("the reply deleted once older than the TTL", Duration::from_secs(30), || async {
        backlog(&bed).await == 0
    })
    .await;
    assert_eq!(expired.count(), 1, "the expired reply is counted, once");
    idemq::outbox::enqueue(&mut conn, idemq::outbox::Outgoing::json("", &target, &2).unwrap())
        .await
        .expect("enqueue");
    eventually("the event after it published", Duration::from_secs(20), || async {
        bed.broker.message_count(&target).await == 2
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(expired.count(), 1, "{:?}", outbox_rows(&bed).await);
    assert_eq!(bed.ledger_rows(&payment.payment_id).await, 1, "the request itself was applied");
}

/// Stages two requests carrying an AMQP `expiration` (how long their requester waits)
/// far shorter than the reply TTL (the default hour): one whose requester is gone, one
/// whose requester is there. The first's reply must be deleted by its request's own
/// expiration, not an hour later, and counted; the second's reply must still be
/// delivered.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_expires_by_its_requests_own_expiration_and_one_to_a_present_requester_is_delivered() {
    let bed = Bed::isolated().await;
    let gone = gone_reply_queue(&bed).await;
    let present = idemq_tests::unique("replies");
    bed.broker.declare_queue(&present).await;
    let expired = Arc::new(ExpiredReplies::default());
    let running = Running::start(bed.runtime().observe(Arc::clone(&expired)).consume(&bed.queue, answer));
    // The requests expire in their queue too: publish them once they are consumed at once.
    eventually("the runtime consumes", Duration::from_secs(20), || async {
        bed.broker.consumer_count(&bed.queue).await >= 1
    })
    .await;
    let within = || lapin::BasicProperties::default().with_expiration("5000".into());
    let (unanswerable, answerable) = (payment(100), payment(200));
    request_with(&bed, &unanswerable, &gone, "c-gone", within()).await;
    request_with(&bed, &answerable, &present, "c-present", within()).await;
    running.wait_for_end(&unanswerable.payment_id).await;
    running.wait_for_end(&answerable.payment_id).await;
    let delivered = replies(&bed, &present, 1).await;
    let receipt: Receipt = serde_json::from_slice(&delivered[0].delivery.data).expect("a receipt");
    assert_eq!(receipt.payment_id, answerable.payment_id);
    assert_eq!(
        delivered[0].delivery.properties.correlation_id().as_ref().map(|c| c.as_str()),
        Some("c-present")
    );
    eventually(
        "the unanswerable reply deleted by its request's expiration",
        Duration::from_secs(30),
        || async { backlog(&bed).await == 0 },
    )
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(expired.count(), 1, "only the reply nobody could take expired");
    assert_eq!(bed.broker.message_count(&present).await, 0, "one reply, delivered once");
}

/// Stages an upgrade: rows written by the previous version (no expiry columns) wait
/// in the outbox — a reply two hours old to a requester that is gone, and an event as
/// old — when the new migration runs. The old reply must be recognised as one and
/// expire by the reply TTL counted from when it was written (deleted unpublished,
/// counted); the old event must never expire and be published.
#[tokio::test(flavor = "multi_thread")]
async fn rows_written_before_the_upgrade_keep_working_old_replies_expire_by_the_ttl_and_events_never() {
    use diesel::migration::MigrationSource;
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let gone = gone_reply_queue(&bed).await;
    // Back to the schema before the expiry migration.
    let migrations =
        MigrationSource::<diesel::pg::Pg>::migrations(&idemq::store::MIGRATIONS).expect("migrations");
    let expiry = migrations
        .iter()
        .find(|m| m.name().to_string().ends_with("_idemq_outbox_reply_expiry"))
        .expect("the expiry migration");
    let mut conn = bed.db.connect().await;
    conn.batch_execute(include_str!("../../migrations/2026-12-03-120000_idemq_outbox_reply_expiry/down.sql"))
        .await
        .expect("revert the expiry migration");
    conn.batch_execute(&format!(
        "DELETE FROM __diesel_schema_migrations WHERE version = '{}'",
        expiry.name().version()
    ))
    .await
    .expect("forget it was applied");
    // What the previous version wrote: a reply (default exchange, correlation id, the
    // status header alone) and an event.
    conn.batch_execute(&format!(
        "INSERT INTO idemq_outbox (message_id, exchange, routing_key, body, content_type, correlation_id, headers, created_at) \
         VALUES ('old-reply', '', '{gone}', '{{}}', 'application/json', 'c-old', '{{\"x-idemq-status\":\"ok\"}}', now() - interval '2 hours'), \
                ('old-event', '', '{target}', '1', 'application/json', NULL, NULL, now() - interval '2 hours')"
    ))
    .await
    .expect("write the old rows");
    idemq::migrate(&bed.db.url()).await.expect("the upgrade");
    assert_eq!(
        bed.db.count("SELECT count(*) FROM idemq_outbox WHERE reply AND message_id = 'old-reply'").await,
        1,
        "the old reply is recognised as a reply"
    );
    assert_eq!(bed.db.count("SELECT count(*) FROM idemq_outbox WHERE reply").await, 1, "and only it");

    let expired = Arc::new(ExpiredReplies::default());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = idemq::outbox::Relay::builder()
        .amqp_url(&bed.amqp_url)
        .database_url(bed.db.url())
        .observe(Arc::clone(&expired))
        .build()
        .expect("a valid relay");
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    eventually("the outbox drained", Duration::from_secs(20), || async { backlog(&bed).await == 0 }).await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay run");
    assert_eq!(expired.count(), 1, "the old reply expired (an hour's TTL, two hours old)");
    let events = bed.broker.drain(&target).await;
    assert_eq!(events.len(), 1, "the old event, as old, was published");
    assert_eq!(message_id(&events[0]), "old-event");
}
