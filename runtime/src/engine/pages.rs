//! Pages served beside `/metrics` (feature `metrics`): the CLI's operations
//! console mounts itself here, so a running service serves it on the address that
//! already serves its metrics. The engine knows nothing of what the pages say; it
//! hands each request for a path under [`PREFIX`] to the mounted [`Pages`] on a
//! thread of its own (a page that reads the broker must not hold up a scrape or a
//! liveness probe), with what only the running process knows: its live metrics.

use std::net::SocketAddr;
use std::sync::Arc;

/// The paths the mounted pages answer: `/console` and everything under it.
pub const PREFIX: &str = "/console";

/// The most pages answered at once: a request beyond them is answered 503 at once
/// (each page is a thread of its own).
pub(crate) const MAX_AT_ONCE: usize = 16;

/// The largest request body read (a form's fields): the rest is refused.
pub const MAX_BODY: usize = 64 * 1024;

/// One HTTP request for a page.
#[derive(Debug)]
pub struct PageRequest {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path and query, as requested (`/console/dead-letters?dlq=…`).
    pub url: String,
    /// The request's headers, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body (at most [`MAX_BODY`] bytes).
    pub body: Vec<u8>,
    /// Where it came from.
    pub remote: Option<SocketAddr>,
}

impl PageRequest {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// The answer to a [`PageRequest`].
#[derive(Debug)]
pub struct PageResponse {
    /// The HTTP status.
    pub status: u16,
    /// Headers to send, `Content-Type` among them.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// What the running process knows that no database or broker holds.
#[derive(Clone)]
pub struct Live {
    /// `None` when the pages are served without a runtime (the CLI's `console`).
    pub(crate) metrics: Option<Arc<dyn Probe>>,
}

/// What the pages read of the process's metrics (`engine::metrics` implements it).
pub(crate) trait Probe: Send + Sync {
    /// The text `/metrics` serves.
    fn render(&self) -> String;
    /// What `/readyz` says.
    fn readiness(&self) -> (Option<String>, String);
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").finish_non_exhaustive()
    }
}

impl Live {
    /// The text `/metrics` serves now (OpenMetrics); `None` without a runtime.
    pub fn metrics_text(&self) -> Option<String> {
        self.metrics.as_ref().map(|metrics| metrics.render())
    }

    /// What `/readyz` says now: why not ready (if so), and its report; `None`
    /// without a runtime.
    pub fn readiness(&self) -> Option<(Option<String>, String)> {
        self.metrics.as_ref().map(|metrics| metrics.readiness())
    }
}

/// The mounted pages: one call per request, on a thread of its own.
pub type Pages = Arc<dyn Fn(PageRequest) -> PageResponse + Send + Sync>;

/// Mounts pages once the server is bound: given the address it serves on and the
/// process's [`Live`] state, returns the [`Pages`]. Called on the async runtime (so
/// it may keep `tokio::runtime::Handle::current()` for the pages' async work).
pub type Mount = Arc<dyn Fn(SocketAddr, Live) -> Pages + Send + Sync>;
