//! PostgreSQL: idemq's tables and statements (dedup rows, start marks, copy
//! records, the outbox), the pool, the schema check, migrations, retention.
//!
//! Public here: what operators and tools need beside the runtime — the
//! [`schema`] of idemq's tables, the migrations ([`MIGRATIONS`], applied by
//! [`migrate`](crate::migrate)), retention ([`Retention`], [`sweep`]), and
//! [`forget`], which deletes a dedup row.

pub(crate) mod db;
pub(crate) mod migrate;
pub(crate) mod replication;
pub(crate) mod retention;
pub mod schema;

use diesel_async::AsyncPgConnection;

use crate::base::BoxFuture;

pub use migrate::{migrate_with, MIGRATIONS, MIGRATION_LOCK};
pub use retention::{sweep, CheckedRetention, Retention, GC_LOCK};

/// Deletes the dedup row of `key` under `handler` (its scope: the name, or
/// `<namespace>/<name>`), so the next message with that key is applied as new.
/// Returns whether there was one.
///
/// For operators: a request whose permanent failure was stored (its duplicates get
/// the same error reply) can be applied after the cause is fixed by forgetting its
/// key and replaying its dead letter. Forgetting the key of an *applied* message
/// makes its next copy apply again: only do it for a message whose effect you know
/// did not happen.
///
/// ```no_run
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// // The handler `apply_payment` may now apply payment p-17 again (its dead letter replayed).
/// idemq::store::forget(conn, "apply_payment", "p-17").await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// The database's.
pub fn forget<'a>(
    conn: &'a mut AsyncPgConnection,
    handler: &'a str,
    key: &'a str,
) -> BoxFuture<'a, diesel::QueryResult<bool>> {
    Box::pin(db::forget(conn, handler, key))
}
