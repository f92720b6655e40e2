//! The one observation seam: everything the runtime reports goes to a list of
//! subscribers implementing [`Observe`] — the built-in [`Stats`], and any number
//! added with [`RuntimeBuilder::observe`](crate::RuntimeBuilder::observe): a
//! callback ([`on_settled`], [`on_connection`]), a metrics exporter, tracing, a test. The hot path knows only this trait.

use std::sync::Arc;
use std::time::Duration;

use crate::base::outcome::{Settled, Stats};

/// A change in the runtime's connection to the broker — or, at start-up, an attempt
/// that found the broker or the database unreachable — for an
/// subscriber ([`on_connection`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionEvent {
    /// Session `session` is connected, declared and consuming.
    Connected {
        /// 1 for the first session, then one more per reconnect.
        session: u64,
    },
    /// Session `session` lost its connection or a channel; the runtime reconnects.
    Lost {
        /// The session that ended.
        session: u64,
        /// Why, as far as the client knows.
        reason: String,
    },
    /// The broker blocked the publishing connection (resource alarm): retry and
    /// dead-letter copies wait; consumption goes on.
    Blocked {
        /// The broker's reason.
        reason: String,
    },
    /// The broker unblocked the publishing connection.
    Unblocked,
    /// At start-up, `dependency` could not be reached (refused, reset, no answer):
    /// the runtime tries again in `retry_in`, until it answers or the
    /// [startup timeout](crate::RuntimeBuilder::startup_timeout) is spent. Once per
    /// failed attempt; the broker's `Connected { session: 1 }` ends the wait.
    Unreachable {
        /// What could not be reached.
        dependency: crate::error::Dependency,
        /// Failed attempts so far (1 for the first).
        attempt: u32,
        /// When the next attempt is made.
        retry_in: Duration,
        /// The attempt's error, passwords redacted.
        error: String,
    },
}

/// Where one stream consumer (a handler on a stream or partition) stands, as
/// [`StreamEvent`] reports it: what `/readyz` shows per stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamState {
    /// The broker does not answer this process: it takes no stream's lock until it
    /// does (a process cut from the broker must not hold a stream others could
    /// consume).
    WaitingForBroker,
    /// Another process owns the stream (or this one owns its share of the
    /// partitions): this one takes over when that changes.
    Standby,
    /// This process owns the stream and consumes it.
    Owned,
    /// Given up: the broker did not answer for the
    /// [release bound](crate::RuntimeBuilder::release_streams_after), so another
    /// process may take it over.
    Released,
}

impl StreamState {
    /// `waiting_for_broker`, `standby`, `owned` or `released`.
    pub fn name(self) -> &'static str {
        match self {
            Self::WaitingForBroker => "waiting_for_broker",
            Self::Standby => "standby",
            Self::Owned => "owned",
            Self::Released => "released",
        }
    }
}

/// A stream consumer's ownership changed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamEvent {
    /// The handler's name.
    pub handler: &'static str,
    /// The stream (or partition).
    pub stream: String,
    /// Where it stands now.
    pub state: StreamState,
}

/// How far a stream consumer is behind its stream's end: read every 15 s while
/// this process owns the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamLag<'a> {
    /// The handler's name.
    pub handler: &'static str,
    /// The stream (or partition).
    pub stream: &'a str,
    /// Messages after the last one applied (0: caught up).
    pub messages: i64,
    /// How long ago a read of the stream's end first saw an offset still not
    /// applied: at least this far behind (to within the 15 s between reads);
    /// zero once caught up.
    pub behind: Duration,
}

