//! One connection session: connect, declare, consume — until the broker goes away or
//! shutdown begins. The runtime's supervisor runs sessions one after another,
//! reconnecting with backoff, so a broker restart or a dropped connection needs no
//! restart by hand.
//!
//! Each session has two connections: one consumes (and acks), one publishes retry
//! and dead-letter copies. RabbitMQ blocks a *publishing* connection under a resource
//! alarm (`connection.blocked`) and stops reading from it; on a shared connection the
//! acks would stall too. Kept apart, consumption goes on while copies wait.
//!
//! A session runs in three phases ([`run`]): start (connect both, declare the
//! topology, start every consumer's intake: [`start`]), watch (until shutdown or a
//! loss: [`watch`]), and end (stop the intakes; after a loss, close what is open).
//! Each consumer's intake — its stream of deliveries into batches — is in `intake`,
//! with its pause while the handler's kill switch is open in `pause`; why a session
//! was lost, typed, in `loss`.

mod intake;
mod loss;
mod pause;
mod route;
mod source;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::observe::ConnectionEvent;
use crate::base::retry::RetryPolicy;
use crate::base::width::Width;
use crate::broker::acks::Acks;
use crate::broker::topology::{Queue, Topology};
use crate::engine::delivery::{Consumer, Shared, Unsent};
use crate::error::Error;
use crate::handler::prepare::ErasedHandler;
use intake::Intake;
pub(crate) use loss::Loss;

/// The longest a session may take to connect, declare and start consuming.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest a close or cancel handshake is awaited; past it the peer is gone.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Awaits a close/cancel handshake for at most [`CLOSE_TIMEOUT`], ignoring its result.
async fn bounded<T>(handshake: impl std::future::Future<Output = T>) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, handshake).await;
}

/// What a consumed queue needs, for every session.
pub(crate) struct ConsumerSpec {
    pub(crate) queue: String,
    pub(crate) declared: Queue,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// The handler's dedup scope (see `Consumer::scope`).
    pub(crate) scope: String,
    pub(crate) retry: RetryPolicy,
    pub(crate) on_conflict: crate::base::verdict::OnConflict,
    /// Its batches (the runtime's, capped by the handler's `batch = N`).
    pub(crate) batch: crate::engine::delivery::BatchLimits,
    /// Enough for every transaction to fill a batch.
    pub(crate) prefetch: u16,
    /// Its handler's rate limit, if any (one bucket per handler, kept across sessions).
    pub(crate) rate: Option<Arc<crate::engine::flow::Rate>>,
    /// Its kill switch (one that never trips if it has none), kept across sessions.
    pub(crate) flow: Arc<crate::engine::flow::Flow>,
}

/// What every session shares.
pub(crate) struct SessionContext {
    /// The broker addresses (heartbeat set), tried in turn.
    pub(crate) brokers: crate::broker::brokers::Brokers,
    pub(crate) topology: Topology,
    pub(crate) consumers: Vec<ConsumerSpec>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) tracker: TaskTracker,
    /// Cancelled when in-flight deliveries must be cut off (after the shutdown deadline).
    pub(crate) hard_stop: CancellationToken,
}

impl SessionContext {
    pub(crate) fn notify(&self, event: &ConnectionEvent) {
        self.shared.observers.connection(event);
    }

    fn intake(&self) -> Intake {
        Intake {
            permits: Arc::clone(&self.permits),
            tracker: self.tracker.clone(),
            hard_stop: self.hard_stop.clone(),
        }
    }
}

/// A session's two connections and the channels open on them.
pub(crate) struct Connections {
    consuming: Connection,
    publishing: Connection,
    channels: Vec<Channel>,
    /// The settling state of each consumer channel.
    acks: Vec<Arc<Acks>>,
    /// The broker address both are connected to.
    node: usize,
}

impl Connections {
    /// Sends the acks still deferred on each consumer channel (see
    /// [`Acks::flush`]): on a shutdown, once every delivery is settled and before the
    /// channels close.
    pub(crate) async fn flush_acks(&self) {
        for acks in &self.acks {
            acks.flush().await;
        }
    }

    /// Closes the channels, then the connections (each handshake bounded). Closing
    /// the channels first keeps lapin's own close from racing channel closes against
    /// the connection close, which it reports as errors.
    pub(crate) async fn close(self, reason: &str) {
        for channel in &self.channels {
            bounded(channel.close(200, reason.into())).await;
        }
        bounded(self.consuming.close(200, reason.into())).await;
        bounded(self.publishing.close(200, reason.into())).await;
    }
}

