//! Consuming a RabbitMQ stream exactly once: the offset in the handler's
//! transaction.
//!
//! A stream ([`Queue::stream`](crate::Queue::stream)) keeps its messages after they
//! are read, and a consumer starts at an offset. So a stream consumer needs no dedup
//! row to be exact: each transaction applies a contiguous run of messages **and moves
//! the handler's offset** (`idemq_stream_offsets`) to the run's last, in the same
//! COMMIT; after any failure it subscribes again after the stored offset. Anything
//! at or below it (a stream starts a consumer at the chunk holding the offset) is
//! skipped without running.
//!
//! ```text
//!  own the (handler, stream) lock ─ subscribe after the stored offset
//!    └─> batch (in offset order) ─ each message: decode + key ─ bad input ─────────┐
//!          │                                                                       │
//!          └─ run: BEGIN ─ [dedup rows] ─ handlers in order ─ outbox + results     │
//!                  ─ offset: last → run's last, only if still `last` ─ COMMIT ─ ack│
//!                  ├ a handler failed: ROLLBACK; the run before it commits first,  │
//!                  │  then it alone: transient → retried in place after the delay, │
//!                  │  until its attempts run out ────────────────────────────────┐ │
//!                  │  permanent ─────────────────────────────────────────────────┤ │
//!                  ├ the offset moved (another consumer): fenced, roll back,     ▼ ▼
//!                  │  subscribe again                     dead letter (confirmed) to the
//!                  └ the database failed: the same run     DLQ, then the offset moves
//!                    again, on a fresh connection          past it in a transaction
//! ```
//!
//! Invariants:
//! - Messages are applied in offset order, and the offset only ever covers messages
//!   that were applied or dead-lettered: a failing message holds the stream until it
//!   is one or the other (nothing can wait in a retry queue: a stream is not a queue).
//! - **Fencing.** A transaction moves the offset only from the value this consumer
//!   read (`UPDATE … WHERE last_offset = $from`): a consumer that lost its ownership
//!   without knowing (a zombie) finds it moved and rolls back. Correctness rests on
//!   that, not on the lock.
//! - **One active consumer per (handler, stream)** across processes: the process
//!   holding a PostgreSQL advisory lock on its own connection consumes; the others
//!   wait and take over within a second when its session ends (a crash, a lost
//!   connection). The owner checks its lock's connection every few seconds.
//! - **Ownership follows the broker** ([`BrokerLink`]): a process takes a stream's
//!   lock only while the broker answers it, and gives it up (at a batch boundary)
//!   once the broker has been silent for the
//!   [release bound](crate::RuntimeBuilder::release_streams_after), so a process cut
//!   from RabbitMQ but not from PostgreSQL never holds a stream the others could
//!   consume.
//! - **Sharing partitions** (a handler on several streams, [`Share`]): each process
//!   counts the processes consuming them (member advisory locks) and owns at most
//!   `ceil(streams / processes)`; an owner with more gives one up between batches.
//!   It decides who works, never what is applied: that stays the offset's fence.
//! - A COMMIT whose outcome is unknown is read back from the offset: at the run's
//!   last, it committed; still at the old value, it did not (run again).
//! - Poison: the first message of every subscription (where a crash restarts) runs
//!   alone, its start committed first; a message started `delivery_limit` times
//!   without an outcome is dead-lettered as `poison`.
//! - Dedup rows stay available (`dedup = false` turns them off, the offset being
//!   enough): with them, a message published twice (a publisher's retransmission, at
//!   two offsets) is applied once.

mod lag;
mod link;
mod owner;
mod run;
mod share;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::base::observe::{StreamEvent, StreamState};
use crate::base::retry::RetryPolicy;
use crate::broker::brokers::Brokers;
use crate::broker::topology::Queue;
use crate::engine::delivery::Shared;
use crate::error::Error;
use crate::handler::prepare::ErasedHandler;
use crate::store::db;

pub(crate) use link::{BrokerLink, DEFAULT_RELEASE_AFTER};
use owner::Owner;
use run::Runner;
pub(crate) use share::Share;

/// How often the owner checks that its lock's connection is alive.
const OWNER_CHECK: Duration = Duration::from_secs(3);

/// One handler consuming one stream, with its settings resolved.
pub(crate) struct StreamSpec {
    pub(crate) declared: Queue,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// The handler's dedup scope, which names its offset row and lock too.
    pub(crate) scope: String,
    pub(crate) retry: RetryPolicy,
    pub(crate) batch_size: usize,
    pub(crate) linger: Duration,
    pub(crate) prefetch: u16,
    /// The handler's share of its streams in this process, when it consumes several
    /// (partitions): see [`Share`].
    pub(crate) share: Option<Arc<Share>>,
}

/// What every stream consumer of a runtime shares.
#[derive(Clone)]
pub(crate) struct StreamContext {
    pub(crate) brokers: Arc<Brokers>,
    pub(crate) database_url: String,
    pub(crate) shared: Arc<Shared>,
    pub(crate) reconnect_max: Duration,
    /// Whether the broker answers this process: see [`BrokerLink`].
    pub(crate) link: Arc<BrokerLink>,
}

