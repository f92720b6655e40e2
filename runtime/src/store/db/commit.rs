//! The checked COMMIT: the check that refuses an aborted or ended transaction in the
//! COMMIT's own round trip, and what its failure means — read by the SQLSTATE the
//! server sent (see `sqlstate`), whatever language the server speaks.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::QueryResult;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager};

use super::conn::Conn;
use super::sqlstate::{
    is_connection_error, is_contention, INVALID_SQL_STATEMENT_NAME, INVALID_TEXT_REPRESENTATION,
    IN_FAILED_SQL_TRANSACTION,
};

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
///   maybe began another — the check fails casting [`ENDED_MARKER`] to `int` (22P02;
///   the `ELSE` is evaluated only then: the function is not constant);
/// - if the prepared check is gone (the handler ran `DISCARD ALL` or `DEALLOCATE`),
///   `EXECUTE` fails with 26000;
/// - otherwise COMMIT runs, and any error it answers is the server's refusal.
fn checked_commit(xid: i64) -> String {
    format!("EXECUTE idemq_check({xid}); COMMIT")
}

/// What the cast error (22P02) of [`checked_commit`] quotes, whatever the server's
/// language: idemq's own literal, the value that did not parse. Read together with
/// the code, so that a handler's own 22P02 (a bad number in its input) is not taken
/// for it.
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
pub(crate) async fn commit_checked(conn: &mut Conn, xid: i64) -> Result<(), CommitFailure> {
    let mark = conn.mark();
    let error = match conn.batch_execute(&checked_commit(xid)).await {
        Ok(()) => {
            // The COMMIT went out by hand, so diesel's bookkeeping must be told; a
            // connection it believes to be in a transaction is discarded by the pool.
            left_transaction(conn).map_err(CommitFailure::Unknown)?;
            return Ok(());
        }
        Err(error) if is_connection_error(&error) => return Err(CommitFailure::Unknown(error)),
        Err(error) => error,
    };
    // The one error the server answered this simple query with (it stops at the
    // first); none recorded only if the error was not the server's.
    let failure = match conn.sent_since(mark).last() {
        Some(INVALID_SQL_STATEMENT_NAME) => return Err(CommitFailure::CheckMissing),
        Some(INVALID_TEXT_REPRESENTATION) if quotes_ended_marker(&error) => CommitFailure::Ended,
        Some(IN_FAILED_SQL_TRANSACTION) => CommitFailure::Aborted,
        Some(code) => CommitFailure::Refused { contention: is_contention(code), error },
        None => CommitFailure::Refused {
            contention: matches!(
                error,
                DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _)
            ),
            error,
        },
    };
    // The aborted transaction, or the one the handler began after ending
    // ours, or nothing (COMMIT's failure ended it; ROLLBACK only warns).
    match AnsiTransactionManager::rollback_transaction(&mut **conn).await {
        // NotInTransaction: the handler ended it through diesel, which knows.
        Ok(()) | Err(DieselError::NotInTransaction) => Err(failure),
        Err(rollback_error) => Err(CommitFailure::Unknown(rollback_error)),
    }
}

/// Whether a 22P02 is the check's own: its message quotes [`ENDED_MARKER`] (the
/// value that did not parse, not translated).
fn quotes_ended_marker(error: &DieselError) -> bool {
    matches!(error, DieselError::DatabaseError(_, info) if info.message().contains(ENDED_MARKER))
}

/// Records in diesel's transaction manager that the top-level transaction ended.
fn left_transaction(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    use diesel::connection::TransactionDepthChange;
    AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_state()?
        .change_transaction_depth(TransactionDepthChange::DecreaseDepth)
}
