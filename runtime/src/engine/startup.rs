//! Starting during an outage: a broker or a database that does not answer yet is
//! waited for, not failed on.
//!
//! A consumer restarted while RabbitMQ or PostgreSQL is out of reach (connection
//! refused or reset, a network that swallows packets) used to exit at once, and an
//! orchestrator restarting it backs off for minutes after the outage ends. Instead,
//! every attempt that finds it unreachable is logged with the delay to the next one
//! and told to the observers ([`ConnectionEvent::Unreachable`]: `/readyz` answers
//! 503 with the reason, `/healthz` stays 200), and the next attempt follows with the
//! reconnect backoff — until it answers, shutdown begins (`run` then returns `Ok`),
//! or the startup timeout is spent ([`Error::StartupTimeout`], naming what was
//! unreachable). What waiting cannot mend — a refused login, a missing vhost or
//! database, an unreadable URL, idemq's tables missing — fails at once, with the fix.
//!
//! One [`Startup`] spans the whole start: the database first (the check at the top
//! of `Runtime::run`), then the broker (the first session, see `engine/session/`, with
//! [`brokers::unreachable`](crate::broker::brokers::unreachable) telling an outage from a
//! refusal). The database's attempts live here: a plain connection first, whose error
//! carries the server's SQLSTATE, then the pool's first connection and the schema
//! check.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::base::duration::human;
use crate::base::observe::ConnectionEvent;
use crate::base::observe::Observers;
use crate::error::{redact, Dependency, Error};
use crate::store::db;
use crate::store::replication::ReplicationCheck;

/// The first wait between attempts (then doubling, with jitter, up to the
/// reconnect backoff's maximum).
const FIRST_DELAY: Duration = Duration::from_millis(100);

/// How long one attempt at the database may take (the plain connection, then the
/// pool's): a server that accepts TCP and never answers is an outage too.
const DATABASE_ATTEMPT: Duration = Duration::from_secs(10);

/// How one attempt at a dependency failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Out of reach for now: wait, then try again. The error, in the driver's words.
    Unreachable(String),
    /// An answer no retry changes: fail with it.
    Refused(Error),
}

/// The start-up wait: one budget (the startup timeout) from the start of `run`, one
/// backoff per dependency.
pub struct Startup {
    began: Instant,
    timeout: Option<Duration>,
    reconnect_max: Duration,
    backoff: Backoff,
    /// The dependency being waited for (its first attempt has failed).
    waiting_for: Option<Dependency>,
    /// The last failed attempt's error, redacted: what the timeout's error quotes.
    last_error: String,
    observers: Observers,
}

impl Startup {
    /// Starts the clock: `timeout` bounds the whole wait (`None`: for ever).
    pub(crate) fn new(timeout: Option<Duration>, reconnect_max: Duration, observers: Observers) -> Self {
        Self {
            began: Instant::now(),
            timeout,
            reconnect_max,
            backoff: Backoff::new(FIRST_DELAY, reconnect_max),
            waiting_for: None,
            last_error: String::new(),
            observers,
        }
    }

    /// How long the wait has lasted so far.
    pub fn elapsed(&self) -> Duration {
        self.began.elapsed()
    }

    /// When the next attempt at `dependency` must end: at the deadline, once its
    /// first attempt has failed. The first attempt at each dependency runs with its
    /// own timeouts, so a zero startup timeout is plain fail-fast: one attempt each.
    pub(crate) fn cut_at(&self, dependency: Dependency) -> Option<Instant> {
        if self.waiting_for == Some(dependency) {
            self.timeout.map(|timeout| self.began + timeout)
        } else {
            None
        }
    }

    /// `Err` with [`Error::StartupTimeout`] if the wait for `dependency` (shown as
    /// `url`) is over: no attempt is made after the deadline.
    pub(crate) fn check_deadline(&self, dependency: Dependency, url: &str) -> Result<(), Error> {
        match self.cut_at(dependency) {
            Some(deadline) if Instant::now() >= deadline => Err(self.timed_out(dependency, url)),
            _ => Ok(()),
        }
    }

    fn timed_out(&self, dependency: Dependency, url: &str) -> Error {
        Error::StartupTimeout {
            dependency,
            url: redact(url),
            waited: to_millis(self.began.elapsed()),
            last_error: self.last_error.clone(),
        }
    }

