//! What a delivery's properties say about its past (redelivered, attempt, replay
//! generation: only as far as the broker and idemq vouch for it) and what makes it
//! itself (its [`Identity`], for copy ids).

use lapin::message::Delivery;
use lapin::types::AMQPValue;

use super::{Consumer, Delivered};
use crate::base::amqp_value;
use crate::base::headers;
use crate::handler::identity::Identity;

/// What a delivery's properties say about its past — only as far as the broker and
/// idemq vouch for it: headers a publisher set are not trusted.
#[derive(Debug, Clone, Copy)]
pub(super) struct Counts {
    /// The broker redelivered it (it was delivered before without an ack).
    pub(super) redelivered: bool,
    /// The broker's delivery count (`x-delivery-count` on quorum queues), read only
    /// when the broker says it redelivered (a publisher can set the header too).
    /// Reported; poison is judged by recorded handler starts, not by this count.
    pub(super) delivery_count: u32,
    /// This handler attempt's number: 1, or 1 + the `x-idemq-attempts` of a retry
    /// copy that came back through this queue's own wait queue.
    pub(super) attempt: u32,
    /// Its replay generation: how often `dlq replay` sent it back (`x-idemq-replay`,
    /// 0 without). Part of its [`Identity`]; trusting a publisher's value costs
    /// nothing (another value only makes another lineage).
    pub(super) replay: u32,
}

impl Counts {
    pub(super) fn of(delivery: &Delivery, queue: &str) -> Self {
        let table = delivery.properties.headers().as_ref().map(|h| h.inner());
        let header = |name: &str| table.and_then(|t| t.get(name));
        let redelivered = delivery.redelivered;
        let delivery_count =
            if redelivered { header(headers::DELIVERY_COUNT).map_or(0, as_count) } else { 0 };
        let retried_here = header(headers::RETRY_OF).and_then(amqp_value::string).is_some_and(|q| q == queue)
            && header("x-death").is_some_and(|death| came_from_wait_queue(death, queue));
        let attempt =
            if retried_here { header(headers::ATTEMPTS).map_or(0, as_count).saturating_add(1) } else { 1 };
        let replay = header(headers::REPLAY).map_or(0, as_count);
        Self { redelivered, delivery_count, attempt, replay }
    }
}

/// Whether the newest `x-death` entry says the message expired in one of `queue`'s
/// wait queues (`<queue>.retry.<ms>ms`): the broker's word that it took that path.
fn came_from_wait_queue(death: &AMQPValue, queue: &str) -> bool {
    let AMQPValue::FieldArray(entries) = death else { return false };
    let Some(AMQPValue::FieldTable(newest)) = entries.as_slice().first() else { return false };
    let field = |name: &str| newest.inner().get(name).and_then(amqp_value::string);
    let prefix = format!("{queue}.retry.");
    field("queue").is_some_and(|q| q.starts_with(&prefix)) && field("reason").as_deref() == Some("expired")
}

fn as_count(value: &AMQPValue) -> u32 {
    let number = match *value {
        AMQPValue::LongLongInt(v) => v,
        AMQPValue::LongInt(v) => i64::from(v),
        AMQPValue::LongUInt(v) => i64::from(v),
        AMQPValue::ShortInt(v) => i64::from(v),
        AMQPValue::ShortUInt(v) => i64::from(v),
        AMQPValue::ShortShortInt(v) => i64::from(v),
        AMQPValue::ShortShortUInt(v) => i64::from(v),
        _ => 0,
    };
    u32::try_from(number.max(0)).unwrap_or(u32::MAX)
}

impl Consumer {
    /// What makes `item` itself (see [`crate::handler::identity`]): `key` is its stored dedup key,
    /// `None` when it could not be decoded.
    pub(super) fn identity<'a>(&'a self, item: &'a Delivered, key: Option<&'a str>) -> Identity<'a> {
        let delivery = &item.delivery;
        Identity {
            scope: &self.scope,
            key,
            message_id: delivery.properties.message_id().as_ref().map(|id| id.as_str()),
            body: &delivery.data,
            replay: item.counts.replay,
        }
    }
}
