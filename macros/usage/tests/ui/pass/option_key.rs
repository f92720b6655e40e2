use diesel_async::AsyncPgConnection;
use idemq::key::KeyError;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Event {
    id: Option<String>,
}

#[idempotent_handler(key = "id")]
async fn on_event(conn: &mut AsyncPgConnection, msg: Event) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = Event>>(_: H) {}

pub(crate) fn main() {
    assert_handler(on_event);
    let some = Event { id: Some("e-1".into()) };
    assert_eq!(
        idemq::Handler::key(&on_event, &some, &idemq::Metadata::new(&Default::default(), &[]))
            .unwrap()
            .as_str(),
        "e-1"
    );
    let none = Event { id: None };
    assert_eq!(
        idemq::Handler::key(&on_event, &none, &idemq::Metadata::new(&Default::default(), &[])).unwrap_err(),
        KeyError::Missing
    );
}
