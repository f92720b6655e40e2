use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError, Metadata};
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    id: u64,
}

#[derive(Deserialize)]
struct OrderPlaced {
    tenant: String,
    order: Order,
}

// A template: each value length-prefixed, so parts never run together.
#[idempotent_handler(key = "{tenant}:{order.id}")]
async fn by_template(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

// Literal braces, and a template mixing a header with a field.
#[idempotent_handler(key = "{{{@header:x-tenant}}}/{order.id}", name = "braces")]
async fn braces(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

// AMQP's message_id, a header, the payload's fingerprint.
#[idempotent_handler(key = "@message_id")]
async fn by_message_id(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@header:x-idempotency-key")]
async fn by_header(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@hash")]
async fn by_hash(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

// A function of the message, or of the message and the delivery.
fn order_key(msg: &OrderPlaced) -> String {
    format!("{}-{}", msg.tenant.len(), msg.order.id)
}

fn header_or_id(msg: &OrderPlaced, metadata: &Metadata<'_>) -> Option<String> {
    metadata.header("x-order").or_else(|| Some(msg.order.id.to_string()))
}

#[idempotent_handler(key_fn = order_key)]
async fn by_fn(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key_fn = header_or_id)]
async fn by_fn_and_metadata(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

pub(crate) fn main() {
    let _ = (by_template, braces, by_message_id, by_header, by_hash, by_fn, by_fn_and_metadata);
}
