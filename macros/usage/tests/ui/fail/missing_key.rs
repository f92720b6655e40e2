use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

#[idempotent_handler(name = "refund")]
async fn refund(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

fn main() {}
