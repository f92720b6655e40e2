//! [`RuntimeBuilder`]: the settings, each handler's registration, and the checks
//! `build` makes before anything connects.

use std::sync::Arc;
use std::time::Duration;

use super::{DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY};
use crate::base::observe::{Observe, Observers};
use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::broker::partitions::Partitions;
use crate::broker::topology::Topology;
use crate::config::{EnvUrls, DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use crate::engine::flow::KillSwitch;
use crate::error::redact;
use crate::handler::prepare::{self, ErasedHandler};
use crate::handler::Handler;
use crate::store::replication::ReplicationCheck;

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

    /// Its batch size: the handler's `batch = N` within the runtime's, else the
    /// runtime's.
    pub(crate) fn batch_size(&self, runtime: usize) -> usize {
        self.handler.batch_size().map_or(runtime, |size| size.clamp(1, runtime))
    }
}

// Each setter is listed in `settings.rs` beside this file, with its `run` flag,
// environment variable and TOML key, and has a row in the Configuration table (`docs/operating.md`)
// table: tests there fail until both are done.

/// Configures a [`Runtime`](super::Runtime). Start with [`Runtime::builder`](super::Runtime::builder).
///
/// Each setter takes the builder and returns it; nothing is checked until
/// [`build`](Self::build), which checks the whole (a runtime's settings depend on
/// each other and on its handlers) and refuses what cannot work with
/// [`Error::Config`](crate::Error::Config), naming the fix. A setting is never
/// silently dropped. [`RelayBuilder::build`](crate::outbox::RelayBuilder::build)
/// does the same for a relay of its own.
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
    pub(super) kill_switch: Option<KillSwitch>,
    /// `handler_kill_switch`'s, by handler name: over the runtime's.
    pub(super) handler_kill_switches: Vec<(String, Option<KillSwitch>)>,
    /// `rate_limit`'s, by handler name.
    pub(super) rate_limits: Vec<(String, u32)>,
    /// `handler_concurrency`'s, by handler name.
    pub(super) handler_concurrency: Vec<(String, usize)>,
    pub(super) handler_timeout: Duration,
    pub(super) database_retry_limit: Duration,
    pub(super) max_body_bytes: usize,
    pub(super) on_conflict: OnConflict,
    pub(super) replication_check: ReplicationCheck,
    pub(super) namespace: Option<String>,
    pub(super) shutdown_deadline: Duration,
    pub(super) heartbeat: Duration,
    pub(super) reconnect_max: Duration,
    pub(super) startup_timeout: Option<Duration>,
    pub(super) release_streams_after: Duration,
    pub(super) consumer_timeout: Duration,
    pub(super) observers: Observers,
    pub(super) relay: Option<crate::engine::relay::Settings>,
    /// Set by `relay_poll_interval`: `build` refuses it with the relay off.
    pub(super) relay_poll_interval: Option<Duration>,
    /// Set by `reply_ttl`: `build` refuses it with the relay off.
    pub(super) reply_ttl: Option<Duration>,
    pub(super) retention: Option<crate::store::retention::Retention>,
    pub(super) prefetch: Option<u16>,
    /// Set by `allow_unpatched_amqp_parser` (`IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER` too,
    /// read by `build`).
    pub(super) allow_unpatched_amqp_parser: bool,
    #[cfg(feature = "metrics")]
    pub(super) http_addr: Option<std::net::SocketAddr>,
    /// Pages served beside the metrics (the CLI's console, through `__private::sibling`).
    #[cfg(feature = "metrics")]
    pub(super) pages: Option<crate::engine::pages::Mount>,
    /// The test kit's fault hook (`idemq-testing`, through `__private::sibling`).
    pub(super) fault_hook: Option<crate::engine::hook::FaultHook>,
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
    /// The default [`concurrency`](Self::concurrency): 16.
    pub const DEFAULT_CONCURRENCY: usize = DEFAULT_CONCURRENCY;
    /// The default [`batch_size`](Self::batch_size): 256.
    pub const DEFAULT_BATCH_SIZE: usize = DEFAULT_BATCH_SIZE;

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
            kill_switch: None,
            handler_kill_switches: Vec::new(),
            rate_limits: Vec::new(),
            handler_concurrency: Vec::new(),
            handler_timeout: Duration::from_secs(60),
            database_retry_limit: Duration::from_secs(25 * 60),
            max_body_bytes: 1024 * 1024,
            on_conflict: OnConflict::default(),
            replication_check: ReplicationCheck::default(),
            namespace: None,
            shutdown_deadline: Duration::from_secs(10),
            heartbeat: Duration::from_secs(20),
            reconnect_max: Duration::from_secs(30),
            startup_timeout: None,
            release_streams_after: crate::engine::stream::DEFAULT_RELEASE_AFTER,
            consumer_timeout: crate::broker::consumer_timeout::DEFAULT,
            observers: Observers::default(),
            relay: Some(crate::engine::relay::Settings::default()),
            relay_poll_interval: None,
            reply_ttl: None,
            retention: None,
            prefetch: None,
            allow_unpatched_amqp_parser: false,
            #[cfg(feature = "metrics")]
            http_addr: None,
            #[cfg(feature = "metrics")]
            pages: None,
            fault_hook: None,
        }
    }

    /// The broker, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f` (default: `AMQP_URL`, or
    /// the file `AMQP_URL_FILE` names, see [`env_url`](crate::connect::env_url)), or several
    /// nodes separated by commas: the runtime connects to one that answers and, after
    /// losing it, tries the next first (a comma in a password is `%2C`).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.amqp_url = url.into();
        self.env_urls.overridden("AMQP_URL");
        self
    }

    /// The database holding the dedup table and the handlers' data (default:
    /// `DATABASE_URL`, or the file `DATABASE_URL_FILE` names, see
    /// [`env_url`](crate::connect::env_url)).
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

    /// Consumes `queue` with `handler`. A queue declared in the
    /// [topology](Self::topology) brings its dead-letter queue and delivery limit.
    ///
    /// Which queues the topology must name: **a topology that names any queue must
    /// name every consumed queue** — [`build`](Self::build) refuses a consumed queue
    /// it does not name (it would not exist, and `run` would fail with the broker's
    /// NOT_FOUND after declaring its retry queues). Name a queue declared elsewhere on
    /// purpose with [`Queue::declared_elsewhere`](crate::Queue::declared_elsewhere). A
    /// builder whose topology names no queue at all (none given, or only exchanges)
    /// consumes queues declared elsewhere: they must already exist, each with a
    /// dead-letter queue named `<queue>.dlq`.
    pub fn consume<H: Handler>(mut self, queue: impl Into<String>, handler: H) -> Self {
        self.consumers.push(Registration::new(queue.into(), handler, None));
        self
    }

    /// Consumes every stream of `partitions` with `handler`, sharing them with the
    /// other processes that do (see [`Partitions`](crate::Partitions)): each stream
    /// has its own offset and owner, and a process owns at most its fair share.
    pub fn consume_partitions<H: Handler>(mut self, partitions: &Partitions, handler: H) -> Self {
        let handler = prepare::erase(handler);
        for stream in partitions.streams() {
            self.consumers.push(Registration { queue: stream, handler: Arc::clone(&handler), retry: None });
        }
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
    /// [`linger`](Self::linger). A batch also takes no more than its handler runs in
    /// about 100 ms at its recent pace (a handler waiting 50 ms on an API runs in
    /// batches of 2, side by side; 16 at most until the first run is timed), so a
    /// slow handler never holds a transaction and its locks for long. `1` is
    /// per-message mode: one transaction per delivery. Guarantees are the same in
    /// both modes: a failing, panicking or timed-out handler, a lock wait or
    /// deadlock, a refused COMMIT never sink a batch's other deliveries (the batch is
    /// re-run without it, or split), and only a delivery run alone is ever charged an
    /// attempt. Default 256 (measured: see the guide's *Performance*, "Draining a
    /// backlog").
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

    /// Every handler's kill switch (default: none): when a handler's attempts keep
    /// failing — a dependency of its own is down — its queue is paused instead of its
    /// messages spending their retries and filling the dead-letter queue; after a
    /// pause one message is tried, and consuming resumes once one applies. See
    /// [`KillSwitch`] for the defaults (MassTransit's) and what counts as a failure.
    /// It applies to each handler with a queue of its own; not to streams, nor to a
    /// queue several handlers share (see [`handler_kill_switch`](Self::handler_kill_switch)).
    pub fn kill_switch(mut self, switch: impl Into<Option<KillSwitch>>) -> Self {
        self.kill_switch = switch.into();
        self
    }

    /// `handler`'s own kill switch, over the runtime's ([`kill_switch`](Self::kill_switch));
    /// `None` turns it off for that handler. [`build`](Self::build) refuses a name no
    /// consumed handler has, and a switch for a handler whose queue other handlers
    /// share (pausing that queue would pause them too).
    pub fn handler_kill_switch(mut self, handler: &str, switch: impl Into<Option<KillSwitch>>) -> Self {
        self.handler_kill_switches.push((handler.to_owned(), switch.into()));
        self
    }

    /// At most `per_second` of `handler`'s deliveries start per second (a partner's
    /// API quota, a database to spare), over all its consumers in this process: a
    /// token bucket of one second's worth, so in any stretch of time at most that
    /// many start plus one second's worth. Batches (group commit) and lanes take a
    /// token per delivery. What waits stays in the queue and the prefetch window.
    /// [`build`](Self::build) refuses `0` and a name no consumed handler has.
    pub fn rate_limit(mut self, handler: &str, per_second: u32) -> Self {
        self.rate_limits.push((handler.to_owned(), per_second));
        self
    }

    /// At most `n` of `handler`'s transactions (batches; single deliveries in
    /// per-message mode) at once, within the runtime's
    /// [`concurrency`](Self::concurrency); for a handler with a lane, its pipelines.
    /// [`build`](Self::build) refuses `0`, more than the runtime's concurrency, and a
    /// name no consumed handler has.
    pub fn handler_concurrency(mut self, handler: &str, n: usize) -> Self {
        self.handler_concurrency.push((handler.to_owned(), n));
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

    /// What to do at start-up when the database could lose COMMITs it acknowledged
    /// — standbys replicated asynchronously (a failover loses what they had not
    /// received), `synchronous_commit = off` — and with them messages idemq acked:
    /// warn (the default), refuse to start, or not check. See the guide, `docs/high-availability.md`, *Database
    /// high availability*.
    pub fn replication_check(mut self, check: ReplicationCheck) -> Self {
        self.replication_check = check;
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
    /// refused or reset, no answer) before [`Runtime::run`](super::Runtime::run) fails with
    /// [`Error::StartupTimeout`](crate::Error::StartupTimeout), naming which. Default: no limit.
    ///
    /// Without one, a consumer started during an outage waits: each attempt is
    /// logged with the delay to the next (the reconnect backoff, see
    /// [`reconnect_max_backoff`](Self::reconnect_max_backoff)) and reported as
    /// [`ConnectionEvent::Unreachable`](crate::observe::ConnectionEvent::Unreachable); `/readyz` answers 503 with the reason and
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

    /// How long a process that consumes streams may go without an answer from the
    /// broker before it gives up the streams it owns (and its place among the
    /// processes sharing partitions), so that a process that reaches the broker takes
    /// them over. Default 15 s.
    ///
    /// A stream's owner lock is in PostgreSQL: without this bound, a process cut
    /// from the broker but not from the database would keep it, and the stream would
    /// stall behind it. The broker is asked for a sign of life every second, on a
    /// connection of the stream consumers' own; a lock is taken only while it answers.
    /// Shorter moves streams sooner after a partition and also after a broker restart
    /// (each then subscribes again after the offset stored in PostgreSQL: nothing is
    /// applied twice either way). Zero is taken as 1 s.
    pub fn release_streams_after(mut self, bound: Duration) -> Self {
        self.release_streams_after = bound.max(Duration::from_secs(1));
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

    /// Adds a subscriber to everything the runtime reports (settled deliveries,
    /// database retries, connection events, batches, relay passes): the one way to
    /// observe a runtime. Any number may be added; each hears every event, in the
    /// order they were added. For one callback, wrap a closure with
    /// [`observe::on_settled`](crate::observe::on_settled) or
    /// [`observe::on_connection`](crate::observe::on_connection).
    pub fn observe(mut self, observer: impl Observe) -> Self {
        self.observers.push(Arc::new(observer));
        self
    }

    /// Whether the runtime runs an outbox [relay](crate::outbox::Relay) (default: yes). Turn
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
    /// (written by other processes or by [`enqueue`](crate::outbox::enqueue) in
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
    /// sooner). See [`RelayBuilder::reply_ttl`](crate::outbox::RelayBuilder::reply_ttl); relays
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
    /// ([`Retention::check`](crate::store::Retention::check)). Several processes may sweep:
    /// one at a time runs (a transaction-scoped advisory lock per batch).
    pub fn retention(mut self, retention: crate::store::retention::Retention) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Starts even when lapin's AMQP parser is upstream `amq-protocol-types`, which
    /// fails a whole frame on a short string that is not UTF-8 (as does
    /// `IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER=1`). Without it, [`build`](Self::build)
    /// refuses such a parser with
    /// [`Error::UnpatchedAmqpParser`](crate::Error::UnpatchedAmqpParser), naming the two
    /// lines of `Cargo.toml` that patch it (idemq's workspace has them; an
    /// application's own workspace needs them too: cargo does not apply a
    /// dependency's `[patch]`). With it, `build` logs a warning and the risk stays:
    /// a publisher that sends a `message_id` (or another short-string property, or a
    /// header name) that is not UTF-8 makes lapin close the connection each time
    /// that message is delivered, and its queue stops until the broker's delivery
    /// limit dead-letters it and the messages delivered beside it.
    pub fn allow_unpatched_amqp_parser(mut self) -> Self {
        self.allow_unpatched_amqp_parser = true;
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

    /// Installs a test's fault hook: the test kit's `FaultHookExt::fault_hook` (in
    /// `idemq-testing`) calls this through `__private::sibling`; nothing else does.
    pub(crate) fn with_fault_hook(mut self, hook: crate::engine::hook::FaultHook) -> Self {
        self.fault_hook = Some(hook);
        self
    }

    /// Each consumer's settings in words (the console's handlers page): handler,
    /// queue, and how it runs (batch, lane, concurrency, rate limit, kill switch).
    pub(crate) fn handler_settings(&self) -> Vec<(String, String, Vec<String>)> {
        self.consumers
            .iter()
            .map(|registration| {
                let handler = &registration.handler;
                let name = handler.name();
                let mut words = Vec::new();
                match registration.batch_size(self.batch_size) {
                    1 => words.push("per message".to_owned()),
                    size if handler.batched() => words.push(format!("batch handler, up to {size} a call")),
                    size => words.push(format!("group commit, up to {size} a transaction")),
                }
                if let Some(lane) = handler.lane_path() {
                    words.push(format!("lane by {lane}"));
                }
                words.push(format!("concurrency {}", self.concurrency_of(name)));
                if let Some(rate) = self.rate_limit_of(name) {
                    words.push(format!("rate limit {rate}/s"));
                }
                // The switch the runtime runs: none on a queue several handlers share.
                words.push(match self.kill_switch_of(name, &registration.queue) {
                    Some(switch) => format!("kill switch {switch}"),
                    None => "no kill switch".to_owned(),
                });
                (name.to_owned(), registration.queue.clone(), words)
            })
            .collect()
    }

    /// Mounts pages beside the metrics (the CLI's console), served once `http_addr`
    /// is set.
    #[cfg(feature = "metrics")]
    pub(crate) fn with_pages(mut self, mount: crate::engine::pages::Mount) -> Self {
        self.pages = Some(mount);
        self
    }
}
