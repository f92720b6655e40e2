//! The payload fingerprint stored with the dedup row: what decides whether a known
//! key arrived with the *same* payload (a duplicate) or another one (a conflict).
//!
//! A duplicate is judged by what the handler would see, not by the bytes on the
//! wire: a publisher that retries after re-serializing its message (another key
//! order, other spacing, `"\u0041"` for `"A"`, a field added that the consumer's
//! message type does not read) sends the same payment, not a new one. So the
//! fingerprint is the SHA-256 of a canonical form of the decoded JSON with every
//! field the message type ignores taken out:
//!
//! - objects: members sorted by key (by the key's UTF-8 bytes, after unescaping),
//!   no whitespace anywhere;
//! - strings: unescaped, then written as serde_json writes them (`"` `\` and
//!   control characters escaped, everything else as UTF-8);
//! - numbers: as serde_json prints the parsed number (`1.50` and `1.5` are one
//!   number, `100` and `100.0` are not: an integer and a float);
//! - ignored fields: every path the typed decode skipped (reported by
//!   `serde_ignored`), taken out of the value before it is written; an ignored
//!   array element is written as `null`, so the positions after it stay put.
//!
//! Only differences the handler cannot see are forgiven. A present `null` and an
//! absent member stay different (a `serde_json::Value` field or a custom
//! deserializer can tell them apart), and so do `100` and `100.0`: when in doubt the
//! answer is "another payload", a visible dead letter, never a silently dropped
//! message. Fields inside `#[serde(flatten)]`, untagged or internally tagged parts
//! of a message are buffered by serde before the type looks at them, and fields of
//! struct variants are reported where they cannot be found (see [`remove`]): all
//! of those count as read.
//!
//! The rare body that decodes but has no canonical form here (a number out of
//! `f64` range or a lone surrogate in a field the type ignores; a message type
//! whose map keys `serde_ignored` cannot follow) is fingerprinted by its raw bytes,
//! as before: its re-serialized copies are conflicts, its identical copies
//! duplicates.

use std::io::Write as _;

use serde::de::DeserializeOwned;
use serde_ignored::Path;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The SHA-256 stored in `idemq_dedup.fingerprint`.
pub(crate) type Fingerprint = [u8; 32];

/// Decodes `body` as `M` and fingerprints what `M` reads of it.
///
/// What is accepted, and every error, is exactly `serde_json::from_slice::<M>`'s:
/// the fingerprint never turns a good message into a bad one.
pub(crate) fn decode<M: DeserializeOwned>(body: &[u8]) -> Result<(M, Fingerprint), serde_json::Error> {
    if let Ok(mut value) = serde_json::from_slice::<Value>(body) {
        if let Ok(message) = decode_removing_ignored(body, &mut value) {
            let mut canonical = Vec::with_capacity(body.len());
            write_canonical(&value, &mut canonical);
            return Ok((message, Sha256::digest(&canonical).into()));
        }
    }
    // Not JSON, not an `M` — or an `M` that has no canonical form here (a number
    // beyond `f64` in an ignored field, a map key serde_ignored cannot follow):
    // decode as plain serde_json does, and fingerprint the bytes.
    serde_json::from_slice(body).map(|message| (message, raw(body)))
}

/// `serde_json::from_slice`, taking every value the message type ignores out of
/// `value` (the same body, parsed) as the decoder skips it.
fn decode_removing_ignored<M: DeserializeOwned>(
    body: &[u8],
    value: &mut Value,
) -> Result<M, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let message = serde_ignored::deserialize(&mut de, |path| remove(value, &path))?;
    de.end()?;
    Ok(message)
}

/// The fingerprint of a value as it is (a versioned message's upcast form,
/// serialized: see `handler::wire`).
pub(crate) fn of_value(value: &Value) -> Fingerprint {
    let mut canonical = Vec::new();
    write_canonical(value, &mut canonical);
    Sha256::digest(&canonical).into()
}

