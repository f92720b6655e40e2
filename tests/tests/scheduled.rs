//! Scheduled messages: written to the outbox with a due time, published by the relay
//! once due — not before — exactly once, across a restart; cancelled in a
//! transaction, never. Each test runs in a vhost of its own.

use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idemq::outbox::{self, Outgoing};
use idemq::{idempotent_handler, Context, HandlerError};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, Broker};
use serde::Serialize;

/// A relay of its own, until the returned token is cancelled.
fn relay(
    bed: &Bed,
) -> (tokio_util::sync::CancellationToken, tokio::task::JoinHandle<Result<(), idemq::Error>>) {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = outbox::Relay::builder()
        .amqp_url(&bed.amqp_url)
        .database_url(bed.db.url())
        .build()
        .expect("a valid relay");
    (shutdown.clone(), tokio::spawn(relay.run(shutdown)))
}

/// Writes `outgoing` in a transaction of its own: its message id.
async fn enqueue(conn: &mut AsyncPgConnection, outgoing: Outgoing) -> String {
    conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
        Ok(outbox::enqueue(conn, outgoing).await?)
    })
    .await
    .expect("enqueue")
}

/// The message ids in `queue`, taken.
async fn take(broker: &Broker, queue: &str) -> Vec<String> {
    broker
        .drain(queue)
        .await
        .iter()
        .map(|m| m.delivery.properties.message_id().as_ref().map(ToString::to_string).unwrap_or_default())
        .collect()
}

/// A message scheduled five seconds ahead waits in the outbox (no backlog: it is
/// not due) and is published once it is due, not before, once, with the id
/// `enqueue` returned; a message written beside it without a due time goes at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_scheduled_message_is_published_once_when_due_and_not_before() {
    const DUE_IN: Duration = Duration::from_secs(5);
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("later");
    bed.broker.declare_queue(&target).await;
    let (shutdown, running) = relay(&bed);
    let mut conn = bed.db.connect().await;
    // Before the transaction starts: its `now()`, from which the delay counts, is later.
    let written = Instant::now();
    let later = enqueue(&mut conn, Outgoing::json("", &target, &"later").unwrap().deliver(DUE_IN)).await;
    let now = enqueue(&mut conn, Outgoing::json("", &target, &"now").unwrap()).await;
    assert!(outbox::backlog(&mut conn).await.expect("backlog") <= 1, "the scheduled one is no backlog");

    // What arrives, and when it was seen (every 100 ms), until both have come.
    let mut seen: Vec<(String, Duration)> = Vec::new();
    let until = Instant::now() + Duration::from_secs(30);
    while seen.len() < 2 && Instant::now() < until {
        for id in take(&bed.broker, &target).await {
            seen.push((id, written.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        vec![now.as_str(), later.as_str()],
        "the unscheduled first, then the scheduled: {seen:?}"
    );
    assert!(seen[1].1 >= DUE_IN, "the scheduled message was seen {:?} after it was written", seen[1].1);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(bed.broker.message_count(&target).await, 0, "not again");
    assert!(!outbox::cancel(&mut conn, &later).await.expect("cancel"), "published: nothing left to cancel");
    shutdown.cancel();
    running.await.expect("relay task").expect("relay run");
}

/// Cancelled in a later transaction before it is due, a scheduled message is never
/// published: a message scheduled a second after it is, and arrives alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_scheduled_message_cancelled_before_it_is_due_is_never_published() {
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("later");
    bed.broker.declare_queue(&target).await;
    let (shutdown, running) = relay(&bed);
    let mut conn = bed.db.connect().await;
    let cancelled = enqueue(
        &mut conn,
        Outgoing::json("", &target, &"cancelled").unwrap().deliver(Duration::from_secs(2)),
    )
    .await;
    let kept =
        enqueue(&mut conn, Outgoing::json("", &target, &"kept").unwrap().deliver(Duration::from_secs(3)))
            .await;
    let undone = conn
        .transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
            Ok(outbox::cancel(conn, &cancelled).await?)
        })
        .await
        .expect("cancel");
    assert!(undone, "it was waiting");
    eventually("the message scheduled after it published", Duration::from_secs(30), || async {
        bed.broker.message_count(&target).await >= 1
    })
    .await;
    assert_eq!(take(&bed.broker, &target).await, vec![kept], "the cancelled one never");
    assert!(!outbox::cancel(&mut conn, &cancelled).await.expect("cancel"), "cancelled once");
    shutdown.cancel();
    running.await.expect("relay task").expect("relay run");
}

/// The timeout a handler schedules.
#[derive(Debug, Serialize, idemq::Message)]
#[message(exchange = "", routing_key = "payment-timeouts")]
struct PaymentTimedOut {
    payment_id: String,
}

/// Schedules a timeout for the payment, two seconds ahead, with its effects.
#[idempotent_handler(key = "payment_id", name = "reserve")]
async fn reserve(
    _conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    ctx.schedule(&PaymentTimedOut { payment_id: msg.payment_id }, Duration::from_secs(2))?;
    Ok(())
}

