//! Why a run decided nothing, and how a handler failed: the fault types, their
//! classification, and idemq's own statements that bound and diagnose them
//! (a statement without an answer, a cancelled handler, a schema gone missing).

use std::future::Future;
use std::time::Duration;

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};

use super::{Consumer, BOOKKEEPING_TIMEOUT};
use crate::base::duration::human;
use crate::error::Error;
use crate::handler::HandlerError;
use crate::store::db;

/// Why a run of part of a batch decided nothing.
pub(super) enum Fault {
    /// The database or pool failed; the outcome is unknown: try again.
    Infra(InfraFault),
    /// A delivery run alone was rolled back for contention (serialization failure,
    /// deadlock): run it again.
    Contention { error: String, key: String },
    /// No retry can fix it: return the deliveries and stop the runtime.
    Fatal(Error),
}

/// How a handler's run in the transaction failed.
pub(super) enum Failure {
    /// It returned an error; the transaction is open (maybe aborted).
    Returned(HandlerError),
    /// It panicked or timed out: its statement was cancelled, and the connection,
    /// still in the transaction, is dropped.
    Cut(String),
}

impl Consumer {
    /// One of idemq's own statements, bounded on the client too: past
    /// [`Shared::statement_deadline`] (the server's `statement_timeout` and a margin)
    /// the server would have answered, if only with an error, so no answer means the
    /// network to it is gone — a half-open connection (a pooler or proxy that stays
    /// up, a black hole) must not hold a delivery for the whole outage. The error is a
    /// connection error: the transaction is retried on a fresh connection.
    ///
    /// [`Shared::statement_deadline`]: super::Shared::statement_deadline
    pub(super) async fn bounded<T>(
        &self,
        statement: impl Future<Output = diesel::QueryResult<T>>,
    ) -> diesel::QueryResult<T> {
        let deadline = self.shared.statement_deadline;
        tokio::time::timeout(deadline, statement).await.unwrap_or_else(|_| Err(no_answer(deadline)))
    }

    /// A statement of idemq's own failed. A server error with the connection still
    /// up may mean idemq's schema is missing or unusable — no retry fixes that, so
    /// the runtime stops; anything else (a lock timeout behind a zombie, a restart in
    /// progress) is retried.
    pub(super) async fn diagnose(&self, conn: &mut AsyncPgConnection, err: diesel::result::Error) -> Fault {
        // A read-only server (a standby; 25006) holds idemq's tables all the same:
        // no schema check, a fault to wait out.
        if db::is_connection_error(&err) || db::is_read_only(&err) || PoolableConnection::is_broken(conn) {
            return Fault::Infra(InfraFault::Database(err));
        }
        match crate::store::migrate::check_schema(conn).await {
            Ok(Some(problem)) => Fault::Fatal(problem.into()),
            Ok(None) | Err(_) => Fault::Infra(InfraFault::Database(err)),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Returned(error) => write!(f, "{error}"),
            Self::Cut(message) => f.write_str(message),
        }
    }
}

/// Cancels the statement running on the connection `cancel` belongs to, bounded.
pub(crate) async fn cancel_statement(cancel: &db::Canceller) {
    match tokio::time::timeout(BOOKKEEPING_TIMEOUT, cancel.cancel()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            crate::base::log::warn!(error = %crate::error::redact(&error.to_string()), "could not cancel the handler's statement")
        }
        Err(_) => crate::base::log::warn!("cancelling the handler's statement timed out"),
    }
}

/// Whether a connection whose handler was cut off (its statement cancelled) still
/// answers, within [`BOOKKEEPING_TIMEOUT`]: any answer counts, an error too (the
/// cancelled statement aborted the transaction, which stays open: the connection is
/// dropped after). A cancel request is sent blind, so only an answer on the
/// connection itself tells an unreachable database from a slow handler.
pub(super) async fn answers(conn: &mut AsyncPgConnection) -> bool {
    use diesel_async::SimpleAsyncConnection;
    match tokio::time::timeout(BOOKKEEPING_TIMEOUT, conn.batch_execute("SELECT 1")).await {
        Ok(Ok(())) => true,
        Ok(Err(error)) => !db::is_connection_error(&error),
        Err(_) => false,
    }
}

/// The error of one of idemq's own statements that got no answer within `deadline`:
/// a connection error (the connection is in an unknown state and is dropped).
pub(super) fn no_answer(deadline: Duration) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::ClosedConnection,
        Box::new(format!(
            "no answer from PostgreSQL within {} (its own statement_timeout would have answered by \
             then): the network to the database is down",
            human(deadline)
        )),
    )
}

/// The message of a panic payload (`panic!` with a literal or a format string).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic payload that is not a string)".to_owned())
}

/// Rolls back after a failed statement; the original fault is what is reported. A
/// connection that failed (or got no answer) is not rolled back: it is dropped, which
/// ends its transaction on the server, and a ROLLBACK could wait as long again.
pub(super) async fn rollback(conn: &mut AsyncPgConnection, fault: Fault) -> Fault {
    let lost = matches!(&fault, Fault::Infra(InfraFault::Database(err)) if db::is_connection_error(err));
    if !lost {
        let rollback = AnsiTransactionManager::rollback_transaction(conn);
        let _ = tokio::time::timeout(BOOKKEEPING_TIMEOUT, rollback).await;
    }
    fault
}

/// A fault of the database or pool: the delivery's outcome is not decided.
#[derive(Debug, thiserror::Error)]
pub(super) enum InfraFault {
    #[error("no database connection: {0}")]
    Pool(String),
    #[error("database error: {0}")]
    Database(diesel::result::Error),
    #[error("COMMIT failed, its outcome is unknown: {0}")]
    Commit(diesel::result::Error),
    #[error("the connection broke during the handler: {0}")]
    Broken(String),
    /// The server refused the handler's write as read-only: a standby, or one still
    /// being promoted (a transaction begun in recovery stays read-only).
    #[error(
        "the database refused the handler's write as read-only (a standby, or a failover in progress): {0}"
    )]
    ReadOnly(String),
}
