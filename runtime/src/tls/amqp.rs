//! `amqps://` for RabbitMQ: RabbitMQ's URI parameters read into a rustls
//! configuration, and a connection that is TLS from its first byte.
//!
//! Parameters (as in RabbitMQ's URI spec): `cacertfile=PATH` (the CA bundle; without
//! it the system's trust store), `certfile=PATH` + `keyfile=PATH` (a client
//! certificate), `server_name_indication=NAME` (the name sent and verified instead of
//! the URL's host), `verify=verify_peer|verify_none` (`verify_peer` by default;
//! `verify_none` encrypts without checking who answers, and is warned about). On an
//! `amqp://` URL they are refused rather than ignored: a URL that names a CA file
//! but connects in plaintext is a mistake.

use std::net::SocketAddr;
use std::sync::Arc;

use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::{Connection, ConnectionProperties};

use super::{Dialect, Roots, Settings, Verify};
use crate::error::{redact, Error};

/// RabbitMQ's TLS parameters (the Erlang client's names).
const PARAMS: [&str; 5] = ["cacertfile", "certfile", "keyfile", "server_name_indication", "verify"];

/// Where one broker address is and how to talk to it.
#[derive(Clone)]
pub(crate) struct Target {
    /// The URL as given (for lapin: credentials, vhost, heartbeat, …).
    url: String,
    host: String,
    port: u16,
    tls: Option<Tls>,
}

#[derive(Clone)]
struct Tls {
    connector: Arc<RustlsConnector>,
    /// The name sent (SNI) and verified.
    server_name: String,
    verify_none: bool,
    /// Whether a client certificate is given (`certfile=`, `keyfile=`).
    client_certificate: bool,
}

/// `url` read as lapin reads it (credentials, vhost, options) and as a URL (the
/// host: lapin reads an IP address as `localhost`, which would verify a certificate
/// against the wrong name); whether its scheme is `amqps`.
fn read(url: &str) -> Result<(url::Url, bool), Error> {
    let not_a_broker_url = |reason: &str| {
        Error::Config(format!(
            "AMQP_URL: {} is not a broker URL ({}); write amqp://user:password@host:5672/vhost \
             or amqps://user:password@host:5671/vhost (the vhost `/` is %2f, a comma in a password %2C)",
            redact(url),
            redact(reason)
        ))
    };
    url.parse::<lapin::uri::AMQPUri>().map_err(|reason| not_a_broker_url(&reason))?;
    let parsed = url::Url::parse(url).map_err(|err| not_a_broker_url(&err.to_string()))?;
    let tls_scheme = match parsed.scheme() {
        "amqp" => false,
        "amqps" => true,
        other => return Err(not_a_broker_url(&format!("the scheme {other} is neither amqp nor amqps"))),
    };
    Ok((parsed, tls_scheme))
}

/// The URL's TLS parameters ([`PARAMS`]), in order.
struct TlsParams(Vec<(String, String)>);

impl TlsParams {
    fn of(parsed: &url::Url) -> Self {
        Self(
            parsed
                .query_pairs()
                .filter(|(key, _)| PARAMS.contains(&key.as_ref()))
                .map(|(key, value)| (key.into_owned(), value.into_owned()))
                .collect(),
        )
    }

    /// The parameter's value (the last, if given twice).
    fn get(&self, name: &str) -> Option<String> {
        self.0.iter().rev().find(|(key, _)| key == name).map(|(_, value)| value.clone())
    }
}

