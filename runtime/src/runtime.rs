//! The runtime: connections, topology, consumers, concurrency and shutdown.
//!
//! One AMQP connection; one channel per consumer (with its own `basic_qos`, never
//! global) plus one publisher channel in confirm mode for dead letters. Deliveries
//! run as tasks, at most `concurrency` at once, which is also the pool size.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::AsyncPgConnection;
use futures_util::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::delivery::{Consumer, OnConflict, Shared};
use crate::error::{redact, Error};
use crate::handler::Handler;
use crate::outcome::{Settled, Stats};
use crate::prepare::{ErasedHandler, InputLimits};
use crate::retry::RetryPolicy;
use crate::topology::{Queue, Topology};

/// The default AMQP URL (`AMQP_URL` overrides it).
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The default database URL (`DATABASE_URL` overrides it).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A callback told of every settled delivery (metrics, tests, progress).
pub type Observer = Arc<dyn Fn(&Settled) + Send + Sync>;

/// Configures a [`Runtime`]. Start with [`Runtime::builder`].
#[must_use = "a builder does nothing until `.build()` and `Runtime::run`"]
pub struct RuntimeBuilder {
    amqp_url: String,
    database_url: String,
    topology: Topology,
    consumers: Vec<(String, Box<dyn ErasedHandler>, Option<RetryPolicy>)>,
    concurrency: usize,
    retry: RetryPolicy,
    handler_timeout: Duration,
    database_retry_limit: Duration,
    max_body_bytes: usize,
    on_conflict: OnConflict,
    shutdown_deadline: Duration,
    observer: Option<Observer>,
    #[cfg(feature = "fault-injection")]
    fault_hook: Option<crate::fault::FaultHook>,
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
        let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        Self {
            amqp_url: env("AMQP_URL", DEFAULT_AMQP_URL),
            database_url: env("DATABASE_URL", DEFAULT_DATABASE_URL),
            topology: Topology::new(),
            consumers: Vec::new(),
            concurrency: 16,
            retry: RetryPolicy::default(),
            handler_timeout: Duration::from_secs(60),
            database_retry_limit: Duration::from_secs(25 * 60),
            max_body_bytes: 1024 * 1024,
            on_conflict: OnConflict::default(),
            shutdown_deadline: Duration::from_secs(10),
            observer: None,
            #[cfg(feature = "fault-injection")]
            fault_hook: None,
        }
    }

    /// The broker, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f` (default: `AMQP_URL`).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.amqp_url = url.into();
        self
    }

    /// The database holding the dedup table and the handlers' data (default: `DATABASE_URL`).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = url.into();
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
        self.consumers.push((queue.into(), Box::new(Arc::new(handler)), None));
        self
    }

    /// Like [`consume`](Self::consume), with this handler's own retry policy.
    pub fn consume_with<H: Handler>(
        mut self,
        queue: impl Into<String>,
        handler: H,
        retry: RetryPolicy,
    ) -> Self {
        self.consumers.push((queue.into(), Box::new(Arc::new(handler)), Some(retry)));
        self
    }

    /// Deliveries processed at once across all consumers; also the connection pool's
    /// size and each consumer's prefetch. Default 16.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
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
    /// connection is dropped. Default 60 s.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long a delivery is held, retrying its transaction on fresh connections,
    /// while the database is unreachable; after that it is returned to the queue.
    /// Keep it under the broker's `consumer_timeout` (30 min by default), which would
    /// otherwise close the channel. Default 25 min.
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

    /// How long shutdown waits for in-flight deliveries before returning them to the
    /// queue. Default 10 s.
    pub fn shutdown_deadline(mut self, deadline: Duration) -> Self {
        self.shutdown_deadline = deadline;
        self
    }

    /// Calls `observer` for every settled delivery, on the delivery's task. Keep it quick.
    pub fn observer(mut self, observer: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// Installs a test-only [fault hook](crate::fault).
    #[cfg(feature = "fault-injection")]
    pub fn fault_hook(mut self, hook: crate::fault::FaultHook) -> Self {
        self.fault_hook = Some(hook);
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting to fix.
    pub fn build(self) -> Result<Runtime, Error> {
        if self.consumers.is_empty() {
            return Err(Error::Config("no consumers: add one with `.consume(queue, handler)`".into()));
        }
        if self.concurrency == 0 || self.concurrency > usize::from(u16::MAX) {
            return Err(Error::Config(format!("concurrency must be 1..=65535, not {}", self.concurrency)));
        }
        let mut seen = std::collections::HashSet::new();
        for (queue, _, _) in &self.consumers {
            if !seen.insert(queue.as_str()) {
                return Err(Error::Config(format!(
                    "queue '{queue}' has two consumers; give each queue one handler"
                )));
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

    /// The outcome counters, live while the runtime runs.
    pub fn stats(&self) -> Arc<Stats> {
        Arc::clone(&self.stats)
    }

    /// Connects, declares the topology, consumes until `shutdown` is cancelled, then
    /// drains: consumers are cancelled, in-flight deliveries get the shutdown deadline
    /// to finish (and are acked if they commit), the rest return to the queue.
    ///
    /// # Errors
    /// Start-up failures, or [`Error::ConsumerLost`] when a consumer's channel or
    /// connection dies (after draining what can be drained).
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future drops the connection, so the broker
    /// requeues every unacked delivery (safe, but not graceful). Cancel `shutdown`
    /// instead.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let b = self.builder;
        let connection = Connection::connect(&b.amqp_url, ConnectionProperties::default())
            .await
            .map_err(|source| Error::AmqpConnect { url: redact(&b.amqp_url), source })?;
        let amqp = |action: &str| {
            let action = action.to_owned();
            move |source| Error::Amqp { action, source }
        };

        let setup = connection.create_channel().await.map_err(amqp("open a channel"))?;
        b.topology.declare(&setup).await?;

        let pool = build_pool(&b.database_url, b.concurrency)?;
        drop(pool.get().await.map_err(|err| Error::DatabaseConnect {
            url: redact(&b.database_url),
            message: err.to_string(),
        })?);

        let publisher = connection.create_channel().await.map_err(amqp("open the publisher channel"))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp("enable publisher confirms"))?;

        let abandon = CancellationToken::new();
        let shared = Arc::new(Shared {
            pool,
            publisher: publisher.clone(),
            limits: InputLimits { max_body_bytes: b.max_body_bytes },
            handler_timeout: b.handler_timeout,
            database_retry_limit: b.database_retry_limit,
            frame_max: connection.configuration().frame_max(),
            on_conflict: b.on_conflict,
            stats: Arc::clone(&self.stats),
            observer: b.observer.clone(),
            abandon: abandon.clone(),
            #[cfg(feature = "fault-injection")]
            fault_hook: b.fault_hook.clone(),
        });

        let prefetch = u16::try_from(b.concurrency).unwrap_or(u16::MAX);
        let permits = Arc::new(Semaphore::new(b.concurrency));
        let tracker = TaskTracker::new();
        let stop = shutdown.child_token();
        let mut loops = tokio::task::JoinSet::new();
        for (index, (queue, handler, retry)) in b.consumers.into_iter().enumerate() {
            let declared =
                b.topology.find_queue(&queue).cloned().unwrap_or_else(|| Queue::new(queue.clone()));
            let retry = retry.unwrap_or_else(|| b.retry.clone());
            for (name, delay) in retry.wait_queues(&queue) {
                declared.declare_wait_queue(&setup, &name, delay).await?;
            }
            let channel = connection.create_channel().await.map_err(amqp("open a consumer channel"))?;
            // Per-consumer QoS: global QoS on a quorum queue is a connection error.
            channel
                .basic_qos(prefetch, BasicQosOptions { global: false })
                .await
                .map_err(amqp("set the prefetch"))?;
            let tag = format!("idemq-{}-{}-{index}", handler.name(), std::process::id());
            let stream = channel
                .basic_consume(
                    queue.as_str().into(),
                    tag.as_str().into(),
                    BasicConsumeOptions { no_ack: false, ..Default::default() },
                    FieldTable::default(),
                )
                .await
                .map_err(amqp(&format!("consume queue '{queue}'")))?;
            tracing::info!(queue = %queue, handler = handler.name(), "consuming");
            let consumer = Arc::new(Consumer {
                queue,
                dead_letter_queue: declared.dead_letter.clone(),
                delivery_limit: declared.delivery_limit,
                retry,
                handler,
                channel,
                shared: Arc::clone(&shared),
            });
            loops.spawn(consume(consumer, stream, tag, Arc::clone(&permits), tracker.clone(), stop.clone()));
        }

        let _ = setup.close(200, "declared".into()).await;

        // The first consumer that ends on its own (channel or connection lost) stops all.
        let mut lost = None;
        while let Some(ended) = loops.join_next().await {
            if let Ok(Err(err)) = ended {
                lost.get_or_insert(err);
                stop.cancel();
            }
        }

        tracker.close();
        if tokio::time::timeout(b.shutdown_deadline, tracker.wait()).await.is_err() {
            tracing::warn!(deadline = ?b.shutdown_deadline, "shutdown deadline passed; undecided deliveries return to the queue");
            abandon.cancel();
            if tokio::time::timeout(Duration::from_secs(2), tracker.wait()).await.is_err() {
                tracing::warn!(
                    "handlers still running after the deadline are cut off; their transactions roll back"
                );
            }
        }
        let _ = publisher.close(200, "shutdown".into()).await;
        let _ = connection.close(200, "shutdown".into()).await;
        match lost {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

/// One consumer's intake loop: take a permit, spawn the delivery, repeat.
async fn consume(
    consumer: Arc<Consumer>,
    mut stream: lapin::Consumer,
    tag: String,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    stop: CancellationToken,
) -> Result<(), Error> {
    let lost = |reason: String| Error::ConsumerLost { queue: consumer.queue.clone(), reason };
    loop {
        let permit = tokio::select! {
            () = stop.cancelled() => break,
            permit = Arc::clone(&permits).acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            next = stream.next() => match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(err)) => return Err(lost(err.to_string())),
                None => return Err(lost("the broker cancelled the consumer or the channel closed".into())),
            },
        };
        let consumer = Arc::clone(&consumer);
        tracker.spawn(async move {
            consumer.process(delivery).await;
            drop(permit);
        });
    }
    // Stop intake; prefetched deliveries not yet taken return when the channel closes.
    let _ = consumer.channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await;
    Ok(())
}

fn build_pool(database_url: &str, size: usize) -> Result<Pool<AsyncPgConnection>, Error> {
    let mut config = ManagerConfig::default();
    // Broken connections are detected and dropped by the delivery state machine, so
    // the per-checkout `SELECT 1` of `Verified` buys nothing but latency.
    config.recycling_method = RecyclingMethod::Fast;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(|err| Error::DatabaseConnect { url: redact(database_url), message: err.to_string() })
}

/// A token cancelled by the first SIGINT or SIGTERM; a second signal exits the
/// process at once (safe: the broker redelivers whatever was unacked).
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
