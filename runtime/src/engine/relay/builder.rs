//! The public face: [`RelayBuilder`] and [`Relay`], whose `run` checks the settings,
//! the database and its schema, then hands over to the [`Worker`].

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::base::observe::{Observe, Observers};
use crate::base::BoxFuture;
use crate::config::EnvUrls;
use crate::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use crate::error::{redact, Error};
use crate::store::db::{self, SessionLimits};

use super::settings::Settings;
use super::worker::Worker;
use super::CONFIRM_TIMEOUT;

/// Configures a [`Relay`] run on its own (a runtime runs one by default; see
/// [`RuntimeBuilder::relay`](crate::RuntimeBuilder::relay)).
///
/// Like [`RuntimeBuilder`](crate::RuntimeBuilder), nothing is checked until
/// [`build`](Self::build), which refuses what cannot work with [`Error::Config`]
/// naming the fix, before anything connects.
#[derive(Clone)]
#[must_use = "a RelayBuilder does nothing until `.build()?` and `Relay::run`: a setting whose result is dropped is lost"]
pub struct RelayBuilder {
    amqp_url: String,
    database_url: String,
    /// A problem reading `AMQP_URL(_FILE)` or `DATABASE_URL(_FILE)`, for `run()`.
    env_urls: EnvUrls,
    settings: Settings,
    observers: Observers,
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("amqp_url", &redact(&self.amqp_url))
            .field("database_url", &redact(&self.database_url))
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl RelayBuilder {
    /// The broker (default: `AMQP_URL`, or the file `AMQP_URL_FILE` names, else
    /// [`DEFAULT_AMQP_URL`]).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.amqp_url = url.into();
        self.env_urls.overridden("AMQP_URL");
        self
    }

    /// The database holding `idemq_outbox` (default: `DATABASE_URL`, or the file
    /// `DATABASE_URL_FILE` names, else [`DEFAULT_DATABASE_URL`]).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = url.into();
        self.env_urls.overridden("DATABASE_URL");
        self
    }

    /// How often the relay looks for rows without being woken (default 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// The most rows one pass claims and publishes (default 512; at least 1:
    /// [`Relay::run`] refuses 0).
    pub fn batch_size(mut self, size: usize) -> Self {
        self.settings.batch_size = size;
        self
    }

    /// The longest a row that failed to publish waits before the next try (default
    /// 60 s; the wait doubles per failure from 100 ms).
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.settings.max_backoff = max;
        self
    }

    /// How long the reply to a request may wait in the outbox before it is deleted
    /// unpublished (default 1 h; at least 1 s; `Duration::MAX`: never), counted from
    /// when its transaction wrote it. A request with an AMQP `expiration` expires its
    /// reply sooner: that long after the request was consumed, when its requester has
    /// stopped waiting. Events never expire.
    ///
    /// A reply that cannot be delivered — its `reply_to` queue is gone, as auto-delete
    /// and exclusive reply queues go with their client, or its direct reply-to
    /// requester is (checked before publishing: the broker would confirm and drop it)
    /// — would otherwise stay in the outbox for ever, retried every
    /// [`max_backoff`](Self::max_backoff) with a warning each time. The default outlasts the timeouts requesters wait with
    /// (seconds to minutes) and a broker outage or relay restart a reply should ride
    /// out, and bounds a stuck reply to about 70 tries (the backoff doubles from
    /// 100 ms to 60 s). Each expired reply is counted ([`RelayPass::expired`](crate::base::observe::RelayPass::expired), the
    /// metric `idemq_outbox_replies_expired_total`), and a pass that deletes some logs
    /// one warning. Several relays on one outbox each apply their own: give them the
    /// same.
    pub fn reply_ttl(mut self, ttl: Duration) -> Self {
        self.settings.set_reply_ttl(ttl);
        self
    }

    /// Adds a subscriber told of every pass that claimed rows ([`Observe::relay`]).
    pub fn observe(mut self, observer: impl Observe) -> Self {
        self.observers.push(std::sync::Arc::new(observer));
        self
    }

    /// Checks the settings and the URLs.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting to fix: a [`batch_size`](Self::batch_size)
    /// of 0, a URL that cannot be used (its TLS files included), or one the
    /// environment gave twice (`DATABASE_URL` and `DATABASE_URL_FILE`);
    /// [`Error::ConfigIo`] for a URL in a file that cannot be read.
    pub fn build(self) -> Result<Relay, Error> {
        self.env_urls.check()?;
        self.settings.check()?;
        crate::broker::brokers::Brokers::parse(&self.amqp_url)?;
        crate::tls::postgres::Target::parse(&self.database_url)?;
        Ok(Relay { builder: self })
    }
}

