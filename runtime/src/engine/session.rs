//! One connection session: connect, declare, consume — until the broker goes away or
//! shutdown begins. The runtime's supervisor runs sessions one after another,
//! reconnecting with backoff, so a broker restart or a dropped connection needs no
//! restart by hand.
//!
//! Each session has two connections: one consumes (and acks), one publishes retry
//! and dead-letter copies. RabbitMQ blocks a *publishing* connection under a resource
//! alarm (`connection.blocked`) and stops reading from it; on a shared connection the
//! acks would stall too. Kept apart, consumption goes on while copies wait.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::observe::ConnectionEvent;
use crate::base::retry::RetryPolicy;
use crate::base::width::Width;
use crate::broker::acks::Acks;
use crate::broker::topology::{Queue, Topology};
use crate::engine::delivery::{Consumer, Item, Shared};
use crate::error::Error;
use crate::handler::prepare::ErasedHandler;

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
    pub(crate) on_conflict: crate::OnConflict,
    /// Its batches (the runtime's, capped by the handler's `batch = N`).
    pub(crate) batch: crate::engine::delivery::BatchLimits,
    /// Enough for every transaction to fill a batch.
    pub(crate) prefetch: u16,
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
}

/// A session's two connections and the channels open on them.
pub(crate) struct Connections {
    consuming: Connection,
    publishing: Connection,
    channels: Vec<Channel>,
    /// The broker address both are connected to.
    node: usize,
}

impl Connections {
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
    Lost { reason: String, connected: bool },
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
    let (connections, mut loops, session_stop) = match started {
        Ok(Ok(started)) => started,
        Ok(Err(end)) => return end,
        Err(_elapsed) => {
            let reason = Error::StartTimeout { after: limit }.to_string();
            return SessionEnd::Lost { reason, connected: false };
        }
    };
    if session > 1 {
        tracing::info!(session, "reconnected; consuming again");
    }
    ctx.notify(&ConnectionEvent::Connected { session });
    let mut consuming_events = connections.consuming.events_listener();
    let mut publishing_events = connections.publishing.events_listener();
    // The publishing channel (copies): closed by the broker, or by a consumer after a
    // nacked copy (see `settle_copy`).
    let publisher = connections.channels[0].clone();
    let reason = loop {
        tokio::select! {
            () = closed(&publisher) => break "the publishing channel closed".to_owned(),
            () = stop.cancelled() => {
                session_stop.cancel();
                while loops.join_next().await.is_some() {}
                return SessionEnd::Shutdown(Some(Box::new(connections)));
            }
            Some(ended) = loops.join_next() => {
                break match ended {
                    Ok(reason) => reason,
                    Err(err) => format!("a consumer task failed: {err}"),
                };
            }
            Some(event) = consuming_events.next() => {
                // A channel the broker closes is reported here too, maybe before its
                // consumer hears of it.
                if let lapin::Event::Error(err) = event {
                    break crate::broker::consumer_timeout::describe(&err)
                        .unwrap_or_else(|| format!("the consuming connection failed: {err}"));
                }
            }
            Some(event) = publishing_events.next() => match event {
                lapin::Event::ConnectionBlocked(reason) => {
                    tracing::warn!(%reason, "the broker blocked publishing (resource alarm); retry and dead-letter copies wait");
                    ctx.notify(&ConnectionEvent::Blocked { reason });
                }
                lapin::Event::ConnectionUnblocked => {
                    tracing::info!("the broker unblocked publishing");
                    ctx.notify(&ConnectionEvent::Unblocked);
                }
                lapin::Event::Error(err) => break format!("the publishing connection failed: {err}"),
                _ => {}
            },
        }
    };
    if crate::broker::consumer_timeout::is_described(&reason) {
        tracing::error!(session, %reason, "{}", crate::broker::consumer_timeout::EXPLAINED);
    }
    session_stop.cancel();
    while loops.join_next().await.is_some() {}
    // The next attempt starts with the next address: this one was just lost.
    ctx.brokers.lost(connections.node);
    // Whatever is still open goes: unacked deliveries return to the queue, and
    // in-flight tasks of this session can no longer ack (their acker's channel is
    // closed), so the broker redelivers them to the next session.
    connections.close("reconnecting").await;
    SessionEnd::Lost { reason, connected: true }
}

