//! A small W3C WebDriver client, for tests that drive a web page in a real browser:
//! Debian's Chromium, headless, through its `chromedriver`.
//!
//! It needs `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian's `chromium` and
//! `chromium-driver`); [`Browser::start`] runs `.ci/browser` to install them when they
//! are missing, which takes root and Debian's archive. Each [`Browser`] has its own
//! chromedriver on a free loopback port and its own fresh profile, so tests can run
//! browsers side by side; dropping it ends the session, the driver and the browser.
//!
//! Every call blocks its thread until chromedriver answers (a page load included, up to
//! 30 s): call it from a plain `#[test]`, from `tokio::task::spawn_blocking`, or from a
//! `multi_thread` tokio test that can spare the worker. The form test of
//! `support_selftest.rs` shows it at work.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The key of an element's id in WebDriver's answers (the W3C spec's "web element identifier").
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
/// Every command's bound, should chromedriver stop answering: above the page-load and
/// script timeouts the session is created with (30 s), so those come back as errors.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long chromedriver has to answer its `/status` as ready.
const DRIVER_READY_TIMEOUT: Duration = Duration::from_secs(20);
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// What went wrong with a [`Browser`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebDriverError {
    /// The browser could not be installed, or chromedriver did not start or get ready.
    #[error("cannot start the browser: {0}")]
    Start(String),
    /// The WebDriver answered `command` (e.g. `POST /element`) with an error: `error` is
    /// its code (`no such element`, `javascript error`…), `message` says more.
    #[error("{command}: {error}: {message}")]
    Command {
        /// The method and the path under the session of the command that failed.
        command: String,
        /// The WebDriver error code.
        error: String,
        /// chromedriver's explanation.
        message: String,
    },
    /// `command` got no answer, or one that is not what WebDriver promises.
    #[error("{command}: {reason}")]
    Transport {
        /// The method and the path under the session of the command.
        command: String,
        /// The HTTP error, or the answer that could not be read.
        reason: String,
    },
    /// A screenshot could not be written to `path`.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A headless Chromium with a WebDriver session: started by [`Browser::start`], ended
/// (session, chromedriver, browser and profile) when dropped.
#[derive(Debug)]
pub struct Browser {
    agent: ureq::Agent,
    /// `http://127.0.0.1:<port>`, chromedriver's.
    driver: String,
    /// `/session/<id>`, the start of every command's path; empty until there is one.
    session: String,
    child: Child,
    /// chromedriver's log and the browser's profile.
    dir: PathBuf,
}

/// An element of the page, found by [`Browser::find`].
#[derive(Debug)]
pub struct Element<'b> {
    browser: &'b Browser,
    id: String,
}

/// A command: its method, and its body for a POST.
enum Verb {
    Get,
    Post(Value),
    Delete,
}

