//! Dedup keys: what a key field may be, and how it becomes the stored key.

use std::fmt;

use sha2::{Digest, Sha256};

/// Keys longer than this (in UTF-8 bytes) are stored as `sha256:<hex>` of the key.
///
/// PostgreSQL's btree rejects index entries over ~2.7 KB; a hash keeps every key
/// indexable and the dedup decision intact (a 256-bit collision is not a concern).
pub const MAX_STORED_KEY_BYTES: usize = 256;

/// A validated dedup key: non-empty, no NUL byte, at most [`MAX_STORED_KEY_BYTES`]
/// stored bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(String);

impl Key {
    /// Validates `raw` and turns it into the stored form.
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
        if raw.len() > MAX_STORED_KEY_BYTES {
            return Ok(Self(format!("sha256:{}", hex(&Sha256::digest(raw.as_bytes())))));
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
}
