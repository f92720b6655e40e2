//! W3C trace context across hops: a delivery's `traceparent` is continued by every
//! message its handler publishes (stored with the outbox row when enqueued) and by
//! the reply to it — the same trace id, a span id of its own. Each test runs in a
//! vhost of its own.

use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::outbox::Outgoing;
use idemq::{idempotent_handler, Context, HandlerError, Publisher};
use idemq_example_payments::{record_payment, PaymentApplied, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, header_str, in_both_modes};
use lapin::message::BasicGetMessage;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const OTHER_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

fn traceparent(trace_id: &str) -> String {
    format!("00-{trace_id}-00f067aa0ba902b7-01")
}

/// The `traceparent` of `message`, split: (trace id, span id, flags).
fn trace_of(message: &BasicGetMessage) -> Option<(String, String, String)> {
    let parent = header_str(&message.delivery.properties, "traceparent")?;
    let fields: Vec<&str> = parent.split('-').collect();
    assert_eq!(fields.len(), 4, "a W3C traceparent: {parent}");
    assert_eq!(fields[0], "00");
    Some((fields[1].to_owned(), fields[2].to_owned(), fields[3].to_owned()))
}

/// Publishes `payment` to the bed's queue as a real publisher would, with a
/// `traceparent` (and a `tracestate`) when given a trace id.
async fn publish_traced(bed: &Bed, payment: &PaymentRequested, trace_id: Option<&str>) {
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let mut outgoing = Outgoing::json("", &bed.queue, payment).expect("outgoing");
    if let Some(trace_id) = trace_id {
        outgoing = outgoing.header("traceparent", traceparent(trace_id)).header("tracestate", "vendor=abc");
    }
    publisher.publish_outgoing(outgoing).await.expect("published");
    publisher.close().await;
}

in_both_modes! {
/// The contract: a payment published with a `traceparent` yields a
/// `payments.applied` event whose `traceparent` has the same trace id (and a span
/// id of its own, the flags and `tracestate` kept), through the demo's batch
/// handler, whose events each continue their own delivery's trace; a payment
/// without one yields an event without one.
async fn a_traced_payment_yields_a_payments_applied_event_in_the_same_trace() {
    let bed = Bed::isolated().await;
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    idemq_example_payments::topology().declare(&channel).await.expect("the demo's topology");
    let (first, second, untraced) = (payment(100), payment(200), payment(300));
    publish_traced(&bed, &first, Some(TRACE_ID)).await;
    publish_traced(&bed, &second, Some(OTHER_TRACE_ID)).await;
    publish_traced(&bed, &untraced, None).await;
    let running = Running::start(
        bed.runtime()
            .topology(idemq_example_payments::topology())
            .consume(&bed.queue, idemq_example_payments::apply_payment),
    );
    running.wait_settled(3).await;
    eventually("three events published", Duration::from_secs(20), || async {
        bed.broker.message_count(idemq_example_payments::EVENTS_QUEUE).await >= 3
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let events = bed.broker.drain(idemq_example_payments::EVENTS_QUEUE).await;
    assert_eq!(events.len(), 3);
    for event in &events {
        let applied: PaymentApplied = serde_json::from_slice(&event.delivery.data).expect("an event");
        let expected = match applied.payment_id {
            id if id == first.payment_id => Some(TRACE_ID),
            id if id == second.payment_id => Some(OTHER_TRACE_ID),
            _ => None,
        };
        match (expected, trace_of(event)) {
            (Some(expected), Some((trace_id, span_id, flags))) => {
                assert_eq!(trace_id, expected, "the same trace");
                assert_ne!(span_id, "00f067aa0ba902b7", "a span of its own");
                assert_eq!(flags, "01");
                assert_eq!(header_str(&event.delivery.properties, "tracestate").as_deref(), Some("vendor=abc"));
            }
            (None, None) => {}
            (expected, got) => panic!("expected trace {expected:?}, got {got:?}"),
        }
    }
}
}

/// A quote: what the handler returns.
#[derive(serde::Serialize)]
struct Receipt {
    payment_id: String,
}

/// The trace ids the quote handler saw (`Context::trace_id`).
static SEEN: std::sync::Mutex<Vec<Option<String>>> = std::sync::Mutex::new(Vec::new());

#[idempotent_handler(key = "payment_id", name = "traced_quote")]
async fn quote(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &Context,
) -> Result<Receipt, HandlerError> {
    SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(ctx.trace_id().map(str::to_owned));
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id })
}

/// The reply to a traced request continues its trace, and so does the stored
/// reply a duplicate of it gets.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_continues_the_requests_trace() {
    let bed = Bed::isolated().await;
    let replies = idemq_tests::unique("replies");
    bed.broker.declare_queue(&replies).await;
    let asked = payment(400);
    let body = serde_json::to_vec(&asked).expect("json");
    let mut headers = FieldTable::default();
    headers.insert("traceparent".into(), AMQPValue::LongString(LongString::from(traceparent(TRACE_ID))));
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_reply_to(replies.as_str().into())
        .with_correlation_id("c-1".into())
        .with_headers(headers);
    bed.broker.publish_bytes(&bed.queue, &body, props.clone()).await;
    bed.broker.publish_bytes(&bed.queue, &body, props).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, quote));
    running.wait_settled(2).await;
    eventually("two replies", Duration::from_secs(20), || async {
        bed.broker.message_count(&replies).await >= 2
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let seen = SEEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
    assert_eq!(seen, [Some(TRACE_ID.to_owned())], "the handler ran once and saw the delivery's trace");
    let answered = bed.broker.drain(&replies).await;
    assert_eq!(answered.len(), 2);
    for reply in &answered {
        let (trace_id, span_id, _) = trace_of(reply).expect("a traceparent on the reply");
        assert_eq!(trace_id, TRACE_ID);
        assert_ne!(span_id, "00f067aa0ba902b7");
    }
}
