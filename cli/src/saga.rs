//! `saga show NAME KEY`: one saga as `idemq_saga` holds it — running or finished,
//! its steps, its times, the timeouts it waits for and its state as JSON. A saga
//! that is not there (never started, or finished and past its `keep_finished`) is
//! an error: exit 1, saying so.

use clap::ArgMatches;
use diesel::sql_types::Bool;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::common::{connect_db, say, CliResult, Out};
use idemq_core::__private::sibling::db;
use idemq_core::RuntimeBuilder;

pub(crate) async fn run(builder: &RuntimeBuilder, matches: &ArgMatches) -> CliResult {
    use idemq_core::__private::sibling::BuilderPlan as _;
    let (action, sub) = matches.subcommand().ok_or("saga needs show")?;
    if action != "show" {
        return Err(format!("unknown saga command `{action}`").into());
    }
    let name = sub.get_one::<String>("name").expect("required");
    let key = sub.get_one::<String>("key").expect("required");
    let mut conn = connect_db(builder.configured_database_url()).await?;
    let saga = match db::show_saga(&mut conn, name, key).await {
        Ok(Some(saga)) => saga,
        Ok(None) => {
            return Err(format!(
                "no saga '{name}' with key '{key}': none started with that key, or it finished and was \
                 deleted after its keep_finished"
            )
            .into())
        }
        Err(_) if table_missing(&mut conn).await => return Err(NOT_MIGRATED.into()),
        Err(err) => return Err(format!("reading idemq_saga failed: {err}").into()),
    };
    show(&mut Out::new(), name, key, &saga);
    Ok(())
}

/// What is said when `idemq_saga` is not there.
pub(crate) const NOT_MIGRATED: &str = "idemq_saga is not there: run `migrate`";

/// Whether `idemq_saga` is missing (a schema from before sagas): asked only after a
/// read of it failed, to say what to run rather than the driver's words.
pub(crate) async fn table_missing(conn: &mut AsyncPgConnection) -> bool {
    let there = diesel::select(diesel::dsl::sql::<Bool>("to_regclass('idemq_saga') IS NOT NULL"))
        .get_result::<bool>(conn)
        .await;
    there == Ok(false)
}

/// The saga, a line per fact, its state last.
fn show(out: &mut Out, name: &str, key: &str, saga: &db::SagaShown) {
    let (running, expires) = match (&saga.finished_at, &saga.expires_at) {
        (None, _) => ("running".to_owned(), "not while it runs".to_owned()),
        (Some(_), Some(expires)) => {
            (format!("finished, kept until {expires}"), format!("{expires} (the retention sweep deletes it)"))
        }
        (Some(_), None) => ("finished".to_owned(), "never".to_owned()),
    };
    say!(out, "saga {name}, key {key}: {running}");
    say!(out, "version:  {} (steps taken)", saga.version);
    say!(out, "started:  {}", saga.started_at);
    say!(out, "updated:  {}", saga.updated_at);
    say!(out, "finished: {}", saga.finished_at.as_deref().unwrap_or("not yet"));
    say!(out, "expires:  {expires}");
    match saga.timeouts.as_slice() {
        [] => say!(out, "timeouts: none pending"),
        ids => say!(out, "timeouts: {} pending (message ids): {}", ids.len(), ids.join(", ")),
    }
    say!(out, "state:");
    say!(out, "{}", saga.state);
}
