//! The outbox relay: publishes committed outbox rows, at least once, each with one
//! stable `message_id`.
//!
//! ```text
//! wake (rows handed over in-process | in-process signal | NOTIFY idemq_outbox | poll interval)
//!   └─ BEGIN ─ rows handed over?  → DELETE … WHERE id = ANY(…) AND due RETURNING id
//!        │                          (those still there; published from memory; all
//!        │                          confirmed → COMMIT, else ROLLBACK and recorded below)
//!        │     else              → SELECT … FOR UPDATE SKIP LOCKED (due rows, oldest first, ≤ batch;
//!        │                          the rows it claims leave those handed over)
//!        ├─ an expired reply?  → DELETE, never published (counted, one warning per pass)
//!        ├─ exchange missing?  → postponed with backoff (never published: a publish to a
//!        │                        missing exchange would close the channel)
//!        ├─ a reply to a direct reply-to requester that is gone (a passive declare of
//!        │    its address: 404)? → postponed with backoff (never published: the broker
//!        │                        would confirm and drop it), until it expires
//!        ├─ publish all, pipelined (mandatory unless best effort), await the confirms
//!        │    ├─ confirmed and routed → DELETE
//!        │    ├─ returned (unroutable) / nacked → postponed with backoff, error kept
//!        │    │    (after a nack the next pass publishes on a fresh channel; a reply
//!        │    │    no later than it expires)
//!        │    └─ channel lost → left as they are (the transaction's end unlocks them)
//!        └─ COMMIT
//! ```
//!
//! A reply expires ([`RelayBuilder::reply_ttl`]); an event never does. A reply to a
//! `reply_to` queue that is gone — auto-delete and exclusive reply queues go away with
//! their client — is returned (312 NO_ROUTE) on every publish and would otherwise be
//! retried for ever, every `max_backoff`, with a warning each time. A reply to a
//! direct reply-to requester that is gone ends the same way, though the broker says
//! nothing of it (it confirms and drops such a reply; `mandatory` does not help: 3.x
//! returns every direct reply, 4.2 and later none): the relay asks before publishing.
//!
//! A pass runs in two halves ([`pass::start`]: claim and publish, on the link;
//! [`pass::Publishing::finish`]: await the confirms, record, COMMIT), so up to
//! [`worker::DEPTH`] passes are in flight: while one awaits the broker, the next claims
//! and publishes (measured: the relay's lag behind the consumers' acks fell from 1.2 s
//! to 0.55 s on the bench's 20,000-payment backlog, `BENCHMARKS.md`).
//!
//! A crash after the broker confirmed and before COMMIT publishes the row again: the
//! downstream dedup (keyed on the message id, or on the body's key) absorbs it.
//! Several relays may run at once (one per runtime process, or on their own): `SKIP
//! LOCKED` hands each row to one of them at a time. No order is promised, not even per
//! aggregate: rows are claimed in id order, and ids are assigned at insert, not at
//! commit; a postponed row goes out after later ones.
//!
//! Wake-ups never cost the handlers' transactions a `NOTIFY`: the runtime's own relay
//! is handed the rows each COMMIT wrote, as written ([`Wake`]: a pass deletes them by
//! id and reads nothing back — a claim of due rows walks every entry the relay's
//! deletes left in the index, 14 ms for 256 rows through 200,000, and every row
//! the other passes hold locked), and scans the table on a `NOTIFY`, every poll
//! interval, and after a fault. While it is behind, the batches that hand it rows
//! wait for it ([`Wake::keep_pace`]). A runtime whose relay is off sends `NOTIFY
//! idemq_outbox` at most once per [`NOTIFY_INTERVAL`], outside any transaction. A
//! relay listens on a dedicated connection; a silently dead socket would leave it
//! waiting forever, so it polls as well.

mod builder;
mod error;
mod link;
mod listen;
mod pass;
mod settings;
mod worker;

use std::time::Duration;

pub(crate) use builder::relay_pool;
pub use builder::{Relay, RelayBuilder};
pub(crate) use listen::{OutboxSignal, Wake};
pub(crate) use settings::Settings;
pub(crate) use worker::Worker;

/// The shortest time between two `NOTIFY`s of one runtime.
pub(crate) const NOTIFY_INTERVAL: Duration = Duration::from_millis(50);

/// How long a relay waits for the broker to confirm a publish.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stopping relay keeps publishing what is due.
const FINAL_PASS: Duration = Duration::from_secs(5);
