//! Where a stream ends, read over AMQP 0-9-1 (RabbitMQ 3.9 and on): the offsets the
//! broker sets on what it delivers (`x-stream-offset`). `status` reads both ends of
//! each stream; a stream consumer reads the last to report its lag
//! (`idemq_stream_lag_messages`).
//!
//! - The first: the offset of the first delivery of a consumer started at `first`.
//!   Exact.
//! - The last: a consumer started at `last` is sent the whole last chunk of the
//!   stream (and what is committed after it), from the chunk's first message, in one
//!   burst — the broker reads every committed entry its credit allows as soon as
//!   the consumer attaches, and the credit here is renewed as deliveries come. So
//!   the greatest offset delivered before the deliveries pause for [`BURST_GAP`] is
//!   the stream's last, exact as of the read (a stream still written to ends later
//!   a moment after; a read lasts at most [`BURST_LIMIT`]).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Connection;

/// The pause in deliveries that ends a read of a stream's last chunk, and the
/// longest such a read lasts on a stream still written to.
pub const BURST_GAP: Duration = Duration::from_millis(300);
/// The longest a read of a last chunk lasts.
pub(crate) const BURST_LIMIT: Duration = Duration::from_secs(5);

/// The offset of the first delivery of a consumer of `stream` started at `from`
/// (`first` or `last`), or with `burst` the greatest offset delivered until they
/// pause; `None` when nothing is delivered within `wait`. On a channel of its own,
/// closed after (nothing is taken from a stream); `tag` names the consumer.
pub async fn read_offset(
    connection: &Connection,
    stream: &str,
    from: &str,
    wait: Duration,
    burst: bool,
    tag: &str,
) -> Result<Option<i64>, String> {
    let failed = |err: lapin::Error| format!("reading the stream '{stream}' from its {from} message: {err}");
    let channel = connection.create_channel().await.map_err(failed)?;
    // A stream consumer needs a prefetch: the largest there is, for a burst.
    let prefetch = if burst { u16::MAX } else { 1 };
    let consumed = async {
        channel.basic_qos(prefetch, BasicQosOptions { global: false }).await?;
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), AMQPValue::LongString(LongString::from(from)));
        channel.basic_consume(stream.into(), tag.into(), BasicConsumeOptions::default(), args).await
    };
    let mut consumer = match consumed.await {
        Ok(consumer) => consumer,
        Err(err) => {
            let _ = channel.close(200, "inspected".into()).await;
            return Err(failed(err));
        }
    };
    let read = async {
        let Ok(Some(delivery)) = tokio::time::timeout(wait, consumer.next()).await else { return Ok(None) };
        let mut offset = offset_of(&delivery.map_err(failed)?)?;
        if burst {
            let until = Instant::now() + BURST_LIMIT;
            let mut unacked = 0_u32;
            while Instant::now() < until {
                let Ok(Some(Ok(delivery))) = tokio::time::timeout(BURST_GAP, consumer.next()).await else {
                    break;
                };
                offset = offset.max(offset_of(&delivery)?);
                // An ack on a stream only renews the credit.
                unacked += 1;
                if unacked >= 1024 {
                    let _ = delivery.acker.ack(BasicAckOptions { multiple: true }).await;
                    unacked = 0;
                }
            }
        }
        Ok(Some(offset))
    };
    let read = read.await;
    // Cancelled before the channel closes: RabbitMQ 3.10 keeps counting a stream
    // consumer whose channel closed without a cancel among the stream's consumers
    // (`rabbitmqctl list_queues consumers`) until its metrics are collected, minutes
    // later.
    let _ = channel.basic_cancel(tag.into(), BasicCancelOptions::default()).await;
    let _ = channel.close(200, "inspected".into()).await;
    read
}

/// A stream delivery's offset, which the broker sets.
fn offset_of(delivery: &Delivery) -> Result<i64, String> {
    crate::base::amqp_value::header(&delivery.properties, "x-stream-offset")
        .and_then(crate::base::amqp_value::text)
        .and_then(|offset| offset.parse().ok())
        .ok_or_else(|| "a delivery from the stream carries no x-stream-offset: is it a stream?".to_owned())
}
