//! Several broker addresses: `AMQP_URL` (or `.amqp_url(..)`) may be a comma-separated
//! list of `amqp://` URLs, each with its own credentials and vhost (a comma inside a
//! password is percent-encoded, `%2C`).
//!
//! Connecting tries the addresses **in order, starting after the one last lost**: at
//! start-up the first that answers is used; after a loss the next one is tried first
//! (a node that just went away is tried last, not first), each once per round, and
//! the runtime's backoff runs between rounds. Every message shows the list redacted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::error::{redact, Error};

/// How long one address may take to accept a connection before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The broker addresses, and where the next connection attempt starts.
#[derive(Debug)]
pub(crate) struct Brokers {
    urls: Vec<String>,
    next: AtomicUsize,
}

impl Brokers {
    /// Splits a comma-separated list (blank entries ignored).
    pub(crate) fn parse(list: &str) -> Result<Self, Error> {
        let urls: Vec<String> =
            list.split(',').map(str::trim).filter(|url| !url.is_empty()).map(str::to_owned).collect();
        if urls.is_empty() {
            return Err(Error::Config(
                "AMQP_URL is empty: give one amqp:// URL, or several separated by commas".into(),
            ));
        }
        Ok(Self { urls, next: AtomicUsize::new(0) })
    }

    /// Each address with `edit` applied (e.g. the heartbeat added).
    pub(crate) fn map(&self, edit: impl Fn(&str) -> String) -> Self {
        Self { urls: self.urls.iter().map(|url| edit(url)).collect(), next: AtomicUsize::new(0) }
    }

    /// Connects to the first address that answers, starting at the current one.
    /// Returns the connection and the address's index (to open more connections to
    /// the same node with [`Brokers::connect_to`]). `role` names the connection for
    /// the broker's operators: `idemq <role> (pid <pid>)` in `rabbitmqctl
    /// list_connections client_properties` and the management UI.
    ///
    /// # Errors
    /// [`Error::AmqpConnect`] with the last address's error when none answers.
    pub(crate) async fn connect(&self, role: &str) -> Result<(Connection, usize), Error> {
        let start = self.next.load(Ordering::Relaxed) % self.urls.len();
        let mut last = None;
        for offset in 0..self.urls.len() {
            let index = (start + offset) % self.urls.len();
            match self.connect_to(index, role).await {
                Ok(connection) => {
                    self.next.store(index, Ordering::Relaxed);
                    return Ok((connection, index));
                }
                Err(err) => {
                    if self.urls.len() > 1 {
                        tracing::debug!(error = %err, "broker address did not answer; trying the next");
                    }
                    last = Some(err);
                }
            }
        }
        Err(last.expect("at least one address"))
    }

    /// Connects to address `index`, naming the connection after `role`.
    ///
    /// # Errors
    /// [`Error::AmqpConnect`].
    pub(crate) async fn connect_to(&self, index: usize, role: &str) -> Result<Connection, Error> {
        let url = &self.urls[index % self.urls.len()];
        let name = format!("idemq {role} (pid {})", std::process::id());
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(url, properties)).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(cause)) => Err(Error::AmqpConnect { url: redact(url), cause }),
            Err(_) => Err(Error::AmqpConnect {
                url: redact(url),
                cause: lapin::Error::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {CONNECT_TIMEOUT:?}"),
                )),
            }),
        }
    }

    /// The connection to address `index` was lost: the next attempt starts after it.
    pub(crate) fn lost(&self, index: usize) {
        self.next.store((index + 1) % self.urls.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_split_on_commas_and_blank_entries_are_dropped() {
        let brokers = Brokers::parse("amqp://a:p%2Cw@h1/v, amqp://h2/v ,").unwrap();
        assert_eq!(brokers.urls, ["amqp://a:p%2Cw@h1/v", "amqp://h2/v"]);
        assert!(Brokers::parse(" , ").is_err());
    }

    #[test]
    fn after_a_loss_the_next_address_is_tried_first() {
        let brokers = Brokers::parse("amqp://h1,amqp://h2,amqp://h3").unwrap();
        brokers.lost(2);
        assert_eq!(brokers.next.load(Ordering::Relaxed), 0);
        brokers.lost(0);
        assert_eq!(brokers.next.load(Ordering::Relaxed), 1);
    }
}