/// A subscriber to what the runtime does. Every method has a no-op default:
/// implement the ones you need. Methods run on the runtime's tasks, in line: keep
/// them quick (count, record, send to a channel), never block.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use idemq::{Outcome, observe::Observe, observe::Settled};
///
/// #[derive(Default)]
/// struct DeadLetters(AtomicU64);
///
/// impl Observe for DeadLetters {
///     fn settled(&self, settled: &Settled) {
///         if matches!(settled.outcome, Outcome::DeadLettered { .. }) {
///             self.0.fetch_add(1, Ordering::Relaxed);
///         }
///     }
/// }
///
/// let dead = Arc::new(DeadLetters::default());
/// let builder = idemq::Runtime::builder().observe(Arc::clone(&dead)); // keep `dead` to read it
/// # let _ = builder;
/// ```
pub trait Observe: Send + Sync + 'static {
    /// A delivery was settled (acked, dead-lettered, retried, requeued, …).
    fn settled(&self, settled: &Settled) {
        let _ = settled;
    }

    /// A transaction is retried in-process after a database fault (not an attempt).
    fn infrastructure_retry(&self, retry: &InfrastructureRetry<'_>) {
        let _ = retry;
    }

    /// The connection to the broker changed (or start-up found the broker or the
    /// database unreachable: [`ConnectionEvent::Unreachable`]).
    fn connection(&self, event: &ConnectionEvent) {
        let _ = event;
    }

    /// A stream consumer's ownership changed (it took, waits for or gave up a stream).
    fn stream(&self, event: &StreamEvent) {
        let _ = event;
    }

    /// A stream consumer's lag was read ([`StreamLag`]).
    fn stream_lag(&self, lag: &StreamLag<'_>) {
        let _ = lag;
    }

    /// A delivery was received from the broker (it is settled later, once).
    fn received(&self, queue: &str) {
        let _ = queue;
    }

    /// A transaction's COMMIT succeeded.
    fn committed(&self, commit: &Commit<'_>) {
        let _ = commit;
    }

    /// A batch (group commit) was decided.
    fn batch(&self, batch: &DecidedBatch<'_>) {
        let _ = batch;
    }

    /// The outbox relay finished a pass that claimed rows.
    fn relay(&self, pass: &RelayPass) {
        let _ = pass;
    }

    /// The retention sweep finished (see [`Retention`](crate::store::Retention)).
    fn swept(&self, sweep: &Sweep) {
        let _ = sweep;
    }

    /// A handler's kill switch opened (its queue is paused) or closed (see
    /// [`RuntimeBuilder::kill_switch`](crate::RuntimeBuilder::kill_switch)).
    fn kill_switch(&self, event: &KillSwitchEvent<'_>) {
        let _ = event;
    }

    /// A saga's step committed (see [`idemq::saga`](crate::saga)): reported after the
    /// COMMIT that holds it, once per step.
    fn saga_step(&self, step: &SagaStep<'_>) {
        let _ = step;
    }
}

/// What a committed step did to its saga.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SagaStep<'a> {
    /// The saga's name.
    pub saga: &'a str,
    /// The step's handler.
    pub handler: &'static str,
    /// What the step was.
    pub kind: SagaStepKind,
    /// Timeouts it scheduled.
    pub timeouts_scheduled: u32,
    /// Timeouts its completion cancelled (still waiting in the outbox).
    pub timeouts_cancelled: u32,
    /// Whether the message was one of the saga's own timeouts.
    pub timeout_fired: bool,
}

/// What a saga step was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SagaStepKind {
    /// It started the saga (and did not complete it).
    Started,
    /// It moved a running saga on.
    Advanced,
    /// It completed the saga (started by it, or not).
    Completed,
    /// The saga did not exist or had finished, and the step's policy acked the
    /// message without running it.
    Ignored,
}

impl SagaStepKind {
    /// `started`, `advanced`, `completed` or `ignored` (the `step` label of the metrics).
    pub fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Advanced => "advanced",
            Self::Completed => "completed",
            Self::Ignored => "ignored",
        }
    }
}

/// A handler's kill switch opened or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KillSwitchEvent<'a> {
    /// The handler's queue.
    pub queue: &'a str,
    /// The handler's name.
    pub handler: &'static str,
    /// For an open switch (the queue is paused), how long until one message is
    /// tried; `None` when it closed (consuming again).
    pub open_for: Option<Duration>,
}

