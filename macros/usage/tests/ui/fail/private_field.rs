use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};

mod messages {
    #[derive(serde::Deserialize)]
    pub struct PaymentRequested {
        payment_id: String,
        pub amount_cents: i64,
    }
}

// The key field is private to `messages`: the handler cannot read it.
#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: messages::PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    Ok(())
}

fn main() {}
