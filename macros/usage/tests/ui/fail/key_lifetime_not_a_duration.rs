use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};

#[derive(serde::Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id", idempotency_key_lifetime = "a day")]
async fn charge(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

fn main() {}
