//! [`Runtime::run`] in four phases, over one [`TaskTracker`] for the subsystems
//! beside the consumers and the tokens they stop on (as tokio-util's `TaskTracker`
//! docs show: spawn on the tracker, cancel the token, `close()`, `wait()`):
//!
//! 1. **assemble**: observers, the metrics server, the pool (a database outage is
//!    waited out here), what every delivery shares;
//! 2. **spawn**: on the tracker, the relay (or, with it off, the `NOTIFY` sender),
//!    the outbox backlog gauge and the retention sweep;
//! 3. **supervise**: broker sessions one after another, reconnecting, until the
//!    shutdown token or a fatal fault stops them;
//! 4. **drain**: in-flight deliveries get the shutdown deadline, the connections
//!    close, then the tracker's tasks stop and are waited for, the relay last (it
//!    publishes what the drain committed).
//!
//! Two tokens, in order: `stop` (a child of the caller's shutdown token, also
//! cancelled by a fatal fault) ends intake, the sweep and the gauge; `relay_stop`,
//! cancelled only after the drain, ends the relay.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::builder::{Registration, RuntimeBuilder};
use super::{dedup_scope, with_heartbeat, Runtime};
use crate::base::backoff::Backoff;
use crate::base::observe::{ConnectionEvent, Observe, Observers};
use crate::base::BoxFuture;
use crate::broker::brokers::Brokers;
use crate::engine::delivery::{BatchLimits, Fatal, Shared};
use crate::engine::flow::{Flow, Rate};
use crate::engine::relay::{relay_pool, OutboxSignal, Worker};
use crate::engine::session::{self, Connections, ConsumerSpec, SessionContext, SessionEnd};
use crate::engine::startup::Startup;
use crate::engine::stream::{BrokerLink, Share, StreamContext, StreamSpec};
use crate::error::{redact, Dependency, Error};
use crate::handler::prepare::InputLimits;
use crate::store::db::{self, SessionLimits};
use crate::store::retention::CheckedRetention;

impl Runtime {
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
    ///
    /// The future is boxed so that the runtime is compiled once, in idemq: an
    /// `async fn` here would be compiled again, whole, in every crate that awaits it
    /// (a release build does not share a future's code between crates).
    pub fn run(self, shutdown: CancellationToken) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(self.run_until(shutdown))
    }

    async fn run_until(self, shutdown: CancellationToken) -> Result<(), Error> {
        announce(&self.builder);
        let Some(assembly) = Assembly::assemble(self, &shutdown).await? else {
            // Shut down while start-up waited for the database: nothing was started.
            crate::base::log::info!("stopped before consuming: shut down while waiting for the database");
            return Ok(());
        };
        let mut running = assembly.spawn()?;
        let (result, connections, started) = running.supervise().await;
        let result = running.drain(result, connections, started).await;
        if result.is_ok() {
            // A failure is the caller's to report (the CLI prints it once).
            crate::base::log::info!(
                "stopped: in-flight deliveries settled or returned to the queue, connections closed"
            );
        }
        result
    }
}

/// The line an operator looks for first: what this process consumes, with which
/// handler, from which broker into which database (passwords redacted).
fn announce(b: &RuntimeBuilder) {
    let consumers: Vec<String> =
        b.consumers.iter().map(|r| format!("{} ({})", r.queue, r.handler.name())).collect();
    crate::base::log::info!(
        consumers = %consumers.join(", "),
        broker = %redact(&b.amqp_url),
        database = %redact(&b.database_url),
        concurrency = b.concurrency,
        batch_size = b.batch_size,
        "starting"
    );
}

/// Phase 1: what the subsystems share, made before any of them is spawned.
struct Assembly {
    builder: RuntimeBuilder,
    shared: Arc<Shared>,
    startup: Startup,
    retention: Option<CheckedRetention>,
    /// The runtime's own relay's wake-up; `None` with the relay off.
    relay_wake: Option<Arc<crate::engine::relay::Wake>>,
    #[cfg(feature = "metrics")]
    metrics: Option<Arc<crate::engine::metrics::Metrics>>,
    /// Serves `/metrics` and health from the start: `/healthz` answers while start-up
    /// waits, and `/readyz` says what for. Stopped when dropped.
    #[cfg(feature = "metrics")]
    serving: Option<crate::engine::metrics::Serving>,
}

