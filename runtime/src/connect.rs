//! Connections made as idemq makes its own, for the application's code beside the
//! runtime (a publisher, a setup step, a report): TLS as the URL says, the same
//! checks, the same errors.
//!
//! `amqps://` URLs take RabbitMQ's URI parameters (`cacertfile`, `certfile`,
//! `keyfile`, `server_name_indication`, `verify`); PostgreSQL URLs take libpq's
//! (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`). lapin's and diesel-async's own
//! `connect`/`establish` read neither: `lapin::Connection::connect` would ignore
//! `cacertfile`, and `AsyncPgConnection::establish` refuses `sslmode=verify-full`
//! and never encrypts. The guide's *Security* chapter (`docs/security.md`, *TLS*) has the details.
//!
//! The URLs themselves: [`env_url`] reads one as the runtime does (`AMQP_URL` or
//! `AMQP_URL_FILE`, …), [`redact`] hides its password for a log line, and [`report`]
//! prints an error with its causes, each once, redacted.
//!
//! ```no_run
//! # async fn example() -> Result<(), idemq::Error> {
//! let db = idemq::connect::database("postgres://app@db.internal/app?sslmode=verify-full&sslrootcert=/etc/ca.pem").await?;
//! let broker = idemq::connect::broker("amqps://app:secret@mq.internal/%2f?cacertfile=/etc/ca.pem", "publisher").await?;
//! # Ok(()) }
//! ```

use diesel_async::AsyncPgConnection;

use crate::base::BoxFuture;
use crate::error::Error;

pub use crate::base::redact::redact;
pub use crate::config::{env_url, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
pub use crate::error::report;

/// Connects to PostgreSQL at `url`, with TLS as its libpq parameters say
/// (`sslmode=prefer` by default, as libpq) and the dead-peer detection idemq's own
/// connections have.
///
/// # Errors
/// [`Error::Tls`] when the server's certificate does not verify or the server
/// refuses this client's; [`Error::Config`] for a URL or file that cannot be used;
/// [`Error::DatabaseConnect`] otherwise.
///
/// Made as idemq makes its own (its socket, TLS and login by idemq, then handed to
/// diesel-async), it is driven by a task of idemq's rather than diesel-async's: it
/// lives until dropped, as any, but diesel-async's `notifications_stream()` yields
/// nothing on it. To `LISTEN`, use a `tokio_postgres` client of your own.
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the half-made connection.
pub fn database(url: &str) -> BoxFuture<'_, Result<AsyncPgConnection, Error>> {
    Box::pin(crate::store::db::connect(url))
}

/// Connects to the first address of `urls` (an `AMQP_URL`: one URL or several,
/// comma-separated) that answers, with TLS for `amqps://` addresses. The connection
/// is named `idemq <role> (pid N)` for the broker's operators.
///
/// # Errors
/// [`Error::Tls`] when the broker's certificate does not verify or the broker
/// refuses this client's; [`Error::Config`] for a URL or file that cannot be used;
/// [`Error::AmqpConnect`] when no address answers.
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the half-made connection.
pub fn broker<'a>(urls: &'a str, role: &'a str) -> BoxFuture<'a, Result<lapin::Connection, Error>> {
    Box::pin(async move { Ok(crate::broker::brokers::Brokers::parse(urls)?.connect(role).await?.0) })
}
