use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Account {
    id: u64,
}

#[derive(Deserialize)]
struct Payment {
    payment_id: String,
    account: Account,
}

// A lane is any field a key may be: here a nested integer.
#[idempotent_handler(key = "payment_id", lane = "account.id")]
async fn apply(conn: &mut AsyncPgConnection, msg: Payment) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

#[idempotent_handler(key = "payment_id")]
async fn unlaned(conn: &mut AsyncPgConnection, msg: Payment) -> Result<(), HandlerError> {
    let _ = (conn, msg.account.id);
    Ok(())
}

pub(crate) fn main() {
    let message = Payment { payment_id: "p-1".into(), account: Account { id: 7 } };
    assert_eq!(apply.lane_path(), Some("account.id"));
    let lane = apply.lane(&message).expect("a lane").expect("a lane value");
    assert_eq!(lane.as_str(), "7");
    assert_eq!(unlaned.lane_path(), None);
    assert!(unlaned.lane(&message).is_none());
}
