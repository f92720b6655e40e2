//! Connecting to PostgreSQL the way tokio-postgres's `Config::connect` does — the
//! URL's hosts in turn, each address of a name in turn, `hostaddr`, `port`,
//! `load_balance_hosts`, `connect_timeout`, the keepalive settings and
//! `tcp_user_timeout`, `target_session_attrs` — with the stream in idemq's hands, so
//! that its plaintext goes through a [`Wire`] that reads the SQLSTATE of every error.
//!
//! Per address: the socket ([`open`]); the SSLRequest and the rustls handshake as the
//! URL's `sslmode` says ([`negotiate`]: `prefer` falls back to plaintext when the
//! server declines, `require` and `verify-*` refuse); then the startup and the login
//! by tokio-postgres (`Config::connect_raw`) over the [`Wire`]. tokio-postgres is told
//! the stream is already TLS (`sslnegotiation=direct` with `sslmode=require`, and a
//! connector that hands the stream back as it is: [`Handover`]), which keeps SCRAM's
//! channel binding working over idemq's TLS (the stream reports the server
//! certificate's `tls-server-end-point`).
//!
//! `Config::connect` (tokio-postgres 0.7.18, `connect.rs` and `connect_socket.rs`) is
//! the reference this follows step by step. Where it differs: an address that
//! cannot be reached is an `io::Error` ([`ConnectFailure::Network`]) rather than
//! tokio-postgres's own error around it, and a server that declines TLS under
//! `require` is [`Error::Tls`]. The client of `connect_raw` knows nothing of the
//! socket, so a cancel request goes through [`Canceller`], which opens one to the
//! same address the same way.

use std::io;
use std::net::IpAddr;
#[cfg(unix)]
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
#[cfg(unix)]
use tokio::net::UnixStream;
use tokio_postgres::config::{
    Host, LoadBalanceHosts, SslMode as DriverSslMode, SslNegotiation, TargetSessionAttrs,
};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::wire::{Wire, WireLog};
use super::{SslMode, Target};
use crate::error::{redact, Dependency, Error};
use crate::tls::Dialect;

/// A connection made by [`connect`]: tokio-postgres's client and connection (to be
/// driven), the log its [`Wire`] writes, and how to cancel its statements.
pub(crate) struct Connected {
    pub(crate) client: tokio_postgres::Client,
    pub(crate) connection: Connection,
    /// The SQLSTATEs the server sent on it.
    pub(crate) wire: Arc<WireLog>,
    pub(crate) canceller: Canceller,
}

/// A connection to drive: tokio-postgres's, over idemq's stream.
pub(crate) type Connection = tokio_postgres::Connection<Wire<Transport>, Wire<Transport>>;

/// Why [`connect`] failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// A configuration or TLS refusal: no retry changes it.
    Refused(Error),
    /// The driver's error: the server's answer (with its SQLSTATE), or the client's.
    Driver(tokio_postgres::Error),
    /// No connection: refused, reset, timed out, a name that does not resolve, a
    /// server that closed it, a read-only server where writes are wanted.
    Network(io::Error),
}

impl std::fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(err) => err.fmt(f),
            Self::Driver(err) => err.fmt(f),
            Self::Network(err) => write!(f, "error connecting to server: {err}"),
        }
    }
}

