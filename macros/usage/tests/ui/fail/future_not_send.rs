use std::rc::Rc;

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

async fn audit(_: &str) {}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let id = Rc::new(msg.payment_id);
    audit(&id).await;
    let _ = conn;
    Ok(())
}

fn main() {}
