//! Dedup keys: what a key field may be, and how it becomes the stored key.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::base::hex;

/// Keys longer than this (in UTF-8 bytes) are stored as `sha256:<hex>` of the key.
///
/// PostgreSQL's btree rejects index entries over ~2.7 KB; a hash keeps every key
/// indexable and the dedup decision intact (a 256-bit collision is not a concern).
pub const MAX_STORED_KEY_BYTES: usize = 256;

/// The prefix of a hashed stored key. A stored key that starts with it is always a
/// hash: raw keys that start with it are hashed too.
const HASH_PREFIX: &str = "sha256:";

/// A validated dedup key: non-empty, no NUL byte, at most [`MAX_STORED_KEY_BYTES`]
/// stored bytes.
///
/// What is stored in `idemq_dedup.key` ([`Key::as_str`]):
///
/// - a key of at most [`MAX_STORED_KEY_BYTES`] UTF-8 bytes that does not start with
///   `sha256:` is stored as it is (integers in decimal, a `uuid::Uuid` hyphenated
///   lower case);
/// - any other key — longer than that, or starting with `sha256:` — is stored as
///   `sha256:` followed by the 64 lower-case hex digits of the SHA-256 of its UTF-8
///   bytes.
///
/// So a stored `sha256:…` always means "hashed", and two different keys never share
/// a stored form (short of a SHA-256 collision): a raw key spelled like the hash of
/// a long key is itself hashed, and cannot equal it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(String);

impl Key {
    /// Validates `raw` and turns it into the stored form (see [`Key`]).
    ///
    /// # Errors
    /// [`KeyError::Empty`] for `""`, [`KeyError::Nul`] for a key holding a NUL byte
    /// (PostgreSQL `text` cannot store it).
    pub fn new(raw: impl Into<String>) -> Result<Self, KeyError> {
        let raw = raw.into();
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.contains('\0') {
            return Err(KeyError::Nul);
        }
        if raw.len() > MAX_STORED_KEY_BYTES || raw.starts_with(HASH_PREFIX) {
            return Ok(Self(format!("{HASH_PREFIX}{}", hex(&Sha256::digest(raw.as_bytes())))));
        }
        Ok(Self(raw))
    }

    /// A key given as bytes (a header holding a binary id): valid UTF-8 is the key
    /// [`Key::new`] makes of that text; any other bytes are stored as `sha256:` and the
    /// hex SHA-256 of the bytes themselves — never a lossy reading, so two byte strings
    /// are two keys. It cannot collide with a text key: a hashed text key is the hash
    /// of valid UTF-8, and these bytes are not.
    ///
    /// # Errors
    /// As [`Key::new`] for UTF-8 bytes (empty, NUL); [`KeyError::Empty`] for none.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self::new(text),
            Err(_) => Ok(Self(format!("{HASH_PREFIX}{}", hex(&Sha256::digest(bytes))))),
        }
    }

    /// The key as stored in the dedup table.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key of a template (`key = "{tenant}:{order.id}"`): the literal parts as
    /// written, each value as `<its stored key's length in bytes>#<its stored key>`, then
    /// stored like any key (hashed if long). The lengths keep values from running
    /// together: tenant `a:b` with id `c` is `3#a:b:1#c`, tenant `a` with id `b:c` is
    /// `1#a:3#b:c` — one template never maps two different value lists to one key.
    ///
    /// A `key_fn` that must keep the keys of `key = "{tenant}:{id}"`:
    ///
    /// ```
    /// use idemq::key::{KeyError, KeyField, TemplatePart};
    /// use idemq::Key;
    ///
    /// # fn main() -> Result<(), KeyError> {
    /// let (tenant, id) = ("acme", String::from("p-42"));
    /// let key = Key::from_template(&[
    ///     TemplatePart::Value(tenant.to_key()),
    ///     TemplatePart::Literal(":"),
    ///     TemplatePart::Value(id.to_key()),
    /// ])?;
    /// assert_eq!(key.as_str(), "4#acme:4#p-42");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The first value's error (a missing, empty or NUL value).
    pub fn from_template(parts: &[TemplatePart<'_>]) -> Result<Self, KeyError> {
        use fmt::Write;
        let mut raw = String::new();
        for part in parts {
            match part {
                TemplatePart::Literal(text) => raw.push_str(text),
                TemplatePart::Value(value) => {
                    let value = value.as_ref().map_err(Clone::clone)?;
                    let _ = write!(raw, "{}#{}", value.0.len(), value.0);
                }
            }
        }
        Self::new(raw)
    }
}