/// Connects to `url` (TLS as its libpq parameters say; `edit` may change the driver's
/// configuration first): the first of its hosts that answers, as tokio-postgres's
/// `Config::connect` tries them (see the module docs).
///
/// # Errors
/// [`ConnectFailure::Refused`] for a URL that cannot be used or a TLS refusal, else
/// the last host's failure.
pub(crate) async fn connect(
    url: &str,
    edit: impl FnOnce(&mut tokio_postgres::Config),
) -> Result<Connected, ConnectFailure> {
    let mut target = Target::parse(url).map_err(ConnectFailure::Refused)?;
    edit(&mut target.config);
    let config = &target.config;
    let refuse = |why: String| ConnectFailure::Refused(Error::Config(format!("DATABASE_URL: {why}")));
    let (hosts, hostaddrs, ports) = (config.get_hosts(), config.get_hostaddrs(), config.get_ports());
    if hosts.is_empty() && hostaddrs.is_empty() {
        return Err(refuse("both host and hostaddr are missing".into()));
    }
    if !hosts.is_empty() && !hostaddrs.is_empty() && hosts.len() != hostaddrs.len() {
        return Err(refuse(format!(
            "the number of hosts ({}) is different from the number of hostaddrs ({})",
            hosts.len(),
            hostaddrs.len()
        )));
    }
    let count = hosts.len().max(hostaddrs.len());
    if ports.len() > 1 && ports.len() != count {
        return Err(refuse("the number of ports is neither 1 nor the number of hosts".into()));
    }
    let random = config.get_load_balance_hosts() == LoadBalanceHosts::Random;
    let mut order: Vec<usize> = (0..count).collect();
    if random {
        fastrand::shuffle(&mut order);
    }
    let settings = Arc::new(Settings::of(url, &target));
    // The startup and login over idemq's stream: tokio-postgres is told it is TLS
    // already (see `Handover`); `settings.negotiation` keeps what the URL asked for.
    let mut raw = target.config.clone();
    raw.ssl_mode(DriverSslMode::Require).ssl_negotiation(SslNegotiation::Direct);
    let mut last = None;
    for i in order {
        let port = ports.get(i).or_else(|| ports.first()).copied().unwrap_or(5432);
        // The host name is what TLS verifies, whatever address is dialled.
        let hostname = match hosts.get(i) {
            Some(Host::Tcp(name)) => Some(name.clone()),
            _ => None,
        };
        let addresses = match (hostaddrs.get(i), hosts.get(i)) {
            (Some(ip), _) => Ok(vec![Address::Tcp(*ip)]),
            (None, Some(Host::Tcp(name))) => resolve(name, port, random).await,
            #[cfg(unix)]
            (None, Some(Host::Unix(dir))) => Ok(vec![Address::Unix(dir.clone())]),
            (None, None) => unreachable!("count is the longer of the two lists"),
        };
        let addresses = match addresses {
            Ok(addresses) => addresses,
            Err(err) => {
                last = Some(ConnectFailure::Network(err));
                continue;
            }
        };
        for address in addresses {
            let route = Arc::new(Route {
                address,
                port,
                hostname: hostname.clone(),
                settings: Arc::clone(&settings),
            });
            match connect_once(&raw, route).await {
                Ok(connected) => return Ok(connected),
                Err(err) => last = Some(err),
            }
        }
    }
    Err(last.unwrap_or_else(|| {
        ConnectFailure::Network(io::Error::new(
            io::ErrorKind::InvalidInput,
            "could not resolve any addresses",
        ))
    }))
}

/// One address: socket, TLS, startup and login, then the session check the URL asks
/// for (`target_session_attrs`).
async fn connect_once(raw: &tokio_postgres::Config, route: Arc<Route>) -> Result<Connected, ConnectFailure> {
    let socket = open(&route).await.map_err(ConnectFailure::Network)?;
    let transport = negotiate(socket, &route).await?;
    let wire = WireLog::new();
    let stream = Wire::new(transport, Arc::clone(&wire));
    let (client, mut connection) = raw.connect_raw(stream, Handover).await.map_err(ConnectFailure::Driver)?;
    check_session(&client, &mut connection, raw.get_target_session_attrs()).await?;
    let canceller = Canceller { token: client.cancel_token(), route };
    Ok(Connected { client, connection, wire, canceller })
}

/// `target_session_attrs`, as tokio-postgres checks it: `read-write` wants
/// `transaction_read_only` off (a primary), `read-only` on; a server that does not
/// fit is passed over for the next host.
async fn check_session(
    client: &tokio_postgres::Client,
    connection: &mut Connection,
    attrs: TargetSessionAttrs,
) -> Result<(), ConnectFailure> {
    if attrs == TargetSessionAttrs::Any {
        return Ok(());
    }
    let messages = tokio::select! {
        messages = client.simple_query("SHOW transaction_read_only") => messages.map_err(ConnectFailure::Driver)?,
        ended = &mut *connection => return Err(match ended {
            Err(err) => ConnectFailure::Driver(err),
            Ok(()) => ConnectFailure::Network(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed the connection")),
        }),
    };
    let read_only = messages.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0),
        _ => None,
    });
    let refused =
        |why: &str| Err(ConnectFailure::Network(io::Error::new(io::ErrorKind::PermissionDenied, why)));
    match (read_only, attrs) {
        (Some("on"), TargetSessionAttrs::ReadWrite) => refused("database does not allow writes"),
        (Some("off"), TargetSessionAttrs::ReadOnly) => refused("database is not read only"),
        _ => Ok(()),
    }
}

/// Each host's `connect_timeout` when a URL lists several and sets none (libpq
/// applies `connect_timeout` per host, as here).
const MULTI_HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What every address of one URL is reached with.
struct Settings {
    /// The URL, for refusals (redacted when shown).
    url: String,
    mode: SslMode,
    negotiation: SslNegotiation,
    tls: MakeRustlsConnect,
    connect_timeout: Option<Duration>,
    tcp_user_timeout: Option<Duration>,
    keepalive: Option<socket2::TcpKeepalive>,
}

