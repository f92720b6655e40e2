//! Copies — retry copies and dead letters — and the headers that travel with them:
//! no copy expires, a copy is made once per attempt even when the ack after it is
//! lost, and only idemq's own wait queues are trusted with the attempt count.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::testing::fault::FaultHookExt;
use idemq::testing::fault::{FaultContext, FaultHook, FaultPoint};
use idemq::{headers, idempotent_handler, FailureKind, HandlerError, Outcome, Permanent, RetryPolicy};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::in_both_modes;
use idemq_tests::{header_i64, header_str};
use lapin::BasicProperties;

#[idempotent_handler(key = "payment_id")]
async fn always_fails(_conn: &mut AsyncPgConnection, _msg: PaymentRequested) -> Result<(), std::io::Error> {
    Err(std::io::Error::other("the ledger service is down"))
}

in_both_modes! {
/// A message published with a per-message TTL must not take it into the DLQ, or
/// its dead letter would vanish after that TTL: neither a dead letter made at once
/// (bad input) nor one made after retry copies carries `expiration`; the original
/// value is kept in `x-idemq-original-expiration`.
async fn dead_letters_and_retry_copies_do_not_inherit_the_originals_expiration() {
    let bed = Bed::new().await;
    let json = || BasicProperties::default().with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, b"not json", json().with_expiration("60000".into())).await;
    let p = payment(7);
    let body = serde_json::to_vec(&p).unwrap();
    bed.broker.publish_bytes(&bed.queue, &body, json().with_expiration("60000".into())).await;

    let three_attempts = RetryPolicy::new([10, 20].map(Duration::from_millis)).without_jitter();
    let events =
        Running::settle(bed.runtime().consume_with(&bed.queue, always_fails, three_attempts), 4).await;
    assert_eq!(
        events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. })).count(),
        2,
        "{events:?}"
    );

    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 2);
    for letter in &dead {
        let props = &letter.delivery.properties;
        assert_eq!(props.expiration(), &None, "a dead letter must not expire: {props:?}");
        assert_eq!(header_str(props, headers::ORIGINAL_EXPIRATION).as_deref(), Some("60000"));
    }
    let exhausted = dead.iter().find(|d| d.delivery.data == body).expect("the exhausted payment");
    assert_eq!(header_i64(&exhausted.delivery.properties, headers::ATTEMPTS), Some(3));
}
}

/// Closes the consumer's channel the first time a copy is confirmed, so the
/// original's ack is lost and the broker redelivers it.
fn lose_the_ack_after_the_first_copy(fired: Arc<AtomicBool>) -> FaultHook {
    Arc::new(move |ctx: FaultContext| {
        let fired = Arc::clone(&fired);
        Box::pin(async move {
            if ctx.point == FaultPoint::AfterCopy && !fired.swap(true, Ordering::SeqCst) {
                ctx.channel
                    .close(200, "fault: ack lost after the copy".into())
                    .await
                    .expect("close the channel");
            }
        })
    })
}

#[idempotent_handler(key = "payment_id")]
async fn refuses(_conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    Err(Permanent(format!("account {} is closed", msg.account)).into())
}

