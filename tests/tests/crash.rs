//! Consumer processes that die: a message that kills its consumer on every delivery
//! must not loop forever.

use std::time::{Duration, Instant};

use idemq::{headers, FailureKind};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{payment, Bed, ConsumerProcess};
use idemq_tests::in_both_modes;
use idemq_tests::{header_str, unique};

const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");

/// Runs consumer processes with `env` (one that kills itself on the poison message),
/// restarting each that dies, until a dead letter appears — at most 3 crashes, the
/// delivery limit — and then until `applied` ledger rows exist; stops the last one
/// with SIGTERM (it must exit 0). Returns how often a consumer died.
async fn crash_until_dead_lettered(bed: &Bed, env: &[(&str, &str)], applied: usize) -> u32 {
    let mut crashes = 0;
    let mut consumer = ConsumerProcess::spawn(CONSUMER, bed, env);
    let deadline = Instant::now() + Duration::from_secs(90);
    while bed.broker.message_count(&bed.dlq).await == 0 {
        assert!(Instant::now() < deadline, "no dead letter after {crashes} crashes");
        if consumer.exited().is_some() {
            crashes += 1;
            assert!(crashes <= 3, "the consumer was killed more often than the delivery limit allows");
            consumer = ConsumerProcess::spawn(CONSUMER, bed, env);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    idemq_tests::eventually("the good messages applied", Duration::from_secs(30), || async {
        bed.ledger_total().await == applied as i64
    })
    .await;
    let status = consumer.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "clean exit after SIGTERM: {status:?}");
    crashes
}

in_both_modes! {
/// Stages a poison message: the consumer process is SIGKILLed inside the handler's
/// transaction on every delivery of it, so no error is ever recorded. The quorum
/// queue's delivery count grows with each crash; at the queue's limit (3) the runtime
/// dead-letters it as `poison` without running the handler. The messages behind it
/// are then applied once each, and nothing of the poison message was ever committed.
async fn a_message_that_kills_its_consumer_every_time_is_dead_lettered_at_the_limit() {
    let bed = Bed::with_queue(|q| q.delivery_limit(3)).await;
    let poison = PaymentRequested { payment_id: unique("kill"), account: unique("acct"), amount_cents: 13 };
    bed.publish(&poison).await;
    let good: Vec<_> = (0..20).map(|i| payment(100 + i)).collect();
    for p in &good {
        bed.publish(p).await;
    }

    // Prefetch 1: only the poison message is in flight when the process dies.
    let env = [("KILL_ON", "kill"), ("DELIVERY_LIMIT", "3"), ("CONCURRENCY", "1")];
    let crashes = crash_until_dead_lettered(&bed, &env, good.len()).await;

    assert_eq!(crashes, 3, "one crash per delivery below the limit");
    for p in &good {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{}", p.payment_id);
    }
    assert_eq!(bed.ledger_rows(&poison.payment_id).await, 0, "every killed transaction rolled back");
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1);
    let props = &dead[0].delivery.properties;
    assert_eq!(header_str(props, headers::ERROR_KIND).as_deref(), Some(FailureKind::Poison.as_str()));
    assert_eq!(dead[0].delivery.data, serde_json::to_vec(&poison).unwrap());
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// The same crash loop with eight deliveries in flight. Each crash returns the whole
/// prefetch window, and the quorum queue counts a delivery for every message in it:
/// judging poison by that count would dead-letter the innocent neighbours. Poison
/// is judged by handler starts instead, recorded for redelivered messages, which
/// run one at a time: only the message that kills the consumer is dead-lettered,
/// every other one is applied exactly once.
async fn a_crash_looping_message_does_not_take_its_prefetch_window_with_it() {
    let bed = Bed::with_queue(|q| q.delivery_limit(3)).await;
    let good: Vec<_> = (0..20).map(|i| payment(200 + i)).collect();
    let poison = PaymentRequested { payment_id: unique("kill"), account: unique("acct"), amount_cents: 13 };
    // The poison message sits in the middle of the stream, with neighbours on both sides.
    for p in &good[..4] {
        bed.publish(p).await;
    }
    bed.publish(&poison).await;
    for p in &good[4..] {
        bed.publish(p).await;
    }

    let env = [("KILL_ON", "kill"), ("DELIVERY_LIMIT", "3"), ("CONCURRENCY", "8"), ("SLOW_MS", "20")];
    let crashes = crash_until_dead_lettered(&bed, &env, good.len()).await;
    assert!(crashes >= 1, "the poison message crashed the consumer");

    for p in &good {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{} applied exactly once", p.payment_id);
    }
    let dead = bed.broker.drain(&bed.dlq).await;
    let dead_keys: Vec<_> = dead
        .iter()
        .map(|d| serde_json::from_slice::<PaymentRequested>(&d.delivery.data).map(|p| p.payment_id))
        .collect();
    assert_eq!(dead.len(), 1, "only the poison message is dead-lettered: {dead_keys:?}");
    assert_eq!(dead[0].delivery.data, serde_json::to_vec(&poison).unwrap());
    assert_eq!(header_str(&dead[0].delivery.properties, headers::ERROR_KIND).as_deref(), Some("poison"));
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}
