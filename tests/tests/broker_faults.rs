//! Faults of the whole RabbitMQ node: a restart of the broker app and a memory
//! alarm. They disturb every connection on the machine, so they live in their own
//! test binary (`cargo test` runs binaries one after another), run one at a time,
//! and restore the broker even when they fail.

use std::time::Duration;

use idemq::observe::ConnectionEvent;
use idemq_tests::fixture::{ledger_payment, payment, publish_stream, slow_payment, Bed, Running};
use idemq_tests::in_both_modes;
use idemq_tests::{eventually, Broker};
use lapin::BasicProperties;
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// The memory watermark this broker runs with (RabbitMQ's default).
const NORMAL_WATERMARK: &str = "0.4";

fn rabbitmqctl(args: &[&str]) -> bool {
    std::process::Command::new("rabbitmqctl")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .is_ok_and(|out| out.status.success())
}

/// Brings the broker back to normal when dropped: app started, no memory alarm.
struct RestoreBroker;

impl Drop for RestoreBroker {
    fn drop(&mut self) {
        rabbitmqctl(&["start_app"]);
        rabbitmqctl(&["await_startup"]);
        rabbitmqctl(&["set_vm_memory_high_watermark", NORMAL_WATERMARK]);
    }
}

in_both_modes! {
/// Fault 3: the broker restarts mid-stream (`rabbitmqctl stop_app`, then
/// `start_app`). Both runtimes reconnect by themselves, declare again and finish
/// the stream: every payment once, nothing left, nothing dead-lettered.
async fn chaos_broker_restarts_mid_stream() {
    let _serial = SERIAL.lock().await;
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, 600).await;
    let start = || {
        Running::start(
            bed.runtime().consume(&bed.queue, slow_payment).reconnect_max_backoff(Duration::from_millis(500)),
        )
    };
    let runtimes = [start(), start()];
    eventually("a third applied", Duration::from_secs(60), || async { bed.ledger_total().await >= 200 })
        .await;
    {
        let _restore = RestoreBroker;
        assert!(rabbitmqctl(&["stop_app"]), "rabbitmqctl stop_app");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eventually("every payment applied", Duration::from_secs(120), || async {
        bed.ledger_total().await >= payments.len() as i64
    })
    .await;
    // Every payment applied is not every delivery settled: what was unacked at the
    // restart comes back redelivered, each copy run alone. Stopped before they
    // settle, the runtimes would leave them in the queue.
    bed.vhost.as_ref().expect("an isolated bed").await_drained(&bed.queue, Duration::from_secs(60)).await;
    for running in runtimes {
        // A runtime reports the loss once its old session is closed (each close
        // handshake is bounded), which may be after the other finished the stream.
        let lost = || running.connection_events().iter().any(|e| matches!(e, ConnectionEvent::Lost { .. }));
        eventually("the runtime reported the lost connection", Duration::from_secs(30), || async { lost() })
            .await;
        running.stop().await.expect("clean shutdown");
    }
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    let broker = Broker::connect(&bed.amqp_url).await;
    assert_eq!(broker.message_count(&bed.queue).await, 0);
    assert_eq!(broker.message_count(&bed.dlq).await, 0);
}
}

in_both_modes! {
/// A memory alarm blocks publishing connections (`connection.blocked`). The
/// runtime publishes copies on a connection of its own, so while a dead letter
/// waits for the alarm to clear, consumption and acks go on; afterwards the dead
/// letter is published and its original acked. (The runtime's prefetch is 8: all 50
/// good messages can only be applied during the alarm if their acks reach the broker.)
async fn a_blocked_publishing_connection_does_not_stall_consumption() {
    let _serial = SERIAL.lock().await;
    let bed = Bed::isolated().await;
    let json = BasicProperties::default().with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, b"not json: must be dead-lettered", json).await;
    let good: Vec<_> = (0..50).map(|i| payment(1 + i)).collect();
    for p in &good {
        bed.publish(p).await;
    }

    let restore = RestoreBroker;
    assert!(rabbitmqctl(&["set_vm_memory_high_watermark", "0"]), "raise a memory alarm");
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    eventually("the good messages applied during the alarm", Duration::from_secs(30), || async {
        bed.ledger_total().await == good.len() as i64
    })
    .await;
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "the dead letter waits for the alarm");
    drop(restore);

    eventually("the dead letter published after the alarm", Duration::from_secs(30), || async {
        bed.broker.message_count(&bed.dlq).await == 1
    })
    .await;
    running.wait_settled(good.len() + 1).await;
    let connection_events = running.connection_events();
    running.stop().await.expect("clean shutdown");
    assert!(
        connection_events.iter().any(|e| matches!(e, ConnectionEvent::Blocked { .. })),
        "{connection_events:?}"
    );
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}
