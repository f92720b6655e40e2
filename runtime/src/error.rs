//! The runtime's errors: start-up, connection and configuration failures.
//!
//! Per-message failures are not errors of the runtime: they end in a retry or a
//! dead letter (see [`FailureKind`](crate::FailureKind)) and never stop it.
//!
//! # A cause is shown once
//!
//! An error caused by another shows that cause once, in one place — as `thiserror`
//! and the Rust API guidelines advise, and as lapin and axum do — so that a reporter
//! walking the chain of [`source`](std::error::Error::source)s (`anyhow`'s `{:#}`,
//! `eyre`, [`Error::report`], idemq's CLI) never prints it twice:
//!
//! - **A cause idemq holds as an error is the variant's `source()`, and its
//!   `Display` does not repeat it**: the message says what idemq was doing
//!   ([`Error::Amqp`], [`Error::ConfigIo`], [`Error::Migration`]). `{}` alone shows
//!   that message only: print or log an [`Error`] with [`Error::report`] (or a
//!   reporter of your own) to see why.
//! - **A cause that may quote a secret is never a source**: a reporter walking the
//!   chain does not redact. lapin's connect errors quote the URL they were given,
//!   password included ([`Error::AmqpConnect`]); a TOML error quotes a line of the
//!   file ([`Error::Config`] for the CLI's `--config`). Such a cause is shown in the
//!   message, through [`redact`](crate::connect::redact), and `source()` is `None`. So a source
//!   is only ever an error met on a connection already made (which no longer knows
//!   its URL) or an I/O error (which never quotes what a file holds).
//! - **A cause idemq has only as words** — a broker's reply text, the server's
//!   answer, a certificate's problem put plainly — is a field shown in the message.
//!
//! Every URL and every driver message shown by these errors' `Display` and `Debug`,
//! and by [`Error::report`], goes through [`redact`](crate::connect::redact): a driver may
//! quote the URL it was given.

use std::fmt;

/// The settings and the variable that start a runtime with an unpatched AMQP parser
/// ([`Error::UnpatchedAmqpParser`]).
pub(crate) const UNPATCHED_PARSER_OPT_OUT: &str =
    "`RuntimeBuilder::allow_unpatched_amqp_parser()` or IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER=1";