/// How a session ended.
pub(crate) enum SessionEnd {
    /// Shutdown began; consumers are cancelled. The connections (if the session got
    /// that far) stay open so that in-flight deliveries can still be acked; close
    /// them after draining.
    Shutdown(Option<Box<Connections>>),
    /// The connection or a channel was lost (both connections are closed), or
    /// could not be made: reconnect. `connected` tells which.
    Lost { loss: Loss, connected: bool },
    /// A failure that reconnecting cannot fix (a topology mismatch; at start-up,
    /// refused credentials, a missing vhost or queue: see [`brokers::unreachable`]).
    ///
    /// [`brokers::unreachable`]: crate::broker::brokers::unreachable
    Fatal(Error),
}

/// Runs session number `session` until shutdown or loss. Connecting and declaring
/// may take [`START_TIMEOUT`], or until `cut_at` if that comes first (the startup
/// timeout's deadline).
pub(crate) async fn run(
    ctx: &SessionContext,
    session: u64,
    stop: &CancellationToken,
    cut_at: Option<tokio::time::Instant>,
) -> SessionEnd {
    // Connecting and declaring are bounded, and give way to shutdown: a broker that
    // accepts TCP but never answers (still booting, or a black hole) must not hold
    // the runtime. Running out of time is an outage like any other: try again.
    let limit = cut_at.map_or(START_TIMEOUT, |cut_at| {
        cut_at.saturating_duration_since(tokio::time::Instant::now()).min(START_TIMEOUT)
    });
    let started = tokio::select! {
        () = stop.cancelled() => return SessionEnd::Shutdown(None),
        started = tokio::time::timeout(limit, start(ctx, session)) => started,
    };
    let Started { connections, mut loops, session_stop } = match started {
        Ok(Ok(started)) => started,
        Ok(Err(end)) => return end,
        Err(_elapsed) => {
            return SessionEnd::Lost {
                loss: Loss::Start(Error::StartTimeout { after: limit }),
                connected: false,
            }
        }
    };
    if session > 1 {
        crate::base::log::info!(session, "reconnected; consuming again");
    }
    ctx.notify(&ConnectionEvent::Connected { session });
    let watched = watch(ctx, &connections, &mut loops, stop).await;
    session_stop.cancel();
    while loops.join_next().await.is_some() {}
    let Some(loss) = watched else {
        // The connections stay open: in-flight deliveries may still be acked.
        return SessionEnd::Shutdown(Some(Box::new(connections)));
    };
    if let Loss::ConsumerTimeout { .. } = loss {
        crate::base::log::error!(session, reason = %loss.report(), "{}", crate::broker::consumer_timeout::EXPLAINED);
    }
    // The next attempt starts with the next address: this one was just lost.
    ctx.brokers.lost(connections.node);
    // Whatever is still open goes: unacked deliveries return to the queue, and
    // in-flight tasks of this session can no longer ack (their acker's channel is
    // closed), so the broker redelivers them to the next session.
    connections.close("reconnecting").await;
    SessionEnd::Lost { loss, connected: true }
}

/// Watches a started session until shutdown (`None`) or its loss: the publishing
/// channel closed, an intake ended, either connection failed. Tells the observers
/// when the broker blocks and unblocks publishing.
async fn watch(
    ctx: &SessionContext,
    connections: &Connections,
    loops: &mut JoinSet<Loss>,
    stop: &CancellationToken,
) -> Option<Loss> {
    let mut consuming_events = connections.consuming.events_listener();
    let mut publishing_events = connections.publishing.events_listener();
    // The publishing channel (copies): closed by the broker, or by a consumer after a
    // nacked copy (see `settle_copy`).
    let publisher = &connections.channels[0];
    loop {
        tokio::select! {
            () = closed(publisher) => return Some(Loss::PublishingChannelClosed),
            () = stop.cancelled() => return None,
            Some(ended) = loops.join_next() => return Some(ended.unwrap_or_else(Loss::ConsumerTask)),
            Some(event) = consuming_events.next() => {
                // A channel the broker closes is reported here too, maybe before its
                // consumer hears of it.
                if let lapin::Event::Error(err) = event {
                    return Some(Loss::of_consuming_connection(err));
                }
            }
            Some(event) = publishing_events.next() => match event {
                lapin::Event::ConnectionBlocked(reason) => {
                    crate::base::log::warn!(%reason, "the broker blocked publishing (resource alarm); retry and dead-letter copies wait");
                    ctx.notify(&ConnectionEvent::Blocked { reason });
                }
                lapin::Event::ConnectionUnblocked => {
                    crate::base::log::info!("the broker unblocked publishing");
                    ctx.notify(&ConnectionEvent::Unblocked);
                }
                lapin::Event::Error(err) => return Some(Loss::PublishingConnection(err)),
                _ => {}
            },
        }
    }
}