type Started = (Connections, tokio::task::JoinSet<String>, CancellationToken);

/// Connects both connections, declares the topology and starts every consumer.
async fn start(ctx: &SessionContext, session: u64) -> Result<Started, SessionEnd> {
    // Until a session has connected (session 1 is every attempt before that: the
    // number grows once one has), what waiting cannot mend is reported at once, with
    // the fix; an unreachable broker is waited for. Later, everything is retried.
    let first = session == 1;
    let fatal = |err: &Error| first && !crate::broker::brokers::unreachable(err);
    let fail = |err: Error| {
        if fatal(&err) {
            SessionEnd::Fatal(err)
        } else {
            SessionEnd::Lost { reason: err.report(), connected: false }
        }
    };
    let amqp = |action: &str| {
        let action = action.to_owned();
        move |source| Error::Amqp { action, source }
    };
    // One node that answers for both connections.
    let (consuming, node) = ctx.brokers.connect("consumer").await.map_err(fail)?;
    let publishing = match ctx.brokers.connect_to(node, "publisher").await {
        Ok(publishing) => publishing,
        Err(err) => {
            bounded(consuming.close(200, "start-up failed".into())).await;
            ctx.brokers.lost(node);
            return Err(fail(err));
        }
    };
    let started = async {
        let publisher = publishing.create_channel().await.map_err(amqp("open the publisher channel"))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp("enable publisher confirms"))?;

        let waits: Vec<_> = ctx
            .consumers
            .iter()
            .flat_map(|spec| {
                spec.retry
                    .wait_queues(&spec.queue)
                    .into_iter()
                    .map(|(name, delay)| (&spec.declared, name, delay))
            })
            .collect();
        let consumed = |queue: &str| ctx.consumers.iter().any(|spec| spec.queue == queue);
        ctx.topology.declare_available(&consuming, &waits, consumed).await?;

        let session_stop = CancellationToken::new();
        let mut loops = tokio::task::JoinSet::new();
        let mut channels = vec![publisher.clone()];
        for (index, spec) in ctx.consumers.iter().enumerate() {
            let channel = consuming.create_channel().await.map_err(amqp("open a consumer channel"))?;
            // Per-consumer QoS: global QoS on a quorum queue is a connection error.
            channel
                .basic_qos(spec.prefetch, BasicQosOptions { global: false })
                .await
                .map_err(amqp("set the prefetch"))?;
            let tag = format!("idemq-{}-{}-{session}-{index}", spec.handler.name(), std::process::id());
            let stream = channel
                .basic_consume(
                    spec.queue.as_str().into(),
                    tag.as_str().into(),
                    BasicConsumeOptions { no_ack: false, ..Default::default() },
                    FieldTable::default(),
                )
                .await
                .map_err(amqp(&format!("consume queue '{}'", spec.queue)))?;
            tracing::info!(queue = %spec.queue, handler = spec.handler.name(), session, "consuming");
            channels.push(channel.clone());
            let consumer = Arc::new(Consumer {
                queue: spec.queue.clone(),
                dead_letter_queue: spec.declared.dead_letter.clone(),
                delivery_limit: spec.declared.delivery_limit,
                retry: spec.retry.clone(),
                handler: Arc::clone(&spec.handler),
                scope: spec.scope.clone(),
                channel,
                acks: Arc::new(Acks::default()),
                publisher: publisher.clone(),
                tracker: ctx.tracker.clone(),
                frame_max: publishing.configuration().frame_max(),
                session,
                width: Width::new(spec.batch.pipelines),
                batch: spec.batch,
                on_conflict: spec.on_conflict,
                shared: Arc::clone(&ctx.shared),
            });
            loops.spawn(consume(consumer, stream, tag, ctx.clone_intake(), session_stop.clone()));
        }
        Ok::<_, Error>((loops, session_stop, channels))
    }
    .await;
    match started {
        Ok((loops, session_stop, channels)) => {
            Ok((Connections { consuming, publishing, channels, node }, loops, session_stop))
        }
        Err(err) => {
            bounded(consuming.close(200, "start-up failed".into())).await;
            bounded(publishing.close(200, "start-up failed".into())).await;
            ctx.brokers.lost(node);
            // A topology mismatch cannot be fixed by reconnecting.
            let fatal =
                fatal(&err) || matches!(err, Error::QueueMismatch { .. } | Error::ExchangeMismatch { .. });
            Err(if fatal {
                SessionEnd::Fatal(err)
            } else {
                SessionEnd::Lost { reason: err.report(), connected: false }
            })
        }
    }
}

