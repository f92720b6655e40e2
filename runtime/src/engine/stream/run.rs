//! Applying a stream's messages in offset order: runs of messages in one
//! transaction with the offset, a failing message alone (retried in place, then
//! dead-lettered), and what each settled as.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use lapin::Channel;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::{End, StreamContext, StreamSpec};
use crate::base::backoff::Backoff;
use crate::base::outcome::{FailureKind, Outcome, Settled};
use crate::base::retry::RetryPolicy;
use crate::broker::dead_letter::{self, Letter};
use crate::engine::delivery::Shared;
use crate::handler::prepare::{ErasedHandler, Prepared};
use crate::handler::ErrorClass;
use crate::store::db;

mod tx;

use tx::Tx;

/// A delivery and its offset.
pub(super) struct Item {
    offset: i64,
    delivery: Delivery,
    received_at: Instant,
}

/// One subscription's state: where the offset is, and the channels.
pub(super) struct Runner {
    stream: String,
    dead_letter: String,
    delivery_limit: u32,
    handler: Arc<dyn ErasedHandler>,
    scope: String,
    retry: RetryPolicy,
    shared: Arc<Shared>,
    /// Whether the broker answers this process (a dead letter's confirm waits on it).
    link: Arc<super::BrokerLink>,
    /// Acks (for the stream's credit: they remove nothing).
    channel: Channel,
    /// Confirm mode: dead letters.
    publisher: Channel,
    /// The last offset applied or dead-lettered, as stored.
    last: i64,
    /// The same, for the lag probe ([`super::lag`]).
    applied: Arc<std::sync::atomic::AtomicI64>,
    session: u64,
    frame_max: u32,
    /// The subscription's first message is yet to come: it runs alone.
    fresh: bool,
    /// The first message runs, holding the process's turn for writing.
    alone_in_process: bool,
    /// The last COMMIT's outcome was unknown: its connection is dropped.
    unknown_commit: bool,
}

impl Runner {
    pub(super) fn new(
        spec: &StreamSpec,
        ctx: &StreamContext,
        channel: Channel,
        publisher: Channel,
        last: i64,
        session: u64,
        frame_max: u32,
    ) -> Self {
        Self {
            stream: spec.stream().to_owned(),
            dead_letter: spec.declared.dead_letter_name().to_owned(),
            delivery_limit: spec.declared.delivery_limit,
            handler: Arc::clone(&spec.handler),
            scope: spec.scope.clone(),
            retry: spec.retry.clone(),
            shared: Arc::clone(&ctx.shared),
            link: Arc::clone(&ctx.link),
            channel,
            publisher,
            last,
            applied: Arc::new(std::sync::atomic::AtomicI64::new(last)),
            session,
            frame_max,
            fresh: true,
            alone_in_process: false,
            unknown_commit: false,
        }
    }

    /// The last offset applied or dead-lettered, as the lag probe reads it.
    pub(super) fn applied(&self) -> Arc<std::sync::atomic::AtomicI64> {
        Arc::clone(&self.applied)
    }

    /// `offset` is stored: the run goes on after it.
    fn stored(&mut self, offset: i64) {
        self.last = offset;
        self.applied.store(offset, std::sync::atomic::Ordering::Relaxed);
    }

