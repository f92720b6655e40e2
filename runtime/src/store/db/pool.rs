//! The pool every delivery takes its connection from, and the session settings
//! each pooled connection runs once when it is made.

use std::time::Duration;

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::SimpleAsyncConnection;

use super::commit::PREPARE_CHECK;
use super::conn::Conn;
use super::connect::open;
use crate::error::Error;

/// Session limits of every pooled connection, so that nothing idemq starts can hold
/// locks for long past the handler timeout, even when its client is gone: a
/// statement, a lock wait and an idle open transaction are each ended by the server.
/// Set, with the COMMIT check's prepared statement, when a connection is made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionLimits {
    pub(crate) statement: Duration,
    pub(crate) idle_in_transaction: Duration,
    /// Plan every execution of a prepared statement for its parameters
    /// (`plan_cache_mode = force_custom_plan`), never with a generic plan (see
    /// [`SessionLimits::custom_plans`]).
    pub(crate) custom_plans: bool,
}

impl SessionLimits {
    /// Derived from the handler timeout: a statement or lock wait may take as long
    /// as the handler may, plus a margin; an open transaction may sit idle a little
    /// longer (the handler may await other things between statements).
    pub(crate) fn for_handler_timeout(handler_timeout: Duration) -> Self {
        Self {
            statement: handler_timeout + Duration::from_secs(10),
            idle_in_transaction: handler_timeout + Duration::from_secs(30),
            custom_plans: false,
        }
    }

    /// These limits, on sessions that never use a generic plan. For the relay's
    /// statements on the outbox, a table that is empty most of the time and then, in
    /// a burst, holds a backlog: a generic plan made while its statistics said
    /// "empty" (after a VACUUM of the empty table) deletes by `id = ANY($1)` with a
    /// sequential scan — 85 ms per pass over 50,000 rows, measured — until the next
    /// ANALYZE, which never comes where autovacuum is off. A custom plan is made
    /// for the parameters each time (tens of µs) and uses the primary key.
    pub(crate) fn custom_plans(self) -> Self {
        Self { custom_plans: true, ..self }
    }

    /// How long idemq waits on the client for one of its own statements: the
    /// server's `statement_timeout` and a margin. By then the server has answered,
    /// if only with its timeout error; no answer means the network to it is gone.
    pub(crate) fn client_deadline(self) -> Duration {
        self.statement + Duration::from_secs(5)
    }

    /// What every pooled connection runs once: the limits, and the COMMIT check.
    fn setup_sql(self) -> String {
        let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX as u128);
        let plans = if self.custom_plans { "SET plan_cache_mode = force_custom_plan; " } else { "" };
        format!(
            "SET statement_timeout = {}; SET lock_timeout = {}; SET idle_in_transaction_session_timeout = {}; {plans}{PREPARE_CHECK}",
            ms(self.statement),
            ms(self.statement),
            ms(self.idle_in_transaction)
        )
    }
}

/// The pool every delivery takes its connection from: idemq's [`Conn`]s, each made
/// by [`open`] and set up with `limits` once.
pub(crate) type Pool = deadpool::managed::Pool<Manager>;
/// A connection taken from a [`Pool`]; back to it when dropped (unless taken out
/// with `Object::take`).
pub(crate) type Pooled = deadpool::managed::Object<Manager>;
/// Why a [`Pool`] handed out no connection.
pub(crate) type PoolError = deadpool::managed::PoolError<NewConnection>;

/// The pool of `size` connections to `database_url`.
pub(crate) fn build_pool(
    database_url: &str,
    size: usize,
    limits: SessionLimits,
) -> Result<Pool, deadpool::managed::BuildError> {
    let manager = Manager { url: database_url.to_owned(), setup_sql: limits.setup_sql() };
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
}

/// Makes and recycles the pool's connections, as diesel-async's manager with
/// `RecyclingMethod::Fast` does: broken connections are detected and dropped by the
/// delivery state machine, so a per-checkout `SELECT 1` would buy nothing but
/// latency; a connection is recycled unless it is broken (closed, or left in a
/// transaction).
#[derive(Debug)]
pub(crate) struct Manager {
    url: String,
    setup_sql: String,
}

/// Why the pool could not make a connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NewConnection {
    /// No connection: as [`open`] fails.
    #[error(transparent)]
    Connect(Error),
    /// The session set-up (the limits, the COMMIT check's prepared statement) failed.
    #[error("the session set-up failed: {0}")]
    Setup(#[source] diesel::result::Error),
}

impl deadpool::managed::Manager for Manager {
    type Type = Conn;
    type Error = NewConnection;

    async fn create(&self) -> Result<Conn, NewConnection> {
        let mut conn = open(&self.url).await.map_err(NewConnection::Connect)?;
        conn.batch_execute(&self.setup_sql).await.map_err(NewConnection::Setup)?;
        Ok(conn)
    }

    async fn recycle(
        &self,
        conn: &mut Conn,
        _: &deadpool::managed::Metrics,
    ) -> deadpool::managed::RecycleResult<NewConnection> {
        if std::thread::panicking() || PoolableConnection::is_broken(&mut **conn) {
            return Err(deadpool::managed::RecycleError::Message("Broken connection".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::SessionLimits;

    #[test]
    fn only_sessions_asking_for_custom_plans_get_them() {
        let limits = SessionLimits::for_handler_timeout(Duration::from_secs(30));
        assert!(
            !limits.setup_sql().contains("plan_cache_mode"),
            "the consumers' sessions keep the server's mode"
        );
        let relay = limits.custom_plans().setup_sql();
        assert!(relay.contains("SET plan_cache_mode = force_custom_plan;"), "{relay}");
        assert!(relay.ends_with(super::PREPARE_CHECK), "the COMMIT check is still prepared: {relay}");
    }
}
