use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment<M: Send>(conn: &mut AsyncPgConnection, msg: M) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn main() {}