impl Browser {
    /// Installs the browser if it is missing (`.ci/browser`), starts chromedriver on a
    /// free loopback port and opens a session in a headless Chromium with a fresh profile.
    pub fn start() -> Result<Browser, WebDriverError> {
        install()?;
        let dir = std::env::temp_dir().join(crate::unique("idemq_browser"));
        let profile = dir.join("profile");
        std::fs::create_dir_all(&profile)
            .map_err(|e| WebDriverError::Start(format!("{}: {e}", profile.display())))?;
        let log = dir.join("chromedriver.log");
        let port = crate::free_addr().port();
        let child = Command::new(CHROMEDRIVER)
            .args([format!("--port={port}"), format!("--log-path={}", log.display())])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| WebDriverError::Start(format!("{CHROMEDRIVER}: {e}")))?;
        // From here on, dropping it (an error below) ends chromedriver and removes `dir`.
        let mut browser = Browser {
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(COMMAND_TIMEOUT))
                .proxy(None)
                .build()
                .into(),
            driver: format!("http://127.0.0.1:{port}"),
            session: String::new(),
            child,
            dir,
        };
        let deadline = Instant::now() + DRIVER_READY_TIMEOUT;
        while !browser.call("/status", Verb::Get).is_ok_and(|status| status["ready"] == true) {
            let exited = browser.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(WebDriverError::Start(format!("chromedriver not ready ({exited:?}): {said}")));
            }
            std::thread::sleep(POLL_INTERVAL);
        }

        let user_data_dir = format!("--user-data-dir={}", profile.display());
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            // Chromium's own connections (updates, sync, safe browsing) are refused on a
            // closed network, and the refusals slow or break page loads.
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
            user_data_dir.as_str(),
        ];
        let capabilities = json!({ "capabilities": { "alwaysMatch": {
            "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
            "timeouts": { "pageLoad": 30_000, "script": 30_000 },
        }}});
        let created = browser.call("/session", Verb::Post(capabilities))?;
        let Some(id) = created["sessionId"].as_str() else {
            return Err(unexpected("POST /session", &created));
        };
        browser.session = format!("/session/{id}");
        Ok(browser)
    }

    /// Loads `url` and waits for it to load.
    pub fn goto(&self, url: &str) -> Result<(), WebDriverError> {
        self.call("/url", Verb::Post(json!({ "url": url }))).map(drop)
    }

    /// The URL of the page shown.
    pub fn current_url(&self) -> Result<String, WebDriverError> {
        self.string("/url")
    }

    /// The page's title.
    pub fn title(&self) -> Result<String, WebDriverError> {
        self.string("/title")
    }

    /// The page's HTML as the browser has it now (scripts' changes included).
    pub fn page_source(&self) -> Result<String, WebDriverError> {
        self.string("/source")
    }

    /// The first element matching the CSS selector `css`; an error `no such element`
    /// at once if there is none (see [`Browser::wait_for`]).
    pub fn find(&self, css: &str) -> Result<Element<'_>, WebDriverError> {
        let found = self.call("/element", Verb::Post(json!({ "using": "css selector", "value": css })))?;
        self.element(found, "POST /element")
    }

    /// Every element matching the CSS selector `css`, in document order.
    pub fn find_all(&self, css: &str) -> Result<Vec<Element<'_>>, WebDriverError> {
        let found = self.call("/elements", Verb::Post(json!({ "using": "css selector", "value": css })))?;
        let Value::Array(found) = found else { return Err(unexpected("POST /elements", &found)) };
        found.into_iter().map(|element| self.element(element, "POST /elements")).collect()
    }

    /// The first element matching `css`, once there is one: polls [`Browser::find`] up
    /// to `timeout`, then fails with its last `no such element`.
    pub fn wait_for(&self, css: &str, timeout: Duration) -> Result<Element<'_>, WebDriverError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.find(css) {
                Err(WebDriverError::Command { command, error, message }) if error == "no such element" => {
                    if Instant::now() > deadline {
                        let message = format!("{message} (waited {timeout:?})");
                        return Err(WebDriverError::Command { command, error, message });
                    }
                }
                found => return found,
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Runs `script`, the body of a JavaScript function called with `args` (as
    /// `arguments`), and returns what it returns. (Not `execute`: diesel-async's
    /// `RunQueryDsl`, in scope in most test files, has an `execute` for every type that
    /// takes `self`, which a call on an owned `Browser` would find first.)
    pub fn execute_script(&self, script: &str, args: &[Value]) -> Result<Value, WebDriverError> {
        self.call("/execute/sync", Verb::Post(json!({ "script": script, "args": args })))
    }

    /// Saves a PNG of the window to `path`.
    pub fn screenshot(&self, path: impl AsRef<Path>) -> Result<(), WebDriverError> {
        let encoded = self.string("/screenshot")?;
        let png = base64::engine::general_purpose::STANDARD.decode(&encoded).map_err(|e| {
            WebDriverError::Transport { command: "GET /screenshot".into(), reason: e.to_string() }
        })?;
        let path = path.as_ref();
        std::fs::write(path, png).map_err(|source| WebDriverError::Write { path: path.to_owned(), source })
    }

    /// Sends a command to `path` under the session and returns its answer's `value`, or
    /// the WebDriver error it carries (with a 4xx or 5xx status).
    fn call(&self, path: &str, verb: Verb) -> Result<Value, WebDriverError> {
        let url = format!("{}{}{path}", self.driver, self.session);
        let (method, answer) = match verb {
            Verb::Get => ("GET", self.agent.get(&url).call()),
            Verb::Delete => ("DELETE", self.agent.delete(&url).call()),
            Verb::Post(body) => {
                ("POST", self.agent.post(&url).content_type("application/json").send(body.to_string()))
            }
        };
        let command = format!("{method} {path}");
        let transport = |reason: String| WebDriverError::Transport { command: command.clone(), reason };
        let answer = answer.map_err(|e| transport(e.to_string()))?;
        let failed = answer.status().as_u16() >= 400;
        // A screenshot or a page source can outgrow ureq's default limit of 10 MB.
        let text = answer.into_body().into_with_config().limit(256 << 20).read_to_string();
        let text = text.map_err(|e| transport(e.to_string()))?;
        let mut answer: Value = serde_json::from_str(&text).map_err(|e| transport(format!("{e}: {text}")))?;
        let value = answer["value"].take();
        if failed {
            let field = |name: &str| value[name].as_str().unwrap_or_default().to_owned();
            let (error, message) = (field("error"), field("message"));
            return Err(WebDriverError::Command { command, error, message });
        }
        Ok(value)
    }

    fn string(&self, path: &str) -> Result<String, WebDriverError> {
        match self.call(path, Verb::Get)? {
            Value::String(s) => Ok(s),
            other => Err(unexpected(&format!("GET {path}"), &other)),
        }
    }

    fn element(&self, found: Value, command: &str) -> Result<Element<'_>, WebDriverError> {
        match found[ELEMENT_KEY].as_str() {
            Some(id) => Ok(Element { browser: self, id: id.to_owned() }),
            None => Err(unexpected(command, &found)),
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver quits the browser as the session ends.
        if !self.session.is_empty() {
            let _ = self.call("", Verb::Delete);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Element<'_> {
    /// The element's rendered text.
    pub fn text(&self) -> Result<String, WebDriverError> {
        self.browser.string(&format!("/element/{}/text", self.id))
    }

    /// Clicks it (scrolled into view first), as a user would.
    pub fn click(&self) -> Result<(), WebDriverError> {
        self.browser.call(&format!("/element/{}/click", self.id), Verb::Post(json!({}))).map(drop)
    }

    /// Types `text` into it, as keystrokes.
    pub fn send_keys(&self, text: &str) -> Result<(), WebDriverError> {
        let verb = Verb::Post(json!({ "text": text }));
        self.browser.call(&format!("/element/{}/value", self.id), verb).map(drop)
    }

    /// Its attribute `name` as the page's markup set it (not the live property: a typed
    /// input's text is not its `value` attribute), `None` if it has none.
    pub fn attribute(&self, name: &str) -> Result<Option<String>, WebDriverError> {
        let path = format!("/element/{}/attribute/{name}", self.id);
        match self.browser.call(&path, Verb::Get)? {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => Err(unexpected(&format!("GET {path}"), &other)),
        }
    }
}

/// Runs `.ci/browser` unless Chromium and chromedriver are both there.
fn install() -> Result<(), WebDriverError> {
    if Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists() {
        return Ok(());
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../.ci/browser");
    let output = Command::new("bash").arg(script).stdin(Stdio::null()).output();
    let output = output.map_err(|e| WebDriverError::Start(format!("bash {script}: {e}")))?;
    if !output.status.success() {
        let said = String::from_utf8_lossy(&output.stderr);
        return Err(WebDriverError::Start(format!(
            "`bash {script}` failed ({}) to install it: {said}",
            output.status
        )));
    }
    Ok(())
}

fn unexpected(command: &str, answer: &Value) -> WebDriverError {
    WebDriverError::Transport { command: command.to_owned(), reason: format!("unexpected answer {answer}") }
}
