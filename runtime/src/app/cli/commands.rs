//! The subcommands `run`, `migrate`, `declare`, `status` and `gc` (`dlq` has its
//! own module), each given the builder its settings were applied to.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use diesel_migrations::EmbeddedMigrations;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Connection;

use crate::app::cli::common::{connect_broker, connect_db, CliResult};
use crate::base::duration::human;
use crate::engine::runtime::RuntimeBuilder;
use crate::error::Error;
use crate::store::retention::Retention;

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
    let signals = crate::shutdown_signals();
    // The set-up and the migrations need the server: wait for it as `run`
    // would (any answer will do: the set-up may create the database).
    if !startup.database_server(&url, &signals.graceful).await? {
        return Ok(());
    }
    runtime.startup_spent(startup.elapsed());
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
    let sweep = crate::store::retention::sweep(&mut conn, &retention).await?;
    if sweep.yielded {
        println!("another sweep is running (it holds idemq::store::GC_LOCK); deleted so far:");
    }
    println!(
        "deleted {} dedup rows, {} copy records, {} start marks older than {}",
        sweep.dedup_rows,
        sweep.copy_records,
        sweep.start_marks,
        human(keep)
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
    crate::store::migrate::migrate(url).await?;
    if let Some(migrations) = app.migrations {
        crate::store::migrate::migrate_with(url, migrations).await?;
    }
    Ok(())
}

/// `migrate --status`: idemq's migrations, then the application's given with
/// [`Cli::migrations`](super::Cli::migrations), each applied or pending.
pub(super) async fn migrate_status(url: &str, app: &App) -> CliResult {
    let mut conn = connect_db(url).await?;
    let applied = crate::store::db::applied_migrations(&mut conn).await?;
    let mut pending = 0;
    let sources = [("idemq", Some(Migrations(&crate::store::MIGRATIONS))), ("application", app.migrations)];
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

/// Lists what the topology declares and whether it exists; with `apply`, declares it.
pub(super) async fn declare(builder: &RuntimeBuilder, apply: bool) -> CliResult {
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    let plan = builder.declarations();
    let mut missing = 0;
    for (name, what) in &plan {
        let exists = queue_exists(&connection, name).await?;
        missing += usize::from(!exists);
        let state = match (exists, apply) {
            (true, _) => "exists",
            (false, false) => "missing: would be declared",
            (false, true) => "missing: declaring",
        };
        println!("queue {name:<40} {what:<48} {state}");
    }
    for exchange in builder.exchange_names() {
        println!("exchange {exchange:<37} (declared with the topology)");
    }
    for (queue, exchange, routing_key) in builder.bindings() {
        let exchange = if exchange.is_empty() { "(default)" } else { exchange };
        println!("binding {queue:<38} to exchange {exchange} with routing key '{routing_key}' (declared with the topology)");
    }
    if apply {
        builder.declare_all(&connection).await?;
        println!("declared ({missing} were missing)");
    } else if missing > 0 {
        println!("{missing} missing; `declare --apply` declares them (`run` does too)");
    }
    let _ = connection.close(200, "declared".into()).await;
    Ok(())
}

/// Whether `queue` exists (a passive declare on a throwaway channel: a 404 closes it).
async fn queue_exists(connection: &Connection, queue: &str) -> Result<bool, Error> {
    Ok(passive(connection, queue).await?.is_some())
}

/// A passive declare of `queue`: its depth and consumers, `None` if it does not exist.
async fn passive(connection: &Connection, queue: &str) -> Result<Option<lapin::Queue>, Error> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| Error::Amqp { action: "open a channel".into(), source })?;
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    match channel.queue_declare(queue.into(), options, FieldTable::default()).await {
        Ok(declared) => {
            let _ = channel.close(200, "inspected".into()).await;
            Ok(Some(declared))
        }
        Err(_) if connection.status().connected() => Ok(None),
        Err(source) => Err(Error::Amqp { action: format!("inspect queue '{queue}'"), source }),
    }
}

/// A figure `status` prints: a number, or why it could not be read.
type Figure = Result<String, String>;

/// `status`: each queue's depth and consumers (the consumed and declared queues,
/// their dead-letter and retry wait queues), the dedup rows and the outbox backlog,
/// counted exactly. What cannot be read is printed as `unknown (why)`, never as a
/// number, and makes the command fail (exit 1) after printing the rest.
pub(super) async fn status(builder: &RuntimeBuilder) -> CliResult {
    let mut unknown = 0;
    let mut show = |figure: Figure| match figure {
        Ok(shown) => shown,
        Err(why) => {
            unknown += 1;
            format!("unknown ({why})")
        }
    };
    println!("{:<40} {:>10} {:>10}", "queue", "ready", "consumers");
    match connect_broker(builder.configured_amqp_url()).await {
        Ok(connection) => {
            for (name, what) in builder.status_queues() {
                let line = match passive(&connection, &name).await {
                    Ok(Some(q)) => format!("{name:<40} {:>10} {:>10}", q.message_count(), q.consumer_count()),
                    Ok(None) => format!("{name:<40} {:>10} {:>10}", "missing", "-"),
                    Err(err) => format!("{name:<40} {}", show(Err(err.report()))),
                };
                println!("{}", format!("{line}  {what}").trim_end());
            }
            let _ = connection.close(200, "inspected".into()).await;
        }
        Err(err) => println!("queues: {}", show(Err(err.report()))),
    }
    let (dedup, outbox) = counts(builder.configured_database_url()).await;
    println!("dedup rows: {}", show(dedup));
    println!("outbox backlog:        {}", show(outbox));
    match unknown {
        0 => Ok(()),
        n => Err(format!("{n} of the figures above could not be read (unknown)").into()),
    }
}

/// The dedup table's rows and the outbox's, counted (each cut after
/// [`COUNT_TIMEOUT`]).
async fn counts(url: &str) -> (Figure, Figure) {
    let mut conn = match connect_db(url).await {
        Ok(conn) => conn,
        Err(err) => {
            let why = err.report();
            return (Err(why.clone()), Err(why));
        }
    };
    if let Err(err) = crate::store::db::limit_statements(&mut conn, COUNT_TIMEOUT).await {
        let why = format!("cannot set a statement_timeout: {err}");
        return (Err(why.clone()), Err(why));
    }
    let mut count = async |table| match crate::store::db::count_rows(&mut conn, table).await {
        Ok(Some(rows)) => Ok(rows.to_string()),
        Ok(None) => Err(format!("{table} is not there: run `migrate`")),
        Err(err) => {
            Err(format!("counting {table} failed within a {} statement_timeout: {err}", human(COUNT_TIMEOUT)))
        }
    };
    let dedup = count("idemq_dedup").await;
    let outbox = count("idemq_outbox").await;
    (dedup, outbox)
}

/// How long `status` lets each count run before it prints "unknown" instead: a
/// count reads the whole table, which at a billion rows takes longer than an
/// operator should wait.
const COUNT_TIMEOUT: Duration = Duration::from_secs(10);
