//! Contender 11, the expert loop (issue 39): the best hand-written consumer for this
//! one workload, with idemq's guarantees — the dedup row in the effect's
//! transaction, the ack after COMMIT, the event published after COMMIT from an
//! outbox row written in the same transaction (so a crash between COMMIT and publish
//! loses no event: the rows left are published at the next start).
//!
//! - One consuming channel, prefetch [`PREFETCH`]. Deliveries ready now are taken
//!   into a batch of up to [`BATCH`](batched::BATCH); a batch goes to the database as
//!   soon as one of [`IN_FLIGHT`](batched::IN_FLIGHT) connections is free, so the next
//!   batch fills while one commits.
//! - Each batch is one transaction ([`batched`]): dedup rows, ledger rows and
//!   balances, outbox rows — five statements for up to 500 payments.
//! - Batches finish in order (a `FuturesOrdered`): after each COMMIT one `multiple`
//!   ack covers the batch.
//! - The events go to a publisher on a connection of its own (confirms on), whose
//!   confirms are awaited by a task of their own while the next batch is published;
//!   a confirmed batch's outbox rows are deleted in one statement.
//!
//! What it leaves out that idemq has: conflict detection (a duplicate's
//! fingerprint compared), retries with backoff and poison detection, dead-lettering
//! with reasons (an undecodable body is rejected to the DLQ, no reason given),
//! reconnects, lanes, handler timeouts, graceful shutdown of a half-filled batch
//! (closing the channel gives it back), metrics.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use idemq::store::schema::idemq_outbox;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions};
use lapin::{BasicProperties, Channel, Consumer as Deliveries, PublisherConfirm};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::batched::{self, Applied, Event, Payment, BATCH, IN_FLIGHT};
use super::{Consumer, Pair};
use crate::metrics::{Recorder, Settle};
use crate::urls::Urls;
use crate::BenchError;

/// The consuming channel's prefetch: a few batches, so the next one is full by the
/// time a connection is free.
pub(super) const PREFETCH: u16 = 2_000;

pub(super) async fn start(urls: &Urls, queue: &str, recorder: Arc<Recorder>) -> Result<Consumer, BenchError> {
    let pair = Pair::connect(urls, PREFETCH).await?;
    let mut connections = Vec::with_capacity(IN_FLIGHT);
    for _ in 0..IN_FLIGHT {
        connections.push(idemq::connect::database(&urls.database).await?);
    }
    let mut deleter = idemq::connect::database(&urls.database).await?;
    let events = super::events_queue(queue);
    recover(&pair.publisher, &mut deleter, &events).await?;
    let deliveries = super::subscribe(&pair.channel, queue, "idemq-bench-expert").await?;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let (to_publish, published) = mpsc::channel(4);
            let publisher = pair.publisher.clone();
            let publishing = tokio::spawn(publish(publisher, deleter, events.clone(), published));
            let consumed = consume(deliveries, connections, &events, &to_publish, &recorder, &stop).await;
            drop(to_publish);
            let published = publishing.await.map_err(BenchError::from).and_then(|done| done);
            pair.close().await;
            consumed.and(published)
        }
    });
    Ok(Consumer { stop, task, infrastructure_retries: Box::new(|| 0) })
}

/// Publishes the events a crash left in the outbox (committed, never confirmed),
/// before consuming.
async fn recover(publisher: &Channel, conn: &mut AsyncPgConnection, events: &str) -> Result<(), BenchError> {
    let left: Vec<(i64, String, Vec<u8>)> = idemq_outbox::table
        .filter(idemq_outbox::routing_key.eq(events))
        .order(idemq_outbox::id)
        .select((idemq_outbox::id, idemq_outbox::message_id, idemq_outbox::body))
        .load(conn)
        .await?;
    let left: Vec<Event> =
        left.into_iter().map(|(id, message_id, body)| Event { id, message_id, body }).collect();
    let confirms = send(publisher, events, &left).await?;
    settle_confirms(conn, confirms, left.iter().map(|event| event.id).collect()).await
}

/// One batch of deliveries, taken in delivery order.
#[derive(Default)]
struct Batch {
    /// The last delivery decoded (its `multiple` ack covers the batch).
    last: Option<Delivery>,
    received: Vec<Instant>,
    payments: Vec<Payment>,
}

type Written = Pin<Box<dyn Future<Output = (AsyncPgConnection, Batch, QueryResult<Applied>)> + Send>>;

