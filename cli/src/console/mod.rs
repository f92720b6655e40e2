//! The operations console: pages an operator reads in a browser, served by `run` on
//! the address that serves `/metrics` (`--http-addr`), under `/console`, and by
//! `console` alone (no consumer runs: the handlers page then shows settings, not
//! figures).
//!
//! | page | shows |
//! |---|---|
//! | `/console` | each handler: its queue, settings, rates per minute by outcome, p50/p99 handler time, in flight, paused or running |
//! | `/console/dead-letters` | every DLQ's letters grouped by handler and error kind; a group's letters with headers (credentials hidden), body and lineage; replay and purge (dry run, then a confirmation) |
//! | `/console/queues` | what `status` prints: each queue's depth, consumers, dead letters and retries; each stream's end and each handler's stored offset, lag and owner |
//! | `/console/database` | the outbox (backlog, oldest, failing), the dedup rows, replication and standbys, the broker as `/readyz` sees it |
//! | `/console/audit` | every action taken, who, on what, when, and what came of it |
//!
//! Server-rendered HTML (maud), no script, no request leaves the page's own server.
//! Who may read and who may act: [`auth`]. An action runs `dlq`'s own code, so a
//! page keeps `dlq replay`'s guarantees ([`letters`]), and is written to the audit
//! table before it runs.

mod auth;
mod facts;
mod letters;
mod live;
mod view;

use std::net::SocketAddr;
use std::sync::Arc;

use idemq_core::__private::sibling::pages::{Live, Mount, PageRequest, PageResponse, Pages, PREFIX};
use maud::Markup;

use crate::common::{CliResult, Out};
use crate::status::Inventory;
use auth::{Access, Refusal, Who};

/// The environment variable holding the console's token (or `…_FILE`, a file
/// holding it).
pub(crate) const TOKEN_ENV: &str = "IDEMQ_CONSOLE_TOKEN";

/// The environment variable that enables actions, as `--console-actions` does.
pub(crate) const ACTIONS_ENV: &str = "IDEMQ_CONSOLE_ACTIONS";

/// How long a wrong token's answer waits: with at most 16 pages answered at once,
/// guessing the token goes no faster than 32 tries a second.
const WRONG_TOKEN_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

/// The console's settings: its token and whether it may act.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) token: Option<String>,
    pub(crate) actions: bool,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("actions", &self.actions)
            .finish()
    }
}

impl Settings {
    /// From the environment (`IDEMQ_CONSOLE_TOKEN[_FILE]`, `IDEMQ_CONSOLE_ACTIONS`)
    /// and `--console-actions`.
    pub(crate) fn from_env(actions_flag: bool) -> Result<Self, idemq_core::Error> {
        let file_name = format!("{TOKEN_ENV}_FILE");
        let token = match (std::env::var(TOKEN_ENV).ok(), std::env::var_os(&file_name)) {
            (Some(_), Some(_)) => {
                return Err(idemq_core::Error::Config(format!(
                    "both {TOKEN_ENV} and {file_name} are set: keep one ({file_name} names a file holding the token)"
                )))
            }
            (Some(token), None) => Some(token),
            (None, Some(path)) => Some(std::fs::read_to_string(&path).map_err(|source| idemq_core::Error::ConfigIo {
                message: format!("cannot read the console's token from {file_name}={}", path.to_string_lossy()),
                source,
            })?),
            (None, None) => None,
        };
        let token = token.map(|token| token.trim().to_owned());
        if token.as_deref() == Some("") {
            return Err(idemq_core::Error::Config(format!(
                "the console's token ({TOKEN_ENV} or {file_name}) is empty: give one, or unset it"
            )));
        }
        let actions = match std::env::var(ACTIONS_ENV) {
            Ok(value) => idemq_core::__private::sibling::parse_switch(&value)
                .map_err(|why| idemq_core::Error::Config(format!("{ACTIONS_ENV}: {why}")))?,
            Err(_) => false,
        };
        Ok(Self { token, actions: actions || actions_flag })
    }
}

