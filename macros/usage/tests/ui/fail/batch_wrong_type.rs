use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

// A `Batch` of the application's own, not idemq's.
struct Batch<M>(Vec<M>);

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, batch: &mut Batch<PaymentRequested>) -> Result<(), HandlerError> {
    let _ = (conn, batch.0.len());
    Ok(())
}

fn main() {}
