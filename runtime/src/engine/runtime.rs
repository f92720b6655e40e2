//! The runtime: connections, topology, consumers, concurrency and shutdown.
//!
//! Two AMQP connections per session (consuming, publishing); one channel per consumer
//! (with its own `basic_qos`, never global) plus one publisher channel in confirm
//! mode for copies. Deliveries run in batches, at most `concurrency` transactions at
//! once, which is also the pool size.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::backoff::Backoff;
use crate::base::observe::ConnectionEvent;
use crate::base::observe::{Observe, Observers, OnConnection, OnSettled};
use crate::base::outcome::{Settled, Stats};
use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::broker::topology::Topology;
use crate::config::EnvUrls;
use crate::engine::delivery::{BatchLimits, Fatal, Shared};
use crate::engine::session::{self, ConsumerSpec, SessionContext, SessionEnd};
use crate::engine::startup::Startup;
use crate::error::{redact, Dependency, Error};
use crate::handler::prepare::{ErasedHandler, InputLimits};
use crate::handler::Handler;
use crate::store::db::{self, SessionLimits};

pub use crate::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};

/// The default [`RuntimeBuilder::concurrency`].
pub const DEFAULT_CONCURRENCY: usize = 16;
/// The default [`RuntimeBuilder::batch_size`].
pub const DEFAULT_BATCH_SIZE: usize = 64;

/// A callback told of every settled delivery (metrics, tests, progress).
pub type Observer = Arc<dyn Fn(&Settled) + Send + Sync>;

