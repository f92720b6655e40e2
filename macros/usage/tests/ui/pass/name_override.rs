use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Ping {
    id: String,
}

// `name` may come before or after `key`, and a trailing comma is fine.
#[idempotent_handler(name = "custom", key = "id")]
async fn renamed_fn(conn: &mut AsyncPgConnection, msg: Ping) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

pub(crate) fn main() {
    let h = renamed_fn;
    assert_eq!(idemq::Handler::name(&h), "custom");
    assert_eq!(idemq::Handler::key_path(&h), "id");
}
