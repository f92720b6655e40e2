//! RabbitMQ's `consumer_timeout`, on a private node (`idemq::testing::Cluster`, one
//! node beside the machine's broker) started with a short one: 5 s, checked every
//! second. Settings that can outlast it are refused by `build()`; a delivery held
//! past it anyway is reported as exactly that, the runtime reconnects, and the
//! effect that committed after the channel died is acked as a duplicate when its
//! message comes back.

use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::testing::Cluster;
use idemq::{idempotent_handler, observe::ConnectionEvent, Error, Outcome};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{next_attempt, payment, Bed, Running};
use idemq_tests::{eventually, unique};

use crate::support::cluster::lease;

/// The node's consumer_timeout.
const BROKER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the first run of [`slow_first_payment`] takes: past the broker's
/// timeout and its next check, well within the handler timeout.
const HELD: Duration = Duration::from_secs(9);

/// The payments handler; its first run for a payment sleeps [`HELD`] inside its
/// transaction. Same name as `apply_payment`: same dedup rows.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn slow_first_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await?;
    if next_attempt(&msg.payment_id) == 1 {
        tokio::time::sleep(HELD).await;
    }
    Ok(())
}

/// Stages a handler that runs past the broker's consumer_timeout but within its own
/// `handler_timeout` (30 s), with idemq told the broker has no timeout
/// (`consumer_timeout(Duration::MAX)`: the build check bypassed; told the truth,
/// `build()` refuses). The broker closes the channel under the running
/// transaction, which still commits. Must hold: the payment is applied exactly once;
/// the late effect's ack never reached the broker; the runtime says the delivery
/// acknowledgement timed out (the lost session's reason names consumer_timeout) and
/// reconnects; the redelivery is settled as `Outcome::Duplicate`; the queue drains.
#[tokio::test(flavor = "multi_thread")]
async fn a_delivery_held_past_the_brokers_consumer_timeout_commits_once_and_comes_back_a_duplicate() {
    let node = lease("one node, consumer_timeout 5s", || {
        Cluster::builder()
            .nodes(1)
            .conf(format!("consumer_timeout = {}", BROKER_TIMEOUT.as_millis()))
            .rabbit_env("channel_tick_interval", "1000")
    })
    .await;
    let vhost = unique("ct");
    node.add_vhost(&vhost).await.expect("add the test's vhost");
    let bed = Bed::on_cluster(node.amqp_urls(&vhost), |queue| queue).await;
    let handler_timeout = Duration::from_secs(30);

    let truth = bed
        .runtime()
        .handler_timeout(handler_timeout)
        .consumer_timeout(BROKER_TIMEOUT)
        .consume(&bed.queue, slow_first_payment)
        .build();
    let Err(Error::Config(refused)) = truth else {
        panic!("settings past the broker's timeout built: {truth:?}")
    };
    assert!(refused.contains("handler_timeout") && refused.contains("consumer_timeout (5s)"), "{refused}");

    let p = payment(100);
    bed.publish(&p).await;
    let running = Running::start(
        bed.runtime()
            .handler_timeout(handler_timeout)
            .consumer_timeout(Duration::MAX)
            .reconnect_max_backoff(Duration::from_millis(500))
            .consume(&bed.queue, slow_first_payment),
    );
    running.wait_settled(2).await;
    eventually("the queue drained", Duration::from_secs(30), || async {
        node.unsettled(&vhost, &bed.queue).await.ok().flatten() == Some(0)
    })
    .await;
    let (events, connections) = (running.events(), running.connection_events());
    running.stop().await.expect("clean shutdown");

    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "applied exactly once: {events:?}");
    let late = events.iter().find(|e| e.outcome == Outcome::Applied).expect("the slow run applied it");
    assert!(!late.settled_with_broker, "its channel was closed under it: {late:?}");
    let again = events.iter().find(|e| e.outcome == Outcome::Duplicate).expect("the redelivery");
    assert!(again.redelivered && again.settled_with_broker, "{again:?}");
    assert!(
        connections.iter().any(|event| matches!(
            event,
            ConnectionEvent::Lost { reason, .. }
                if reason.contains("consumer_timeout") && reason.contains("delivery acknowledgement")
                    && reason.contains("timed out")
        )),
        "the loss is reported as the broker's delivery timeout: {connections:?}"
    );
    assert!(connections.contains(&ConnectionEvent::Connected { session: 2 }), "reconnected: {connections:?}");
    node.delete_vhost(&vhost).await.expect("delete the test's vhost");
}