/// Configures a [`Runtime`]. Start with [`Runtime::builder`].
#[must_use = "a builder does nothing until `.build()` and `Runtime::run`"]
pub struct RuntimeBuilder {
    amqp_url: String,
    database_url: String,
    /// A problem reading `AMQP_URL(_FILE)` or `DATABASE_URL(_FILE)`, for `build()`.
    env_urls: EnvUrls,
    topology: Topology,
    consumers: Vec<(String, Arc<dyn ErasedHandler>, Option<RetryPolicy>)>,
    concurrency: usize,
    batch_size: usize,
    linger: Duration,
    retry: RetryPolicy,
    handler_timeout: Duration,
    database_retry_limit: Duration,
    max_body_bytes: usize,
    on_conflict: OnConflict,
    namespace: Option<String>,
    shutdown_deadline: Duration,
    heartbeat: Duration,
    reconnect_max: Duration,
    startup_timeout: Option<Duration>,
    consumer_timeout: Duration,
    observers: Observers,
    relay: Option<crate::engine::relay::Settings>,
    retention: Option<crate::store::retention::Retention>,
    prefetch: Option<u16>,
    #[cfg(feature = "metrics")]
    http_addr: Option<std::net::SocketAddr>,
    #[cfg(feature = "fault-injection")]
    fault_hook: Option<crate::engine::fault::FaultHook>,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("amqp_url", &redact(&self.amqp_url))
            .field("database_url", &redact(&self.database_url))
            .field("consumers", &self.consumers.iter().map(|(q, h, _)| (q, h.name())).collect::<Vec<_>>())
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl RuntimeBuilder {
    fn new() -> Self {
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
            retention: None,
            prefetch: None,
            #[cfg(feature = "metrics")]
            http_addr: None,
            #[cfg(feature = "fault-injection")]
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
        self.consumers.push((queue.into(), Arc::new(Arc::new(handler)), None));
        self
    }

    /// Consumes the queue the handler names (`#[idempotent_handler(queue = "...")]`).
    /// A handler that names none is refused by [`build`](Self::build).
    pub fn handler<H: Handler>(mut self, handler: H) -> Self {
        let queue = handler.queue().map(str::to_owned).unwrap_or_default();
        self.consumers.push((queue, Arc::new(Arc::new(handler)), None));
        self
    }

    /// Like [`consume`](Self::consume), with this handler's own retry policy.
    pub fn consume_with<H: Handler>(
        mut self,
        queue: impl Into<String>,
        handler: H,
        retry: RetryPolicy,
    ) -> Self {
        self.consumers.push((queue.into(), Arc::new(Arc::new(handler)), Some(retry)));
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
        self.relay = enabled.then(|| self.relay.unwrap_or_default());
        self
    }

    /// How often the runtime's relay looks for outbox rows it was not woken for
    /// (written by other processes or by [`enqueue`](crate::enqueue) in
    /// application code; default 1 s).
    pub fn relay_poll_interval(mut self, interval: std::time::Duration) -> Self {
        if let Some(settings) = &mut self.relay {
            settings.poll_interval = interval;
        }
        self
    }

    /// How long the reply to a request may wait in the outbox before this runtime's
    /// relay deletes it unpublished (default 1 h; a request's own `expiration` ends it
    /// sooner). See [`RelayBuilder::reply_ttl`](crate::RelayBuilder::reply_ttl); relays
    /// run on their own take theirs.
    pub fn reply_ttl(mut self, ttl: Duration) -> Self {
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

    /// Installs a test-only [fault hook](crate::engine::fault).
    #[cfg(feature = "fault-injection")]
    pub fn fault_hook(mut self, hook: crate::engine::fault::FaultHook) -> Self {
        self.fault_hook = Some(hook);
        self
    }

    /// The broker URL this builder holds.
    #[cfg(feature = "cli")]
    pub(crate) fn configured_amqp_url(&self) -> &str {
        &self.amqp_url
    }

    /// The database URL this builder holds.
    #[cfg(feature = "cli")]
    pub(crate) fn configured_database_url(&self) -> &str {
        &self.database_url
    }

    /// A start-up wait with this builder's timeout and backoff, for what the CLI
    /// does before `run` (its set-up and migrations need the database).
    #[cfg(feature = "cli")]
    pub(crate) fn startup(&self) -> Startup {
        Startup::new(self.startup_timeout, self.reconnect_max, Observers::default())
    }

    /// Keeps only the consumers of `queues`; a queue nobody consumes is an error.
    #[cfg(feature = "cli")]
    pub(crate) fn only_queues(mut self, queues: &[String]) -> Result<Self, Error> {
        for queue in queues {
            if !self
                .consumers
                .iter()
                .any(|(q, handler, _)| q == queue || handler.queue() == Some(queue.as_str()))
            {
                let known: Vec<&str> = self.consumers.iter().map(|(q, _, _)| q.as_str()).collect();
                return Err(Error::Config(format!(
                    "--queue {queue}: no handler consumes it; the consumed queues are {}",
                    known.join(", ")
                )));
            }
        }
        self.consumers.retain(|(queue, _, _)| queues.contains(queue));
        Ok(self)
    }

    /// Every consumer's retry policy, as `run` uses it.
    pub(crate) fn retry_policies(&self) -> Vec<RetryPolicy> {
        self.consumers
            .iter()
            .map(|(_, handler, retry)| effective_retry(retry.clone(), &**handler, &self.retry))
            .collect()
    }

    /// Every queue the runtime would declare (the topology's, their dead-letter
    /// queues, the consumers' wait queues), with what it is.
    #[cfg(feature = "cli")]
    pub(crate) fn declarations(&self) -> Vec<(String, String)> {
        let mut plan = Vec::new();
        for queue in self.topology.queues() {
            plan.push((queue.name().to_owned(), queue.describe()));
            plan.push((
                queue.dead_letter_name().to_owned(),
                "its dead-letter queue (no delivery limit)".to_owned(),
            ));
        }
        for ((queue, _, _), retry) in self.consumers.iter().zip(self.retry_policies()) {
            for (name, delay) in retry.wait_queues(queue) {
                plan.push((name, format!("retries of {queue} after {delay:?}")));
            }
        }
        plan
    }

    /// The exchanges the topology declares.
    #[cfg(feature = "cli")]
    pub(crate) fn exchange_names(&self) -> Vec<String> {
        self.topology.exchange_names().map(str::to_owned).collect()
    }

    /// Declares what `run` declares — the topology and the consumers' wait queues —
    /// through the runtime's own declaration, strictly: a queue that is unavailable
    /// (its node down) is an error here, not skipped.
    #[cfg(feature = "cli")]
    pub(crate) async fn declare_all(&self, connection: &lapin::Connection) -> Result<(), Error> {
        let declared: Vec<_> =
            self.consumers.iter().map(|(queue, _, _)| self.topology.queue_or_default(queue)).collect();
        let waits: Vec<_> = self
            .consumers
            .iter()
            .zip(self.retry_policies())
            .zip(&declared)
            .flat_map(|(((queue, _, _), retry), declared)| {
                retry.wait_queues(queue).into_iter().map(move |(name, delay)| (declared, name, delay))
            })
            .collect();
        self.topology.declare_available(connection, &waits, |_| true).await
    }

    /// Every consumed or declared queue with its dead-letter queue.
    #[cfg(feature = "cli")]
    pub(crate) fn consumed_queues(&self) -> Vec<(String, String)> {
        let mut queues: Vec<(String, String)> = self
            .topology
            .queues()
            .iter()
            .map(|queue| (queue.name().to_owned(), queue.dead_letter_name().to_owned()))
            .collect();
        for (queue, _, _) in &self.consumers {
            if !queues.iter().any(|(name, _)| name == queue) {
                let declared = self.topology.queue_or_default(queue);
                queues.push((queue.clone(), declared.dead_letter_name().to_owned()));
            }
        }
        queues
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting to fix, including a URL the environment
    /// gave twice (`DATABASE_URL` and `DATABASE_URL_FILE`) or in an unreadable file.
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
                "batch_size must be 1..={MAX_BATCH_SIZE}, not {} (1 is per-message mode)",
                self.batch_size
            )));
        }
        for (queue, handler, _) in &self.consumers {
            match handler.queue() {
                None if queue.is_empty() => {
                    return Err(Error::Config(format!(
                        "handler `{}` names no queue: give it one with #[idempotent_handler(queue = \"...\")], \
                         or register it with `.consume(queue, handler)`",
                        handler.type_path()
                    )));
                }
                Some(own) if own != queue => {
                    return Err(Error::Config(format!(
                        "handler `{}` consumes queue '{own}' (its `queue = ...`), but is registered for '{queue}'; \
                         register it with `.handler(h)`, or drop its `queue` option",
                        handler.type_path()
                    )));
                }
                _ => {}
            }
        }
        if let Some(retention) = &self.retention {
            retention.check(&self.retry_policies())?;
        }
        let holding = crate::broker::consumer_timeout::Holding {
            handler_timeout: self.handler_timeout,
            database_retry_limit: self.database_retry_limit,
            shutdown_deadline: self.shutdown_deadline,
        };
        crate::broker::consumer_timeout::check(holding, self.consumer_timeout)?;
        let mut seen = std::collections::HashSet::new();
        for (queue, _, _) in &self.consumers {
            if !seen.insert(queue.as_str()) {
                return Err(Error::Config(format!(
                    "queue '{queue}' has two consumers; give each queue one handler"
                )));
            }
        }
        if let Some(namespace) = &self.namespace {
            if namespace.is_empty() || namespace.contains('/') {
                return Err(Error::Config(format!(
                    "namespace {namespace:?} must be non-empty and hold no '/' (it is joined to handler names with one)"
                )));
            }
        }
        // The name scopes dedup rows: two handlers sharing one would share rows, and
        // the second's messages would be acked as duplicates without ever running.
        // The same handler on two queues is one handler (its rows are shared on
        // purpose: a key applied from either queue is applied).
        let mut names: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        for (_, handler, _) in &self.consumers {
            let (name, path) = (handler.name(), handler.type_path());
            if name.is_empty() || name.contains('/') {
                return Err(Error::Config(format!(
                    "handler `{path}` is named {name:?}; a handler name must be non-empty and hold no '/': \
                     set another with #[idempotent_handler(name = \"...\")]"
                )));
            }
            match names.insert(name, path) {
                Some(other) if other != path => {
                    return Err(Error::Config(format!(
                        "handlers `{other}` and `{path}` are both named `{name}`, so they would share one dedup \
                         namespace and one's messages would be acked as duplicates of the other's; give each a \
                         stable name of its own with #[idempotent_handler(name = \"...\")]"
                    )));
                }
                _ => {}
            }
        }
        Ok(Runtime { builder: self, stats: Arc::default() })
    }
}

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
    /// local defaults ([`DEFAULT_AMQP_URL`], [`DEFAULT_DATABASE_URL`]).
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::new()
    }

    /// `spent` of the startup timeout went before `run` (the CLI's wait for the
    /// database before its migrations): `run` waits only for what is left.
    #[cfg(feature = "cli")]
    pub(crate) fn startup_spent(&mut self, spent: Duration) {
        if let Some(timeout) = &mut self.builder.startup_timeout {
            *timeout = timeout.saturating_sub(spent);
        }
    }

    /// The outcome counters, live while the runtime runs.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// Connects, declares the topology, consumes until `shutdown` is cancelled, then
    /// drains: consumers are cancelled, in-flight deliveries get the shutdown deadline
    /// to finish (and are acked if they commit), the rest are cut off (rolled back)
    /// and return to the queue; channels and connections are closed cleanly.
    ///
    /// A connection or channel lost while running (broker restart, closed
    /// connection, missed heartbeats, a consumer cancelled by the broker) is not an
    /// error: the runtime reconnects with backoff, declares the topology again and
    /// resumes every consumer. Deliveries that were in flight on the lost channel
    /// cannot be acked any more; the broker redelivers them and their dedup rows make
    /// that harmless.
    ///
    /// Starting during an outage is waited out: an unreachable database or broker
    /// (refused, reset, silent) is tried again with the reconnect backoff, each
    /// attempt logged and reported as [`ConnectionEvent::Unreachable`], until it
    /// answers, `shutdown` is cancelled (then `Ok`), or the
    /// [startup timeout](RuntimeBuilder::startup_timeout) is spent.
    ///
    /// # Errors
    /// At start-up, what waiting cannot mend (a refused login, a missing vhost,
    /// database or queue, a topology that differs, idemq's tables missing) and
    /// [`Error::StartupTimeout`]; while running, a topology mismatch found on a
    /// reconnect and faults no retry fixes (idemq's tables dropped).
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future drops the connections, so the broker
    /// requeues every unacked delivery (safe, but not graceful). Cancel `shutdown`
    /// instead.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let b = self.builder;
        // `build` refused a retention too short for the retry policies; the sweep takes
        // only what that check lets through, so it is made again (before anything starts).
        let retention = b.retention.map(|retention| retention.check(&b.retry_policies())).transpose()?;
        #[cfg(feature = "metrics")]
        let metrics = b.http_addr.map(|addr| {
            let queues: Vec<String> = b.consumers.iter().map(|(queue, _, _)| queue.clone()).collect();
            (addr, crate::engine::metrics::Metrics::new(&queues))
        });
        // The built-in stats are a subscriber like any other, heard first.
        let mut observers = Observers::default();
        observers.push(Arc::clone(&self.stats) as Arc<dyn Observe>);
        for observer in b.observers.0.iter() {
            observers.push(Arc::clone(observer));
        }
        #[cfg(feature = "metrics")]
        if let Some((_, metrics)) = &metrics {
            observers.push(Arc::clone(metrics) as Arc<dyn Observe>);
        }
        // Served from the start: `/healthz` answers while start-up waits, and
        // `/readyz` says what for. Stopped when `serving` is dropped.
        #[cfg(feature = "metrics")]
        let serving = match &metrics {
            Some((addr, metrics)) => Some(crate::engine::metrics::serve(*addr, Arc::clone(metrics))?),
            None => None,
        };

        let mut startup = Startup::new(b.startup_timeout, b.reconnect_max, observers.clone());
        let limits = SessionLimits::for_handler_timeout(b.handler_timeout);
        let pool = db::build_pool(&b.database_url, b.concurrency, limits).map_err(|err| {
            Error::DatabaseConnect { url: redact(&b.database_url), message: err.to_string() }
        })?;
        if !startup.database(&pool, &b.database_url, &shutdown).await? {
            return Ok(());
        }

        let relay_wake = b.relay.map(|_| Arc::new(tokio::sync::Notify::new()));
        let shared = Arc::new(Shared {
            pool,
            cancel_tls: crate::tls::postgres::Target::parse(&b.database_url)?.tls,
            limits: InputLimits { max_body_bytes: b.max_body_bytes },
            handler_timeout: b.handler_timeout,
            statement_deadline: limits.client_deadline(),
            database_retry_limit: b.database_retry_limit,
            observers,
            outbox: crate::engine::relay::OutboxSignal::new(relay_wake.clone()),
            turns: tokio::sync::RwLock::new(()),
            // Consumers stop on the caller's signal, or when a delivery meets a fault no
            // retry can fix (then `run` returns that error after draining).
            fatal: Fatal::new(shutdown.child_token()),
            #[cfg(feature = "fault-injection")]
            fault_hook: b.fault_hook.clone(),
        });
        let stop = shared.fatal.stop.clone();
        // The relay outlives the consumers' drain (it publishes what they commit) and
        // stops after it; without one, relays elsewhere are notified.
        let relay_stop = CancellationToken::new();
        let relay = match (b.relay, relay_wake) {
            (Some(settings), Some(wake)) => {
                let worker = crate::engine::relay::Worker {
                    pool: crate::engine::relay::relay_pool(&b.database_url)?,
                    brokers: crate::broker::brokers::Brokers::parse(&b.amqp_url)?,
                    database_url: b.database_url.clone(),
                    settings,
                    wake,
                    observers: shared.observers.clone(),
                };
                tokio::spawn(worker.run(relay_stop.clone()))
            }
            _ => {
                let shared = Arc::clone(&shared);
                let stop = relay_stop.clone();
                tokio::spawn(async move { shared.outbox.notify_elsewhere(shared.pool.clone(), stop).await })
            }
        };
        #[cfg(feature = "metrics")]
        if let Some((_, metrics)) = &metrics {
            let (metrics, pool, stop) = (Arc::clone(metrics), shared.pool.clone(), stop.clone());
            tokio::spawn(async move {
                // The outbox backlog, and a sign of life from the database for /readyz.
                loop {
                    let backlog = async {
                        let mut conn = pool.get().await.ok()?;
                        db::outbox_backlog(&mut conn).await.ok()
                    };
                    let backlog = tokio::time::timeout(Duration::from_secs(5), backlog).await.ok().flatten();
                    metrics.set_backlog(backlog);
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(5)) => {}
                        () = stop.cancelled() => return,
                    }
                }
            });
        }
        let sweeper = retention.map(|retention| {
            let (shared, stop) = (Arc::clone(&shared), stop.clone());
            tokio::spawn(async move { sweep_every(&shared, retention, stop).await })
        });
        let consumers = b
            .consumers
            .into_iter()
            .map(|(queue, handler, retry)| {
                // The handler's own options (`batch = N`, `retry(..)`, `on_conflict`)
                // override the runtime's; `consume_with`'s policy overrides both.
                let size = handler.batch_size().map_or(b.batch_size, |size| size.clamp(1, b.batch_size));
                ConsumerSpec {
                    declared: b.topology.queue_or_default(&queue),
                    retry: effective_retry(retry, &*handler, &b.retry),
                    on_conflict: handler.on_conflict().unwrap_or(b.on_conflict),
                    batch: BatchLimits { size, linger: b.linger, pipelines: b.concurrency },
                    prefetch: b.prefetch.unwrap_or_else(|| {
                        u16::try_from(b.concurrency.saturating_mul(size)).unwrap_or(u16::MAX)
                    }),
                    scope: dedup_scope(b.namespace.as_deref(), handler.name()),
                    queue,
                    handler,
                }
            })
            .collect();
        let ctx = SessionContext {
            brokers: crate::broker::brokers::Brokers::parse(&b.amqp_url)?
                .map(|url| with_heartbeat(url, b.heartbeat)),
            topology: b.topology,
            consumers,
            shared,
            permits: Arc::new(Semaphore::new(b.concurrency)),
            tracker: TaskTracker::new(),
            hard_stop: CancellationToken::new(),
        };

        // Numbered per session that connected: failed attempts keep the number, so
        // session 1 is start-up, when an unreachable broker is waited for as above.
        let mut session = 1;
        let mut backoff = Backoff::new(Duration::from_millis(100), b.reconnect_max);
        let (result, connections) = loop {
            let starting = session == 1;
            if starting {
                if let Err(err) = startup.check_deadline(Dependency::Broker, &b.amqp_url) {
                    break (Err(err), None);
                }
            }
            let cut_at = if starting { startup.cut_at(Dependency::Broker) } else { None };
            match session::run(&ctx, session, &stop, cut_at).await {
                SessionEnd::Shutdown(connections) => break (Ok(()), connections),
                SessionEnd::Fatal(err) => break (Err(err), None),
                SessionEnd::Lost { reason, connected: false } if starting => {
                    match startup.wait(Dependency::Broker, &b.amqp_url, &reason, &stop).await {
                        Ok(true) => {}
                        Ok(false) => break (Ok(()), None),
                        Err(err) => break (Err(err), None),
                    }
                }
                SessionEnd::Lost { reason, connected } => {
                    if connected {
                        // Logged once per loss, not once per attempt.
                        tracing::warn!(session, %reason, "connection to the broker lost; reconnecting");
                        ctx.notify(&ConnectionEvent::Lost { session, reason });
                        backoff = Backoff::new(Duration::from_millis(100), b.reconnect_max);
                        session += 1;
                    } else {
                        tracing::debug!(session, %reason, attempt = backoff.attempts, "reconnect attempt failed");
                    }
                    tokio::select! {
                        () = stop.cancelled() => break (Ok(()), None),
                        () = backoff.wait() => {}
                    }
                }
            }
        };

        // Whether a session ever connected and consumed.
        let started = session > 1 || connections.is_some();
        ctx.tracker.close();
        if tokio::time::timeout(b.shutdown_deadline, ctx.tracker.wait()).await.is_err() {
            tracing::warn!(deadline = ?b.shutdown_deadline, "shutdown deadline passed; cutting off in-flight deliveries, which return to the queue");
            ctx.hard_stop.cancel();
            ctx.tracker.wait().await;
        }
        if let Some(connections) = connections {
            connections.close("shutdown").await;
        }
        if let Some(sweeper) = sweeper {
            sweeper.abort();
        }
        #[cfg(feature = "metrics")]
        drop(serving);
        relay_stop.cancel();
        if !started {
            // Stopped (or failed) before ever consuming: nothing was committed here
            // for the relay to publish, and it may be in the middle of an attempt at
            // the unreachable broker that would hold the shutdown for seconds. Its
            // rows, if any, wait in the outbox for the next relay.
            relay.abort();
        }
        match relay.await {
            Err(err) if !err.is_cancelled() => tracing::error!(error = %err, "the outbox relay task failed"),
            _ => {}
        }
        match ctx.shared.fatal.take() {
            Some(fatal) => Err(fatal),
            None => result,
        }
    }
}

