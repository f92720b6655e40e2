//! The subcommands `run`, `migrate` and `gc` (`declare`, `status` and `dlq` have
//! modules of their own), each given the builder its settings were applied to.

use idemq_core::__private::sibling;
use idemq_core::__private::sibling::BuilderPlan as _;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use diesel_migrations::EmbeddedMigrations;

use crate::common::{connect_db, CliResult};
use idemq_core::__private::sibling::human;
use idemq_core::store::Retention;
use idemq_core::RuntimeBuilder;

/// The application's own step (creating its database, its tables), given the
/// database URL: `migrate` and `run` take it first, **before** idemq's migrations,
/// so it may create the database they run in (see [`Cli::setup`](super::Cli::setup)).
pub type Setup = Box<
    dyn Fn(
            String,
        )
            -> Pin<Box<dyn Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send>>
        + Send
        + Sync,
>;

/// `run` was interrupted by a second signal.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by a second signal; unacked deliveries will be redelivered")]
pub(super) struct Interrupted;

/// `run`: waits for the database server, runs the set-up and the migrations, then
/// the runtime until the first signal (or out at once on the second).
pub(super) async fn run(builder: RuntimeBuilder, app: &App) -> CliResult {
    // Checked before anything connects.
    let url = builder.configured_database_url().to_owned();
    let mut startup = builder.startup();
    let mut runtime = builder.build()?;
    let signals = idemq_core::shutdown_signals();
    // The set-up and the migrations need the server: wait for it as `run`
    // would (any answer will do: the set-up may create the database).
    if !startup.database_server(&url, &signals.graceful).await? {
        return Ok(());
    }
    sibling::startup_spent(&mut runtime, startup.elapsed());
    migrate(&url, app).await?;
    tokio::select! {
        result = runtime.run(signals.graceful.clone()) => Ok(result?),
        () = signals.immediate.cancelled() => Err(Box::new(Interrupted)),
    }
}

/// `gc`: one sweep of the rows older than `keep` (dead letters younger than
/// `replay_window` keep theirs).
pub(super) async fn gc(
    builder: &RuntimeBuilder,
    keep: Duration,
    replay_window: Option<Duration>,
) -> CliResult {
    let mut retention = Retention::keep(keep);
    if let Some(window) = replay_window {
        retention = retention.replay_window(window);
    }
    let retention = retention.check(&builder.retry_policies())?;
    let mut conn = connect_db(builder.configured_database_url()).await?;
    let sweep = idemq_core::store::sweep(&mut conn, &retention).await?;
    if sweep.yielded {
        println!("another sweep is running (it holds idemq::store::GC_LOCK); deleted so far:");
    }
    println!(
        "deleted {} dedup rows, {} copy records, {} start marks older than {}, and {} finished sagas past their keep_finished",
        sweep.dedup_rows,
        sweep.copy_records,
        sweep.start_marks,
        human(keep),
        sweep.finished_sagas
    );
    Ok(())
}

/// What the application adds to `migrate` and `run`: its set-up, and its own
/// migrations.
#[derive(Default)]
pub(super) struct App {
    pub(super) setup: Option<Setup>,
    pub(super) migrations: Option<Migrations>,
}

/// The application's embedded migrations, by reference (diesel's
/// `EmbeddedMigrations` is neither `Copy` nor `Clone`).
#[derive(Clone, Copy)]
pub(super) struct Migrations(pub(super) &'static EmbeddedMigrations);

impl MigrationSource<Pg> for Migrations {
    fn migrations(&self) -> diesel::migration::Result<Vec<Box<dyn diesel::migration::Migration<Pg>>>> {
        MigrationSource::<Pg>::migrations(self.0)
    }
}

/// The application's setup first (it may create the database), then idemq's
/// migrations (a no-op if the setup ran them), then the application's.
pub(super) async fn migrate(url: &str, app: &App) -> CliResult {
    if let Some(setup) = &app.setup {
        setup(url.to_owned()).await?;
    }
    idemq_core::migrate(url).await?;
    if let Some(migrations) = app.migrations {
        idemq_core::store::migrate_with(url, migrations).await?;
    }
    Ok(())
}

/// `migrate --status`: idemq's migrations, then the application's given with
/// [`Cli::migrations`](super::Cli::migrations), each applied or pending.
pub(super) async fn migrate_status(url: &str, app: &App) -> CliResult {
    let mut conn = connect_db(url).await?;
    let applied = sibling::db::applied_migrations(&mut conn).await?;
    let mut pending = 0;
    let sources =
        [("idemq", Some(Migrations(&idemq_core::store::MIGRATIONS))), ("application", app.migrations)];
    for (whose, source) in sources {
        let Some(source) = source else {
            println!(
                "application: none given to idemq (Cli::migrations); a set-up step's own are not listed"
            );
            continue;
        };
        let embedded = source.migrations()?;
        for migration in &embedded {
            let done = applied.contains(&migration.name().version().to_string());
            pending += usize::from(!done);
            println!("{whose:<12} {}  {}", if done { "applied" } else { "pending" }, migration.name());
        }
    }
    println!("{pending} pending; `migrate` applies them");
    Ok(())
}