impl Tls {
    /// The rustls configuration of `amqps://` URL `url` (to `host`) from its
    /// parameters.
    fn configure(url: &str, host: &str, params: &TlsParams) -> Result<Self, Error> {
        let verify = match params.get("verify").as_deref() {
            None | Some("verify_peer") => Verify::Full,
            Some("verify_none") => Verify::Nothing,
            Some(other) => {
                return Err(Error::Config(format!(
                    "AMQP_URL: verify={other} in {} is not a verify mode; write verify=verify_peer (the \
                     default) or verify=verify_none",
                    redact(url)
                )))
            }
        };
        let client = match (params.get("certfile"), params.get("keyfile")) {
            (Some(cert), Some(key)) => Some(super::ClientCert { cert, key }),
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(Error::Config(format!(
                    "AMQP_URL: {} gives only one of certfile= and keyfile=; a client certificate needs both",
                    redact(url)
                )))
            }
        };
        let roots = params.get("cacertfile").map_or(Roots::System, Roots::File);
        let client_certificate = client.is_some();
        let config = Settings { roots, verify, client }.client_config(Dialect::Amqp)?;
        let server_name = params.get("server_name_indication").unwrap_or_else(|| host.to_owned());
        rustls::pki_types::ServerName::try_from(server_name.clone()).map_err(|_| {
            Error::Config(format!(
                "AMQP_URL: {server_name} in {} is not a host name TLS can verify",
                redact(url)
            ))
        })?;
        Ok(Self {
            connector: Arc::new(RustlsConnector::from(Arc::new(config))),
            server_name,
            verify_none: verify == Verify::Nothing,
            client_certificate,
        })
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("url", &redact(&self.url))
            .field("tls", &self.tls.as_ref().map(|tls| &tls.server_name))
            .finish()
    }
}

