//! Publishing a copy of a delivery — a dead letter, or a retry into a wait queue: the
//! original body byte for byte, its properties, and headers that explain it.
//! Published persistent, `mandatory`, with a publisher confirm; only a confirmed,
//! routed copy lets the original be acked.

use std::time::SystemTime;

use lapin::message::Delivery;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::base::outcome::FailureKind;

use crate::base::headers::{self, MAX_ERROR_HEADER_BYTES};

/// Why a dead letter could not be published. The original stays unacked. The
/// client's error is the `source`, not repeated in the message: print it with
/// [`report`](crate::error::report).
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error("publishing to '{queue}' failed")]
    Amqp {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    #[error("the broker returned the copy as unroutable: does queue '{queue}' exist?")]
    Unroutable { queue: String },
    #[error("the broker nacked the copy for '{queue}'")]
    Nacked { queue: String },
    #[error("the copy for '{queue}' was not confirmed before the shutdown cut-off")]
    CutOff { queue: String },
}

/// What to say about the failure.
pub(crate) struct Letter<'a> {
    /// Set on dead letters; a retry copy has none.
    pub(crate) kind: Option<FailureKind>,
    pub(crate) error: &'a str,
    pub(crate) handler: &'a str,
    /// The queue it was consumed from (see [`headers::QUEUE`]).
    pub(crate) queue: &'a str,
    pub(crate) attempts: u32,
    /// See [`headers::COPY_ID`].
    pub(crate) copy_id: &'a str,
    /// Set on retry copies: the queue they return to (see [`headers::RETRY_OF`]).
    pub(crate) retry_of: Option<&'a str>,
}

/// Publishes `delivery` to `queue` (default exchange) with the failure headers.
pub(crate) async fn publish(
    channel: &Channel,
    queue: &str,
    delivery: &Delivery,
    letter: &Letter<'_>,
    frame_max: u32,
) -> Result<(), PublishError> {
    let properties = annotate(delivery, letter, frame_max);
    let options = BasicPublishOptions { mandatory: true, ..Default::default() };
    let amqp = |source| PublishError::Amqp { queue: queue.to_owned(), source };
    let confirm = channel
        .basic_publish("".into(), queue.into(), options, &delivery.data, properties)
        .await
        .map_err(amqp)?
        .await
        .map_err(amqp)?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable { queue: queue.to_owned() }),
        Confirmation::Nack(_) | Confirmation::NotRequested => {
            Err(PublishError::Nacked { queue: queue.to_owned() })
        }
    }
}

/// Room left for everything in a header frame but the headers (the other
/// properties are short strings, at most 255 bytes each) and a safety margin: a
/// header frame over `frame_max` is a connection error that returns every in-flight
/// delivery, so a copy must stay well under it.
const FRAME_RESERVE: usize = 8 * 1024;

/// The original's properties, persistent and without `expiration`, with idemq's
/// headers set and the broker's delivery count (and a retry copy's marker) removed,
/// trimmed to fit a header frame under `frame_max`.
fn annotate(delivery: &Delivery, letter: &Letter<'_>, frame_max: u32) -> BasicProperties {
    let original = delivery.properties.headers().clone().unwrap_or_default();
    let mut headers = FieldTable::default();
    for (name, value) in original.inner() {
        if ![headers::DELIVERY_COUNT, headers::RETRY_OF].contains(&name.as_str()) {
            headers.insert(name.clone(), value.clone());
        }
    }
    let now = rfc3339(SystemTime::now());
    let set = |headers: &mut FieldTable, name: &str, value: &str| {
        headers.insert(ShortString::from(name), AMQPValue::LongString(LongString::from(value)));
    };
    let set_if_absent = |headers: &mut FieldTable, name: &str, value: &str| {
        if !headers.contains_key(name) {
            set(headers, name, value);
        }
    };
    set_if_absent(&mut headers, headers::ORIGINAL_EXCHANGE, delivery.exchange.as_str());
    set_if_absent(&mut headers, headers::ORIGINAL_ROUTING_KEY, delivery.routing_key.as_str());
    set_if_absent(&mut headers, headers::FIRST_FAILURE, &now);
    set(&mut headers, headers::LAST_FAILURE, &now);
    set(&mut headers, headers::ERROR, truncate_utf8(letter.error, MAX_ERROR_HEADER_BYTES));
    if let Some(kind) = letter.kind {
        set(&mut headers, headers::ERROR_KIND, kind.as_str());
        if kind == FailureKind::UnroutableType {
            let routed =
                crate::base::amqp_value::routed_type(&delivery.properties, delivery.routing_key.as_str());
            set(&mut headers, headers::MESSAGE_TYPE, routed);
        }
    }
    set(&mut headers, headers::HANDLER, letter.handler);
    set(&mut headers, headers::QUEUE, letter.queue);
    set(&mut headers, headers::COPY_ID, letter.copy_id);
    if let Some(queue) = letter.retry_of {
        set(&mut headers, headers::RETRY_OF, queue);
    }
    if let Some(expiration) = delivery.properties.expiration() {
        set_if_absent(&mut headers, headers::ORIGINAL_EXPIRATION, expiration.as_str());
    }
    headers.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(i64::from(letter.attempts)));
    let budget = usize::try_from(frame_max).unwrap_or(usize::MAX).saturating_sub(FRAME_RESERVE);
    let headers = fit(headers, budget);
    without_expiration(&delivery.properties).with_headers(headers).with_delivery_mode(2)
}

