//! idemq's own tables, embedded and applied from code.

use diesel_async::{AsyncConnection, AsyncMigrationHarness, AsyncPgConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use crate::error::{redact, Error};

/// The migrations in the repository's `migrations/` folder (the dedup table).
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

/// Applies idemq's pending migrations to the database at `database_url`.
///
/// Safe to run at every start-up and from several processes (each migration runs in
/// its own transaction; a concurrent runner fails on the version row and is retried).
///
/// # Errors
/// [`Error::DatabaseConnect`] or [`Error::Migration`].
///
/// # Cancel safety
/// Not cancel safe: the migration runs to completion on a blocking thread.
pub async fn migrate(database_url: &str) -> Result<(), Error> {
    let conn = AsyncPgConnection::establish(database_url)
        .await
        .map_err(|err| Error::DatabaseConnect { url: redact(database_url), message: err.to_string() })?;
    // The harness blocks in place; on a blocking thread that works on every runtime
    // flavour (on a current-thread runtime's own thread it would panic).
    tokio::task::spawn_blocking(move || {
        let mut harness = AsyncMigrationHarness::new(conn);
        harness
            .run_pending_migrations(MIGRATIONS)
            .map(|_| ())
            .map_err(|err| Error::Migration(err.to_string()))
    })
    .await
    .map_err(|err| Error::Migration(format!("the migration task failed: {err}")))?
}
