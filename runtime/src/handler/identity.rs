//! A message's identity: what a copy's id and a dead letter's lineage derive from.
//!
//! A copy (a retry copy in a wait queue, or a dead letter) is recorded in
//! `idemq_copies` once the broker confirmed it, under its copy id
//! `<lineage>:<attempt>`. A redelivered original whose copy id is recorded is acked
//! without running its handler: the copy carries on for it. That is only safe if
//! **a recorded copy can only ever settle the message it was made from** — so the
//! lineage is a hash of everything that makes a message itself to its handler:
//!
//! - the handler's dedup scope (two handlers never share a lineage);
//! - its dedup key, where it has one (a message that could not be decoded has none):
//!   `@message_id`, `@header:…` and `key_fn` keys read more than the body;
//! - its AMQP `message_id` (two messages with one body are two messages);
//! - its body, byte for byte (copies keep it);
//! - its replay generation, the `x-idemq-replay` header `dlq replay` increments: a
//!   replayed dead letter starts again at attempt 1, in a lineage of its own, so the
//!   copies its first life recorded cannot settle it.
//!
//! Each field is written with a tag and its length, so no two different field
//! lists hash alike. Two deliveries share a lineage only when all of that is equal:
//! copies of one message, or a publisher's retransmission of it (the same
//! `message_id` and body) — which is the same message. A keyless dead letter (bad
//! input) is merged with another only on broker-level identity: the same
//! `message_id` and body.
//!
//! Lineages begin with `v2.`; those of idemq 0.1's first releases (a hash of scope
//! and body only) have no prefix. Such old ids are never looked up: a redelivered
//! original whose copy the old code recorded runs again, and its dedup row makes
//! that harmless (see the CHANGELOG).

use sha2::{Digest, Sha256};

use crate::base::hex;

/// The version prefix of a lineage; see the module docs.
pub(crate) const LINEAGE_PREFIX: &str = "v2.";

/// What a lineage is computed from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Identity<'a> {
    /// The handler's dedup scope.
    pub(crate) scope: &'a str,
    /// The stored dedup key, if the message was decoded.
    pub(crate) key: Option<&'a str>,
    /// The AMQP `message_id`, if any.
    pub(crate) message_id: Option<&'a str>,
    pub(crate) body: &'a [u8],
    /// The replay generation (`x-idemq-replay`, 0 when absent).
    pub(crate) replay: u32,
}

impl Identity<'_> {
    /// `v2.<32 hex digits>`: the same for every copy of one message.
    pub(crate) fn lineage(&self) -> String {
        let mut hash = Sha256::new();
        hash.update(b"idemq lineage v2");
        let mut field = |tag: u8, bytes: Option<&[u8]>| {
            hash.update([tag]);
            match bytes {
                Some(bytes) => {
                    hash.update([1]);
                    hash.update((bytes.len() as u64).to_be_bytes());
                    hash.update(bytes);
                }
                None => hash.update([0]),
            }
        };
        field(b's', Some(self.scope.as_bytes()));
        field(b'k', self.key.map(str::as_bytes));
        field(b'm', self.message_id.map(str::as_bytes));
        field(b'b', Some(self.body));
        field(b'r', Some(&self.replay.to_be_bytes()));
        format!("{LINEAGE_PREFIX}{}", hex(&hash.finalize()[..16]))
    }

    /// `<lineage>:<attempt>`: the id of the copy made at `attempt`.
    pub(crate) fn copy_id(&self, attempt: u32) -> String {
        format!("{}:{attempt}", self.lineage())
    }
}

/// The lineage part of a copy id (before its `:attempt`), for the DLQ tools.
pub fn lineage_of(copy_id: &str) -> &str {
    copy_id.rsplit_once(':').map_or(copy_id, |(lineage, _)| lineage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Identity<'static> {
        Identity { scope: "h", key: Some("k"), message_id: Some("m1"), body: b"{\"n\":1}", replay: 0 }
    }

    #[test]
    fn copies_of_one_message_share_a_lineage_across_attempts() {
        assert_eq!(base().lineage(), base().lineage());
        assert_eq!(lineage_of(&base().copy_id(1)), lineage_of(&base().copy_id(4)));
        assert_ne!(base().copy_id(1), base().copy_id(2));
        assert!(base().lineage().starts_with(LINEAGE_PREFIX));
    }

    #[test]
    fn every_part_of_a_messages_identity_changes_its_lineage() {
        let lineage = base().lineage();
        let others = [
            Identity { scope: "other", ..base() },
            Identity { key: Some("k2"), ..base() },
            Identity { key: None, ..base() },
            Identity { message_id: Some("m2"), ..base() },
            Identity { message_id: None, ..base() },
            Identity { body: b"{\"n\":2}", ..base() },
            Identity { replay: 1, ..base() },
        ];
        for other in others {
            assert_ne!(other.lineage(), lineage, "{other:?}");
        }
    }

    #[test]
    fn fields_do_not_run_together() {
        let a = Identity { key: Some("ab"), message_id: Some("c"), ..base() };
        let b = Identity { key: Some("a"), message_id: Some("bc"), ..base() };
        assert_ne!(a.lineage(), b.lineage());
        let absent = Identity { key: None, ..base() };
        let empty = Identity { key: Some(""), ..base() };
        assert_ne!(absent.lineage(), empty.lineage());
    }

    #[test]
    fn the_lineage_of_a_copy_id_is_before_its_last_colon() {
        assert_eq!(lineage_of("v2.abc:3"), "v2.abc");
        assert_eq!(lineage_of("0123abcd:1"), "0123abcd");
        assert_eq!(lineage_of("no-attempt"), "no-attempt");
    }
}
