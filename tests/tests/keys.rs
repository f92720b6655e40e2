//! Every key form against the real broker and database: what is one message and
//! what is two, and what a missing key does.

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::store::schema::idemq_dedup;
use idemq::{idempotent_handler, FailureKind, HandlerError, Message, Metadata, Outcome};
use idemq_tests::fixture::{Bed, Running};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Order {
    id: String,
}

/// An order; `tenant` and `order.id` make its key in the template handler.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    tenant: String,
    order: Order,
}

#[idempotent_handler(key = "{tenant}:{order.id}", name = "by_template")]
async fn by_template(conn: &mut AsyncPgConnection, msg: &OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, &msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@message_id", name = "by_message_id")]
async fn by_message_id(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@header:x-idempotency-key", name = "by_header")]
async fn by_header(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@hash", name = "by_hash")]
async fn by_hash(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

fn tenant_and_header(msg: &OrderPlaced, metadata: &Metadata<'_>) -> Option<String> {
    Some(format!("{}/{}", msg.tenant, metadata.header("x-region")?))
}

#[idempotent_handler(key_fn = tenant_and_header, name = "by_fn")]
async fn by_fn(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

/// The key from the type, renamed on the wire.
#[derive(Debug, Deserialize, Message)]
struct Refund {
    #[message(key)]
    #[serde(rename = "refundId")]
    refund_id: String,
    amount_cents: i64,
}

#[idempotent_handler(name = "refunds")]
async fn refunds(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    Ok(())
}

/// The same type keyed in the attribute by the field's Rust name.
#[idempotent_handler(key = "refund_id", name = "refunds_by_path")]
async fn refunds_by_path(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    Ok(())
}

fn order(tenant: &str, id: &str) -> serde_json::Value {
    serde_json::json!({ "tenant": tenant, "order": { "id": id } })
}

async fn publish(bed: &Bed, body: &serde_json::Value, props: BasicProperties) {
    let body = serde_json::to_vec(body).expect("serialize");
    bed.broker.publish_bytes(&bed.queue, &body, props.with_content_type("application/json".into())).await;
}

fn with_header(name: &str, value: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(name.into(), AMQPValue::LongString(value.into()));
    BasicProperties::default().with_headers(headers)
}

async fn stored_keys(bed: &Bed, handler: &str) -> Vec<String> {
    let mut conn = bed.db.connect().await;
    idemq_dedup::table
        .filter(idemq_dedup::handler.eq(handler))
        .select(idemq_dedup::key)
        .order(idemq_dedup::key)
        .load(&mut conn)
        .await
        .expect("read the dedup rows")
}

fn outcomes_of(events: &[idemq::observe::Settled]) -> Vec<Outcome> {
    events.iter().map(|event| event.outcome.clone()).collect()
}

fn count(outcomes: &[Outcome], wanted: &Outcome) -> usize {
    outcomes.iter().filter(|outcome| *outcome == wanted).count()
}

/// Template values never run together: tenant `a:b` with id `c` and tenant `a` with
/// id `b:c` are two orders; the same order twice is one.
#[tokio::test(flavor = "multi_thread")]
async fn a_template_key_keeps_its_parts_apart() {
    let bed = Bed::new().await;
    for body in [order("a:b", "c"), order("a", "b:c"), order("a", "b:c")] {
        publish(&bed, &body, BasicProperties::default()).await;
    }
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_template), 3).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(count(&outcomes, &Outcome::Applied), 2, "{outcomes:?}");
    assert_eq!(count(&outcomes, &Outcome::Duplicate), 1, "{outcomes:?}");
    assert_eq!(stored_keys(&bed, "by_template").await, ["1#a:3#b:c", "3#a:b:1#c"]);
}

/// `@message_id`: the AMQP property is the key; a delivery without one is
/// dead-lettered as a key error, not applied under an empty key.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_id_key_dedups_on_the_property() {
    let bed = Bed::new().await;
    let body = order("t", "1");
    for id in ["m-1", "m-1", "m-2"] {
        publish(&bed, &body, BasicProperties::default().with_message_id(id.into())).await;
    }
    publish(&bed, &body, BasicProperties::default()).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_message_id), 4).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(count(&outcomes, &Outcome::Applied), 2, "{outcomes:?}");
    assert_eq!(count(&outcomes, &Outcome::Duplicate), 1, "{outcomes:?}");
    assert!(
        outcomes.iter().any(|o| matches!(o, Outcome::DeadLettered { kind: FailureKind::Key, error } if error.contains("@message_id"))),
        "{outcomes:?}"
    );
    assert_eq!(stored_keys(&bed, "by_message_id").await, ["m-1", "m-2"]);
}

/// `@header:<name>` and `key_fn` with metadata read the delivery's headers.
#[tokio::test(flavor = "multi_thread")]
async fn header_keys_and_key_fns_read_the_delivery() {
    let bed = Bed::new().await;
    let body = order("t", "1");
    publish(&bed, &body, with_header("x-idempotency-key", "k-1")).await;
    publish(&bed, &body, with_header("x-idempotency-key", "k-1")).await;
    publish(&bed, &body, BasicProperties::default()).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_header), 3).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(
        (count(&outcomes, &Outcome::Applied), count(&outcomes, &Outcome::Duplicate)),
        (1, 1),
        "{outcomes:?}"
    );
    assert_eq!(stored_keys(&bed, "by_header").await, ["k-1"]);

    let bed = Bed::new().await;
    publish(&bed, &body, with_header("x-region", "eu")).await;
    publish(&bed, &body, with_header("x-region", "us")).await;
    publish(&bed, &body, BasicProperties::default()).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_fn), 3).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(count(&outcomes, &Outcome::Applied), 2, "{outcomes:?}");
    assert_eq!(stored_keys(&bed, "by_fn").await, ["t/eu", "t/us"]);
}