/// A started session: its connections, its intake loops and what stops them.
struct Started {
    connections: Connections,
    loops: JoinSet<Loss>,
    session_stop: CancellationToken,
}

/// Connects both connections, declares the topology and starts every consumer.
async fn start(ctx: &SessionContext, session: u64) -> Result<Started, SessionEnd> {
    // Until a session has connected (session 1 is every attempt before that: the
    // number grows once one has), what waiting cannot mend is reported at once, with
    // the fix; an unreachable broker is waited for. Later, everything is retried.
    let first = session == 1;
    let fail = |err: Error| {
        // A topology mismatch cannot be fixed by reconnecting, ever.
        if is_mismatch(&err) || (first && !crate::broker::brokers::unreachable(&err)) {
            SessionEnd::Fatal(err)
        } else {
            SessionEnd::Lost { loss: Loss::Start(err), connected: false }
        }
    };
    // One node that answers for both connections.
    let (consuming, node) = ctx.brokers.connect("consumer").await.map_err(fail)?;
    // The publishing connection opens while the topology is declared on the other.
    let (publishing, declared) =
        tokio::join!(ctx.brokers.connect_to(node, "publisher"), declare(ctx, &consuming));
    let publishing = match (publishing, declared) {
        (Ok(publishing), Ok(())) => Ok(publishing),
        (Ok(publishing), Err(err)) => {
            bounded(publishing.close(200, "start-up failed".into())).await;
            Err(err)
        }
        (Err(err), Ok(())) => Err(err),
        // Both failed: a mismatch is fatal whatever else failed; otherwise the
        // connection's error says best whether the broker is out of reach (waited for).
        (Err(connect), Err(declare)) => Err(if is_mismatch(&declare) { declare } else { connect }),
    };
    let publishing = match publishing {
        Ok(publishing) => publishing,
        Err(err) => {
            bounded(consuming.close(200, "start-up failed".into())).await;
            ctx.brokers.lost(node);
            return Err(fail(err));
        }
    };
    match begin(ctx, session, &consuming, &publishing).await {
        Ok((loops, session_stop, channels, acks)) => Ok(Started {
            connections: Connections { consuming, publishing, channels, acks, node },
            loops,
            session_stop,
        }),
        Err(err) => {
            bounded(consuming.close(200, "start-up failed".into())).await;
            bounded(publishing.close(200, "start-up failed".into())).await;
            ctx.brokers.lost(node);
            Err(fail(err))
        }
    }
}

/// Whether `err` says the broker holds a queue or exchange with other arguments.
fn is_mismatch(err: &Error) -> bool {
    matches!(err, Error::QueueMismatch { .. } | Error::ExchangeMismatch { .. })
}

/// Declares the topology, with the wait queues of every consumer's retry policy, on
/// the session's consuming connection.
async fn declare(ctx: &SessionContext, consuming: &Connection) -> Result<(), Error> {
    let waits: Vec<_> = ctx
        .consumers
        .iter()
        .flat_map(|spec| {
            spec.retry.wait_queues(&spec.queue).into_iter().map(|(name, delay)| (&spec.declared, name, delay))
        })
        .collect();
    let consumed = |queue: &str| ctx.consumers.iter().any(|spec| spec.queue == queue);
    ctx.topology.declare_available(consuming, &waits, consumed).await
}