/// The operations console on a runtime built in code: served under `/console` on
/// the runtime's [`http_addr`](idemq_core::RuntimeBuilder::http_addr), beside
/// `/metrics`. The CLI's `run` mounts it itself, with [`Console::from_env`].
///
/// ```no_run
/// # async fn handler(msg: serde_json::Value) -> Result<(), idemq::HandlerError> { Ok(()) }
/// use idemq::cli::Console;
///
/// let builder = idemq::Runtime::builder().http_addr("127.0.0.1:9464".parse().unwrap());
/// // Read-only, without a token: served to loopback only.
/// let builder = Console::new("shop").mount(builder);
/// # let _ = builder;
/// ```
#[derive(Debug, Clone)]
pub struct Console {
    app: &'static str,
    settings: Settings,
}

impl Console {
    /// A read-only console without a token, titled `app`: served to loopback only.
    pub fn new(app: &'static str) -> Self {
        Self { app, settings: Settings { token: None, actions: false } }
    }

    /// A console configured as `run` configures it: the token from
    /// `IDEMQ_CONSOLE_TOKEN` (or `IDEMQ_CONSOLE_TOKEN_FILE`), actions if
    /// `IDEMQ_CONSOLE_ACTIONS` is on.
    ///
    /// # Errors
    /// [`Error::Config`](idemq_core::Error::Config): both variables of the token are
    /// set, its file cannot be read, or `IDEMQ_CONSOLE_ACTIONS` is neither on nor off.
    pub fn from_env(app: &'static str) -> Result<Self, idemq_core::Error> {
        Ok(Self { app, settings: Settings::from_env(false)? })
    }

    /// The token every request must then present (loopback too), and that actions
    /// need. Give it from a secret, never in code.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.settings.token = Some(token.into());
        self
    }

    /// Lets operators holding the token replay and purge dead letters.
    pub fn actions(mut self, on: bool) -> Self {
        self.settings.actions = on;
        self
    }

    /// Mounts it on `builder`: served once its `http_addr` is set.
    pub fn mount(self, builder: idemq_core::RuntimeBuilder) -> idemq_core::RuntimeBuilder {
        let mount = mount(Inventory::of(&builder), self.app, self.settings);
        idemq_core::__private::sibling::pages::with_pages(builder, mount)
    }
}

/// The console mounted on a runtime's HTTP server (`run --http-addr`).
pub(crate) fn mount(inventory: Inventory, app: &'static str, settings: Settings) -> Mount {
    let inventory = Arc::new(inventory);
    Arc::new(move |bound: SocketAddr, live: Live| -> Pages {
        let console = Arc::new(Mounted::new(Arc::clone(&inventory), app, &settings, bound, live));
        console.sample_every_few_seconds();
        Arc::new(move |request| console.answer(request))
    })
}

/// `console`: serves the console alone on `addr` until SIGINT/SIGTERM.
pub(crate) async fn serve(
    inventory: Inventory,
    app: &'static str,
    settings: Settings,
    addr: SocketAddr,
) -> CliResult {
    let mounted = mount(inventory, app, settings.clone());
    let _serving = idemq_core::__private::sibling::pages::serve_pages(addr, mounted)?;
    let reading = if addr.ip().is_loopback() || settings.token.is_some() {
        ""
    } else {
        " (refusing every page: no token)"
    };
    println!("console on http://{addr}{PREFIX}{reading}; Ctrl-C stops it");
    let signals = idemq_core::shutdown_signals();
    signals.graceful.cancelled().await;
    Ok(())
}

/// One mounted console.
struct Mounted {
    inventory: Arc<Inventory>,
    app: &'static str,
    access: Access,
    live: Live,
    samples: live::Samples,
    /// For the pages' async work (they are answered on threads of their own).
    runtime: tokio::runtime::Handle,
}

