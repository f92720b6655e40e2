//! On a private 3-node RabbitMQ cluster (`idemq::testing::Cluster`, beside the
//! machine's own broker, never joined to it): consumers given every node's address
//! lose the node that leads their quorum queue, a node they are connected to, a
//! node while a batch's transaction is open and one while a retry copy is being
//! confirmed — and every payment is still applied exactly once. The tests share one
//! cluster (starting one takes ~25 s) and run one at a time, since they kill nodes
//! (`crate::support::cluster`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::testing::fault::FaultHookExt;
use idemq::testing::Cluster;
use idemq::{idempotent_handler, HandlerError, Outcome, Queue, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{next_attempt, payment, publish_stream, Bed, ConsumerProcess, Running};
use idemq_tests::{eventually, unique, Broker};

use crate::support::cluster::{lease, Lease};

const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");

/// The cluster, started by the first test that needs it and kept for the next
/// (torn down when the process ends, by the kit's watchdog), lent to one test at a
/// time.
async fn cluster() -> Lease {
    let cluster = lease("three nodes", Cluster::builder).await;
    // A test that failed midway may have left a node down.
    cluster.heal().await.expect("every node up");
    cluster
}

/// A vhost of the test's own on the cluster, and a bed (database, queue) in it
/// whose broker client is on node 0.
async fn bed_on(cluster: &Cluster, shape: impl FnOnce(Queue) -> Queue) -> (String, Bed) {
    let vhost = unique("cluster");
    cluster.add_vhost(&vhost).await.expect("add the test's vhost");
    let bed = Bed::on_cluster(cluster.amqp_urls(&vhost), shape).await;
    (vhost, bed)
}

async fn applied(bed: &Bed, n: usize) {
    eventually(&format!("{n} payments applied"), Duration::from_secs(120), || async {
        bed.ledger_total().await >= n as i64
    })
    .await;
}

/// Every payment applied once, nothing dead-lettered, the queue drained.
async fn exactly_once(cluster: &Cluster, vhost: &str, bed: &Bed, payments: usize) {
    applied(bed, payments).await;
    eventually("the queue drained", Duration::from_secs(90), || async {
        cluster.unsettled(vhost, &bed.queue).await.ok().flatten() == Some(0)
    })
    .await;
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice");
    assert_eq!(bed.ledger_total().await, payments as i64, "every payment applied once");
    assert_eq!(
        cluster.unsettled(vhost, &bed.dlq).await.expect("list queues"),
        Some(0),
        "nothing dead-lettered"
    );
}

/// Waits until `queue` has a leader and holds nothing (ready or unacked) on two reads
/// more than a metrics tick apart. A quorum queue's counts are its leader's, published
/// on its tick (5 s): a leader elected a moment ago reads 0 until its first tick (seen:
/// 0 read while 924 deliveries were still unacked).
async fn drained_for_a_tick(cluster: &Cluster, vhost: &str, queue: &str) {
    leader(cluster, vhost, queue).await;
    eventually("the queue drained while the runtime runs", Duration::from_secs(120), || async {
        let empty = || async { cluster.unsettled(vhost, queue).await.ok().flatten() == Some(0) };
        if !empty().await {
            return false;
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        empty().await
    })
    .await;
}

/// The node that leads `queue` now (a new one is elected after a loss).
async fn leader(cluster: &Cluster, vhost: &str, queue: &str) -> usize {
    let found = AtomicUsize::new(usize::MAX);
    eventually(&format!("a leader for {queue}"), Duration::from_secs(30), || async {
        let leader =
            cluster.leader(vhost, queue).await.ok().flatten().filter(|&node| cluster.is_running(node));
        found.store(leader.unwrap_or(usize::MAX), Ordering::SeqCst);
        leader.is_some()
    })
    .await;
    found.load(Ordering::SeqCst)
}

/// The node an idemq runtime's consuming connection to `vhost` is on, other than
/// `except` (the test's own client, `idemq-tests`, does not count).
async fn consumer_node(cluster: &Cluster, vhost: &str, except: Option<usize>) -> usize {
    let found = AtomicUsize::new(usize::MAX);
    eventually("a node with an idemq consumer", Duration::from_secs(30), || async {
        let connections = cluster.connections(vhost).await.unwrap_or_default();
        let node = connections
            .iter()
            .find(|(node, name)| Some(*node) != except && name.starts_with("idemq consumer"));
        node.inspect(|(node, _)| found.store(*node, Ordering::SeqCst)).is_some()
    })
    .await;
    found.load(Ordering::SeqCst)
}

/// Three consumer processes, each given the three addresses starting at a
/// different node; a stream of payments with duplicates and racing duplicate
/// bursts (one payment four times in a row: the prefetch spreads the copies over
/// the processes). Mid-stream the node leading the queue is SIGKILLed, and after it
/// is back, a node consumers are connected to. Every payment once, nothing
/// dead-lettered, the queue drained, every process exits 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn three_processes_lose_the_queue_leader_then_a_connected_node_and_apply_every_payment_once() {
    let cluster = cluster().await;
    let (vhost, bed) = bed_on(&cluster, |queue| queue).await;
    let mut payments = publish_stream(&bed, 900).await;
    for _ in 0..60 {
        let p = payment(1);
        for _ in 0..4 {
            bed.publish(&p).await;
        }
        payments.push(p);
    }
    let n = payments.len();
    let consumers: Vec<ConsumerProcess> = (0..3)
        .map(|i| {
            let urls = cluster.amqp_urls_from(i, &vhost);
            ConsumerProcess::spawn(CONSUMER, &bed, &[("AMQP_URL", urls.as_str()), ("SLOW_MS", "20")])
        })
        .collect();

    applied(&bed, n / 5).await;
    let lead = leader(&cluster, &vhost, &bed.queue).await;
    cluster.kill(lead).await.expect("kill the queue's leader");
    applied(&bed, n * 2 / 5).await;
    cluster.restart(lead).await.expect("the old leader back");

    let connected = consumer_node(&cluster, &vhost, Some(lead)).await;
    cluster.kill(connected).await.expect("kill a node consumers are connected to");
    applied(&bed, n * 3 / 5).await;
    cluster.restart(connected).await.expect("the node back");

    exactly_once(&cluster, &vhost, &bed, n).await;
    for consumer in consumers {
        assert!(consumer.terminate(Duration::from_secs(30)).await.success(), "exit 0 on SIGTERM");
    }
    drop(bed);
    cluster.delete_vhost(&vhost).await.expect("delete the vhost");
}

/// The payment whose handler kills the runtime's node from inside its batch's
/// transaction (set by the test).
static TRIGGER: OnceLock<(String, String, Weak<Cluster>)> = OnceLock::new();
static KILLED_IN_BATCH: AtomicBool = AtomicBool::new(false);

/// Records the payment; the trigger payment first kills the runtime's node, with
/// the batch's transaction open; every fifth payment fails twice (a retry copy).
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn node_lost_in_batch(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    if let Some((trigger, vhost, cluster)) = TRIGGER.get() {
        if *trigger == msg.payment_id && !KILLED_IN_BATCH.swap(true, Ordering::SeqCst) {
            let cluster = cluster.upgrade().expect("the test's cluster");
            let node = consumer_node(&cluster, vhost, None).await;
            cluster.kill(node).await.map_err(|err| HandlerError::transient(err.to_string()))?;
        }
    }
    // In a batch the first failure only splits it (no attempt is charged); the
    // second, run alone, is retried through a copy.
    if msg.amount_cents % 5 == 0 && next_attempt(&msg.payment_id) <= 2 {
        return Err(HandlerError::transient("the first two attempts of every fifth payment fail"));
    }
    Ok(())
}

/// Group commit on a cluster: the node the runtime is connected to is lost while a
/// batch's transaction is open (the batch commits, its acks cannot be sent, its
/// deliveries come back and are found as duplicates), then, after it is back, the
/// next one is lost just after a retry copy was confirmed and before the original
/// was acked. Every payment once, nothing dead-lettered, the queue drained.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_lost_while_a_batch_is_open_or_a_copy_is_confirmed_loses_and_doubles_nothing() {
    let cluster = cluster().await;
    let (vhost, bed) = bed_on(&cluster, |queue| queue).await;
    let first = publish_stream(&bed, 200).await;
    let trigger = first[100].payment_id.clone();
    TRIGGER.set((trigger.clone(), vhost.clone(), cluster.weak())).expect("one test sets the trigger");

    // The copy hook: once armed with the node the runtime is on, the first
    // confirmed retry copy loses that node. (Quickly: the signal goes before the
    // first await, since losing the node may end this task, hook and all.)
    let armed = Arc::new(AtomicUsize::new(usize::MAX));
    let killed_at_copy = Arc::new(AtomicUsize::new(usize::MAX));
    let hook: idemq::testing::fault::FaultHook = {
        let (armed, killed_at_copy, cluster) =
            (Arc::clone(&armed), Arc::clone(&killed_at_copy), cluster.weak());
        Arc::new(move |ctx: idemq::testing::fault::FaultContext| {
            let (armed, killed_at_copy, cluster) =
                (Arc::clone(&armed), Arc::clone(&killed_at_copy), cluster.clone());
            Box::pin(async move {
                if ctx.point != idemq::testing::fault::FaultPoint::AfterCopy {
                    return;
                }
                let node = armed.swap(usize::MAX, Ordering::SeqCst);
                if node != usize::MAX {
                    killed_at_copy.store(node, Ordering::SeqCst);
                    if let Some(cluster) = cluster.upgrade() {
                        let _ = cluster.kill(node).await;
                    }
                }
            })
        })
    };
    let running = Running::start(
        bed.runtime()
            .amqp_url(cluster.amqp_urls_from(1, &vhost))
            .batch_size(16)
            .reconnect_max_backoff(Duration::from_millis(500))
            .fault_hook(hook)
            .consume(&bed.queue, node_lost_in_batch),
    );
    applied(&bed, first.len()).await;
    assert!(KILLED_IN_BATCH.load(Ordering::SeqCst), "a node was lost inside a batch");
    cluster.heal().await.expect("the node back");

    armed.store(consumer_node(&cluster, &vhost, None).await, Ordering::SeqCst);
    let second = publish_stream(&bed, 200).await;
    applied(&bed, first.len() + second.len()).await;
    let node = killed_at_copy.load(Ordering::SeqCst);
    assert!(node < 3, "a node was lost after a copy's confirm");
    cluster.restart(node).await.expect("the node back");

    exactly_once(&cluster, &vhost, &bed, first.len() + second.len()).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    let of_trigger: Vec<Outcome> = events
        .iter()
        .filter(|s| s.key.as_deref() == Some(trigger.as_str()))
        .map(|s| s.outcome.clone())
        .collect();
    assert_eq!(of_trigger.iter().filter(|o| **o == Outcome::Applied).count(), 1, "{of_trigger:?}");
    assert!(
        of_trigger.contains(&Outcome::Duplicate),
        "the batch committed, its ack was lost with the node, the redelivery found the row: {of_trigger:?}"
    );
    drop(bed);
    cluster.delete_vhost(&vhost).await.expect("delete the vhost");
}

