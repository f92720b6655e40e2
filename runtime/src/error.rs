//! The runtime's errors: start-up, connection and configuration failures.
//!
//! Per-message failures are not errors of the runtime: they end in a retry or a
//! dead letter (see [`FailureKind`](crate::FailureKind)) and never stop it.
//!
//! Every URL and every driver message shown by these errors goes through
//! [`redact`](crate::redact): a driver may quote the URL it was given.

use std::fmt;

/// What stopped the runtime or kept it from starting.
///
/// `Display` and `Debug` show every URL and driver message with its passwords
/// redacted ([`redact`](crate::redact)).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Could not connect to RabbitMQ.
    #[error("cannot connect to RabbitMQ at {url}: {}; is the broker running, and are AMQP_URL's credentials and vhost right?", redact(&.cause.to_string()))]
    AmqpConnect {
        /// The URL, password redacted.
        url: String,
        /// The client's error. It may quote the URL: show it through
        /// [`redact`](crate::redact) (this error's `Display` does). Deliberately not
        /// the error's `source()`: a reporter walking the chain would print it
        /// unredacted (and twice, since the message already holds it).
        cause: lapin::Error,
    },
    /// A RabbitMQ operation failed.
    #[error("RabbitMQ refused or failed to {action}: {source}")]
    Amqp {
        /// What the runtime was doing.
        action: String,
        /// The client's error.
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
        /// [`redact`](crate::redact). Deliberately not the error's `source()`, as
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
    /// log and in [`ConnectionEvent`](crate::ConnectionEvent)s) rather than what
    /// `run` returns; at start-up it counts as the broker being unreachable
    /// ([`Error::StartupTimeout`] once the startup timeout is spent).
    #[error("connecting to RabbitMQ and declaring the topology took longer than {after:?}; is the broker at AMQP_URL healthy (not still starting, not under an alarm)?")]
    StartTimeout {
        /// How long the runtime waited.
        after: std::time::Duration,
    },
    /// At start-up, the broker or the database stayed unreachable (connection
    /// refused, reset, no answer) for the whole
    /// [`startup_timeout`](crate::RuntimeBuilder::startup_timeout). Without one the
    /// runtime waits for ever and this error never happens.
    #[error(
        "cannot connect to {dependency} at {url}: still unreachable after {waited:?} (the startup timeout); \
         the last attempt said: {}. Fix: make {dependency} reachable from here, or let the runtime wait \
         longer (`startup_timeout`, `--startup-timeout`, IDEMQ_STARTUP_TIMEOUT; unset, it waits for ever)",
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
    #[error("running idemq's migrations failed: {}", redact(.0))]
    Migration(String),
    /// The builder was given an unusable setting.
    #[error("invalid idemq configuration: {0}")]
    Config(String),
}

/// A service the runtime needs, named in start-up waits
/// ([`ConnectionEvent::Unreachable`](crate::ConnectionEvent::Unreachable)) and
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
            Self::Migration(message) => f.debug_tuple("Migration").field(&Redacted(message)).finish(),
            Self::Config(message) => f.debug_tuple("Config").field(message).finish(),
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
        let err = Error::Migration("could not connect with password=hunter2".into());
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
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
        let err = Error::Migration("could not connect with password=hunter2".into());
        for shown in [err.to_string(), format!("{err:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }
}
