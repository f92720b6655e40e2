//! Contenders 3–5, 7, 8 and 12: idemq's [`Runtime`] on the payments queue, with the default
//! retry policy (whose wait queues it declares at start-up). Every setting not
//! named here is the builder's default.

use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use idemq::{
    idempotent_handler, observe::Settled, Batch, Context, HandlerError, Outcome, Queue, Runtime, Topology,
};
use idemq_example_payments::{record_payment, record_payments, PaymentApplied, PaymentRequested};
use tokio_util::sync::CancellationToken;

use super::Consumer;
use crate::metrics::{Recorder, Settle};
use crate::urls::Urls;
use crate::BenchError;

/// The demo's payment effect (`record_payment`, without the demo's outbox event:
/// the baseline does not publish either) under the demo's dedup name, without a lane.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn apply_payment_unlaned(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// The same, with the demo's lane (the account).
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn apply_payment_laned(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// The demo's `apply_payment` as it is: a batch handler with the demo's lane, one
/// call per transaction, the demo's `record_payments` (one multi-row ledger insert,
/// one upsert of per-account totals), and a `PaymentApplied` event per payment
/// through the outbox — the batch form of `apply_payment_with_event`.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn apply_payment_batched(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    record_payments(conn, batch.messages()).await?;
    let events = EVENTS.get().map_or("", String::as_str);
    for (msg, ctx) in batch.iter_mut() {
        ctx.publish("", events, &PaymentApplied::from(msg.clone()))?;
    }
    Ok(())
}

/// Where the outbox contender's events go: the run's events queue.
static EVENTS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The name of a run's events queue (declared and deleted by the parent).
pub(crate) fn events_queue(queue: &str) -> String {
    format!("{queue}.events")
}

/// The laned handler that also publishes the demo's event, through the outbox.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn apply_payment_with_event(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let event = PaymentApplied::from(msg);
    ctx.publish("", EVENTS.get().map_or("", String::as_str), &event)?;
    Ok(())
}

/// How the runtime is configured.
#[derive(Debug, Clone, Copy)]
pub(super) enum Flavor {
    /// `.batch_size(1).concurrency(c)`, the unlaned handler.
    PerMessage(usize),
    /// Defaults, the unlaned handler.
    Group,
    /// Defaults, the laned handler (lane = "account", as the demo's).
    Lanes,
    /// Defaults, the laned handler with an outbox event per payment.
    Outbox,
    /// Defaults, the laned batch handler.
    Batch,
    /// The laned batch handler with the expert loop's batch size and transactions
    /// in flight.
    Tuned,
}

pub(super) fn start(
    flavor: Flavor,
    urls: &Urls,
    queue: &str,
    recorder: Arc<Recorder>,
) -> Result<Consumer, BenchError> {
    let builder = Runtime::builder()
        .amqp_url(&urls.amqp)
        .database_url(&urls.database)
        .topology(Topology::new().queue(Queue::new(queue)))
        .observe(idemq::observe::on_settled(move |settled| record(&recorder, settled)));
    let builder = match flavor {
        Flavor::PerMessage(concurrency) => {
            builder.consume(queue, apply_payment_unlaned).batch_size(1).concurrency(concurrency)
        }
        Flavor::Group => builder.consume(queue, apply_payment_unlaned),
        Flavor::Lanes => builder.consume(queue, apply_payment_laned),
        Flavor::Outbox => {
            let _ = EVENTS.set(events_queue(queue));
            builder.consume(queue, apply_payment_with_event)
        }
        Flavor::Batch => {
            let _ = EVENTS.set(events_queue(queue));
            builder.consume(queue, apply_payment_batched)
        }
        Flavor::Tuned => {
            let _ = EVENTS.set(events_queue(queue));
            builder
                .consume(queue, apply_payment_batched)
                .batch_size(super::batched::BATCH)
                .concurrency(super::batched::IN_FLIGHT)
        }
    };
    let runtime = builder.build()?;
    let stats = runtime.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { runtime.run(stop).await.map_err(BenchError::from) }
    });
    Ok(Consumer {
        stop,
        task,
        infrastructure_retries: Box::new(move || stats.snapshot().infrastructure_retries),
    })
}

fn record(recorder: &Recorder, settled: &Settled) {
    if !settled.settled_with_broker {
        // The ack (or nack) was not sent: the broker delivers the message again.
        return recorder.returned();
    }
    let how = match settled.outcome {
        Outcome::Applied => Settle::Applied,
        Outcome::Duplicate => Settle::Duplicate,
        Outcome::DeadLettered { .. } | Outcome::AlreadyCopied { .. } => Settle::Failed,
        // Retry, Requeued, Abandoned: the message comes again.
        _ => return recorder.returned(),
    };
    recorder.settle(how, settled.received_at, settled.settled_at);
}