/// What an intake loop needs from the context.
struct Intake {
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    hard_stop: CancellationToken,
}

impl SessionContext {
    fn clone_intake(&self) -> Intake {
        Intake {
            permits: Arc::clone(&self.permits),
            tracker: self.tracker.clone(),
            hard_stop: self.hard_stop.clone(),
        }
    }
}

/// The next delivery of a consumer's stream, registered with its channel's acks.
#[allow(clippy::large_enum_variant)] // moved once, straight into a batch
enum Next {
    Delivery(Delivery),
    /// The stream ended: why.
    Ended(String),
}

/// Takes the next delivery, if it is there now (`wait` zero) or arrives within `wait`.
async fn next_within(consumer: &Consumer, stream: &mut lapin::Consumer, wait: Duration) -> Option<Next> {
    let next = match stream.next().now_or_never() {
        Some(next) => next,
        None if wait.is_zero() => return None,
        None => tokio::time::timeout(wait, stream.next()).await.ok()?,
    };
    Some(registered(consumer, next).await)
}

async fn registered(consumer: &Consumer, next: Option<lapin::Result<Delivery>>) -> Next {
    match next {
        Some(Ok(delivery)) => {
            consumer.acks.received(&delivery);
            Next::Delivery(delivery)
        }
        Some(Err(err)) => Next::Ended(ended_by(consumer, &err)),
        None => Next::Ended(format!(
            "queue '{}': the broker cancelled the consumer (queue deleted?) or the channel closed",
            consumer.queue
        )),
    }
}

/// Why a consumer's stream ended with `err`: the broker's words — and, when it
/// closed the channel for a delivery not acknowledged within its
/// `consumer_timeout`, that said plainly (see [`run`], which logs it once).
fn ended_by(consumer: &Consumer, err: &lapin::Error) -> String {
    let said = crate::broker::consumer_timeout::describe(err).unwrap_or_else(|| err.to_string());
    format!("queue '{}': {said}", consumer.queue)
}

