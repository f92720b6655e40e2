use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Context, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
    retries: u32,
) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id, ctx, retries);
    Ok(())
}

fn main() {}