/// The fingerprint of the bytes themselves (the fallback, and what idemq stored
/// before fingerprints were canonical).
pub(crate) fn raw(body: &[u8]) -> Fingerprint {
    Sha256::digest(body).into()
}

/// Takes the value at `path` out of `value`: an object member is removed, anything
/// else becomes `null` (an array keeps its length, so later paths still point
/// right). A path that cannot be followed (a map key `serde_ignored` reports in
/// another spelling than the body's, such as `5` for `"05"`) is left alone: the
/// value then counts as read, the safe side.
///
/// The only member of an object is never removed. `serde_ignored` gives a field
/// inside a struct variant (`{"Refunded": {"id": .., "x": ..}}`) the path of the
/// enum itself (`.x`, not `.Refunded.x`); were the ignored field named like its
/// variant, removing it there would take out the whole variant and make every
/// payload of that variant look the same. An externally tagged enum is always an
/// object of one member, so this rule keeps it; what it costs is that an object
/// whose every member is ignored keeps its last one (counts as read).
fn remove(value: &mut Value, path: &Path<'_>) {
    match path {
        Path::Root => *value = Value::Null, // the whole message is ignored
        Path::Some { parent } | Path::NewtypeStruct { parent } => remove(value, parent),
        Path::Map { parent, key } => {
            if let Some(Value::Object(members)) = locate(value, parent) {
                if members.len() > 1 {
                    members.remove(key);
                }
            }
        }
        Path::Seq { .. } | Path::NewtypeVariant { .. } => {
            if let Some(target) = locate(value, path) {
                *target = Value::Null;
            }
        }
    }
}

/// The value at `path`. `Some` and newtype structs are transparent in JSON; a
/// newtype variant's content is the single member of `{"Variant": content}`.
fn locate<'v>(value: &'v mut Value, path: &Path<'_>) -> Option<&'v mut Value> {
    match path {
        Path::Root => Some(value),
        Path::Some { parent } | Path::NewtypeStruct { parent } => locate(value, parent),
        Path::Map { parent, key } => match locate(value, parent)? {
            Value::Object(members) => members.get_mut(key),
            _ => None,
        },
        Path::Seq { parent, index } => match locate(value, parent)? {
            Value::Array(elements) => elements.get_mut(*index),
            _ => None,
        },
        Path::NewtypeVariant { parent } => match locate(value, parent)? {
            Value::Object(members) if members.len() == 1 => members.values_mut().next(),
            _ => None,
        },
    }
}

/// Writes `value` in the canonical form described in the module docs.
///
/// Object members are sorted here, not by serde_json: with its `preserve_order`
/// feature (which any crate in a build can turn on) a map keeps the body's order.
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        // Writing to a Vec cannot fail.
        Value::Number(number) => {
            let _ = write!(out, "{number}");
        }
        Value::String(string) => write_string(string, out),
        Value::Array(elements) => {
            out.push(b'[');
            for (i, element) in elements.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(element, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            let mut write_members = |members: &mut dyn Iterator<Item = (&String, &Value)>| {
                for (i, (key, member)) in members.enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(key, out);
                    out.push(b':');
                    write_canonical(member, out);
                }
            };
            // `str`'s order is the order of its UTF-8 bytes. Without
            // `preserve_order` the map is a BTreeMap and already sorted.
            if members.keys().is_sorted() {
                write_members(&mut members.iter());
            } else {
                let mut sorted: Vec<_> = members.iter().collect();
                sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
                write_members(&mut sorted.into_iter());
            }
            out.push(b'}');
        }
    }
}

