use std::fmt;

use diesel_async::AsyncPgConnection;
use idemq::idempotent_handler;
use serde::Deserialize;

#[derive(Deserialize)]
struct Transfer {
    id: String,
    amount: i64,
}

#[derive(Debug)]
enum TransferError {
    Overdrawn,
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("account overdrawn")
    }
}

impl std::error::Error for TransferError {}

#[idempotent_handler(key = "id")]
async fn transfer(conn: &mut AsyncPgConnection, msg: Transfer) -> Result<(), TransferError> {
    let _ = conn;
    if msg.amount < 0 {
        return Err(TransferError::Overdrawn);
    }
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = Transfer>>(_: H) {}

pub(crate) fn main() {
    assert_handler(transfer);
}