impl Assembly {
    /// `None` when `shutdown` was cancelled while waiting for the database.
    async fn assemble(runtime: Runtime, shutdown: &CancellationToken) -> Result<Option<Self>, Error> {
        let Runtime { builder: mut b, stats } = runtime;
        // `build` refused a retention too short for the retry policies; the sweep takes
        // only what that check lets through, so it is made again (before anything starts).
        let retention =
            b.retention.take().map(|retention| retention.check(&b.retry_policies())).transpose()?;
        #[cfg(feature = "metrics")]
        let metrics = b.http_addr.map(|_| {
            let consumers: Vec<(String, &'static str)> =
                b.consumers.iter().map(|r| (r.queue.clone(), r.handler.name())).collect();
            crate::engine::metrics::Metrics::new(&consumers)
        });
        // The built-in stats are a subscriber like any other, heard first.
        let mut observers = Observers::default();
        observers.push(stats as Arc<dyn Observe>);
        for observer in b.observers.0.iter() {
            observers.push(Arc::clone(observer));
        }
        #[cfg(feature = "metrics")]
        if let Some(metrics) = &metrics {
            observers.push(Arc::clone(metrics) as Arc<dyn Observe>);
        }
        #[cfg(feature = "metrics")]
        let serving = match (b.http_addr, &metrics) {
            (Some(addr), Some(metrics)) => {
                Some(crate::engine::metrics::serve(addr, Arc::clone(metrics), b.pages.clone())?)
            }
            _ => None,
        };

        let mut startup = Startup::new(b.startup_timeout, b.reconnect_max, observers.clone());
        let limits = SessionLimits::for_handler_timeout(b.handler_timeout);
        let pool =
            db::build_pool(&b.database_url, b.concurrency, limits).map_err(|err| Error::DatabaseConnect {
                url: redact(&b.database_url),
                message: err.to_string(),
                cause: Some(Box::new(err)),
            })?;
        if !startup.database(&pool, &b.database_url, shutdown).await? {
            return Ok(None);
        }
        crate::engine::startup::replication(&pool, b.replication_check).await?;
        let relay_wake = b.relay.map(|_| Arc::new(crate::engine::relay::Wake::default()));
        let shared = Arc::new(Shared {
            pool,
            limits: InputLimits { max_body_bytes: b.max_body_bytes },
            handler_timeout: b.handler_timeout,
            statement_deadline: limits.client_deadline(),
            database_retry_limit: b.database_retry_limit,
            observers,
            outbox: OutboxSignal::new(relay_wake.clone()),
            turns: tokio::sync::RwLock::new(()),
            unstarted: Default::default(),
            // Consumers stop on the caller's signal, or when a delivery meets a fault no
            // retry can fix (then `run` returns that error after draining).
            fatal: Fatal::new(shutdown.child_token()),
            fault_hook: b.fault_hook.clone(),
        });
        Ok(Some(Self {
            builder: b,
            shared,
            startup,
            retention,
            relay_wake,
            #[cfg(feature = "metrics")]
            metrics,
            #[cfg(feature = "metrics")]
            serving,
        }))
    }

    /// Phase 2: the subsystems beside the consumers, on one tracker.
    fn spawn(self) -> Result<Running, Error> {
        let Self { builder: mut b, shared, startup, retention, relay_wake, .. } = self;
        let background = TaskTracker::new();
        let stop = shared.fatal.stop.clone();
        // The relay outlives the consumers' drain (it publishes what they commit) and
        // stops after it; without one, relays elsewhere are notified.
        let relay_stop = CancellationToken::new();
        let relay = match (b.relay, relay_wake) {
            (Some(settings), Some(wake)) => {
                let worker = Worker {
                    pool: relay_pool(&b.database_url)?,
                    brokers: Brokers::parse(&b.amqp_url)?,
                    database_url: b.database_url.clone(),
                    settings,
                    wake,
                    observers: shared.observers.clone(),
                };
                background.spawn(worker.run(relay_stop.clone()))
            }
            _ => {
                let (shared, stop) = (Arc::clone(&shared), relay_stop.clone());
                background
                    .spawn(async move { shared.outbox.notify_elsewhere(shared.pool.clone(), stop).await })
            }
        };
        #[cfg(feature = "metrics")]
        if let Some(metrics) = &self.metrics {
            background.spawn(watch_backlog(Arc::clone(metrics), shared.pool.clone(), stop.clone()));
        }
        if let Some(retention) = retention {
            let (shared, stop) = (Arc::clone(&shared), stop.clone());
            background.spawn(async move { sweep_every(&shared, retention, stop).await });
        }
        let (amqp_url, reconnect_max, shutdown_deadline) =
            (b.amqp_url.clone(), b.reconnect_max, b.shutdown_deadline);
        let StreamConsumers { specs: streams, shares, ctx: stream_ctx } = stream_consumers(&mut b, &shared)?;
        let ctx = session_context(b, shared)?;
        if !streams.is_empty() {
            let (link, brokers, stop) =
                (Arc::clone(&stream_ctx.link), Arc::clone(&stream_ctx.brokers), stop.clone());
            ctx.tracker.spawn(async move { link.keep(&brokers, stop).await });
        }
        for share in shares {
            let (url, link, stop) =
                (stream_ctx.database_url.clone(), Arc::clone(&stream_ctx.link), stop.clone());
            ctx.tracker.spawn(async move { share.keep(&url, &link, stop).await });
        }
        for spec in streams {
            // On the sessions' tracker: the drain gives them the shutdown deadline, as
            // it gives deliveries, then cuts them off.
            let (stream_ctx, stop, hard_stop) = (stream_ctx.clone(), stop.clone(), ctx.hard_stop.clone());
            ctx.tracker.spawn(async move {
                tokio::select! {
                    () = crate::engine::stream::consume(spec, stream_ctx, stop) => {}
                    () = hard_stop.cancelled() => {}
                }
            });
        }
        Ok(Running {
            ctx,
            startup,
            amqp_url,
            reconnect_max,
            shutdown_deadline,
            stop,
            background,
            relay,
            relay_stop,
            #[cfg(feature = "metrics")]
            serving: self.serving,
        })
    }
}

/// What every broker session shares: the consumers, with the runtime's settings
/// and each handler's own options resolved.
fn session_context(b: RuntimeBuilder, shared: Arc<Shared>) -> Result<SessionContext, Error> {
    let switches: Vec<_> = b.consumers.iter().map(|r| b.kill_switch_of(r.handler.name(), &r.queue)).collect();
    // One bucket per handler, shared by its queues and kept across sessions.
    let mut rates: HashMap<&'static str, Arc<Rate>> = HashMap::new();
    let limits: Vec<_> = b
        .consumers
        .iter()
        .map(|r| {
            let name = r.handler.name();
            let rate = b.rate_limit_of(name).map(|per_second| {
                Arc::clone(rates.entry(name).or_insert_with(|| Arc::new(Rate::new(per_second))))
            });
            (rate, b.concurrency_of(name))
        })
        .collect();
    if b.kill_switch.is_some() {
        for (r, switch) in b.consumers.iter().zip(&switches) {
            if switch.is_none() && b.handlers_of(&r.queue) > 1 {
                crate::base::log::warn!(
                    queue = %r.queue,
                    handler = r.handler.name(),
                    "no kill switch for this handler: its queue is shared with other handlers (pausing it would pause them all)"
                );
            }
        }
    }
    let consumers = b
        .consumers
        .into_iter()
        .zip(switches.into_iter().zip(limits))
        .map(|(registration, (switch, (rate, concurrency)))| {
            // The handler's own options (`batch = N`, `retry(..)`, `on_conflict`)
            // override the runtime's; `consume_with`'s policy overrides both.
            let (retry, size) = (registration.retry_policy(&b.retry), registration.batch_size(b.batch_size));
            let Registration { queue, handler, .. } = registration;
            ConsumerSpec {
                declared: b.topology.queue_or_default(&queue),
                retry,
                on_conflict: handler.on_conflict().unwrap_or(b.on_conflict),
                batch: BatchLimits { size, linger: b.linger, pipelines: concurrency },
                rate: rate.clone(),
                // A rate-limited handler holds at most ten seconds' worth (or a
                // batch): what waits longer stays in the queue, far from the
                // broker's consumer_timeout.
                prefetch: b.prefetch.unwrap_or_else(|| {
                    let window = rate
                        .as_ref()
                        .map_or(usize::MAX, |rate| rate.per_second().saturating_mul(10).max(size));
                    u16::try_from(concurrency.saturating_mul(size).min(window)).unwrap_or(u16::MAX)
                }),
                scope: dedup_scope(b.namespace.as_deref(), handler.name()),
                flow: Arc::new(Flow::new(switch, handler.name(), &queue, shared.observers.clone())),
                queue,
                handler,
            }
        })
        .collect();
    Ok(SessionContext {
        brokers: Brokers::parse(&b.amqp_url)?.map(|url| with_heartbeat(url, b.heartbeat)),
        topology: b.topology,
        consumers,
        shared,
        permits: Arc::new(Semaphore::new(b.concurrency)),
        tracker: TaskTracker::new(),
        hard_stop: CancellationToken::new(),
    })
}

/// The consumers of streams, taken out of `b`'s (the sessions consume the queues),
/// with their settings resolved, and what they share.
fn stream_consumers(b: &mut RuntimeBuilder, shared: &Arc<Shared>) -> Result<StreamConsumers, Error> {
    let (streams, queues): (Vec<Registration>, Vec<Registration>) =
        std::mem::take(&mut b.consumers).into_iter().partition(|r| b.is_stream(&r.queue));
    b.consumers = queues;
    let specs = streams
        .into_iter()
        .map(|registration| {
            let (retry, batch_size) =
                (registration.retry_policy(&b.retry), registration.batch_size(b.batch_size));
            let Registration { queue, handler, .. } = registration;
            StreamSpec {
                declared: b.topology.queue_or_default(&queue),
                retry,
                batch_size,
                linger: b.linger,
                prefetch: b
                    .prefetch
                    .unwrap_or_else(|| u16::try_from(batch_size.saturating_mul(2)).unwrap_or(u16::MAX)),
                scope: dedup_scope(b.namespace.as_deref(), handler.name()),
                handler,
                share: None,
            }
        })
        .collect::<Vec<_>>();
    let (specs, shares) = share_streams(specs);
    let ctx = StreamContext {
        brokers: Arc::new(Brokers::parse(&b.amqp_url)?.map(|url| with_heartbeat(url, b.heartbeat))),
        database_url: b.database_url.clone(),
        shared: Arc::clone(shared),
        reconnect_max: b.reconnect_max,
        link: Arc::new(BrokerLink::new(b.release_streams_after)),
    };
    Ok(StreamConsumers { specs, shares, ctx })
}

/// The stream consumers of a runtime: their specs, the shares of handlers that
/// consume several streams (each kept by a task of its own), what they share.
struct StreamConsumers {
    specs: Vec<StreamSpec>,
    shares: Vec<Arc<Share>>,
    ctx: StreamContext,
}

/// A handler consuming several streams (partitions) shares them with the other
/// processes that do: one [`Share`] per such handler, given to its specs and
/// returned (each kept by a task of its own).
fn share_streams(mut specs: Vec<StreamSpec>) -> (Vec<StreamSpec>, Vec<Arc<Share>>) {
    let mut streams: HashMap<String, usize> = HashMap::new();
    for spec in &specs {
        *streams.entry(spec.scope.clone()).or_default() += 1;
    }
    let shares: HashMap<String, Arc<Share>> = streams
        .into_iter()
        .filter(|(_, streams)| *streams > 1)
        .map(|(scope, streams)| (scope.clone(), Arc::new(Share::new(&scope, streams))))
        .collect();
    for spec in &mut specs {
        spec.share = shares.get(&spec.scope).cloned();
    }
    (specs, shares.into_values().collect())
}

/// Phases 3 and 4: the sessions, and what runs beside them until the drain.
struct Running {
    ctx: SessionContext,
    startup: Startup,
    amqp_url: String,
    reconnect_max: Duration,
    shutdown_deadline: Duration,
    /// What the consumers stop on: the caller's shutdown, or a fatal fault.
    stop: CancellationToken,
    /// The relay, the backlog gauge and the retention sweep.
    background: TaskTracker,
    relay: JoinHandle<()>,
    relay_stop: CancellationToken,
    #[cfg(feature = "metrics")]
    serving: Option<crate::engine::metrics::Serving>,
}

/// How the sessions ended, the connections to close after the drain, and whether
/// a session ever connected and consumed.
type Supervised = (Result<(), Error>, Option<Box<Connections>>, bool);

impl Running {
    /// Phase 3: runs broker sessions until shutdown or a fatal fault, reconnecting
    /// with backoff after a loss. Sessions are numbered per session that connected:
    /// failed attempts keep the number, so session 1 is start-up, when an
    /// unreachable broker is waited for (see [`Startup`]).
    async fn supervise(&mut self) -> Supervised {
        let (ctx, stop, url) = (&self.ctx, &self.stop, self.amqp_url.as_str());
        let mut session = 1;
        let mut backoff = Backoff::new(Duration::from_millis(100), self.reconnect_max);
        let (result, connections) = loop {
            let starting = session == 1;
            if starting {
                if let Err(err) = self.startup.check_deadline(Dependency::Broker, url) {
                    break (Err(err), None);
                }
            }
            let cut_at = if starting { self.startup.cut_at(Dependency::Broker) } else { None };
            match session::run(ctx, session, stop, cut_at).await {
                SessionEnd::Shutdown(connections) => break (Ok(()), connections),
                SessionEnd::Fatal(err) => break (Err(err), None),
                SessionEnd::Lost { loss, connected: false } if starting => {
                    match self.startup.wait(Dependency::Broker, url, &loss.report(), stop).await {
                        Ok(true) => {}
                        Ok(false) => break (Ok(()), None),
                        Err(err) => break (Err(err), None),
                    }
                }
                SessionEnd::Lost { loss, connected } => {
                    let reason = loss.report();
                    if connected {
                        // Logged once per loss, not once per attempt.
                        crate::base::log::warn!(session, %reason, "connection to the broker lost; reconnecting");
                        ctx.notify(&ConnectionEvent::Lost { session, reason });
                        backoff = Backoff::new(Duration::from_millis(100), self.reconnect_max);
                        session += 1;
                    } else {
                        crate::base::log::debug!(session, %reason, attempt = backoff.attempts, "reconnect attempt failed");
                    }
                    tokio::select! {
                        () = stop.cancelled() => break (Ok(()), None),
                        () = backoff.wait() => {}
                    }
                }
            }
        };
        let started = session > 1 || connections.is_some();
        (result, connections, started)
    }

