//! Start marks (a redelivered message's handler starts, each committed on its own)
//! and copy records (the ids of retry and dead-letter copies the broker confirmed).

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::store::schema::{idemq_copies, idemq_started};

/// Counts a handler start of a redelivered message, committed on its own before the
/// handler runs (so it survives the crash it may cause); returns the starts so far,
/// this one included.
pub(crate) async fn mark_start(conn: &mut AsyncPgConnection, scope: &str, key: &str) -> QueryResult<i32> {
    diesel::insert_into(idemq_started::table)
        .values((idemq_started::handler.eq(scope), idemq_started::key.eq(key), idemq_started::starts.eq(1)))
        .on_conflict((idemq_started::handler, idemq_started::key))
        .do_update()
        .set((
            idemq_started::starts.eq(idemq_started::starts + 1),
            idemq_started::last_started_at.eq(diesel::dsl::now),
        ))
        .returning(idemq_started::starts)
        .get_result(conn)
        .await
}

/// Forgets the starts of a message that reached an outcome.
pub(crate) async fn clear_starts(conn: &mut AsyncPgConnection, scope: &str, key: &str) -> QueryResult<()> {
    diesel::delete(idemq_started::table.find((scope, key))).execute(conn).await.map(drop)
}

/// Whether the broker confirmed a copy with this id before.
pub(crate) async fn copy_recorded(conn: &mut AsyncPgConnection, copy_id: &str) -> QueryResult<bool> {
    diesel::select(diesel::dsl::exists(idemq_copies::table.find(copy_id))).get_result(conn).await
}

/// Records a copy the broker confirmed.
pub(crate) async fn record_copy(conn: &mut AsyncPgConnection, copy_id: &str) -> QueryResult<()> {
    diesel::insert_into(idemq_copies::table)
        .values(idemq_copies::copy_id.eq(copy_id))
        .on_conflict_do_nothing()
        .execute(conn)
        .await
        .map(drop)
}
