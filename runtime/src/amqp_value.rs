//! Reading AMQP field values (headers, `x-death` entries) as text: one reading for the
//! delivery state machine, the handler's context, key extraction and the DLQ tools.

use lapin::types::AMQPValue;
use lapin::BasicProperties;

/// The header `name` of a delivery, if it has one.
pub(crate) fn header<'a>(properties: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// A string value (long or short), as text; anything else is `None`.
pub(crate) fn string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A string as it is, an integer in decimal; anything else is `None`.
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
