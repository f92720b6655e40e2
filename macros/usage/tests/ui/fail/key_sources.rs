use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct OrderPlaced {
    tenant: String,
}

fn tenant(msg: &OrderPlaced) -> String {
    msg.tenant.clone()
}

fn borrowed(msg: &OrderPlaced) -> &str {
    &msg.tenant
}

#[idempotent_handler(key = "@correlation_id")]
async fn unknown(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "@header:", name = "no_header")]
async fn no_header(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key = "tenant", key_fn = tenant, name = "both")]
async fn both(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

#[idempotent_handler(key_fn = borrowed, name = "borrowed")]
async fn borrows(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.tenant);
    Ok(())
}

fn main() {}
