use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id", retry(delays = ["5 seconds"]), on_conflict = "skip")]
async fn bad_values(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "bounds", batch = 0, dedup = "no", queue = "")]
async fn bounds(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "shape", retry = 3)]
async fn shape(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

fn main() {}
