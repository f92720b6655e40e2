//! idemq's own tables, embedded and applied from code.

use diesel::sql_types::{BigInt, Bool};
use diesel_async::{AsyncMigrationHarness, AsyncPgConnection, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::result::Error as DieselError;
use diesel::sql_types::Text;

use crate::base::BoxFuture;
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
/// tables (see `docs/security.md`, *Least privilege*) can call it at every start-up. Such a
/// role cannot apply a pending migration: that is [`Error::Schema`], saying so.
///
/// # Errors
/// [`Error::DatabaseConnect`], [`Error::Migration`], or [`Error::Schema`] when
/// something is missing that this database user may not create or read.
///
/// # Cancel safety
/// Not cancel safe: the migration runs to completion on a blocking thread.
pub fn migrate(database_url: &str) -> BoxFuture<'_, Result<(), Error>> {
    Box::pin(async move {
        let mut conn = crate::store::db::connect(database_url).await?;
        if nothing_to_do(&mut conn).await? {
            return Ok(());
        }
        apply(conn, MIGRATIONS).await
    })
}

/// Applies the pending migrations of `source` — an application's own, embedded with
/// `diesel_migrations::embed_migrations!` (or any diesel `MigrationSource`) — to the
/// database at `database_url`, as [`migrate`] applies idemq's: under
/// [`MIGRATION_LOCK`], and with nothing pending, without DDL (so a role that may not
/// create tables can run it at every start).
///
/// # Errors
/// [`Error::DatabaseConnect`], [`Error::Migration`].
///
/// # Cancel safety
/// Not cancel safe: the migration runs to completion on a blocking thread.
pub async fn migrate_with<S>(database_url: &str, source: S) -> Result<(), Error>
where
    S: MigrationSource<Pg> + Send + 'static,
{
    let (conn, applied) = connect_and_read_applied(database_url).await?;
    // Not held across an await: diesel's migrations are not `Send`.
    let pending = source
        .migrations()
        .map_err(|source| Error::Migration { action: "read the embedded migrations".into(), source })?
        .iter()
        .any(|m| !applied.contains(&m.name().version().to_string()));
    if !pending {
        return Ok(());
    }
    apply(conn, source).await
}

/// A connection and the versions applied on it: [`migrate_with`]'s part that does
/// not depend on the source, boxed so that it is compiled once, in idemq, not in
/// each caller's crate.
fn connect_and_read_applied(
    database_url: &str,
) -> BoxFuture<'_, Result<(AsyncPgConnection, Vec<String>), Error>> {
    Box::pin(async move {
        let mut conn = crate::store::db::connect(database_url).await?;
        let applied = crate::store::db::applied_migrations(&mut conn)
            .await
            .map_err(migration("read the applied migrations"))?;
        Ok((conn, applied))
    })
}

/// Applies `source`'s pending migrations on `conn`, holding [`MIGRATION_LOCK`].
async fn apply<S>(mut conn: AsyncPgConnection, source: S) -> Result<(), Error>
where
    S: MigrationSource<Pg> + Send + 'static,
{
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<BigInt, _>(MIGRATION_LOCK)
        .execute(&mut conn)
        .await
        .map_err(migration("take the migration lock"))?;
    // The harness blocks in place; on a blocking thread that works on every runtime
    // flavour (on a current-thread runtime's own thread it would panic).
    let (mut conn, result) = tokio::task::spawn_blocking(move || {
        let mut harness = AsyncMigrationHarness::new(conn);
        let result = harness
            .run_pending_migrations(source)
            .map(|_| ())
            .map_err(|source| Error::Migration { action: "apply the pending migrations".into(), source });
        (harness.into_inner(), result)
    })
    .await
    // A panicked task dropped the connection, and its session's lock with it.
    .map_err(migration("finish the migration task"))?;
    // Dropping the connection would free the lock too; unlocking says so at once.
    let unlocked = diesel::sql_query("SELECT pg_advisory_unlock($1)")
        .bind::<BigInt, _>(MIGRATION_LOCK)
        .execute(&mut conn)
        .await;
    result?;
    unlocked.map_err(migration("release the migration lock"))?;
    Ok(())
}

/// An [`Error::Migration`] of `action`, keeping its cause as the source.
fn migration<E>(action: &'static str) -> impl FnOnce(E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |source| Error::Migration { action: action.into(), source: Box::new(source) }
}