/// Publishes the outbox (see the module docs): runs inside every
/// [`Runtime`](crate::Runtime) unless turned off, or on its own:
///
/// ```no_run
/// # async fn example() -> Result<(), idemq::Error> {
/// idemq::outbox::Relay::builder().build()?.run(idemq::shutdown_signal()).await
/// # }
/// ```
#[derive(Debug)]
pub struct Relay {
    builder: RelayBuilder,
}

impl Relay {
    /// A builder reading `AMQP_URL` and `DATABASE_URL` (or the files `AMQP_URL_FILE`
    /// and `DATABASE_URL_FILE` name, see [`env_url`](crate::connect::env_url); a problem with
    /// them is reported by [`Relay::run`]).
    pub fn builder() -> RelayBuilder {
        let mut env_urls = EnvUrls::default();
        RelayBuilder {
            amqp_url: env_urls.read("AMQP_URL", DEFAULT_AMQP_URL),
            database_url: env_urls.read("DATABASE_URL", DEFAULT_DATABASE_URL),
            env_urls,
            settings: Settings::default(),
            observers: Observers::default(),
        }
    }

    /// Publishes until `shutdown` is cancelled, then publishes what is due for a
    /// few more seconds and closes its connections. Broker and database faults are
    /// retried with backoff.
    ///
    /// # Errors
    /// Start-up failures: the database unreachable, idemq's migrations not applied.
    ///
    /// Boxed, as [`Runtime::run`](crate::engine::runtime::Runtime::run) is: compiled
    /// once, in idemq.
    pub fn run(self, shutdown: CancellationToken) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(self.run_until(shutdown))
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), Error> {
        let RelayBuilder { amqp_url, database_url, env_urls: _, settings, observers } = self.builder;
        let pool = relay_pool(&database_url)?;
        let connect_error = |err: Box<dyn std::error::Error + Send + Sync>| Error::DatabaseConnect {
            url: redact(&database_url),
            message: err.to_string(),
            cause: Some(err),
        };
        let mut conn = pool.get().await.map_err(|err| connect_error(Box::new(err)))?;
        if let Some(problem) = crate::store::migrate::check_schema(&mut conn)
            .await
            .map_err(|err| connect_error(Box::new(err)))?
        {
            return Err(problem.into());
        }
        drop(conn);
        let brokers = crate::broker::brokers::Brokers::parse(&amqp_url)?;
        let worker = Worker {
            pool,
            brokers,
            database_url,
            settings,
            wake: Arc::new(super::listen::Wake::default()),
            observers,
        };
        worker.run(shutdown).await;
        Ok(())
    }
}

/// The relay's own small pool: a connection per pass in flight, one spare; custom
/// plans only (see [`SessionLimits::custom_plans`]).
pub(crate) fn relay_pool(database_url: &str) -> Result<db::Pool, Error> {
    let limits = SessionLimits::for_handler_timeout(CONFIRM_TIMEOUT).custom_plans();
    db::build_pool(database_url, super::worker::DEPTH + 1, limits).map_err(|err| Error::DatabaseConnect {
        url: redact(database_url),
        message: err.to_string(),
        cause: Some(Box::new(err)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_size_of_zero_is_refused_by_build_with_the_fix() {
        let relay = Relay::builder()
            .amqp_url("amqp://guest:guest@127.0.0.1:1/%2f")
            .database_url("postgres://postgres@127.0.0.1:1/idemq")
            .batch_size(0)
            .build();
        match relay {
            Err(Error::Config(message)) => {
                assert!(message.contains("not 0") && message.contains(".batch_size(1)"), "{message}");
            }
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn debug_redacts_the_urls() {
        let builder = Relay::builder()
            .amqp_url("amqp://guest:secret@127.0.0.1:5672/%2f")
            .database_url("postgres://postgres:secret@127.0.0.1:5432/idemq");
        let printed = format!("{builder:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("127.0.0.1:5672"), "{printed}");
    }
}
