//! Whether a COMMIT the server acknowledges survives losing the server: the
//! replication check made at start-up.
//!
//! idemq acks a delivery only after its COMMIT returned. That is exactly-once as
//! long as an acknowledged COMMIT is never lost. It is lost
//! - with `synchronous_commit = off`: the server acknowledges before its WAL is on
//!   disk, so a crash of the server loses the last commits;
//! - with standbys but **asynchronous** replication (no `synchronous_standby_names`,
//!   or `synchronous_commit = local`): the primary acknowledges before any standby
//!   has the commit, so a failover to a standby loses what it had not received —
//!   the effect and its dedup row gone, the message already acked: lost.
//!
//! With a synchronous standby (`synchronous_standby_names` naming connected
//! standbys, `synchronous_commit` `on`, `remote_write` or `remote_apply`) a COMMIT
//! returns only once a standby has it, and a promoted standby holds every COMMIT
//! that was acknowledged. The check reads `pg_is_in_recovery()`, the number of
//! standbys streaming (`pg_stat_replication`: every role sees the rows, their
//! `sync_state` only with `pg_read_all_stats`), and the two settings as this
//! connection's session has them (per role and database settings included), and says
//! what it found ([`Replication::concerns`]); [`ReplicationCheck`] says what the
//! runtime does about it.

use diesel::sql_types::{BigInt, Bool, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

/// What the runtime does at start-up when acknowledged COMMITs could be lost (see
/// [`RuntimeBuilder::replication_check`](crate::RuntimeBuilder::replication_check)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ReplicationCheck {
    /// Log a warning that says what could be lost and how to set the server (the
    /// default).
    #[default]
    Warn,
    /// Refuse to start ([`Error::Replication`](crate::Error::Replication)).
    Refuse,
    /// Check nothing: the risk is known and accepted (or the database's durability
    /// is not visible from SQL, as with some managed services).
    Off,
}

impl ReplicationCheck {
    /// `warn`, `refuse` or `off`, as the CLI takes it.
    ///
    /// # Errors
    /// Another word, with the three it takes.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "warn" => Ok(Self::Warn),
            "refuse" => Ok(Self::Refuse),
            "off" => Ok(Self::Off),
            _ => Err(format!("`{text}` is not a replication check: write warn, refuse or off")),
        }
    }
}

/// The server's replication state, as one connection sees it.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub(crate) struct Replication {
    /// The server is a standby (read-only).
    #[diesel(sql_type = Bool)]
    pub(crate) in_recovery: bool,
    /// Standbys streaming from it.
    #[diesel(sql_type = BigInt)]
    pub(crate) standbys: i64,
    /// Of them, the synchronous ones (`sync` or `quorum`); `None` when this role
    /// may not see `sync_state` (it needs `pg_read_all_stats`).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) synchronous: Option<i64>,
    /// `synchronous_standby_names`.
    #[diesel(sql_type = Text)]
    pub(crate) standby_names: String,
    /// `synchronous_commit`, as this session has it.
    #[diesel(sql_type = Text)]
    pub(crate) synchronous_commit: String,
}

/// Reads the replication state on `conn`.
pub(crate) async fn read(conn: &mut AsyncPgConnection) -> diesel::QueryResult<Replication> {
    diesel::sql_query(
        "SELECT pg_is_in_recovery() AS in_recovery, \
                (SELECT count(*) FROM pg_stat_replication) AS standbys, \
                (SELECT CASE WHEN bool_or(sync_state IS NULL) THEN NULL \
                             ELSE count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) END \
                   FROM pg_stat_replication) AS synchronous, \
                current_setting('synchronous_standby_names') AS standby_names, \
                current_setting('synchronous_commit') AS synchronous_commit",
    )
    .get_result(conn)
    .await
}