impl Settings {
    fn of(url: &str, target: &Target) -> Self {
        let config = &target.config;
        let keepalive = config.get_keepalives().then(|| {
            #[allow(unused_mut)]
            let mut keepalive = socket2::TcpKeepalive::new().with_time(config.get_keepalives_idle());
            #[cfg(not(any(
                target_os = "aix",
                target_os = "redox",
                target_os = "solaris",
                target_os = "openbsd"
            )))]
            if let Some(interval) = config.get_keepalives_interval() {
                keepalive = keepalive.with_interval(interval);
            }
            #[cfg(not(any(
                target_os = "aix",
                target_os = "redox",
                target_os = "solaris",
                target_os = "windows",
                target_os = "openbsd"
            )))]
            if let Some(retries) = config.get_keepalives_retries() {
                keepalive = keepalive.with_retries(retries);
            }
            keepalive
        });
        Self {
            url: url.to_owned(),
            mode: target.mode,
            negotiation: config.get_ssl_negotiation(),
            tls: target.tls.clone(),
            // Several hosts and no `connect_timeout`: one that swallows packets (a
            // primary gone with its machine) would hold the attempt in TCP's SYN
            // retries (minutes) and the pool would give up before the next host.
            connect_timeout: config.get_connect_timeout().copied().or_else(|| {
                let hosts = config.get_hosts().len().max(config.get_hostaddrs().len());
                (hosts > 1).then_some(MULTI_HOST_CONNECT_TIMEOUT)
            }),
            tcp_user_timeout: config.get_tcp_user_timeout().copied(),
            keepalive,
        }
    }
}

/// Where one connection went: its cancel requests go there too.
struct Route {
    address: Address,
    port: u16,
    /// The URL's host name (what TLS verifies); none for a Unix socket or a bare
    /// `hostaddr`.
    hostname: Option<String>,
    settings: Arc<Settings>,
}

impl Route {
    /// The host as a person wrote it, for messages.
    fn host(&self) -> String {
        match (&self.hostname, &self.address) {
            (Some(name), _) => name.clone(),
            (None, Address::Tcp(ip)) => ip.to_string(),
            #[cfg(unix)]
            (None, Address::Unix(dir)) => dir.display().to_string(),
        }
    }
}

/// An address to dial.
#[derive(Debug, Clone)]
enum Address {
    Tcp(IpAddr),
    /// The directory of the server's socket (`.s.PGSQL.<port>` in it).
    #[cfg(unix)]
    Unix(PathBuf),
}

/// The addresses of `name`, in the resolver's order (shuffled with
/// `load_balance_hosts=random`).
async fn resolve(name: &str, port: u16, random: bool) -> io::Result<Vec<Address>> {
    let mut addresses: Vec<Address> =
        tokio::net::lookup_host((name, port)).await?.map(|addr| Address::Tcp(addr.ip())).collect();
    if random {
        fastrand::shuffle(&mut addresses);
    }
    Ok(addresses)
}

/// Opens the socket, as tokio-postgres does: within `connect_timeout`; for TCP
/// without Nagle's delay, with `tcp_user_timeout` (Linux) and the keepalives.
async fn open(route: &Route) -> io::Result<Socket> {
    let settings = &route.settings;
    let limit = settings.connect_timeout;
    match &route.address {
        Address::Tcp(ip) => {
            let stream = within(limit, TcpStream::connect((*ip, route.port))).await?;
            stream.set_nodelay(true)?;
            let socket = socket2::SockRef::from(&stream);
            #[cfg(target_os = "linux")]
            if let Some(timeout) = settings.tcp_user_timeout {
                socket.set_tcp_user_timeout(Some(timeout))?;
            }
            if let Some(keepalive) = &settings.keepalive {
                socket.set_tcp_keepalive(keepalive)?;
            }
            Ok(Socket::Tcp(stream))
        }
        #[cfg(unix)]
        Address::Unix(dir) => {
            let path = dir.join(format!(".s.PGSQL.{}", route.port));
            Ok(Socket::Unix(within(limit, UnixStream::connect(path)).await?))
        }
    }
}

/// `connect`, within `limit` if there is one.
async fn within<T>(
    limit: Option<Duration>,
    connect: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match limit {
        Some(limit) => tokio::time::timeout(limit, connect)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connection timed out"))),
        None => connect.await,
    }
}