    /// After an attempt at `dependency` (shown as `url`) found it unreachable with
    /// `error`: logs it with the delay to the next attempt, tells the observers, and
    /// waits that long (never past the deadline). `Ok(true)`: try again;
    /// `Ok(false)`: `stop` was cancelled meanwhile.
    ///
    /// # Errors
    /// [`Error::StartupTimeout`] once the deadline has passed.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled wait only counts as an attempt.
    pub(crate) async fn wait(
        &mut self,
        dependency: Dependency,
        url: &str,
        error: &str,
        stop: &CancellationToken,
    ) -> Result<bool, Error> {
        if self.waiting_for != Some(dependency) {
            self.waiting_for = Some(dependency);
            self.backoff = Backoff::new(FIRST_DELAY, self.reconnect_max);
            self.last_error.clear();
        }
        let url = redact(url);
        let left = self.cut_at(dependency).map(|deadline| deadline.saturating_duration_since(Instant::now()));
        if left == Some(Duration::ZERO) {
            // This attempt ran into the deadline, which cut it short: its error
            // says only that the time ran out. The attempt before it says why.
            if self.last_error.is_empty() {
                self.last_error = redact(error);
            }
            return Err(self.timed_out(dependency, &url));
        }
        self.last_error = redact(error);
        let delay = self.backoff.next_delay();
        let delay = to_millis(left.map_or(delay, |left| delay.min(left)));
        let left = left.map(to_millis);
        let attempt = self.backoff.attempts;
        let error = self.last_error.clone();
        match left {
            None => crate::base::log::warn!(
                %dependency, %url, attempt, retry_in = %human(delay), %error,
                "{dependency} is unreachable at start-up; waiting for it (no startup timeout: as long as it takes)"
            ),
            Some(left) => crate::base::log::warn!(
                %dependency, %url, attempt, retry_in = %human(delay), gives_up_in = %human(left), %error,
                "{dependency} is unreachable at start-up; waiting for it"
            ),
        }
        self.observers.connection(&ConnectionEvent::Unreachable {
            dependency,
            attempt,
            retry_in: delay,
            error,
        });
        tokio::select! {
            () = stop.cancelled() => Ok(false),
            () = tokio::time::sleep(delay) => Ok(true),
        }
    }

    /// Waits until the database at `url` answers through `pool` and holds idemq's
    /// tables, usable by this user. `Ok(false)`: `stop` was cancelled first.
    ///
    /// # Errors
    /// What waiting cannot mend ([`Error::DatabaseConnect`] for a refused login or a
    /// missing database, [`Error::Schema`]), or [`Error::StartupTimeout`].
    pub(crate) async fn database(
        &mut self,
        pool: &db::Pool,
        url: &str,
        stop: &CancellationToken,
    ) -> Result<bool, Error> {
        self.until_up(Dependency::Database, url, stop, |limit| database_ready(pool, url, limit)).await
    }

    /// Waits until the PostgreSQL server at `url` answers at all — any answer, a
    /// refusal included: what comes next (the CLI's set-up, which may create the
    /// database, and the migrations) reports it. `Ok(false)`: `stop` was cancelled.
    ///
    /// # Errors
    /// [`Error::StartupTimeout`].
    pub async fn database_server(&mut self, url: &str, stop: &CancellationToken) -> Result<bool, Error> {
        self.until_up(Dependency::Database, url, stop, |limit| async move {
            match probe(url, limit).await {
                Err(Failure::Unreachable(error)) => Err(Failure::Unreachable(error)),
                Ok(()) | Err(Failure::Refused(_)) => Ok(()),
            }
        })
        .await
    }

    /// Runs `attempt` (given how long it may take) until it succeeds, waiting
    /// between attempts that find `dependency` unreachable.
    async fn until_up<F, Fut>(
        &mut self,
        dependency: Dependency,
        url: &str,
        stop: &CancellationToken,
        mut attempt: F,
    ) -> Result<bool, Error>
    where
        F: FnMut(Duration) -> Fut,
        Fut: std::future::Future<Output = Result<(), Failure>>,
    {
        loop {
            self.check_deadline(dependency, url)?;
            let limit = self.cut_at(dependency).map_or(DATABASE_ATTEMPT, |deadline| {
                deadline.saturating_duration_since(Instant::now()).min(DATABASE_ATTEMPT)
            });
            let result = tokio::select! {
                () = stop.cancelled() => return Ok(false),
                result = attempt(limit) => result,
            };
            match result {
                Ok(()) => return Ok(true),
                Err(Failure::Refused(err)) => return Err(err),
                Err(Failure::Unreachable(error)) => {
                    if !self.wait(dependency, url, &error, stop).await? {
                        return Ok(false);
                    }
                }
            }
        }
    }
}

/// `duration` in whole milliseconds, as logs and messages show it.
fn to_millis(duration: Duration) -> Duration {
    Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
}