/// Sweeps the dedup table every interval until `stop` (a sweep cut off by `stop`
/// loses nothing: each batch is its own transaction).
async fn sweep_every(
    shared: &Shared,
    retention: crate::store::retention::CheckedRetention,
    stop: CancellationToken,
) {
    loop {
        let swept = async {
            let mut conn = shared.pool.get().await.map_err(|err| err.to_string())?;
            crate::store::retention::sweep(&mut conn, &retention).await.map_err(|err| err.to_string())
        };
        tokio::select! {
            result = swept => match result {
                Ok(sweep) => {
                    tracing::info!(?sweep, "retention sweep");
                    shared.observers.swept(&sweep);
                }
                Err(error) => tracing::warn!(error = %redact(&error), "the retention sweep failed; trying again later"),
            },
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(retention.retention().interval()) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// A consumer's retry policy: `consume_with`'s, else the handler's `retry(..)`, else
/// the runtime's.
fn effective_retry(
    explicit: Option<RetryPolicy>,
    handler: &dyn ErasedHandler,
    runtime: &RetryPolicy,
) -> RetryPolicy {
    explicit.or_else(|| handler.retry()).unwrap_or_else(|| runtime.clone())
}

/// The largest [`RuntimeBuilder::batch_size`]: a batch's dedup rows go in one
/// statement, and a transaction that large already holds its locks long enough.
const MAX_BATCH_SIZE: usize = 4096;

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

/// The process's shutdown signals, as tokens: the first SIGINT or SIGTERM cancels
/// `graceful` (drain, then exit), a second one `immediate` (exit now: safe, the
/// broker redelivers whatever was unacked). Nothing here exits the process — that is
/// the binary's decision (`idemq::cli` returns exit status 130 on `immediate`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShutdownSignals {
    /// Cancelled by the first signal: give it to [`Runtime::run`].
    pub graceful: CancellationToken,
    /// Cancelled by the second signal.
    pub immediate: CancellationToken,
}

/// Listens for SIGINT and SIGTERM; see [`ShutdownSignals`]. Must be called inside a
/// Tokio runtime.
pub fn shutdown_signals() -> ShutdownSignals {
    let signals = ShutdownSignals { graceful: CancellationToken::new(), immediate: CancellationToken::new() };
    let (graceful, immediate) = (signals.graceful.clone(), signals.immediate.clone());
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: finishing in-flight deliveries (signal again to exit now)");
        graceful.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting now; unacked deliveries will be redelivered");
        immediate.cancel();
    });
    signals
}

/// A token cancelled by the first SIGINT or SIGTERM; a second signal exits the
/// process at once with status 130 (safe: the broker redelivers whatever was
/// unacked). A convenience for small binaries; [`shutdown_signals`] leaves the exit
/// to the caller.
///
/// Must be called inside a Tokio runtime.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down: finishing in-flight deliveries (signal again to exit now)");
        cancel.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting now; unacked deliveries will be redelivered");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
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
