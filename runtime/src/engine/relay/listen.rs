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
    /// A pass took rows handed over ([`Wake::keep_pace`] waits for it).
    taken: Notify,
}

/// Rows handed over, oldest first, the bytes of their bodies, and when a pass last
/// took some.
#[derive(Default)]
struct Fed {
    rows: VecDeque<OutboxRow>,
    bytes: usize,
    last_taken: Option<tokio::time::Instant>,
}

/// How many rows handed over a relay may hold before the batches that write them
/// wait for it ([`Wake::keep_pace`]): two passes' worth beyond the three in flight.
pub(crate) const LAG: usize = 1_024;

/// The longest a batch waits for its relay to keep pace.
pub(crate) const KEEP_PACE_AT_MOST: Duration = Duration::from_millis(100);

/// A relay that took no rows handed over for this long is stalled (the broker is
/// unreachable, say): batches do not wait for it, and its rows wait in the table.
pub(crate) const STALLED: Duration = Duration::from_millis(500);

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
        let taken: Vec<OutboxRow> = {
            let mut fed = self.fed();
            let n = most.min(fed.rows.len());
            let taken: Vec<OutboxRow> = fed.rows.drain(..n).collect();
            fed.bytes -= taken.iter().map(|row| row.body.len()).sum::<usize>();
            if n > 0 {
                fed.last_taken = Some(tokio::time::Instant::now());
            }
            taken
        };
        if !taken.is_empty() {
            self.taken.notify_waiters();
        }
        taken
    }

    /// Waits while the relay is behind — it holds more than [`LAG`] rows handed over
    /// and is taking them — for at most [`KEEP_PACE_AT_MOST`]: a batch that writes
    /// outbox rows starts once the relay has caught up a pass.
    ///
    /// On a backlog the consumers would otherwise commit twice as fast as the relay
    /// publishes, which sends the rest after the last ack: 0.5–0.9 s on the bench's
    /// 20,000 payments, against 0.2 for a hand-written loop that publishes each batch
    /// before it takes more. Publishing is bound by the broker's confirms, not the
    /// CPU, so the consumers' wait costs less than that tail. A relay that took
    /// nothing for [`STALLED`] is not waited for: consuming never depends on the
    /// broker accepting the events, only their publishing does.
    pub(crate) async fn keep_pace(&self) {
        let deadline = tokio::time::Instant::now() + KEEP_PACE_AT_MOST;
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            // Registered before the rows are counted: a take in between still wakes it.
            taken.as_mut().enable();
            {
                let fed = self.fed();
                let taking = fed.last_taken.is_some_and(|at| at.elapsed() < STALLED);
                if fed.rows.len() <= LAG || !taking {
                    return;
                }
            }
            if tokio::time::timeout_at(deadline, taken).await.is_err() {
                return;
            }
        }
    }

    /// Drops the rows of `claimed` from those handed over: a scan claimed them (it
    /// walks the table in id order, and under a lag the oldest due rows are the ones
    /// handed over), so it publishes them, and a pass of them would only wait on the
    /// claim's locks to find them gone.
    pub(crate) fn forget(&self, claimed: &std::collections::HashSet<i64>) {
        if claimed.is_empty() {
            return;
        }
        let mut fed = self.fed();
        let mut dropped = 0;
        fed.rows.retain(|row| {
            let keep = !claimed.contains(&row.id);
            if !keep {
                dropped += row.body.len();
            }
            keep
        });
        fed.bytes -= dropped;
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

    /// Waits while the runtime's own relay is behind ([`Wake::keep_pace`]).
    pub(crate) async fn keep_pace(&self) {
        if let Some(wake) = &self.wake {
            wake.keep_pace().await;
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
    use std::time::Duration;

    use super::{OutboxRow, Wake, KEEP_PACE_AT_MOST, LAG, MOST_FED, MOST_FED_BYTES, STALLED};

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

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_while_the_relay_is_behind_until_a_pass_takes_rows() {
        let wake = std::sync::Arc::new(Wake::default());
        let lag = i64::try_from(LAG).expect("fits");
        wake.feed((0..lag).map(row).collect());
        let start = tokio::time::Instant::now();
        wake.keep_pace().await;
        assert_eq!(start.elapsed(), Duration::ZERO, "not behind: no wait");
        wake.feed(vec![row(lag)]);
        wake.keep_pace().await;
        assert_eq!(start.elapsed(), Duration::ZERO, "behind, but no pass took rows yet: no wait");
        assert_eq!(wake.take_fed(1).len(), 1);
        wake.feed((lag + 1..lag + 600).map(row).collect());
        let relay = tokio::spawn({
            let wake = std::sync::Arc::clone(&wake);
            async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                wake.take_fed(600);
            }
        });
        wake.keep_pace().await;
        assert_eq!(start.elapsed(), Duration::from_millis(30), "waited until the pass took rows");
        relay.await.expect("the pass");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_for_a_relay_that_is_behind_a_bounded_time_and_not_at_all_once_it_stalls() {
        let wake = Wake::default();
        let lag = i64::try_from(LAG).expect("fits");
        wake.feed((0..=lag).map(row).collect());
        assert_eq!(wake.take_fed(1).len(), 1);
        wake.feed(vec![row(lag + 1), row(lag + 2)]);
        let start = tokio::time::Instant::now();
        wake.keep_pace().await;
        assert_eq!(start.elapsed(), KEEP_PACE_AT_MOST, "at most this long");
        tokio::time::sleep(STALLED).await;
        let stalled = tokio::time::Instant::now();
        wake.keep_pace().await;
        assert_eq!(stalled.elapsed(), Duration::ZERO, "a stalled relay is not waited for");
    }

    #[test]
    fn rows_a_scan_claimed_are_no_longer_handed_over() {
        let wake = Wake::default();
        let mib = 1 << 20;
        wake.feed((0..MOST_FED_BYTES / mib).map(|id| sized(i64::try_from(id).expect("fits"), mib)).collect());
        wake.forget(&[1, 3, 1_000].into_iter().collect());
        wake.feed(vec![sized(100, mib), sized(101, mib), sized(102, mib)]);
        let held: Vec<i64> = wake.take_fed(usize::MAX).iter().map(|row| row.id).collect();
        assert!(!held.contains(&1) && !held.contains(&3), "the claimed rows are gone: {held:?}");
        assert_eq!(held.len(), MOST_FED_BYTES / mib, "their bytes were freed for two more");
        assert_eq!(held.last(), Some(&101));
    }
}