/// A part of a key template, for [`Key::from_template`].
///
/// `#[idempotent_handler(key = "{tenant}:{id}")]` writes these; they are public so
/// that a handler written by hand (or a `key_fn`) can make **the same key** as the
/// template it replaces. A dedup key that changes when a handler is rewritten makes
/// every redelivery across that deploy look new, so the encoding is API, not an
/// implementation detail of the macro.
#[derive(Debug)]
pub enum TemplatePart<'a> {
    /// Text written in the template.
    Literal(&'a str),
    /// A value read from the message or the delivery.
    Value(Result<Key, KeyError>),
}

/// What a key can be read from besides the message: the delivery's AMQP properties
/// and the body's fingerprint. Handed to `key_fn`s that take two arguments.
#[derive(Debug, Clone, Copy)]
pub struct Metadata<'a> {
    properties: &'a lapin::BasicProperties,
    fingerprint: &'a [u8],
}

impl<'a> Metadata<'a> {
    /// Metadata of a delivery with `properties` and payload `fingerprint` (for unit
    /// tests of keys and `key_fn`s; the runtime makes its own).
    pub fn new(properties: &'a lapin::BasicProperties, fingerprint: &'a [u8]) -> Self {
        Self { properties, fingerprint }
    }

    /// The delivery's AMQP `message_id`. One that is not valid UTF-8 on the wire
    /// reads as U+FDD0 followed by the hex of its bytes (idemq's patched AMQP
    /// parser, see `vendor/README.md`): never a lossy reading, so `@message_id`
    /// keys stay one-to-one.
    pub fn message_id(&self) -> Option<&'a str> {
        self.properties.message_id().as_ref().map(|id| id.as_str())
    }

    /// A header of the delivery: a string as it is, an integer in decimal. A string
    /// that is not valid UTF-8 is `None` (never replaced by a lossy reading that
    /// another value could share): [`header_key`](Self::header_key) keys it byte-exact.
    pub fn header(&self, name: &str) -> Option<String> {
        crate::base::amqp_value::header(self.properties, name).and_then(crate::base::amqp_value::text)
    }

    /// The SHA-256 of the body's canonical payload (see the crate docs, "the same
    /// payload"): two copies of one payload have one fingerprint.
    pub fn fingerprint(&self) -> &'a [u8] {
        self.fingerprint
    }

    /// `key = "@message_id"`: a delivery without one has a missing key.
    ///
    /// # Errors
    /// [`KeyError::Missing`], or the id's own (empty, NUL).
    pub fn message_id_key(&self) -> Result<Key, KeyError> {
        self.message_id().ok_or(KeyError::Missing)?.to_key()
    }

    /// `key = "@header:<name>"`: a delivery without it (or with a value that is
    /// neither a string nor an integer) has a missing key.
    ///
    /// Byte-exact: a string value that is not valid UTF-8 is keyed by its bytes
    /// ([`Key::from_bytes`]), so `ff 31` and `fe 31` are two keys. An integer is its
    /// decimal text: the integer header `7` and the string header `"7"` are one key,
    /// as an integer key field `7` and a string key field `"7"` are (publishers in
    /// different languages send one id either way).
    ///
    /// # Errors
    /// [`KeyError::Missing`], or the value's own.
    pub fn header_key(&self, name: &str) -> Result<Key, KeyError> {
        let value = crate::base::amqp_value::header(self.properties, name).ok_or(KeyError::Missing)?;
        if let Some(text) = crate::base::amqp_value::text(value) {
            return text.to_key();
        }
        let bytes = crate::base::amqp_value::bytes(value).ok_or(KeyError::Missing)?;
        Key::from_bytes(bytes)
    }

    /// `key = "@hash"`: the payload's fingerprint in hex, for producers that send no
    /// id. Only a copy of the same payload is a duplicate; two different messages
    /// with one payload are one message.
    pub fn hash_key(&self) -> Key {
        Key(hex(self.fingerprint))
    }
}

/// A message type that carries its own dedup key (`#[derive(Message)]` with
/// `#[message(key)]` on a field): a handler of it needs no `key = "..."`.
#[diagnostic::on_unimplemented(
    message = "no dedup key for `{Self}`: the handler names none, and the type declares none",
    label = "`{Self}` declares no key",
    note = "give the handler one: #[idempotent_handler(key = \"payment_id\")] (or `key_fn = ...`), \
            or derive `idemq::Message` on `{Self}` and mark its key field `#[message(key)]`"
)]
pub trait KeyedMessage {
    /// The key field's name on the wire (its `#[serde(rename)]`, if any), for messages.
    const KEY_PATH: &'static str;

    /// The message's key.
    ///
    /// # Errors
    /// As [`KeyField::to_key`].
    fn message_key(&self) -> Result<Key, KeyError>;
}

