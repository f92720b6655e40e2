//! idemq's own statements: the dedup row, the checked COMMIT, start marks, copy
//! records, the outbox, retention and the pool's session settings. One place for
//! every table idemq owns and for how its errors are read.
//!
//! Split by concern, every item re-exported here so callers keep one path
//! (`crate::store::db::X`):
//! - `dedup`: BEGIN with the dedup claim, stored rows and results, `forget`;
//! - `commit`: the checked COMMIT and the reading of errors (lost connection,
//!   contention);
//! - `outbox`: the outbox table's statements and the relays' `NOTIFY` channel;
//! - `marks`: start marks and copy records;
//! - `housekeeping`: retention deletes and their lock, applied migrations, table sizes;
//! - `pool`: the pool and each connection's session settings;
//! - `connect`: `establish`/`connect`, with TLS and keepalives.

mod commit;
mod connect;
mod dedup;
mod housekeeping;
mod marks;
mod outbox;
mod pool;

pub(crate) use commit::{commit_checked, is_connection_error, is_contention_message, CommitFailure};
pub(crate) use connect::{connect, establish};
// Named only by the delivery docs' link, which keeps this path.
#[allow(unused_imports)]
pub(crate) use dedup::BATCH_LOCK_TIMEOUT;
pub(crate) use dedup::{
    begin_and_claim, begin_without_claim, forget, limit_batch_lock_waits, store_failure, store_results,
    stored_rows, Stored,
};
#[cfg(feature = "cli")]
pub(crate) use housekeeping::table_sizes;
pub(crate) use housekeeping::{applied_migrations, delete_older, try_gc_lock};
pub(crate) use marks::{clear_starts, copy_recorded, mark_start, record_copy};
pub(crate) use outbox::{
    claim_outbox, delete_outbox, insert_outbox, notify_relays, outbox_backlog, postpone_outbox, OutboxRow,
    CHANNEL,
};
pub(crate) use pool::{build_pool, SessionLimits};
