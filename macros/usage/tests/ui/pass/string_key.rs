use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct PaymentRequested {
    payment_id: String,
    amount_cents: i64,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.amount_cents);
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = PaymentRequested>>(_: H) {}

// Registers with the runtime as it is (not run: that would connect).
#[allow(dead_code)]
fn register() -> idemq::RuntimeBuilder {
    idemq::Runtime::builder().consume("payments", apply_payment)
}

pub(crate) fn main() {
    assert_handler(apply_payment);
    let h = apply_payment;
    assert_eq!(idemq::Handler::name(&h), "apply_payment");
    assert_eq!(idemq::Handler::key_path(&h), "payment_id");
    let msg = PaymentRequested { payment_id: "p-1".into(), amount_cents: 5 };
    assert_eq!(
        idemq::Handler::key(&h, &msg, &idemq::Metadata::new(&Default::default(), &[])).unwrap().as_str(),
        "p-1"
    );
}