/// What stopped the runtime or kept it from starting.
///
/// `Display` and `Debug` show every URL and driver message with its passwords
/// redacted ([`redact`](crate::connect::redact)).
///
/// A cause is shown once. One idemq holds as an error is the variant's
/// [`source`](std::error::Error::source), not repeated by `Display` (which says what
/// idemq was doing): print or log an `Error` with [`Error::report`], or a reporter
/// that walks the sources (`anyhow`'s `{:#}`). A cause that may quote a password (a
/// connect error quoting the URL, a TOML error quoting a line of the file) is never a
/// source — reporters do not redact — but shown in the message, redacted.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Could not connect to RabbitMQ.
    #[error("cannot connect to RabbitMQ at {url}: {}; is the broker running, and are AMQP_URL's credentials and vhost right?", redact(&.cause.to_string()))]
    AmqpConnect {
        /// The URL, password redacted.
        url: String,
        /// The client's error. It may quote the URL: show it through
        /// [`redact`](crate::connect::redact) (this error's `Display` does). Deliberately not
        /// the error's `source()`: a reporter walking the chain would print it
        /// unredacted (and twice, since the message already holds it).
        cause: lapin::Error,
    },
    /// A RabbitMQ operation failed on a connection already made.
    #[error("RabbitMQ refused or failed to {action}")]
    Amqp {
        /// What the runtime was doing.
        action: String,
        /// The client's error: the broker's reply, or the channel or connection lost.
        #[source]
        source: lapin::Error,
    },
    /// A queue exists but lives on a cluster node that is down (404 NOT_FOUND "home
    /// node … is down"): a classic queue is not replicated, so while that node is
    /// gone nothing can declare, publish to or consume it.
    #[error(
        "queue '{queue}' is unavailable: {detail}. It is a classic queue and its node is down; \
         it comes back with that node. To survive the loss of a node, make it a quorum queue \
         (the default: drop `.classic()`; an existing classic queue must be drained and deleted first)"
    )]
    QueueUnavailable {
        /// The queue's name.
        queue: String,
        /// The broker's words.
        detail: String,
    },
    /// A queue exists with other arguments than the topology declares (406 PRECONDITION_FAILED).
    #[error(
        "queue '{queue}' already exists with different arguments: {detail}. \
         idemq declares it with [{declared}]. \
         Fix: declare it as it exists (e.g. `.classic()` for a classic queue), \
         or move its messages and delete it (`rabbitmqctl delete_queue {queue}`) so it can be redeclared"
    )]
    QueueMismatch {
        /// The queue's name.
        queue: String,
        /// The broker's words on which argument differs (it names the first only).
        detail: String,
        /// The arguments idemq declared, `name=value, ...`.
        declared: String,
    },
    /// An exchange exists with another type or other arguments (406 PRECONDITION_FAILED).
    #[error(
        "exchange '{exchange}' already exists with a different type or arguments: {detail}. \
         Fix: declare it as it exists, or delete it (`rabbitmqctl delete_exchange {exchange}`)"
    )]
    ExchangeMismatch {
        /// The exchange's name.
        exchange: String,
        /// The broker's words on what differs.
        detail: String,
    },
    /// Could not reach PostgreSQL or build the pool.
    #[error(
        "cannot connect to PostgreSQL at {url}: {}; is the server running and DATABASE_URL right?",
        redact(message)
    )]
    DatabaseConnect {
        /// The URL, password redacted.
        url: String,
        /// What failed, in the driver's words (shown redacted).
        message: String,
        /// The error `message` tells of, for a program to inspect: a
        /// `tokio_postgres::Error` when the server refused the connection
        /// (`downcast_ref` it; its `code()` is the server's SQLSTATE, such as
        /// `28P01` for a wrong password or `3D000` for a missing database), a
        /// `std::io::Error` when the network did, a diesel error when a statement of
        /// the connection's set-up failed. It may quote the URL: show it through
        /// [`redact`](crate::connect::redact). Deliberately not the error's `source()`, as
        /// with [`Error::AmqpConnect`]'s cause: `message` already says it, and a
        /// reporter walking the chain would print it a second time, unredacted.
        cause: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// idemq's tables are missing or out of date, or this user may not use them:
    /// found at start-up, or when one of idemq's own statements is refused.
    #[error("the database is not ready for idemq: {problem}. Fix: {fix}")]
    Schema {
        /// What is wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// One attempt at connecting to the broker and declaring the topology did not
    /// finish in time. The runtime tries again, so it is the reason of a retry (in the
    /// log and in [`ConnectionEvent`](crate::observe::ConnectionEvent)s) rather than what
    /// `run` returns; at start-up it counts as the broker being unreachable
    /// ([`Error::StartupTimeout`] once the startup timeout is spent).
    #[error("connecting to RabbitMQ and declaring the topology took longer than {}; is the broker at AMQP_URL healthy (not still starting, not under an alarm)?", crate::base::duration::human(*after))]
    StartTimeout {
        /// How long the runtime waited.
        after: std::time::Duration,
    },
    /// At start-up, the broker or the database stayed unreachable (connection
    /// refused, reset, no answer) for the whole
    /// [`startup_timeout`](crate::RuntimeBuilder::startup_timeout). Without one the
    /// runtime waits for ever and this error never happens.
    #[error(
        "cannot connect to {dependency} at {url}: still unreachable after {} (the startup timeout); \
         the last attempt said: {}. Fix: make {dependency} reachable from here, or let the runtime wait \
         longer (`startup_timeout`, `--startup-timeout`, IDEMQ_STARTUP_TIMEOUT; unset, it waits for ever)",
        crate::base::duration::human(*waited),
        redact(last_error)
    )]
    StartupTimeout {
        /// What was unreachable.
        dependency: Dependency,
        /// Its URL (or list of URLs), passwords redacted.
        url: String,
        /// How long the runtime waited.
        waited: std::time::Duration,
        /// The last attempt's error, in the driver's words (shown redacted).
        last_error: String,
    },
    /// A TLS connection to RabbitMQ (`amqps://`) or PostgreSQL (`sslmode`) was
    /// refused: the server's certificate did not verify (unknown authority, expired,
    /// another host name), or the server refused this client's certificate or its
    /// absence. No retry changes that: start-up fails at once. Nothing was sent in
    /// the clear, the login included.
    #[error("cannot connect to {dependency} at {url} over TLS: {reason}. Fix: {fix}")]
    Tls {
        /// RabbitMQ or PostgreSQL.
        dependency: Dependency,
        /// The URL, passwords redacted.
        url: String,
        /// The host name the certificate was checked against.
        host: String,
        /// What failed, in plain words.
        reason: String,
        /// What to change.
        fix: String,
    },
    /// The embedded migrations failed.
    #[error("running idemq's migrations failed: could not {action}")]
    Migration {
        /// What [`migrate`](crate::migrate) was doing: "take the migration lock",
        /// "apply the pending migrations", "check the schema"…
        action: String,
        /// The driver's or the migration harness's error (a server's answer on the
        /// connection made, never its URL).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The builder was given an unusable setting. The message names it and says
    /// what to write instead.
    #[error("invalid idemq configuration: {0}")]
    Config(String),
    /// At start-up, the database's durability could lose COMMITs it acknowledged
    /// (asynchronous standbys, `synchronous_commit = off`), and the runtime was told
    /// to refuse that ([`ReplicationCheck::Refuse`](crate::ReplicationCheck)).
    #[error(
        "the database could lose COMMITs it acknowledged, and with them messages idemq acked: {}. \
         Fix the server's settings, or start anyway with `replication_check = \"warn\"` \
         (`--replication-check`, IDEMQ_REPLICATION_CHECK)",
        concerns.join("; ")
    )]
    Replication {
        /// What the check found, each with its fix.
        concerns: Vec<String>,
    },
    /// The AMQP parser this program was built with (lapin's `amq-protocol-types`) is
    /// not idemq's patched one: upstream fails a whole frame on a short string that is
    /// not UTF-8 (a `message_id` a pika publisher sent as bytes), which closes the
    /// connection on every delivery of that message, for ever. An application's own
    /// workspace builds the upstream crate unless its `Cargo.toml` patches it (cargo
    /// does not apply idemq's `[patch]`): `fix` holds the two lines to add. Refused by
    /// [`RuntimeBuilder::build`](crate::RuntimeBuilder::build) unless
    /// [`allow_unpatched_amqp_parser`](crate::RuntimeBuilder::allow_unpatched_amqp_parser)
    /// or `IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER=1` accepts the risk.
    #[error(
        "the AMQP parser this program was built with (amq-protocol-types, as lapin uses it) {found}. \
         Fix: {fix}or start anyway, accepting that risk, with {}",
        UNPATCHED_PARSER_OPT_OUT
    )]
    UnpatchedAmqpParser {
        /// What the parser does with a `message_id` that is not UTF-8, and what follows.
        found: String,
        /// What to do, with the two lines of `Cargo.toml` (`[patch.crates-io]` and
        /// `amq-protocol-types = { path = ... }`), each on its own line.
        fix: String,
    },
    /// A setting could not be used because an I/O operation on it failed: a file it
    /// names cannot be read (`AMQP_URL_FILE`, `DATABASE_URL_FILE`, their CLI flags and
    /// config-file keys, the CLI's `--config` file), or the metrics address cannot
    /// be listened on (`http_addr`).
    #[error("invalid idemq configuration: {message}")]
    ConfigIo {
        /// What could not be done, naming the setting and the file or address.
        message: String,
        /// Why: not found, permission denied, not UTF-8, address in use… An I/O
        /// error never quotes what a file holds.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// This error and its causes (its [`source`](std::error::Error::source)s),
    /// `": "`-joined, each once, passwords redacted: what to print or log. `Display`
    /// shows this error's own message only (see [`Error`]: a cause is shown once).
    ///
    /// ```
    /// let cause = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
    /// let err = idemq::Error::ConfigIo {
    ///     message: "AMQP_URL_FILE: cannot read the file /run/secrets/amqp_url".into(),
    ///     source: cause,
    /// };
    /// assert_eq!(
    ///     err.report(),
    ///     "invalid idemq configuration: AMQP_URL_FILE: cannot read the file /run/secrets/amqp_url: \
    ///      No such file or directory"
    /// );
    /// ```
    #[must_use = "the report is the text to print or log"]
    pub fn report(&self) -> String {
        report(self)
    }
}

