//! The relay's loop: connect, pass, wait for a wake-up; faults waited out with
//! backoff; on stop, a final pass bounded by [`FINAL_PASS`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::base::observe::{Observers, RelayPass};
use crate::broker::brokers::Brokers;
use crate::store::db;

use super::error::RelayError;
use super::link::Link;
use super::listen::listen;
use super::pass::{pass, Pass};
use super::settings::Settings;
use super::FINAL_PASS;

/// A relay's loop and what it needs.
pub(crate) struct Worker {
    pub(crate) pool: db::Pool,
    /// The broker addresses, tried in turn (the one last lost, last).
    pub(crate) brokers: Brokers,
    pub(crate) database_url: String,
    pub(crate) settings: Settings,
    pub(crate) wake: Arc<Notify>,
    pub(crate) observers: Observers,
}

/// A fault the relay waits out.
struct Fault {
    what: &'static str,
    error: RelayError,
}

/// The backoff between faults, and the last fault logged (a repeat is not).
struct Faults {
    backoff: Backoff,
    last_error: Option<String>,
}

impl Faults {
    fn new() -> Self {
        Self { backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)), last_error: None }
    }

    /// Logs `fault` (once per change of fault) and waits out the backoff or `stop`.
    /// `false`: the relay is finishing (stopping), give up now.
    async fn wait(&mut self, fault: Fault, stop: &CancellationToken, finishing: bool) -> bool {
        let error = fault.error.report();
        if self.last_error.as_deref() != Some(error.as_str()) {
            crate::base::log::warn!(error = %error, "outbox relay: {}; retrying", fault.what);
            self.last_error = Some(error);
        }
        if finishing {
            return false;
        }
        tokio::select! {
            () = self.backoff.wait() => {}
            () = stop.cancelled() => {}
        }
        true
    }
}

impl Worker {
    /// Publishes until `stop`, then for at most [`FINAL_PASS`] more.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let listening = CancellationToken::new();
        let listener =
            tokio::spawn(listen(self.database_url.clone(), Arc::clone(&self.wake), listening.clone()));
        let mut link = None;
        self.publish(&stop, &mut link).await;
        listening.cancel();
        let _ = listener.await;
        if let Some(link) = link {
            link.close().await;
        }
    }

    /// The loop: passes until `stop`, then the final pass; leaves the link it has.
    async fn publish(&self, stop: &CancellationToken, link: &mut Option<Link>) {
        let mut faults = Faults::new();
        let mut final_until: Option<Instant> = None;
        loop {
            if final_until.is_none() && stop.is_cancelled() {
                final_until = Some(Instant::now() + FINAL_PASS);
            }
            if final_until.is_some_and(|until| Instant::now() >= until) {
                break;
            }
            let finishing = final_until.is_some();
            // Once stopping, nothing may take longer than what is left of the final pass.
            let left =
                final_until.map_or(Duration::MAX, |until| until.saturating_duration_since(Instant::now()));
            let current = match link {
                Some(current) => current,
                None => match self.connect_until(left, stop, finishing).await {
                    // Stop came first: the final pass begins (and may connect again).
                    None => continue,
                    Some(Ok(connected)) => {
                        faults = Faults::new();
                        link.insert(connected)
                    }
                    Some(Err(error)) => {
                        let fault = Fault { what: "cannot reach the broker", error };
                        if !faults.wait(fault, stop, finishing).await {
                            break;
                        }
                        continue;
                    }
                },
            };
            let Ok(pass) = tokio::time::timeout(left, pass(&self.pool, self.settings, current)).await else {
                // Cut off while stopping: the pass's transaction rolls back when the
                // relay's pool closes; its rows stay for the next relay.
                break;
            };
            let claimed = match pass {
                Ok(pass) => match self.passed(pass, link).await {
                    Some(claimed) => claimed,
                    None => continue,
                },
                Err(error) => {
                    if !faults.wait(Fault { what: "database fault", error }, stop, finishing).await {
                        break;
                    }
                    continue;
                }
            };
            if claimed >= self.settings.batch_size {
                continue;
            }
            if finishing {
                break;
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.settings.poll_interval) => {}
                () = stop.cancelled() => {}
            }
        }
    }

    /// Tells the observers of a pass that claimed rows; if the broker connection was
    /// lost during it, drops the link (`None`: reconnect), else the rows claimed.
    async fn passed(&self, pass: Pass, link: &mut Option<Link>) -> Option<usize> {
        let Pass { claimed, published, postponed, expired, lost, .. } = pass;
        if claimed > 0 {
            self.observers.relay(&RelayPass { claimed, published, postponed, expired });
        }
        let Some(reason) = lost else {
            return Some(claimed);
        };
        crate::base::log::warn!(reason = %reason.report(), "outbox relay: broker connection lost; reconnecting");
        if let Some(old) = link.take() {
            // The next connection starts with the next address.
            self.brokers.lost(old.node);
            old.drop_connection().await;
        }
        None
    }

    /// [`Link::connect`], for at most `left`; before the final pass, also cut short
    /// by `stop` (`None`: the loop then starts the final pass, bounded by
    /// [`FINAL_PASS`]) — a broker that does not answer must not hold a shutdown for
    /// the connect timeout.
    async fn connect_until(
        &self,
        left: Duration,
        stop: &CancellationToken,
        stopping: bool,
    ) -> Option<Result<Link, RelayError>> {
        let connect = async {
            tokio::time::timeout(left, Link::connect(&self.brokers))
                .await
                .unwrap_or(Err(RelayError::Stopping))
        };
        if stopping {
            return Some(connect.await);
        }
        tokio::select! {
            connected = connect => Some(connected),
            () = stop.cancelled() => None,
        }
    }
}