impl Target {
    /// Reads one broker URL.
    ///
    /// # Errors
    /// [`Error::Config`]: not a broker URL, an unknown `verify` value, TLS
    /// parameters on an `amqp://` URL, a certificate or key file that cannot be used.
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        let (parsed, tls_scheme) = read(url)?;
        let host = match parsed.host() {
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(host) => host.to_string(),
            None => "localhost".to_owned(),
        };
        let port = parsed.port().unwrap_or(if tls_scheme { 5671 } else { 5672 });
        let params = TlsParams::of(&parsed);
        let tls = if tls_scheme {
            Some(Tls::configure(url, &host, &params)?)
        } else if let Some((key, _)) = params.0.first() {
            return Err(Error::Config(format!(
                "AMQP_URL: {} sets the TLS parameter {key} but is an amqp:// URL, which connects in \
                 plaintext; write amqps:// (port 5671 by default) to use TLS",
                redact(url)
            )));
        } else {
            None
        };
        Ok(Self { url: url.to_owned(), host, port, tls })
    }

    /// The URL as given.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Whether this address skips verifying the server (`verify=verify_none`).
    pub(crate) fn verify_none(&self) -> bool {
        self.tls.as_ref().is_some_and(|tls| tls.verify_none)
    }

    /// This address with another URL of the same broker (an added option, say).
    pub(crate) fn with_url(&self, url: String) -> Self {
        Self { url, ..self.clone() }
    }

    /// Connects: TCP, then (for `amqps://`) the TLS handshake, and only then the
    /// AMQP protocol header and login. A handshake that fails is [`Error::Tls`];
    /// so is a server that refuses this client's certificate (or its absence) just
    /// after the handshake (TLS 1.3 says so on the first read).
    ///
    /// # Errors
    /// [`Error::Tls`] or [`Error::AmqpConnect`].
    pub(crate) async fn connect(&self, properties: ConnectionProperties) -> Result<Connection, Error> {
        let uri: lapin::uri::AMQPUri = self.url.parse().map_err(|reason: String| {
            Error::Config(format!(
                "AMQP_URL: {} is not a broker URL ({})",
                redact(&self.url),
                redact(&reason)
            ))
        })?;
        let runtime = lapin::runtime::default_runtime()
            .map_err(|cause| Error::AmqpConnect { url: redact(&self.url), cause })?;
        let (host, port, tls) = (self.host.clone(), self.port, self.tls.clone());
        let handshake_failure: Arc<std::sync::Mutex<Option<rustls::Error>>> = Arc::default();
        let failure = Arc::clone(&handshake_failure);
        let connected = Connection::connector(
            uri,
            runtime,
            async move |_uri, runtime| {
                let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(lapin::Error::from)?
                    .collect();
                let stream =
                    AsyncTcpStream::connect(&runtime, addresses).await.map_err(lapin::Error::from)?;
                let Some(tls) = &tls else { return Ok(stream) };
                stream.into_rustls(&tls.connector, &tls.server_name).await.map_err(|err| {
                    if let Some(cause) = super::rustls_error(&err) {
                        *failure.lock().expect("not poisoned") = Some(cause.clone());
                        return lapin::Error::from(err);
                    }
                    // Reset or closed mid-handshake: a port that does not speak TLS
                    // (a plain AMQP listener resets it), or a broker going away. The
                    // kind is kept: an outage is waited out as before.
                    lapin::Error::from(std::io::Error::new(
                        err.kind(),
                        format!(
                            "the connection ended during the TLS handshake ({err}); does port {port} speak TLS? \
                             (RabbitMQ's TLS listener is 5671 by default, its plain one 5672)"
                        ),
                    ))
                })
            },
            properties,
        )
        .await;
        match connected {
            Ok(connection) => Ok(connection),
            Err(cause) => {
                let during = handshake_failure.lock().expect("not poisoned").take();
                match during.as_ref().or_else(|| super::rustls_error(&cause)) {
                    Some(tls) => Err(super::refused(Dialect::Amqp, &self.url, self.name(), tls)),
                    None => Err(Error::AmqpConnect { url: redact(&self.url), cause: self.explain(cause) }),
                }
            }
        }
    }

    /// A connection closed just after a TLS handshake without a client certificate
    /// is, most likely, a broker that requires one: under TLS 1.3 it says so in an
    /// alert after the handshake, which the reset that follows often overtakes. The
    /// error says so; its kind stays (a broker going away is waited out as before).
    fn explain(&self, cause: lapin::Error) -> lapin::Error {
        let closed = match cause.kind() {
            lapin::ErrorKind::IOError(io) => matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            )
            .then(|| io.kind()),
            _ => None,
        };
        match (&self.tls, closed) {
            (Some(tls), Some(kind)) if !tls.client_certificate => lapin::Error::from(std::io::Error::new(
                kind,
                format!(
                    "{cause}: the broker closed the connection after the TLS handshake, before the AMQP login; \
                     a broker that requires client certificates does that when none is given (give one with \
                     certfile= and keyfile=)"
                ),
            )),
            _ => cause,
        }
    }

    /// The name the server is verified against.
    fn name(&self) -> &str {
        self.tls.as_ref().map_or(&self.host, |tls| &tls.server_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ip_address_is_its_own_host_name_and_amqps_defaults_to_5671() {
        let target = Target::parse("amqps://u:p@127.0.0.1/%2f").unwrap();
        assert_eq!((target.host.as_str(), target.port), ("127.0.0.1", 5671));
        assert_eq!(target.name(), "127.0.0.1");
        let target = Target::parse("amqp://u:p@127.0.0.1/%2f").unwrap();
        assert_eq!((target.host.as_str(), target.port), ("127.0.0.1", 5672));
        assert!(target.tls.is_none());
    }

    #[test]
    fn tls_parameters_on_a_plain_url_are_refused_not_ignored() {
        let err = Target::parse("amqp://u:s3cret@h/%2f?cacertfile=/ca.pem").unwrap_err().to_string();
        assert!(err.contains("amqps://") && err.contains("cacertfile") && !err.contains("s3cret"), "{err}");
    }

    #[test]
    fn bad_tls_parameters_say_what_to_write() {
        let err = Target::parse("amqps://h/%2f?verify=none").unwrap_err().to_string();
        assert!(err.contains("verify=verify_none"), "{err}");
        let err = Target::parse("amqps://h/%2f?certfile=/c.pem").unwrap_err().to_string();
        assert!(err.contains("keyfile"), "{err}");
        let err = Target::parse("amqps://u:s3cret@h/%2f?cacertfile=/no/such/ca.pem").unwrap_err().to_string();
        assert!(
            err.contains("/no/such/ca.pem") && err.contains("no such file") && !err.contains("s3cret"),
            "{err}"
        );
    }

    #[test]
    fn server_name_indication_names_the_host_verified() {
        let target = Target::parse("amqps://127.0.0.1/%2f?server_name_indication=broker.internal").unwrap();
        assert_eq!(target.name(), "broker.internal");
        assert!(!target.verify_none());
        assert!(Target::parse("amqps://h/%2f?verify=verify_none").unwrap().verify_none());
    }
}
