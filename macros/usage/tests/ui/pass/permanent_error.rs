use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError, Permanent};
use serde::Deserialize;

#[derive(Deserialize)]
struct Refund {
    id: String,
    amount: i64,
}

#[idempotent_handler(key = "id")]
async fn refund(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
    let _ = conn;
    if msg.amount < 0 {
        return Err(Permanent("negative refund").into());
    }
    let amount: u32 = u32::try_from(msg.amount).map_err(Permanent)?;
    let _ = amount;
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = Refund>>(_: H) {}

pub(crate) fn main() {
    assert_handler(refund);
}
