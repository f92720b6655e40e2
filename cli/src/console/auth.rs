//! Who may see the console, and who may act on it.
//!
//! - **Reading**: without credentials only when no token is configured, the
//!   console listens on a loopback address and the request comes from one (the
//!   operator's own machine, or a `kubectl port-forward`). With a token configured
//!   (`IDEMQ_CONSOLE_TOKEN`, or `IDEMQ_CONSOLE_TOKEN_FILE` naming a file holding
//!   it), every request must carry it, loopback too (a proxy or sidecar on the same
//!   host is no operator); without one, a console beyond loopback refuses every
//!   page, saying how to set one.
//! - **Acting** (replay, purge): only when actions are enabled (`--console-actions`)
//!   and a token is configured, by a request that presents it, loopback or not.
//! - **Presenting the token**: the login form (a session cookie, `HttpOnly`,
//!   `SameSite=Strict`, scoped to `/console`, valid for [`SESSION_FOR`]), HTTP basic auth (any user name, which
//!   the audit records; the token as password), or `Authorization: Bearer`. A wrong
//!   token is refused with 401 and a WARN, never taken as no token.
//! - **Forms**: every action posts a form key that only the console's own pages
//!   hold (random per process), and a request whose `Origin` is another site is
//!   refused: a page elsewhere cannot make an operator's browser act.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;

use base64::Engine as _;
use idemq_core::__private::sibling::pages::PageRequest;

/// The session cookie's name.
pub(super) const COOKIE: &str = "idemq_console";

/// How long a login lasts.
pub(super) const SESSION_FOR: std::time::Duration = std::time::Duration::from_secs(12 * 60 * 60);

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Who {
    /// No credentials, from loopback to a loopback console: may read.
    Local,
    /// Presented the token: the name it gave (basic auth's user, the login form's
    /// name), else `operator`.
    Operator(String),
    /// Not logged in (the login page, a refusal).
    Nobody,
}

impl Who {
    /// As the audit records it.
    pub(super) fn name(&self) -> String {
        match self {
            Who::Local => "local (no token)".to_owned(),
            Who::Operator(name) => name.clone(),
            Who::Nobody => "nobody".to_owned(),
        }
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Credentials are needed (none given): 401, with the login form.
    Unauthenticated,
    /// The token given is wrong: 401.
    WrongToken,
    /// The console listens beyond loopback and has no token: 403, nothing served.
    NoTokenConfigured,
}

/// The console's access rules (see the module docs).
pub(super) struct Access {
    token: Option<String>,
    /// The console listens on a loopback address.
    loopback: bool,
    /// Actions are enabled (`--console-actions`).
    pub(super) actions: bool,
    /// The key every action's form carries.
    pub(super) form_key: String,
    /// Login sessions: cookie value → name, and when it was opened.
    sessions: Mutex<HashMap<String, (String, std::time::Instant)>>,
}

impl Access {
    pub(super) fn new(token: Option<String>, bound: SocketAddr, actions: bool) -> Self {
        Self {
            token: token.filter(|token| !token.is_empty()),
            loopback: bound.ip().is_loopback(),
            actions,
            form_key: idemq_core::__private::sibling::random_id(),
            sessions: Mutex::default(),
        }
    }

    /// Whether a token is configured.
    pub(super) fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Who `request` comes from, or why it is refused.
    pub(super) fn who(&self, request: &PageRequest) -> Result<Who, Refusal> {
        let presented = self.presented(request);
        let Some(token) = &self.token else {
            return match self.loopback && is_loopback(request.remote) {
                true => Ok(Who::Local),
                false => Err(Refusal::NoTokenConfigured),
            };
        };
        match presented {
            Some(Presented::Session(session)) => {
                let mut sessions = self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                sessions.retain(|_, (_, opened)| opened.elapsed() < SESSION_FOR);
                match sessions.get(&session) {
                    Some((name, _)) => Ok(Who::Operator(name.clone())),
                    // A stale cookie (expired, or the process restarted): log in again.
                    None => Err(Refusal::Unauthenticated),
                }
            }
            Some(Presented::Token { name, token: given }) => match same(given.as_bytes(), token.as_bytes()) {
                true => Ok(Who::Operator(name)),
                false => Err(Refusal::WrongToken),
            },
            None => Err(Refusal::Unauthenticated),
        }
    }