/// One attempt at the database: a plain connection (its error tells an outage from
/// a refusal), then the pool's first connection and idemq's schema check.
async fn database_ready(pool: &db::Pool, url: &str, limit: Duration) -> Result<(), Failure> {
    probe(url, limit).await?;
    let no_answer = || Failure::Unreachable(format!("no answer within {}", human(limit)));
    let refused = |message: String, cause: Box<dyn std::error::Error + Send + Sync>| {
        Failure::Refused(Error::DatabaseConnect { url: redact(url), message, cause: Some(cause) })
    };
    let mut conn = match tokio::time::timeout(limit, pool.get()).await {
        Err(_) => return Err(no_answer()),
        Ok(Ok(conn)) => conn,
        // The session set-up every pooled connection runs (limits, the COMMIT
        // check's prepared statement) refused by the server, e.g. a pooler that
        // forbids prepared statements.
        Ok(Err(db::PoolError::Backend(db::NewConnection::Setup(err)))) if !db::is_connection_error(&err) => {
            return Err(refused(format!("the pool's session set-up was refused: {err}"), Box::new(err)))
        }
        // A URL or a certificate no wait mends.
        Ok(Err(db::PoolError::Backend(db::NewConnection::Connect(
            err @ (Error::Tls { .. } | Error::Config(_)),
        )))) => return Err(Failure::Refused(err)),
        // It answered a moment ago: the connection was lost in between.
        Ok(Err(err @ (db::PoolError::Timeout(_) | db::PoolError::Backend(_)))) => {
            return Err(Failure::Unreachable(redact(&err.to_string())))
        }
        Ok(Err(err)) => return Err(refused(err.to_string(), Box::new(err))),
    };
    // Fail fast, with the fix, on what no retry can mend: without idemq's tables
    // every delivery would fail until someone runs the migrations.
    match crate::store::migrate::check_schema(&mut conn).await {
        Ok(None) => Ok(()),
        Ok(Some(problem)) => Err(Failure::Refused(problem.into())),
        Err(err) if db::is_connection_error(&err) => Err(Failure::Unreachable(err.to_string())),
        Err(err) => Err(refused(format!("checking idemq's tables failed: {err}"), Box::new(err))),
    }
}

/// A connection to `url` (TLS as the URL says), closed at once; how it failed if it did.
async fn probe(url: &str, limit: Duration) -> Result<(), Failure> {
    use crate::tls::postgres::{ConnectFailure, Connected};
    match tokio::time::timeout(limit, crate::tls::postgres::connect(url, |_| {})).await {
        Err(_) => Err(Failure::Unreachable(format!("no answer within {}", human(limit)))),
        // A URL that cannot be used, a certificate that does not verify: no wait mends it.
        Ok(Err(ConnectFailure::Refused(err))) => Err(Failure::Refused(err)),
        Ok(Err(ConnectFailure::Driver(err))) => Err(classify(url, err)),
        // Refused, reset, unreachable, a name that does not resolve (yet), a
        // read-only server where writes are wanted (a failover in progress).
        Ok(Err(failure @ ConnectFailure::Network(_))) => {
            Err(Failure::Unreachable(redact(&failure.to_string())))
        }
        Ok(Ok(Connected { client, connection, .. })) => {
            // Without its client the connection says goodbye (Terminate) and ends.
            drop(client);
            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
            Ok(())
        }
    }
}

/// An outage (wait) or an answer (fail), by the server's SQLSTATE when it sent one,
/// else by whether the error is the network's.
fn classify(url: &str, err: tokio_postgres::Error) -> Failure {
    let said = redact(&error_chain(&err));
    let hint = match err.code() {
        Some(code) => match code.code().get(..2) {
            // 08 connection exception, 53 insufficient resources (too many
            // connections), 57 operator intervention (starting up, shutting down,
            // terminated by the administrator): a server that will answer later.
            Some("08" | "53" | "57") => return Failure::Unreachable(said),
            // 3D000: no such database.
            _ if code == &tokio_postgres::error::SqlState::INVALID_CATALOG_NAME => {
                " (the server answered: create the database, or correct its name in DATABASE_URL)"
            }
            // 28000, 28P01: no such role, wrong password, or pg_hba.conf refuses.
            Some("28") => " (login refused: check the user and password in DATABASE_URL, and pg_hba.conf)",
            _ => "",
        },
        // Refused, reset, unreachable, a name that does not resolve (yet).
        None if caused_by_io(&err) => return Failure::Unreachable(said),
        // An unreadable connection string, TLS demanded, a password the server asked
        // for and the URL lacks, something that is not PostgreSQL on that port.
        None => "",
    };
    Failure::Refused(Error::DatabaseConnect {
        url: redact(url),
        message: format!("{said}{hint}"),
        cause: Some(Box::new(err)),
    })
}

