//! TLS to RabbitMQ and PostgreSQL, configured by the URLs alone, with rustls.
//!
//! - `amqps://` URLs ([`amqp`]) take RabbitMQ's URI parameters: `cacertfile`,
//!   `certfile` + `keyfile`, `server_name_indication`, `verify=verify_peer|verify_none`.
//!   An `amqps://` URL is TLS or nothing: there is no fallback to plaintext.
//! - PostgreSQL URLs ([`postgres`]) take libpq's: `sslmode`
//!   (`disable|prefer|require|verify-ca|verify-full`, libpq's meanings, `prefer` by
//!   default), `sslrootcert`, `sslcert`, `sslkey`.
//!
//! idemq builds the rustls configuration itself (the drivers' own TLS settings cannot
//! express libpq's `verify-ca` or RabbitMQ's `verify_none`), so one code path decides
//! what is verified for every connection: the runtime's, the relay's, the CLI's and
//! the test kit's. A handshake that fails is reported as [`Error::Tls`] with the host,
//! the reason in plain words and the parameter that fixes it; it is never taken for
//! an outage (no retry fixes a certificate).

pub(crate) mod amqp;
pub(crate) mod postgres;

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::error::{Dependency, Error};

/// The one crypto provider: ring (aws-lc-rs would nearly double the build).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Where the trusted certificate authorities come from.
#[derive(Debug, Clone)]
pub(crate) enum Roots {
    /// The PEM bundle at this path (`cacertfile=`, `sslrootcert=`).
    File(String),
    /// The operating system's trust store.
    System,
}

/// How the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Chain to a trusted root and valid for the host name (`verify_peer`,
    /// `verify-full`).
    Full,
    /// Chain to a trusted root, any host name (libpq's `verify-ca`).
    ChainOnly,
    /// Not at all: encrypted, but anyone on the path can pose as the server
    /// (`verify_none`; libpq's `require` and `prefer` without a root certificate).
    Nothing,
}

/// A client certificate and its key (PEM files).
#[derive(Debug, Clone)]
pub(crate) struct ClientCert {
    pub(crate) cert: String,
    pub(crate) key: String,
}

/// What a TLS client checks and presents, as read from a URL.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) roots: Roots,
    pub(crate) verify: Verify,
    pub(crate) client: Option<ClientCert>,
}

/// The names a service's URL gives its TLS parameters, for messages that say what
/// to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// RabbitMQ's URI parameters.
    Amqp,
    /// libpq's parameters.
    Postgres,
}

impl Dialect {
    fn dependency(self) -> Dependency {
        match self {
            Self::Amqp => Dependency::Broker,
            Self::Postgres => Dependency::Database,
        }
    }

    fn ca(self) -> &'static str {
        match self {
            Self::Amqp => "cacertfile=",
            Self::Postgres => "sslrootcert=",
        }
    }

    fn client_cert(self) -> &'static str {
        match self {
            Self::Amqp => "certfile= and keyfile=",
            Self::Postgres => "sslcert= and sslkey=",
        }
    }

    fn url_var(self) -> &'static str {
        match self {
            Self::Amqp => "AMQP_URL",
            Self::Postgres => "DATABASE_URL",
        }
    }
}

impl Settings {
    /// The rustls client configuration: roots, verifier and client certificate.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and the parameter when a file cannot be read
    /// or holds no certificate or key.
    pub(crate) fn client_config(&self, dialect: Dialect) -> Result<ClientConfig, Error> {
        let provider = provider();
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|err| Error::Config(format!("TLS: {err}")))?;
        let builder = match self.verify {
            Verify::Full => builder.with_root_certificates(Arc::new(self.root_store(dialect)?)),
            Verify::ChainOnly => {
                let roots = Arc::new(self.root_store(dialect)?);
                let inner = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
                    .build()
                    .map_err(|err| Error::Config(format!("TLS: {err}")))?;
                builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly { inner }))
            }
            Verify::Nothing => {
                // No root is consulted. A CA file given beside is still read, so that a
                // wrong path is refused rather than ignored; the system store is not
                // loaded (libpq's default `prefer` connects this way every time).
                if let Roots::File(_) = self.roots {
                    self.root_store(dialect)?;
                }
                builder.dangerous().with_custom_certificate_verifier(Arc::new(NoVerification { provider }))
            }
        };
        match &self.client {
            None => Ok(builder.with_no_client_auth()),
            Some(ClientCert { cert, key }) => {
                let (param_cert, param_key) = match dialect {
                    Dialect::Amqp => ("certfile", "keyfile"),
                    Dialect::Postgres => ("sslcert", "sslkey"),
                };
                let chain = load_certs(cert, param_cert, dialect)?;
                let key_der = PrivateKeyDer::from_pem_file(key).map_err(|err| {
                    Error::Config(format!(
                        "{}: {param_key}={key} holds no usable private key ({err}); give the client \
                         certificate's key as PEM (PKCS#8, PKCS#1 or SEC1)",
                        dialect.url_var()
                    ))
                })?;
                builder.with_client_auth_cert(chain, key_der).map_err(|err| {
                    Error::Config(format!(
                        "{}: the client certificate {param_cert}={cert} and key {param_key}={key} \
                         cannot be used together ({err}); are they a pair?",
                        dialect.url_var()
                    ))
                })
            }
        }
    }

    fn root_store(&self, dialect: Dialect) -> Result<RootCertStore, Error> {
        let mut store = RootCertStore::empty();
        match &self.roots {
            Roots::File(path) => {
                let param = dialect.ca().trim_end_matches('=');
                for cert in load_certs(path, param, dialect)? {
                    store.add(cert).map_err(|err| {
                        Error::Config(format!(
                            "{}: {param}={path} holds a certificate that is not a usable CA ({err})",
                            dialect.url_var()
                        ))
                    })?;
                }
            }
            Roots::System => {
                // Unreadable entries of the system store are skipped, as every
                // client of it does; an empty store fails every handshake, which
                // then says so.
                let (added, _) = store.add_parsable_certificates(system_roots().iter().cloned());
                if added == 0 {
                    crate::base::log::warn!(
                        "TLS: the system trust store has no certificates; give the CA file with {}PATH",
                        dialect.ca()
                    );
                }
            }
        }
        Ok(store)
    }
}