    /// Closes both channels (each handshake bounded), before their connection.
    pub(super) async fn close_channels(&self) {
        for channel in [&self.channel, &self.publisher] {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                channel.close(200, "stream session ended".into()),
            )
            .await;
        }
    }

    /// Applies a batch in offset order (what is at or below the offset skipped),
    /// then acks it.
    pub(super) async fn batch(&mut self, batch: Vec<Delivery>, stop: &CancellationToken) -> Result<(), End> {
        let received_at = Instant::now();
        let last_tag = batch.last().map(|delivery| delivery.delivery_tag);
        let mut items = Vec::with_capacity(batch.len());
        for delivery in batch {
            let Some(offset) = offset_of(&delivery) else {
                return Err(End::Fatal(crate::error::Error::Config(format!(
                    "'{}' is consumed as a stream but its deliveries carry no x-stream-offset: is it a stream?",
                    self.stream
                ))));
            };
            if offset > self.last {
                items.push(Item { offset, delivery, received_at });
            }
        }
        self.alone_in_process = false;
        let mut rest = items.as_slice();
        if self.fresh {
            if let Some((first, after)) = rest.split_first() {
                self.first(first, stop).await?;
                rest = after;
                self.fresh = false;
            }
        }
        self.segments(rest, stop).await?;
        if let Some(tag) = last_tag {
            let ack = BasicAckOptions { multiple: true };
            self.channel.basic_ack(tag, ack).await.map_err(|err| End::Lost(err.to_string()))?;
        }
        Ok(())
    }

    /// The subscription's first message (where a crash restarts): alone in the
    /// process, its start committed before its handler runs; past the queue's
    /// delivery limit of starts, it is poison.
    async fn first(&mut self, item: &Item, stop: &CancellationToken) -> Result<(), End> {
        let shared = Arc::clone(&self.shared);
        let _alone = shared.turns.write().await;
        self.alone_in_process = true;
        let mark = format!("{}@{}", self.stream, item.offset);
        let starts = {
            let mut conn = self.shared.pool.get().await.map_err(|err| End::Lost(err.to_string()))?;
            db::mark_start(&mut conn, &self.scope, &mark).await.map_err(|err| End::Lost(err.to_string()))?
        };
        if u32::try_from(starts).unwrap_or(u32::MAX) > self.delivery_limit {
            let error = format!(
                "its handler started {} times without an outcome (the process crashed or hung each time)",
                starts - 1
            );
            self.dead_letter(item, FailureKind::Poison, &error, None, 0, stop).await?;
        } else {
            self.segments(std::slice::from_ref(item), stop).await?;
        }
        self.alone_in_process = false;
        if let Ok(mut conn) = self.shared.pool.get().await {
            let _ = db::clear_starts(&mut conn, &self.scope, &mark).await;
        }
        Ok(())
    }

    /// Runs of messages that decode, in order; a message that does not is
    /// dead-lettered between them.
    async fn segments(&mut self, items: &[Item], stop: &CancellationToken) -> Result<(), End> {
        let mut start = 0;
        for (index, item) in items.iter().enumerate() {
            if let Err(rejection) = self.prepare(item) {
                self.apply(&items[start..index], stop).await?;
                self.dead_letter(item, rejection.kind, &rejection.message, None, 0, stop).await?;
                start = index + 1;
            }
        }
        self.apply(&items[start..], stop).await
    }

    fn prepare(&self, item: &Item) -> Result<Prepared, crate::handler::prepare::Rejection> {
        self.handler.prepare(&item.delivery.data, &item.delivery.properties, self.shared.limits)
    }

    /// `items` in one transaction; when one fails, the ones before it commit first,
    /// then it runs alone ([`Self::alone`]), then the ones after it.
    fn apply<'a>(
        &'a mut self,
        items: &'a [Item],
        stop: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<(), End>> {
        Box::pin(async move {
            match items {
                [] => return Ok(()),
                [item] => return self.alone(item, stop).await,
                _ => {}
            }
            let mut backoff = database_backoff();
            loop {
                let (before, culprit, after) = match self.transact(items, 1).await {
                    Tx::Committed => return Ok(()),
                    Tx::Failed { at: Some(at), .. } => (&items[..at], Some(&items[at]), &items[at + 1..]),
                    Tx::Failed { at: None, .. } => {
                        let (left, right) = items.split_at(items.len() / 2);
                        (left, None, right)
                    }
                    Tx::Repeat { at } => (&items[..at], None, &items[at..]),
                    Tx::Fenced => return Err(End::Fenced),
                    Tx::Fault(reason) => {
                        self.wait_out(&reason, &mut backoff, stop).await?;
                        continue;
                    }
                };
                self.apply(before, stop).await?;
                if let Some(culprit) = culprit {
                    self.alone(culprit, stop).await?;
                }
                return self.apply(after, stop).await;
            }
        })
    }

    /// One message alone: a transient failure is retried in place after the
    /// policy's delay, until its attempts run out; then, or on a permanent failure,
    /// it is dead-lettered and the offset moves past it.
    async fn alone(&mut self, item: &Item, stop: &CancellationToken) -> Result<(), End> {
        let mut attempt = 1;
        let mut backoff = database_backoff();
        loop {
            match self.transact(std::slice::from_ref(item), attempt).await {
                Tx::Committed => return Ok(()),
                Tx::Fenced => return Err(End::Fenced),
                Tx::Fault(reason) => self.wait_out(&reason, &mut backoff, stop).await?,
                Tx::Repeat { .. } => unreachable!("one message cannot repeat its key"),
                Tx::Failed { error, kind, .. } => {
                    let (delay, kind) = match error.class() {
                        ErrorClass::Permanent => (None, kind),
                        _ => (self.retry.delay_after(attempt), FailureKind::AttemptsExhausted),
                    };
                    let Some(delay) = delay else {
                        let key = self.prepare(item).ok().map(|prepared| prepared.key.as_str().to_owned());
                        return self.dead_letter(item, kind, &error.to_string(), key, attempt, stop).await;
                    };
                    crate::base::log::warn!(stream = %self.stream, offset = item.offset, attempt, delay = %crate::base::duration::human(delay), error = %error, "handler failed; retrying in place (the stream waits for it)");
                    tokio::select! {
                        () = stop.cancelled() => return Err(End::Stopped),
                        () = tokio::time::sleep(delay) => {}
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// A database fault: wait (or stop), then the caller runs the transaction again.
    async fn wait_out(
        &self,
        reason: &str,
        backoff: &mut Backoff,
        stop: &CancellationToken,
    ) -> Result<(), End> {
        crate::base::log::warn!(stream = %self.stream, %reason, "database fault; running the transaction again on a fresh connection (not an attempt)");
        tokio::select! {
            () = stop.cancelled() => Err(End::Stopped),
            () = backoff.wait() => Ok(()),
        }
    }

    /// Publishes `item` to the dead-letter queue (confirmed), then moves the offset
    /// past it.
    async fn dead_letter(
        &mut self,
        item: &Item,
        kind: FailureKind,
        error: &str,
        key: Option<String>,
        attempts: u32,
        stop: &CancellationToken,
    ) -> Result<(), End> {
        crate::base::log::warn!(stream = %self.stream, offset = item.offset, kind = %kind, %error, "dead-lettering; the stream moves past it");
        let copy_id = copy_id(&self.scope, &self.stream, item.offset);
        let letter = Letter {
            kind: Some(kind),
            error,
            handler: self.handler.name(),
            queue: &self.stream,
            attempts,
            copy_id: &copy_id,
            retry_of: None,
        };
        // No transaction is open here: a broker silent past the release bound ends the
        // wait for the confirm, and the stream goes to a process that reaches it (the
        // offset has not moved: the message is dead-lettered there, its copy id the same).
        tokio::select! {
            published = dead_letter::publish(&self.publisher, &self.dead_letter, &item.delivery, &letter, self.frame_max) => {
                published.map_err(|err| End::Lost(crate::error::report(&err)))?;
            }
            () = self.link.lost() => return Err(End::Released),
        }
        let mut backoff = database_backoff();
        loop {
            let moved = async {
                let mut conn = self.shared.pool.get().await.map_err(|err| err.to_string())?;
                db::advance_offset(&mut conn, &self.scope, &self.stream, self.last, item.offset)
                    .await
                    .map_err(|err| err.to_string())
            };
            match moved.await {
                Ok(true) => break,
                Ok(false) => match self.landed(item.offset).await {
                    Some(true) => break,
                    _ => return Err(End::Fenced),
                },
                Err(reason) => self.wait_out(&reason, &mut backoff, stop).await?,
            }
        }
        self.stored(item.offset);
        let outcome = Outcome::DeadLettered { kind, error: error.to_owned() };
        self.settled(item, key, outcome, 0, None, None);
        Ok(())
    }

    fn settled(
        &self,
        item: &Item,
        key: Option<String>,
        outcome: Outcome,
        batch: usize,
        began_at: Option<Instant>,
        handler_time: Option<Duration>,
    ) {
        self.shared.observers.settled(&Settled {
            queue: self.stream.clone(),
            handler: self.handler.name(),
            key,
            outcome,
            settled_with_broker: true,
            delivery_count: 0,
            redelivered: false,
            attempt: 1,
            session: self.session,
            batch,
            received_at: item.received_at,
            began_at,
            settled_at: Instant::now(),
            handler_time,
        });
    }
}

/// The waits between runs of a transaction the database failed.
fn database_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
}

/// A stream delivery's offset (`x-stream-offset`, set by the broker).
fn offset_of(delivery: &Delivery) -> Option<i64> {
    match crate::base::amqp_value::header(&delivery.properties, "x-stream-offset")? {
        AMQPValue::LongLongInt(offset) => Some(*offset),
        AMQPValue::LongInt(offset) => Some(i64::from(*offset)),
        AMQPValue::LongUInt(offset) => Some(i64::from(*offset)),
        AMQPValue::Timestamp(offset) => i64::try_from(*offset).ok(),
        _ => None,
    }
}

/// The copy id of a stream message's dead letter: one per (handler, stream, offset).
fn copy_id(scope: &str, stream: &str, offset: i64) -> String {
    let digest = Sha256::new()
        .chain_update(scope)
        .chain_update([0])
        .chain_update(stream)
        .chain_update([0])
        .chain_update(offset.to_be_bytes())
        .finalize();
    format!("{}:1", crate::base::hex(&digest[..16]))
}