in_both_modes! {
/// A dead letter confirmed, then the original's ack lost: the redelivered original
/// finds its copy recorded and is acked without running the handler — one message,
/// one dead letter.
async fn a_dead_letter_whose_ack_was_lost_is_not_dead_lettered_twice() {
    let bed = Bed::new().await;
    let p = payment(8);
    bed.publish(&p).await;
    let fired = Arc::new(AtomicBool::new(false));
    let builder = bed
        .runtime()
        .consume(&bed.queue, refuses)
        .fault_hook(lose_the_ack_after_the_first_copy(Arc::clone(&fired)));
    let events = Running::settle(builder, 2).await;
    // Told apart by what they are, not by the order they were reported in.
    let (Some(first), Some(again)) =
        (events.iter().find(|e| !e.redelivered), events.iter().find(|e| e.redelivered))
    else {
        panic!("the delivery and its redelivery: {events:?}")
    };

    assert!(fired.load(Ordering::SeqCst), "the fault hook ran");
    assert!(
        matches!(first.outcome, Outcome::DeadLettered { kind: FailureKind::Handler, .. }),
        "{events:?}"
    );
    assert!(!first.settled_with_broker, "the ack after the closed channel failed: {events:?}");
    assert!(matches!(again.outcome, Outcome::AlreadyCopied { .. }), "{events:?}");
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1, "one dead letter, not two");
    let copy_id = header_str(&dead[0].delivery.properties, headers::COPY_ID).expect("the copy id");
    assert!(matches!(&again.outcome, Outcome::AlreadyCopied { copy_id: seen } if *seen == copy_id));
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

/// Handler runs per payment id (tests of both modes run at once in this process).
static RUNS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn runs_of(payment_id: &str) -> usize {
    RUNS.lock().expect("runs").iter().filter(|id| *id == payment_id).count()
}

#[idempotent_handler(key = "payment_id")]
async fn counts_and_fails(
    _conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), std::io::Error> {
    RUNS.lock().expect("runs").push(msg.payment_id);
    Err(std::io::Error::other("still down"))
}

in_both_modes! {
/// A retry copy confirmed, then the original's ack lost: without the copy record
/// the redelivered original would run again and start a second retry lineage (two
/// attempt budgets, two dead letters). With it, the handler runs exactly as often as
/// the policy allows and the message is dead-lettered once.
async fn a_retry_copy_whose_ack_was_lost_keeps_one_lineage() {
    let bed = Bed::new().await;
    let p = payment(9);
    bed.publish(&p).await;
    // The first delay outlasts the fault (closing the channel after the copy): the
    // copy must not come back to the session whose ack is being lost.
    let three_attempts = RetryPolicy::new([80, 40].map(Duration::from_millis));
    let fired = Arc::new(AtomicBool::new(false));
    let builder = bed
        .runtime()
        .consume_with(&bed.queue, counts_and_fails, three_attempts)
        .fault_hook(lose_the_ack_after_the_first_copy(Arc::clone(&fired)));
    // Three attempts plus the redelivered original, acked as already copied.
    let events = Running::settle(builder, 4).await;

    assert!(fired.load(Ordering::SeqCst), "the fault hook ran");
    assert_eq!(runs_of(&p.payment_id), 3, "the handler ran once per attempt: {events:?}");
    assert_eq!(
        events.iter().filter(|e| matches!(e.outcome, Outcome::AlreadyCopied { .. })).count(),
        1,
        "{events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1, "one dead letter: {events:?}");
    assert_eq!(header_i64(&dead[0].delivery.properties, headers::ATTEMPTS), Some(3));
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// A dead letter replayed to its queue (body and headers as they are in the DLQ,
/// `x-idemq-attempts` included) is a new message: it starts at attempt 1, not with
/// its attempts used up. Only a copy that came back through this queue's own wait
/// queue continues the count.
async fn a_replayed_dead_letter_starts_with_fresh_attempts() {
    let bed = Bed::new().await;
    let p = payment(11);
    bed.publish(&p).await;
    let two_attempts = || RetryPolicy::new([Duration::from_millis(10)]);
    let builder = bed.runtime().consume_with(&bed.queue, always_fails, two_attempts());
    let events = Running::settle_message(builder, &p.payment_id).await;
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");

    let dead = bed.broker.drain(&bed.dlq).await;
    let letter = &dead[0].delivery;
    assert_eq!(header_i64(&letter.properties, headers::ATTEMPTS), Some(2));
    bed.broker.publish_bytes(&bed.queue, &letter.data, letter.properties.clone()).await;

    let replayed =
        Running::settle(bed.runtime().consume_with(&bed.queue, always_fails, two_attempts()), 1).await;
    assert_eq!(replayed[0].attempt, 1, "a replay starts afresh: {replayed:?}");
    assert!(matches!(replayed[0].outcome, Outcome::Retry { .. }), "{replayed:?}");
}
}