/// Whether every migration is applied and idemq's tables are usable, checked without
/// DDL: diesel's harness begins with `CREATE TABLE IF NOT EXISTS
/// __diesel_schema_migrations`, which PostgreSQL refuses to a role without CREATE on
/// the schema even when the table exists. What such a role cannot mend is an
/// [`Error::Schema`] with the fix (the GRANT to run, or migrating as the owner);
/// anything else is left to the harness.
async fn nothing_to_do(conn: &mut AsyncPgConnection) -> Result<bool, Error> {
    let Some(problem) = check_schema(conn).await.map_err(migration("check the schema"))? else {
        return Ok(true);
    };
    let may_create: bool = diesel::select(diesel::dsl::sql::<Bool>(
        "COALESCE(has_schema_privilege(current_schema(), 'CREATE'), false)",
    ))
    .get_result(conn)
    .await
    .map_err(migration("check the schema"))?;
    if may_create {
        return Ok(false);
    }
    Err(Error::Schema {
        problem: format!("{} (and this database user may not create tables)", problem.problem),
        fix: problem.fix,
    })
}

/// The tables [`check_schema`] requires, with the privileges idemq uses on them.
const TABLES: [&str; 5] =
    ["idemq_dedup", "idemq_started", "idemq_copies", "idemq_outbox", "idemq_stream_offsets"];

/// What is wrong with the database for idemq, if anything: missing migrations,
/// missing tables, or privileges this user lacks. Errors that no retry can fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SchemaProblem {
    pub(crate) problem: String,
    pub(crate) fix: String,
}

impl From<SchemaProblem> for crate::error::Error {
    fn from(SchemaProblem { problem, fix }: SchemaProblem) -> Self {
        Self::Schema { problem, fix }
    }
}

#[derive(QueryableByName)]
struct TableState {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    present: bool,
    #[diesel(sql_type = Bool)]
    usable: bool,
}

/// Checks that idemq's migrations were applied and its tables are usable.
pub(crate) async fn check_schema(conn: &mut AsyncPgConnection) -> QueryResult<Option<SchemaProblem>> {
    let run_migrate = "run idemq's migrations against this database first \
                       (`idemq::migrate(url)`, or your binary's `migrate` subcommand)";
    let tables: Vec<TableState> = diesel::sql_query(
        "SELECT t.name, to_regclass(t.name) IS NOT NULL AS present, \
         COALESCE(has_table_privilege(to_regclass(t.name), 'SELECT') \
              AND has_table_privilege(to_regclass(t.name), 'INSERT') \
              AND has_table_privilege(to_regclass(t.name), 'UPDATE') \
              AND has_table_privilege(to_regclass(t.name), 'DELETE'), false) AS usable \
         FROM unnest($1::text[]) AS t(name)",
    )
    .bind::<diesel::sql_types::Array<Text>, _>(TABLES.to_vec())
    .load(conn)
    .await?;
    let missing: Vec<&str> = tables.iter().filter(|t| !t.present).map(|t| t.name.as_str()).collect();
    if !missing.is_empty() {
        return Ok(Some(SchemaProblem {
            problem: format!("idemq's table(s) {} do not exist", missing.join(", ")),
            fix: run_migrate.to_owned(),
        }));
    }
    let unusable: Vec<&str> = tables.iter().filter(|t| !t.usable).map(|t| t.name.as_str()).collect();
    // The migrations' record is read below: without SELECT on it the server's
    // "permission denied" would be all the operator sees. (Its absence is the
    // missing-migrations problem, found below.)
    let record_readable: bool = diesel::select(diesel::dsl::sql::<Bool>(
        "COALESCE(has_table_privilege(to_regclass('__diesel_schema_migrations'), 'SELECT'), true)",
    ))
    .get_result(conn)
    .await?;
    if !unusable.is_empty() || !record_readable {
        // The fix names the role to grant to, as the server spells it.
        let user: String =
            diesel::select(diesel::dsl::sql::<Text>("quote_ident(current_user)")).get_result(conn).await?;
        let owner = "(see docs/security.md, *Least privilege*)";
        return Ok(Some(if unusable.is_empty() {
            SchemaProblem {
                problem: format!(
                    "the database user {user} may not read __diesel_schema_migrations, where idemq \
                     checks that its migrations are applied"
                ),
                fix: format!(
                    "as the tables' owner, run GRANT SELECT ON __diesel_schema_migrations TO {user}; {owner}"
                ),
            }
        } else {
            SchemaProblem {
                problem: format!(
                    "the database user {user} lacks SELECT, INSERT, UPDATE or DELETE on {}",
                    unusable.join(", ")
                ),
                fix: format!(
                    "as the tables' owner, run GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {user}; {owner}",
                    unusable.join(", ")
                ),
            }
        }));
    }
    let applied = crate::store::db::applied_migrations(conn).await?;
    let embedded = diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&MIGRATIONS)
        .map_err(DieselError::QueryBuilderError)?;
    let pending: Vec<String> = embedded
        .iter()
        .filter(|m| !applied.contains(&m.name().version().to_string()))
        .map(|m| m.name().to_string())
        .collect();
    if !pending.is_empty() {
        return Ok(Some(SchemaProblem {
            problem: format!("idemq's migration(s) {} are not applied", pending.join(", ")),
            fix: run_migrate.to_owned(),
        }));
    }
    Ok(None)
}
