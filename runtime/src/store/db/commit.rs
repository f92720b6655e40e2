//! The checked COMMIT and how a failed statement's error is read: the check that
//! refuses an aborted or ended transaction in the COMMIT's own round trip, and the
//! lost-connection and contention classifications the delivery state machine acts on.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::QueryResult;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager};

/// Prepared on every pooled connection (see `SessionLimits::setup_sql`, in `pool`), so the
/// check below is planned once per connection, not once per COMMIT.
pub(super) const PREPARE_CHECK: &str = "PREPARE idemq_check(bigint) AS \
     SELECT CASE WHEN txid_current_if_assigned() = $1 THEN 0 \
     ELSE ('idemq_transaction_ended' || coalesce(txid_current_if_assigned()::text, ''))::int END";

/// The check sent with COMMIT, as one simple-query message, so it costs the same
/// round trip as `COMMIT` alone. PostgreSQL runs the statements in order and stops
/// at the first error:
/// - a transaction aborted by a failed statement (whose error the handler ignored)
///   fails the check (25P02) and COMMIT is never sent — without the check, COMMIT
///   would answer `ROLLBACK` and no error, and the delivery would be acked;
/// - if the transaction is no longer the one that wrote the dedup row (its id, `xid`,
///   was returned by the insert) — the handler ran its own COMMIT or ROLLBACK, and
///   maybe began another — the check fails with [`ENDED_MARKER`] in the message
///   (the `ELSE` is evaluated only then: the function is not constant);
/// - otherwise COMMIT runs, and any error it answers is the server's refusal.
fn checked_commit(xid: i64) -> String {
    format!("EXECUTE idemq_check({xid}); COMMIT")
}

/// What the cast error of [`checked_commit`] quotes, whatever the server's language.
const ENDED_MARKER: &str = "idemq_transaction_ended";

/// Why the checked COMMIT did not commit.
#[derive(Debug)]
pub(crate) enum CommitFailure {
    /// A statement in the handler failed and its error was ignored: rolled back.
    Aborted,
    /// The handler ended idemq's transaction itself (COMMIT, ROLLBACK): rolled back
    /// whatever it began after.
    Ended,
    /// The server refused the COMMIT (deferred constraint, serialization failure,
    /// deadlock): rolled back. `contention` for the ones worth running again at once.
    Refused { error: DieselError, contention: bool },
    /// The connection failed: the COMMIT may or may not have landed.
    Unknown(DieselError),
    /// The check's prepared statement is gone (the handler ran `DISCARD ALL` or
    /// `DEALLOCATE`): rolled back once the connection, left open in diesel's eyes, is
    /// dropped.
    CheckMissing,
}

/// COMMITs the open top-level transaction `xid`, refusing one that is aborted or is
/// not the one the dedup row was written in (see [`checked_commit`]). On any refusal the
/// transaction is rolled back and the connection stays usable; on
/// [`CommitFailure::Unknown`] it must be dropped.
pub(crate) async fn commit_checked(conn: &mut AsyncPgConnection, xid: i64) -> Result<(), CommitFailure> {
    match conn.batch_execute(&checked_commit(xid)).await {
        Ok(()) => {
            // The COMMIT went out by hand, so diesel's bookkeeping must be told; a
            // connection it believes to be in a transaction is discarded by the pool.
            left_transaction(conn).map_err(CommitFailure::Unknown)?;
            Ok(())
        }
        Err(error) if is_connection_error(&error) => Err(CommitFailure::Unknown(error)),
        Err(DieselError::DatabaseError(_, info)) if info.message().contains("\"idemq_check\"") => {
            Err(CommitFailure::CheckMissing)
        }
        Err(error) => {
            let failure = match &error {
                DieselError::DatabaseError(_, info) if info.message().contains(ENDED_MARKER) => {
                    CommitFailure::Ended
                }
                DieselError::DatabaseError(_, info)
                    if info.message().starts_with("current transaction is aborted") =>
                {
                    CommitFailure::Aborted
                }
                _ => CommitFailure::Refused { contention: is_contention(&error), error },
            };
            // The aborted transaction, or the one the handler began after ending
            // ours, or nothing (COMMIT's failure ended it; ROLLBACK only warns).
            match AnsiTransactionManager::rollback_transaction(conn).await {
                // NotInTransaction: the handler ended it through diesel, which knows.
                Ok(()) | Err(DieselError::NotInTransaction) => Err(failure),
                Err(rollback_error) => Err(CommitFailure::Unknown(rollback_error)),
            }
        }
    }
}

/// Records in diesel's transaction manager that the top-level transaction ended.
fn left_transaction(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    use diesel::connection::TransactionDepthChange;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::DecreaseDepth)
}

/// The connection failed (closed, could not send): the server's answer is unknown.
pub(crate) fn is_connection_error(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(
            DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
            _
        ) | DieselError::BrokenTransactionManager
    )
}

/// Whether an error's text says the transaction collided with another: a lock wait
/// over `lock_timeout`, a deadlock, a serialization failure. (diesel-async gives no
/// SQLSTATE for most of these; PostgreSQL's English messages are matched.)
pub(crate) fn is_contention_message(message: &str) -> bool {
    ["lock timeout", "deadlock detected", "could not serialize access"].iter().any(|m| message.contains(m))
}

/// A serialization failure or a deadlock: running the transaction again may succeed.
fn is_contention(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        // 40P01 has no kind of its own in diesel-async (it maps to Unknown).
        DieselError::DatabaseError(_, info) => info.message().starts_with("deadlock detected"),
        _ => false,
    }
}
