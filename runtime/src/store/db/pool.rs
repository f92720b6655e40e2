//! The pool every delivery takes its connection from, and the session settings
//! each pooled connection runs once when it is made.

use std::time::Duration;

use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::FutureExt;

use super::commit::PREPARE_CHECK;
use super::connect::establish;

/// Session limits of every pooled connection, so that nothing idemq starts can hold
/// locks for long past the handler timeout, even when its client is gone: a
/// statement, a lock wait and an idle open transaction are each ended by the server.
/// Set, with the COMMIT check's prepared statement, when a connection is made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionLimits {
    pub(crate) statement: Duration,
    pub(crate) idle_in_transaction: Duration,
}

impl SessionLimits {
    /// Derived from the handler timeout: a statement or lock wait may take as long
    /// as the handler may, plus a margin; an open transaction may sit idle a little
    /// longer (the handler may await other things between statements).
    pub(crate) fn for_handler_timeout(handler_timeout: Duration) -> Self {
        Self {
            statement: handler_timeout + Duration::from_secs(10),
            idle_in_transaction: handler_timeout + Duration::from_secs(30),
        }
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
        format!(
            "SET statement_timeout = {}; SET lock_timeout = {}; SET idle_in_transaction_session_timeout = {}; {PREPARE_CHECK}",
            ms(self.statement),
            ms(self.statement),
            ms(self.idle_in_transaction)
        )
    }
}

/// The pool every delivery takes its connection from.
pub(crate) fn build_pool(
    database_url: &str,
    size: usize,
    limits: SessionLimits,
) -> Result<Pool<AsyncPgConnection>, deadpool::managed::BuildError> {
    let mut config = ManagerConfig::default();
    // Broken connections are detected and dropped by the delivery state machine, so
    // the per-checkout `SELECT 1` of `Verified` buys nothing but latency.
    config.recycling_method = RecyclingMethod::Fast;
    let setup_sql = limits.setup_sql();
    config.custom_setup = Box::new(move |url| {
        let setup_sql = setup_sql.clone();
        let url = url.to_owned();
        async move {
            let mut conn = establish(&url).await?;
            conn.batch_execute(&setup_sql)
                .await
                .map_err(diesel::ConnectionError::CouldntSetupConfiguration)?;
            Ok(conn)
        }
        .boxed()
    });
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    Pool::builder(manager)
        .max_size(size)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
}