/// PostgreSQL's SSLRequest: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// TLS as `sslmode` says, on a socket just opened: the SSLRequest (unless the URL
/// asks for `sslnegotiation=direct`), then rustls's handshake with the configuration
/// [`Target::parse`] built, the URL's host name sent (SNI) and verified. `prefer`
/// takes the server's no for plaintext; `require` and `verify-*` refuse.
async fn negotiate(mut socket: Socket, route: &Route) -> Result<Transport, ConnectFailure> {
    let settings = &route.settings;
    if settings.mode == SslMode::Disable {
        return Ok(Transport::Plain(socket));
    }
    if settings.negotiation == SslNegotiation::Direct {
        if settings.mode == SslMode::Prefer {
            return Err(ConnectFailure::Refused(Error::Config(
                "DATABASE_URL: sslmode=prefer cannot be used with sslnegotiation=direct (use sslmode=require)"
                    .into(),
            )));
        }
    } else {
        socket.write_all(&SSL_REQUEST).await.map_err(ConnectFailure::Network)?;
        let mut answer = [0];
        socket.read_exact(&mut answer).await.map_err(ConnectFailure::Network)?;
        if answer[0] != b'S' {
            return match settings.mode {
                SslMode::Prefer => Ok(Transport::Plain(socket)),
                _ => Err(ConnectFailure::Refused(no_tls(route))),
            };
        }
    }
    let Some(hostname) = &route.hostname else {
        return Err(ConnectFailure::Refused(Error::Tls {
            dependency: Dependency::Database,
            url: redact(&settings.url),
            host: route.host(),
            reason: format!(
                "{} offers TLS, but there is no host name to verify its certificate against",
                route.host()
            ),
            fix:
                "give the server's name with host= (and its address with hostaddr=), or use sslmode=disable \
                  on a Unix socket"
                    .into(),
        }));
    };
    let connector = MakeTlsConnect::<Socket>::make_tls_connect(&mut settings.tls.clone(), hostname)
        .unwrap_or_else(|never| match never {});
    match TlsConnect::connect(connector, socket).await {
        Ok(stream) => Ok(Transport::Tls(Box::new(stream))),
        Err(err) => Err(match crate::tls::rustls_error(&err) {
            Some(tls) => {
                ConnectFailure::Refused(crate::tls::refused(Dialect::Postgres, &settings.url, hostname, tls))
            }
            None => ConnectFailure::Network(err),
        }),
    }
}

/// The refusal of a server that declines TLS where the URL requires it.
fn no_tls(route: &Route) -> Error {
    let host = route.host();
    Error::Tls {
        dependency: Dependency::Database,
        url: redact(&route.settings.url),
        reason: format!("{host} does not offer TLS (it declined the SSLRequest), and sslmode requires it"),
        host,
        fix: "check that this is the server you meant, and turn its TLS on (ssl = on, with a certificate and key)"
            .into(),
    }
}

/// Cancels the statement running on one connection: a cancel request on a socket of
/// its own, opened and secured as the connection's was.
#[derive(Clone)]
pub(crate) struct Canceller {
    token: tokio_postgres::CancelToken,
    route: Arc<Route>,
}

impl Canceller {
    /// Sends the cancel request. The server answers nothing: success means it was
    /// sent.
    ///
    /// # Errors
    /// The socket, TLS or write failed.
    pub(crate) async fn cancel(&self) -> Result<(), ConnectFailure> {
        let socket = open(&self.route).await.map_err(ConnectFailure::Network)?;
        let transport = negotiate(socket, &self.route).await?;
        self.token.cancel_query_raw(transport, Handover).await.map_err(ConnectFailure::Driver)
    }
}

/// A socket: TCP, or a Unix socket.
pub(crate) enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(UnixStream),
}

/// What the startup and login run over: the socket, or TLS on it.
pub(crate) enum Transport {
    Plain(Socket),
    Tls(Box<<MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream>),
}

/// Hands tokio-postgres the stream as it is, as though it had made it TLS: idemq
/// did (or, the server declining under `prefer`, did not) before. Its channel
/// binding is the stream's own.
struct Handover;

impl<S: TlsStream + Unpin> TlsConnect<S> for Handover {
    type Stream = S;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<S, std::convert::Infallible>>;

    fn connect(self, stream: S) -> Self::Future {
        std::future::ready(Ok(stream))
    }
}

impl TlsStream for Transport {
    fn channel_binding(&self) -> ChannelBinding {
        match self {
            Self::Plain(_) => ChannelBinding::none(),
            Self::Tls(stream) => stream.channel_binding(),
        }
    }
}

/// `$method` on whichever stream `$self` holds.
macro_rules! delegate {
    ($self:ident, $stream:ident => $call:expr) => {
        match $self.get_mut() {
            Socket::Tcp($stream) => $call,
            #[cfg(unix)]
            Socket::Unix($stream) => $call,
        }
    };
}

impl AsyncRead for Socket {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        delegate!(self, s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

impl AsyncRead for Transport {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(socket) => Pin::new(socket).poll_read(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(socket) => Pin::new(socket).poll_write(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(socket) => Pin::new(socket).poll_flush(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(socket) => Pin::new(socket).poll_shutdown(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
