//! Settling deliveries with the broker, for one channel session: single acks and
//! nacks, and one `multiple` ack for a run of deliveries where that is safe.
//!
//! `basic.ack(multiple)` with tag `T` acks *every* unacked delivery of the channel up
//! to `T`, including ones still in flight elsewhere, and a later ack of one of them
//! is a 406 that closes the channel. So a multiple ack is sent only below the
//! *watermark*: the lowest tag of this channel whose frame has not gone out, other
//! than the ones being acked. A tag is forgotten only once its frame was sent, so
//! every tag below the watermark is settled and the only unacked tags a multiple ack
//! covers are the ones it means to ack. Tags above the watermark are acked one by
//! one, at once: nothing waits for a slow neighbour. No lock is held while a frame
//! goes out.
//!
//! This relies on every delivery of the channel being [`Acks::received`] in delivery
//! order before any later one is settled: one consumer per channel, whose intake
//! registers each delivery as it takes it from the stream.
//!
//! Deliveries that go back to the queue go one by one, as [`REQUEUE`] says: never a
//! `multiple` nack (it would return every unacked tag below, in flight elsewhere or
//! not), and a `basic.nack`, not a `basic.reject`, so that on RabbitMQ 4.3+ a requeue
//! does not count towards a quorum queue's delivery limit.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Acker;

/// The settling state of one channel.
#[derive(Debug, Default)]
pub(crate) struct Acks {
    /// Tags received whose ack or nack frame has not gone out yet. A tag leaves only
    /// after its frame was sent, so the watermark never passes a frame in flight.
    unsettled: Mutex<BTreeSet<u64>>,
}

/// How a delivery goes back to its queue: one `basic.nack` of its own tag, with
/// `requeue`.
///
/// - **Never `multiple`.** A multiple nack settles *every* unacked delivery of the
///   channel up to its tag, including ones still running elsewhere, whose own
///   settlement would then be a 406 that closes the channel. Acks may go as one
///   `multiple` below the watermark because every tag there is settled already;
///   requeues are rare and go one by one, so a requeue only ever returns the
///   delivery it names. (Invariant, checked when compiling: see below.)
/// - **`nack`, not `reject`.** From RabbitMQ 4.3 on, a quorum queue counts a
///   `basic.reject` with requeue as a failed delivery (`x-delivery-count` + 1; the
///   queue's `x-delivery-limit`, RabbitMQ's default 20 or idemq's
///   `delivery_limit + BROKER_LIMIT_MARGIN`, dead-letters at it), and a
///   `basic.nack` with requeue as "not processed", which it does not count (its
///   `x-acquired-count` still goes up). idemq requeues only what it has not
///   finished — a database outage past `database_retry_limit`, a fault that stops
///   the runtime, a shutdown, a retry or dead-letter copy it could not publish, a
///   delivery its batch left undecided — none of them the message's fault, so none
///   brings it nearer the broker's limit. Handler failures are counted by idemq
///   itself: retry copies carry the attempt, and poison is judged by the handler
///   starts it records (`idemq_started`).
pub(crate) const REQUEUE: BasicNackOptions = BasicNackOptions { multiple: false, requeue: true };

// One tag, never the run below it; back to the queue, not dropped or dead-lettered.
const _: () = assert!(!REQUEUE.multiple && REQUEUE.requeue, "a requeue returns only the delivery it names");

/// Whether each frame was sent (`false`: the channel is gone, the broker redelivers).
pub(crate) type Sent = lapin::Result<bool>;

/// The longest one ack or nack frame may take to go out. A connection whose I/O
/// died may never answer; the lock must not be held forever (the broker redelivers
/// whatever was not settled).
const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

async fn bounded(frame: impl Future<Output = Sent>) -> Sent {
    tokio::time::timeout(FRAME_TIMEOUT, frame).await.unwrap_or(Ok(false))
}

impl Acks {
    /// Registers a delivery as taken from the channel's stream.
    pub(crate) fn received(&self, delivery: &Delivery) {
        self.lock().insert(delivery.delivery_tag);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        self.unsettled.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets tags whose frames went out.
    fn settled(&self, tags: impl IntoIterator<Item = u64>) {
        let mut unsettled = self.lock();
        for tag in tags {
            unsettled.remove(&tag);
        }
    }

    /// Acks `deliveries` (of this channel): one `multiple` ack for those below the
    /// watermark, single acks for the rest. Returns one result per delivery, in order.
    pub(crate) async fn ack(&self, deliveries: &[&Delivery]) -> Vec<Sent> {
        let ours: BTreeSet<u64> = deliveries.iter().map(|d| d.delivery_tag).collect();
        // The lowest tag of anyone else's still unsettled. Ours stay registered until
        // their frames are out, so no one else's multiple ack covers them meanwhile.
        let watermark = self.lock().iter().find(|tag| !ours.contains(tag)).copied().unwrap_or(u64::MAX);
        let below: Vec<&&Delivery> = deliveries.iter().filter(|d| d.delivery_tag < watermark).collect();
        let multiple = match below.iter().max_by_key(|d| d.delivery_tag) {
            Some(highest) if below.len() > 1 => {
                Some(bounded(highest.acker.ack(BasicAckOptions { multiple: true })).await)
            }
            _ => None,
        };
        let mut sent = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            let result = match &multiple {
                Some(result) if delivery.delivery_tag < watermark => clone_result(result),
                _ => bounded(delivery.acker.ack(BasicAckOptions::default())).await,
            };
            sent.push(result);
        }
        self.settled(ours);
        sent
    }

    /// Nacks one delivery with requeue.
    pub(crate) async fn requeue(&self, delivery: &Delivery) -> Sent {
        self.requeue_tag(delivery.delivery_tag, &delivery.acker).await
    }

    /// Like [`requeue`](Self::requeue), for a delivery known by its tag and acker.
    pub(crate) async fn requeue_tag(&self, tag: u64, acker: &Acker) -> Sent {
        let sent = bounded(acker.nack(REQUEUE)).await;
        self.settled([tag]);
        sent
    }

    /// Acks one delivery.
    pub(crate) async fn ack_one(&self, delivery: &Delivery) -> Sent {
        self.ack(&[delivery]).await.pop().unwrap_or(Ok(false))
    }
}

fn clone_result(result: &lapin::Result<bool>) -> lapin::Result<bool> {
    match result {
        Ok(sent) => Ok(*sent),
        // lapin's error is not Clone; the channel is gone either way.
        Err(_) => Ok(false),
    }
}
