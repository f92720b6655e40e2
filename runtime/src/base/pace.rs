//! How long one consumer's handler takes per message: its *pace*, and the batch it
//! allows. A batch is one transaction, and the handlers run in it one after the
//! other: a handler that waits 50 ms on an API would hold a batch of 256 open for
//! 13 s — its row locks, and the dedup rows the same keys' other copies wait on. So
//! a batch takes at most what the handler runs in about [`TARGET`], by its recent
//! pace, and never more than the batch size: a fast handler (the demo's, tens of µs
//! a message) gets whole batches, a slow one small batches side by side (the
//! runtime's concurrency), one that takes longer than the target batches of one.
//!
//! The pace is a moving average (a new run weighs a quarter) of a handler run's
//! time divided by the messages it took (one, or a batch handler's batch); a run cut
//! off by the handler timeout counts its full time. Until the first run ends, a
//! batch takes at most [`FIRST_BATCH`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// About how long a batch's handlers should run, by the pace.
pub(crate) const TARGET: Duration = Duration::from_millis(100);

/// The most deliveries in a batch while the pace is unknown.
pub(crate) const FIRST_BATCH: usize = 16;

/// One consumer's pace: nanoseconds per message, 0 while unknown.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    nanos_per_message: AtomicU64,
}

impl Pace {
    /// Learns from a handler run that took `took` for `messages` messages.
    pub(crate) fn record(&self, took: Duration, messages: usize) {
        let messages = u64::try_from(messages.max(1)).unwrap_or(u64::MAX);
        let sample = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX) / messages;
        // Runs of one consumer end concurrently; a lost update only drops a sample.
        let old = self.nanos_per_message.load(Ordering::Relaxed);
        let new = if old == 0 { sample.max(1) } else { (old - old / 4).saturating_add(sample / 4).max(1) };
        self.nanos_per_message.store(new, Ordering::Relaxed);
    }

    /// The most deliveries the next batch may take: what runs in about [`TARGET`] at
    /// the current pace, between 1 and `size`.
    pub(crate) fn batch(&self, size: usize) -> usize {
        let per_message = self.nanos_per_message.load(Ordering::Relaxed);
        if per_message == 0 {
            return size.min(FIRST_BATCH);
        }
        let fits = u64::try_from(TARGET.as_nanos()).unwrap_or(u64::MAX) / per_message;
        usize::try_from(fits).unwrap_or(usize::MAX).clamp(1, size.max(1))
    }

    /// Whether `messages` run within `limit` at the current pace; while the pace is
    /// unknown, no.
    pub(crate) fn runs_within(&self, messages: usize, limit: Duration) -> bool {
        let per_message = self.nanos_per_message.load(Ordering::Relaxed);
        let messages = u64::try_from(messages).unwrap_or(u64::MAX);
        per_message != 0
            && per_message.saturating_mul(messages) <= u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Pace, FIRST_BATCH};

    #[test]
    fn a_fast_handler_gets_whole_batches_and_a_slow_one_small_ones() {
        let fast = Pace::default();
        assert_eq!(fast.batch(256), FIRST_BATCH, "unknown: a first batch");
        assert_eq!(fast.batch(4), 4, "never more than the batch size");
        fast.record(Duration::from_millis(3), 256);
        assert_eq!(fast.batch(256), 256);

        let slow = Pace::default();
        slow.record(Duration::from_millis(50), 1);
        assert_eq!(slow.batch(256), 2, "100 ms of 50 ms handlers");
        slow.record(Duration::from_secs(60), 1);
        assert_eq!(slow.batch(256), 1, "a timed-out run: batches of one");
    }

    #[test]
    fn a_batch_runs_within_a_limit_only_by_a_known_pace() {
        let pace = Pace::default();
        assert!(!pace.runs_within(1, Duration::from_secs(1)), "unknown: not known to be quick");
        pace.record(Duration::from_millis(5), 250);
        assert!(pace.runs_within(250, Duration::from_millis(5)), "20 µs a message: 250 in 5 ms");
        assert!(!pace.runs_within(251, Duration::from_millis(5)));
    }

    #[test]
    fn the_pace_follows_the_handler_a_quarter_per_run() {
        let pace = Pace::default();
        pace.record(Duration::from_millis(40), 1);
        for _ in 0..30 {
            pace.record(Duration::from_millis(1), 1);
        }
        let back = pace.batch(256);
        assert!((99..=100).contains(&back), "back to about 1 ms a message: {back}");
        pace.record(Duration::from_millis(101), 1);
        assert_eq!(pace.batch(256), 3, "one slow run weighs a quarter: 26 ms");
    }
}
