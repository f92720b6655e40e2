//! Whether this process reaches the broker, for its stream consumers: only a
//! process that can subscribe may own a stream.
//!
//! A stream's owner lock lives in PostgreSQL, so a process that reaches PostgreSQL
//! but not RabbitMQ could hold it for ever while another, healthy one waits (seen:
//! 200 messages, none consumed for minutes). So a process's stream consumers share
//! one [`BrokerLink`]: a connection of its own on which a round trip (`basic.qos`)
//! is made every [`PROBE_EVERY`]. Its rules:
//! - a stream's lock is taken only while the broker [answers](BrokerLink::reachable);
//! - once the broker has not answered for the
//!   [release bound](crate::RuntimeBuilder::release_streams_after), the locks are
//!   [given up](BrokerLink::lost) at the next batch boundary (and a partition's
//!   member lock with them), so a process that reaches the broker takes over;
//! - that decides only who works: a former owner that comes back is fenced by the
//!   offset's compare-and-set, never trusted because of the lock.

use std::time::Duration;

use lapin::options::BasicQosOptions;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::broker::brokers::Brokers;

/// How often the broker is asked for a sign of life.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The default [`release bound`](crate::RuntimeBuilder::release_streams_after).
pub(crate) const DEFAULT_RELEASE_AFTER: Duration = Duration::from_secs(15);

/// The broker as this process's stream consumers see it.
#[derive(Debug)]
pub(crate) struct BrokerLink {
    /// When the broker last answered a probe (`None`: never yet).
    answered: watch::Sender<Option<Instant>>,
    release_after: Duration,
}

impl BrokerLink {
    pub(crate) fn new(release_after: Duration) -> Self {
        Self { answered: watch::Sender::new(None), release_after }
    }

    /// How long the broker may stay silent before the streams are given up.
    pub(crate) fn release_after(&self) -> Duration {
        self.release_after
    }

    /// How long a probe may take: a silent broker (a black hole) must be noticed well
    /// within the release bound.
    fn probe_timeout(&self) -> Duration {
        (self.release_after / 3).clamp(Duration::from_millis(500), Duration::from_secs(5))
    }

    /// Whether the broker answered recently enough to take a stream's lock.
    fn answering(last: Option<Instant>) -> bool {
        last.is_some_and(|at| at.elapsed() < PROBE_EVERY * 3)
    }

    /// Whether the broker has been silent past the release bound (or never answered).
    pub(crate) fn is_lost(&self) -> bool {
        self.answered.borrow().is_none_or(|at| at.elapsed() >= self.release_after)
    }

    /// Whether the broker answers now (a probe within the last few seconds).
    pub(crate) fn is_answering(&self) -> bool {
        Self::answering(*self.answered.borrow())
    }

    /// Waits until the broker answers a probe.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub(crate) async fn reachable(&self) {
        let mut answered = self.answered.subscribe();
        let _ = answered.wait_for(|last| Self::answering(*last)).await;
    }

    /// Resolves once the broker has been silent for the release bound (at once if it
    /// never answered): the moment to give the streams up.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub(crate) async fn lost(&self) {
        let mut answered = self.answered.subscribe();
        loop {
            let Some(at) = *answered.borrow_and_update() else { return };
            let deadline = at + self.release_after;
            if Instant::now() >= deadline {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                changed = answered.changed() => if changed.is_err() { return },
            }
        }
    }

    /// Probes the broker every [`PROBE_EVERY`] until `stop`, on a connection of its
    /// own (made again after any failure).
    pub(crate) async fn keep(&self, brokers: &Brokers, stop: CancellationToken) {
        let timeout = self.probe_timeout();
        loop {
            let connected = tokio::select! {
                () = stop.cancelled() => return,
                connected = tokio::time::timeout(timeout * 2, brokers.connect("stream link")) => connected,
            };
            if let Ok(Ok((connection, node))) = connected {
                if let Ok(Ok(channel)) = tokio::time::timeout(timeout, connection.create_channel()).await {
                    loop {
                        let qos =
                            tokio::time::timeout(timeout, channel.basic_qos(1, BasicQosOptions::default()));
                        if !matches!(qos.await, Ok(Ok(()))) {
                            break;
                        }
                        self.answered.send_replace(Some(Instant::now()));
                        tokio::select! {
                            () = stop.cancelled() => break,
                            () = tokio::time::sleep(PROBE_EVERY) => {}
                        }
                    }
                }
                if !stop.is_cancelled() {
                    crate::base::log::debug!("the stream consumers' broker probe failed; connecting again");
                    brokers.lost(node);
                }
                let _ =
                    tokio::time::timeout(timeout, connection.close(200, "stream link closed".into())).await;
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PROBE_EVERY) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_link_that_never_answered_is_lost_and_not_reachable() {
        let link = BrokerLink::new(Duration::from_secs(10));
        assert!(link.is_lost());
        assert!(!link.is_answering());
        tokio::time::timeout(Duration::from_millis(1), link.lost()).await.expect("lost at once");
        assert!(tokio::time::timeout(Duration::from_secs(60), link.reachable()).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_broker_is_lost_only_after_the_release_bound() {
        let link = BrokerLink::new(Duration::from_secs(10));
        link.answered.send_replace(Some(Instant::now()));
        tokio::time::timeout(Duration::from_millis(1), link.reachable()).await.expect("reachable");
        assert!(link.is_answering());
        assert!(!link.is_lost());
        let lost = tokio::spawn({
            let link = std::sync::Arc::new(link);
            async move {
                let started = Instant::now();
                link.lost().await;
                started.elapsed()
            }
        });
        let waited = lost.await.expect("task");
        assert!(waited >= Duration::from_secs(10) && waited < Duration::from_secs(11), "{waited:?}");
    }
}
