use diesel_async::AsyncPgConnection;
use idemq::saga::Saga;
use idemq::{idempotent_handler, Batch, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Placed {
    order_id: String,
}

#[derive(Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "order", key = "order_id", takes(Placed))]
struct Order {
    steps: u32,
}

// The saga taken read-only.
#[idempotent_handler(key = "order_id")]
async fn read_only(conn: &mut AsyncPgConnection, msg: Placed, saga: &Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id, saga.steps);
    Ok(())
}

// A batch of a saga's messages.
#[idempotent_handler(key = "order_id")]
async fn batched(conn: &mut AsyncPgConnection, batch: &mut Batch<Placed>, saga: &mut Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, batch.len(), saga.steps);
    Ok(())
}

// Saga options on a handler of no saga; a policy it does not have.
#[idempotent_handler(key = "order_id", saga(start))]
async fn no_saga(conn: &mut AsyncPgConnection, msg: Placed) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id);
    Ok(())
}

#[idempotent_handler(key = "order_id", saga(missing = "wait"))]
async fn unknown_policy(conn: &mut AsyncPgConnection, msg: Placed, saga: &mut Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id, saga.steps);
    Ok(())
}

// Started by a message, but the state has no `Default`.
#[idempotent_handler(key = "order_id", saga(start))]
async fn starts(conn: &mut AsyncPgConnection, msg: Placed, saga: &mut Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id, saga.steps);
    Ok(())
}

// A step without dedup rows would move the saga again for a duplicate.
#[idempotent_handler(key = "order_id", dedup = false)]
async fn undeduplicated(conn: &mut AsyncPgConnection, msg: Placed, saga: &mut Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id, saga.steps);
    Ok(())
}

fn main() {}