/// A database fault a transaction is retried after.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct InfrastructureRetry<'a> {
    /// The consumer's queue.
    pub queue: &'a str,
    /// The fault, redacted.
    pub fault: &'a str,
}

/// A decided batch (`Observe::batch`). Not [`crate::Batch`], the messages a batch
/// handler is given.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DecidedBatch<'a> {
    /// The consumer's queue.
    pub queue: &'a str,
    /// Deliveries in it.
    pub deliveries: usize,
    /// Times it (or a part of it) was run again smaller.
    pub splits: u64,
    /// Whether a part of it was rolled back for colliding with another transaction —
    /// by PostgreSQL's word (SQLSTATE 40001 serialization failure, 40P01 deadlock,
    /// 55P03 lock timeout), in whatever language the server speaks — which narrows
    /// how many of the consumer's batches run at once.
    pub contended: bool,
    /// How many of the consumer's batches may run at once after this one: its
    /// concurrency, narrowed while its batches collide.
    pub width: usize,
    /// From the first transaction's start to the last decision.
    pub took: Duration,
}

/// A COMMIT that succeeded.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Commit<'a> {
    /// The consumer's queue.
    pub queue: &'a str,
    /// Deliveries whose effects it committed.
    pub deliveries: usize,
    /// How long the checked COMMIT took (one round trip).
    pub took: Duration,
}

/// What a sweep deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sweep {
    /// Dedup rows older than the retention.
    pub dedup_rows: u64,
    /// Copy records older than the retention.
    pub copy_records: u64,
    /// Start marks older than the retention (messages that never came back).
    pub start_marks: u64,
    /// Finished sagas past the retention they were kept for (`keep_finished`).
    pub finished_sagas: u64,
    /// Another sweeper held the lock: this one stopped.
    pub yielded: bool,
}

/// One pass of the outbox relay that claimed rows.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct RelayPass {
    /// Rows claimed.
    pub claimed: usize,
    /// Published and confirmed (deleted).
    pub published: usize,
    /// Refused (unroutable, missing exchange, nacked): postponed with backoff.
    pub postponed: usize,
    /// Replies deleted unpublished: older than the reply TTL, or past their request's
    /// `expiration` (see [`RelayBuilder::reply_ttl`](crate::outbox::RelayBuilder::reply_ttl)).
    pub expired: usize,
}

/// The subscribers, in registration order.
#[derive(Clone, Default)]
pub(crate) struct Observers(pub(crate) Vec<Arc<dyn Observe>>);

impl std::fmt::Debug for Observers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Observers({})", self.0.len())
    }
}

impl Observers {
    pub(crate) fn push(&mut self, observer: Arc<dyn Observe>) {
        self.0.push(observer);
    }

    pub(crate) fn settled(&self, settled: &Settled) {
        self.0.iter().for_each(|o| o.settled(settled));
    }

    pub(crate) fn infrastructure_retry(&self, retry: &InfrastructureRetry<'_>) {
        self.0.iter().for_each(|o| o.infrastructure_retry(retry));
    }

    pub(crate) fn connection(&self, event: &ConnectionEvent) {
        self.0.iter().for_each(|o| o.connection(event));
    }

    pub(crate) fn stream(&self, event: &StreamEvent) {
        self.0.iter().for_each(|o| o.stream(event));
    }

    pub(crate) fn stream_lag(&self, lag: &StreamLag<'_>) {
        self.0.iter().for_each(|o| o.stream_lag(lag));
    }

    pub(crate) fn received(&self, queue: &str) {
        self.0.iter().for_each(|o| o.received(queue));
    }

    pub(crate) fn committed(&self, commit: &Commit<'_>) {
        self.0.iter().for_each(|o| o.committed(commit));
    }

    pub(crate) fn batch(&self, batch: &DecidedBatch<'_>) {
        self.0.iter().for_each(|o| o.batch(batch));
    }

    pub(crate) fn relay(&self, pass: &RelayPass) {
        self.0.iter().for_each(|o| o.relay(pass));
    }

