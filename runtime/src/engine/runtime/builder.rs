//! [`RuntimeBuilder`]: the settings, each handler's registration, and the checks
//! `build` makes before anything connects.

use std::sync::Arc;
use std::time::Duration;

use super::{
    Runtime, DEFAULT_AMQP_URL, DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, DEFAULT_DATABASE_URL, MAX_BATCH_SIZE,
};
use crate::base::observe::ConnectionEvent;
use crate::base::observe::{Observe, Observers, OnConnection, OnSettled};
use crate::base::outcome::Settled;
use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::broker::topology::Topology;
use crate::config::EnvUrls;
use crate::error::{redact, Error};
use crate::handler::prepare::{self, ErasedHandler};
use crate::handler::Handler;

/// A handler registered for a queue (`consume`, `consume_with`, `handler`).
pub(crate) struct Registration {
    /// The queue it consumes (empty when `handler` named none: `build` refuses it).
    pub(crate) queue: String,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// `consume_with`'s policy, which overrides the handler's and the runtime's.
    pub(crate) retry: Option<RetryPolicy>,
}

impl Registration {
    fn new<H: Handler>(queue: String, handler: H, retry: Option<RetryPolicy>) -> Self {
        Self { queue, handler: prepare::erase(handler), retry }
    }

    /// Its retry policy: `consume_with`'s, else the handler's `retry(..)`, else the
    /// runtime's.
    pub(crate) fn retry_policy(&self, runtime: &RetryPolicy) -> RetryPolicy {
        self.retry.clone().or_else(|| self.handler.retry()).unwrap_or_else(|| runtime.clone())
    }
}

/// Configures a [`Runtime`]. Start with [`Runtime::builder`].
///
/// Each setter takes the builder and returns it; [`build`](Self::build) checks the
/// whole and is fallible (a runtime's settings depend on each other and on its
/// handlers). [`RelayBuilder::build`](crate::RelayBuilder::build) is not: a relay's
/// settings are checked by [`Relay::run`](crate::Relay::run), which reports them as
/// this `build` does, with [`Error::Config`].
#[must_use = "a RuntimeBuilder does nothing until `.build()?` and `Runtime::run`: a setting whose result is dropped is lost"]
pub struct RuntimeBuilder {
    pub(super) amqp_url: String,
    pub(super) database_url: String,
    /// A problem reading `AMQP_URL(_FILE)` or `DATABASE_URL(_FILE)`, for `build()`.
    pub(super) env_urls: EnvUrls,
    pub(super) topology: Topology,
    pub(super) consumers: Vec<Registration>,
    pub(super) concurrency: usize,
    pub(super) batch_size: usize,
    pub(super) linger: Duration,
    pub(super) retry: RetryPolicy,
    pub(super) handler_timeout: Duration,
    pub(super) database_retry_limit: Duration,
    pub(super) max_body_bytes: usize,
    pub(super) on_conflict: OnConflict,
    pub(super) namespace: Option<String>,
    pub(super) shutdown_deadline: Duration,
    pub(super) heartbeat: Duration,
    pub(super) reconnect_max: Duration,
    pub(super) startup_timeout: Option<Duration>,
    pub(super) consumer_timeout: Duration,
    pub(super) observers: Observers,
    pub(super) relay: Option<crate::engine::relay::Settings>,
    /// Set by `relay_poll_interval`: `build` refuses it with the relay off.
    pub(super) relay_poll_interval: Option<Duration>,
    /// Set by `reply_ttl`: `build` refuses it with the relay off.
    pub(super) reply_ttl: Option<Duration>,
    pub(super) retention: Option<crate::store::retention::Retention>,
    pub(super) prefetch: Option<u16>,
    #[cfg(feature = "metrics")]
    pub(super) http_addr: Option<std::net::SocketAddr>,
    #[cfg(feature = "testing")]
    pub(super) fault_hook: Option<crate::engine::fault::FaultHook>,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("amqp_url", &redact(&self.amqp_url))
            .field("database_url", &redact(&self.database_url))
            .field(
                "consumers",
                &self.consumers.iter().map(|r| (&r.queue, r.handler.name())).collect::<Vec<_>>(),
            )
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl RuntimeBuilder {
    pub(super) fn new() -> Self {
        let mut env_urls = EnvUrls::default();
        Self {
            amqp_url: env_urls.read("AMQP_URL", DEFAULT_AMQP_URL),
            database_url: env_urls.read("DATABASE_URL", DEFAULT_DATABASE_URL),
            env_urls,
            topology: Topology::new(),
            consumers: Vec::new(),
            concurrency: DEFAULT_CONCURRENCY,
            batch_size: DEFAULT_BATCH_SIZE,
            linger: Duration::ZERO,
            retry: RetryPolicy::default(),
            handler_timeout: Duration::from_secs(60),
            database_retry_limit: Duration::from_secs(25 * 60),
            max_body_bytes: 1024 * 1024,
            on_conflict: OnConflict::default(),
            namespace: None,
            shutdown_deadline: Duration::from_secs(10),
            heartbeat: Duration::from_secs(20),
            reconnect_max: Duration::from_secs(30),
            startup_timeout: None,
            consumer_timeout: crate::broker::consumer_timeout::DEFAULT,
            observers: Observers::default(),
            relay: Some(crate::engine::relay::Settings::default()),
            relay_poll_interval: None,
            reply_ttl: None,
            retention: None,
            prefetch: None,
            #[cfg(feature = "metrics")]
            http_addr: None,
            #[cfg(feature = "testing")]
            fault_hook: None,
        }
    }

    /// The broker, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f` (default: `AMQP_URL`, or
    /// the file `AMQP_URL_FILE` names, see [`env_url`](crate::env_url)), or several
    /// nodes separated by commas: the runtime connects to one that answers and, after
    /// losing it, tries the next first (a comma in a password is `%2C`).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.amqp_url = url.into();
        self.env_urls.overridden("AMQP_URL");
        self
    }

