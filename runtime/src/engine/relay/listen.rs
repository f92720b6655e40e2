//! Wake-ups: a runtime tells relays that rows were committed ([`OutboxSignal`]: its
//! own relay in-process, others by a throttled `NOTIFY`), and a relay hears the
//! `NOTIFY`s on a dedicated `LISTEN` connection ([`listen`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::store::db::{self, CHANNEL};

use super::error::RelayError;
use super::NOTIFY_INTERVAL;

/// How a runtime tells relays that rows were committed.
pub(crate) struct OutboxSignal {
    /// Its own relay's wake-up, if it runs one.
    pub(crate) wake: Option<Arc<Notify>>,
    /// Set after a commit that wrote rows; sent as one `NOTIFY` per interval when
    /// there is no relay in-process.
    pending: AtomicBool,
}

impl OutboxSignal {
    pub(crate) fn new(wake: Option<Arc<Notify>>) -> Self {
        Self { wake, pending: AtomicBool::new(false) }
    }

    /// Rows were committed.
    pub(crate) fn committed(&self) {
        match &self.wake {
            Some(wake) => wake.notify_one(),
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
pub(super) async fn listen(database_url: String, wake: Arc<Notify>, stop: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        tokio::select! {
            result = forward(&database_url, &wake) => {
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
