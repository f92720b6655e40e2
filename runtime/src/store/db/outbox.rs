//! The outbox table's statements: rows written in a handler's transaction, claimed,
//! deleted and postponed by the relay, counted for the backlog; and the `NOTIFY`
//! that wakes relays.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::fixed::Fixed;
use crate::base::outgoing::{Outgoing, When};
use crate::store::schema::idemq_outbox;

/// The `LISTEN`/`NOTIFY` channel relays wake on.
pub(crate) const CHANNEL: &str = "idemq_outbox";

/// Writes outbox rows (each with its message id set) in the caller's transaction:
/// one statement for any number (every column an array parameter), its text fixed,
/// so it is prepared once per connection. Returns what [`written`] needs: the rows'
/// ids, in their order — none if the server returned them in another order
/// (PostgreSQL returns an `INSERT … SELECT`'s rows as it inserts them; checked by
/// message id all the same) — and their headers as written.
pub(crate) async fn insert_outbox(conn: &mut AsyncPgConnection, rows: &[Outgoing]) -> QueryResult<Inserted> {
    #[derive(QueryableByName)]
    struct Returned {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        message_id: String,
    }
    if rows.is_empty() {
        return Ok(Inserted::default());
    }
    let ids: Vec<&str> = rows.iter().map(|row| row.message_id.as_deref().unwrap_or_default()).collect();
    let exchanges: Vec<&str> = rows.iter().map(|row| row.exchange.as_str()).collect();
    let routing_keys: Vec<&str> = rows.iter().map(|row| row.routing_key.as_str()).collect();
    let bodies: Vec<&[u8]> = rows.iter().map(|row| row.body.as_slice()).collect();
    let content_types: Vec<Option<&str>> = rows.iter().map(|row| row.content_type.as_deref()).collect();
    let correlation_ids: Vec<Option<&str>> = rows.iter().map(|row| row.correlation_id.as_deref()).collect();
    let message_types: Vec<Option<&str>> = rows.iter().map(|row| row.message_type.as_deref()).collect();
    let headers: Vec<Option<String>> = rows.iter().map(headers_text).collect();
    let mandatory: Vec<bool> = rows.iter().map(|row| row.mandatory).collect();
    let replies: Vec<bool> = rows.iter().map(|row| row.reply.is_some()).collect();
    // A reply's own window, from now (the transaction's start: about when its request
    // was consumed); NULL for events and for requests without an `expiration`.
    let windows: Vec<Option<i64>> = rows
        .iter()
        .map(|row| row.reply.and_then(|reply| reply.within).map(|within| millis(within, MAX_WINDOW)))
        .collect();
    // A scheduled row's due time: at a time (ms since the epoch) or after a delay
    // (ms from now); neither: now, as the column's default.
    let (due_at, due_after): (Vec<Option<i64>>, Vec<Option<i64>>) = rows
        .iter()
        .map(|row| match row.due {
            Some(When::At(at)) => (Some(epoch_millis(at)), None),
            Some(When::After(delay)) => (None, Some(millis(delay, MAX_WINDOW))),
            _ => (None, None),
        })
        .unzip();
    let insert = diesel::sql_query(
        "INSERT INTO idemq_outbox \
         (message_id, exchange, routing_key, body, content_type, correlation_id, headers, mandatory, reply, \
          expires_at, message_type, due_at, available_at) \
         SELECT m, e, r, b, c, k, h, y, p, now() + w * interval '1 millisecond', t, d, coalesce(d, now()) \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::text[], \
                     $8::bool[], $9::bool[], $10::bigint[], $11::text[], $12::bigint[], $13::bigint[]) \
              AS u(m, e, r, b, c, k, h, y, p, w, t, da, df), \
              LATERAL (SELECT coalesce(to_timestamp(da / 1000.0), now() + df * interval '1 millisecond') AS d) AS due \
         RETURNING id, message_id",
    )
    .bind::<Array<Text>, _>(ids)
    .bind::<Array<Text>, _>(exchanges)
    .bind::<Array<Text>, _>(routing_keys)
    .bind::<Array<Bytea>, _>(bodies)
    .bind::<Array<Nullable<Text>>, _>(content_types)
    .bind::<Array<Nullable<Text>>, _>(correlation_ids)
    .bind::<Array<Nullable<Text>>, _>(&headers)
    .bind::<Array<Bool>, _>(mandatory)
    .bind::<Array<Bool>, _>(replies)
    .bind::<Array<Nullable<BigInt>>, _>(windows)
    .bind::<Array<Nullable<Text>>, _>(message_types)
    .bind::<Array<Nullable<BigInt>>, _>(due_at)
    .bind::<Array<Nullable<BigInt>>, _>(due_after);
    let returned: Vec<Returned> = Fixed(insert).load(conn).await?;
    let in_order = returned.len() == rows.len()
        && returned
            .iter()
            .zip(rows)
            .all(|(written, row)| Some(written.message_id.as_str()) == row.message_id.as_deref());
    let ids = if in_order { returned.into_iter().map(|row| row.id).collect() } else { Vec::new() };
    Ok(Inserted { ids, headers })
}

