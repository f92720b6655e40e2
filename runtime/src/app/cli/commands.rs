//! The subcommands `run`, `migrate`, `declare`, `status` and `gc` (`dlq` has its
//! own module), each given the builder its settings were applied to.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Connection;

use crate::app::cli::common::{connect_broker, connect_db, CliResult};
use crate::base::duration::human;
use crate::engine::runtime::RuntimeBuilder;
use crate::error::Error;
use crate::store::retention::Retention;

/// An application step `migrate` and `run` take after idemq's own migrations (the
/// app's tables), given the database URL.
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
pub(super) async fn run(builder: RuntimeBuilder, setup: Option<&Setup>) -> CliResult {
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
    migrate(&url, setup).await?;
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

/// The application's setup first (it may create the database), then idemq's
/// migrations (a no-op if the setup ran them).
pub(super) async fn migrate(url: &str, setup: Option<&Setup>) -> CliResult {
    if let Some(setup) = setup {
        setup(url.to_owned()).await?;
    }
    crate::store::migrate::migrate(url).await?;
    Ok(())
}

/// `migrate --status`: idemq's migrations, applied or pending.
pub(super) async fn migrate_status(url: &str) -> CliResult {
    let mut conn = connect_db(url).await?;
    let applied = crate::store::db::applied_migrations(&mut conn).await?;
    let embedded =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&crate::store::MIGRATIONS)?;
    let mut pending = 0;
    for migration in &embedded {
        let done = applied.contains(&migration.name().version().to_string());
        pending += usize::from(!done);
        println!("{}  {}", if done { "applied" } else { "pending" }, migration.name());
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

/// `status`: queue depths and consumers, the dedup rows' estimate, the outbox backlog.
pub(super) async fn status(builder: &RuntimeBuilder) -> CliResult {
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    println!("{:<40} {:>10} {:>10}", "queue", "ready", "consumers");
    for (queue, dead_letters) in builder.consumed_queues() {
        for name in [queue, dead_letters] {
            match passive(&connection, &name).await? {
                Some(q) => println!("{name:<40} {:>10} {:>10}", q.message_count(), q.consumer_count()),
                None => println!("{name:<40} {:>10} {:>10}", "missing", "-"),
            }
        }
    }
    let _ = connection.close(200, "inspected".into()).await;
    let mut conn = connect_db(builder.configured_database_url()).await?;
    let (dedup_rows, outbox) = crate::store::db::table_sizes(&mut conn).await?;
    println!("dedup rows (estimate): {dedup_rows}");
    println!("outbox backlog:        {outbox}");
    Ok(())
}
