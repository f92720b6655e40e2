//! Contender 1, the broker's ceiling: lapin with manual acks and no database. One
//! `multiple` ack per [`ACK_EVERY`] deliveries, and one whenever no delivery is
//! waiting (so a lone message is acked at once).

use std::sync::Arc;
use std::time::Instant;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicQosOptions};
use lapin::{Connection, ConnectionProperties, Consumer as Deliveries};
use tokio_util::sync::CancellationToken;

use super::Consumer;
use crate::metrics::{Recorder, Settle};
use crate::urls::Urls;
use crate::BenchError;

/// Deliveries per `multiple` ack.
pub(super) const ACK_EVERY: usize = 100;
/// The channel's prefetch: several acks' worth, so the broker never waits for one.
pub(super) const PREFETCH: u16 = 1_000;

pub(super) async fn start(urls: &Urls, queue: &str, recorder: Arc<Recorder>) -> Result<Consumer, BenchError> {
    let connection = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(PREFETCH, BasicQosOptions { global: false }).await?;
    let deliveries = super::subscribe(&channel, queue, "idemq-bench-raw").await?;
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let consumed = consume(deliveries, &recorder, &stop).await;
            let _ = connection.close(200, "done".into()).await;
            consumed
        }
    });
    Ok(Consumer { stop, task, infrastructure_retries: Box::new(|| 0) })
}

/// Deliveries received and not yet acked: the last one (whose `multiple` ack covers
/// them all) and when each was received.
#[derive(Default)]
pub(super) struct Unacked {
    pub(super) last: Option<Delivery>,
    pub(super) received: Vec<Instant>,
}

impl Unacked {
    pub(super) async fn ack(&mut self, recorder: &Recorder) -> Result<(), BenchError> {
        let Some(last) = self.last.take() else { return Ok(()) };
        if !last.ack(BasicAckOptions { multiple: true }).await? {
            return Err("the ack was not sent (channel gone)".into());
        }
        let settled = Instant::now();
        for received in self.received.drain(..) {
            recorder.settle(Settle::Acked, received, settled);
        }
        Ok(())
    }
}

async fn consume(
    mut deliveries: Deliveries,
    recorder: &Recorder,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    let mut unacked = Unacked::default();
    loop {
        let next = match deliveries.next().now_or_never() {
            Some(next) => next,
            None => {
                // Idle: nothing is waiting, so ack what there is before waiting.
                unacked.ack(recorder).await?;
                tokio::select! {
                    () = stop.cancelled() => break,
                    next = deliveries.next() => next,
                }
            }
        };
        let Some(delivery) = next else { break };
        unacked.received.push(Instant::now());
        unacked.last = Some(delivery?);
        if unacked.received.len() >= ACK_EVERY {
            unacked.ack(recorder).await?;
        }
    }
    unacked.ack(recorder).await
}
