use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Batch, Context, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    let _ = (conn, batch, ctx);
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "shared")]
async fn shared(conn: &mut AsyncPgConnection, batch: &Batch<PaymentRequested>) -> Result<(), HandlerError> {
    let _ = (conn, batch);
    Ok(())
}

fn main() {}
