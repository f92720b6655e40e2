//! Contender 10, the database's ceiling (issue 39): the rows idemq-batch writes for
//! the backlog — dedup row, ledger row, balance, outbox row and its removal — written
//! by the batched transaction of [`batched`], [`IN_FLIGHT`](batched::IN_FLIGHT)
//! transactions in flight, with no broker in the measured window. Before the clock
//! starts it drains the run's queue into memory (so the run's queue checks hold);
//! then each batch of [`BATCH`](batched::BATCH) bodies is decoded and written, and
//! the outbox rows a batch wrote are deleted by the next transaction on the same
//! connection (as if their events had been confirmed at once), the last ones by a
//! statement of their own.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use diesel::QueryResult;
use diesel_async::AsyncPgConnection;
use futures_util::stream::FuturesOrdered;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicQosOptions};
use lapin::{Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use super::batched::{self, Applied, Payment, BATCH, IN_FLIGHT};
use super::Consumer;
use crate::metrics::{Recorder, Settle};
use crate::urls::Urls;
use crate::BenchError;

/// Deliveries per `multiple` ack while the queue is drained.
const DRAIN_ACK_EVERY: usize = 500;

/// Takes the `expect` messages of `queue` (the run's backlog) into memory, acked.
pub(super) async fn drain(urls: &Urls, queue: &str, expect: u64) -> Result<Vec<Vec<u8>>, BenchError> {
    let connection = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(2_000, BasicQosOptions { global: false }).await?;
    let mut deliveries = super::subscribe(&channel, queue, "idemq-bench-database-drain").await?;
    let mut bodies = Vec::with_capacity(usize::try_from(expect).unwrap_or(0));
    while (bodies.len() as u64) < expect {
        let delivery = deliveries.next().await.ok_or("database: the queue's consumer was cancelled")??;
        bodies.push(delivery.data.clone());
        if bodies.len() % DRAIN_ACK_EVERY == 0 || bodies.len() as u64 == expect {
            delivery.ack(BasicAckOptions { multiple: true }).await?;
        }
    }
    let _ = connection.close(200, "drained".into()).await;
    Ok(bodies)
}

pub(super) async fn start(
    urls: &Urls,
    queue: &str,
    bodies: Vec<Vec<u8>>,
    recorder: Arc<Recorder>,
) -> Result<Consumer, BenchError> {
    let mut idle = Vec::with_capacity(IN_FLIGHT);
    for _ in 0..IN_FLIGHT {
        idle.push((idemq::connect::database(&urls.database).await?, Vec::new()));
    }
    let events = super::events_queue(queue);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { write(bodies, idle, &events, &recorder, &stop).await }
    });
    Ok(Consumer { stop, task, infrastructure_retries: Box::new(|| 0) })
}

/// A connection and the outbox rows its last batch wrote (deleted by its next).
type Slot = (AsyncPgConnection, Vec<i64>);
type Written = Pin<Box<dyn Future<Output = (Slot, Instant, QueryResult<Applied>)> + Send>>;

async fn write(
    bodies: Vec<Vec<u8>>,
    mut idle: Vec<Slot>,
    events: &str,
    recorder: &Recorder,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    let mut batches = bodies.chunks(BATCH);
    let mut in_flight: FuturesOrdered<Written> = FuturesOrdered::new();
    loop {
        while let Some((mut conn, published)) = idle.pop() {
            let Some(bodies) = batches.next() else {
                batched::delete_published(&mut conn, &published).await?;
                continue;
            };
            let received = Instant::now();
            let payments: Vec<Payment> = bodies.iter().filter_map(|body| Payment::decode(body)).collect();
            let failed = bodies.len() - payments.len();
            (0..failed).for_each(|_| recorder.settle(Settle::Failed, received, received));
            let events = events.to_owned();
            in_flight.push_back(Box::pin(async move {
                let applied = batched::apply(&mut conn, &payments, &events, &published).await;
                ((conn, Vec::new()), received, applied)
            }));
        }
        let next = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            next = in_flight.next() => next,
        };
        let Some(((conn, _), received, applied)) = next else { return Ok(()) };
        let applied = applied?;
        let settled = Instant::now();
        for new in applied.new {
            recorder.settle(if new { Settle::Applied } else { Settle::Duplicate }, received, settled);
        }
        idle.push((conn, applied.events.into_iter().map(|event| event.id).collect()));
    }
}
