//! Sharing a handler's streams (partitions) between processes, fairly, with
//! nothing but PostgreSQL advisory locks.
//!
//! Each process that consumes several streams with one handler holds a *member*
//! lock of that handler's group on a connection of its own, and counts the member
//! locks held (`pg_locks`): that is how many processes share the streams. Its fair
//! share is `ceil(streams / members)`:
//! - a process owning fewer tries the free streams' owner locks;
//! - a process owning more gives one up (at a batch boundary: it ends its
//!   subscription and releases the owner lock), and a process owning fewer takes it;
//! - a process that dies stops counting: the others' share grows and they take its
//!   streams as its owner locks go.
//!
//! This decides only *who works*; it is never what keeps a message once: the owner
//! lock and the offset's compare-and-set do that, whatever the share says.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::BrokerLink;
use crate::store::db;

/// How often the members are counted (and the member lock's connection checked).
const COUNT_EVERY: Duration = Duration::from_secs(1);

/// A handler's streams in this process, and its share of them.
#[derive(Debug)]
pub(crate) struct Share {
    scope: String,
    group: i32,
    streams: usize,
    owned: AtomicUsize,
    /// The members counted last (0 until the first count).
    members: watch::Sender<usize>,
}

impl Share {
    pub(crate) fn new(scope: &str, streams: usize) -> Self {
        Self {
            scope: scope.to_owned(),
            group: db::share_group(scope),
            streams,
            owned: AtomicUsize::new(0),
            members: watch::Sender::new(0),
        }
    }

    /// How many streams the handler consumes in this process.
    pub(super) fn streams(&self) -> usize {
        self.streams
    }

    /// The streams this process should own: `ceil(streams / members)`.
    fn fair(&self) -> usize {
        let members = (*self.members.borrow()).max(1);
        self.streams.div_ceil(members)
    }

    /// Waits for the first count of members (so a process starting beside others
    /// does not take every stream first and give them back after).
    pub(super) async fn counted(&self) {
        let mut members = self.members.subscribe();
        let _ = members.wait_for(|members| *members > 0).await;
    }

    /// Counts one more stream as owned if this process has room for it: `true`
    /// when it may try that stream's lock (and must call [`Self::released`] if it
    /// does not get it). Two of its streams never both take the last place.
    pub(super) fn reserve(&self) -> bool {
        let fair = self.fair();
        self.owned
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |owned| (owned < fair).then(|| owned + 1))
            .is_ok()
    }

    /// One stream fewer owned (or reserved).
    pub(super) fn released(&self) {
        self.owned.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether this process owns more than its share; if so, one stream is counted
    /// as given up at once (the caller releases it), so two of its streams never
    /// both give way for one surplus.
    pub(super) fn give_up_one(&self) -> bool {
        let fair = self.fair();
        self.owned
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |owned| (owned > fair).then(|| owned - 1))
            .is_ok()
    }

    /// Holds this process's member lock and counts the members, every second, until
    /// `stop`. A lost connection is made again (its lock with it); meanwhile the
    /// last count stands. While the broker is [lost](BrokerLink::is_lost) to this
    /// process the member lock is let go: a process that cannot consume must not
    /// count as one that shares the streams (the others' share would stay too small
    /// to take the streams it gave up).
    pub(crate) async fn keep(&self, url: &str, link: &BrokerLink, stop: CancellationToken) {
        let mut conn: Option<AsyncPgConnection> = None;
        loop {
            if link.is_lost() {
                if conn.take().is_some() {
                    crate::base::log::info!(scope = %self.scope, "the broker does not answer: this process no longer counts among those sharing the handler's streams");
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = link.reachable() => {}
                }
            }
            match self.count(url, &mut conn).await {
                Ok(members) => {
                    self.members.send_if_modified(|last| std::mem::replace(last, members) != members);
                }
                Err(reason) => {
                    conn = None;
                    crate::base::log::debug!(scope = %self.scope, %reason, "cannot count the processes sharing this handler's streams; trying again");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(COUNT_EVERY) => {}
            }
        }
    }

    async fn count(&self, url: &str, conn: &mut Option<AsyncPgConnection>) -> Result<usize, String> {
        let conn = match conn {
            Some(conn) => conn,
            None => {
                let mut fresh = db::connect(url).await.map_err(|err| err.report())?;
                if !db::try_lock_member(&mut fresh, self.group).await.map_err(|err| err.to_string())? {
                    return Err("the member lock is taken (a backend pid reused?)".into());
                }
                conn.insert(fresh)
            }
        };
        let members = db::count_members(conn, self.group).await.map_err(|err| err.to_string())?;
        Ok(usize::try_from(members).unwrap_or(1).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(streams: usize, members: usize, owned: usize) -> Share {
        let share = Share::new("h", streams);
        share.members.send_replace(members);
        share.owned.store(owned, Ordering::SeqCst);
        share
    }

    #[test]
    fn a_process_alone_takes_every_stream() {
        let alone = share(4, 1, 3);
        assert!(alone.reserve());
        assert!(!alone.reserve(), "four of four");
        assert!(!alone.give_up_one());
    }

    #[test]
    fn two_processes_split_two_streams_one_each() {
        let first = share(2, 2, 2);
        assert!(first.give_up_one(), "the surplus one is given up");
        assert!(!first.give_up_one(), "and only that one");
        assert!(!first.reserve());
        let second = share(2, 2, 0);
        assert!(second.reserve());
        assert!(!second.reserve(), "one is its share");
    }

    #[test]
    fn an_odd_stream_goes_to_whoever_has_room() {
        // 3 streams, 2 processes: a share of 2, so 2 + 1.
        assert!(!share(3, 2, 2).give_up_one());
        assert!(share(3, 2, 1).reserve());
        assert!(share(3, 3, 2).give_up_one());
    }

    #[test]
    fn a_reservation_that_got_no_lock_is_given_back() {
        let second = share(2, 2, 0);
        assert!(second.reserve());
        second.released();
        assert!(second.reserve());
    }

    #[test]
    fn before_the_first_count_a_process_counts_itself_alone() {
        assert!(share(2, 0, 1).reserve());
    }
}
