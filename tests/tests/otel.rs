//! OpenTelemetry (idemq's feature `otel`): the spans handlers run in continue the
//! trace their deliveries came with, across hops. The spans go to opentelemetry_sdk's
//! in-memory exporter through the `tracing-opentelemetry` layer, installed as this
//! binary's global subscriber (the runtime's tasks run on any worker thread); each
//! test picks its spans out by a trace id of its own.

use std::sync::OnceLock;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::otel::opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use idemq::otel::tracing_opentelemetry;
use idemq::outbox::Outgoing;
use idemq::{idempotent_handler, Context, HandlerError, Publisher, Queue, Topology};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, in_both_modes, unique};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The span id of the sender every test's first message names in its `traceparent`.
const SENDER_SPAN: &str = "00f067aa0ba902b7";

/// The spans every handler of this binary ran in, once ended.
fn spans() -> &'static InMemorySpanExporter {
    static SPANS: OnceLock<(SdkTracerProvider, InMemorySpanExporter)> = OnceLock::new();
    let (_, exporter) = SPANS.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idemq-tests"));
        tracing_subscriber::registry()
            .with(layer)
            .with(tracing_subscriber::filter::LevelFilter::INFO)
            .try_init()
            .expect("the first subscriber of this binary (before any Bed installs its own)");
        (provider, exporter)
    });
    exporter
}

/// A trace id of this test's own: 32 hex digits.
fn new_trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The string attribute `name` of `span`.
fn attribute(span: &SpanData, name: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key.as_str() == name).map(|kv| kv.value.as_str().into_owned())
}

/// The ended `handler` spans of `handler` whose message was keyed `key`, once there
/// is one (at most 20 s).
async fn handler_spans(handler: &str, key: &str) -> Vec<SpanData> {
    let find = || {
        let ended = spans().get_finished_spans().expect("the in-memory exporter");
        ended
            .into_iter()
            .filter(|span| span.name == "handler")
            .filter(|span| attribute(span, "handler").as_deref() == Some(handler))
            .filter(|span| attribute(span, "key").as_deref() == Some(key))
            .collect::<Vec<_>>()
    };
    eventually(&format!("the span of {handler} for {key}"), Duration::from_secs(20), || async {
        !find().is_empty()
    })
    .await;
    find()
}

/// Publishes `body` as JSON to `queue`, as a sender in the trace `trace_id` would.
async fn publish_traced<T: Serialize>(bed: &Bed, queue: &str, body: &T, trace_id: &str) {
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let outgoing = Outgoing::json("", queue, body)
        .expect("outgoing")
        .header("traceparent", format!("00-{trace_id}-{SENDER_SPAN}-01"));
    publisher.publish_outgoing(outgoing).await.expect("published");
    publisher.close().await;
}

/// Stage 1's message: an order, and the queue of stage 2.
#[derive(Serialize, Deserialize)]
struct Order {
    id: String,
    next: String,
}

/// Stage 2's message, published by stage 1 through the outbox.
#[derive(Serialize, Deserialize)]
struct Shipment {
    order_id: String,
}

#[idempotent_handler(key = "id", name = "otel_stage_one")]
async fn stage_one(
    _conn: &mut AsyncPgConnection,
    order: Order,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    ctx.publish("", &order.next, &Shipment { order_id: order.id })?;
    Ok(())
}

#[idempotent_handler(key = "order_id", name = "otel_stage_two")]
async fn stage_two(_conn: &mut AsyncPgConnection, _shipment: Shipment) -> Result<(), HandlerError> {
    Ok(())
}

in_both_modes! {
/// An order published without a trace: stage 1's span starts one, and stage 2's
/// span is its child, in that trace.
async fn an_untraced_message_starts_a_trace_that_the_next_stage_continues() {
    spans();
    let bed = Bed::isolated().await;
    let next = unique("otel-next");
    let order = Order { id: unique("order"), next: next.clone() };
    let publisher = Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    publisher.publish("", &bed.queue, &order).await.expect("published");
    publisher.close().await;
    let running = Running::start(
        bed.runtime()
            .topology(Topology::new().queue(Queue::new(next.clone())))
            .consume(&bed.queue, stage_one)
            .consume(&next, stage_two),
    );
    running.wait_settled(2).await;
    running.stop().await.expect("clean shutdown");

    let first = handler_spans("otel_stage_one", &order.id).await;
    let second = handler_spans("otel_stage_two", &order.id).await;
    let (first, second) = (&first[0], &second[0]);
    assert_eq!(first.parent_span_id, SpanId::INVALID, "stage 1 starts the trace");
    assert_eq!(second.span_context.trace_id(), first.span_context.trace_id(), "stage 2 continues it");
    assert_eq!(second.parent_span_id, first.span_context.span_id(), "stage 2's parent: stage 1's span");
}
}