impl Replication {
    /// What could lose an acknowledged COMMIT, or make COMMITs wait, each said with
    /// its fix; empty when nothing could.
    pub(crate) fn concerns(&self) -> Vec<String> {
        let mut concerns = Vec::new();
        let commit = self.synchronous_commit.to_ascii_lowercase();
        if commit == "off" {
            concerns.push(
                "synchronous_commit is off: the server acknowledges a COMMIT before its WAL is on disk, so a \
                 crash of the server loses commits whose messages idemq has already acked; set \
                 synchronous_commit = on (or remote_write, remote_apply) for idemq's role"
                    .to_owned(),
            );
        }
        if self.in_recovery {
            concerns.push(
                "the server is a standby (in recovery, read-only): every transaction will fail until it is \
                 promoted; point DATABASE_URL at the primary, or list every host with \
                 target_session_attrs=read-write"
                    .to_owned(),
            );
        }
        let standby_names = self.standby_names.trim();
        if self.standbys > 0 && (standby_names.is_empty() || commit == "local") {
            let why = if standby_names.is_empty() {
                "synchronous_standby_names is empty".to_owned()
            } else {
                "synchronous_commit is local".to_owned()
            };
            concerns.push(format!(
                "{} standby(s) replicate this server asynchronously ({why}): a COMMIT is acknowledged before any \
                 standby has it, so a failover to a standby loses the commits it had not received — their \
                 messages already acked by idemq, lost; set synchronous_standby_names (e.g. 'ANY 1 (standby1, \
                 standby2)') and synchronous_commit = on on the primary (see docs/high-availability.md, *Database high \
                 availability*)",
                self.standbys
            ));
        }
        if !standby_names.is_empty() && commit != "local" && commit != "off" && self.synchronous == Some(0) {
            concerns.push(format!(
                "synchronous_standby_names is '{standby_names}' but no synchronous standby is connected: every \
                 COMMIT waits until one is; start the standby, or correct the names"
            ));
        }
        concerns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(standbys: i64, synchronous: Option<i64>, names: &str, commit: &str) -> Replication {
        Replication {
            in_recovery: false,
            standbys,
            synchronous,
            standby_names: names.to_owned(),
            synchronous_commit: commit.to_owned(),
        }
    }

    #[test]
    fn a_server_alone_or_replicated_synchronously_gives_no_concern() {
        assert!(state(0, Some(0), "", "on").concerns().is_empty(), "alone");
        assert!(state(1, Some(1), "standby1", "on").concerns().is_empty());
        assert!(state(2, Some(1), "ANY 1 (s1, s2)", "remote_apply").concerns().is_empty());
        assert!(state(1, None, "standby1", "remote_write").concerns().is_empty(), "sync_state hidden");
    }

    #[test]
    fn asynchronous_standbys_and_commits_off_are_named_with_their_fix() {
        let concerns = state(1, Some(0), "", "on").concerns();
        assert_eq!(concerns.len(), 1, "{concerns:?}");
        assert!(concerns[0].contains("asynchronously") && concerns[0].contains("synchronous_standby_names"));
        let local = state(1, Some(1), "standby1", "local").concerns();
        assert!(local[0].contains("synchronous_commit is local"), "{local:?}");
        let off = state(0, None, "", "off").concerns();
        assert!(off[0].contains("synchronous_commit is off"), "{off:?}");
    }

    #[test]
    fn named_standbys_that_are_not_connected_make_commits_wait() {
        let concerns = state(0, Some(0), "standby1", "on").concerns();
        assert!(concerns[0].contains("no synchronous standby is connected"), "{concerns:?}");
    }

    #[test]
    fn the_check_reads_what_people_write() {
        assert_eq!(ReplicationCheck::parse("Refuse"), Ok(ReplicationCheck::Refuse));
        assert_eq!(ReplicationCheck::parse(" off "), Ok(ReplicationCheck::Off));
        assert!(ReplicationCheck::parse("strict").unwrap_err().contains("warn, refuse or off"));
    }
}
