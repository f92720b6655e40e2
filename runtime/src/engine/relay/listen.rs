//! Wake-ups: a runtime tells relays that rows were committed ([`OutboxSignal`]: its
//! own relay in-process — handing it the rows themselves where it can ([`Wake`]) —
//! others by a throttled `NOTIFY`), and a relay hears the `NOTIFY`s on a dedicated
//! `LISTEN` connection ([`listen`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::store::db::{self, OutboxRow, CHANNEL};

use super::error::RelayError;
use super::NOTIFY_INTERVAL;

/// What wakes a runtime's own relay: rows may be due anywhere in the outbox (`scan`:
/// its next pass claims what is due, walking the table), or rows were committed in
/// this process and handed over as they were written ([`Wake::feed`]: the next pass
/// deletes them by id in its transaction and publishes them from memory). A pass of handed-over rows
/// walks none of the entries the relay's deletes leave behind in the table's index
/// (a churned outbox: 14 ms for a claim of 256 rows through 200,000 of them,
/// BENCHMARKS.md), nor the rows other passes hold locked, and reads no body back.
#[derive(Default)]
pub(crate) struct Wake {
    /// Rows may be due: claim them.
    pub(crate) scan: Notify,
    /// Rows handed over, committed, not yet taken by a pass.
    fed: Mutex<Fed>,
    /// Rows were handed over.
    pub(crate) fed_arrived: Notify,
}

/// Rows handed over, oldest first, and the bytes of their bodies.
#[derive(Default)]
struct Fed {
    rows: VecDeque<OutboxRow>,
    bytes: usize,
}

/// The most rows a relay holds handed over, and the most bytes of their bodies;
/// past either, rows are left to a scan. 4,096 rows are almost three passes' worth
/// beyond the three in flight; 16,384 held 3–4 MiB more at the same rate on the
/// bench's backlog (BENCHMARKS.md, *Rows handed to the relay*).
pub(crate) const MOST_FED: usize = 4_096;
pub(crate) const MOST_FED_BYTES: usize = 16 << 20;

impl Wake {
    fn fed(&self) -> std::sync::MutexGuard<'_, Fed> {
        self.fed.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands over rows just committed; those past [`MOST_FED`] or
    /// [`MOST_FED_BYTES`] are left to a scan.
    fn feed(&self, rows: Vec<OutboxRow>) {
        let mut left = false;
        {
            let mut fed = self.fed();
            for row in rows {
                if fed.rows.len() >= MOST_FED || fed.bytes + row.body.len() > MOST_FED_BYTES {
                    left = true;
                    break;
                }
                fed.bytes += row.body.len();
                fed.rows.push_back(row);
            }
        }
        self.fed_arrived.notify_one();
        if left {
            self.scan.notify_one();
        }
    }

    /// Takes up to `most` rows handed over, oldest first.
    pub(crate) fn take_fed(&self, most: usize) -> Vec<OutboxRow> {
        let mut fed = self.fed();
        let n = most.min(fed.rows.len());
        let taken: Vec<OutboxRow> = fed.rows.drain(..n).collect();
        fed.bytes -= taken.iter().map(|row| row.body.len()).sum::<usize>();
        taken
    }

    /// Whether rows are handed over.
    pub(crate) fn has_fed(&self) -> bool {
        !self.fed().rows.is_empty()
    }
}

/// How a runtime tells relays that rows were committed.
pub(crate) struct OutboxSignal {
    /// Its own relay's wake-up, if it runs one.
    pub(crate) wake: Option<Arc<Wake>>,
    /// Set after a commit that wrote rows; sent as one `NOTIFY` per interval when
    /// there is no relay in-process.
    pending: AtomicBool,
}

impl OutboxSignal {
    pub(crate) fn new(wake: Option<Arc<Wake>>) -> Self {
        Self { wake, pending: AtomicBool::new(false) }
    }

    /// Rows were committed.
    pub(crate) fn committed(&self) {
        match &self.wake {
            Some(wake) => wake.scan.notify_one(),
            None => self.pending.store(true, Ordering::Relaxed),
        }
    }

    /// `rows` were committed, each as written (with its id): handed to the runtime's
    /// own relay, if it runs one.
    pub(crate) fn committed_rows(&self, rows: Vec<OutboxRow>) {
        match &self.wake {
            Some(wake) => wake.feed(rows),
            None => self.pending.store(true, Ordering::Relaxed),
        }
    }