/// Why `consumer`'s channel closed, from its stream: lapin hands the broker's close
/// to the consumer after the deliveries still buffered (dropped here: the broker
/// requeues them). Waits a moment for it; else a plain "the channel closed".
async fn closing_reason(consumer: &Consumer, stream: &mut lapin::Consumer) -> String {
    let told = async {
        loop {
            match stream.next().await {
                Some(Ok(_buffered)) => {}
                Some(Err(err)) => return Some(ended_by(consumer, &err)),
                None => return None,
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(1), told).await {
        Ok(Some(reason)) => reason,
        _ => format!("queue '{}': the channel closed", consumer.queue),
    }
}

/// One consumer's intake loop. Returns why it stopped on its own (the channel or
/// connection went away, or the broker cancelled the consumer, e.g. because its
/// queue was deleted); after `stop` it cancels the consumer and returns.
///
/// A handler without a lane: receive a delivery, wait for a permit (one running
/// transaction), take whatever else has arrived, and run a batch of it as a task —
/// its share among the idle slots, up to the batch size (waiting at most the linger
/// for more) — repeat. Receiving comes first: a
/// consumer waiting on an idle queue holds no permit, so it cannot starve the busy
/// ones. A handler with a lane: see [`consume_in_lanes`].
async fn consume(
    consumer: Arc<Consumer>,
    mut stream: lapin::Consumer,
    tag: String,
    intake: Intake,
    stop: CancellationToken,
) -> String {
    if consumer.handler.lane_path().is_some() {
        return consume_in_lanes(consumer, stream, tag, intake, stop).await;
    }
    let limits = consumer.batch;
    // Taken from the stream, not yet in a batch.
    let mut pending: VecDeque<Delivery> = VecDeque::new();
    let mut ended: Option<String> = None;
    let reason = loop {
        if pending.is_empty() {
            if let Some(reason) = ended.take() {
                break Some(reason);
            }
            tokio::select! {
                () = stop.cancelled() => break None,
                next = stream.next() => match registered(&consumer, next).await {
                    Next::Delivery(delivery) => pending.push_back(delivery),
                    Next::Ended(reason) => break Some(reason),
                },
            }
        }
        // A slot of this consumer's (its width shrinks while its batches collide),
        // then one of the runtime's.
        let permit = tokio::select! {
            permit = async {
                consumer.width.acquire().await;
                // Counted off again on drop, even if this wait is given up.
                let mut slot = BatchSlot { consumer: Arc::clone(&consumer), permit: None };
                let permit = Arc::clone(&intake.permits).acquire_owned().await;
                slot.permit = Some(permit.expect("the semaphore is never closed"));
                slot
            } => permit,
            () = stop.cancelled() => break None,
            // Waiting for a slot must not hide a dead channel: its deliveries can no
            // longer be settled (the broker requeues them), and the session must end.
            () = closed(&consumer.channel) => {
                break Some(closing_reason(&consumer, &mut stream).await);
            }
        };
        // Whatever arrived meanwhile.
        while ended.is_none() {
            match next_within(&consumer, &mut stream, Duration::ZERO).await {
                None => break,
                Some(Next::Delivery(delivery)) => pending.push_back(delivery),
                Some(Next::Ended(reason)) => ended = Some(reason),
            }
        }
        // Share what waits with the idle transaction slots: a few deliveries and free
        // slots run side by side (slow handlers stay concurrent), a backlog fills
        // whole batches.
        let idle = intake.permits.available_permits().min(consumer.width.free()) + 1;
        let share = pending.len().div_ceil(idle).clamp(1, limits.size);
        let mut batch = Vec::with_capacity(share);
        while batch.len() < share {
            // A redelivered message runs in a batch of its own.
            match pending.front() {
                Some(next) if next.redelivered && !batch.is_empty() => break,
                Some(_) => {}
                None => break,
            }
            let Some(delivery) = pending.pop_front() else { break };
            let alone = delivery.redelivered;
            batch.push(Item::new(delivery, &consumer, None));
            if alone {
                break;
            }
        }
        if !limits.linger.is_zero() && ended.is_none() && pending.is_empty() && !batch[0].runs_alone() {
            let deadline = tokio::time::Instant::now() + limits.linger;
            while batch.len() < limits.size {
                let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
                match next_within(&consumer, &mut stream, wait).await {
                    None => break,
                    Some(Next::Delivery(delivery)) if delivery.redelivered => {
                        pending.push_back(delivery);
                        break;
                    }
                    Some(Next::Delivery(delivery)) => batch.push(Item::new(delivery, &consumer, None)),
                    Some(Next::Ended(reason)) => {
                        ended = Some(reason);
                        break;
                    }
                }
            }
        }
        let batch_consumer = Arc::clone(&consumer);
        let hard_stop = intake.hard_stop.clone();
        intake.tracker.spawn(async move {
            batch_consumer.process(batch, &hard_stop).await;
            drop(permit);
        });
    };
    for delivery in pending {
        let _ = consumer.acks.requeue(&delivery).await;
    }
    intake_ended(&consumer, &tag, reason).await
}

/// The intake of a handler with a lane: each delivery is decoded as it arrives and
/// sent to the pipeline its lane value hashes to (one per unit of concurrency).
/// A pipeline runs its deliveries in arrival order, one batch at a time, so one
/// lane's messages are never applied concurrently or out of order in this process,
/// and batches on different pipelines do not lock the same hot rows. A delivery that
/// cannot be decoded (it will be dead-lettered) goes to any pipeline.
async fn consume_in_lanes(
    consumer: Arc<Consumer>,
    mut stream: lapin::Consumer,
    tag: String,
    intake: Intake,
    stop: CancellationToken,
) -> String {
    let pipelines: Vec<mpsc::UnboundedSender<Item>> = (0..consumer.batch.pipelines.max(1))
        .map(|_| {
            let (sender, receiver) = mpsc::unbounded_channel();
            intake.tracker.spawn(pipeline(
                Arc::clone(&consumer),
                receiver,
                Arc::clone(&intake.permits),
                intake.hard_stop.clone(),
            ));
            sender
        })
        .collect();
    let mut spread = 0_usize;
    let reason = loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break None,
            next = stream.next() => match registered(&consumer, next).await {
                Next::Delivery(delivery) => delivery,
                Next::Ended(reason) => break Some(reason),
            },
        };
        let prepared = consumer.prepare(&delivery);
        let slot = match prepared.as_ref().ok().and_then(|prepared| prepared.lane.as_ref()) {
            Some(lane) => lane_slot(lane.as_str(), pipelines.len()),
            None => {
                spread = spread.wrapping_add(1);
                spread % pipelines.len()
            }
        };
        // A pipeline ends only when its sender is dropped (below).
        let _ = pipelines[slot].send(Item::new(delivery, &consumer, Some(prepared)));
    };
    // The pipelines finish what they hold (in flight, within the shutdown deadline).
    drop(pipelines);
    intake_ended(&consumer, &tag, reason).await
}

