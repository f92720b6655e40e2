use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Batch, HandlerError};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[derive(Serialize)]
struct Receipt;

// One result for the whole batch: a batch handler returns one per message.
#[idempotent_handler(key = "payment_id")]
async fn apply_payment(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<Receipt, HandlerError> {
    let _ = (conn, batch);
    Ok(Receipt)
}

fn main() {}