    /// Sends the pending `NOTIFY`s (at most one per [`NOTIFY_INTERVAL`]) until `stop`.
    pub(crate) async fn notify_elsewhere(&self, pool: db::Pool, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(NOTIFY_INTERVAL) => {}
                () = stop.cancelled() => return,
            }
            if self.pending.swap(false, Ordering::Relaxed) {
                let notified = async {
                    let mut conn = pool.get().await.map_err(RelayError::Pool)?;
                    db::notify_relays(&mut conn).await.map_err(RelayError::database("send NOTIFY"))
                };
                if let Err(error) = notified.await {
                    // The relays poll as well: a lost wake-up only delays.
                    crate::base::log::debug!(error = %error.report(), "could not notify the outbox relays");
                }
            }
        }
    }
}

/// Forwards `NOTIFY idemq_outbox` to `wake`, on a dedicated connection (never a
/// pooled one: a pool would hand the listening session to a handler), reconnecting
/// with backoff. Polling covers the gaps.
pub(super) async fn listen(database_url: String, wake: Arc<Wake>, stop: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        tokio::select! {
            result = forward(&database_url, &wake.scan) => {
                if let Err(error) = result {
                    crate::base::log::debug!(error = %error.report(), "outbox relay: LISTEN connection lost; polling meanwhile");
                }
            }
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = backoff.wait() => {}
            () = stop.cancelled() => return,
        }
    }
}

/// One `LISTEN` connection's life: connects, listens and wakes `wake` per
/// notification until the connection fails (never `Ok`).
async fn forward(database_url: &str, wake: &Notify) -> Result<(), RelayError> {
    let mut listener =
        db::Listener::start(database_url, CHANNEL).await.map_err(RelayError::DatabaseConnect)?;
    while listener.next().await.is_some() {
        wake.notify_one();
    }
    Err(RelayError::NotificationsEnded)
}

#[cfg(test)]
mod tests {
    use super::{OutboxRow, Wake, MOST_FED, MOST_FED_BYTES};

    fn row(id: i64) -> OutboxRow {
        sized(id, 0)
    }

    fn sized(id: i64, bytes: usize) -> OutboxRow {
        OutboxRow {
            id,
            message_id: format!("m{id}"),
            exchange: String::new(),
            routing_key: "events".into(),
            body: vec![0; bytes],
            content_type: None,
            correlation_id: None,
            headers: None,
            message_type: None,
            mandatory: true,
            attempts: 0,
            last_error: None,
            expired: false,
        }
    }

    #[tokio::test]
    async fn rows_handed_over_past_the_most_are_left_to_a_scan() {
        let wake = Wake::default();
        wake.feed((0..10).map(row).collect());
        assert!(wake.has_fed());
        let first: Vec<i64> = wake.take_fed(4).iter().map(|row| row.id).collect();
        assert_eq!(first, vec![0, 1, 2, 3], "oldest first, at most as many as asked");
        // No scan was asked for: the rows fit.
        let scan = wake.scan.notified();
        tokio::pin!(scan);
        assert!(!scan.as_mut().enable(), "no wake-up to scan while the rows fit");
        let most = i64::try_from(MOST_FED).expect("fits");
        wake.feed((10..10 + most).map(row).collect());
        assert!(scan.as_mut().enable(), "rows past the most: a wake-up to scan");
        let held = wake.take_fed(usize::MAX);
        assert_eq!(held.len(), MOST_FED, "never more than the most");
        assert_eq!(held.first().map(|row| row.id), Some(4));
        assert!(!wake.has_fed());
    }

    #[tokio::test]
    async fn rows_handed_over_past_the_most_bytes_are_left_to_a_scan() {
        let wake = Wake::default();
        let scan = wake.scan.notified();
        tokio::pin!(scan);
        let mib = 1 << 20;
        wake.feed((0..20).map(|id| sized(id, mib)).collect());
        assert!(scan.as_mut().enable(), "past the most bytes: a wake-up to scan");
        let held = wake.take_fed(usize::MAX);
        assert_eq!(held.len(), MOST_FED_BYTES / mib, "only what fits");
        wake.feed(vec![sized(99, mib)]);
        assert_eq!(wake.take_fed(1).len(), 1, "taken rows free their bytes");
    }
}
