//! Several broker addresses: `AMQP_URL` (or `.amqp_url(..)`) may be a comma-separated
//! list of `amqp://` or `amqps://` URLs, each with its own credentials, vhost and TLS
//! settings (a comma inside a password is percent-encoded, `%2C`).
//!
//! Connecting tries the addresses **in order, starting after the one last lost**: at
//! start-up the first that answers is used; after a loss the next one is tried first
//! (a node that just went away is tried last, not first), each once per round, and
//! the runtime's backoff runs between rounds. Every message shows the list redacted.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use crate::error::{redact, Error};
use crate::tls::amqp::Target;

/// How long one address may take to accept a connection before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The broker addresses, and where the next connection attempt starts.
#[derive(Debug)]
pub(crate) struct Brokers {
    targets: Vec<Target>,
    next: AtomicUsize,
    /// Whether `verify_none` was warned about (once per list, at its first connection).
    warned: AtomicBool,
}

impl Brokers {
    /// Splits a comma-separated list (blank entries ignored) and reads each address,
    /// its TLS settings included (certificate files are read here, once).
    ///
    /// # Errors
    /// [`Error::Config`]: an empty list, a URL the client cannot read, TLS settings
    /// that cannot be used.
    pub(crate) fn parse(list: &str) -> Result<Self, Error> {
        let urls: Vec<&str> = list.split(',').map(str::trim).filter(|url| !url.is_empty()).collect();
        if urls.is_empty() {
            return Err(Error::Config(
                "AMQP_URL is empty: give one amqp:// URL, or several separated by commas".into(),
            ));
        }
        // A URL the client cannot read fails every attempt the same way (and lapin
        // reports it as an I/O error, like a refused connection): refuse it here, so
        // that start-up never waits on it.
        let targets = urls.into_iter().map(Target::parse).collect::<Result<_, _>>()?;
        Ok(Self { targets, next: AtomicUsize::new(0), warned: AtomicBool::new(false) })
    }

    /// Each address with `edit` applied to its URL (e.g. the heartbeat added).
    pub(crate) fn map(&self, edit: impl Fn(&str) -> String) -> Self {
        Self {
            targets: self.targets.iter().map(|target| target.with_url(edit(target.url()))).collect(),
            next: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Connects to the first address that answers, starting at the current one.
    /// Returns the connection and the address's index (to open more connections to
    /// the same node with [`Brokers::connect_to`]). `role` names the connection for
    /// the broker's operators: `idemq <role> (pid <pid>)` in `rabbitmqctl
    /// list_connections client_properties` and the management UI.
    ///
    /// A TLS refusal ([`Error::Tls`]: a certificate that does not verify) does not
    /// stop the round: the next address is tried (another node may be configured
    /// right), with a warning. When none connects, the refusal is what is returned,
    /// rather than another address's outage: it names the reason, and no wait mends it.
    ///
    /// # Errors
    /// [`Error::Tls`] when an address refused TLS and none connected;
    /// [`Error::AmqpConnect`] with the last address's error when none answers.
    pub(crate) async fn connect(&self, role: &str) -> Result<(Connection, usize), Error> {
        let start = self.next.load(Ordering::Relaxed) % self.targets.len();
        let mut last = None;
        let mut refusal = None;
        for offset in 0..self.targets.len() {
            let index = (start + offset) % self.targets.len();
            match self.connect_to(index, role).await {
                Ok(connection) => {
                    self.next.store(index, Ordering::Relaxed);
                    return Ok((connection, index));
                }
                Err(err @ Error::Tls { .. }) => {
                    if self.targets.len() > 1 {
                        crate::base::log::warn!(error = %err.report(), "broker address refused over TLS; trying the next");
                    }
                    refusal.get_or_insert(err);
                }
                Err(err) => {
                    if self.targets.len() > 1 {
                        crate::base::log::debug!(error = %err.report(), "broker address did not answer; trying the next");
                    }
                    last = Some(err);
                }
            }
        }
        Err(refusal.or(last).expect("at least one address"))
    }

    /// Connects to address `index`, naming the connection after `role`.
    ///
    /// # Errors
    /// [`Error::AmqpConnect`], [`Error::Tls`].
    pub(crate) async fn connect_to(&self, index: usize, role: &str) -> Result<Connection, Error> {
        let target = &self.targets[index % self.targets.len()];
        let name = format!("idemq {role} (pid {})", std::process::id());
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        let url = redact(target.url());
        match tokio::time::timeout(CONNECT_TIMEOUT, target.connect(properties)).await {
            Ok(Ok(connection)) => {
                if target.verify_none() && !self.warned.swap(true, Ordering::Relaxed) {
                    crate::base::log::warn!(
                        %url,
                        "TLS without verifying the broker (verify=verify_none): the connection is encrypted, \
                         but anyone on the network path can pose as the broker and read the login; give the \
                         broker's CA with cacertfile= and drop verify=verify_none"
                    );
                }
                Ok(connection)
            }
            Ok(Err(err)) => Err(err),
            Err(_) => Err(Error::AmqpConnect {
                url,
                cause: lapin::Error::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {}", crate::base::duration::human(CONNECT_TIMEOUT)),
                )),
            }),
        }
    }