/// What [`insert_outbox`] wrote, beside the rows themselves: their ids and headers.
#[derive(Debug, Default)]
pub(crate) struct Inserted {
    ids: Vec<i64>,
    headers: Vec<Option<String>>,
}

/// An outgoing message's headers as the outbox keeps them: JSON text, `NULL` for none.
fn headers_text(row: &Outgoing) -> Option<String> {
    (!row.headers.is_empty()).then(|| serde_json::to_string(&row.headers).unwrap_or_default())
}

/// The rows [`insert_outbox`] wrote, as a relay publishes them, given what it
/// returned — those due at once; a scheduled row is left to the relay's scan. None
/// when its ids are not those of `rows`.
pub(crate) fn written(rows: Vec<Outgoing>, inserted: Inserted) -> Vec<OutboxRow> {
    let Inserted { ids, headers } = inserted;
    if ids.len() != rows.len() || headers.len() != rows.len() {
        return Vec::new();
    }
    rows.into_iter()
        .zip(ids.into_iter().zip(headers))
        .filter(|(row, _)| row.due.is_none())
        .map(|(row, (id, headers))| OutboxRow {
            id,
            headers,
            message_id: row.message_id.unwrap_or_default(),
            exchange: row.exchange,
            routing_key: row.routing_key,
            body: row.body,
            content_type: row.content_type,
            correlation_id: row.correlation_id,
            message_type: row.message_type,
            mandatory: row.mandatory,
            attempts: 0,
            last_error: None,
            expired: false,
        })
        .collect()
}

/// `at` in milliseconds since the Unix epoch (before it: negative), within what
/// PostgreSQL's timestamps hold.
fn epoch_millis(at: std::time::SystemTime) -> i64 {
    let millis = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX).min(MAX_EPOCH_MILLIS);
    match at.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => millis(after),
        Err(before) => -millis(before.duration()),
    }
}

/// Year 10,000 in ms since the epoch: later times are bound as it.
const MAX_EPOCH_MILLIS: i64 = 253_402_300_800_000;

/// Deletes the outbox rows of `message_id` not yet published: whether there were
/// any. A row the relay is publishing right now is locked: this waits for its pass,
/// and finds it gone (published).
pub(crate) async fn cancel_outbox(conn: &mut AsyncPgConnection, message_id: &str) -> QueryResult<bool> {
    diesel::sql_query("DELETE FROM idemq_outbox WHERE message_id = $1")
        .bind::<Text, _>(message_id)
        .execute(conn)
        .await
        .map(|deleted| deleted > 0)
}

/// The longest window a duration is bound as (100 years, in ms): what PostgreSQL's
/// timestamps can be moved by without overflowing (`Duration::MAX` means "never").
const MAX_WINDOW: i64 = 100 * 365 * 86_400 * 1000;

/// `duration` in whole milliseconds, at most `max`.
fn millis(duration: Duration, max: i64) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX).min(max)
}

/// An outbox row as the relay publishes it.
#[derive(Debug, QueryableByName)]
pub(crate) struct OutboxRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) message_id: String,
    #[diesel(sql_type = Text)]
    pub(crate) exchange: String,
    #[diesel(sql_type = Text)]
    pub(crate) routing_key: String,
    #[diesel(sql_type = Bytea)]
    pub(crate) body: Vec<u8>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) content_type: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) correlation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) headers: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) message_type: Option<String>,
    #[diesel(sql_type = Bool)]
    pub(crate) mandatory: bool,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pub(crate) attempts: i32,
    /// Why its last publish failed.
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) last_error: Option<String>,
    /// A reply past its expiry: deleted, never published.
    #[diesel(sql_type = Bool)]
    pub(crate) expired: bool,
}

/// When a reply row expires: its request's own deadline or `created_at` plus the
/// reply TTL (`$ttl`, ms), whichever comes first (`least` skips a NULL); NULL for an
/// event, which never expires.
fn reply_expiry(ttl: &str) -> String {
    format!("CASE WHEN reply THEN least(expires_at, created_at + {ttl} * interval '1 millisecond') END")
}

/// Locks up to `limit` rows that are due, oldest first, skipping rows another
/// relay holds (in the caller's transaction: held until it ends). A reply older than
/// `reply_ttl`, or past its request's own deadline, comes back `expired`.
pub(crate) async fn claim_outbox(
    conn: &mut AsyncPgConnection,
    limit: i64,
    reply_ttl: Duration,
) -> QueryResult<Vec<OutboxRow>> {
    // The text is the same on every call (the TTL is a bind): cached.
    let claim = diesel::sql_query(format!(
        "SELECT id, message_id, exchange, routing_key, body, content_type, correlation_id, headers, message_type, \
                mandatory, attempts, last_error, coalesce({} <= now(), false) AS expired \
         FROM idemq_outbox WHERE available_at <= now() ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
        reply_expiry("$2")
    ))
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(millis(reply_ttl, MAX_WINDOW));
    Fixed(claim).load(conn).await
}