fn with_raw_header(name: &str, value: AMQPValue) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(name.into(), value);
    BasicProperties::default().with_headers(headers)
}

/// A header key is byte-exact: the bytes `ff 31` and `fe 31` (not UTF-8; a lossy
/// reading made both `"\u{fffd}1"`) are two messages, both applied, each its own
/// stored key; the same bytes again are a duplicate. The integer header `7` and the
/// string header `"7"` are one key (documented on `Metadata::header_key`).
#[tokio::test(flavor = "multi_thread")]
async fn header_keys_are_byte_exact_and_an_integer_is_its_decimal_text() {
    let bed = Bed::new().await;
    let body = order("t", "1");
    let bytes = |raw: &[u8]| AMQPValue::LongString(raw.to_vec().into());
    for value in [bytes(b"\xff1"), bytes(b"\xfe1"), bytes(b"\xff1")] {
        publish(&bed, &body, with_raw_header("x-idempotency-key", value)).await;
    }
    publish(&bed, &body, with_raw_header("x-idempotency-key", AMQPValue::LongLongInt(7))).await;
    publish(&bed, &body, with_raw_header("x-idempotency-key", bytes(b"7"))).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_header), 5).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(
        (count(&outcomes, &Outcome::Applied), count(&outcomes, &Outcome::Duplicate)),
        (3, 2),
        "ff 31, fe 31 and 7 applied; ff 31 again and \"7\" duplicates: {outcomes:?}"
    );
    let keys = stored_keys(&bed, "by_header").await;
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(keys.contains(&"7".to_owned()), "{keys:?}");
    assert_eq!(keys.iter().filter(|key| key.starts_with("sha256:")).count(), 2, "{keys:?}");
    assert!(!keys.iter().any(|key| key.contains('\u{fffd}')), "never a lossy reading: {keys:?}");
}

/// `@hash`: a copy of the same payload (re-serialized: other member order and
/// spacing) is a duplicate; another payload is another message.
#[tokio::test(flavor = "multi_thread")]
async fn a_hash_key_is_the_payload() {
    let bed = Bed::new().await;
    let props = || BasicProperties::default().with_content_type("application/json".into());
    for body in [
        &br#"{"tenant":"t","order":{"id":"1"}}"#[..],
        br#"{ "order": { "id": "1" }, "tenant": "t" }"#,
        br#"{"tenant":"t","order":{"id":"2"}}"#,
    ] {
        bed.broker.publish_bytes(&bed.queue, body, props()).await;
    }
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_hash), 3).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(
        (count(&outcomes, &Outcome::Applied), count(&outcomes, &Outcome::Duplicate)),
        (2, 1),
        "{outcomes:?}"
    );
    let keys = stored_keys(&bed, "by_hash").await;
    assert!(keys.iter().all(|k| k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit())), "{keys:?}");
}

/// A key declared by the type (`#[message(key)]`) is read under its serde name; a
/// body without it is a key error, and a body whose *other* field is wrong is a
/// decode error — not misreported as a missing key because the key's Rust name is
/// absent from the wire.
#[tokio::test(flavor = "multi_thread")]
async fn a_renamed_key_field_is_found_under_its_wire_name() {
    let bed = Bed::new().await;
    for body in [
        serde_json::json!({ "refundId": "r-1", "amount_cents": 5 }),
        serde_json::json!({ "refundId": "r-1", "amount_cents": 5 }),
        serde_json::json!({ "amount_cents": 5 }),
        serde_json::json!({ "refundId": "r-2", "amount_cents": "five" }),
    ] {
        publish(&bed, &body, BasicProperties::default()).await;
    }
    let events = Running::settle(bed.runtime().consume(&bed.queue, refunds), 4).await;
    let outcomes = outcomes_of(&events);
    assert_eq!(
        (count(&outcomes, &Outcome::Applied), count(&outcomes, &Outcome::Duplicate)),
        (1, 1),
        "{outcomes:?}"
    );
    let kinds: Vec<FailureKind> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::DeadLettered { kind, .. } => Some(*kind),
            _ => None,
        })
        .collect();
    assert_eq!(kinds.len(), 2, "{outcomes:?}");
    assert!(kinds.contains(&FailureKind::Key) && kinds.contains(&FailureKind::Decode), "{outcomes:?}");
    assert_eq!(stored_keys(&bed, "refunds").await, ["r-1"]);

    // Keyed by the Rust name: a wrong amount is still a decode error.
    let bed = Bed::new().await;
    publish(
        &bed,
        &serde_json::json!({ "refundId": "r-3", "amount_cents": "five" }),
        BasicProperties::default(),
    )
    .await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, refunds_by_path), 1).await;
    assert!(
        matches!(&events[0].outcome, Outcome::DeadLettered { kind: FailureKind::Decode, .. }),
        "{:?}",
        events[0].outcome
    );
}
