use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Batch, Handler, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Clone, Deserialize, Serialize)]
struct PaymentRequested {
    payment_id: String,
    account: String,
}

#[derive(Serialize)]
struct Receipt {
    payment_id: String,
}

// The new messages of a transaction together, each with its own context; the
// options apply per message.
#[idempotent_handler(key = "payment_id", lane = "account", batch = 50)]
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    batch: &mut idemq::Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    let _ = (conn, batch.len(), batch.messages());
    for (msg, ctx) in batch.iter_mut() {
        ctx.publish("", "payments.applied", msg)?;
    }
    Ok(())
}

// One result per message, in order; `Batch` imported; any error type.
#[idempotent_handler(key = "payment_id", name = "receipts")]
async fn receipts(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<Vec<Receipt>, std::io::Error> {
    let _ = conn;
    Ok(batch.messages().iter().map(|msg| Receipt { payment_id: msg.payment_id.clone() }).collect())
}

pub(crate) fn main() {
    assert!(apply_payment.batched());
    assert!(receipts.batched());
}