/// The operating system's trust store, read once per process (it is hundreds of
/// files; every connection that verifies against it would read them again).
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: std::sync::OnceLock<Vec<CertificateDer<'static>>> = std::sync::OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// Every certificate of a PEM file.
fn load_certs(path: &str, param: &str, dialect: Dialect) -> Result<Vec<CertificateDer<'static>>, Error> {
    let unreadable =
        |why: String| Error::Config(format!("{}: {param}={path} cannot be used: {why}", dialect.url_var()));
    if !Path::new(path).exists() {
        return Err(unreadable("no such file".into()));
    }
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|err| unreadable(err.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| unreadable(err.to_string()))?;
    if certs.is_empty() {
        return Err(unreadable("it holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into()));
    }
    Ok(certs)
}

/// libpq's `verify-ca`: the chain must lead to a trusted root; the host name is not
/// checked.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            // webpki checks the name last: everything else held.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// No check of the server's certificate (`verify_none`, libpq's `require`): the
/// handshake's signatures are still verified, so the session is encrypted to
/// whoever holds the key of the certificate shown.
#[derive(Debug)]
struct NoVerification {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// The rustls error somewhere in `err`'s chain (an `io::Error` carries it inside,
/// where `source()` does not look), if the failure was TLS's.
pub(crate) fn rustls_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = err.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            if let Some(tls) = rustls_error(inner) {
                return Some(tls);
            }
        }
        next = err.source();
    }
    None
}

/// [`Error::Tls`] for a handshake with `host` that failed with `err`: the reason in
/// plain words and the parameter that fixes it.
pub(crate) fn refused(dialect: Dialect, url: &str, host: &str, err: &rustls::Error) -> Error {
    use rustls::AlertDescription as Alert;
    let (reason, fix) = match err {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => (
                format!("the server's certificate for {host} is not signed by a trusted certificate authority (unknown issuer)"),
                format!("give the CA that signed it with {}PATH (a PEM bundle)", dialect.ca()),
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => (
                format!("the server's certificate for {host} has expired ({cert:?})"),
                "renew the server's certificate".to_owned(),
            ),
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => (
                format!("the server's certificate for {host} is not valid yet ({cert:?}); is this host's clock right?"),
                "check the clocks, or the certificate's validity".to_owned(),
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => (
                match cert {
                    CertificateError::NotValidForNameContext { presented, .. } => format!(
                        "the server's certificate is not valid for the host name {host} (it is for {})",
                        presented.iter().map(|name| plain_name(name)).collect::<Vec<_>>().join(", ")
                    ),
                    _ => format!("the server's certificate is not valid for the host name {host}"),
                },
                match dialect {
                    Dialect::Amqp => "connect by a name the certificate lists (or name it with server_name_indication=NAME)".to_owned(),
                    Dialect::Postgres => "connect by a name the certificate lists (or use sslmode=verify-ca, which checks the chain only)".to_owned(),
                },
            ),
            CertificateError::Revoked => {
                (format!("the server's certificate for {host} is revoked"), "replace the server's certificate".to_owned())
            }
            other => (
                format!("the server's certificate for {host} does not verify ({other:?})"),
                "check the server's certificate".to_owned(),
            ),
        },
        rustls::Error::AlertReceived(Alert::CertificateRequired) => (
                format!("{host} requires a client certificate and none was given"),
                format!("give one with {}", dialect.client_cert()),
            ),
        rustls::Error::AlertReceived(
            alert @ (Alert::BadCertificate | Alert::UnknownCA | Alert::CertificateUnknown | Alert::CertificateExpired
            | Alert::AccessDenied | Alert::HandshakeFailure),
        ) => (
            format!("{host} refused the TLS handshake ({alert:?}): it wants a client certificate it trusts, or other TLS settings"),
            format!("give a client certificate its CA signed with {}", dialect.client_cert()),
        ),
        other => (
            format!("the TLS handshake with {host} failed: {other}"),
            match dialect {
                Dialect::Amqp => "check that the port speaks TLS (RabbitMQ's TLS listener is 5671 by default) and the broker's TLS settings".to_owned(),
                Dialect::Postgres => "check the server's TLS settings (ssl = on, its certificate and key)".to_owned(),
            },
        ),
    };
    Error::Tls {
        dependency: dialect.dependency(),
        url: crate::base::redact::redact(url),
        host: host.to_owned(),
        reason,
        fix,
    }
}

/// A name as rustls presents it (`DnsName("localhost")`, `IpAddress(..)`), as a
/// person writes it.
fn plain_name(presented: &str) -> &str {
    presented.strip_prefix("DnsName(\"").and_then(|rest| rest.strip_suffix("\")")).unwrap_or(presented)
}