/// A `key_fn`: `fn(&Message) -> K` or `fn(&Message, &Metadata) -> K`, `K` a
/// [`KeyField`] (a string, an integer, an `Option` of one, a [`Key`]). `Args` tells
/// the two forms apart; it is inferred.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be this handler's `key_fn`",
    label = "expected `fn(&{M}) -> K` or `fn(&{M}, &idemq::Metadata<'_>) -> K`",
    note = "`K` is a key type: a string, an integer, a uuid::Uuid, an Option of one, or idemq::Key; \
            return it owned (e.g. `String`), not borrowed from the message"
)]
pub trait KeyFn<M, Args> {
    /// The message's key.
    ///
    /// # Errors
    /// The key's (missing, empty, NUL).
    fn key(&self, message: &M, metadata: &Metadata<'_>) -> Result<Key, KeyError>;
}

/// [`KeyFn`]'s form `fn(&Message) -> K`.
#[derive(Debug)]
pub enum FromMessage {}
/// [`KeyFn`]'s form `fn(&Message, &Metadata) -> K`.
#[derive(Debug)]
pub enum FromMessageAndMetadata {}

impl<M, F, K> KeyFn<M, FromMessage> for F
where
    F: Fn(&M) -> K,
    K: KeyField,
{
    fn key(&self, message: &M, _: &Metadata<'_>) -> Result<Key, KeyError> {
        self(message).to_key()
    }
}

impl<M, F, K> KeyFn<M, FromMessageAndMetadata> for F
where
    F: Fn(&M, &Metadata<'_>) -> K,
    K: KeyField,
{
    fn key(&self, message: &M, metadata: &Metadata<'_>) -> Result<Key, KeyError> {
        self(message, metadata).to_key()
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a message's key could not be used. The message is dead-lettered (kind `key`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key field is absent or `null` (an `Option` key that is `None`).
    #[error("the key is missing (absent or null); every message needs a key")]
    Missing,
    /// The key is the empty string.
    #[error("the key is an empty string; a key must identify the message")]
    Empty,
    /// The key holds a NUL byte, which PostgreSQL text cannot store.
    #[error("the key contains a NUL byte, which PostgreSQL text cannot store")]
    Nul,
}

/// A field type usable as a dedup key: strings, integers, `uuid::Uuid` (feature `uuid`),
/// and `Option` of those (`None` is [`KeyError::Missing`]).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idemq dedup key",
    label = "this key field has type `{Self}`",
    note = "key fields must be a string, an integer or a uuid::Uuid (or an Option of one); point `key` at such a field"
)]
pub trait KeyField {
    /// Converts the field into a [`Key`].
    ///
    /// # Errors
    /// See [`KeyError`].
    fn to_key(&self) -> Result<Key, KeyError>;
}

impl KeyField for Key {
    fn to_key(&self) -> Result<Key, KeyError> {
        Ok(self.clone())
    }
}

impl KeyField for str {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self)
    }
}

impl KeyField for String {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(self.as_str())
    }
}

impl KeyField for Box<str> {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(&**self)
    }
}

impl KeyField for std::borrow::Cow<'_, str> {
    fn to_key(&self) -> Result<Key, KeyError> {
        Key::new(&**self)
    }
}

impl<T: KeyField + ?Sized> KeyField for &T {
    fn to_key(&self) -> Result<Key, KeyError> {
        (**self).to_key()
    }
}

impl<T: KeyField> KeyField for Option<T> {
    fn to_key(&self) -> Result<Key, KeyError> {
        self.as_ref().ok_or(KeyError::Missing)?.to_key()
    }
}

macro_rules! int_key {
    ($($t:ty)*) => {$(
        impl KeyField for $t {
            fn to_key(&self) -> Result<Key, KeyError> {
                Ok(Key(self.to_string()))
            }
        }
    )*};
}
int_key!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

