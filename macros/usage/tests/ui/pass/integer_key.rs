use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Unsigned {
    seq: u64,
}

#[derive(Deserialize)]
struct Signed {
    seq: i64,
}

#[idempotent_handler(key = "seq")]
async fn on_unsigned(conn: &mut AsyncPgConnection, msg: Unsigned) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

#[idempotent_handler(key = "seq")]
async fn on_signed(conn: &mut AsyncPgConnection, msg: Signed) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn assert_handler<H: idemq::Handler>(_: H) {}

pub(crate) fn main() {
    assert_handler(on_unsigned);
    assert_handler(on_signed);
    let key = idemq::Handler::key(
        &on_unsigned,
        &Unsigned { seq: 42 },
        &idemq::Metadata::new(&Default::default(), &[]),
    )
    .unwrap();
    assert_eq!(key.as_str(), "42");
    let key =
        idemq::Handler::key(&on_signed, &Signed { seq: -7 }, &idemq::Metadata::new(&Default::default(), &[]))
            .unwrap();
    assert_eq!(key.as_str(), "-7");
}
