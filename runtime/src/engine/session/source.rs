//! Where an intake's deliveries come from — the consumer's own stream, or its share
//! of a queue several handlers consume — and the next one, registered with the
//! channel's acks. Shared by the intake and its pause (`pause`).

use futures_util::StreamExt;
use lapin::message::Delivery;
use tokio::sync::mpsc;

use super::loss::Loss;
use crate::engine::delivery::Consumer;

/// Where an intake's deliveries come from.
pub(super) enum Source {
    /// The consumer's own stream on its channel: each delivery is registered with
    /// the channel's acks as it is taken.
    Broker(lapin::Consumer),
    /// Its share of a queue several handlers consume (`intake::consume_routed`): the
    /// router took them from the channel's stream and registered them.
    Routed(mpsc::UnboundedReceiver<Delivery>),
}

impl Source {
    pub(super) async fn next(&mut self, consumer: &Consumer) -> Next {
        match self {
            Self::Broker(stream) => registered(consumer, stream.next().await),
            // The router is gone: it reports why the stream ended.
            Self::Routed(deliveries) => {
                deliveries.recv().await.map_or(Next::Ended(Loss::Stopped), Next::Delivery)
            }
        }
    }
}

/// The next delivery of a consumer's stream, registered with its channel's acks.
#[allow(clippy::large_enum_variant)] // moved once, straight into a batch
pub(super) enum Next {
    Delivery(Delivery),
    /// The stream ended: why.
    Ended(Loss),
}

/// `next` of a consumer's stream: a delivery, registered with its channel's acks, or
/// why the stream ended.
pub(super) fn registered(consumer: &Consumer, next: Option<lapin::Result<Delivery>>) -> Next {
    match next {
        Some(Ok(mut delivery)) => {
            consumer.acks.received(&delivery);
            // Held here and never started when its channel closed: nothing of it ran,
            // so it is no suspect of a crash and need not run alone.
            if delivery.redelivered && consumer.shared.unstarted.take(&consumer.queue, &delivery) {
                delivery.redelivered = false;
            }
            Next::Delivery(delivery)
        }
        Some(Err(err)) => Next::Ended(Loss::of_consumer(&consumer.queue, err)),
        None => Next::Ended(Loss::Cancelled { queue: consumer.queue.clone() }),
    }
}
