//! The relay's loop: connect, passes (several in flight), wait for a wake-up; faults
//! waited out with backoff; on stop, a final pass bounded by [`FINAL_PASS`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::base::observe::{Observers, RelayPass};
use crate::broker::brokers::Brokers;
use crate::store::db;

use super::error::RelayError;
use super::link::Link;
use super::listen::{listen, Wake};
use super::pass::{self, Pass, Rows};
use super::settings::Settings;
use super::FINAL_PASS;

/// A relay's loop and what it needs.
pub(crate) struct Worker {
    pub(crate) pool: db::Pool,
    /// The broker addresses, tried in turn (the one last lost, last).
    pub(crate) brokers: Brokers,
    pub(crate) database_url: String,
    pub(crate) settings: Settings,
    pub(crate) wake: Arc<Wake>,
    pub(crate) observers: Observers,
}

/// How many passes may be in flight at once (each holds a connection of the
/// relay's pool, which has one more).
pub(crate) const DEPTH: usize = 3;

/// Whether rows may be due, and what must be mended before the next pass.
struct State {
    /// A wake-up to scan came, or the last scan claimed a full batch while no rows
    /// were handed over: scan (see [`scans`]).
    due: bool,
    /// The last pass started was a scan.
    scanned: bool,
    /// When the last scan started: one is due a poll interval later, however busy
    /// the relay is with rows handed over.
    last_scan: tokio::time::Instant,
    trouble: Trouble,
}

/// Whether the next pass scans — claims due rows from the table — rather than takes
/// rows handed over (`fed`): when a scan is `due`, unless the last pass was one and
/// rows handed over wait. So a scan that is due never waits for the rows handed over
/// to run out — under a steady load they may never — and scans and passes of rows
/// handed over take turns: a scheduled or postponed row is published within a poll
/// interval or so, as before. (While rows handed over wait, a full scan does not ask
/// for another: the rows it found may be theirs.)
fn scans(due: bool, fed: bool, scanned: bool) -> bool {
    due && (!fed || !scanned)
}

/// What the passes that ended met, mended once none is in flight.
#[derive(Default)]
struct Trouble {
    fault: Option<Fault>,
    nacked: bool,
    lost: Option<RelayError>,
}

impl Trouble {
    fn any(&self) -> bool {
        self.fault.is_some() || self.nacked || self.lost.is_some()
    }
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
    ///
    /// Up to [`DEPTH`] passes are in flight: while one awaits its confirms (the
    /// broker's confirm latency, tens of ms for a batch on a quorum queue), the next
    /// claims and publishes on the same channel. A pass takes rows handed over
    /// ([`Wake`]) or scans, while the last scan claimed a full batch or on a
    /// wake-up to scan (a `NOTIFY`, the poll interval, rows left to a scan): see
    /// [`scans`]. After a fault (a lost connection, a nack, the database) none
    /// starts until those in flight have ended; then the link is dropped, the
    /// channel reopened, or the fault waited out — and the next pass scans, as rows
    /// handed over to a pass that failed are in the table still.
    async fn publish(&self, stop: &CancellationToken, link: &mut Option<Link>) {
        let mut faults = Faults::new();
        let mut final_until: Option<Instant> = None;
        let mut in_flight = FuturesUnordered::new();
        let mut state = State {
            due: true,
            scanned: false,
            last_scan: tokio::time::Instant::now(),
            trouble: Trouble::default(),
        };
        loop {
            if final_until.is_none() && stop.is_cancelled() {
                final_until = Some(Instant::now() + FINAL_PASS);
                state.due = true;
            }
            if final_until.is_some_and(|until| Instant::now() >= until) {
                // Cut off while stopping: the transactions of the passes in flight roll
                // back as their connections close; their rows stay for the next relay.
                break;
            }
            let finishing = final_until.is_some();
            // Once stopping, nothing may take longer than what is left of the final pass.
            let left =
                final_until.map_or(Duration::MAX, |until| until.saturating_duration_since(Instant::now()));
            // (A poll interval past what an instant holds: a year, as good as never.)
            let next_scan = state
                .last_scan
                .checked_add(self.settings.poll_interval)
                .unwrap_or_else(|| state.last_scan + Duration::from_secs(365 * 86_400));
            state.due |= tokio::time::Instant::now() >= next_scan;
            let room = !state.trouble.any() && in_flight.len() < DEPTH;
            let fed = self.wake.has_fed();
            let start_another = room && (state.due || fed);
            if !in_flight.is_empty() && !start_another {
                // Wait for a pass to end (or, with room for another, for a wake-up).
                tokio::select! {
                    Some(ended) = in_flight.next() => self.ended(ended, &mut state),
                    () = self.wake.scan.notified(), if room => state.due = true,
                    () = self.wake.fed_arrived.notified(), if room => {}
                    () = tokio::time::sleep_until(next_scan), if room => state.due = true,
                    () = stop.cancelled(), if !finishing => {}
                    // A pass started before the stop is bounded by the final pass too.
                    () = tokio::time::sleep(left), if finishing => {}
                }
                continue;
            }
            if in_flight.is_empty() && state.trouble.any() {
                let trouble = std::mem::take(&mut state.trouble);
                if !self.settle(trouble, link, &mut faults, stop, finishing).await {
                    break;
                }
                state.due = true;
                continue;
            }
            if !state.due && !fed {
                // Nothing in flight, nothing due.
                if finishing {
                    break;
                }
                tokio::select! {
                    () = self.wake.scan.notified() => state.due = true,
                    () = self.wake.fed_arrived.notified() => {}
                    () = tokio::time::sleep_until(next_scan) => state.due = true,
                    () = stop.cancelled() => {}
                }
                continue;
            }
            let current = match link {
                Some(current) => current,
                // (Only with none in flight: a link is dropped once those have ended.)
                None => match self.connect_until(left, stop, finishing).await {
                    // Stop came first: the final pass begins (and may connect again).
                    None => continue,
                    Some(Ok(connected)) => {
                        faults = Faults::new();
                        link.insert(connected)
                    }
                    Some(Err(error)) => {
                        state.trouble.fault = Some(Fault { what: "cannot reach the broker", error });
                        continue;
                    }
                },
            };
            // The next pass's first half, while those in flight go on.
            let rows = if scans(state.due, fed, state.scanned) {
                Rows::Scan
            } else {
                match self.wake.take_fed(self.settings.batch_size) {
                    taken if !taken.is_empty() => Rows::Fed(taken),
                    _ => Rows::Scan,
                }
            };
            let scan = matches!(rows, Rows::Scan);
            state.scanned = scan;
            if scan {
                state.last_scan = tokio::time::Instant::now();
            }
            let mut ended = Vec::new();
            let started = {
                let start = tokio::time::timeout(left, pass::start(&self.pool, self.settings, current, rows));
                tokio::pin!(start);
                loop {
                    tokio::select! {
                        started = &mut start => break started,
                        Some(pass) = in_flight.next() => ended.push(pass),
                    }
                }
            };
            for pass in ended {
                self.ended(pass, &mut state);
            }
            match started {
                // Cut off while stopping.
                Err(_) => break,
                Ok(Ok(Some(publishing))) => {
                    if scan {
                        // Before any other pass is started: none can take them meanwhile.
                        self.wake.forget(&publishing.ids());
                        state.due = publishing.claimed() >= self.settings.batch_size && !self.wake.has_fed();
                    }
                    let settings = self.settings;
                    in_flight.push(async move {
                        tokio::time::timeout(left, publishing.finish(settings)).await.ok()
                    });
                }
                Ok(Ok(None)) => state.due &= !scan,
                Ok(Err(error)) => {
                    state.trouble.fault.get_or_insert(Fault { what: "database fault", error });
                }
            }
        }
    }