/// On a session's two connections, its topology declared: opens the publisher
/// channel (with confirms) and starts every consumer's intake. The intake loops,
/// what stops them, the channels opened (the publisher's first) and the consumer
/// channels' settling states.
async fn begin(
    ctx: &SessionContext,
    session: u64,
    consuming: &Connection,
    publishing: &Connection,
) -> Result<(JoinSet<Loss>, CancellationToken, Vec<Channel>, Vec<Arc<Acks>>), Error> {
    let publisher = publishing.create_channel().await.map_err(amqp("open the publisher channel"))?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(amqp("enable publisher confirms"))?;

    let session_stop = CancellationToken::new();
    let mut loops = JoinSet::new();
    let mut channels = vec![publisher.clone()];
    let mut settling = Vec::new();
    let on = On { ctx, session, publisher: &publisher, frame_max: publishing.configuration().frame_max() };
    for (index, specs) in by_queue(&ctx.consumers).into_iter().enumerate() {
        let tag = format!("idemq-{}-{}-{session}-{index}", specs[0].handler.name(), std::process::id());
        // Per-consumer QoS: global QoS on a quorum queue is a connection error. A
        // queue several handlers consume has room for each one's batches.
        let prefetch = specs.iter().fold(0_u16, |sum, spec| sum.saturating_add(spec.prefetch));
        let (channel, stream) = open_consumer(consuming, &specs[0].queue, prefetch, &tag).await?;
        channels.push(channel.clone());
        let acks = Arc::new(Acks::new(prefetch));
        Acks::flush_overdue_acks(&acks);
        settling.push(Arc::clone(&acks));
        if let [spec] = specs[..] {
            crate::base::log::info!(queue = %spec.queue, handler = spec.handler.name(), session, "consuming");
            let consumer = on.consumer(spec, Arc::clone(&spec.handler), &spec.scope, channel, acks);
            let source = source::Source::Broker(stream);
            loops.spawn(intake::consume(consumer, source, tag, ctx.intake(), session_stop.clone()));
            continue;
        }
        let mut routes = Vec::with_capacity(specs.len());
        for spec in &specs {
            // Checked at build(): every handler of a shared queue has a type of its own.
            let name = spec.handler.amqp_type().unwrap_or_default();
            crate::base::log::info!(queue = %spec.queue, handler = spec.handler.name(), message_type = name, session, "consuming");
            routes.push((
                name,
                on.consumer(spec, Arc::clone(&spec.handler), &spec.scope, channel.clone(), Arc::clone(&acks)),
            ));
        }
        let unroutable: Arc<dyn ErasedHandler> = Arc::new(route::Unroutable {
            queue: specs[0].queue.clone(),
            types: routes.iter().map(|(name, _)| *name).collect(),
        });
        let unroutable = on.consumer(specs[0], unroutable, route::UNROUTABLE, channel, acks);
        loops.spawn(intake::consume_routed(
            routes,
            unroutable,
            stream,
            tag,
            ctx.intake(),
            session_stop.clone(),
        ));
    }
    Ok((loops, session_stop, channels, settling))
}

/// The consumers of each consumed queue, in registration order: one, or several
/// (one per message type: see `intake::consume_routed`).
fn by_queue(consumers: &[ConsumerSpec]) -> Vec<Vec<&ConsumerSpec>> {
    let mut queues: Vec<Vec<&ConsumerSpec>> = Vec::new();
    for spec in consumers {
        match queues.iter_mut().find(|specs| specs[0].queue == spec.queue) {
            Some(specs) => specs.push(spec),
            None => queues.push(vec![spec]),
        }
    }
    queues
}

/// Opens a channel on `consuming` with `prefetch` and consumes `queue` as `tag`:
/// the channel and its stream of deliveries.
async fn open_consumer(
    consuming: &Connection,
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> Result<(Channel, lapin::Consumer), Error> {
    let channel = consuming.create_channel().await.map_err(amqp("open a consumer channel"))?;
    channel.basic_qos(prefetch, BasicQosOptions { global: false }).await.map_err(amqp("set the prefetch"))?;
    let stream = channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions { no_ack: false, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .map_err(amqp(&format!("consume queue '{queue}'")))?;
    Ok((channel, stream))
}

/// What a session's consumers are made on.
struct On<'a> {
    ctx: &'a SessionContext,
    session: u64,
    publisher: &'a Channel,
    frame_max: u32,
}

impl On<'_> {
    /// `spec`'s consumer, running `handler` under `scope`, on `channel`, settling
    /// through `acks` (one per channel).
    fn consumer(
        &self,
        spec: &ConsumerSpec,
        handler: Arc<dyn ErasedHandler>,
        scope: &str,
        channel: Channel,
        acks: Arc<Acks>,
    ) -> Arc<Consumer> {
        Arc::new(Consumer {
            queue: spec.queue.clone(),
            dead_letter_queue: spec.declared.dead_letter.clone(),
            delivery_limit: spec.declared.delivery_limit,
            retry: spec.retry.clone(),
            handler,
            scope: scope.to_owned(),
            channel,
            acks,
            publisher: self.publisher.clone(),
            tracker: self.ctx.tracker.clone(),
            frame_max: self.frame_max,
            session: self.session,
            width: Width::new(spec.batch.pipelines),
            pace: Default::default(),
            collisions: Default::default(),
            sends: Default::default(),
            unsent: Unsent::new(&spec.queue, self.session),
            batch: spec.batch,
            on_conflict: spec.on_conflict,
            flow: Arc::clone(&spec.flow),
            rate: spec.rate.clone(),
            shared: Arc::clone(&self.ctx.shared),
        })
    }
}

/// An [`Error::Amqp`] of `action`, the client's error its source.
fn amqp(action: &str) -> impl FnOnce(lapin::Error) -> Error {
    let action = action.to_owned();
    move |source| Error::Amqp { action, source }
}

/// Resolves once `channel` is no longer usable (polled: lapin has no close event
/// per channel).
async fn closed(channel: &Channel) {
    while channel.status().connected() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
