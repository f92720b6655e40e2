//! idemq's own statements: the dedup row, the checked COMMIT, start marks, copy
//! records, the outbox, retention and the pool's session settings. One place for
//! every table idemq owns and for how its errors are read.
//!
//! Split by concern, every item re-exported here so callers keep one path
//! (`crate::store::db::X`):
//! - `dedup`: BEGIN with the dedup claim, stored rows and results, `forget`;
//! - `commit`: the checked COMMIT and what its failure means;
//! - `fixed`: [`Fixed`](fixed::Fixed), a statement of idemq's own whose text never
//!   changes, prepared once per connection;
//! - `sqlstate`: how a failed statement's error is read — a lost connection by
//!   diesel's kinds, the rest (contention, an aborted transaction, a missing
//!   prepared statement) by the SQLSTATE the server sent, never by its message;
//! - `outbox`: the outbox table's statements and the relays' `NOTIFY` channel;
//! - `marks`: start marks and copy records;
//! - `streams`: stream offsets, the stream owner's advisory lock and the members
//!   sharing partitioned streams (and, for `status`, who holds a lock);
//! - `sagas`: a saga's lock and transition, and what `status` and `saga show` read;
//! - `housekeeping`: retention deletes and their lock, applied migrations, row counts;
//! - `pool`: the pool and each connection's session settings;
//! - `conn`: the pool's connection, [`Conn`]: diesel-async's, with the SQLSTATEs its
//!   server sent and its cancel request;
//! - `connect`: `open`/`connect` (with TLS, keepalives and the wire log), the
//!   `LISTEN` connection, and the task that drives each connection.

mod commit;
mod conn;
mod connect;
mod dedup;
mod fixed;
mod housekeeping;
mod marks;
mod outbox;
mod pool;
mod sagas;
mod sqlstate;
mod streams;

pub(crate) use commit::{commit_checked, CommitFailure};
pub(crate) use conn::Conn;
pub(crate) use connect::{connect, Listener};
// Named only by the delivery docs' link, which keeps this path.
pub(crate) use crate::tls::postgres::Canceller;
#[allow(unused_imports)]
pub(crate) use dedup::BATCH_LOCK_TIMEOUT;
pub(crate) use dedup::{
    begin_and_claim, begin_without_claim, forget, store_failure, store_results, stored_rows, Claim, Stored,
};
// What the CLI runs too (`__private::sibling::db`).
pub use housekeeping::{applied_migrations, count_rows, limit_statements};
pub(crate) use housekeeping::{delete_older, try_gc_lock};
pub(crate) use marks::{clear_starts, copy_recorded, mark_start, record_copy};
// Also the console's (`__private::sibling::db`).
#[cfg(feature = "metrics")]
pub use outbox::outbox_lag;
pub(crate) use outbox::{
    cancel_outbox, claim_outbox, delete_outbox, insert_outbox, notify_relays, outbox_backlog,
    postpone_outbox, take_outbox, written, OutboxRow, CHANNEL,
};
pub(crate) use pool::{build_pool, NewConnection, Pool, PoolError, Pooled, SessionLimits};
pub(crate) use sagas::{delete_expired_sagas, lock_saga, write_saga, SagaRow, SagaWrite};
// The CLI's `status` and `saga show` (`__private::sibling::db`).
pub use sagas::{count_sagas, show_saga, SagaCount, SagaShown};
pub(crate) use sqlstate::{contended_since, is_connection_error, is_read_only, read_only_since};
pub(crate) use streams::{advance_offset, read_offset, try_lock, try_lock_member};
pub use streams::{
    count_members, lock_holder, owner_lock, share_group, stored_offsets, LockHolder, StoredOffset, NO_OFFSET,
};
