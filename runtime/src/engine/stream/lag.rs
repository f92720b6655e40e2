//! How far a stream consumer is behind its stream's end, read every [`EVERY`] while
//! it owns the stream and reported to the observers ([`StreamLag`]): the metrics
//! `idemq_stream_lag_messages` and `idemq_stream_lag_seconds`, and the console.
//!
//! In messages: the stream's last offset (read on a channel of its own, as `status`
//! reads it: [`crate::broker::stream_end`]) less the last offset applied. In time:
//! how long ago a read first saw an offset that is still not applied — at least
//! that far behind, to within one [`EVERY`]; 0 once the consumer has applied
//! everything a read saw.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;

use crate::base::observe::{Observers, StreamLag};

/// How often the stream's end is read.
pub(super) const EVERY: Duration = Duration::from_secs(15);

/// How long a read waits for the stream's last chunk.
const WAIT: Duration = Duration::from_secs(2);

/// The reads not yet caught up with: when, and the stream's last offset then.
#[derive(Debug, Default)]
pub(super) struct Lag {
    reads: VecDeque<(Instant, i64)>,
}

impl Lag {
    /// A read at `at` found the stream ending at `end` (`None`: empty) with
    /// `applied` the last offset applied: the lag in messages and in time.
    pub(super) fn read(&mut self, at: Instant, end: Option<i64>, applied: i64) -> (i64, Duration) {
        let Some(end) = end else {
            self.reads.clear();
            return (0, Duration::ZERO);
        };
        if self.reads.back().is_none_or(|(_, last)| *last < end) {
            self.reads.push_back((at, end));
        }
        while self.reads.front().is_some_and(|(_, seen)| *seen <= applied) {
            self.reads.pop_front();
        }
        let behind =
            self.reads.front().map_or(Duration::ZERO, |(first, _)| at.saturating_duration_since(*first));
        ((end - applied).max(0), behind)
    }
}

/// Reads `stream`'s end every [`EVERY`] on `connection` and reports the lag of
/// `handler`, whose last applied offset is `applied`. Runs until dropped.
pub(super) async fn probe(
    connection: &Connection,
    stream: &str,
    handler: &'static str,
    applied: Arc<AtomicI64>,
    observers: &Observers,
) -> std::convert::Infallible {
    let tag = format!("idemq-lag-{handler}");
    let mut lag = Lag::default();
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        // A failed read says nothing new: the consumer's own session reports the
        // broker's trouble.
        if let Ok(end) =
            crate::broker::stream_end::read_offset(connection, stream, "last", WAIT, true, &tag).await
        {
            let (messages, behind) = lag.read(Instant::now(), end, applied.load(Ordering::Relaxed));
            observers.stream_lag(&StreamLag { handler, stream, messages, behind });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lag_in_time_is_the_age_of_the_oldest_read_not_yet_caught_up_with() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut lag = Lag::default();
        assert_eq!(lag.read(at(0), None, -1), (0, Duration::ZERO), "an empty stream");
        assert_eq!(lag.read(at(0), Some(99), -1), (100, Duration::ZERO), "first seen now");
        assert_eq!(
            lag.read(at(15), Some(150), 40),
            (110, Duration::from_secs(15)),
            "offset 99 seen 15 s ago"
        );
        assert_eq!(
            lag.read(at(30), Some(150), 120),
            (30, Duration::from_secs(15)),
            "99 applied; 150 seen at 15 s"
        );
        assert_eq!(lag.read(at(45), Some(160), 160), (0, Duration::ZERO), "caught up");
        assert_eq!(lag.read(at(60), Some(170), 160), (10, Duration::ZERO));
    }
}
