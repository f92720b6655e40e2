//! Every connection idemq makes: TLS as the URL says, keepalives so that a vanished
//! host is noticed in about 30 s rather than 2 h, the SQLSTATEs its server sends
//! recorded ([`Conn`]), and the task that drives it.

use std::time::Duration;

use diesel_async::AsyncPgConnection;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::conn::Conn;
use crate::error::{redact, Error};
use crate::tls::postgres::{ConnectFailure, Connected, Connection};

/// How long a connection may hear nothing from PostgreSQL's host before its first
/// keepalive probe; then one every [`KEEPALIVE_INTERVAL`].
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// The interval between keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection is given up (where `TCP_USER_TIMEOUT`
/// does not decide it first).
const KEEPALIVE_RETRIES: u32 = 4;
/// How long sent data (a request, a probe) may stay unacknowledged before the
/// connection is given up (`TCP_USER_TIMEOUT`, Linux).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects to `url` with TLS as the URL's libpq parameters say (`sslmode`,
/// `sslrootcert`, `sslcert`, `sslkey`: see [`crate::tls::postgres`]), dead-peer
/// detection on the socket, and the server's SQLSTATEs recorded (see [`Conn`]).
/// Every connection idemq makes goes through here: the pools, the relay's `LISTEN`,
/// migrations, the CLI, the test kit, [`crate::connect::database`].
///
/// A PostgreSQL host that vanishes without a word (a partition, a lost machine, a
/// NAT or firewall that forgot the flow: no FIN, no RST) leaves the socket half-open,
/// and a connection waiting on it — for a COMMIT's answer, for the BEGIN of a
/// pooled connection — waits until TCP notices. Once the request was acknowledged
/// nothing is retransmitted, so only a keepalive can notice, and tokio-postgres's
/// first goes out after 2 h of silence (libpq's default too): the delivery and its
/// slot would be held far past `handler_timeout`, `database_retry_limit` (the
/// statements never fail, so the retry loop never gets control back) and the
/// broker's `consumer_timeout`. With these settings the kernel gives such a
/// connection up about 30 s after the host last answered; the statement waiting on
/// it fails as a lost connection, which the delivery state machine already handles
/// (a fresh connection, the dedup row decides a COMMIT's fate). `keepalives`,
/// `keepalives_idle`, `keepalives_interval`, `keepalives_retries` or
/// `tcp_user_timeout` given in the URL win.
///
/// It does not help when the socket's peer stays up and what is behind it goes
/// silent (a pooler such as PgBouncer, a proxy, a hung server): that peer's kernel
/// answers the probes (`tests/tests/network_faults.rs` stages this with a proxy).
///
/// # Errors
/// [`Error::Tls`] and [`Error::Config`] as they are; the driver's error as
/// [`Error::DatabaseConnect`] (the server's message, or the client's error, with the
/// error itself as its `cause`).
pub(crate) async fn open(url: &str) -> Result<Conn, Error> {
    let Connected { client, connection, wire, canceller } = raw(url).await?;
    let stop = CancellationToken::new();
    tokio::spawn(drive(connection, stop.clone(), None));
    let pg = AsyncPgConnection::try_from(client).await.map_err(|err| Error::DatabaseConnect {
        url: redact(url),
        message: err.to_string(),
        cause: Some(Box::new(err)),
    })?;
    Ok(Conn::new(pg, wire, canceller, stop.drop_guard()))
}

/// [`open`], as a plain connection: it lives as long as its client (the driver ends
/// once the connection is dropped and its last answer read).
///
/// # Errors
/// As [`open`].
pub(crate) async fn connect(url: &str) -> Result<AsyncPgConnection, Error> {
    Ok(open(url).await?.into_inner())
}

/// The connection of [`open`] before diesel sees it: tokio-postgres's client and the
/// connection to drive.
///
/// # Errors
/// As [`open`].
async fn raw(url: &str) -> Result<Connected, Error> {
    crate::tls::postgres::connect(url, |config| {
        // tokio-postgres's defaults, which the URL did not change.
        if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            config.keepalives_idle(KEEPALIVE_IDLE);
        }
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(KEEPALIVE_INTERVAL);
        }
        if config.get_keepalives_retries().is_none() {
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(TCP_USER_TIMEOUT);
        }
    })
    .await
    .map_err(|failure| {
        let failed = |message: String, cause: Box<dyn std::error::Error + Send + Sync>| {
            Error::DatabaseConnect { url: redact(url), message, cause: Some(cause) }
        };
        match failure {
            ConnectFailure::Refused(err) => err,
            ConnectFailure::Driver(err) => failed(
                err.as_db_error().map_or_else(|| err.to_string(), |db| db.message().to_owned()),
                Box::new(err),
            ),
            ConnectFailure::Network(err) => {
                failed(format!("error connecting to server: {err}"), Box::new(err))
            }
        }
    })
}

/// A connection that `LISTEN`s: the notifications its server sends, as they come.
pub(crate) struct Listener {
    /// Held: the connection lives as long as its client.
    _client: tokio_postgres::Client,
    notifications: mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    _driver: tokio_util::sync::DropGuard,
}

impl Listener {
    /// Connects to `url` (as [`open`] does) and listens on `channel`.
    ///
    /// # Errors
    /// As [`open`]; a refused `LISTEN` as [`Error::DatabaseConnect`].
    pub(crate) async fn start(url: &str, channel: &str) -> Result<Self, Error> {
        let Connected { client, connection, .. } = raw(url).await?;
        let (sender, notifications) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        tokio::spawn(drive(connection, stop.clone(), Some(sender)));
        client.batch_execute(&format!("LISTEN {channel}")).await.map_err(|err| Error::DatabaseConnect {
            url: redact(url),
            message: format!("LISTEN {channel} failed: {err}"),
            cause: Some(Box::new(err)),
        })?;
        Ok(Self { _client: client, notifications, _driver: stop.drop_guard() })
    }

    /// The next notification; `None` once the connection ended.
    ///
    /// # Cancel safety
    /// Cancel safe: a notification not yet returned stays queued.
    pub(crate) async fn next(&mut self) -> Option<tokio_postgres::Notification> {
        self.notifications.recv().await
    }
}

/// Drives a connection until it ends or `stop` is cancelled (its [`Conn`] or
/// [`Listener`] dropped: the socket closes at once, ending a transaction left open
/// on the server, as diesel-async's own driver does), passing its notifications to
/// `notifications` when given. Notices are dropped, as diesel-async drops them.
async fn drive(
    mut connection: Connection,
    stop: CancellationToken,
    notifications: Option<mpsc::UnboundedSender<tokio_postgres::Notification>>,
) {
    let mut messages = std::pin::pin!(futures_util::stream::poll_fn(|cx| connection.poll_message(cx)));
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            message = messages.next() => message,
        };
        match message {
            None => return,
            Some(Ok(tokio_postgres::AsyncMessage::Notification(notification))) => {
                if let Some(notifications) = &notifications {
                    let _ = notifications.send(notification);
                }
            }
            Some(Ok(_)) => {}
            Some(Err(error)) => {
                crate::base::log::debug!(error = %redact(&error.to_string()), "a PostgreSQL connection ended");
                return;
            }
        }
    }
}
