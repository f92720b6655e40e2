//! Prometheus metrics and health endpoints (feature `metrics`), served on
//! [`RuntimeBuilder::http_addr`](crate::RuntimeBuilder::http_addr) — off unless set,
//! so several consumers can share a host.
//!
//! - `GET /metrics`: every series below, registered at zero from start-up (an idle
//!   process already exposes them);
//! - `GET /healthz` (liveness): 200 while the process's async runtime runs its
//!   tasks; 503 once it has not for [`STALLED_AFTER`] (every worker thread blocked:
//!   a restart is the cure). An unreachable broker or database is *not* a liveness
//!   failure — a restart does not mend a network — and it is what `/readyz` says.
//! - `GET /readyz` (readiness): 200 while connected to the broker (consuming), the
//!   database answered within the last refresh, and no stream waits for the broker;
//!   else 503 with the first reason — at start-up, while the runtime waits for an
//!   unreachable broker or database, which one and why. The body has a line per
//!   check: the broker, the database, each stream consumer (owned, standby, or
//!   waiting for the broker, and for how long), each handler its kill switch holds
//!   paused (still ready: a restart does not mend a dependency) and the outbox (rows
//!   waiting, the oldest's age: the relay's lag).
//!
//! An orchestrator probes `/healthz` to restart a stuck process and `/readyz` to
//! hold a rollout (or alert) while a process cannot consume; a standby of a stream
//! owned elsewhere is ready.
//!
//! | series | |
//! |---|---|
//! | `idemq_deliveries_total{queue, handler, outcome, kind}` | settled deliveries: `applied`, `duplicate`, `already_copied`, `retried`, `requeued`, `dead_lettered` (with the failure `kind`), `paused` (an open kill switch), `abandoned` |
//! | `idemq_in_flight{queue, handler}` | deliveries received and not yet settled |
//! | `idemq_delivery_duration_seconds{queue, handler}` | received → settled |
//! | `idemq_handler_duration_seconds{queue, handler}` | a handler's run (its last, for a re-run one) |
//! | `idemq_commit_duration_seconds{queue, handler}` | the checked COMMIT of a transaction that committed |
//! | `idemq_transaction_duration_seconds{queue, handler}` | a batch, from its first transaction's start to its last decision (handlers and COMMIT) |
//! | `idemq_batch_splits_total{queue, handler}` | batches run again smaller |
//! | `idemq_contended_batches_total{queue, handler}` | batches whose transactions collided with others (a lock wait past the batch limit, a deadlock, a serialization failure): a handler without a lane whose messages update shared rows — give it a lane |
//! | `idemq_batch_width{queue, handler}` | how many of the consumer's batches may run at once: its concurrency, narrowed while batches collide |
//! | `idemq_infrastructure_retries_total{queue, handler}` | transactions retried after a database fault |
//! | `idemq_reconnects_total` | broker connections lost (and re-made) |
//! | `idemq_connected` | 1 while a session is consuming |
//! | `idemq_outbox_published_total`, `idemq_outbox_postponed_total` | relay results |
//! | `idemq_outbox_replies_expired_total` | replies deleted unpublished: past the reply TTL or their request's `expiration` (the requester stopped waiting; most often its `reply_to` queue is gone) |
//! | `idemq_outbox_backlog` | rows waiting in the outbox (refreshed every 5 s) |
//! | `idemq_outbox_oldest_seconds` | the age of the oldest row waiting in the outbox: the relay's lag (refreshed every 5 s) |
//! | `idemq_stream_owned{stream, handler}` | 1 while this process owns the stream for the handler |
//! | `idemq_stream_lag_messages{stream, handler}` | messages in the stream after the last one the handler applied (read every 15 s while this process owns it; 0 otherwise) |
//! | `idemq_stream_lag_seconds{stream, handler}` | how long ago a read of the stream's end first saw an offset still not applied: at least this far behind in time (0 once caught up) |
//! | `idemq_kill_switch_open{queue, handler}` | 1 while the handler's kill switch holds its queue paused (`RuntimeBuilder::kill_switch`) |
//! | `idemq_kill_switch_trips_total{queue, handler}` | times it opened, a failed try after a pause included |
//! | `idemq_saga_steps_total{saga, handler, step}` | committed saga steps: `started`, `advanced`, `completed`, or `ignored` (no saga, or finished, and the step's policy acked it) |
//! | `idemq_saga_timeouts_total{saga, event}` | saga timeouts `scheduled`, `fired` (taken by a step) and `cancelled` (by the saga's completion, before they were due) |
//! | `idemq_dedup_rows_deleted_total` | rows the retention sweep deleted |
//!
//! `handler` is the name of the handler consuming the queue (as in the
//! `x-idemq-handler` header of its dead letters), so a dashboard can group by either.
//!
//! The hot path knows nothing of this: it is one more [`Observe`] subscriber.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::pages::{Live, Mount, PageRequest, PageResponse, Pages, Probe, MAX_AT_ONCE, MAX_BODY, PREFIX};
use crate::base::observe::{ConnectionEvent, StreamEvent, StreamState};
use crate::base::observe::{DecidedBatch, InfrastructureRetry, Observe, RelayPass};
use crate::base::outcome::{FailureKind, Outcome, Settled};

