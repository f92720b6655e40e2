//! PostgreSQL connections: libpq's TLS parameters read ([`Target::parse`]), every
//! connection made by idemq itself ([`connect`]), and the SQLSTATE of every error the
//! server sends read off the wire ([`wire`]).
//!
//! tokio-postgres reads `sslmode` as `disable|prefer|require` only, and neither
//! `sslrootcert`, `sslcert` nor `sslkey`: [`Target::parse`] takes those four out of
//! the URL and decides, as libpq does:
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (default) | if the server offers it | not checked, unless a root certificate is given (then as `verify-ca`) |
//! | `require` | always | as `prefer` |
//! | `verify-ca` | always | chains to `sslrootcert` |
//! | `verify-full` | always | chains to `sslrootcert` and is valid for the host name |
//!
//! `sslrootcert` defaults to `~/.postgresql/root.crt` when that file exists;
//! `sslrootcert=system` uses the system's trust store (and, as in libpq, only with
//! `verify-full`). `sslcert`/`sslkey` default to `~/.postgresql/postgresql.crt` and
//! `.key` when both exist. Both URL forms are read: `postgres://…?sslmode=…` (one host
//! or several) and `host=… sslmode=…`.
//!
//! idemq opens the socket and runs the SSLRequest and the rustls handshake itself
//! ([`connect`]), then hands the stream to tokio-postgres for the startup and login,
//! wrapped in a [`Wire`](wire::Wire): diesel-async drops the SQLSTATE of a server
//! error, and the message it keeps is in the server's language (`lc_messages`). Why
//! not tokio-postgres's own `Config::connect` with a TLS connector that wraps the
//! stream: it calls the connector only when TLS is used, so a plaintext connection
//! (`sslmode=disable`, `prefer` against a server without TLS, every Unix socket)
//! would have no [`Wire`](wire::Wire). SCRAM's channel binding still works: the
//! stream tells tokio-postgres the server certificate's `tls-server-end-point`. What
//! it costs: diesel-async takes only a connection over tokio-postgres's own socket
//! type, so one over idemq's stream is driven by a task of idemq's (see
//! `store::db::connect`) and diesel-async's `notifications_stream` yields nothing on
//! it (the relay's `LISTEN` reads its notifications from that task instead).

mod connect;
pub(crate) mod wire;

pub(crate) use connect::{connect, Canceller, ConnectFailure, Connected, Connection};

use std::path::PathBuf;

use tokio_postgres_rustls::MakeRustlsConnect;

use super::{ClientCert, Dialect, Roots, Settings, Verify};
use crate::error::{redact, Error};

/// libpq's TLS parameters, which tokio-postgres does not read.
const PARAMS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// A database URL read: the driver's configuration (its `sslmode` unused: [`connect`]
/// negotiates TLS by `mode`), and the rustls configuration to use with it.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) tls: MakeRustlsConnect,
    pub(crate) mode: SslMode,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Target {
    /// Reads a database URL.
    ///
    /// # Errors
    /// [`Error::Config`]: a URL the driver cannot read, an unknown `sslmode`, a
    /// verifying mode without a root certificate, a file that cannot be used.
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        let (rest, params) = split(url);
        let get =
            |name: &str| params.iter().rev().find(|(key, _)| key == name).map(|(_, value)| value.clone());
        let mode = ssl_mode(get("sslmode").as_deref())?;
        let config: tokio_postgres::Config = rest.parse().map_err(|err: tokio_postgres::Error| {
            Error::Config(format!(
                "DATABASE_URL: {} cannot be read: {}",
                redact(url),
                redact(&err.to_string())
            ))
        })?;
        let (roots, verify) = verification(mode, get("sslrootcert").as_deref())?;
        let client = client_certificate(get("sslcert"), get("sslkey"))?;
        let settings = Settings { roots: roots.unwrap_or(Roots::System), verify, client };
        let tls = if mode == SslMode::Disable {
            // Never used (no TLS is negotiated), but one type for all modes.
            MakeRustlsConnect::new(
                Settings { roots: Roots::System, verify: Verify::Nothing, client: None }
                    .client_config(Dialect::Postgres)?,
            )
        } else {
            MakeRustlsConnect::new(settings.client_config(Dialect::Postgres)?)
        };
        Ok(Self { config, tls, mode })
    }
}

/// libpq's `sslmode` (`prefer` when absent); `allow` is refused.
fn ssl_mode(given: Option<&str>) -> Result<SslMode, Error> {
    match given {
        None | Some("prefer") => Ok(SslMode::Prefer),
        Some("disable") => Ok(SslMode::Disable),
        Some("require") => Ok(SslMode::Require),
        Some("verify-ca") => Ok(SslMode::VerifyCa),
        Some("verify-full") => Ok(SslMode::VerifyFull),
        Some("allow") => Err(Error::Config(
            "DATABASE_URL: sslmode=allow is not supported; use sslmode=prefer (TLS when the server \
             offers it) or sslmode=disable"
                .into(),
        )),
        Some(other) => Err(Error::Config(format!(
            "DATABASE_URL: sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
        ))),
    }
}

/// A file under `~/.postgresql/`, libpq's default place for certificates.
fn home(file: &str) -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".postgresql").join(file))
}