impl Mounted {
    fn new(
        inventory: Arc<Inventory>,
        app: &'static str,
        settings: &Settings,
        bound: SocketAddr,
        live: Live,
    ) -> Self {
        Self {
            inventory,
            app,
            access: Access::new(settings.token.clone(), bound, settings.actions),
            live,
            samples: live::Samples::default(),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// Samples the metrics every [`live::EVERY`], for the handlers page's rates.
    fn sample_every_few_seconds(self: &Arc<Self>) {
        let console = Arc::downgrade(self);
        self.runtime.spawn(async move {
            loop {
                let Some(console) = console.upgrade() else { return };
                match console.live.metrics_text() {
                    Some(text) => console.samples.take(&text),
                    None => return,
                }
                drop(console);
                tokio::time::sleep(live::EVERY).await;
            }
        });
    }

    fn answer(&self, request: PageRequest) -> PageResponse {
        let (path, query) = match request.url.split_once('?') {
            Some((path, query)) => (path.to_owned(), query.to_owned()),
            None => (request.url.clone(), String::new()),
        };
        let path = path.strip_prefix(PREFIX).unwrap_or(&path).trim_end_matches('/').to_owned();
        let method = request.method.to_ascii_uppercase();
        if path == "/login" {
            return self.login(&request, &method);
        }
        let who = match self.access.who(&request) {
            Ok(who) => who,
            Err(refusal) => return self.refused(&request, refusal),
        };
        let query: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
        let page = Page { who: &who, access: &self.access, app: self.app };
        match (method.as_str(), path.as_str()) {
            ("GET", "" | "/handlers") => {
                let waiting = self.live.readiness().and_then(|(why, _)| why);
                let text = self.live.metrics_text();
                let rows = self.handlers(text.as_deref());
                let mut response = html(200, view::handlers(&page, &rows, waiting.as_deref()));
                if text.is_some() {
                    response.headers.push(("Refresh".into(), "10".into()));
                }
                response
            }
            ("GET", "/dead-letters") => {
                let groups = self.runtime.block_on(letters::groups(&self.inventory));
                let chosen = GroupKey::of(&query);
                html(200, view::dead_letters(&page, &groups, chosen.as_ref()))
            }
            ("GET", "/queues") => {
                let mut out = Out::captured();
                let result = self.runtime.block_on(crate::status::status_to(
                    &mut out,
                    &self.inventory,
                    self.app,
                    false,
                ));
                html(200, view::queues(&page, &out.lines(), result.err().map(|err| err.to_string())))
            }
            ("GET", "/database") => {
                let database = self.runtime.block_on(facts::database(&self.inventory.database_url));
                let relay = self
                    .live
                    .metrics_text()
                    .and_then(|text| self.samples.per_minute(&text, "idemq_outbox_published_total"));
                let brokers: Vec<String> = self
                    .inventory
                    .amqp_url
                    .split(',')
                    .map(|address| idemq_core::connect::redact(address.trim()))
                    .collect();
                html(200, view::database(&page, &database, relay, &brokers, self.live.readiness()))
            }
            ("GET", "/audit") => {
                let rows = self.runtime.block_on(facts::audit(&self.inventory.database_url, 200));
                html(200, view::audit(&page, &rows))
            }
            ("POST", "/logout") => {
                self.access.logout(&request);
                let mut response = redirect(&format!("{PREFIX}/login"));
                response
                    .headers
                    .push(("Set-Cookie".into(), format!("{}=; Path={PREFIX}; Max-Age=0", auth::COOKIE)));
                response
            }
            ("POST", "/dead-letters/replay" | "/dead-letters/purge") => self.act(&page, &request, &path),
            _ => html(404, view::message(&page, "Not found", &format!("No page at {}.", request.url))),
        }
    }

    /// Each handler's settings and, in a running service (its metrics `text`), its
    /// figures.
    fn handlers(&self, text: Option<&str>) -> Vec<view::HandlerRow> {
        let figures = text.map(|text| self.samples.figures(text));
        self.inventory
            .handlers
            .iter()
            .map(|(handler, queue, settings)| view::HandlerRow {
                handler: handler.clone(),
                queue: queue.clone(),
                settings: settings.clone(),
                figures: figures
                    .as_ref()
                    .map(|all| all.iter().find(|f| f.handler == *handler && f.queue == *queue).cloned()),
            })
            .collect()
    }

    /// A replay or purge: refused unless allowed; a dry run unless confirmed; written
    /// to the audit list before it runs.
    fn act(&self, page: &Page<'_>, request: &PageRequest, path: &str) -> PageResponse {
        let form: Vec<(String, String)> = form_urlencoded::parse(&request.body).into_owned().collect();
        let field = |name: &str| form.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        if let Err(why) = self.access.may_act(page.who, request, field("form_key").as_deref()) {
            tracing::warn!(who = %page.who.name(), "console: action refused: {why}");
            return html(403, view::message(page, "Refused", &why));
        }
        let Some(key) = GroupKey::of(&form) else {
            return html(400, view::message(page, "Which letters?", "The form names no dead-letter queue."));
        };
        let target = letters::Target {
            dlq: key.dlq.clone(),
            handler: key.handler.clone(),
            kind: key.kind.clone(),
            message_id: field("message_id").filter(|id| !id.is_empty()),
        };
        let act = if path.ends_with("/replay") {
            let max_replays = match field("max_replays").unwrap_or_default().trim() {
                "" => crate::dlq::DEFAULT_MAX_REPLAYS,
                given => match given.parse() {
                    Ok(n) => n,
                    Err(_) => {
                        return html(
                            400,
                            view::message(page, "Replay cap", "The replay cap must be a whole number."),
                        )
                    }
                },
            };
            letters::Act::Replay { max_replays }
        } else {
            letters::Act::Purge
        };
        let confirmed = field("confirm").as_deref() == Some("yes");
        if !confirmed {
            let lines = self.runtime.block_on(letters::act(&self.inventory, &target, &act, true));
            return html(200, view::confirm(page, &target, &act, &key, lines));
        }
        let name = match act {
            letters::Act::Replay { .. } => "replay",
            letters::Act::Purge => "purge",
        };
        let url = &self.inventory.database_url;
        let who = page.who.name();
        let described = match &act {
            letters::Act::Replay { max_replays } => {
                format!("{} (replay cap {max_replays})", target.describe())
            }
            letters::Act::Purge => target.describe(),
        };
        let audit = match self.runtime.block_on(facts::start(url, &who, name, &described)) {
            Ok(id) => id,
            Err(why) => {
                return html(
                    503,
                    view::message(
                        page,
                        "Not done",
                        &format!("The action was not run: its audit row cannot be written: {why}"),
                    ),
                )
            }
        };
        let result = self.runtime.block_on(letters::act(&self.inventory, &target, &act, false));
        let (summary, lines) = match &result {
            Ok(lines) => (lines.join("; "), lines.clone()),
            Err(why) => (format!("failed: {why}"), vec![format!("failed: {why}")]),
        };
        tracing::info!(who = %who, action = name, target = %described, "console: {summary}");
        let recorded = self.runtime.block_on(facts::finish(url, audit, &summary));
        html(200, view::done(page, name, &target, &lines, recorded.err()))
    }

    fn login(&self, request: &PageRequest, method: &str) -> PageResponse {
        let page_who = Who::Nobody;
        let page = Page { who: &page_who, access: &self.access, app: self.app };
        if method != "POST" {
            return html(200, view::login(&page, None));
        }
        if let Err(why) = auth::cross_site(request) {
            return html(403, view::message(&page, "Refused", &why));
        }
        let form: Vec<(String, String)> = form_urlencoded::parse(&request.body).into_owned().collect();
        let field = |name: &str| form.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str()).unwrap_or("");
        if !self.access.has_token() {
            return html(403, view::login(&page, Some("No token is configured: set IDEMQ_CONSOLE_TOKEN (or IDEMQ_CONSOLE_TOKEN_FILE) where the console runs.")));
        }
        match self.access.login(field("token"), field("name")) {
            Some(session) => {
                let mut response = redirect(PREFIX);
                response.headers.push((
                    "Set-Cookie".into(),
                    format!("{}={session}; Path={PREFIX}; HttpOnly; SameSite=Strict", auth::COOKIE),
                ));
                response
            }
            None => {
                tracing::warn!(remote = ?request.remote, "console: login refused: wrong token");
                std::thread::sleep(WRONG_TOKEN_PAUSE);
                html(401, view::login(&page, Some("Wrong token.")))
            }
        }
    }

    fn refused(&self, request: &PageRequest, refusal: Refusal) -> PageResponse {
        let who = Who::Nobody;
        let page = Page { who: &who, access: &self.access, app: self.app };
        match refusal {
            Refusal::WrongToken => {
                tracing::warn!(remote = ?request.remote, "console: request refused: wrong token");
                std::thread::sleep(WRONG_TOKEN_PAUSE);
                let mut response = html(401, view::message(&page, "Wrong token", "The token given is not this console's."));
                response.headers.push(("WWW-Authenticate".into(), "Basic realm=\"idemq console\"".into()));
                response
            }
            Refusal::Unauthenticated => {
                let mut response = html(401, view::login(&page, None));
                response.headers.push(("WWW-Authenticate".into(), "Basic realm=\"idemq console\"".into()));
                response
            }
            Refusal::NoTokenConfigured => html(
                403,
                view::message(
                    &page,
                    "Console off",
                    "This console listens beyond loopback and has no token, so it serves nothing: set \
                     IDEMQ_CONSOLE_TOKEN (or IDEMQ_CONSOLE_TOKEN_FILE) where it runs, or serve it on 127.0.0.1.",
                ),
            ),
        }
    }
}

/// What every page shows in its frame.
struct Page<'a> {
    who: &'a Who,
    access: &'a Access,
    app: &'a str,
}