/// Whether an I/O error is among `err`'s causes.
fn caused_by_io(err: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The error and its causes, `: `-joined (tokio-postgres' own message is a summary
/// such as "error connecting to server").
fn error_chain(err: &tokio_postgres::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The replication check (see `store/replication.rs`), once the database answers:
/// whether a COMMIT it acknowledges could be lost, warned about or refused as
/// `check` says. A check that cannot be made (the query refused) is said and
/// skipped: it must not stop a runtime that would run.
///
/// # Errors
/// [`Error::Replication`] with [`ReplicationCheck::Refuse`] and a concern.
pub(crate) async fn replication(pool: &db::Pool, check: ReplicationCheck) -> Result<(), Error> {
    if check == ReplicationCheck::Off {
        return Ok(());
    }
    let read = async {
        let mut conn = pool.get().await.map_err(|err| err.to_string())?;
        crate::store::replication::read(&mut conn).await.map_err(|err| err.to_string())
    };
    let state = match tokio::time::timeout(DATABASE_ATTEMPT, read).await {
        Ok(Ok(state)) => state,
        Ok(Err(error)) => {
            crate::base::log::warn!(error = %redact(&error), "could not read the database's replication state; not checked");
            return Ok(());
        }
        Err(_) => {
            crate::base::log::warn!("reading the database's replication state took too long; not checked");
            return Ok(());
        }
    };
    let concerns = state.concerns();
    if concerns.is_empty() {
        crate::base::log::info!(
            standbys = state.standbys,
            synchronous_standby_names = %state.standby_names,
            synchronous_commit = %state.synchronous_commit,
            "replication: an acknowledged COMMIT survives the loss of the server"
        );
        return Ok(());
    }
    if check == ReplicationCheck::Refuse {
        return Err(Error::Replication { concerns });
    }
    for concern in &concerns {
        crate::base::log::warn!(
            standbys = state.standbys,
            "the database could lose COMMITs it acknowledged: {concern} (replication_check = \"refuse\" \
             makes this an error; \"off\" silences it)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_is_an_outage_and_a_bad_string_is_not() {
        let refused = probe("postgres://postgres@127.0.0.1:1/x", Duration::from_secs(5)).await;
        assert!(matches!(refused, Err(Failure::Unreachable(ref e)) if e.contains("refused")), "{refused:?}");
        let bad = probe("postgres//bad", Duration::from_secs(5)).await;
        assert!(
            matches!(bad, Err(Failure::Refused(Error::Config(ref e))) if e.contains("connection string")),
            "{bad:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_at_the_deadline_with_the_last_error_and_what_was_unreachable() {
        let mut startup =
            Startup::new(Some(Duration::from_secs(2)), Duration::from_secs(1), Observers::default());
        let stop = CancellationToken::new();
        assert!(startup.cut_at(Dependency::Broker).is_none(), "the first attempt runs uncut");
        let url = "amqp://guest:s3cret@h:5672/%2f";
        let mut waits = 0;
        let err = loop {
            match startup.wait(Dependency::Broker, url, "connection refused", &stop).await {
                Ok(true) => waits += 1,
                Ok(false) => panic!("not stopped"),
                Err(err) => break err,
            }
        };
        assert!(waits >= 2, "{waits}");
        let shown = err.to_string();
        assert!(
            shown.contains("RabbitMQ") && shown.contains("connection refused") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(matches!(err, Error::StartupTimeout { dependency: Dependency::Broker, .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_cut_short_by_the_deadline_does_not_hide_why_the_wait_began() {
        let mut startup =
            Startup::new(Some(Duration::from_secs(1)), Duration::from_secs(1), Observers::default());
        let stop = CancellationToken::new();
        let url = "amqp://guest:s3cret@h:5672/%2f";
        assert!(startup.wait(Dependency::Broker, url, "connection refused", &stop).await.expect("in time"));
        tokio::time::advance(Duration::from_secs(2)).await;
        let err = startup
            .wait(Dependency::Broker, url, "took longer than 936µs", &stop)
            .await
            .expect_err("past the deadline");
        let shown = err.to_string();
        assert!(shown.contains("connection refused") && !shown.contains("936"), "{shown}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_during_the_wait_ends_it() {
        let mut startup = Startup::new(None, Duration::from_secs(30), Observers::default());
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(!startup
            .wait(Dependency::Database, "postgres://h/db", "refused", &stop)
            .await
            .expect("no timeout"));
    }
}