/// Why an intake loop ended: `reason` if the stream did; after `stop` (`None`) it
/// cancels the consumer — prefetched deliveries not yet taken return when the channel
/// closes — and says "stopped".
async fn intake_ended(consumer: &Consumer, tag: &str, reason: Option<String>) -> String {
    match reason {
        Some(reason) => reason,
        None => {
            bounded(consumer.channel.basic_cancel(tag.into(), BasicCancelOptions::default())).await;
            String::from("stopped")
        }
    }
}

/// A running batch's place: one of its consumer's slots and one of the runtime's
/// permits, both given back when it is dropped.
struct BatchSlot {
    consumer: Arc<Consumer>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for BatchSlot {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.consumer.width.release();
    }
}

/// The pipeline a lane value belongs to: a stable hash, so one process always sends
/// one lane to one pipeline.
fn lane_slot(lane: &str, pipelines: usize) -> usize {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same in every run.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    lane.hash(&mut hasher);
    usize::try_from(hasher.finish() % pipelines as u64).unwrap_or(0)
}

/// One lane pipeline: batches of what it holds, one at a time, in order.
async fn pipeline(
    consumer: Arc<Consumer>,
    mut deliveries: mpsc::UnboundedReceiver<Item>,
    permits: Arc<Semaphore>,
    hard_stop: CancellationToken,
) {
    let limits = consumer.batch;
    let mut held: Option<Item> = None;
    loop {
        let first = match held.take() {
            Some(first) => first,
            None => match deliveries.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let permit = Arc::clone(&permits).acquire_owned().await.expect("the semaphore is never closed");
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + limits.linger;
        while batch.len() < limits.size && !batch[0].runs_alone() {
            let next = match deliveries.try_recv() {
                Ok(next) => next,
                Err(_) if limits.linger.is_zero() => break,
                Err(_) => match tokio::time::timeout_at(deadline, deliveries.recv()).await {
                    Ok(Some(next)) => next,
                    Ok(None) | Err(_) => break,
                },
            };
            if next.runs_alone() {
                held = Some(next);
                break;
            }
            batch.push(next);
        }
        consumer.process(batch, &hard_stop).await;
        drop(permit);
    }
}

/// Resolves once `channel` is no longer usable (polled: lapin has no close event
/// per channel).
async fn closed(channel: &Channel) {
    while channel.status().connected() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
