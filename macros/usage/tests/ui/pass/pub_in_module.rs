mod payments {
    use diesel_async::AsyncPgConnection;
    use idemq::{idempotent_handler, HandlerError};
    use serde::Deserialize;

    /// A payment.
    #[derive(Deserialize)]
    pub struct PaymentRequested {
        pub payment_id: String,
    }

    /// Applies a payment.
    #[idempotent_handler(key = "payment_id")]
    pub async fn apply_payment(
        conn: &mut AsyncPgConnection,
        msg: PaymentRequested,
    ) -> Result<(), HandlerError> {
        let _ = (conn, msg);
        Ok(())
    }
}

use diesel_async::AsyncPgConnection;
use payments::{apply_payment, PaymentRequested};

fn assert_handler<H: idemq::Handler<Message = PaymentRequested>>(_: H) {}

async fn call_from_outside(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), idemq::HandlerError> {
    payments::apply_payment::call(conn, msg).await
}

pub(crate) fn main() {
    assert_handler(apply_payment);
    assert_handler(payments::apply_payment);
    let _ = call_from_outside;
}