/// `Queue::replicas` sets how many nodes hold a quorum queue (and its dead-letter
/// queue); without it the broker's default (every node) applies.
#[tokio::test(flavor = "multi_thread")]
async fn quorum_queues_get_the_replica_count_asked_for() {
    let cluster = cluster().await;
    let vhost = unique("cluster");
    cluster.add_vhost(&vhost).await.expect("add the test's vhost");
    let broker = Broker::connect(&cluster.amqp_urls(&vhost)).await;
    let channel = broker.connection().create_channel().await.expect("channel");
    Topology::new()
        .queue(Queue::new("two").replicas(2))
        .queue(Queue::new("default"))
        .declare(&channel)
        .await
        .expect("declare");
    assert_eq!(cluster.members(&vhost, "two").await.expect("members").len(), 2);
    assert_eq!(cluster.members(&vhost, "two.dlq").await.expect("members").len(), 2);
    assert_eq!(cluster.members(&vhost, "default").await.expect("members").len(), 3);
    drop(broker);
    cluster.delete_vhost(&vhost).await.expect("delete the vhost");
}

/// A classic queue lives on one node. With that node down, the runtime (on another
/// node) still starts and consumes its quorum queue: the classic queue it only
/// publishes to is skipped with a warning instead of failing every (re)connect.
#[tokio::test(flavor = "multi_thread")]
async fn a_classic_queue_whose_node_is_down_does_not_stop_consumption() {
    let cluster = cluster().await;
    let (vhost, bed) = bed_on(&cluster, |queue| queue).await;
    let events = Queue::new(unique("events")).classic();
    // Declared through node 2, so it lives there.
    let on_node_2 = Broker::connect(&cluster.nodes()[2].amqp_url(&vhost)).await;
    let channel = on_node_2.connection().create_channel().await.expect("channel");
    Topology::new().queue(events.clone()).declare(&channel).await.expect("declare the classic queue");
    drop(on_node_2);
    cluster.kill(2).await.expect("kill node 2");

    let p = payment(100);
    bed.publish(&p).await;
    let topology = Topology::new().queue(Queue::new(bed.queue.clone())).queue(events);
    let settled = Running::settle(
        bed.runtime()
            .amqp_url(cluster.amqp_urls_from(0, &vhost))
            .topology(topology)
            .consume(&bed.queue, idemq_tests::fixture::ledger_payment),
        1,
    )
    .await;
    assert_eq!(settled[0].outcome, Outcome::Applied);
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    cluster.restart(2).await.expect("node 2 back");
    drop(bed);
    cluster.delete_vhost(&vhost).await.expect("delete the vhost");
}

