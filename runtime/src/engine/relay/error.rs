//! What goes wrong in a relay, typed: the faults it waits out ([`RelayError`]) and
//! why a row was not published ([`Refusal`], kept in the row's `last_error`).
//!
//! Neither reaches a user as a value: the relay logs them and retries. They are
//! printed through [`RelayError::report`], which walks the causes once and redacts the
//! whole text — a driver's message may quote a URL with its password.

use std::fmt;
use std::time::Duration;

use crate::store::db;

/// A fault of the broker link or the database that the relay waits out.
///
/// `Display` says what the relay was doing; the driver's error is the `source`, not
/// repeated in the message. Print it with [`RelayError::report`].
#[derive(thiserror::Error)]
pub(crate) enum RelayError {
    /// A broker operation failed: the channel or the connection went.
    #[error("could not {action}")]
    Broker {
        /// What the relay was doing ("publish", "open a channel").
        action: &'static str,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// The broker did not confirm a publish in time.
    #[error("no confirm within {}", crate::base::duration::human(*.0))]
    ConfirmTimeout(Duration),
    /// Connecting to the broker failed (every address tried).
    #[error(transparent)]
    Connect(crate::error::Error),
    /// Connecting to the broker and opening the channel took too long.
    #[error("connecting took over {}", crate::base::duration::human(*.0))]
    ConnectTimeout(Duration),
    /// The relay is stopping and had no time left to connect.
    #[error("stopping")]
    Stopping,
    /// No database connection from the relay's pool.
    #[error("could not take a database connection from the pool")]
    Pool(#[source] db::PoolError),
    /// A dedicated database connection (the `LISTEN` one) could not be made.
    #[error(transparent)]
    DatabaseConnect(crate::error::Error),
    /// A statement failed.
    #[error("could not {action}")]
    Database {
        /// What the relay was doing.
        action: &'static str,
        /// The driver's error.
        #[source]
        source: diesel::result::Error,
    },
    /// The server ended the `LISTEN` connection's notification stream.
    #[error("the notification stream ended")]
    NotificationsEnded,
}

impl RelayError {
    /// A broker operation's failure.
    pub(crate) fn broker(action: &'static str) -> impl FnOnce(lapin::Error) -> Self {
        move |source| Self::Broker { action, source }
    }

    /// A statement's failure.
    pub(crate) fn database(action: &'static str) -> impl FnOnce(diesel::result::Error) -> Self {
        move |source| Self::Database { action, source }
    }

    /// The error and its causes, `: `-joined, each once (a cause whose text the
    /// message already holds is skipped), redacted: what log lines and stored errors
    /// show.
    pub(crate) fn report(&self) -> String {
        crate::error::report(self)
    }
}

/// The report, never a driver's own `Debug` (which may quote a URL unredacted).
impl fmt::Debug for RelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RelayError").field(&self.report()).finish()
    }
}

/// Why one row was not published. Its `Display` is stored as the row's `last_error`
/// (and tests read it: keep "unroutable" and "does not exist").
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    /// Its exchange does not exist: never published (it would close the channel).
    #[error("exchange '{exchange}' does not exist; declare it (the message stays in the outbox)")]
    NoExchange {
        /// The exchange named by the row.
        exchange: String,
    },
    /// Returned by the broker: no queue is bound for it (published `mandatory`).
    #[error(
        "unroutable: no queue is bound to exchange '{exchange}' with routing key '{routing_key}' (returned, mandatory)"
    )]
    Unroutable {
        /// The row's exchange.
        exchange: String,
        /// The row's routing key.
        routing_key: String,
    },
    /// A reply to a direct reply-to address whose requester is gone (its channel
    /// closed): never published (the broker would confirm and drop it), kept until it
    /// expires, like a reply returned unroutable.
    #[error("the requester is gone: no one consumes its direct reply-to address '{reply_to}' (kept until the reply expires)")]
    RequesterGone {
        /// The row's routing key: the requester's direct reply-to address.
        reply_to: String,
    },
    /// The broker refused it.
    #[error("the broker refused it (nack)")]
    Nacked,
    /// The channel or connection failed while it was out; it may be why.
    #[error("the channel failed while it was being published: {reason}")]
    ChannelFailed {
        /// The fault, as [`RelayError::report`] shows it.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::RelayError;

    #[tokio::test]
    async fn a_report_names_each_cause_once_and_no_password() {
        let url = "amqp:guest:hunter2@127.0.0.1:1/%2f"; // no `//`: lapin quotes it back
        let cause = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .expect_err("an invalid URL");
        let said = cause.to_string();
        assert!(said.contains("hunter2"), "lapin quotes the URL: {said}");
        let err = RelayError::broker("open a channel")(cause);
        let report = err.report();
        assert!(report.starts_with("could not open a channel: "), "{report}");
        assert!(!report.contains("hunter2") && !format!("{err:?}").contains("hunter2"), "{report}");
        let stopping = RelayError::ConnectTimeout(std::time::Duration::from_secs(30));
        assert_eq!(stopping.report(), "connecting took over 30s");
    }
}
