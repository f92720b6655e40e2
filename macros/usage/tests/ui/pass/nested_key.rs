use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Order {
    id: String,
}

#[derive(Deserialize)]
struct OrderPlaced {
    order: Order,
}

#[idempotent_handler(key = "order.id")]
async fn place(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = OrderPlaced>>(_: H) {}

pub(crate) fn main() {
    assert_handler(place);
    assert_eq!(idemq::Handler::key_path(&place), "order.id");
    let msg = OrderPlaced { order: Order { id: "o-9".into() } };
    assert_eq!(
        idemq::Handler::key(&place, &msg, &idemq::Metadata::new(&Default::default(), &[])).unwrap().as_str(),
        "o-9"
    );
}