/// The queue the handler below announces each payment to.
static EVENTS: OnceLock<String> = OnceLock::new();

/// The payment, then its event through the outbox.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn apply_and_announce(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut idemq::Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let events = EVENTS.get().expect("set by the test");
    ctx.publish("", events, &idemq_example_payments::PaymentApplied::from(msg))?;
    Ok(())
}

/// The node that leads the events queue — and holds the relay's connection — is
/// SIGKILLed while the relay publishes. The relay reconnects to the next node while
/// the queue is still electing its new leader; a publishing channel opened then was
/// refused (nacked) for good on RabbitMQ 3.10 (seen by hand: the outbox stopped
/// draining until the process restarted). Every payment's event still goes out, one
/// message id per payment, and the outbox drains.
#[tokio::test(flavor = "multi_thread")]
async fn the_relay_publishes_every_event_after_the_events_queues_leader_is_lost() {
    let cluster = cluster().await;
    let (vhost, bed) = bed_on(&cluster, |queue| queue).await;
    let events = Queue::new(unique("events"));
    EVENTS.set(events.name().to_owned()).expect("one test sets it");
    // Declared through node 0 (the bed's client), so node 0 leads it.
    Topology::new()
        .queue(events.clone())
        .declare(&bed.broker.connection().create_channel().await.expect("channel"))
        .await
        .expect("declare");
    let payments = publish_stream(&bed, 1500).await;
    assert_eq!(leader(&cluster, &vhost, events.name()).await, 0, "the events queue is led by node 0");
    let running = Running::start(
        bed.runtime()
            .amqp_url(cluster.amqp_urls_from(0, &vhost))
            .reconnect_max_backoff(Duration::from_millis(500))
            .consume(&bed.queue, apply_and_announce),
    );
    applied(&bed, payments.len() / 3).await;
    cluster.kill(0).await.expect("kill node 0");
    applied(&bed, payments.len()).await;
    let outbox = || async {
        let mut conn = bed.db.connect().await;
        diesel_async::RunQueryDsl::get_result::<i64>(
            diesel::dsl::sql::<diesel::sql_types::BigInt>("SELECT count(*) FROM idemq_outbox"),
            &mut conn,
        )
        .await
        .expect("count the outbox")
    };
    eventually("the outbox drained", Duration::from_secs(60), || async { outbox().await == 0 }).await;
    // Every payment applied is not every delivery settled: what was unacked when node
    // 0 (the queue's leader too) died comes back redelivered, each copy run alone.
    // Stopped before they settle, the runtime would leave them in the queue.
    drained_for_a_tick(&cluster, &vhost, &bed.queue).await;
    running.stop().await.expect("clean shutdown");
    cluster.restart(0).await.expect("node 0 back");
    let client = Broker::connect(&cluster.amqp_urls_from(1, &vhost)).await;
    let delivered = client.drain(events.name()).await;
    let ids: std::collections::HashSet<String> = delivered
        .iter()
        .map(|m| m.delivery.properties.message_id().as_ref().map(|id| id.to_string()).unwrap_or_default())
        .collect();
    assert!(delivered.len() >= payments.len(), "{} events for {} payments", delivered.len(), payments.len());
    assert_eq!(ids.len(), payments.len(), "one message id per payment (a re-send repeats its id)");
    exactly_once(&cluster, &vhost, &bed, payments.len()).await;
    drop(bed);
    cluster.delete_vhost(&vhost).await.expect("delete the vhost");
}
