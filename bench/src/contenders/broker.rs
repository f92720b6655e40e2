//! Contender 9, the broker's ceiling for the demo's messaging (issue 39): no database;
//! for each delivery an event published to the run's events queue (persistent,
//! mandatory, publisher confirms, pipelined) from a connection of its own, and one
//! `multiple` ack per [`raw::ACK_EVERY`](super::raw::ACK_EVERY) deliveries — and
//! whenever none is waiting — once every event of those deliveries is confirmed. The
//! confirms of a batch are awaited by a task of their own while the next batch is
//! consumed and published: what idemq's handler plus relay do on the broker, written
//! as fast as lapin allows.

use std::sync::Arc;
use std::time::Instant;

use futures_util::{FutureExt, StreamExt};
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Consumer as Deliveries, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use super::raw::{Unacked, ACK_EVERY, PREFETCH};
use super::{Consumer, Pair};
use crate::metrics::Recorder;
use crate::urls::Urls;
use crate::BenchError;

pub(super) async fn start(urls: &Urls, queue: &str, recorder: Arc<Recorder>) -> Result<Consumer, BenchError> {
    let pair = Pair::connect(urls, PREFETCH).await?;
    let deliveries = super::subscribe(&pair.channel, queue, "idemq-bench-broker").await?;
    let events = super::events_queue(queue);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let consumed = consume(deliveries, &pair.publisher, &events, recorder, &stop).await;
            pair.close().await;
            consumed
        }
    });
    Ok(Consumer { stop, task, infrastructure_retries: Box::new(|| 0) })
}

/// Deliveries whose events are published and not yet confirmed, not yet acked.
#[derive(Default)]
struct Pending {
    unacked: Unacked,
    confirms: Vec<PublisherConfirm>,
}

impl Pending {
    /// Waits for every event's confirm, then acks the deliveries (`multiple`).
    async fn settle(&mut self, recorder: &Recorder) -> Result<(), BenchError> {
        for confirm in self.confirms.drain(..) {
            crate::workload::confirmed(confirm.await?)?;
        }
        self.unacked.ack(recorder).await
    }
}

async fn consume(
    mut deliveries: Deliveries,
    publisher: &Channel,
    events: &str,
    recorder: Arc<Recorder>,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    // The acker: each batch's confirms awaited, then its `multiple` ack, in order,
    // while the consumer goes on.
    let (batches, mut to_ack) = tokio::sync::mpsc::channel::<Pending>(8);
    let acker = tokio::spawn(async move {
        while let Some(mut batch) = to_ack.recv().await {
            batch.settle(&recorder).await?;
        }
        Ok::<(), BenchError>(())
    });
    let hand_over = |pending: &mut Pending| {
        let batch = std::mem::take(pending);
        let batches = batches.clone();
        async move {
            if batch.unacked.last.is_some() && batches.send(batch).await.is_err() {
                return Err::<(), BenchError>("broker: the acker stopped".into());
            }
            Ok(())
        }
    };
    let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
    let properties =
        BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
    let mut pending = Pending::default();
    let consumed = async {
        loop {
            let next = match deliveries.next().now_or_never() {
                Some(next) => next,
                None => {
                    // Idle: nothing is waiting, so hand over what there is before waiting.
                    hand_over(&mut pending).await?;
                    tokio::select! {
                        () = stop.cancelled() => break,
                        next = deliveries.next() => next,
                    }
                }
            };
            let Some(delivery) = next else { break };
            let delivery = delivery?;
            pending.unacked.received.push(Instant::now());
            let confirm = publisher
                .basic_publish("".into(), events.into(), options, &delivery.data, properties.clone())
                .await?;
            pending.confirms.push(confirm);
            pending.unacked.last = Some(delivery);
            if pending.unacked.received.len() >= ACK_EVERY {
                hand_over(&mut pending).await?;
            }
        }
        hand_over(&mut pending).await
    }
    .await;
    drop(batches);
    let acked = acker.await?;
    consumed.and(acked)
}