#[cfg(feature = "uuid")]
impl KeyField for uuid::Uuid {
    fn to_key(&self) -> Result<Key, KeyError> {
        Ok(Key(self.hyphenated().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_nul_and_none_keys_are_refused() {
        assert_eq!("".to_key(), Err(KeyError::Empty));
        assert_eq!("a\0b".to_key(), Err(KeyError::Nul));
        assert_eq!(None::<String>.to_key(), Err(KeyError::Missing));
        assert_eq!(Some(7_u64).to_key().unwrap().as_str(), "7");
    }

    #[test]
    fn long_keys_are_stored_as_their_hash() {
        let long = "x".repeat(3000);
        let key = long.to_key().unwrap();
        assert!(key.as_str().starts_with("sha256:"));
        assert_eq!(key.as_str().len(), "sha256:".len() + 64);
        assert_ne!(key, "y".repeat(3000).to_key().unwrap());
        assert_eq!(key, long.clone().to_key().unwrap());
    }

    #[test]
    fn a_raw_key_that_looks_hashed_never_equals_a_hashed_key() {
        let long = "x".repeat(3000);
        let hashed = long.to_key().unwrap();
        // A client sending the stored form of the long key as its key.
        let lookalike = hashed.as_str().to_key().unwrap();
        assert_ne!(lookalike, hashed);
        assert!(lookalike.as_str().starts_with("sha256:"));
        assert_eq!(lookalike.as_str().len(), "sha256:".len() + 64);
        // Hashed, not refused: the same raw key always maps to the same stored key.
        assert_eq!(lookalike, hashed.as_str().to_key().unwrap());
        // Every key starting with the prefix is hashed, however short.
        assert_ne!("sha256:".to_key().unwrap().as_str(), "sha256:");
        assert_ne!("sha256:abc".to_key().unwrap().as_str(), "sha256:abc");
        // Keys that merely contain it, or another case, are stored as they are.
        assert_eq!("x-sha256:abc".to_key().unwrap().as_str(), "x-sha256:abc");
        assert_eq!("SHA256:abc".to_key().unwrap().as_str(), "SHA256:abc");
    }

    #[test]
    fn template_values_cannot_run_together() {
        let key = |tenant: &str, id: &str| {
            Key::from_template(&[
                TemplatePart::Value(tenant.to_key()),
                TemplatePart::Literal(":"),
                TemplatePart::Value(id.to_key()),
            ])
            .unwrap()
        };
        assert_eq!(key("a:b", "c").as_str(), "3#a:b:1#c");
        assert_ne!(key("a:b", "c"), key("a", "b:c"));
        assert_ne!(key("1#a", "b"), key("1", "a:1#b"));
        let missing = Key::from_template(&[TemplatePart::Value(None::<String>.to_key())]);
        assert_eq!(missing, Err(KeyError::Missing));
    }

    #[test]
    fn short_keys_are_stored_as_they_are() {
        let at_limit = "k".repeat(MAX_STORED_KEY_BYTES);
        assert_eq!(at_limit.to_key().unwrap().as_str(), at_limit);
        let over = "k".repeat(MAX_STORED_KEY_BYTES + 1);
        assert!(over.to_key().unwrap().as_str().starts_with("sha256:"));
        assert_eq!("pay-1".to_key().unwrap().as_str(), "pay-1");
    }

    fn with_header(value: lapin::types::AMQPValue) -> lapin::BasicProperties {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert("x-k".into(), value);
        lapin::BasicProperties::default().with_headers(headers)
    }

    fn header_key(value: lapin::types::AMQPValue) -> Result<Key, KeyError> {
        Metadata::new(&with_header(value), &[]).header_key("x-k")
    }

    fn bytes(raw: &[u8]) -> lapin::types::AMQPValue {
        lapin::types::AMQPValue::LongString(raw.to_vec().into())
    }

    #[test]
    fn header_keys_that_are_not_utf8_are_byte_exact() {
        let (a, b) = (header_key(bytes(b"\xff1")).unwrap(), header_key(bytes(b"\xfe1")).unwrap());
        assert_ne!(a, b, "two byte strings are two keys");
        assert!(a.as_str().starts_with("sha256:"), "{a:?}");
        assert_eq!(a, header_key(bytes(b"\xff1")).unwrap(), "the same bytes, the same key");
        // Not the key of the lossy reading, nor of any text.
        assert_ne!(a, "\u{fffd}1".to_key().unwrap());
        assert_eq!(Metadata::new(&with_header(bytes(b"\xff1")), &[]).header("x-k"), None);
        assert_eq!(header_key(bytes(b"")), Err(KeyError::Empty));
        assert_eq!(header_key(bytes("pay-1".as_bytes())).unwrap().as_str(), "pay-1");
    }

    #[test]
    fn an_integer_header_and_its_decimal_string_are_one_key() {
        use lapin::types::AMQPValue;
        let string = header_key(bytes(b"7")).unwrap();
        assert_eq!(header_key(AMQPValue::LongLongInt(7)).unwrap(), string);
        assert_eq!(header_key(AMQPValue::ShortInt(7)).unwrap(), string);
        assert_eq!(string, 7_u32.to_key().unwrap(), "as an integer key field 7 and a string field \"7\" are");
        assert_eq!(header_key(AMQPValue::Boolean(true)), Err(KeyError::Missing));
    }
}
