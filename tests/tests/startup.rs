//! What the runtime refuses at start-up or stops for, and how it shares its slots:
//! missing schema is not an outage, and an idle queue starves nobody.

use std::time::Duration;

use diesel_async::AsyncPgConnection;
use diesel_async::SimpleAsyncConnection;
use idemq::{idempotent_handler, Error, HandlerError, Outcome, Queue, Runtime, Topology};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{ledger_payment, payment, test_retry_policy, Bed, Running};
use idemq_tests::{unique, with_timeout, TestDb};
use tokio_util::sync::CancellationToken;

/// Without idemq's tables every delivery would fail until someone ran the
/// migrations: the runtime refuses to start and says so, instead of looping.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_without_idemqs_tables_is_refused_at_start_up_with_the_fix() {
    let db = TestDb::create().await;
    let queue = unique("q");
    let runtime = Runtime::builder()
        .database_url(db.url())
        .topology(Topology::new().queue(Queue::new(queue.clone())))
        .consume(&queue, ledger_payment)
        .build()
        .expect("build");
    let result =
        with_timeout("start-up", Duration::from_secs(20), runtime.run(CancellationToken::new())).await;
    let Err(err @ Error::Schema { .. }) = result else { panic!("expected a schema error, got {result:?}") };
    let message = err.to_string();
    assert!(message.contains("idemq_dedup") && message.contains("migrate"), "{message}");
}

/// idemq's table dropped under a running runtime: its insert is refused, which no
/// retry can fix. The runtime stops with the fix instead of retrying every delivery
/// for the database retry limit, and the delivery is returned, not lost.
#[tokio::test(flavor = "multi_thread")]
async fn losing_idemqs_table_while_running_stops_the_runtime_and_returns_the_delivery() {
    let bed = Bed::new().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    bed.publish(&payment(1)).await;
    running.wait_settled(1).await;
    bed.db.connect().await.batch_execute("DROP TABLE idemq_dedup").await.expect("drop the table");
    let p = payment(2);
    bed.publish(&p).await;
    let result =
        with_timeout("the runtime stops", Duration::from_secs(30), running.handle).await.expect("task");
    let Err(err @ Error::Schema { .. }) = result else { panic!("expected a schema error, got {result:?}") };
    assert!(err.to_string().contains("migrate"), "{err}");
    let events = running.events.lock().unwrap().clone();
    assert!(matches!(events[1].outcome, Outcome::Requeued { .. }), "{events:?}");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 1, "the delivery was returned to the queue");
}

/// The idle queue's handler; nothing is ever published there.
#[idempotent_handler(key = "payment_id")]
async fn never_called(_conn: &mut AsyncPgConnection, _msg: PaymentRequested) -> Result<(), HandlerError> {
    Err(HandlerError::permanent("nothing is published to the idle queue"))
}

/// With one slot (`concurrency(1)`) and an idle queue consumed beside a busy one,
/// the idle consumer must not hold the slot while it waits for a delivery.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_queue_does_not_starve_a_busy_one() {
    let bed = Bed::new().await;
    let idle = unique("idle");
    let topology = Topology::new().queue(Queue::new(idle.clone()));
    let payments: Vec<_> = (0..20).map(|i| payment(100 + i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    // The idle queue's consumer starts first.
    let builder = bed
        .runtime()
        .topology(topology)
        .concurrency(1)
        .consume(&idle, never_called)
        .consume(&bed.queue, ledger_payment);
    let events = Running::settle(builder, payments.len()).await;
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    let wait_queues = test_retry_policy().wait_queues(&idle).into_iter().map(|(name, _)| name);
    for queue in [idle.clone(), format!("{idle}.dlq")].into_iter().chain(wait_queues) {
        bed.broker.delete_queue(&queue).await;
    }
}