    /// Phase 4: in-flight deliveries get the shutdown deadline (then are cut off and
    /// return to the queue), the connections close, and the tracker's tasks stop
    /// and are waited for. A fatal fault a delivery raised wins over `result`.
    async fn drain(
        self,
        result: Result<(), Error>,
        connections: Option<Box<Connections>>,
        started: bool,
    ) -> Result<(), Error> {
        let Self { ctx, stop, background, relay, relay_stop, shutdown_deadline, .. } = self;
        // Already cancelled on a shutdown; not when the sessions ended by themselves
        // (the startup timeout, a fatal fault): then the stream consumers and the
        // tasks beside them must stop now, not at the shutdown deadline.
        stop.cancel();
        ctx.tracker.close();
        if tokio::time::timeout(shutdown_deadline, ctx.tracker.wait()).await.is_err() {
            crate::base::log::warn!(deadline = %crate::base::duration::human(shutdown_deadline), "shutdown deadline passed; cutting off in-flight deliveries, which return to the queue");
            ctx.hard_stop.cancel();
            ctx.tracker.wait().await;
        }
        if let Some(connections) = connections {
            connections.flush_acks().await;
            connections.close("shutdown").await;
        }
        // The sweep and the gauge stopped with the consumers; a sweep cut off loses
        // nothing: each batch is its own transaction.
        #[cfg(feature = "metrics")]
        drop(self.serving);
        relay_stop.cancel();
        if !started {
            // Stopped (or failed) before ever consuming: nothing was committed here
            // for the relay to publish, and it may be in the middle of an attempt at
            // the unreachable broker that would hold the shutdown for seconds. Its
            // rows, if any, wait in the outbox for the next relay.
            relay.abort();
        }
        match relay.await {
            Err(err) if !err.is_cancelled() => {
                crate::base::log::error!(error = %err, "the outbox relay task failed")
            }
            _ => {}
        }
        background.close();
        background.wait().await;
        match ctx.shared.fatal.take() {
            Some(fatal) => Err(fatal),
            None => result,
        }
    }
}

/// The outbox backlog, and a sign of life from the database for `/readyz`, every
/// 5 s until `stop`.
#[cfg(feature = "metrics")]
async fn watch_backlog(
    metrics: Arc<crate::engine::metrics::Metrics>,
    pool: db::Pool,
    stop: CancellationToken,
) {
    loop {
        let backlog = async {
            let mut conn = pool.get().await.ok()?;
            db::outbox_lag(&mut conn).await.ok()
        };
        let backlog = tokio::select! {
            backlog = tokio::time::timeout(Duration::from_secs(5), backlog) => backlog.ok().flatten(),
            () = stop.cancelled() => return,
        };
        metrics.set_backlog(backlog);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
            () = stop.cancelled() => return,
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
            let mut conn = shared.pool.get().await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                crate::store::retention::sweep(&mut conn, &retention).await?,
            )
        };
        tokio::select! {
            result = swept => match result {
                Ok(sweep) => {
                    crate::base::log::info!(?sweep, "retention sweep");
                    shared.observers.swept(&sweep);
                }
                Err(error) => crate::base::log::warn!(error = %crate::error::report(&*error), "the retention sweep failed; trying again later"),
            },
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(retention.retention().interval()) => {}
            () = stop.cancelled() => return,
        }
    }
}
