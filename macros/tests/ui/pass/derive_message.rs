use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Context, HandlerError, Message, Topology};
use serde::{Deserialize, Serialize};

/// Consumed: the key comes from the type.
#[derive(Deserialize, Message)]
struct PaymentRequested {
    #[message(key)]
    #[serde(rename = "paymentId")]
    payment_id: String,
    amount_cents: i64,
}

/// Published: where it goes is declared once.
#[derive(Serialize, Message)]
#[message(exchange = "payments", routing_key = "payment.applied")]
struct PaymentApplied {
    payment_id: String,
}

/// Applies a payment (this doc stays on the handler type).
#[idempotent_handler]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested, ctx: &mut Context) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    ctx.send(&PaymentApplied { payment_id: msg.payment_id })?;
    Ok(())
}

fn main() {
    assert_eq!(<PaymentRequested as idemq::KeyedMessage>::KEY_PATH, "paymentId");
    assert_eq!(<PaymentApplied as idemq::Message>::ROUTING_KEY, "payment.applied");
    let _ = (apply_payment, Topology::new().message::<PaymentApplied>());
}