    pub(crate) fn swept(&self, sweep: &Sweep) {
        self.0.iter().for_each(|o| o.swept(sweep));
    }

    pub(crate) fn kill_switch(&self, event: &KillSwitchEvent<'_>) {
        self.0.iter().for_each(|o| o.kill_switch(event));
    }

    pub(crate) fn saga_step(&self, step: &SagaStep<'_>) {
        self.0.iter().for_each(|o| o.saga_step(step));
    }
}

/// A shared subscriber (keep a clone to read what it gathered).
impl<T: Observe> Observe for Arc<T> {
    fn settled(&self, settled: &Settled) {
        (**self).settled(settled);
    }

    fn infrastructure_retry(&self, retry: &InfrastructureRetry<'_>) {
        (**self).infrastructure_retry(retry);
    }

    fn connection(&self, event: &ConnectionEvent) {
        (**self).connection(event);
    }

    fn stream(&self, event: &StreamEvent) {
        (**self).stream(event);
    }

    fn stream_lag(&self, lag: &StreamLag<'_>) {
        (**self).stream_lag(lag);
    }

    fn batch(&self, batch: &DecidedBatch<'_>) {
        (**self).batch(batch);
    }

    fn received(&self, queue: &str) {
        (**self).received(queue);
    }

    fn committed(&self, commit: &Commit<'_>) {
        (**self).committed(commit);
    }

    fn relay(&self, pass: &RelayPass) {
        (**self).relay(pass);
    }

    fn swept(&self, sweep: &Sweep) {
        (**self).swept(sweep);
    }

    fn kill_switch(&self, event: &KillSwitchEvent<'_>) {
        (**self).kill_switch(event);
    }

    fn saga_step(&self, step: &SagaStep<'_>) {
        (**self).saga_step(step);
    }
}

impl Observe for Stats {
    fn settled(&self, settled: &Settled) {
        self.record(settled);
    }

    fn infrastructure_retry(&self, _: &InfrastructureRetry<'_>) {
        self.count_infrastructure_retry();
    }

    fn batch(&self, batch: &DecidedBatch<'_>) {
        self.count_batch_splits(batch.splits);
    }
}

/// An observer that calls `f` for every settled delivery, on the delivery's task
/// (keep it quick):
///
/// ```no_run
/// # fn example(builder: idemq::RuntimeBuilder) -> idemq::RuntimeBuilder {
/// builder.observe(idemq::observe::on_settled(|settled| {
///     eprintln!("{}: {:?}", settled.queue, settled.outcome);
/// }))
/// # }
/// ```
pub fn on_settled(f: impl Fn(&Settled) + Send + Sync + 'static) -> impl Observe {
    OnSettled(f)
}

/// An observer that calls `f` when the runtime connects, loses its connection, or
/// the broker blocks or unblocks publishing, and for every start-up attempt that
/// finds the broker or the database unreachable ([`ConnectionEvent`]).
pub fn on_connection(f: impl Fn(&ConnectionEvent) + Send + Sync + 'static) -> impl Observe {
    OnConnection(f)
}

struct OnSettled<F>(F);

impl<F: Fn(&Settled) + Send + Sync + 'static> Observe for OnSettled<F> {
    fn settled(&self, settled: &Settled) {
        (self.0)(settled);
    }
}

struct OnConnection<F>(F);

impl<F: Fn(&ConnectionEvent) + Send + Sync + 'static> Observe for OnConnection<F> {
    fn connection(&self, event: &ConnectionEvent) {
        (self.0)(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Observe for Count {
        fn connection(&self, _: &ConnectionEvent) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_subscriber_hears_every_event() {
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let mut observers = Observers::default();
        observers.push(a.clone());
        observers.push(b.clone());
        observers.connection(&ConnectionEvent::Unblocked);
        observers.connection(&ConnectionEvent::Connected { session: 1 });
        assert_eq!((a.0.load(Ordering::Relaxed), b.0.load(Ordering::Relaxed)), (2, 2));
    }
}