/// `err` and its causes, `": "`-joined, each once (a cause whose words the text
/// already holds is skipped: some errors quote their cause), passwords redacted
/// ([`redact`](crate::connect::redact)): how idemq prints any error, its own
/// ([`Error::report`]) or an application's that wraps a driver's.
pub fn report(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    redact(&text)
}

/// A service the runtime needs, named in start-up waits
/// ([`ConnectionEvent::Unreachable`](crate::observe::ConnectionEvent::Unreachable)) and
/// errors ([`Error::StartupTimeout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dependency {
    /// RabbitMQ (`AMQP_URL`).
    Broker,
    /// PostgreSQL (`DATABASE_URL`).
    Database,
}

impl fmt::Display for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Broker => "RabbitMQ",
            Self::Database => "PostgreSQL",
        })
    }
}

/// The one redaction rule (see [`crate::base::redact`]), under the name the runtime uses.
pub(crate) use crate::base::redact::redact;

/// Like the derived `Debug`, with driver errors redacted: a lapin error may quote the
/// whole URL, password included ("Invalid URL: '…'"), and `main() -> Result<(), Error>`
/// prints this.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AmqpConnect { url, cause } => {
                f.debug_struct("AmqpConnect").field("url", url).field("cause", &Redacted(cause)).finish()
            }
            Self::Amqp { action, source } => {
                f.debug_struct("Amqp").field("action", action).field("source", &Redacted(source)).finish()
            }
            Self::QueueMismatch { queue, detail, declared } => f
                .debug_struct("QueueMismatch")
                .field("queue", queue)
                .field("detail", detail)
                .field("declared", declared)
                .finish(),
            Self::QueueUnavailable { queue, detail } => {
                f.debug_struct("QueueUnavailable").field("queue", queue).field("detail", detail).finish()
            }
            Self::ExchangeMismatch { exchange, detail } => f
                .debug_struct("ExchangeMismatch")
                .field("exchange", exchange)
                .field("detail", detail)
                .finish(),
            Self::DatabaseConnect { url, message, cause } => f
                .debug_struct("DatabaseConnect")
                .field("url", url)
                .field("message", &Redacted(message))
                .field("cause", &Redacted(cause))
                .finish(),
            Self::Schema { problem, fix } => {
                f.debug_struct("Schema").field("problem", problem).field("fix", fix).finish()
            }
            Self::StartTimeout { after } => f.debug_struct("StartTimeout").field("after", after).finish(),
            Self::StartupTimeout { dependency, url, waited, last_error } => f
                .debug_struct("StartupTimeout")
                .field("dependency", dependency)
                .field("url", url)
                .field("waited", waited)
                .field("last_error", &Redacted(last_error))
                .finish(),
            Self::Tls { dependency, url, host, reason, fix } => f
                .debug_struct("Tls")
                .field("dependency", dependency)
                .field("url", url)
                .field("host", host)
                .field("reason", reason)
                .field("fix", fix)
                .finish(),
            Self::Migration { action, source } => f
                .debug_struct("Migration")
                .field("action", action)
                .field("source", &Redacted(source))
                .finish(),
            Self::Config(message) => f.debug_tuple("Config").field(message).finish(),
            Self::Replication { concerns } => {
                f.debug_struct("Replication").field("concerns", concerns).finish()
            }
            Self::UnpatchedAmqpParser { found, fix } => {
                f.debug_struct("UnpatchedAmqpParser").field("found", found).field("fix", fix).finish()
            }
            Self::ConfigIo { message, source } => {
                f.debug_struct("ConfigIo").field("message", message).field("source", source).finish()
            }
        }
    }
}

