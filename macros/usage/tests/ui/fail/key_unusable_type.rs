use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reading {
    value: f64,
}

#[derive(Deserialize)]
struct Blob {
    digest: Vec<u8>,
}

#[idempotent_handler(key = "value")]
async fn record(conn: &mut AsyncPgConnection, msg: Reading) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

#[idempotent_handler(key = "digest")]
async fn store(conn: &mut AsyncPgConnection, msg: Blob) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn main() {}
