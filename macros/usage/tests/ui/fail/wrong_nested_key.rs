use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    id: String,
}

#[derive(Deserialize)]
struct OrderPlaced {
    order: Order,
}

#[idempotent_handler(key = "order.uid")]
async fn place(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg.order.id);
    Ok(())
}

fn main() {}
