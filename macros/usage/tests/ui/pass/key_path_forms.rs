//! Key paths beyond a plain field: a keyword field (`r#type`), a tuple field,
//! a `Box<str>` key, and `std::result::Result` spelled in full.
use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Kind {
    r#type: String,
}

#[derive(Deserialize)]
struct Pair {
    ids: (u32, Box<str>),
}

#[idempotent_handler(key = "type")]
async fn by_keyword(conn: &mut AsyncPgConnection, msg: Kind) -> std::result::Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

#[idempotent_handler(key = "ids.1")]
async fn by_tuple_field(conn: &mut AsyncPgConnection, msg: Pair) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

pub(crate) fn main() {
    let kind = Kind { r#type: "created".into() };
    assert_eq!(
        idemq::Handler::key(&by_keyword, &kind, &idemq::Metadata::new(&Default::default(), &[]))
            .unwrap()
            .as_str(),
        "created"
    );
    let pair = Pair { ids: (1, "second".into()) };
    assert_eq!(
        idemq::Handler::key(&by_tuple_field, &pair, &idemq::Metadata::new(&Default::default(), &[]))
            .unwrap()
            .as_str(),
        "second"
    );
}