    /// Checks the login form's token: the new session's cookie value, or `None`.
    pub(super) fn login(&self, token: &str, name: &str) -> Option<String> {
        let expected = self.token.as_ref()?;
        if !same(token.as_bytes(), expected.as_bytes()) {
            return None;
        }
        let session = idemq_core::__private::sibling::random_id();
        let name = match name.trim() {
            "" => "operator".to_owned(),
            name => name.chars().filter(|c| !c.is_control()).take(64).collect(),
        };
        let mut sessions = self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        sessions.retain(|_, (_, opened)| opened.elapsed() < SESSION_FOR);
        sessions.insert(session.clone(), (name, std::time::Instant::now()));
        Some(session)
    }

    /// Ends the request's login session, if it has one.
    pub(super) fn logout(&self, request: &PageRequest) {
        if let Some(Presented::Session(session)) = self.presented(request) {
            self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&session);
        }
    }

    /// Why `who` may not act with a form carrying `form_key`, if it may not.
    pub(super) fn may_act(
        &self,
        who: &Who,
        request: &PageRequest,
        form_key: Option<&str>,
    ) -> Result<(), String> {
        if !self.actions {
            return Err("actions are off: this console is read-only (start it with --console-actions, or \
                        IDEMQ_CONSOLE_ACTIONS=on, to replay and purge)"
                .to_owned());
        }
        if self.token.is_none() {
            return Err(
                "actions need a token: set IDEMQ_CONSOLE_TOKEN (or IDEMQ_CONSOLE_TOKEN_FILE) and log in"
                    .to_owned(),
            );
        }
        if !matches!(who, Who::Operator(_)) {
            return Err("actions need the token: log in first".to_owned());
        }
        if !form_key.is_some_and(|key| same(key.as_bytes(), self.form_key.as_bytes())) {
            return Err(
                "this form is not one of this console's (or the console restarted): open the page again"
                    .to_owned(),
            );
        }
        cross_site(request)
    }

    fn presented(&self, request: &PageRequest) -> Option<Presented> {
        if let Some(authorization) = request.header("authorization") {
            let (scheme, value) = authorization.trim().split_once(' ')?;
            return match scheme.to_ascii_lowercase().as_str() {
                "bearer" => {
                    Some(Presented::Token { name: "operator".to_owned(), token: value.trim().to_owned() })
                }
                "basic" => {
                    let decoded = base64::engine::general_purpose::STANDARD.decode(value.trim()).ok()?;
                    let decoded = String::from_utf8(decoded).ok()?;
                    let (name, token) = decoded.split_once(':')?;
                    let name = if name.is_empty() { "operator" } else { name };
                    Some(Presented::Token { name: name.to_owned(), token: token.to_owned() })
                }
                _ => None,
            };
        }
        let cookies = request.header("cookie")?;
        cookies.split(';').find_map(|cookie| {
            let (name, value) = cookie.trim().split_once('=')?;
            (name == COOKIE).then(|| Presented::Session(value.to_owned()))
        })
    }
}

/// Refuses a request whose `Origin` (or, without one, `Referer`) is another site
/// than the `Host` it was sent to.
pub(super) fn cross_site(request: &PageRequest) -> Result<(), String> {
    let Some(host) = request.header("host") else { return Ok(()) };
    let origin = match (request.header("origin"), request.header("referer")) {
        (Some("null"), _) => return Err("refused: a form posted from an opaque origin".to_owned()),
        (Some(origin), _) | (None, Some(origin)) => origin,
        // Not a browser's form (curl with the token): nothing to forge.
        (None, None) => return Ok(()),
    };
    let authority = origin.split("://").nth(1).unwrap_or("").split('/').next().unwrap_or("");
    match authority.eq_ignore_ascii_case(host) {
        true => Ok(()),
        false => Err(format!("refused: a form posted from {origin}, not from this console ({host})")),
    }
}