/// The root certificates (`sslrootcert`: a file, `system`, or libpq's
/// `~/.postgresql/root.crt` when present) and what `mode` verifies with them.
fn verification(mode: SslMode, root: Option<&str>) -> Result<(Option<Roots>, Verify), Error> {
    let mode_name = match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    };
    let roots = match root {
        Some("system") => {
            if mode != SslMode::VerifyFull && mode != SslMode::Disable {
                return Err(Error::Config(format!(
                    "DATABASE_URL: sslrootcert=system needs sslmode=verify-full (the system's authorities \
                     sign certificates for anyone's host: only the host name check makes them mean \
                     something); sslmode is {mode_name}"
                )));
            }
            Some(Roots::System)
        }
        Some(path) => Some(Roots::File(path.to_owned())),
        None => {
            home("root.crt").filter(|path| path.is_file()).map(|path| Roots::File(path.display().to_string()))
        }
    };
    let verify = match (mode, &roots) {
        (SslMode::VerifyFull, Some(_)) => Verify::Full,
        (SslMode::VerifyCa, Some(_)) => Verify::ChainOnly,
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(Error::Config(format!(
            "DATABASE_URL: sslmode={mode_name} checks the server's certificate, but no root certificate is \
                 given: add sslrootcert=PATH (the CA's PEM file), or sslrootcert=system with verify-full, \
                 or put the CA at ~/.postgresql/root.crt"
        )))
        }
        // libpq: with a root certificate, `require` (and `prefer`) verify the chain.
        (_, Some(_)) => Verify::ChainOnly,
        (_, None) => Verify::Nothing,
    };
    Ok((roots, verify))
}

/// The client certificate: `sslcert` with `sslkey` (or libpq's
/// `~/.postgresql/postgresql.key`), or libpq's defaults when both files are present.
fn client_certificate(cert: Option<String>, key: Option<String>) -> Result<Option<ClientCert>, Error> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(ClientCert { cert, key })),
        (Some(cert), None) => match home("postgresql.key").filter(|path| path.is_file()) {
            Some(key) => Ok(Some(ClientCert { cert, key: key.display().to_string() })),
            None => Err(Error::Config(
                "DATABASE_URL: sslcert= is given without sslkey=; a client certificate needs its key".into(),
            )),
        },
        (None, Some(_)) => Err(Error::Config(
            "DATABASE_URL: sslkey= is given without sslcert=; a client certificate needs both".into(),
        )),
        (None, None) => match (home("postgresql.crt"), home("postgresql.key")) {
            (Some(cert), Some(key)) if cert.is_file() && key.is_file() => {
                Ok(Some(ClientCert { cert: cert.display().to_string(), key: key.display().to_string() }))
            }
            _ => Ok(None),
        },
    }
}

/// Splits libpq's TLS parameters out of a URL: the rest (for tokio-postgres) and the
/// parameters, in order.
fn split(url: &str) -> (String, Vec<(String, String)>) {
    let trimmed = url.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else { return (trimmed.to_owned(), Vec::new()) };
        let mut kept = Vec::new();
        let mut taken = Vec::new();
        for segment in query.split('&').filter(|segment| !segment.is_empty()) {
            let key = segment.split_once('=').map_or(segment, |(key, _)| key);
            if PARAMS.contains(&key) {
                if let Some((key, value)) = url::form_urlencoded::parse(segment.as_bytes()).next() {
                    taken.push((key.into_owned(), value.into_owned()));
                }
            } else {
                kept.push(segment);
            }
        }
        let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
        (rest, taken)
    } else {
        let (pairs, taken): (Vec<_>, Vec<_>) =
            key_values(trimmed).into_iter().partition(|(key, _)| !PARAMS.contains(&key.as_str()));
        let rest = pairs
            .iter()
            .map(|(key, value)| format!("{key}='{}'", value.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(" ");
        (rest, taken)
    }
}

/// libpq's `key=value` form: whitespace-separated, a value optionally single-quoted
/// with `\` escapes.
fn key_values(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        if key.is_empty() {
            break;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next_if_eq(&'=').is_none() {
            pairs.push((key, String::new()));
            continue;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '\'' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libpqs_parameters_are_taken_out_of_both_url_forms() {
        let (rest, taken) = split(
            "postgres://u:p@h1:5432,h2:5433/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fca.pem",
        );
        assert_eq!(rest, "postgres://u:p@h1:5432,h2:5433/db?application_name=x");
        assert_eq!(
            taken,
            [("sslmode".into(), "verify-full".into()), ("sslrootcert".into(), "/ca.pem".into())]
        );
        let (rest, taken) = split("host=h user='a b' sslmode = require password=p\\'q");
        assert_eq!(rest, "host='h' user='a b' password='p\\'q'");
        assert_eq!(taken, [("sslmode".into(), "require".into())]);
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_user(), Some("a b"));
        assert_eq!(parsed.get_password(), Some(&b"p'q"[..]));
    }

    #[test]
    fn the_modes_mean_what_they_mean_in_libpq() {
        let mode = |url: &str| Target::parse(url).map(|target| target.mode);
        assert_eq!(mode("postgres://h/db").unwrap(), SslMode::Prefer);
        assert_eq!(mode("postgres://h/db?sslmode=disable").unwrap(), SslMode::Disable);
        let err =
            mode("postgres://h/db?sslmode=verify-full&sslrootcert=/no/such.pem").unwrap_err().to_string();
        assert!(err.contains("sslrootcert=/no/such.pem") && err.contains("no such file"), "{err}");
        let err = mode("postgres://h/db?sslmode=require&sslrootcert=system").unwrap_err().to_string();
        assert!(err.contains("verify-full"), "{err}");
        let err = mode("postgres://h/db?sslmode=verify-everything").unwrap_err().to_string();
        assert!(err.contains("verify-everything") && err.contains("verify-full"), "{err}");
        assert!(mode("postgres://h/db?sslmode=require&sslcert=/c.pem").is_err());
    }
}
