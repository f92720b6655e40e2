use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct OrderPlaced {
    tenant: String,
}

#[idempotent_handler(key = "{tenant:x")]
async fn unclosed(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "{tenant}}", name = "stray")]
async fn stray(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "a:{}", name = "empty")]
async fn empty(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "{tenant}:{@messageid}", name = "unknown_source")]
async fn unknown_source(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "{tenant}:{order.id}", name = "wrong_field")]
async fn wrong_field(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

fn main() {}
