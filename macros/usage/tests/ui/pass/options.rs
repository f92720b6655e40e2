use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Handler, HandlerError, OnConflict};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

// Every option that tunes the runtime for one handler.
#[idempotent_handler(
    key = "payment_id",
    queue = "payments",
    retry(delays = ["250ms", "5s", "2m"]),
    on_conflict = "ignore",
    batch = 8,
    idempotency_key_lifetime = "24h"
)]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

// Idempotent by itself: no dedup rows (and no key needed).
#[idempotent_handler(dedup = false, retry(none))]
async fn upsert(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

pub(crate) fn main() {
    assert_eq!(apply_payment.queue(), Some("payments"));
    assert_eq!(apply_payment.retry().map(|r| r.max_attempts()), Some(4));
    assert_eq!(apply_payment.on_conflict(), Some(OnConflict::Ignore));
    assert_eq!(apply_payment.batch_size(), Some(8));
    assert!(apply_payment.dedup());
    assert_eq!(apply_payment.idempotency_key_lifetime(), Some(std::time::Duration::from_secs(86_400)));
    assert_eq!(upsert.idempotency_key_lifetime(), None);
    assert!(!upsert.dedup());
    assert_eq!(upsert.retry().map(|r| r.max_attempts()), Some(1));
    assert_eq!(upsert.key_path(), "@hash");
}
