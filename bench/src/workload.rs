//! The payments workload: the messages of one run, what they must add up to, how
//! they are published, and the run's queues.

use std::collections::BTreeMap;

use idemq::{Queue, RetryPolicy, Topology};
use idemq_example_payments::PaymentRequested;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use crate::config::Shape;
use crate::BenchError;

/// One run's messages: `shape.messages` distinct payments over `shape.accounts`
/// accounts, every `duplicates_every`-th published twice, back to back. The same
/// `run_id` and shape always give the same messages (a child rebuilds them).
pub(crate) struct Workload {
    /// Every payment id and account of the run starts with this.
    pub(crate) prefix: String,
    /// Each distinct payment's JSON body.
    payments: Vec<Vec<u8>>,
    /// The publishing order, as indices into `payments`.
    order: Vec<usize>,
    /// What each account's balance must be once every payment is applied once.
    pub(crate) balances: BTreeMap<String, i64>,
}

impl Workload {
    pub(crate) fn new(run_id: &str, shape: Shape) -> Self {
        let prefix = format!("bench-{run_id}-");
        let mut payments = Vec::with_capacity(shape.messages);
        let mut order = Vec::with_capacity(shape.messages + shape.messages / shape.duplicates_every.max(1));
        let mut balances = BTreeMap::new();
        for i in 0..shape.messages {
            let payment = PaymentRequested {
                payment_id: format!("{prefix}pay-{i}"),
                account: format!("{prefix}acct-{}", i % shape.accounts.max(1)),
                amount_cents: 100 + (i as i64 * 37) % 9_900,
            };
            *balances.entry(payment.account.clone()).or_insert(0) += payment.amount_cents;
            payments.push(serde_json::to_vec(&payment).expect("a payment serializes"));
            if shape.duplicates_every > 0 && i % shape.duplicates_every == 0 {
                order.push(i);
            }
            order.push(i);
        }
        Self { prefix, payments, order, balances }
    }

    /// Every body in publishing order, duplicates included.
    pub(crate) fn bodies(&self) -> impl Iterator<Item = &[u8]> {
        self.order.iter().map(|&i| self.payments[i].as_slice())
    }

    /// Each distinct payment once.
    pub(crate) fn distinct_bodies(&self) -> impl Iterator<Item = &[u8]> {
        self.payments.iter().map(Vec::as_slice)
    }

    pub(crate) fn distinct(&self) -> u64 {
        self.payments.len() as u64
    }

    pub(crate) fn deliveries(&self) -> u64 {
        self.order.len() as u64
    }

    pub(crate) fn duplicates(&self) -> u64 {
        self.deliveries() - self.distinct()
    }
}

/// The properties of every published payment: persistent JSON.
pub(crate) fn properties() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into())
}

/// Every publish is `mandatory`: a message the broker cannot route is returned, not dropped.
pub(crate) const PUBLISH: BasicPublishOptions = BasicPublishOptions { mandatory: true, immediate: false };

/// Publishes every body with pipelined confirms (all frames first, then every
/// confirmation); any body not confirmed and routed is an error.
pub(crate) async fn publish<'a>(
    channel: &Channel,
    queue: &str,
    bodies: impl Iterator<Item = &'a [u8]>,
) -> Result<(), BenchError> {
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let props = properties();
    let mut confirms = Vec::new();
    for body in bodies {
        confirms.push(channel.basic_publish("".into(), queue.into(), PUBLISH, body, props.clone()).await?);
    }
    for confirm in confirms {
        confirmed(confirm.await?)?;
    }
    Ok(())
}

/// A broker's confirmation as a result: only an ack of a routed message is success.
pub(crate) fn confirmed(confirmation: Confirmation) -> Result<(), BenchError> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        other => Err(format!("publish not confirmed and routed: {other:?}").into()),
    }
}

/// A run's queues, named uniquely: a quorum queue with its `.dlq` (idemq's
/// [`Topology`], the same kind of queue for every contender) and, for contenders
/// that are an idemq runtime, the default retry policy's wait queues it declares.
pub(crate) struct RunQueues {
    queue: Queue,
    wait_queues: Vec<String>,
    /// The outbox contender's events queue (classic, durable).
    events: Option<String>,
}

/// What was left in a run's queues when they were deleted.
#[derive(Debug, Default)]
pub(crate) struct Leftovers {
    pub(crate) queue: u32,
    pub(crate) dead_letters: u32,
    pub(crate) waiting: u32,
    /// Events in the run's events queue (outbox runs: one per payment expected).
    pub(crate) events: Option<u32>,
}

impl RunQueues {
    pub(crate) fn new(name: String, with_wait_queues: bool) -> Self {
        let wait_queues = if with_wait_queues {
            RetryPolicy::default().wait_queues(&name).into_iter().map(|(queue, _)| queue).collect()
        } else {
            Vec::new()
        };
        Self { queue: Queue::new(name), wait_queues, events: None }
    }

    /// With an events queue for the outbox contender.
    pub(crate) fn with_events(mut self) -> Self {
        self.events = Some(crate::contenders::events_queue(self.queue.name()));
        self
    }

    pub(crate) fn name(&self) -> &str {
        self.queue.name()
    }

    pub(crate) async fn declare(&self, admin: &Connection) -> Result<(), BenchError> {
        let channel = admin.create_channel().await?;
        let mut topology = Topology::new().queue(self.queue.clone());
        if let Some(events) = &self.events {
            topology = topology.queue(Queue::new(events.clone()).classic());
        }
        topology.declare(&channel).await?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    }

    /// Deletes every queue of the run and says how many messages each still held.
    pub(crate) async fn delete(&self, admin: &Connection) -> Result<Leftovers, BenchError> {
        let channel = admin.create_channel().await?;
        let delete = |name: &str| channel.queue_delete(name.into(), QueueDeleteOptions::default());
        let mut left = Leftovers {
            queue: delete(self.queue.name()).await?,
            dead_letters: delete(self.queue.dead_letter_name()).await?,
            waiting: 0,
            events: None,
        };
        for wait_queue in &self.wait_queues {
            left.waiting += delete(wait_queue).await?;
        }
        if let Some(events) = &self.events {
            left.events = Some(delete(events).await?);
            let events = Queue::new(events.clone()).classic();
            delete(events.dead_letter_name()).await?;
        }
        let _ = channel.close(200, "deleted".into()).await;
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_gives_the_deliveries_and_sums_it_promises() {
        let shape = Shape { messages: 100, duplicates_every: 10, accounts: 3 };
        let workload = Workload::new("t", shape);
        assert_eq!((workload.distinct(), workload.duplicates(), workload.deliveries()), (100, 10, 110));
        assert_eq!(workload.balances.len(), 3);
        let decoded: Vec<PaymentRequested> =
            workload.distinct_bodies().map(|b| serde_json::from_slice(b).unwrap()).collect();
        let sum: i64 = decoded.iter().map(|p| p.amount_cents).sum();
        assert_eq!(sum, workload.balances.values().sum::<i64>());
        assert!(Workload::new("t", shape).bodies().eq(workload.bodies()), "not deterministic");
        let none = Workload::new("t", Shape { duplicates_every: 0, ..shape });
        assert_eq!(none.deliveries(), 100);
    }
}