/// How a subscription ended.
pub(super) enum End {
    /// Shut down.
    Stopped,
    /// The broker connection or the database failed: subscribe again after a wait.
    Lost(String),
    /// Another consumer moved the offset: read it again and subscribe after it.
    Fenced,
    /// The owner's lock is gone: take it again first.
    OwnerLost,
    /// This process owns more than its share of the handler's streams: this one
    /// goes to another process.
    GiveWay,
    /// The broker has not answered for the release bound: the stream goes to a
    /// process that reaches it.
    Released,
    /// No retry can fix it: the runtime stops.
    Fatal(Error),
}

impl StreamSpec {
    fn stream(&self) -> &str {
        self.declared.name()
    }
}

/// Consumes `spec`'s stream until `stop`: owns it, subscribes, applies, and after
/// any loss starts again (a lost lock first waits to own it again). A lock is taken
/// only while the broker answers, and given up once it has been silent for the
/// release bound ([`BrokerLink`]).
pub(crate) async fn consume(spec: StreamSpec, ctx: StreamContext, stop: CancellationToken) {
    let lock = db::owner_lock(&spec.scope, spec.stream());
    let tell = |state| {
        let event = StreamEvent { handler: spec.handler.name(), stream: spec.stream().to_owned(), state };
        ctx.shared.observers.stream(&event);
    };
    let mut session = 0_u64;
    'owning: loop {
        if !ctx.link.is_answering() {
            tell(StreamState::WaitingForBroker);
            tokio::select! {
                () = stop.cancelled() => return,
                () = ctx.link.reachable() => {}
            }
        }
        tell(StreamState::Standby);
        let acquired = tokio::select! {
            owner = Owner::acquire(&ctx.database_url, lock, &spec, &stop) => owner,
            // Silent while this process waited for the lock: wait for the broker first.
            () = ctx.link.lost() => continue 'owning,
        };
        let Some(mut owner) = acquired else { return };
        tell(StreamState::Owned);
        let mut backoff = Backoff::new(Duration::from_millis(100), ctx.reconnect_max);
        loop {
            session += 1;
            let (end, consumed) = subscribe(&spec, &ctx, &mut owner, session, &stop).await;
            if consumed {
                // A subscription that was made: the next loss starts the waits afresh.
                backoff = Backoff::new(Duration::from_millis(100), ctx.reconnect_max);
            }
            let reason = match end {
                End::Stopped => return,
                End::Fatal(err) => {
                    ctx.shared.fatal.raise(err);
                    return;
                }
                End::OwnerLost => {
                    crate::base::log::warn!(stream = spec.stream(), handler = spec.handler.name(), "lost the stream's lock (its database connection went); taking it again before consuming");
                    continue 'owning;
                }
                End::GiveWay => {
                    crate::base::log::info!(
                        stream = spec.stream(),
                        handler = spec.handler.name(),
                        "another process shares this handler's streams: giving this one to it"
                    );
                    continue 'owning;
                }
                End::Released => {
                    release(&spec, &ctx, owner);
                    tell(StreamState::Released);
                    continue 'owning;
                }
                End::Fenced => {
                    crate::base::log::warn!(
                        stream = spec.stream(),
                        handler = spec.handler.name(),
                        "the stream's offset was moved by another consumer; reading it again"
                    );
                    continue;
                }
                End::Lost(reason) => reason,
            };
            crate::base::log::warn!(stream = spec.stream(), handler = spec.handler.name(), %reason, "stream consumer interrupted; subscribing again after the stored offset");
            tokio::select! {
                () = stop.cancelled() => return,
                () = backoff.wait() => {}
                () = ctx.link.lost() => {
                    release(&spec, &ctx, owner);
                    tell(StreamState::Released);
                    continue 'owning;
                }
            }
            if !owner.alive().await {
                continue 'owning;
            }
        }
    }
}

/// Gives the stream's lock up (by dropping its owner) because the broker has been
/// silent for the release bound: a process that reaches it takes the stream over.
fn release(spec: &StreamSpec, ctx: &StreamContext, owner: Owner) {
    crate::base::log::warn!(
        stream = spec.stream(),
        handler = spec.handler.name(),
        silent_for = %crate::base::duration::human(ctx.link.release_after()),
        "the broker has not answered this process for the release bound: giving the stream up so a process \
         that reaches it takes over (release_streams_after, IDEMQ_RELEASE_STREAMS_AFTER)"
    );
    drop(owner);
}

