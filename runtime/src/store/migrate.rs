//! idemq's own tables, embedded and applied from code.

use diesel::sql_types::{BigInt, Bool};
use diesel_async::{AsyncMigrationHarness, AsyncPgConnection, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use crate::error::Error;

/// The migrations in the repository's `migrations/` folder (the dedup table).
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

/// The key of the PostgreSQL advisory lock [`migrate`] holds while it migrates
/// (`pg_advisory_lock(MIGRATION_LOCK)`, session level; the bytes spell `idemq_mg`).
///
/// Take it around your own schema changes, on their connection, to serialize them
/// with idemq's and with other processes starting at the same moment: two
/// `CREATE TABLE`s of one name racing on a fresh database fail (duplicate key on
/// `pg_type_typname_nsp_index`) even with `IF NOT EXISTS`. Do not hold it while
/// calling [`migrate`] from the same task: that waits on another session.
pub const MIGRATION_LOCK: i64 = 0x6964_656d_715f_6d67;

/// Applies idemq's pending migrations to the database at `database_url`.
///
/// Safe to run at every start-up and from several processes at once: each run holds
/// the advisory lock [`MIGRATION_LOCK`] while it migrates, so concurrent runs take
/// turns and the later ones find nothing pending. A run waits for the lock as long as
/// another holds it; a crashed holder's session ends and frees it.
///
/// With every migration applied it changes nothing and needs no more than reading
/// `__diesel_schema_migrations`: a process whose role may only read and write the
/// tables (see the README's *Least privilege*) can call it at every start-up. Such a
/// role cannot apply a pending migration: that is [`Error::Schema`], saying so.
///
/// # Errors
/// [`Error::DatabaseConnect`], [`Error::Migration`], or [`Error::Schema`] when
/// something is missing that this database user may not create or read.
///
/// # Cancel safety
/// Not cancel safe: the migration runs to completion on a blocking thread.
pub async fn migrate(database_url: &str) -> Result<(), Error> {
    let mut conn = crate::connect::database(database_url).await?;
    if nothing_to_do(&mut conn).await? {
        return Ok(());
    }
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<BigInt, _>(MIGRATION_LOCK)
        .execute(&mut conn)
        .await
        .map_err(|err| Error::Migration(format!("taking the migration lock failed: {err}")))?;
    // The harness blocks in place; on a blocking thread that works on every runtime
    // flavour (on a current-thread runtime's own thread it would panic).
    let (mut conn, result) = tokio::task::spawn_blocking(move || {
        let mut harness = AsyncMigrationHarness::new(conn);
        let result = harness
            .run_pending_migrations(MIGRATIONS)
            .map(|_| ())
            .map_err(|err| Error::Migration(err.to_string()));
        (harness.into_inner(), result)
    })
    .await
    // A panicked task dropped the connection, and its session's lock with it.
    .map_err(|err| Error::Migration(format!("the migration task failed: {err}")))?;
    // Dropping the connection would free the lock too; unlocking says so at once.
    let unlocked = diesel::sql_query("SELECT pg_advisory_unlock($1)")
        .bind::<BigInt, _>(MIGRATION_LOCK)
        .execute(&mut conn)
        .await;
    result?;
    unlocked.map_err(|err| Error::Migration(format!("releasing the migration lock failed: {err}")))?;
    Ok(())
}

/// Whether every migration is applied and idemq's tables are usable, checked without
/// DDL: diesel's harness begins with `CREATE TABLE IF NOT EXISTS
/// __diesel_schema_migrations`, which PostgreSQL refuses to a role without CREATE on
/// the schema even when the table exists. What such a role cannot mend is an
/// [`Error::Schema`] with the fix (the GRANT to run, or migrating as the owner);
/// anything else is left to the harness.
async fn nothing_to_do(conn: &mut AsyncPgConnection) -> Result<bool, Error> {
    let checked = |err: diesel::result::Error| Error::Migration(format!("checking the schema failed: {err}"));
    let Some(problem) = crate::store::db::check_schema(conn).await.map_err(checked)? else {
        return Ok(true);
    };
    let may_create: bool = diesel::select(diesel::dsl::sql::<Bool>(
        "COALESCE(has_schema_privilege(current_schema(), 'CREATE'), false)",
    ))
    .get_result(conn)
    .await
    .map_err(checked)?;
    if may_create {
        return Ok(false);
    }
    Err(Error::Schema {
        problem: format!("{} (and this database user may not create tables)", problem.problem),
        fix: problem.fix,
    })
}
