//! The runtime: connections, topology, consumers, concurrency and shutdown.
//!
//! Two AMQP connections per session (consuming, publishing); one channel per consumer
//! (with its own `basic_qos`, never global) plus one publisher channel in confirm
//! mode for copies. Deliveries run in batches, at most `concurrency` transactions at
//! once, which is also the pool size.
//!
//! - `builder`: [`RuntimeBuilder`], its settings and the checks `build` makes;
//! - `check`: what `build` checks of the handlers;
//! - `plan`: what a builder would declare and consume, read by the CLI;
//! - `run`: [`Runtime::run`] in phases — assemble, spawn, supervise, drain;
//! - `settings`: every builder setting with its flag, variable and TOML key;
//! - `signals`: the process's shutdown signals as tokens.

use std::sync::Arc;
use std::time::Duration;

use crate::base::outcome::Stats;

mod builder;
mod check;
pub(crate) mod plan;
mod run;
// Read by tests only: the guide's Configuration table and the CLI's (`idemq-cli`, through
// `__private::sibling`) are checked against it.
pub(crate) mod settings;
mod signals;

pub use builder::RuntimeBuilder;
pub use signals::{shutdown_signal, shutdown_signals, ShutdownSignals};

/// The default [`RuntimeBuilder::concurrency`].
pub(crate) const DEFAULT_CONCURRENCY: usize = 16;
/// The default [`RuntimeBuilder::batch_size`].
pub(crate) const DEFAULT_BATCH_SIZE: usize = 256;

/// Consumes queues with idempotent handlers until shut down.
///
/// ```no_run
/// # use idemq::{Runtime, Topology, Queue};
/// # async fn example(handler: impl idemq::Handler) -> Result<(), idemq::Error> {
/// let runtime = Runtime::builder()
///     .topology(Topology::new().queue(Queue::new("payments")))
///     .consume("payments", handler)
///     .build()?;
/// runtime.run(idemq::shutdown_signal()).await
/// # }
/// ```
pub struct Runtime {
    builder: RuntimeBuilder,
    stats: Arc<Stats>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("builder", &self.builder).finish_non_exhaustive()
    }
}

impl Runtime {
    /// A builder reading `AMQP_URL` and `DATABASE_URL` from the environment, with
    /// local defaults ([`DEFAULT_AMQP_URL`](crate::connect::DEFAULT_AMQP_URL),
    /// [`DEFAULT_DATABASE_URL`](crate::connect::DEFAULT_DATABASE_URL)).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::new()
    }

    /// `spent` of the startup timeout went before `run` (the CLI's wait for the
    /// database before its migrations): `run` waits only for what is left.
    pub(crate) fn startup_spent(&mut self, spent: Duration) {
        if let Some(timeout) = &mut self.builder.startup_timeout {
            *timeout = timeout.saturating_sub(spent);
        }
    }

    /// The outcome counters, live while the runtime runs.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }
}

/// The largest [`RuntimeBuilder::batch_size`]: a batch's dedup rows go in one
/// statement, and a transaction that large already holds its locks long enough.
pub(crate) const MAX_BATCH_SIZE: usize = 4096;

/// The `handler` value of a handler's dedup rows.
fn dedup_scope(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_owned(),
    }
}

/// `url` with `heartbeat=<secs>` in its query, unless it already sets one. A URL
/// that does not parse is left as it is: connecting reports it (redacted).
fn with_heartbeat(url: &str, heartbeat: Duration) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else { return url.to_owned() };
    if parsed.query_pairs().any(|(name, _)| name == "heartbeat") {
        return url.to_owned();
    }
    parsed.query_pairs_mut().append_pair("heartbeat", &heartbeat.as_secs().max(1).to_string());
    parsed.into()
}

#[cfg(test)]
mod tests {
    use super::with_heartbeat;
    use std::time::Duration;

    #[test]
    fn the_heartbeat_joins_the_query_unless_the_url_sets_one() {
        let beat = Duration::from_secs(20);
        assert_eq!(
            with_heartbeat("amqp://guest:gu%40st@127.0.0.1:5672/%2f", beat),
            "amqp://guest:gu%40st@127.0.0.1:5672/%2f?heartbeat=20"
        );
        assert_eq!(with_heartbeat("amqp://h/v?channel_max=5", beat), "amqp://h/v?channel_max=5&heartbeat=20");
        assert_eq!(with_heartbeat("amqp://h/v?heartbeat=5", beat), "amqp://h/v?heartbeat=5");
        assert_eq!(with_heartbeat("not a url", beat), "not a url");
    }
}
