//! What the console reads of the database: the outbox, the dedup rows, replication,
//! and the audit list it writes. Each figure is a value or why it could not be read.

use std::time::Duration;

use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq_core::__private::sibling::db;

use crate::common::connect_db_limited;

/// A figure: a value, or why it could not be read.
pub(super) type Figure<T> = Result<T, String>;

/// How long a statement may run before the page says "unknown" instead.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The database page's figures.
pub(super) struct Database {
    /// Rows due in the outbox, and how long the oldest has been due, in seconds.
    pub(super) outbox: Figure<(i64, Option<i64>)>,
    /// Scheduled messages not yet due, and in how many seconds the next is.
    pub(super) scheduled: Figure<(i64, Option<i64>)>,
    /// Outbox rows that failed to publish at least once, and the last error seen.
    pub(super) outbox_failing: Figure<(i64, Option<String>)>,
    /// Dedup rows, and the oldest one's age in seconds.
    pub(super) dedup: Figure<(i64, Option<i64>)>,
    /// The replication state in words, and the replication check's concerns.
    pub(super) replication: Figure<(String, Vec<String>)>,
    /// Each standby: name, state, sync state, replay lag.
    pub(super) standbys: Figure<Vec<Standby>>,
}

#[derive(QueryableByName)]
struct CountAge {
    #[diesel(sql_type = BigInt)]
    count: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    age: Option<i64>,
}

#[derive(QueryableByName)]
struct Failing {
    #[diesel(sql_type = BigInt)]
    count: i64,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

/// A standby as `pg_stat_replication` shows it.
#[derive(QueryableByName, Debug)]
pub(super) struct Standby {
    #[diesel(sql_type = Text)]
    pub(super) name: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) state: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) sync_state: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(super) replay_lag: Option<String>,
}

/// Reads the database page's figures.
pub(super) async fn database(url: &str) -> Database {
    let mut conn = match connect(url).await {
        Ok(conn) => conn,
        Err(why) => {
            return Database {
                outbox: Err(why.clone()),
                scheduled: Err(why.clone()),
                outbox_failing: Err(why.clone()),
                dedup: Err(why.clone()),
                replication: Err(why.clone()),
                standbys: Err(why),
            }
        }
    };
    let count_age = |table: &str, column: &str| {
        format!(
            "SELECT count(*) AS count, \
                    extract(epoch FROM now() - min({column}))::bigint AS age FROM {table}"
        )
    };
    // What `/readyz` and the metrics say of it: from when each row was due.
    let outbox = db::outbox_lag(&mut conn).await.map_err(|err| err.to_string());
    let scheduled = read::<CountAge>(
        &mut conn,
        "SELECT count(*) AS count, extract(epoch FROM min(due_at) - now())::bigint AS age \
           FROM idemq_outbox WHERE due_at > now()",
    )
    .await;
    let failing = read::<Failing>(
        &mut conn,
        "SELECT count(*) AS count, \
                (SELECT last_error FROM idemq_outbox WHERE last_error IS NOT NULL ORDER BY id DESC LIMIT 1) \
                  AS last_error \
           FROM idemq_outbox WHERE attempts > 0",
    )
    .await;
    let dedup = read::<CountAge>(&mut conn, &count_age("idemq_dedup", "processed_at")).await;
    let replication = db::replication(&mut conn).await.map_err(|err| err.to_string());
    let standbys = diesel::sql_query(
        "SELECT coalesce(application_name, '') AS name, state, sync_state, replay_lag::text AS replay_lag \
           FROM pg_stat_replication ORDER BY 1",
    )
    .load::<Standby>(&mut conn)
    .await
    .map_err(|err| err.to_string());
    Database {
        outbox: outbox.map(|(rows, oldest)| (rows, (rows > 0).then_some(oldest))),
        scheduled: scheduled.map(|row| (row.count, row.age)),
        outbox_failing: failing.map(|row| (row.count, row.last_error)),
        dedup: dedup.map(|row| (row.count, row.age)),
        replication,
        standbys,
    }
}

async fn connect(url: &str) -> Figure<AsyncPgConnection> {
    connect_db_limited(url, STATEMENT_TIMEOUT).await
}

async fn read<T: QueryableByName<diesel::pg::Pg> + Send + 'static>(
    conn: &mut AsyncPgConnection,
    sql: &str,
) -> Figure<T> {
    diesel::sql_query(sql).get_result::<T>(conn).await.map_err(|err| err.to_string())
}

/// One row of the audit list.
#[derive(QueryableByName, Debug)]
pub(super) struct AuditRow {
    #[diesel(sql_type = Text)]
    pub(super) at: String,
    #[diesel(sql_type = Text)]
    pub(super) who: String,
    #[diesel(sql_type = Text)]
    pub(super) action: String,
    #[diesel(sql_type = Text)]
    pub(super) target: String,
    #[diesel(sql_type = Text)]
    pub(super) result: String,
}

/// The last `limit` actions, newest first.
pub(super) async fn audit(url: &str, limit: i64) -> Figure<Vec<AuditRow>> {
    let mut conn = connect(url).await?;
    diesel::sql_query(
        "SELECT to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || ' UTC' AS at, who, action, target, result \
           FROM idemq_console_audit ORDER BY id DESC LIMIT $1",
    )
    .bind::<BigInt, _>(limit)
    .load(&mut conn)
    .await
    .map_err(|err| err.to_string())
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Records that `who` starts `action` on `target`: the row's id, to complete
/// with [`finish`]. An action whose row cannot be written does not run.
pub(super) async fn start(url: &str, who: &str, action: &str, target: &str) -> Figure<i64> {
    let mut conn = connect(url).await?;
    let row: Id = diesel::sql_query(
        "INSERT INTO idemq_console_audit (who, action, target, result) VALUES ($1, $2, $3, 'started') RETURNING id",
    )
    .bind::<Text, _>(who)
    .bind::<Text, _>(action)
    .bind::<Text, _>(target)
    .get_result(&mut conn)
    .await
    .map_err(|err| match err.to_string() {
        why if why.contains("does not exist") => {
            format!("{why}: the audit table is missing — run `migrate` (or `run`, which migrates) first")
        }
        why if why.contains("permission denied") => {
            format!("{why}: the console's database role needs INSERT, UPDATE and SELECT on idemq_console_audit")
        }
        why => why,
    })?;
    Ok(row.id)
}

/// Completes the audit row `id` with what came of the action.
pub(super) async fn finish(url: &str, id: i64, result: &str) -> Figure<()> {
    let mut conn = connect(url).await?;
    diesel::sql_query("UPDATE idemq_console_audit SET result = $2 WHERE id = $1")
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(result)
        .execute(&mut conn)
        .await
        .map(drop)
        .map_err(|err| err.to_string())
}