/// `Debug` of the inner value, redacted.
struct Redacted<'a, T: fmt::Debug>(&'a T);

impl<T: fmt::Debug> fmt::Debug for Redacted<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&format!("{:?}", self.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn a_driver_error_quoting_the_url_is_redacted_in_display_and_debug() {
        let said = "invalid URL 'postgres://u:s3cr@t@h/db'";
        let err = Error::DatabaseConnect {
            url: super::redact("postgres://u:s3cr@t@h/db"),
            message: said.into(),
            cause: Some(said.into()),
        };
        for shown in [err.to_string(), format!("{err:?}"), format!("{err:#?}")] {
            assert!(!shown.contains("s3cr") && !shown.contains("t@h"), "{shown}");
            assert!(shown.contains("postgres://u:***@h/db"), "{shown}");
        }
        assert!(std::error::Error::source(&err).is_none(), "the cause is printed once, redacted");
    }

    #[tokio::test]
    async fn a_broker_connect_error_shows_no_password_anywhere_in_its_chain() {
        let url = "amqp:guest:hunter2@127.0.0.1:1/%2f"; // no `//`: lapin quotes it back
        let cause = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .expect_err("an invalid URL");
        assert!(cause.to_string().contains("hunter2"), "lapin quotes the URL: {cause}");
        let err = Error::AmqpConnect { url: super::redact(url), cause };
        let mut shown = vec![err.to_string(), format!("{err:?}")];
        let mut source = std::error::Error::source(&err);
        while let Some(cause) = source {
            shown.push(cause.to_string());
            source = cause.source();
        }
        for shown in shown {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }

    #[test]
    fn migration_errors_are_redacted() {
        let err = Error::Migration {
            action: "apply the pending migrations".into(),
            source: "could not connect with password=hunter2".into(),
        };
        for shown in [err.to_string(), format!("{err:?}"), err.report()] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        assert!(err.report().contains("could not connect with password="), "{}", err.report());
    }

    #[test]
    fn a_cause_is_the_source_and_printed_once() {
        let cause = lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "basic.qos",
        ));
        let said = cause.to_string();
        let err = Error::Amqp { action: "open a channel".into(), source: cause };
        assert_eq!(err.to_string(), "RabbitMQ refused or failed to open a channel");
        assert_eq!(std::error::Error::source(&err).map(ToString::to_string), Some(said.clone()));
        let report = err.report();
        assert_eq!(report.matches(&said).count(), 1, "{report}");
        assert!(report.starts_with("RabbitMQ refused or failed to open a channel: "), "{report}");

        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "Permission denied");
        let err = Error::ConfigIo { message: "AMQP_URL_FILE: cannot read the file /s".into(), source: io };
        assert!(!err.to_string().contains("Permission denied"), "{err}");
        assert_eq!(
            err.report(),
            "invalid idemq configuration: AMQP_URL_FILE: cannot read the file /s: Permission denied"
        );
    }

    #[test]
    fn a_report_skips_a_cause_the_message_already_quotes() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer: inner went wrong")]
        struct Quoting(#[source] std::io::Error);
        let err = Quoting(std::io::Error::other("inner went wrong"));
        assert_eq!(super::report(&err), "outer: inner went wrong");
    }
}
