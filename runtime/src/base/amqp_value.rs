//! Reading AMQP field values (headers, `x-death` entries) as text: one reading for the
//! delivery state machine, the handler's context, key extraction and the DLQ tools.

use lapin::types::AMQPValue;
use lapin::BasicProperties;

use crate::base::headers;

/// The name a delivery is routed by on a queue several handlers consume, one per
/// message type: its AMQP `type`, else (no `type`, or an empty one) the routing key
/// it was first published with.
///
/// A copy (a retry coming back from its wait queue, a dead letter, a replay)
/// arrives with another routing key — the queue's name — so the key it was first
/// published with is read from [`ORIGINAL_ROUTING_KEY`](headers::ORIGINAL_ROUTING_KEY),
/// which every copy carries: a message routed by its key is routed the same way
/// at every attempt and in every generation.
pub(crate) fn routed_type<'a>(properties: &'a BasicProperties, routing_key: &'a str) -> &'a str {
    match properties.kind() {
        Some(kind) if !kind.as_str().is_empty() => kind.as_str(),
        _ => original_routing_key(properties).unwrap_or(routing_key),
    }
}

/// The routing key a copy's original was published with
/// ([`ORIGINAL_ROUTING_KEY`](headers::ORIGINAL_ROUTING_KEY)), if it is a copy.
fn original_routing_key(properties: &BasicProperties) -> Option<&str> {
    let value = header(properties, headers::ORIGINAL_ROUTING_KEY)?;
    std::str::from_utf8(bytes(value)?).ok()
}

/// The header `name` of a delivery, if it has one.
pub fn header<'a>(properties: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// A string value (long or short), as text; anything else — and a long string that
/// is not valid UTF-8 — is `None`. Never lossy: two different byte strings never
/// read as one text (see `bytes` beside it for the raw bytes).
pub fn string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A string value's bytes (a long string may hold any); anything else is `None`.
pub(crate) fn bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}

/// A string as it is, an integer in decimal; anything else (and a string that is
/// not valid UTF-8) is `None`.
pub fn text(value: &AMQPValue) -> Option<String> {
    match *value {
        AMQPValue::LongLongInt(v) => Some(v.to_string()),
        AMQPValue::LongInt(v) => Some(v.to_string()),
        AMQPValue::LongUInt(v) => Some(v.to_string()),
        AMQPValue::ShortInt(v) => Some(v.to_string()),
        AMQPValue::ShortUInt(v) => Some(v.to_string()),
        AMQPValue::ShortShortInt(v) => Some(v.to_string()),
        AMQPValue::ShortShortUInt(v) => Some(v.to_string()),
        _ => string(value),
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::BasicProperties;

    use super::routed_type;
    use crate::base::headers;

    fn copy_of(original_key: &str) -> BasicProperties {
        let mut table = FieldTable::default();
        table.insert(
            headers::ORIGINAL_ROUTING_KEY.into(),
            AMQPValue::LongString(LongString::from(original_key)),
        );
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn a_delivery_is_routed_by_its_type_first() {
        let typed = copy_of("payment.refunded").with_type("payment.requested".into());
        assert_eq!(routed_type(&typed, "payments"), "payment.requested");
    }

    #[test]
    fn an_untyped_first_delivery_is_routed_by_its_routing_key() {
        assert_eq!(routed_type(&BasicProperties::default(), "payment.refunded"), "payment.refunded");
        let empty = BasicProperties::default().with_type("".into());
        assert_eq!(routed_type(&empty, "payment.refunded"), "payment.refunded");
    }

    #[test]
    fn an_untyped_copy_is_routed_by_the_key_its_original_was_published_with() {
        // A retry copy comes back from its wait queue, and a replay is published,
        // with the queue's name as routing key.
        assert_eq!(routed_type(&copy_of("payment.refunded"), "payments"), "payment.refunded");
    }
}
