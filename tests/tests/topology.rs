//! Topology declared in code: idempotent redeclaration, and a clear start-up error
//! when a queue exists with other arguments.

use idemq::{Queue, Topology};
use idemq_tests::{amqp_url, unique, Broker};

async fn declare(broker: &Broker, topology: &Topology) -> Result<(), idemq::Error> {
    let channel = broker.connection().create_channel().await.expect("channel");
    let result = topology.declare(&channel).await;
    let _ = channel.close(200, "done".into()).await;
    result
}

/// Declaring the same topology twice succeeds (start-up declares every time), and
/// the queue gets its dead-letter queue.
#[tokio::test(flavor = "multi_thread")]
async fn declaring_twice_is_idempotent_and_creates_the_dlq() {
    let broker = Broker::connect(&amqp_url()).await;
    let name = unique("topo");
    let topology = Topology::new().queue(Queue::new(name.clone()));
    declare(&broker, &topology).await.expect("first declaration");
    declare(&broker, &topology).await.expect("second declaration");
    assert_eq!(broker.message_count(&format!("{name}.dlq")).await, 0, "the DLQ exists");
    broker.delete_queue(&name).await;
    broker.delete_queue(&format!("{name}.dlq")).await;
}

/// A classic queue redeclared as quorum: RabbitMQ answers 406 PRECONDITION_FAILED;
/// idemq's error names the queue, the differing argument and the fix.
#[tokio::test(flavor = "multi_thread")]
async fn a_queue_existing_with_other_arguments_fails_start_up_with_a_fix() {
    let broker = Broker::connect(&amqp_url()).await;
    let name = unique("topo");
    declare(&broker, &Topology::new().queue(Queue::new(name.clone()).classic()))
        .await
        .expect("classic declaration");

    let err = declare(&broker, &Topology::new().queue(Queue::new(name.clone())))
        .await
        .expect_err("quorum over classic");
    let text = err.to_string();
    assert!(matches!(err, idemq::Error::QueueMismatch { ref queue, .. } if *queue == name), "{err:?}");
    assert!(text.contains(&name), "names the queue: {text}");
    assert!(text.contains("x-queue-type"), "names the differing argument: {text}");
    assert!(text.contains("Fix:") && text.contains(".classic()"), "says what to do: {text}");

    broker.delete_queue(&name).await;
    broker.delete_queue(&format!("{name}.dlq")).await;
}
