use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct Job {
    id: String,
}

#[derive(Debug)]
struct Failed;

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("failed")
    }
}

impl std::error::Error for Failed {}

/// Doc comments and other attributes stay on the original fn.
#[idempotent_handler(key = "id")]
async fn apply(conn: &mut AsyncPgConnection, msg: Job) -> Result<(), Failed> {
    let _ = (conn, msg);
    Ok(())
}

// The original fn keeps its signature, including its own error type.
async fn reuse(conn: &mut AsyncPgConnection, msg: Job) -> Result<(), Failed> {
    apply::call(conn, msg).await
}

// And composes with `?` into a `HandlerError`.
async fn reuse_with_question_mark(conn: &mut AsyncPgConnection, msg: Job) -> Result<(), HandlerError> {
    apply::call(conn, msg).await?;
    Ok(())
}

pub(crate) fn main() {
    let _ = reuse;
    let _ = reuse_with_question_mark;
}
