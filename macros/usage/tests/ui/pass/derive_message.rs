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
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    ctx.send(&PaymentApplied { payment_id: msg.payment_id })?;
    Ok(())
}

/// Named on the wire, versioned, with a route: `send` sets the type and version.
#[derive(Serialize, Deserialize, Message)]
#[message(type = "payment.refunded", version = 2, previous = RefundV1, exchange = "payments", routing_key = "refund")]
struct Refund {
    payment_id: String,
    cents: i64,
}

#[derive(Serialize, Deserialize, Message)]
#[message(version = 1)]
struct RefundV1 {
    payment_id: String,
}

impl From<RefundV1> for Refund {
    fn from(old: RefundV1) -> Self {
        Self { payment_id: old.payment_id, cents: 0 }
    }
}

pub(crate) fn main() {
    assert_eq!(<Refund as idemq::MessageType>::TYPE, "payment.refunded");
    assert_eq!(<Refund as idemq::Versioned>::VERSION, 2);
    assert_eq!(<Refund as idemq::Message>::TYPE, Some("payment.refunded"));
    assert_eq!(<Refund as idemq::Message>::VERSION, Some(2));
    assert_eq!(<RefundV1 as idemq::Versioned>::VERSION, 1);
    assert_eq!(<PaymentRequested as idemq::key::KeyedMessage>::KEY_PATH, "paymentId");
    assert_eq!(<PaymentApplied as idemq::Message>::ROUTING_KEY, "payment.applied");
    let _ = (apply_payment, Topology::new().message::<PaymentApplied>());
}