/// `properties` without `expiration`: lapin's builder can set a property but not
/// clear one, so the rest are copied over.
fn without_expiration(properties: &BasicProperties) -> BasicProperties {
    let mut copy = BasicProperties::default();
    macro_rules! keep {
        ($($get:ident => $set:ident),* $(,)?) => {$(
            if let Some(value) = properties.$get().clone() {
                copy = copy.$set(value);
            }
        )*};
    }
    keep!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        user_id => with_user_id,
        app_id => with_app_id,
        cluster_id => with_cluster_id,
    );
    copy
}

/// Makes `headers` encode to at most `budget` bytes: first the broker's `x-death`
/// history goes, then the largest of the original's own headers, each named in
/// `x-idemq-trimmed`. idemq's own headers always stay.
fn fit(mut headers: FieldTable, budget: usize) -> FieldTable {
    let mut trimmed: Vec<String> = Vec::new();
    while table_len(&headers) + 64 + trimmed.iter().map(|t| t.len() + 2).sum::<usize>() > budget {
        let victim = if headers.contains_key("x-death") {
            Some("x-death".to_owned())
        } else {
            headers
                .inner()
                .iter()
                .filter(|(name, _)| !name.as_str().starts_with("x-idemq-"))
                .max_by_key(|(name, value)| name.as_str().len() + value_len(value))
                .map(|(name, _)| name.as_str().to_owned())
        };
        let Some(victim) = victim else { break };
        let mut kept = FieldTable::default();
        for (name, value) in headers.inner() {
            if name.as_str() != victim {
                kept.insert(name.clone(), value.clone());
            }
        }
        headers = kept;
        trimmed.push(victim);
    }
    if !trimmed.is_empty() {
        crate::base::log::warn!(trimmed = ?trimmed, "headers dropped from a copy to keep it under frame_max");
        headers.insert(headers::TRIMMED.into(), AMQPValue::LongString(LongString::from(trimmed.join(","))));
    }
    headers
}

/// The AMQP wire size of a field table: a 4-byte length, then per entry a short
/// string name (1 + len) and a tagged value.
fn table_len(table: &FieldTable) -> usize {
    4 + table.inner().iter().map(|(name, value)| 1 + name.as_str().len() + value_len(value)).sum::<usize>()
}

/// The AMQP wire size of a tagged field value.
fn value_len(value: &AMQPValue) -> usize {
    1 + match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::FieldArray(a) => 4 + a.as_slice().iter().map(value_len).sum::<usize>(),
        AMQPValue::FieldTable(t) => table_len(t),
        AMQPValue::Void => 0,
    }
}

/// The longest prefix of `s` that is at most `max` bytes and ends on a char boundary.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `2026-11-30T11:04:05.123Z`: UTC, milliseconds.
fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(super::rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_796_036_645_123);
        assert_eq!(super::rfc3339(t), "2026-11-30T11:04:05.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(super::rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn oversized_headers_are_trimmed_largest_first_keeping_idemqs_own() {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let mut table = FieldTable::default();
        table.insert("small".into(), AMQPValue::LongString(LongString::from("s")));
        table.insert("big".into(), AMQPValue::LongString(LongString::from("b".repeat(5_000))));
        table.insert("x-idemq-error".into(), AMQPValue::LongString(LongString::from("e".repeat(1_000))));
        let untouched = super::fit(table.clone(), 10_000);
        assert_eq!(untouched, table);
        let fitted = super::fit(table, 2_000);
        assert!(super::table_len(&fitted) <= 2_000);
        assert!(fitted.contains_key("small") && fitted.contains_key("x-idemq-error"));
        assert!(!fitted.contains_key("big"));
        let trimmed = fitted.inner().get("x-idemq-trimmed").cloned();
        assert_eq!(trimmed, Some(AMQPValue::LongString(LongString::from("big"))));
    }

    #[test]
    fn truncation_keeps_whole_chars() {
        assert_eq!(super::truncate_utf8("héllo", 2), "h");
        assert_eq!(super::truncate_utf8("abc", 10), "abc");
        assert_eq!(super::truncate_utf8(&"é".repeat(600), 1024).len(), 1024);
    }
}