    /// The database holding the dedup table and the handlers' data (default:
    /// `DATABASE_URL`, or the file `DATABASE_URL_FILE` names, see
    /// [`env_url`](crate::env_url)).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = url.into();
        self.env_urls.overridden("DATABASE_URL");
        self
    }

    /// Exchanges and queues to declare at start-up (added to what is there).
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology.merge(topology);
        self
    }

    /// Consumes `queue` with `handler`. A queue declared in the topology brings its
    /// dead-letter queue and delivery limit; any other queue must already exist, with
    /// a dead-letter queue named `<queue>.dlq`.
    pub fn consume<H: Handler>(mut self, queue: impl Into<String>, handler: H) -> Self {
        self.consumers.push(Registration::new(queue.into(), handler, None));
        self
    }

    /// Consumes the queue the handler names (`#[idempotent_handler(queue = "...")]`).
    /// A handler that names none is refused by [`build`](Self::build).
    pub fn handler<H: Handler>(mut self, handler: H) -> Self {
        let queue = handler.queue().map(str::to_owned).unwrap_or_default();
        self.consumers.push(Registration::new(queue, handler, None));
        self
    }

    /// Like [`consume`](Self::consume), with this handler's own retry policy.
    pub fn consume_with<H: Handler>(
        mut self,
        queue: impl Into<String>,
        handler: H,
        retry: RetryPolicy,
    ) -> Self {
        self.consumers.push(Registration::new(queue.into(), handler, Some(retry)));
        self
    }

    /// Transactions run at once across all consumers (each holds one batch of
    /// deliveries, see [`batch_size`](Self::batch_size)); also the connection pool's
    /// size. Each consumer's prefetch is `concurrency × batch_size` (at most 65,535).
    /// Default 16.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Group commit: up to this many deliveries of one consumer run in one
    /// transaction, then are acked together. A batch closes at once when nothing else
    /// is waiting (a lone message never waits for a timer), or after
    /// [`linger`](Self::linger). `1` is per-message mode: one transaction per
    /// delivery. Guarantees are the same in both modes: a failing, panicking or
    /// timed-out handler, a lock wait or deadlock, a refused COMMIT never sink a
    /// batch's other deliveries (the batch is re-run without it, or split), and only
    /// a delivery run alone is ever charged an attempt. Default 64.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// How long a batch that is not full may wait for more deliveries before it
    /// runs. Default zero: a batch takes what has arrived and runs at once, so light
    /// load pays no latency and a backlog fills batches anyway.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// The retry policy of handlers consumed without their own: how often and how
    /// late a transient failure is retried before the message is dead-lettered (kind
    /// `attempts-exhausted`). Default [`RetryPolicy::default`]: 6 attempts.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long a handler may run; past it the attempt fails (transient) and its
    /// connection is dropped. Default 60 s. Counted twice against the broker's
    /// [`consumer_timeout`](Self::consumer_timeout).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long a delivery is held, retrying its transaction on fresh connections,
    /// while the database is unreachable; after that it is returned to the queue.
    /// Counted from the delivery's receipt (time waiting for its turn counts too).
    /// It must fit the broker's `consumer_timeout` with two handler timeouts and a
    /// minute to spare, which `build` checks (see
    /// [`consumer_timeout`](Self::consumer_timeout)). Default 25 min.
    pub fn database_retry_limit(mut self, limit: Duration) -> Self {
        self.database_retry_limit = limit;
        self
    }

    /// Bodies larger than this are dead-lettered (kind `too-large`) before decoding.
    /// Default 1 MiB.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// What to do with a known key arriving with a different payload. Default: dead-letter.
    pub fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    /// Scopes every handler's dedup rows under `namespace` (stored as
    /// `<namespace>/<handler name>`), for services that share one database: two
    /// services each with a handler `apply_payment` would otherwise share its dedup
    /// rows, and one's messages would be acked as the other's duplicates. Default:
    /// none (rows are scoped by handler name alone). Changing it makes every earlier
    /// message look new: set it once, before the first run.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// How long shutdown waits for in-flight deliveries before returning them to the
    /// queue. Default 10 s; with a minute to spare it must fit the broker's
    /// [`consumer_timeout`](Self::consumer_timeout).
    pub fn shutdown_deadline(mut self, deadline: Duration) -> Self {
        self.shutdown_deadline = deadline;
        self
    }

    /// The AMQP heartbeat: a broker that goes silent (without closing) is detected
    /// within about two intervals, then the runtime reconnects. Default 20 s; a
    /// `heartbeat=` in the URL wins.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval;
        self
    }

    /// The longest wait between reconnect attempts (the backoff starts at 100 ms and
    /// doubles, with jitter), after a loss and at start-up. Default 30 s.
    pub fn reconnect_max_backoff(mut self, max: Duration) -> Self {
        self.reconnect_max = max;
        self
    }

    /// How long start-up may wait for an unreachable broker or database (connection
    /// refused or reset, no answer) before [`Runtime::run`] fails with
    /// [`Error::StartupTimeout`], naming which. Default: no limit.
    ///
    /// Without one, a consumer started during an outage waits: each attempt is
    /// logged with the delay to the next (the reconnect backoff, see
    /// [`reconnect_max_backoff`](Self::reconnect_max_backoff)) and reported as
    /// [`ConnectionEvent::Unreachable`]; `/readyz` answers 503 with the reason and
    /// `/healthz` 200 meanwhile; it starts consuming once both answer, and cancelling
    /// the shutdown token ends the wait (`run` returns `Ok`). Set one where an
    /// orchestrator should restart the process instead; zero is one attempt at each.
    /// The budget covers the database check and the first broker connection
    /// together, from the start of `run`; an attempt under way is cut at the
    /// deadline, except the first at each. What waiting cannot mend fails at once
    /// whatever this says: a refused login, a missing vhost or database, a URL that
    /// does not parse, idemq's tables missing.
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = Some(timeout);
        self
    }

    /// The broker's `consumer_timeout`: how long RabbitMQ lets a delivery stay
    /// unacknowledged before it closes the channel and redelivers everything on it
    /// (default 30 min, RabbitMQ's; on 3.10 a node setting in `rabbitmq.conf`,
    /// checked on each channel's tick, about once a minute). Give the value your
    /// broker has; `Duration::MAX` for one with the timeout turned off.
    ///
    /// `build` refuses settings that can hold a delivery longer, naming them:
    ///
    /// - **while running**: `database_retry_limit + 2 × handler_timeout + 1 min`.
    ///   During a database outage a delivery is retried until
    ///   [`database_retry_limit`](Self::database_retry_limit) after its receipt,
    ///   and the last retry may run its handler for a whole
    ///   [`handler_timeout`](Self::handler_timeout); before its first run it may
    ///   wait about one handler's time for its turn (a redelivered message runs
    ///   alone, once the transactions running when it came have finished; a lane's
    ///   delivery waits for its pipeline's batch). The minute covers the rest of an
    ///   attempt (pool checkout, BEGIN, dedup insert, COMMIT, ack).
    /// - **at shutdown**: `shutdown_deadline + 1 min`: a delivery taken just before
    ///   shutdown may run for the whole [`shutdown_deadline`](Self::shutdown_deadline).
    ///
    /// The defaults fit RabbitMQ's: 25 min + 2 × 60 s + 1 min = 28 min. What the
    /// check cannot know is how long your handlers really take: a batch's handlers
    /// run one after another, so handlers that take close to their timeout belong
    /// in small batches (`batch = N` on the handler, or
    /// [`batch_size`](Self::batch_size)), and a copy whose confirm waits on a
    /// broker resource alarm stays unacked meanwhile. If the broker closes a channel
    /// for a delivery timeout anyway, the runtime logs it as that (naming these
    /// settings), reconnects, and an effect that committed late is acked as a
    /// duplicate when its message comes back.
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// Calls `on_event` when the runtime connects, loses its connection, or the
    /// broker blocks or unblocks publishing, and for every start-up attempt that
    /// finds the broker or the database unreachable.
    /// Each call adds one (see [`observe`](Self::observe)).
    pub fn on_connection_event(
        mut self,
        on_event: impl Fn(&ConnectionEvent) + Send + Sync + 'static,
    ) -> Self {
        self.observers.push(Arc::new(OnConnection(on_event)));
        self
    }

    /// Calls `observer` for every settled delivery, on the delivery's task. Keep it
    /// quick. Each call adds one (see [`observe`](Self::observe)).
    pub fn observer(mut self, observer: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.observers.push(Arc::new(OnSettled(observer)));
        self
    }

    /// Adds a subscriber to everything the runtime reports (settled deliveries,
    /// database retries, connection events, batches, relay passes). Any number may
    /// be added; each hears every event, in the order they were added.
    pub fn observe(mut self, observer: impl Observe) -> Self {
        self.observers.push(Arc::new(observer));
        self
    }

    /// Whether the runtime runs an outbox [relay](crate::Relay) (default: yes). Turn
    /// it off when relays run on their own (`Relay::run`); the runtime then wakes
    /// them with a `NOTIFY` (at most one per 50 ms) after commits that wrote rows.
    pub fn relay(mut self, enabled: bool) -> Self {
        self.relay = enabled.then(|| {
            let mut settings = self.relay.unwrap_or_default();
            if let Some(interval) = self.relay_poll_interval {
                settings.poll_interval = interval;
            }
            if let Some(ttl) = self.reply_ttl {
                settings.set_reply_ttl(ttl);
            }
            settings
        });
        self
    }

    /// How often the runtime's relay looks for outbox rows it was not woken for
    /// (written by other processes or by [`enqueue`](crate::enqueue) in
    /// application code; default 1 s). With the relay off (`.relay(false)`, before
    /// or after) there is nothing to poll: `build` refuses the pair.
    pub fn relay_poll_interval(mut self, interval: std::time::Duration) -> Self {
        self.relay_poll_interval = Some(interval);
        if let Some(settings) = &mut self.relay {
            settings.poll_interval = interval;
        }
        self
    }

    /// How long the reply to a request may wait in the outbox before this runtime's
    /// relay deletes it unpublished (default 1 h; a request's own `expiration` ends it
    /// sooner). See [`RelayBuilder::reply_ttl`](crate::RelayBuilder::reply_ttl); relays
    /// run on their own take theirs. With the relay off (`.relay(false)`, before or
    /// after) this runtime publishes no replies: `build` refuses the pair.
    pub fn reply_ttl(mut self, ttl: Duration) -> Self {
        self.reply_ttl = Some(ttl);
        if let Some(settings) = &mut self.relay {
            settings.set_reply_ttl(ttl);
        }
        self
    }

    /// Each consumer's prefetch (unacked deliveries the broker sends ahead), instead
    /// of `concurrency × batch_size`. Lower it to bound memory and redelivery after a
    /// crash; below the batch size, batches cannot fill. 1..=65535.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = Some(prefetch);
        self
    }

    /// Deletes dedup rows older than `retention` in the background (off by
    /// default: the dedup table grows until something sweeps it). `build` refuses a
    /// retention not longer than the longest retry horizon plus the replay window
    /// ([`Retention::check`](crate::Retention::check)). Several processes may sweep:
    /// one at a time runs (a transaction-scoped advisory lock per batch).
    pub fn retention(mut self, retention: crate::store::retention::Retention) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Serves Prometheus metrics (`/metrics`) and health (`/healthz`, `/readyz`) on
    /// `addr` while the runtime runs (feature `metrics`; off by default, so several
    /// consumers can share a host). See the series in the crate's `metrics` docs.
    #[cfg(feature = "metrics")]
    pub fn http_addr(mut self, addr: std::net::SocketAddr) -> Self {
        self.http_addr = Some(addr);
        self
    }

    /// Installs a test-only [fault hook](crate::testing::fault) (feature `testing`).
    #[cfg(feature = "testing")]
    pub fn fault_hook(mut self, hook: crate::engine::fault::FaultHook) -> Self {
        self.fault_hook = Some(hook);
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting to fix, including a URL the environment
    /// gave twice (`DATABASE_URL` and `DATABASE_URL_FILE`); [`Error::ConfigIo`] for a
    /// URL in a file that cannot be read.
    pub fn build(self) -> Result<Runtime, Error> {
        self.env_urls.check()?;
        if self.consumers.is_empty() {
            return Err(Error::Config("no consumers: add one with `.consume(queue, handler)`".into()));
        }
        // Unreadable URLs fail every attempt alike: refused here, never waited on.
        crate::broker::brokers::Brokers::parse(&self.amqp_url)?;
        // The database URL too, its TLS settings and files included.
        crate::tls::postgres::Target::parse(&self.database_url)?;
        if self.concurrency == 0 || self.concurrency > usize::from(u16::MAX) {
            return Err(Error::Config(format!("concurrency must be 1..=65535, not {}", self.concurrency)));
        }
        if self.prefetch == Some(0) {
            return Err(Error::Config(
                "prefetch must be 1..=65535 (0 would be unlimited: the broker would send the whole queue)"
                    .into(),
            ));
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(Error::Config(format!(
                "batch_size must be 1..={MAX_BATCH_SIZE}, not {}: give `.batch_size(1)` for per-message mode, \
                 or more for group commit (default {DEFAULT_BATCH_SIZE})",
                self.batch_size
            )));
        }
        self.check_handler_queues()?;
        if let Some(retention) = &self.retention {
            retention.check(&self.retry_policies())?;
        }
        let holding = crate::broker::consumer_timeout::Holding {
            handler_timeout: self.handler_timeout,
            database_retry_limit: self.database_retry_limit,
            shutdown_deadline: self.shutdown_deadline,
        };
        crate::broker::consumer_timeout::check(holding, self.consumer_timeout)?;
        self.check_unique_queues()?;
        if let Some(namespace) = &self.namespace {
            if namespace.is_empty() || namespace.contains('/') {
                return Err(Error::Config(format!(
                    "namespace {namespace:?} must be non-empty and hold no '/' (it is joined to handler names with one)"
                )));
            }
        }
        self.check_handler_names()?;
        if self.relay.is_none() && self.relay_poll_interval.is_some() {
            return Err(Error::Config(
                "relay_poll_interval is set but the relay is off (`.relay(false)`): drop one of the two"
                    .into(),
            ));
        }
        if self.relay.is_none() && self.reply_ttl.is_some() {
            return Err(Error::Config(
                "reply_ttl is set but the relay is off (`.relay(false)`): the relays that run on their own \
                 take theirs (RelayBuilder::reply_ttl); drop one of the two"
                    .into(),
            ));
        }
        Ok(Runtime { builder: self, stats: Arc::default() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::context::{Context, HandlerOutput};
    use crate::handler::key::{Key, KeyError, Metadata};
    use crate::handler::{BoxFuture, HandlerError};
    use diesel_async::AsyncPgConnection;

    /// A handler that does nothing (the checks read only its options).
    struct Noop;

    impl Handler for Noop {
        type Message = serde_json::Value;

        fn name(&self) -> &'static str {
            "noop"
        }

        fn key_path(&self) -> &'static str {
            "id"
        }

        fn key(&self, _: &Self::Message, metadata: &Metadata<'_>) -> Result<Key, KeyError> {
            Ok(metadata.hash_key())
        }

        fn handle<'a>(
            &'a self,
            _: &'a mut AsyncPgConnection,
            _: &'a mut Context,
            _: Self::Message,
        ) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>> {
            Box::pin(async { Ok(HandlerOutput::none()) })
        }
    }

    /// A builder that passes every check but the one under test.
    fn builder() -> RuntimeBuilder {
        RuntimeBuilder::new()
            .amqp_url("amqp://guest:secret@127.0.0.1:5672/%2f")
            .database_url("postgres://postgres:secret@127.0.0.1:5432/idemq")
            .consume("payments", Noop)
    }

    fn config_error(builder: RuntimeBuilder) -> String {
        match builder.build() {
            Err(Error::Config(message)) => message,
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn the_test_builder_builds() {
        builder().build().expect("a valid configuration");
    }

    #[test]
    fn a_batch_size_of_zero_is_refused_with_the_fix() {
        let message = config_error(builder().batch_size(0));
        assert!(message.contains("not 0") && message.contains(".batch_size(1)"), "{message}");
    }

    #[test]
    fn a_reply_ttl_with_the_relay_off_is_refused_either_way_round() {
        for builder in [
            builder().relay(false).reply_ttl(Duration::from_secs(60)),
            builder().reply_ttl(Duration::from_secs(60)).relay(false),
        ] {
            let message = builder.build().expect_err("refused").to_string();
            assert!(message.contains("reply_ttl") && message.contains("drop one"), "{message}");
        }
        builder().reply_ttl(Duration::from_secs(60)).build().expect("the TTL alone");
        let kept = builder().relay(false).reply_ttl(Duration::from_secs(60)).relay(true);
        kept.build().expect("set while off, kept by relay(true)");
    }

    #[test]
    fn a_relay_poll_interval_with_the_relay_off_is_refused_either_way_round() {
        for builder in [
            builder().relay(false).relay_poll_interval(Duration::from_millis(50)),
            builder().relay_poll_interval(Duration::from_millis(50)).relay(false),
        ] {
            let message = config_error(builder);
            assert!(message.contains("relay_poll_interval") && message.contains("drop one"), "{message}");
        }
        builder().relay(false).build().expect("the relay off alone");
        builder().relay_poll_interval(Duration::from_millis(50)).build().expect("the interval alone");
    }

    #[test]
    fn a_poll_interval_survives_turning_the_relay_off_and_on_again() {
        let builder = builder().relay(false).relay_poll_interval(Duration::from_millis(50)).relay(true);
        assert_eq!(builder.relay.map(|settings| settings.poll_interval), Some(Duration::from_millis(50)));
    }

    #[test]
    fn debug_redacts_the_urls() {
        let printed = format!("{:?}", builder());
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("payments"), "{printed}");
    }
}
