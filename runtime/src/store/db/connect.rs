//! Every connection idemq makes: TLS as the URL says, and keepalives so that a
//! vanished host is noticed in about 30 s rather than 2 h.

use std::time::Duration;

use diesel_async::AsyncPgConnection;

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

/// Connects like `AsyncPgConnection::establish`, with TLS as the URL's libpq
/// parameters say (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`: see
/// [`crate::tls::postgres`]) and dead-peer detection on the socket. Every connection
/// idemq makes goes through here: the pools, the relay's `LISTEN`, migrations, the
/// CLI, the test kit.
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
pub(crate) async fn establish(url: &str) -> diesel::ConnectionResult<AsyncPgConnection> {
    connect(url).await.map_err(|err| match err {
        crate::error::Error::DatabaseConnect { message, .. } => {
            diesel::ConnectionError::BadConnection(message)
        }
        other => diesel::ConnectionError::BadConnection(other.to_string()),
    })
}

/// [`establish`] with a typed error: [`Error::Tls`](crate::Error::Tls) and
/// [`Error::Config`](crate::Error::Config) as they are, the driver's error as
/// [`Error::DatabaseConnect`](crate::Error::DatabaseConnect) (the server's message, or
/// the client's error).
pub(crate) async fn connect(url: &str) -> Result<AsyncPgConnection, crate::error::Error> {
    use crate::tls::postgres::ConnectFailure;
    let failed = |message: String| crate::error::Error::DatabaseConnect {
        url: crate::base::redact::redact(url),
        message,
    };
    let (client, connection) = crate::tls::postgres::connect(url, |config| {
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
    .map_err(|failure| match failure {
        ConnectFailure::Refused(err) => err,
        ConnectFailure::Driver(err) => {
            failed(err.as_db_error().map_or_else(|| err.to_string(), |db| db.message().to_owned()))
        }
    })?;
    AsyncPgConnection::try_from_client_and_connection(client, connection)
        .await
        .map_err(|err| failed(err.to_string()))
}
