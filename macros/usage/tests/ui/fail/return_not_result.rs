use diesel_async::AsyncPgConnection;
use idemq::idempotent_handler;
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> bool {
    let _ = (conn, msg.payment_id);
    true
}

fn main() {}
