//! Stream offsets: the last offset of a stream a handler applied, kept in the
//! handler's transaction (see `engine::stream`), and the advisory lock that makes
//! one consumer per handler and stream the active one.

use diesel::sql_types::{BigInt, Integer, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use sha2::{Digest, Sha256};

/// The offset before the first: nothing applied yet.
pub const NO_OFFSET: i64 = -1;

#[derive(QueryableByName)]
struct Offset {
    #[diesel(sql_type = BigInt)]
    last_offset: i64,
}

/// The last offset of `stream` the handler `scope` applied ([`NO_OFFSET`] before
/// the first), its row made if missing.
pub(crate) async fn read_offset(
    conn: &mut AsyncPgConnection,
    scope: &str,
    stream: &str,
) -> diesel::QueryResult<i64> {
    let row: Offset = diesel::sql_query(
        "WITH made AS (INSERT INTO idemq_stream_offsets (handler, stream, last_offset) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING RETURNING last_offset) \
         SELECT last_offset FROM made UNION ALL \
         SELECT last_offset FROM idemq_stream_offsets WHERE handler = $1 AND stream = $2 LIMIT 1",
    )
    .bind::<Text, _>(scope)
    .bind::<Text, _>(stream)
    .bind::<BigInt, _>(NO_OFFSET)
    .get_result(conn)
    .await?;
    Ok(row.last_offset)
}

/// Moves the offset from `from` to `to` in the open transaction: `false` when it
/// is not at `from` any more (another consumer moved it: this one is fenced off).
pub(crate) async fn advance_offset(
    conn: &mut AsyncPgConnection,
    scope: &str,
    stream: &str,
    from: i64,
    to: i64,
) -> diesel::QueryResult<bool> {
    let moved = diesel::sql_query(
        "UPDATE idemq_stream_offsets SET last_offset = $4, updated_at = now() \
         WHERE handler = $1 AND stream = $2 AND last_offset = $3",
    )
    .bind::<Text, _>(scope)
    .bind::<Text, _>(stream)
    .bind::<BigInt, _>(from)
    .bind::<BigInt, _>(to)
    .execute(conn)
    .await?;
    Ok(moved == 1)
}

/// The key of the session-level advisory lock held by the active consumer of
/// `stream` for the handler `scope`: the first 8 bytes of a SHA-256 of both.
pub fn owner_lock(scope: &str, stream: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"idemq stream owner\0")
        .chain_update(scope)
        .chain_update([0])
        .chain_update(stream)
        .finalize();
    let mut bytes = [0_u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(bytes)
}

/// The answer of a `pg_try_advisory_lock`.
#[derive(QueryableByName)]
struct Locked {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    locked: bool,
}

/// Takes the advisory lock `key` if it is free: `true` once held (by this session,
/// until it ends).
pub(crate) async fn try_lock(conn: &mut AsyncPgConnection, key: i64) -> diesel::QueryResult<bool> {
    let row: Locked = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS locked")
        .bind::<BigInt, _>(key)
        .get_result(conn)
        .await?;
    Ok(row.locked)
}

/// The first key of the two-key advisory locks by which processes consuming several
/// streams with the handler `scope` count each other (each holds one, its second key
/// its session's backend pid, unique on the server): 31 bits of a SHA-256, so it
/// reads back from `pg_locks.classid` (an `oid`) unchanged.
pub fn share_group(scope: &str) -> i32 {
    let digest = Sha256::new().chain_update(b"idemq stream share\0").chain_update(scope).finalize();
    let mut bytes = [0_u8; 4];
    bytes.copy_from_slice(&digest[..4]);
    i32::from_be_bytes(bytes) & i32::MAX
}

/// Takes this session's member lock of `group` (its second key the backend pid):
/// `true` once held.
pub(crate) async fn try_lock_member(conn: &mut AsyncPgConnection, group: i32) -> diesel::QueryResult<bool> {
    let row: Locked = diesel::sql_query("SELECT pg_try_advisory_lock($1, pg_backend_pid()) AS locked")
        .bind::<Integer, _>(group)
        .get_result(conn)
        .await?;
    Ok(row.locked)
}

/// How many sessions hold a member lock of `group` in this database: the processes
/// sharing its streams, this one included.
pub async fn count_members(conn: &mut AsyncPgConnection, group: i32) -> diesel::QueryResult<i64> {
    #[derive(QueryableByName)]
    struct Members {
        #[diesel(sql_type = BigInt)]
        members: i64,
    }
    let row: Members = diesel::sql_query(
        "SELECT count(*) AS members FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND objsubid = 2 AND classid = $1::int8::oid \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind::<BigInt, _>(i64::from(group))
    .get_result(conn)
    .await?;
    Ok(row.members)
}

/// A handler's stored offset of a stream, as `status` shows it.
#[derive(QueryableByName)]
pub struct StoredOffset {
    /// The handler's scope (`<namespace>/<name>`, or its name).
    #[diesel(sql_type = Text)]
    pub handler: String,
    /// The last offset it applied ([`NO_OFFSET`] before the first).
    #[diesel(sql_type = BigInt)]
    pub last_offset: i64,
    /// When it last moved, in UTC, to the second.
    #[diesel(sql_type = Text)]
    pub updated: String,
}

/// Every handler's stored offset of `stream`, by scope; `None` when the table is not
/// there (no migrations yet).
pub async fn stored_offsets(
    conn: &mut AsyncPgConnection,
    stream: &str,
) -> diesel::QueryResult<Option<Vec<StoredOffset>>> {
    let there: bool = diesel::select(diesel::dsl::sql::<diesel::sql_types::Bool>(
        "to_regclass('idemq_stream_offsets') IS NOT NULL",
    ))
    .get_result(conn)
    .await?;
    if !there {
        return Ok(None);
    }
    diesel::sql_query(
        "SELECT handler, last_offset, \
         to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC' AS updated \
         FROM idemq_stream_offsets WHERE stream = $1 ORDER BY handler",
    )
    .bind::<Text, _>(stream)
    .load(conn)
    .await
    .map(Some)
}

/// The session holding a session-level advisory lock, as far as this role may see
/// it in `pg_stat_activity` (another role's sessions show only their pid).
#[derive(QueryableByName)]
pub struct LockHolder {
    /// Its server process id.
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// Its client's address and port, or `a Unix socket`.
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    pub client: Option<String>,
    /// When it connected, in UTC, to the second.
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    pub since: Option<String>,
    /// Its `application_name`, if it set one (`?application_name=` in the URL).
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    pub application: Option<String>,
}

/// Who holds the advisory lock `key` in this database, if anyone: for the owner of a
/// stream ([`owner_lock`]). A one-key lock shows in `pg_locks` as its high 32 bits
/// (`classid`), its low 32 bits (`objid`) and `objsubid` 1.
pub async fn lock_holder(conn: &mut AsyncPgConnection, key: i64) -> diesel::QueryResult<Option<LockHolder>> {
    let mut holders: Vec<LockHolder> = diesel::sql_query(
        "SELECT l.pid, \
         CASE WHEN a.client_addr IS NOT NULL THEN host(a.client_addr) || ':' || a.client_port \
              WHEN a.client_port = -1 THEN 'a Unix socket' END AS client, \
         to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC' AS since, \
         nullif(a.application_name, '') AS application \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
         AND l.classid = (($1 >> 32) & 4294967295)::int8::oid AND l.objid = ($1 & 4294967295)::int8::oid \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind::<BigInt, _>(key)
    .load(conn)
    .await?;
    Ok(holders.pop())
}
