use diesel_async::AsyncPgConnection;
use idemq::saga::Saga;
use idemq::{idempotent_handler, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Placed {
    order_id: String,
}

#[derive(Deserialize)]
struct Refunded {
    order_id: String,
}

#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "order", key = "order_id", takes(Placed))]
struct Order {
    steps: u32,
}

// A step for a message the saga does not take.
#[idempotent_handler(key = "order_id")]
async fn refunded(conn: &mut AsyncPgConnection, msg: Refunded, saga: &mut Saga<Order>) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id);
    saga.steps += 1;
    Ok(())
}

// The saga's key names a field the message does not have.
#[derive(Deserialize)]
struct Misnamed {
    id: String,
}

#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(key = "order_id", takes(Misnamed))]
struct Other {
    steps: u32,
}

fn main() {
    let _ = Misnamed { id: String::new() }.id;
}