in_both_modes! {
/// A two-stage pipeline is one trace: an order published with a `traceparent` is
/// handled in a span that is the child of that sender's span; what the handler
/// publishes (an outbox row, sent by the relay) is handled by stage 2 in a span that
/// is the child of stage 1's, in the same trace.
async fn a_two_stage_pipelines_spans_share_one_trace_id() {
    spans();
    let bed = Bed::isolated().await;
    let next = unique("otel-next");
    let trace_id = new_trace_id();
    let order = Order { id: unique("order"), next: next.clone() };
    publish_traced(&bed, &bed.queue, &order, &trace_id).await;
    let running = Running::start(
        bed.runtime()
            .topology(Topology::new().queue(Queue::new(next.clone())))
            .consume(&bed.queue, stage_one)
            .consume(&next, stage_two),
    );
    running.wait_settled(2).await;
    running.stop().await.expect("clean shutdown");

    let first = handler_spans("otel_stage_one", &order.id).await;
    let second = handler_spans("otel_stage_two", &order.id).await;
    assert_eq!((first.len(), second.len()), (1, 1), "one run of each stage");
    let (first, second) = (&first[0], &second[0]);
    let trace = TraceId::from_hex(&trace_id).expect("hex");
    assert_eq!(first.span_context.trace_id(), trace, "stage 1 continues the sender's trace");
    assert_eq!(second.span_context.trace_id(), trace, "stage 2 is in the same trace");
    assert_eq!(first.parent_span_id, SpanId::from_hex(SENDER_SPAN).expect("hex"), "stage 1's parent: the sender");
    assert!(first.parent_span_is_remote);
    assert_eq!(second.parent_span_id, first.span_context.span_id(), "stage 2's parent: stage 1's span");
    assert!(second.parent_span_is_remote, "known from the message's traceparent");
    assert_eq!(attribute(first, "trace_id").as_deref(), Some(trace_id.as_str()));
}
}

in_both_modes! {
/// A batch handler (the demo's `apply_payment`) runs in one span for many
/// deliveries: that span starts a trace of its own, linked to the sender of each
/// traced delivery it handled.
async fn a_batch_handlers_span_links_to_each_deliverys_sender() {
    spans();
    let bed = Bed::isolated().await;
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    idemq_example_payments::topology().declare(&channel).await.expect("the demo's topology");
    let sent: Vec<(PaymentRequested, String)> = (0..2).map(|i| (payment(100 + i), new_trace_id())).collect();
    for (payment, trace_id) in &sent {
        publish_traced(&bed, &bed.queue, payment, trace_id).await;
    }
    let running = Running::start(
        bed.runtime()
            .topology(idemq_example_payments::topology())
            .consume(&bed.queue, idemq_example_payments::apply_payment),
    );
    running.wait_settled(2).await;
    running.stop().await.expect("clean shutdown");

    let wanted: Vec<TraceId> =
        sent.iter().map(|(_, trace_id)| TraceId::from_hex(trace_id).expect("hex")).collect();
    let linked = || {
        spans()
            .get_finished_spans()
            .expect("the in-memory exporter")
            .into_iter()
            .filter(|span| span.name == "handler")
            .filter(|span| span.links.iter().any(|link| wanted.contains(&link.span_context.trace_id())))
            .collect::<Vec<_>>()
    };
    eventually("the batch spans", Duration::from_secs(20), || async {
        linked().iter().map(|span| span.links.len()).sum::<usize>() >= 2
    })
    .await;
    let mut links = Vec::new();
    for span in linked() {
        assert!(!wanted.contains(&span.span_context.trace_id()), "a batch's span starts a trace of its own");
        assert_eq!(span.parent_span_id, SpanId::INVALID, "and has no parent");
        links.extend(span.links.iter().map(|link| {
            assert_eq!(link.span_context.span_id(), SpanId::from_hex(SENDER_SPAN).expect("hex"));
            assert!(link.span_context.is_remote());
            link.span_context.trace_id()
        }));
    }
    links.sort_by_key(|id| id.to_string());
    let mut expected = wanted.clone();
    expected.sort_by_key(|id| id.to_string());
    assert_eq!(links, expected, "one link to each delivery's sender");
}
}