/// Publishes an event per payment, to the queue its account names.
#[idempotent_handler(key = "payment_id", name = "announce")]
async fn announce(
    _conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    ctx.publish("", &msg.account, &msg.payment_id)?;
    Ok(())
}

/// A message falls due while the relay is kept busy with the rows a steady stream of
/// handlers commits (each handed to it in-process, none of them waking a scan): it
/// is published while the stream goes on — the relay scans every poll interval
/// however busy — not only once the stream stops.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_falls_due_and_is_published_while_a_steady_stream_keeps_the_relay_busy() {
    let bed = Bed::isolated().await;
    let (events, target) = (idemq_tests::unique("events"), idemq_tests::unique("later"));
    bed.broker.declare_queue(&events).await;
    bed.broker.declare_queue(&target).await;
    let running = Running::start(
        bed.runtime().relay_poll_interval(Duration::from_millis(200)).consume(&bed.queue, announce),
    );
    let mut conn = bed.db.connect().await;
    enqueue(&mut conn, Outgoing::json("", &target, &"later").unwrap().deliver(Duration::from_secs(1))).await;
    // A payment every 20 ms, each committing an event, until the message arrives
    // (at most 20 s: far past its due time and many poll intervals).
    let stream_until = Instant::now() + Duration::from_secs(20);
    let mut sent = 0;
    while bed.broker.message_count(&target).await == 0 && Instant::now() < stream_until {
        bed.publish(&PaymentRequested { account: events.clone(), ..payment(sent) }).await;
        sent += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let published_during_the_stream = bed.broker.message_count(&target).await == 1;
    running.wait_settled(usize::try_from(sent).expect("a count")).await;
    running.stop().await.expect("clean shutdown");
    assert!(published_during_the_stream, "the due message waited for the stream to stop ({sent} payments)");
    assert!(sent > 10, "the stream ran: {sent} payments");
}

/// A handler's scheduled timeout commits with its dedup row: a duplicate of the
/// message schedules nothing more, the process stopping before it is due loses
/// nothing, and a relay started after publishes it once.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_scheduled_by_a_handler_fires_once_after_a_restart_and_a_duplicate() {
    let bed = Bed::isolated().await;
    bed.broker.declare_queue("payment-timeouts").await;
    let placed = payment(4200);
    bed.publish(&placed).await;
    bed.publish(&placed).await;
    let running = Running::start(bed.runtime().relay(false).consume(&bed.queue, reserve));
    running.wait_settled(2).await;
    running.stop().await.expect("clean shutdown");
    let mut conn = bed.db.connect().await;
    let waiting = bed.db.count("SELECT count(*) FROM idemq_outbox WHERE due_at > created_at").await;
    assert_eq!(waiting, 1, "one timeout scheduled, the duplicate skipped");

    let (shutdown, relay) = relay(&bed);
    eventually("the timeout published", Duration::from_secs(30), || async {
        bed.broker.message_count("payment-timeouts").await == 1
    })
    .await;
    // The broker has the message before the relay's pass commits the row's delete.
    eventually("the timeout's row deleted", Duration::from_secs(30), || async {
        outbox::backlog(&mut bed.db.connect().await).await.expect("backlog") == 0
    })
    .await;
    shutdown.cancel();
    relay.await.expect("relay task").expect("relay run");
    let fired = bed.broker.drain("payment-timeouts").await;
    assert_eq!(fired.len(), 1, "published once");
    let body: serde_json::Value = serde_json::from_slice(&fired[0].delivery.data).expect("JSON");
    assert_eq!(body["payment_id"], placed.payment_id.as_str());
    assert_eq!(outbox::backlog(&mut conn).await.expect("backlog"), 0);
}

/// The test kit drives a handler's 15-minute timeout forward without waiting: not
/// due, it is scheduled, not published; 14 minutes on, still not; one more, it is.
#[tokio::test(flavor = "multi_thread")]
async fn the_test_kit_moves_a_timeout_forward_without_waiting() {
    let kit = idemq::testing::TestKit::builder()
        .handler(reserve_for_a_quarter_hour)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    assert_eq!(kit.deliver(&payment(4300)).await, idemq::Outcome::Applied);
    assert!(kit.published().await.is_empty(), "the timeout is not due");
    assert_eq!(kit.scheduled().await.len(), 1);
    kit.advance(Duration::from_secs(14 * 60)).await;
    assert!(kit.published().await.is_empty(), "a minute early");
    kit.advance(Duration::from_secs(60)).await;
    let fired = kit.published().await;
    assert_eq!(fired.len(), 1, "due now");
    assert_eq!(fired[0].routing_key(), "payment-timeouts");
    assert!(kit.scheduled().await.is_empty());
}

/// [`reserve`], with the quarter hour a payment reservation waits for its capture.
#[idempotent_handler(key = "payment_id", name = "reserve_for_a_quarter_hour")]
async fn reserve_for_a_quarter_hour(
    _conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    ctx.schedule(&PaymentTimedOut { payment_id: msg.payment_id }, Duration::from_secs(15 * 60))?;
    Ok(())
}
