use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[derive(Serialize)]
struct Receipt {
    payment_id: String,
}

// A result is stored with the dedup row and replied to requests.
#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<Receipt, HandlerError> {
    let _ = conn;
    Ok(Receipt { payment_id: msg.payment_id })
}

#[idempotent_handler(key = "payment_id", name = "count")]
async fn count(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<u64, HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(1)
}

pub(crate) fn main() {
    let _ = (apply_payment, count);
}
