//! What the CLI's commands and `dlq` share: connecting to the database and to the
//! broker, and the result a command returns. Its own module so that `dlq` needs
//! nothing from the CLI that declares it.

use diesel_async::AsyncPgConnection;
use lapin::Connection;

use crate::error::Error;

/// What a subcommand returns: any error, printed once by `Cli::run_matches`.
pub(crate) type CliResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A connection to the database at `url`.
pub(crate) async fn connect_db(url: &str) -> Result<AsyncPgConnection, Error> {
    crate::store::db::connect(url).await
}

/// A connection to the first broker address of the list that answers.
pub(crate) async fn connect_broker(urls: &str) -> Result<Connection, Error> {
    Ok(crate::broker::brokers::Brokers::parse(urls)?.connect("cli").await?.0)
}