/// A group of dead letters, as a page's query or a form names it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GroupKey {
    dlq: String,
    handler: Option<String>,
    kind: Option<String>,
}

impl GroupKey {
    /// From `dlq`, `handler` and `kind` fields (absent: the header is absent).
    fn of(fields: &[(String, String)]) -> Option<Self> {
        let field = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        Some(Self {
            dlq: field("dlq").filter(|dlq| !dlq.is_empty())?,
            handler: field("handler"),
            kind: field("kind"),
        })
    }

    /// As query fields.
    pub(super) fn query(&self) -> String {
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair("dlq", &self.dlq);
        if let Some(handler) = &self.handler {
            query.append_pair("handler", handler);
        }
        if let Some(kind) = &self.kind {
            query.append_pair("kind", kind);
        }
        query.finish()
    }
}

fn html(status: u16, markup: Markup) -> PageResponse {
    PageResponse {
        status,
        headers: vec![
            ("Content-Type".into(), "text/html; charset=utf-8".into()),
            ("Cache-Control".into(), "no-store".into()),
            // No script, no frame, nothing from elsewhere.
            (
                "Content-Security-Policy".into(),
                "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; frame-ancestors 'none'"
                    .into(),
            ),
            ("X-Content-Type-Options".into(), "nosniff".into()),
            ("Referrer-Policy".into(), "same-origin".into()),
        ],
        body: markup.into_string().into_bytes(),
    }
}

fn redirect(to: &str) -> PageResponse {
    PageResponse { status: 303, headers: vec![("Location".into(), to.to_owned())], body: Vec::new() }
}
