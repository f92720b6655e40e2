//! Reading AMQP field values (headers, `x-death` entries) as text: one reading for the
//! delivery state machine, the handler's context, key extraction and the DLQ tools.

use lapin::types::AMQPValue;
use lapin::BasicProperties;

/// The name a delivery is routed by on a queue several handlers consume, one per
/// message type: its AMQP `type`, else (no `type`, or an empty one) its routing key.
pub(crate) fn routed_type<'a>(properties: &'a BasicProperties, routing_key: &'a str) -> &'a str {
    match properties.kind() {
        Some(kind) if !kind.as_str().is_empty() => kind.as_str(),
        _ => routing_key,
    }
}

/// The header `name` of a delivery, if it has one.
pub(crate) fn header<'a>(properties: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// A string value (long or short), as text; anything else — and a long string that
/// is not valid UTF-8 — is `None`. Never lossy: two different byte strings never
/// read as one text (see [`bytes`] for the raw bytes).
pub(crate) fn string(value: &AMQPValue) -> Option<String> {
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
pub(crate) fn text(value: &AMQPValue) -> Option<String> {
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
