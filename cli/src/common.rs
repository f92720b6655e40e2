//! What the CLI's commands and `dlq` share: connecting to the database and to the
//! broker, passive declares, and the result a command returns. Its own module so
//! that `dlq` needs nothing from the CLI that declares it.

use diesel_async::AsyncPgConnection;
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};

use idemq_core::Error;

/// What a subcommand returns: any error, printed once by `Cli::run_matches`.
pub(crate) type CliResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A connection to the database at `url`.
pub(crate) async fn connect_db(url: &str) -> Result<AsyncPgConnection, Error> {
    idemq_core::connect::database(url).await
}

/// A connection to the database at `url` whose statements are cut after `limit`
/// (a count over a huge table must not hold a page or `status`); or why there is none.
pub(crate) async fn connect_db_limited(
    url: &str,
    limit: std::time::Duration,
) -> Result<AsyncPgConnection, String> {
    let mut conn = connect_db(url).await.map_err(|err| err.report())?;
    idemq_core::__private::sibling::db::limit_statements(&mut conn, limit)
        .await
        .map_err(|err| format!("cannot set a statement_timeout: {err}"))?;
    Ok(conn)
}

/// A connection to the first broker address of the list that answers.
pub(crate) async fn connect_broker(urls: &str) -> Result<Connection, Error> {
    idemq_core::connect::broker(urls, "cli").await
}

/// A passive declare of `queue` on a throwaway channel (a 404 closes it): its ready
/// messages and consumers, `None` if it does not exist.
pub(crate) async fn passive_queue(
    connection: &Connection,
    queue: &str,
) -> Result<Option<lapin::Queue>, Error> {
    let channel = open_channel(connection).await?;
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    match channel.queue_declare(queue.into(), options, FieldTable::default()).await {
        Ok(declared) => {
            let _ = channel.close(200, "inspected".into()).await;
            Ok(Some(declared))
        }
        Err(_) if connection.status().connected() => Ok(None),
        Err(source) => Err(Error::Amqp { action: format!("inspect queue '{queue}'"), source }),
    }
}

/// Whether `exchange` exists: a passive declare on a throwaway channel, which
/// checks the name only (the broker ignores the kind of a passive declare).
pub(crate) async fn exchange_exists(connection: &Connection, exchange: &str) -> Result<bool, Error> {
    let channel = open_channel(connection).await?;
    let options = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
    match channel
        .exchange_declare(exchange.into(), ExchangeKind::Direct, options, FieldTable::default())
        .await
    {
        Ok(()) => {
            let _ = channel.close(200, "inspected".into()).await;
            Ok(true)
        }
        Err(_) if connection.status().connected() => Ok(false),
        Err(source) => Err(Error::Amqp { action: format!("inspect exchange '{exchange}'"), source }),
    }
}

async fn open_channel(connection: &Connection) -> Result<lapin::Channel, Error> {
    connection
        .create_channel()
        .await
        .map_err(|source| Error::Amqp { action: "open a channel".into(), source })
}

/// Standard output for a command's report, line by line: a reader that has gone
/// (`status | head -3`) ends the writing — not the command, with a panic, as
/// `println!` would (Rust ignores SIGPIPE, so the write fails instead).
/// Or, [`captured`](Out::captured), the lines kept for a page (the console).
pub(crate) struct Out {
    closed: bool,
    kept: Option<Vec<String>>,
}

impl Out {
    pub(crate) fn new() -> Self {
        Self { closed: false, kept: None }
    }

    /// An `Out` that keeps its lines instead of writing them ([`Out::lines`]).
    pub(crate) fn captured() -> Self {
        Self { closed: false, kept: Some(Vec::new()) }
    }

    /// The lines kept so far (none for standard output).
    pub(crate) fn lines(self) -> Vec<String> {
        self.kept.unwrap_or_default()
    }

    /// Writes `text` and a newline, unless the reader has gone.
    pub(crate) fn line(&mut self, text: impl std::fmt::Display) {
        use std::io::Write;
        if let Some(kept) = &mut self.kept {
            kept.push(text.to_string());
        } else if !self.closed && writeln!(std::io::stdout().lock(), "{text}").is_err() {
            self.closed = true;
        }
    }
}

/// `println!` to an [`Out`]: `say!(out, "{n} missing")`.
macro_rules! say {
    ($out:expr, $($arg:tt)*) => {
        $out.line(format_args!($($arg)*))
    };
}
pub(crate) use say;