    /// The connection to address `index` was lost: the next attempt starts after it.
    pub(crate) fn lost(&self, index: usize) {
        self.next.store((index + 1) % self.targets.len(), Ordering::Relaxed);
    }
}

/// Whether `err`, met connecting to the broker or declaring the topology, is the
/// broker being out of reach for now — refused, reset, silent, a name that does not
/// resolve yet, a broker stopping or restarting, a queue whose node is down — which
/// waiting mends. The rest is a refusal no retry changes (login refused, vhost
/// missing, a queue that is missing or declared otherwise, permissions): start-up
/// fails at once with it.
pub(crate) fn unreachable(err: &Error) -> bool {
    match err {
        Error::AmqpConnect { cause, .. } => out_of_reach(cause),
        Error::Amqp { source, .. } => out_of_reach(source),
        Error::StartTimeout { .. } | Error::QueueUnavailable { .. } => true,
        _ => false,
    }
}

fn out_of_reach(err: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError};
    use lapin::ErrorKind;
    match err.kind() {
        // Refused, reset, aborted, timed out, no such host (yet: DNS in an
        // orchestrator comes up with the service), a connection or channel that died
        // under us. (An unreadable URL is an I/O error too: `parse` refuses those.)
        ErrorKind::IOError(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::InvalidChannel(_) => true,
        // 320 as a node stops or restarts, 506/541 for a shortage or fault inside it.
        // ACCESS_REFUSED (login), NOT_ALLOWED (vhost), NOT_FOUND, PRECONDITION_FAILED
        // and the rest are answers, not outages.
        ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            AMQPErrorKind::Hard(
                AMQPHardError::CONNECTIONFORCED | AMQPHardError::RESOURCEERROR | AMQPHardError::INTERNALERROR
            )
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_split_on_commas_and_blank_entries_are_dropped() {
        let brokers = Brokers::parse("amqp://a:p%2Cw@h1/v, amqp://h2/v ,").unwrap();
        let urls: Vec<&str> = brokers.targets.iter().map(Target::url).collect();
        assert_eq!(urls, ["amqp://a:p%2Cw@h1/v", "amqp://h2/v"]);
        assert!(Brokers::parse(" , ").is_err());
    }

    #[test]
    fn a_url_the_client_cannot_read_is_refused_redacted() {
        for list in
            ["amqp:guest:s3cret@127.0.0.1:5672", "http://guest:s3cret@h/v", "amqp://h/v,amqp://u:s3cret@:x"]
        {
            let err = Brokers::parse(list).expect_err(list).to_string();
            assert!(err.contains("not a broker URL") && !err.contains("s3cret"), "{err}");
        }
    }

    #[tokio::test]
    async fn refused_and_silent_are_out_of_reach_but_a_refused_login_is_not() {
        let refused =
            lapin::Connection::connect("amqp://127.0.0.1:1/%2f", lapin::ConnectionProperties::default())
                .await
                .expect_err("nothing listens on port 1");
        let connect = |cause| Error::AmqpConnect { url: "amqp://h".into(), cause };
        assert!(unreachable(&connect(refused)));
        let timed_out = lapin::Error::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(unreachable(&connect(timed_out)));
        assert!(unreachable(&Error::StartTimeout { after: Duration::from_secs(1) }));
        let answer = |kind| {
            lapin::Error::from(lapin::ErrorKind::ProtocolError(lapin::protocol::AMQPError::new(
                kind,
                "no".into(),
            )))
        };
        use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
        assert!(!unreachable(&connect(answer(AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)))));
        assert!(!unreachable(&connect(answer(AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)))));
        assert!(unreachable(&connect(answer(AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED)))));
        assert!(!unreachable(&Error::Config("x".into())));
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
