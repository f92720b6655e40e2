use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
    account: String,
}

#[idempotent_handler(key = "payment_id", lane = "acount")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id, msg.account);
    Ok(())
}

#[idempotent_handler(key = "payment_id", lane = "")]
async fn empty_lane(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id, msg.account);
    Ok(())
}

fn main() {}