type Labels = Vec<(&'static str, String)>;

/// Each stream consumer's state and since when, by (stream, handler).
type StreamStates = BTreeMap<(String, &'static str), (StreamState, Instant)>;

/// How often the liveness beat runs.
const BEAT_EVERY: Duration = Duration::from_secs(1);

/// How long the async runtime may go without running the beat before `/healthz`
/// answers 503.
pub(crate) const STALLED_AFTER: Duration = Duration::from_secs(15);

/// Histograms with the buckets of [`histogram`].
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

fn histograms() -> Histograms {
    Family::new_with_constructor(histogram)
}

fn histogram() -> Histogram {
    // 0.5 ms … ~16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The exporter's series, shared by the observer and the HTTP thread.
pub(crate) struct Metrics {
    registry: Registry,
    deliveries: Family<Labels, Counter>,
    in_flight: Family<Labels, Gauge>,
    delivery_seconds: Histograms,
    handler_seconds: Histograms,
    commit_seconds: Histograms,
    transaction_seconds: Histograms,
    batch_splits: Family<Labels, Counter>,
    contended_batches: Family<Labels, Counter>,
    batch_width: Family<Labels, Gauge>,
    infrastructure_retries: Family<Labels, Counter>,
    reconnects: Counter,
    connected: Gauge,
    outbox_published: Counter,
    outbox_postponed: Counter,
    outbox_replies_expired: Counter,
    outbox_backlog: Gauge,
    outbox_oldest: Gauge,
    stream_owned: Family<Labels, Gauge>,
    stream_lag_messages: Family<Labels, Gauge>,
    stream_lag_seconds: Family<Labels, Gauge>,
    kill_switch_open: Family<Labels, Gauge>,
    kill_switch_trips: Family<Labels, Counter>,
    saga_steps: Family<Labels, Counter>,
    saga_timeouts: Family<Labels, Counter>,
    dedup_deleted: Counter,
    database_ok: AtomicBool,
    /// Each stream consumer's state and since when: (stream, handler) → …
    streams: std::sync::Mutex<StreamStates>,
    /// Each handler held paused by its kill switch: (queue, handler) → since when.
    paused: std::sync::Mutex<BTreeMap<(String, &'static str), Instant>>,
    /// When the async runtime last ran the beat task (see [`STALLED_AFTER`]).
    beat: std::sync::Mutex<Instant>,
    /// At start-up, what the runtime waits for and why (until it is connected).
    waiting: std::sync::Mutex<Option<String>>,
    /// The handler consuming each queue: the `handler` label of its series.
    /// The `handler` label of each queue's series: its handler's name, or the
    /// names of a queue's handlers (one per message type), joined by commas.
    handlers: HashMap<String, String>,
}

const OUTCOMES: [&str; 7] =
    ["applied", "duplicate", "already_copied", "retried", "requeued", "paused", "abandoned"];

impl Metrics {
    /// Every series, at zero for each of `consumers` (a queue and its handler's name).
    pub(crate) fn new(consumers: &[(String, &'static str)]) -> Arc<Self> {
        let mut metrics = Self {
            registry: Registry::default(),
            deliveries: Family::default(),
            in_flight: Family::default(),
            delivery_seconds: histograms(),
            handler_seconds: histograms(),
            commit_seconds: histograms(),
            transaction_seconds: histograms(),
            batch_splits: Family::default(),
            contended_batches: Family::default(),
            batch_width: Family::default(),
            infrastructure_retries: Family::default(),
            reconnects: Counter::default(),
            connected: Gauge::default(),
            outbox_published: Counter::default(),
            outbox_postponed: Counter::default(),
            outbox_replies_expired: Counter::default(),
            outbox_backlog: Gauge::default(),
            outbox_oldest: Gauge::default(),
            stream_owned: Family::default(),
            stream_lag_messages: Family::default(),
            stream_lag_seconds: Family::default(),
            kill_switch_open: Family::default(),
            kill_switch_trips: Family::default(),
            saga_steps: Family::default(),
            saga_timeouts: Family::default(),
            dedup_deleted: Counter::default(),
            database_ok: AtomicBool::new(false),
            streams: std::sync::Mutex::default(),
            paused: std::sync::Mutex::default(),
            beat: std::sync::Mutex::new(Instant::now()),
            waiting: std::sync::Mutex::new(None),
            handlers: HashMap::new(),
        };
        for (queue, handler) in consumers {
            let label = metrics.handlers.entry(queue.clone()).or_default();
            if !label.is_empty() {
                label.push(',');
            }
            label.push_str(handler);
        }
        metrics.register();
        for (queue, _) in consumers {
            metrics.zero(queue);
        }
        Arc::new(metrics)
    }

    /// Registers every series under its name and help.
    fn register(&mut self) {
        let registry = &mut self.registry;
        registry.register(
            "idemq_deliveries",
            "Settled deliveries by queue, outcome and failure kind",
            self.deliveries.clone(),
        );
        registry.register(
            "idemq_in_flight",
            "Deliveries received and not yet settled",
            self.in_flight.clone(),
        );
        registry.register(
            "idemq_delivery_duration_seconds",
            "Received to settled",
            self.delivery_seconds.clone(),
        );
        registry.register("idemq_handler_duration_seconds", "A handler's run", self.handler_seconds.clone());
        registry.register(
            "idemq_commit_duration_seconds",
            "A checked COMMIT that committed",
            self.commit_seconds.clone(),
        );
        registry.register(
            "idemq_transaction_duration_seconds",
            "A batch: first transaction start to last decision",
            self.transaction_seconds.clone(),
        );
        registry.register("idemq_batch_splits", "Batches run again smaller", self.batch_splits.clone());
        registry.register(
            "idemq_contended_batches",
            "Batches whose transactions collided with others' (lock wait, deadlock, serialization failure)",
            self.contended_batches.clone(),
        );
        registry.register(
            "idemq_batch_width",
            "Batches of the consumer that may run at once (narrowed while batches collide)",
            self.batch_width.clone(),
        );
        registry.register(
            "idemq_infrastructure_retries",
            "Transactions retried after a database fault",
            self.infrastructure_retries.clone(),
        );
        registry.register("idemq_reconnects", "Broker connections lost", self.reconnects.clone());
        registry.register("idemq_connected", "1 while a session is consuming", self.connected.clone());
        registry.register(
            "idemq_outbox_published",
            "Outbox rows published and confirmed",
            self.outbox_published.clone(),
        );
        registry.register(
            "idemq_outbox_postponed",
            "Outbox rows refused and postponed",
            self.outbox_postponed.clone(),
        );
        registry.register(
            "idemq_outbox_replies_expired",
            "Replies deleted unpublished: past the reply TTL or their request's expiration",
            self.outbox_replies_expired.clone(),
        );
        registry.register("idemq_outbox_backlog", "Rows waiting in the outbox", self.outbox_backlog.clone());
        registry.register(
            "idemq_outbox_oldest_seconds",
            "Age of the oldest row waiting in the outbox (the relay's lag)",
            self.outbox_oldest.clone(),
        );
        registry.register(
            "idemq_stream_owned",
            "1 while this process owns the stream for the handler",
            self.stream_owned.clone(),
        );
        registry.register(
            "idemq_stream_lag_messages",
            "Messages in the stream after the last one the handler applied",
            self.stream_lag_messages.clone(),
        );
        registry.register(
            "idemq_stream_lag_seconds",
            "How long ago a read of the stream's end first saw an offset the handler has not applied",
            self.stream_lag_seconds.clone(),
        );
        registry.register(
            "idemq_kill_switch_open",
            "1 while the handler's kill switch holds its queue paused",
            self.kill_switch_open.clone(),
        );
        registry.register(
            "idemq_kill_switch_trips",
            "Times the handler's kill switch opened (a failed try after a pause included)",
            self.kill_switch_trips.clone(),
        );
        registry.register(
            "idemq_saga_steps",
            "Committed saga steps: started, advanced, completed, or ignored by the step's policy",
            self.saga_steps.clone(),
        );
        registry.register(
            "idemq_saga_timeouts",
            "Saga timeouts scheduled, fired (taken by a step) and cancelled by the saga's completion",
            self.saga_timeouts.clone(),
        );
        registry.register(
            "idemq_dedup_rows_deleted",
            "Dedup rows deleted by the retention sweep",
            self.dedup_deleted.clone(),
        );
    }

    /// `queue`'s series at zero, so that they are exposed before anything happens.
    fn zero(&self, queue: &str) {
        for outcome in OUTCOMES {
            let _ = self.deliveries.get_or_create(&self.labels(queue, outcome, ""));
        }
        for kind in FailureKind::ALL {
            let _ = self.deliveries.get_or_create(&self.labels(queue, "dead_lettered", kind.as_str()));
        }
        let queue_only = self.consumer(queue);
        let _ = self.in_flight.get_or_create(&queue_only);
        for histograms in
            [&self.delivery_seconds, &self.handler_seconds, &self.commit_seconds, &self.transaction_seconds]
        {
            let _ = histograms.get_or_create(&queue_only);
        }
        let _ = self.batch_splits.get_or_create(&queue_only);
        let _ = self.contended_batches.get_or_create(&queue_only);
        let _ = self.infrastructure_retries.get_or_create(&queue_only);
        let _ = self.kill_switch_open.get_or_create(&queue_only);
        let _ = self.kill_switch_trips.get_or_create(&queue_only);
    }

    /// The text exposition of every series.
    pub(crate) fn render(&self) -> String {
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// `None` when ready, else why not; and a line per check.
    pub(crate) fn readiness(&self) -> (Option<String>, String) {
        let mut report = String::new();
        let mut not_ready: Option<String> = None;
        let mut check = |ok: bool, line: String| {
            if !ok && not_ready.is_none() {
                not_ready = Some(line.clone());
            }
            report.push_str(&line);
            report.push('\n');
        };
        let connected = self.connected.get() != 0;
        let broker = match connected {
            true => "broker: connected".to_owned(),
            false => format!(
                "broker: {}",
                self.waiting().unwrap_or_else(|| "not connected to the broker".to_owned())
            ),
        };
        check(connected, broker);
        let database = self.database_ok.load(Ordering::Relaxed);
        check(
            database,
            match database {
                true => "database: answered".to_owned(),
                false => "database: the database did not answer".to_owned(),
            },
        );
        let streams = self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        for ((stream, handler), (state, since)) in streams {
            let age = crate::base::duration::human(Duration::from_secs(since.elapsed().as_secs()));
            let (ok, said) = match state {
                StreamState::Owned => (true, format!("owned for {age}")),
                StreamState::Standby => (true, format!("standby for {age} (another process owns it)")),
                StreamState::WaitingForBroker | StreamState::Released => {
                    (false, format!("waiting for the broker for {age} (this process cannot consume it)"))
                }
            };
            check(ok, format!("stream {stream} ({handler}): {said}"));
        }
        // A paused handler is no reason to take the process out of rotation: a
        // restart does not mend the dependency its attempts failed on.
        let paused = self.paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        for ((queue, handler), since) in paused {
            let age = crate::base::duration::human(Duration::from_secs(since.elapsed().as_secs()));
            check(true, format!("handler {handler} ({queue}): paused by its kill switch for {age}; one message is tried after each pause"));
        }
        if database {
            let (rows, oldest) = (self.outbox_backlog.get(), self.outbox_oldest.get());
            check(true, format!("outbox: {rows} rows waiting, the oldest {oldest}s old"));
        }
        (not_ready, report)
    }

    /// `None` when the async runtime ran its tasks within [`STALLED_AFTER`], else
    /// for how long it has not.
    pub(crate) fn stalled(&self) -> Option<Duration> {
        let beat = *self.beat.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let since = beat.elapsed();
        (since >= STALLED_AFTER).then_some(since)
    }

    fn beat(&self) {
        *self.beat.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    fn waiting(&self) -> Option<String> {
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn set_waiting(&self, waiting: Option<String>) {
        *self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = waiting;
    }

    /// The outbox's rows and the oldest's age in seconds, or `None` when the
    /// database did not answer.
    pub(crate) fn set_backlog(&self, backlog: Option<(i64, i64)>) {
        self.database_ok.store(backlog.is_some(), Ordering::Relaxed);
        if let Some((rows, oldest)) = backlog {
            self.outbox_backlog.set(rows);
            self.outbox_oldest.set(oldest);
        }
    }
}

impl Metrics {
    /// The labels of `queue`'s series: the queue and its handler.
    fn consumer(&self, queue: &str) -> Labels {
        let handler = self.handlers.get(queue).cloned().unwrap_or_default();
        vec![("queue", queue.to_owned()), ("handler", handler)]
    }

    /// The labels of a settled delivery: the consumer's, its outcome and failure kind.
    fn labels(&self, queue: &str, outcome: &'static str, kind: &str) -> Labels {
        let mut labels = self.consumer(queue);
        labels.extend([("outcome", outcome.to_owned()), ("kind", kind.to_owned())]);
        labels
    }
}

impl Observe for Metrics {
    fn settled(&self, settled: &Settled) {
        let kind = match &settled.outcome {
            Outcome::DeadLettered { kind, .. } => kind.as_str(),
            _ => "",
        };
        let outcome = settled.outcome.name();
        self.deliveries.get_or_create(&self.labels(&settled.queue, outcome, kind)).inc();
        let queue = self.consumer(&settled.queue);
        let took = settled.settled_at.saturating_duration_since(settled.received_at);
        self.delivery_seconds.get_or_create(&queue).observe(took.as_secs_f64());
        if let Some(handler) = settled.handler_time {
            self.handler_seconds.get_or_create(&queue).observe(handler.as_secs_f64());
        }
        self.in_flight.get_or_create(&queue).dec();
    }

    fn received(&self, queue: &str) {
        self.in_flight.get_or_create(&self.consumer(queue)).inc();
    }

    fn committed(&self, commit: &crate::base::observe::Commit<'_>) {
        let queue = self.consumer(commit.queue);
        self.commit_seconds.get_or_create(&queue).observe(commit.took.as_secs_f64());
    }

    fn infrastructure_retry(&self, retry: &InfrastructureRetry<'_>) {
        self.infrastructure_retries.get_or_create(&self.consumer(retry.queue)).inc();
    }

    fn connection(&self, event: &ConnectionEvent) {
        match event {
            ConnectionEvent::Connected { .. } => {
                self.set_waiting(None);
                self.connected.set(1);
            }
            ConnectionEvent::Unreachable { dependency, attempt, error, .. } => {
                self.set_waiting(Some(format!(
                    "starting: waiting for {dependency}, unreachable (attempt {attempt}): {error}"
                )));
            }
            ConnectionEvent::Lost { .. } => {
                self.connected.set(0);
                self.reconnects.inc();
            }
            _ => {}
        }
    }

    fn stream_lag(&self, lag: &crate::base::observe::StreamLag<'_>) {
        let labels = vec![("stream", lag.stream.to_owned()), ("handler", lag.handler.to_owned())];
        self.stream_lag_messages.get_or_create(&labels).set(lag.messages);
        self.stream_lag_seconds
            .get_or_create(&labels)
            .set(i64::try_from(lag.behind.as_secs()).unwrap_or(i64::MAX));
    }

    fn stream(&self, event: &StreamEvent) {
        let labels = vec![("stream", event.stream.clone()), ("handler", event.handler.to_owned())];
        self.stream_owned.get_or_create(&labels).set(i64::from(event.state == StreamState::Owned));
        if event.state != StreamState::Owned {
            // Another process reads it now: its lag is that one's to report.
            self.stream_lag_messages.get_or_create(&labels).set(0);
            self.stream_lag_seconds.get_or_create(&labels).set(0);
        }
        let mut streams = self.streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry =
            streams.entry((event.stream.clone(), event.handler)).or_insert((event.state, Instant::now()));
        if entry.0 != event.state {
            *entry = (event.state, Instant::now());
        }
    }

    fn batch(&self, batch: &DecidedBatch<'_>) {
        let queue = self.consumer(batch.queue);
        self.transaction_seconds.get_or_create(&queue).observe(batch.took.as_secs_f64());
        if batch.splits > 0 {
            self.batch_splits.get_or_create(&queue).inc_by(batch.splits);
        }
        if batch.contended {
            self.contended_batches.get_or_create(&queue).inc();
        }
        self.batch_width.get_or_create(&queue).set(i64::try_from(batch.width).unwrap_or(i64::MAX));
    }

    fn relay(&self, pass: &RelayPass) {
        self.outbox_published.inc_by(pass.published as u64);
        self.outbox_postponed.inc_by(pass.postponed as u64);
        self.outbox_replies_expired.inc_by(pass.expired as u64);
    }

    fn swept(&self, sweep: &crate::base::observe::Sweep) {
        self.dedup_deleted.inc_by(sweep.dedup_rows);
    }

    fn saga_step(&self, step: &crate::base::observe::SagaStep<'_>) {
        let labels = vec![
            ("saga", step.saga.to_owned()),
            ("handler", step.handler.to_owned()),
            ("step", step.kind.name().to_owned()),
        ];
        self.saga_steps.get_or_create(&labels).inc();
        let fired = u32::from(step.timeout_fired);
        for (event, n) in
            [("scheduled", step.timeouts_scheduled), ("fired", fired), ("cancelled", step.timeouts_cancelled)]
        {
            if n > 0 {
                let labels = vec![("saga", step.saga.to_owned()), ("event", event.to_owned())];
                self.saga_timeouts.get_or_create(&labels).inc_by(u64::from(n));
            }
        }
    }

    fn kill_switch(&self, event: &crate::base::observe::KillSwitchEvent<'_>) {
        let queue = self.consumer(event.queue);
        self.kill_switch_open.get_or_create(&queue).set(i64::from(event.open_for.is_some()));
        let mut paused = self.paused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if event.open_for.is_some() {
            self.kill_switch_trips.get_or_create(&queue).inc();
            paused.entry((event.queue.to_owned(), event.handler)).or_insert_with(Instant::now);
        } else {
            paused.remove(&(event.queue.to_owned(), event.handler));
        }
    }
}

impl Probe for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }

    fn readiness(&self) -> (Option<String>, String) {
        Metrics::readiness(self)
    }
}

/// The HTTP thread of [`serve`]: it stops (within 200 ms) when this is dropped.
#[derive(Debug)]
pub(crate) struct Serving(Arc<AtomicBool>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` from a thread of its own
/// until the returned [`Serving`] is dropped.
///
/// # Errors
/// [`Error::ConfigIo`](crate::Error::ConfigIo): the address cannot be bound (in use,
/// not local).
pub(crate) fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    mount: Option<Mount>,
) -> Result<Serving, crate::error::Error> {
    let stop = Arc::new(AtomicBool::new(false));
    // The liveness beat: a task on the async runtime, so `/healthz` (answered by a
    // thread of its own) tells whether the runtime still runs its tasks.
    let (beating, stopped) = (Arc::clone(&metrics), Arc::clone(&stop));
    tokio::spawn(async move {
        while !stopped.load(Ordering::Relaxed) {
            beating.beat();
            tokio::time::sleep(BEAT_EVERY).await;
        }
    });
    listen(addr, Some(metrics), mount, stop, "cannot serve metrics on {addr} (--http-addr / IDEMQ_HTTP_ADDR)")
}

/// Serves the mounted pages alone on `addr` (the CLI's `console`, without a
/// runtime: no metrics, no health endpoints) until the returned [`Serving`] is
/// dropped.
pub(crate) fn serve_pages(addr: SocketAddr, mount: Mount) -> Result<Serving, crate::error::Error> {
    listen(addr, None, Some(mount), Arc::new(AtomicBool::new(false)), "cannot serve the console on {addr}")
}

/// Binds `addr` and answers from a thread of its own until `stop`: the metrics
/// and health endpoints (with `metrics`), and the mounted pages.
fn listen(
    addr: SocketAddr,
    metrics: Option<Arc<Metrics>>,
    mount: Option<Mount>,
    stop: Arc<AtomicBool>,
    cannot: &str,
) -> Result<Serving, crate::error::Error> {
    let serving = Serving(Arc::clone(&stop));
    let server = tiny_http::Server::http(addr).map_err(|err| crate::error::Error::ConfigIo {
        message: cannot.replace("{addr}", &addr.to_string()),
        // tiny_http boxes the socket's I/O error.
        source: err.downcast::<std::io::Error>().map_or_else(std::io::Error::other, |err| *err),
    })?;
    let bound = server.server_addr().to_ip().unwrap_or(addr);
    let probe = metrics.clone().map(|metrics| metrics as Arc<dyn Probe>);
    let pages = mount.map(|mount| mount(bound, Live { metrics: probe }));
    let answering = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("idemq-http".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let Ok(Some(request)) = server.recv_timeout(Duration::from_millis(200)) else { continue };
                if let Some(pages) = pages.as_ref().filter(|_| is_page(request.url())) {
                    if answering.fetch_add(1, Ordering::SeqCst) >= MAX_AT_ONCE {
                        answering.fetch_sub(1, Ordering::SeqCst);
                        let busy =
                            tiny_http::Response::from_string("busy: too many console pages at once; retry\n");
                        let _ = request.respond(busy.with_status_code(503));
                        continue;
                    }
                    // Counted out when the page's thread ends, a panic included (or
                    // at once, if no thread could be started).
                    let (pages, done) = (Arc::clone(pages), Answering(Arc::clone(&answering)));
                    // A thread per page: reading the broker must not hold up a scrape.
                    let _ = std::thread::Builder::new().name("idemq-page".into()).spawn(move || {
                        let _done = done;
                        answer_page(request, &pages);
                    });
                    continue;
                }
                let (status, body) = match (request.url(), &metrics) {
                    ("/metrics", Some(metrics)) => (200, metrics.render()),
                    ("/healthz", Some(metrics)) => match metrics.stalled() {
                        None => (200, "ok\n".to_owned()),
                        Some(since) => (
                            503,
                            format!(
                                "stalled: the async runtime has not run its tasks for {} (are all its worker \
                                 threads blocked?)\n",
                                crate::base::duration::human(since)
                            ),
                        ),
                    },
                    ("/readyz", Some(metrics)) => match metrics.readiness() {
                        (None, report) => (200, format!("ready\n{report}")),
                        (Some(why), report) => (503, format!("not ready: {why}\n{report}")),
                    },
                    (_, None) => (404, "not found: the console is under /console\n".to_owned()),
                    _ if pages.is_some() => {
                        (404, "not found: /metrics, /healthz, /readyz, /console\n".to_owned())
                    }
                    _ => (404, "not found: /metrics, /healthz, /readyz\n".to_owned()),
                };
                let content_type = if request.url() == "/metrics" && status == 200 {
                    "application/openmetrics-text; version=1.0.0; charset=utf-8"
                } else {
                    "text/plain; charset=utf-8"
                };
                let header =
                    tiny_http::Header::from_bytes("Content-Type", content_type).expect("a valid header");
                let response =
                    tiny_http::Response::from_string(body).with_status_code(status).with_header(header);
                let _ = request.respond(response);
            }
        })
        .map_err(|source| crate::error::Error::ConfigIo {
            message: "cannot start the metrics thread".into(),
            source,
        })?;
    Ok(serving)
}

/// One page being answered: counted out of `MAX_AT_ONCE` when dropped.
struct Answering(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether `url` is one of the mounted pages' ([`PREFIX`] or under it).
fn is_page(url: &str) -> bool {
    url.strip_prefix(PREFIX).is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']))
}

/// Reads `request` (a body past [`MAX_BODY`] is refused), asks `pages`, answers.
fn answer_page(mut request: tiny_http::Request, pages: &Pages) {
    use std::io::Read as _;
    let mut body = Vec::new();
    let read = request.as_reader().take(MAX_BODY as u64 + 1).read_to_end(&mut body);
    let answer = if read.is_err() || body.len() > MAX_BODY {
        PageResponse {
            status: 413,
            headers: vec![("Content-Type".into(), "text/plain; charset=utf-8".into())],
            body: b"request body too large or unreadable\n".to_vec(),
        }
    } else {
        pages(PageRequest {
            method: request.method().as_str().to_owned(),
            url: request.url().to_owned(),
            headers: request
                .headers()
                .iter()
                .map(|header| (header.field.as_str().as_str().to_owned(), header.value.as_str().to_owned()))
                .collect(),
            body,
            remote: request.remote_addr().copied(),
        })
    };
    let mut response = tiny_http::Response::from_data(answer.body).with_status_code(answer.status);
    for (name, value) in answer.headers {
        if let Ok(header) = tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()) {
            response.add_header(header);
        }
    }
    let _ = request.respond(response);
}
