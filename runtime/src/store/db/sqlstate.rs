//! How a failed statement's error is read, in one place: a lost connection by
//! diesel's error kinds; everything else by the SQLSTATE the server sent, read off
//! the wire (see [`crate::tls::postgres::wire`]) — never by the message. The message
//! is in the server's language (`lc_messages`: "Verklemmung (Deadlock) entdeckt"),
//! and a handler's own error may say anything ("deadlock detected" included)
//! without the server having said it. diesel-async keeps the message and drops the
//! code: most codes idemq acts on (40P01, 55P03, 25P02, 26000) come out of it as
//! `DatabaseErrorKind::Unknown`.

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use super::conn::Conn;
pub(crate) use crate::tls::postgres::wire::{Mark, Sent, SqlState};

/// `serialization_failure`: a serializable (or repeatable read) transaction
/// collided with another.
pub(crate) const SERIALIZATION_FAILURE: SqlState = SqlState::new(b"40001");
/// `deadlock_detected`: this transaction was the deadlock's victim.
pub(crate) const DEADLOCK_DETECTED: SqlState = SqlState::new(b"40P01");
/// `lock_not_available`: a lock wait outlasted `lock_timeout` (or `NOWAIT`).
pub(crate) const LOCK_NOT_AVAILABLE: SqlState = SqlState::new(b"55P03");
/// `in_failed_sql_transaction`: a statement in a transaction that an earlier
/// failed statement aborted.
pub(crate) const IN_FAILED_SQL_TRANSACTION: SqlState = SqlState::new(b"25P02");
/// `invalid_sql_statement_name`: no prepared statement of that name.
pub(crate) const INVALID_SQL_STATEMENT_NAME: SqlState = SqlState::new(b"26000");
/// `invalid_text_representation`: a cast of text that does not parse.
pub(crate) const INVALID_TEXT_REPRESENTATION: SqlState = SqlState::new(b"22P02");
/// `read_only_sql_transaction`: a write refused by a read-only server.
pub(crate) const READ_ONLY_SQL_TRANSACTION: SqlState = SqlState::new(b"25006");

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

/// The server is read-only (a standby, `default_transaction_read_only`): 25006,
/// which diesel-async does give a kind of its own.
pub(crate) fn is_read_only(error: &DieselError) -> bool {
    matches!(error, DieselError::DatabaseError(DatabaseErrorKind::ReadOnlyTransaction, _))
}

/// A code that says the transaction collided with another and was rolled back for
/// it: a serialization failure, a deadlock, a lock wait over `lock_timeout` —
/// running it again may succeed.
pub(crate) fn is_contention(code: SqlState) -> bool {
    [SERIALIZATION_FAILURE, DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE].contains(&code)
}

/// What the statements behind `sent` failed with: the latest error that is not
/// 25P02 (each statement after a failed one in its transaction only echoes that
/// failure with 25P02).
pub(crate) fn cause(sent: &Sent) -> Option<SqlState> {
    sent.iter().rev().find(|code| *code != IN_FAILED_SQL_TRANSACTION)
}

/// Whether what ran on `conn` since `mark` failed on a read-only server (a standby,
/// or one being promoted): the server's word, as for [`contended_since`].
pub(crate) fn read_only_since(conn: &Conn, mark: Mark) -> bool {
    cause(&conn.sent_since(mark)) == Some(READ_ONLY_SQL_TRANSACTION)
}

/// Whether what ran on `conn` since `mark` failed for contention: the server's own
/// word ([`cause`] is one of [`is_contention`]'s codes) — whatever a handler's error
/// says, and whether or not it kept the driver's error.
pub(crate) fn contended_since(conn: &Conn, mark: Mark) -> bool {
    cause(&conn.sent_since(mark)).is_some_and(is_contention)
}