fn write_string(string: &str, out: &mut Vec<u8>) {
    // Serializing a `str` into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, string);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use serde::Deserialize;

    use super::{decode, raw, Fingerprint};

    #[derive(Debug, Deserialize, PartialEq)]
    struct Payment {
        payment_id: String,
        account: String,
        amount_cents: i64,
        #[serde(default)]
        memo: Option<String>,
    }

    fn fingerprint(body: &str) -> Fingerprint {
        decode::<Payment>(body.as_bytes()).expect("decodes").1
    }

    const BASE: &str = r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1250}"#;

    #[test]
    fn key_order_does_not_change_the_fingerprint() {
        let reordered = r#"{"amount_cents":1250,"account":"acct-9","payment_id":"p-1"}"#;
        assert_eq!(fingerprint(BASE), fingerprint(reordered));
    }

    #[test]
    fn whitespace_does_not_change_the_fingerprint() {
        let spaced =
            "{\n  \"payment_id\" : \"p-1\",\n\t\"account\": \"acct-9\" ,\r\n  \"amount_cents\":   1250\n}\n";
        assert_eq!(fingerprint(BASE), fingerprint(spaced));
    }

    #[test]
    fn string_escapes_do_not_change_the_fingerprint() {
        let escaped = r#"{"payment_id":"p\u002d1","account":"\u0061cct-9","amount_cents":1250}"#;
        assert_eq!(fingerprint(BASE), fingerprint(escaped));
        let escaped_key = r#"{"p\u0061yment_id":"p-1","account":"acct\/9","amount_cents":1250}"#;
        let slash = r#"{"payment_id":"p-1","account":"acct/9","amount_cents":1250}"#;
        assert_eq!(fingerprint(slash), fingerprint(escaped_key));
        let unicode = r#"{"payment_id":"p-1","account":"Zürich ✓","amount_cents":1250}"#;
        let unicode_escaped = r#"{"payment_id":"p-1","account":"Z\u00fcrich \u2713","amount_cents":1250}"#;
        assert_eq!(fingerprint(unicode), fingerprint(unicode_escaped));
    }

    #[test]
    fn a_field_the_message_type_ignores_does_not_change_the_fingerprint() {
        let extra = r#"{"payment_id":"p-1","trace":{"id":[1,2,{"x":null}]},"account":"acct-9","amount_cents":1250,"sent_at":"2024-05-01T10:00:00Z"}"#;
        assert_eq!(fingerprint(BASE), fingerprint(extra));
    }

    #[test]
    fn another_amount_changes_the_fingerprint() {
        let other = r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1251}"#;
        assert_ne!(fingerprint(BASE), fingerprint(other));
    }

    #[test]
    fn an_added_field_the_message_type_reads_changes_the_fingerprint() {
        let with_memo = r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1250,"memo":"rent"}"#;
        assert_ne!(fingerprint(BASE), fingerprint(with_memo));
        // Conservative: present-but-null is not treated as absent.
        let null_memo = r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1250,"memo":null}"#;
        assert_ne!(fingerprint(BASE), fingerprint(null_memo));
    }

    #[test]
    fn numbers_compare_as_parsed_numbers() {
        #[derive(Deserialize)]
        struct Rate {
            #[allow(dead_code)]
            rate: f64,
        }
        let f = |body: &str| decode::<Rate>(body.as_bytes()).expect("decodes").1;
        assert_eq!(f(r#"{"rate":1.50}"#), f(r#"{"rate":1.5}"#));
        assert_eq!(f(r#"{"rate":1.5e2}"#), f(r#"{"rate":150.0}"#));
        // An integer and a float are different JSON numbers.
        assert_ne!(f(r#"{"rate":150}"#), f(r#"{"rate":150.0}"#));
    }

    #[test]
    fn ignored_fields_are_found_in_nested_structs_arrays_and_maps() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Order {
            id: String,
            lines: Vec<Line>,
            tags: HashMap<String, Line>,
            note: Option<Line>,
        }
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Line {
            sku: String,
        }
        let f = |body: &str| decode::<Order>(body.as_bytes()).expect("decodes").1;
        let plain =
            r#"{"id":"o","lines":[{"sku":"a"},{"sku":"b"}],"tags":{"k.1":{"sku":"c"}},"note":{"sku":"d"}}"#;
        let noisy = r#"{"note":{"sku":"d","x":1},"tags":{"k.1":{"v":2,"sku":"c"}},"lines":[{"sku":"a","n":1},{"sku":"b"}],"id":"o","extra":[]}"#;
        assert_eq!(f(plain), f(noisy));
        let reordered_lines =
            r#"{"id":"o","lines":[{"sku":"b"},{"sku":"a"}],"tags":{"k.1":{"sku":"c"}},"note":{"sku":"d"}}"#;
        assert_ne!(f(plain), f(reordered_lines), "array order is data");
    }

    #[test]
    fn ignored_fields_inside_an_externally_tagged_enum_are_found() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        enum Event {
            Paid(Paid),
            Refunded { id: String },
        }
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Paid {
            id: String,
        }
        let f = |body: &str| decode::<Event>(body.as_bytes()).expect("decodes").1;
        assert_eq!(f(r#"{"Paid":{"id":"1"}}"#), f(r#"{"Paid":{"x":true,"id":"1"}}"#));
        assert_ne!(f(r#"{"Paid":{"id":"1"}}"#), f(r#"{"Refunded":{"id":"1"}}"#));
        // serde_ignored reports a struct variant's fields at the enum's own path:
        // they cannot be found, so they count as read (the safe side)...
        assert_ne!(f(r#"{"Refunded":{"id":"1"}}"#), f(r#"{"Refunded":{"id":"1","x":0}}"#));
        // ... and an ignored field named like its variant never takes the variant out.
        assert_ne!(
            f(r#"{"Refunded":{"id":"1","Refunded":0}}"#),
            f(r#"{"Refunded":{"id":"2","Refunded":0}}"#)
        );
    }

    #[test]
    fn an_ignored_value_with_no_canonical_form_falls_back_to_the_raw_bytes() {
        // serde_json skips an ignored number without converting it; as a Value,
        // 1e400 is out of range.
        let body = r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1250,"huge":1e400}"#;
        let (message, fingerprint) = decode::<Payment>(body.as_bytes()).expect("decodes as before");
        assert_eq!(message.amount_cents, 1250);
        assert_eq!(fingerprint, raw(body.as_bytes()));
    }

    #[test]
    fn a_message_type_serde_ignored_cannot_follow_decodes_as_before_and_is_fingerprinted_raw() {
        #[derive(PartialEq, Eq, Hash)]
        struct Weight(u64);
        impl<'de> Deserialize<'de> for Weight {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                f64::deserialize(d).map(|w| Weight(w.to_bits()))
            }
        }
        #[derive(Deserialize)]
        struct Scale {
            weights: HashMap<Weight, u8>,
        }
        // serde_ignored only follows map keys it sees as strings, integers or bools.
        let body = br#"{"weights":{"1.5":7}}"#;
        let (scale, fingerprint) = decode::<Scale>(body).expect("decodes as plain serde_json does");
        assert_eq!(scale.weights[&Weight(1.5_f64.to_bits())], 7);
        assert_eq!(fingerprint, raw(body));
    }

    #[test]
    fn decode_errors_are_serde_jsons_own() {
        for body in [
            r#"{"payment_id":"p-1","account":"acct-9"}"#,
            r#"{"payment_id":"p-1","account":"acct-9","amount_cents":"ten"}"#,
            r#"{"payment_id":"p-1","account":"acct-9","amount_cents":1,"amount_cents":2}"#,
            r#"{"payment_id":"p-1"} trailing"#,
            r#"{"payment_id":"p-1","#,
        ] {
            let ours = decode::<Payment>(body.as_bytes()).expect_err(body).to_string();
            let plain = serde_json::from_slice::<Payment>(body.as_bytes()).expect_err(body).to_string();
            assert_eq!(ours, plain, "{body}");
            assert!(ours.contains("line 1 column"), "{ours}");
        }
    }
}