enum Presented {
    Session(String),
    Token { name: String, token: String },
}

fn is_loopback(remote: Option<SocketAddr>) -> bool {
    remote.is_some_and(|remote| match remote.ip() {
        IpAddr::V4(ip) => ip.is_loopback(),
        IpAddr::V6(ip) => ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|ip| ip.is_loopback()),
    })
}

/// `a == b`, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0_u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(remote: &str, headers: &[(&str, &str)]) -> PageRequest {
        PageRequest {
            method: "GET".into(),
            url: "/console".into(),
            headers: headers.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(),
            body: Vec::new(),
            remote: Some(remote.parse().unwrap()),
        }
    }

    const LOCAL: &str = "127.0.0.1:5000";
    const AWAY: &str = "10.1.2.3:5000";

    #[test]
    fn without_a_token_only_loopback_reads_and_nothing_beyond_it_is_served() {
        let on_loopback = Access::new(None, "127.0.0.1:9000".parse().unwrap(), true);
        assert_eq!(on_loopback.who(&request(LOCAL, &[])), Ok(Who::Local));
        let everywhere = Access::new(None, "0.0.0.0:9000".parse().unwrap(), true);
        assert_eq!(everywhere.who(&request(LOCAL, &[])), Err(Refusal::NoTokenConfigured));
        assert_eq!(everywhere.who(&request(AWAY, &[])), Err(Refusal::NoTokenConfigured));
    }

    #[test]
    fn with_a_token_every_request_needs_it_a_wrong_one_is_refused_and_the_right_one_names_its_user() {
        let access = Access::new(Some("s3cret".into()), "0.0.0.0:9000".parse().unwrap(), true);
        assert_eq!(access.who(&request(AWAY, &[])), Err(Refusal::Unauthenticated));
        assert_eq!(access.who(&request(AWAY, &[("Authorization", "Bearer nope")])), Err(Refusal::WrongToken));
        let basic = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("ana:s3cret"));
        assert_eq!(access.who(&request(AWAY, &[("Authorization", &basic)])), Ok(Who::Operator("ana".into())));
        let local = Access::new(Some("s3cret".into()), "127.0.0.1:9000".parse().unwrap(), true);
        assert_eq!(
            local.who(&request(LOCAL, &[])),
            Err(Refusal::Unauthenticated),
            "a token is asked of loopback too"
        );
        assert_eq!(
            local.who(&request(LOCAL, &[("authorization", "Bearer s3cre")])),
            Err(Refusal::WrongToken)
        );
    }

    #[test]
    fn a_login_session_acts_only_with_the_form_key_and_from_the_same_site() {
        let access = Access::new(Some("s3cret".into()), "127.0.0.1:9000".parse().unwrap(), true);
        assert_eq!(access.login("wrong", "ana"), None);
        let session = access.login("s3cret", "ana").unwrap();
        let cookie = format!("{COOKIE}={session}");
        let ok = request(
            LOCAL,
            &[("Cookie", &cookie), ("Host", "127.0.0.1:9000"), ("Origin", "http://127.0.0.1:9000")],
        );
        let who = access.who(&ok).unwrap();
        assert_eq!(who, Who::Operator("ana".into()));
        assert!(access.may_act(&who, &ok, Some(&access.form_key.clone())).is_ok());
        assert!(access.may_act(&who, &ok, Some("forged")).is_err());
        let elsewhere = request(
            LOCAL,
            &[("Cookie", &cookie), ("Host", "127.0.0.1:9000"), ("Origin", "http://evil.example")],
        );
        assert!(access.may_act(&who, &elsewhere, Some(&access.form_key.clone())).is_err());
        assert!(access.may_act(&Who::Local, &ok, Some(&access.form_key.clone())).is_err());
        let read_only = Access::new(Some("s3cret".into()), "127.0.0.1:9000".parse().unwrap(), false);
        assert!(read_only
            .may_act(&who, &ok, Some(&read_only.form_key.clone()))
            .unwrap_err()
            .contains("read-only"));
    }
}
