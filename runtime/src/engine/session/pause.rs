//! An open kill switch seen from the intake (see [`crate::engine::flow`]): cancel the
//! consumer, return what it holds to the queue unprocessed, wait out the pause, try
//! one message at a time (`basic.get`) until one applies or the queue is empty, then
//! consume again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicGetOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use super::closed;
use super::loss::Loss;
use super::source::{Next, Source};
use crate::engine::delivery::{Consumer, Item};
use crate::engine::flow::Probe;

/// How long the deliveries the broker sent before the cancel may take to arrive.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a paused intake did not resume.
pub(super) enum Ended {
    /// Shutdown began (the consumer is already cancelled).
    Stopped,
    /// The channel or its consumer went away.
    Lost(Loss),
}

/// Pauses `consumer`'s intake while its kill switch is open: cancels the consumer
/// `tag`, requeues `pending` and whatever the stream still delivers, waits out the
/// pause and tries one message after another until one passes (or the queue is
/// empty); then consumes again as `tag`, its new stream in `stream`.
pub(super) async fn pause(
    consumer: &Arc<Consumer>,
    stream: &mut Source,
    pending: &mut VecDeque<Delivery>,
    tag: &str,
    hard_stop: &CancellationToken,
    stop: &CancellationToken,
) -> Result<(), Ended> {
    // A queue several handlers share has no switch (`RuntimeBuilder::build`).
    let Source::Broker(_) = stream else { return Ok(()) };
    let lost = || Ended::Lost(Loss::ChannelClosed { queue: consumer.queue.clone() });
    let cancelled = tokio::time::timeout(
        super::CLOSE_TIMEOUT,
        consumer.channel.basic_cancel(tag.into(), BasicCancelOptions::default()),
    )
    .await;
    if !matches!(cancelled, Ok(Ok(()))) {
        return Err(lost());
    }
    // What the broker sent before the cancel goes back, as what was taken.
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Next::Delivery(delivery) = stream.next(consumer).await {
            pending.push_back(delivery);
        }
    })
    .await;
    let returned = pending.len();
    for delivery in pending.drain(..) {
        let _ = consumer.acks.requeue(&delivery).await;
    }
    if drained.is_err() {
        return Err(lost());
    }
    crate::base::log::info!(queue = %consumer.queue, returned, "kill switch open: consumer cancelled, its deliveries returned to the queue");
    loop {
        tokio::select! {
            () = consumer.flow.pause_over() => {}
            () = stop.cancelled() => return Err(Ended::Stopped),
            () = closed(&consumer.channel) => return Err(lost()),
        }
        let got = tokio::time::timeout(
            super::CLOSE_TIMEOUT,
            consumer.channel.basic_get(consumer.queue.as_str().into(), BasicGetOptions { no_ack: false }),
        )
        .await;
        let message = match got {
            Ok(Ok(message)) => message,
            _ => return Err(lost()),
        };
        let Some(message) = message else {
            // Nothing to try: whatever comes next is the test.
            consumer.flow.close();
            break;
        };
        let delivery = message.delivery;
        consumer.acks.received(&delivery);
        consumer.process(vec![Item::new(delivery, consumer, None)], hard_stop).await;
        // Its outcome is told when it is decided; one cut off unsettled (its channel
        // gone) never is: the channel's loss ends the wait.
        let probe = tokio::select! {
            probe = consumer.flow.probed() => probe,
            () = stop.cancelled() => return Err(Ended::Stopped),
            () = closed(&consumer.channel) => return Err(lost()),
        };
        match probe {
            Probe::Passed => break,
            Probe::Failed | Probe::Inconclusive => {}
        }
    }
    consumer.flow.resumed();
    let resumed = tokio::time::timeout(
        super::CLOSE_TIMEOUT,
        consumer.channel.basic_consume(
            consumer.queue.as_str().into(),
            tag.into(),
            BasicConsumeOptions { no_ack: false, ..Default::default() },
            FieldTable::default(),
        ),
    )
    .await;
    match resumed {
        Ok(Ok(resumed)) => {
            *stream = Source::Broker(resumed);
            Ok(())
        }
        _ => Err(lost()),
    }
}