/// Deletes the rows of `ids` still in the outbox and due, in the caller's
/// transaction: the ids deleted. Until it ends they are held: a relay's claim skips
/// them, a delete of them waits. A lookup by primary key, its text fixed.
pub(crate) async fn take_outbox(conn: &mut AsyncPgConnection, ids: &[i64]) -> QueryResult<Vec<i64>> {
    #[derive(QueryableByName)]
    struct Taken {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }
    let take = diesel::sql_query(
        "DELETE FROM idemq_outbox WHERE id = ANY($1) AND available_at <= now() RETURNING id",
    )
    .bind::<Array<BigInt>, _>(ids);
    let taken: Vec<Taken> = Fixed(take).load(conn).await?;
    Ok(taken.into_iter().map(|row| row.id).collect())
}

/// Deletes rows whose messages were published.
pub(crate) async fn delete_outbox(conn: &mut AsyncPgConnection, ids: &[i64]) -> QueryResult<()> {
    if ids.is_empty() {
        return Ok(());
    }
    diesel::delete(idemq_outbox::table.filter(idemq_outbox::id.eq_any(ids))).execute(conn).await.map(drop)
}

/// Puts a row whose publish failed back for later, after `delay` — a reply no later
/// than when it expires (with `reply_ttl`), so it is deleted then, not a backoff later.
pub(crate) async fn postpone_outbox(
    conn: &mut AsyncPgConnection,
    id: i64,
    delay: Duration,
    error: &str,
    reply_ttl: Duration,
) -> QueryResult<()> {
    diesel::sql_query(format!(
        "UPDATE idemq_outbox SET attempts = attempts + 1, \
         available_at = least(now() + $2 * interval '1 millisecond', {}), last_error = $3 WHERE id = $1",
        reply_expiry("$4")
    ))
    .bind::<BigInt, _>(id)
    .bind::<BigInt, _>(millis(delay, MAX_WINDOW))
    .bind::<Text, _>(error)
    .bind::<BigInt, _>(millis(reply_ttl, MAX_WINDOW))
    .execute(conn)
    .await
    .map(drop)
}

/// Rows due in the outbox, waiting for the relay (a scheduled message not yet due
/// is no backlog).
pub(crate) async fn outbox_backlog(conn: &mut AsyncPgConnection) -> QueryResult<i64> {
    #[derive(diesel::QueryableByName)]
    struct Due {
        #[diesel(sql_type = BigInt)]
        rows: i64,
    }
    let due: Due = diesel::sql_query(format!("SELECT count(*) AS rows FROM idemq_outbox WHERE {DUE}"))
        .get_result(conn)
        .await?;
    Ok(due.rows)
}

/// When a row was due: its due time if scheduled, else when it was written.
#[cfg(feature = "metrics")]
const DUE_FROM: &str = "coalesce(due_at, created_at)";

/// A row is due (backlog, not a scheduled message still waiting).
const DUE: &str = "coalesce(due_at, created_at) <= now()";

/// Rows waiting in the outbox and the oldest one's age in whole seconds (0 when
/// there is none): the relay's lag, for `/readyz` and the metrics.
#[cfg(feature = "metrics")]
pub async fn outbox_lag(conn: &mut AsyncPgConnection) -> QueryResult<(i64, i64)> {
    #[derive(diesel::QueryableByName)]
    struct Lag {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        rows: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        oldest: i64,
    }
    let lag: Lag = diesel::sql_query(format!(
        "SELECT count(*) AS rows, \
             COALESCE(floor(EXTRACT(EPOCH FROM now() - min({DUE_FROM}))), 0)::int8 AS oldest \
             FROM idemq_outbox WHERE {DUE}"
    ))
    .get_result(conn)
    .await?;
    Ok((lag.rows, lag.oldest))
}

/// Wakes the relays listening on [`CHANNEL`] (outside any transaction).
pub(crate) async fn notify_relays(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute(&format!("NOTIFY {CHANNEL}")).await
}

#[cfg(test)]
mod tests {
    use super::{headers_text, written, Inserted};
    use crate::base::outgoing::{Outgoing, When};

    fn event(id: &str) -> Outgoing {
        Outgoing::bytes("", "events", b"{}".to_vec()).expect("short names").message_id(id)
    }

    #[test]
    fn the_rows_written_are_handed_over_with_their_ids_but_a_scheduled_one_is_left_to_a_scan() {
        let scheduled = event("b").deliver(When::After(std::time::Duration::from_secs(60)));
        let rows = vec![event("a"), scheduled, event("c").header("x-a", "1")];
        let inserted = Inserted { ids: vec![7, 8, 9], headers: rows.iter().map(headers_text).collect() };
        let rows = written(rows, inserted);
        let handed: Vec<(i64, &str)> = rows.iter().map(|row| (row.id, row.message_id.as_str())).collect();
        assert_eq!(handed, vec![(7, "a"), (9, "c")]);
        assert_eq!(rows[1].headers.as_deref(), Some(r#"{"x-a":"1"}"#), "the headers as written");
        let none = Inserted { ids: Vec::new(), headers: vec![None] };
        assert!(written(vec![event("a")], none).is_empty(), "ids not those of the rows: none");
    }
}
