//! The attribute's options that tune the runtime for one handler: `queue`,
//! `retry(...)`, `on_conflict`, `batch`, `dedup = false`.

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, FailureKind, HandlerError, Outcome, Queue, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};

/// A fixed name: the test runs in a vhost of its own.
const ORDERS: &str = "orders.placed";

#[idempotent_handler(key = "payment_id", name = "apply_payment", queue = "orders.placed")]
async fn on_orders(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

#[idempotent_handler(dedup = false, name = "apply_payment")]
async fn without_dedup(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "apply_payment", batch = 1)]
async fn one_at_a_time(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "apply_payment", on_conflict = "ignore")]
async fn tolerant(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "flaky", retry(none))]
async fn never_retried(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Err(HandlerError::transient("the downstream is down"))
}

/// `queue = "..."`: a handler that names its queue consumes it when registered there.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_that_names_its_queue_consumes_it() {
    let bed = Bed::isolated().await;
    let payment = payment(100);
    let topology = Topology::new().queue(Queue::new(ORDERS));
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    topology.declare(&channel).await.expect("declare the orders queue");
    let running = Running::start(bed.runtime().topology(topology).consume(ORDERS, on_orders));
    idemq_tests::eventually("the queue declared", std::time::Duration::from_secs(20), || async {
        bed.broker.consumer_count(ORDERS).await == 1
    })
    .await;
    let body = serde_json::to_vec(&payment).expect("serialize");
    bed.broker.publish_bytes(ORDERS, &body, lapin::BasicProperties::default()).await;
    running.wait_settled(1).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.ledger_rows(&payment.payment_id).await, 1);
}

/// A `queue` that disagrees with `.consume` is refused when the runtime is built,
/// naming both.
#[test]
fn a_handler_registered_on_another_queue_than_it_names_is_refused_at_build() {
    let err = idemq::Runtime::builder().consume("elsewhere", on_orders).build().unwrap_err().to_string();
    assert!(err.contains("'orders.placed'") && err.contains("'elsewhere'"), "{err}");
}

/// `dedup = false`: every delivery runs, duplicates included (the handler is
/// idempotent by itself); each is still acked after its COMMIT.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_without_dedup_runs_every_delivery() {
    let bed = Bed::new().await;
    let payment = payment(100);
    bed.publish(&payment).await;
    bed.publish(&payment).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, without_dedup), 2).await;
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(bed.ledger_rows(&payment.payment_id).await, 2, "no dedup: both ran");
    assert_eq!(bed.dedup_rows(&payment.payment_id).await, 0, "and no dedup row was written");
}

/// `batch = 1`: this handler's deliveries run one per transaction, whatever the
/// runtime's batch size.
#[tokio::test(flavor = "multi_thread")]
async fn batch_one_runs_each_delivery_in_its_own_transaction() {
    let bed = Bed::new().await;
    for i in 0..12 {
        bed.publish(&payment(100 + i)).await;
    }
    let events = Running::settle(bed.runtime().batch_size(64).consume(&bed.queue, one_at_a_time), 12).await;
    assert!(events.iter().all(|e| e.batch == 1), "{:?}", events.iter().map(|e| e.batch).collect::<Vec<_>>());
}

/// `on_conflict = "ignore"`: the same key with another payload is acked as a
/// duplicate for this handler, whatever the runtime's setting.
#[tokio::test(flavor = "multi_thread")]
async fn on_conflict_ignore_acks_a_reused_key_as_a_duplicate() {
    let bed = Bed::new().await;
    let first = payment(100);
    let reused = PaymentRequested { amount_cents: 999, ..first.clone() };
    bed.publish(&first).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, tolerant));
    running.wait_settled(1).await;
    bed.publish(&reused).await;
    running.wait_settled(2).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events[1].outcome, Outcome::Duplicate, "{events:?}");
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}

/// `retry(none)`: the first transient failure dead-letters (one attempt in all).
#[tokio::test(flavor = "multi_thread")]
async fn retry_none_dead_letters_the_first_transient_failure() {
    let bed = Bed::new().await;
    bed.publish(&payment(100)).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, never_retried), 1).await;
    assert!(
        matches!(&events[0].outcome, Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, .. }),
        "{:?}",
        events[0].outcome
    );
}