/// One subscription: connect, declare, read the offset, consume after it, apply
/// batch after batch until something ends it. `true` if it got to consume.
async fn subscribe(
    spec: &StreamSpec,
    ctx: &StreamContext,
    owner: &mut Owner,
    session: u64,
    stop: &CancellationToken,
) -> (End, bool) {
    // Nothing here holds a transaction: a silent broker or a shutdown may cut it.
    let connected = tokio::select! {
        connected = ctx.brokers.connect("stream consumer") => connected,
        () = ctx.link.lost() => return (End::Released, false),
        () = stop.cancelled() => return (End::Stopped, false),
    };
    let (connection, node) = match connected {
        Ok(connected) => connected,
        Err(err) if crate::broker::brokers::unreachable(&err) => return (End::Lost(err.report()), false),
        Err(err) => return (End::Fatal(err), false),
    };
    let opened = tokio::select! {
        opened = open(spec, ctx, &connection, session) => opened,
        () = ctx.link.lost() => Err(End::Released),
        () = stop.cancelled() => Err(End::Stopped),
    };
    let (end, consumed) = match opened {
        Ok((mut runner, consumer)) => {
            let probe = lag::probe(
                &connection,
                spec.stream(),
                spec.handler.name(),
                runner.applied(),
                &ctx.shared.observers,
            );
            let end = tokio::select! {
                end = pump(spec, &mut runner, consumer, owner, &ctx.link, stop) => end,
                never = probe => match never {},
            };
            // The channels first: lapin reports channels still open when their
            // connection closes as errors.
            runner.close_channels().await;
            (end, true)
        }
        Err(end) => (end, false),
    };
    if matches!(end, End::Lost(_) | End::Released) {
        ctx.brokers.lost(node);
    }
    let _ =
        tokio::time::timeout(Duration::from_secs(2), connection.close(200, "stream session ended".into()))
            .await;
    (end, consumed)
}

/// The channels, the stream declared, the stored offset read and the consumer
/// started after it.
async fn open(
    spec: &StreamSpec,
    ctx: &StreamContext,
    connection: &Connection,
    session: u64,
) -> Result<(Runner, lapin::Consumer), End> {
    let lost = |err: lapin::Error| End::Lost(err.to_string());
    let mut channel = connection.create_channel().await.map_err(lost)?;
    if !spec.declared.elsewhere {
        // A DLQ an earlier idemq declared without `x-delivery-limit` is kept (with a
        // warning), as the queue sessions keep it.
        spec.declared.declare_keeping_old_dead_letter_queue(connection, &mut channel).await.map_err(
            |err| match crate::broker::brokers::unreachable(&err) {
                true => End::Lost(err.report()),
                false => End::Fatal(err),
            },
        )?;
    }
    let publisher = connection.create_channel().await.map_err(lost)?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await.map_err(lost)?;
    let last = {
        let mut conn = ctx.shared.pool.get().await.map_err(|err| End::Lost(err.to_string()))?;
        db::read_offset(&mut conn, &spec.scope, spec.stream())
            .await
            .map_err(|err| End::Lost(err.to_string()))?
    };
    channel.basic_qos(spec.prefetch, BasicQosOptions::default()).await.map_err(lost)?;
    let mut args = FieldTable::default();
    let start = match last {
        db::NO_OFFSET => AMQPValue::LongString(LongString::from("first")),
        last => AMQPValue::LongLongInt(last + 1),
    };
    args.insert("x-stream-offset".into(), start);
    let consumer = channel
        .basic_consume(
            spec.stream().into(),
            format!("idemq-{}-{session}", spec.handler.name()).as_str().into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .map_err(lost)?;
    crate::base::log::info!(
        stream = spec.stream(),
        handler = spec.handler.name(),
        after = last,
        session,
        "consuming the stream after its stored offset"
    );
    let frame_max = connection.configuration().frame_max();
    Ok((Runner::new(spec, ctx, channel, publisher, last, session, frame_max), consumer))
}

/// Batches from `consumer`, each applied in order, until the consumer ends, the
/// owner's lock goes, the broker is silent for the release bound, or `stop`.
async fn pump(
    spec: &StreamSpec,
    runner: &mut Runner,
    mut consumer: lapin::Consumer,
    owner: &mut Owner,
    link: &BrokerLink,
    stop: &CancellationToken,
) -> End {
    let mut check = tokio::time::interval(OWNER_CHECK);
    check.tick().await;
    loop {
        let first = tokio::select! {
            () = stop.cancelled() => return End::Stopped,
            // Between batches: nothing is in flight.
            () = link.lost() => return End::Released,
            _ = check.tick() => {
                if !owner.alive().await {
                    return End::OwnerLost;
                }
                if owner.give_way() {
                    return End::GiveWay;
                }
                continue;
            }
            next = consumer.next() => next,
        };
        let mut batch = match first {
            Some(Ok(delivery)) => vec![delivery],
            Some(Err(err)) => return End::Lost(err.to_string()),
            None => return End::Lost("the broker cancelled the stream's consumer".into()),
        };
        while batch.len() < spec.batch_size {
            match tokio::time::timeout(spec.linger, consumer.next()).await {
                Ok(Some(Ok(delivery))) => batch.push(delivery),
                Ok(Some(Err(err))) => return End::Lost(err.to_string()),
                Ok(None) => return End::Lost("the broker cancelled the stream's consumer".into()),
                Err(_) => break,
            }
        }
        if let Err(end) = runner.batch(batch, stop).await {
            return end;
        }
    }
}