    /// Takes in a pass that ended (`None`: cut off while stopping): tells the
    /// observers what it did, and notes what must be mended before the next.
    fn ended(&self, ended: Option<Result<Pass, RelayError>>, state: &mut State) {
        let pass = match ended {
            Some(Ok(pass)) => pass,
            Some(Err(error)) => {
                state.trouble.fault.get_or_insert(Fault { what: "database fault", error });
                return;
            }
            None => return,
        };
        let Pass { claimed, published, postponed, expired, nacked, lost } = pass;
        if claimed > 0 {
            self.observers.relay(&RelayPass { claimed, published, postponed, expired });
        }
        state.trouble.nacked |= nacked;
        if let Some(reason) = lost {
            state.trouble.lost.get_or_insert(reason);
        }
    }

    /// Mends what the passes that ended met, once none is in flight: a lost link is
    /// dropped (the next pass reconnects, to the next address), a nacked channel
    /// replaced, a fault waited out. `false`: stopping, give up now.
    async fn settle(
        &self,
        trouble: Trouble,
        link: &mut Option<Link>,
        faults: &mut Faults,
        stop: &CancellationToken,
        finishing: bool,
    ) -> bool {
        let Trouble { fault, nacked, mut lost } = trouble;
        if nacked && lost.is_none() {
            if let Some(current) = link.as_mut() {
                lost = current.reopen_channel().await.err();
            }
        }
        if let Some(reason) = lost {
            crate::base::log::warn!(reason = %reason.report(), "outbox relay: broker connection lost; reconnecting");
            if let Some(old) = link.take() {
                self.brokers.lost(old.node);
                old.drop_connection().await;
            }
        }
        match fault {
            Some(fault) => faults.wait(fault, stop, finishing).await,
            None => true,
        }
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

#[cfg(test)]
mod tests {
    use super::scans;

    #[test]
    fn a_due_scan_takes_its_turn_beside_rows_handed_over() {
        assert!(scans(true, false, true), "due, nothing handed over: scan");
        assert!(scans(true, true, false), "due, rows handed over, last was theirs: scan now");
        assert!(!scans(true, true, true), "due, rows handed over, last was a scan: their turn");
        assert!(!scans(false, true, false), "not due: the rows handed over");
    }
}
