use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Context, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[derive(Serialize)]
struct PaymentApplied<'a> {
    payment_id: &'a str,
}

// The context after the message, to publish through the outbox.
#[idempotent_handler(key = "payment_id")]
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    let _ = conn;
    ctx.publish("", "payments.applied", &PaymentApplied { payment_id: &msg.payment_id })?;
    Ok(())
}

// Before the message, read only: the compiler tells them apart.
#[idempotent_handler(key = "payment_id", name = "audit")]
async fn audit(
    conn: &mut AsyncPgConnection,
    ctx: &Context,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    let _ = (conn, ctx.attempt(), ctx.message_id(), msg.payment_id);
    Ok(())
}

pub(crate) fn main() {
    let _ = (apply_payment, audit);
}
