//! An opaque error type (`impl Error`) in the return type is accepted.
use diesel_async::AsyncPgConnection;
use idemq::idempotent_handler;
use serde::Deserialize;

#[derive(Deserialize)]
struct Job {
    id: String,
}

#[idempotent_handler(key = "id")]
async fn run(
    conn: &mut AsyncPgConnection,
    msg: Job,
) -> Result<(), impl std::error::Error + Send + Sync + 'static> {
    let _ = (conn, msg);
    "1".parse::<u8>().map(drop)
}

fn assert_handler<H: idemq::Handler<Message = Job>>(_: H) {}

pub(crate) fn main() {
    assert_handler(run);
}
