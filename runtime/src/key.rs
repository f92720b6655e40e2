//! Dedup keys: what a key field may be, and how it becomes the stored key.

use std::fmt;

use sha2::{Digest, Sha256};

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

    /// The key as stored in the dedup table.
    pub fn as_str(&self) -> &str {
        &self.0
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

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
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
    fn short_keys_are_stored_as_they_are() {
        let at_limit = "k".repeat(MAX_STORED_KEY_BYTES);
        assert_eq!(at_limit.to_key().unwrap().as_str(), at_limit);
        let over = "k".repeat(MAX_STORED_KEY_BYTES + 1);
        assert!(over.to_key().unwrap().as_str().starts_with("sha256:"));
        assert_eq!("pay-1".to_key().unwrap().as_str(), "pay-1");
    }
}