async fn consume(
    mut deliveries: Deliveries,
    mut idle: Vec<AsyncPgConnection>,
    events: &str,
    to_publish: &mpsc::Sender<Vec<Event>>,
    recorder: &Recorder,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    let mut in_flight: FuturesOrdered<Written> = FuturesOrdered::new();
    let mut batch = Batch::default();
    let mut ended = false;
    loop {
        // Everything ready now, up to a batch.
        while !ended && batch.payments.len() < BATCH {
            match deliveries.next().now_or_never() {
                Some(Some(delivery)) => take(&mut batch, delivery?, recorder).await?,
                Some(None) => ended = true,
                None => break,
            }
        }
        if batch.last.is_some() {
            if let Some(mut conn) = idle.pop() {
                let batch = std::mem::take(&mut batch);
                let events = events.to_owned();
                in_flight.push_back(Box::pin(async move {
                    let applied = batched::apply(&mut conn, &batch.payments, &events, &[]).await;
                    (conn, batch, applied)
                }));
                continue;
            }
        }
        let waiting = in_flight.is_empty() && batch.last.is_none();
        if ended && waiting {
            break; // The broker cancelled the consumer and everything taken is settled.
        }
        tokio::select! {
            Some((conn, done, applied)) = in_flight.next() => {
                idle.push(conn);
                settle(done, applied, to_publish, recorder).await?;
            }
            next = deliveries.next(), if !ended && batch.payments.len() < BATCH => match next {
                Some(delivery) => take(&mut batch, delivery?, recorder).await?,
                None => ended = true,
            },
            () = stop.cancelled(), if waiting => break,
        }
    }
    Ok(())
}

/// Adds a delivery to the batch; one that is not a payment is rejected to the DLQ.
async fn take(batch: &mut Batch, delivery: Delivery, recorder: &Recorder) -> Result<(), BenchError> {
    let received = Instant::now();
    match Payment::decode(&delivery.data) {
        Some(payment) => {
            batch.payments.push(payment);
            batch.received.push(received);
            batch.last = Some(delivery);
        }
        None => {
            delivery.reject(BasicRejectOptions { requeue: false }).await?;
            recorder.settle(Settle::Failed, received, Instant::now());
        }
    }
    Ok(())
}

/// After a batch's transaction: on COMMIT, one `multiple` ack and its events to the
/// publisher; on an error, the batch back to the queue.
async fn settle(
    batch: Batch,
    applied: QueryResult<Applied>,
    to_publish: &mpsc::Sender<Vec<Event>>,
    recorder: &Recorder,
) -> Result<(), BenchError> {
    let Some(last) = batch.last else { return Ok(()) };
    match applied {
        Ok(applied) => {
            if !last.ack(BasicAckOptions { multiple: true }).await? {
                return Err("expert: the ack was not sent (channel gone)".into());
            }
            let settled = Instant::now();
            for (received, new) in batch.received.into_iter().zip(applied.new) {
                recorder.settle(if new { Settle::Applied } else { Settle::Duplicate }, received, settled);
            }
            if !applied.events.is_empty() && to_publish.send(applied.events).await.is_err() {
                return Err("expert: the publisher stopped".into());
            }
        }
        Err(err) => {
            eprintln!(
                "expert: {}; the batch goes back to the queue",
                idemq::connect::redact(&err.to_string())
            );
            last.nack(BasicNackOptions { multiple: true, requeue: true }).await?;
            batch.received.iter().for_each(|_| recorder.returned());
        }
    }
    Ok(())
}

/// The publisher: each batch of events published (persistent, mandatory), its
/// confirms awaited by a task of their own while the next batch is published, then
/// its outbox rows deleted.
async fn publish(
    publisher: Channel,
    deleter: AsyncPgConnection,
    events: String,
    mut batches: mpsc::Receiver<Vec<Event>>,
) -> Result<(), BenchError> {
    let (to_confirm, mut confirming) = mpsc::channel::<(Vec<PublisherConfirm>, Vec<i64>)>(4);
    let confirmer = tokio::spawn(async move {
        let mut deleter = deleter;
        while let Some((confirms, ids)) = confirming.recv().await {
            settle_confirms(&mut deleter, confirms, ids).await?;
        }
        Ok::<(), BenchError>(())
    });
    while let Some(batch) = batches.recv().await {
        let confirms = send(&publisher, &events, &batch).await?;
        let ids = batch.iter().map(|event| event.id).collect();
        if to_confirm.send((confirms, ids)).await.is_err() {
            break; // The confirmer failed: its error is the result.
        }
    }
    drop(to_confirm);
    confirmer.await?
}

/// Publishes `events` to the `events` queue; their confirms.
async fn send(
    publisher: &Channel,
    events: &str,
    batch: &[Event],
) -> Result<Vec<PublisherConfirm>, BenchError> {
    let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
    let mut confirms = Vec::with_capacity(batch.len());
    for event in batch {
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(event.message_id.as_str().into());
        confirms
            .push(publisher.basic_publish("".into(), events.into(), options, &event.body, properties).await?);
    }
    Ok(confirms)
}

/// Waits for every confirm, then deletes the confirmed events' outbox rows.
async fn settle_confirms(
    conn: &mut AsyncPgConnection,
    confirms: Vec<PublisherConfirm>,
    ids: Vec<i64>,
) -> Result<(), BenchError> {
    for confirm in confirms {
        crate::workload::confirmed(confirm.await?)?;
    }
    batched::delete_published(conn, &ids).await?;
    Ok(())
}
