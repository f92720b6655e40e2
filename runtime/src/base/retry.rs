//! Delayed retries without a broker plugin: TTL "wait" queues that dead-letter back.
//!
//! A transiently failed delivery is republished (persistent, `mandatory`, confirmed)
//! to `<queue>.retry.<delay>ms`, a queue whose queue-level `x-message-ttl` is the
//! delay and whose dead-letter target is the original queue; the original is acked
//! only after the confirm, so the message always exists somewhere. One queue per
//! delay step: a queue's TTL cannot be changed by redeclaring, and per-message TTLs
//! in one shared queue would block behind its head. Jitter is applied in-process
//! before republishing, never as a per-message TTL.

use std::time::Duration;

/// How often and how late a transient handler failure is retried.
///
/// The message gets one attempt plus one per delay; after the last it is
/// dead-lettered (kind `attempts-exhausted`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a retry policy does nothing until it is given to the runtime builder"]
pub struct RetryPolicy {
    delays: Vec<Duration>,
    jitter: bool,
}

impl Default for RetryPolicy {
    /// Six attempts: retried after 1 s, 5 s, 30 s, 2 min and 10 min.
    fn default() -> Self {
        Self::new([1, 5, 30, 120, 600].map(Duration::from_secs))
    }
}

impl RetryPolicy {
    /// Retries after each of `delays` in turn (whole milliseconds; at least 1 ms).
    pub fn new(delays: impl IntoIterator<Item = Duration>) -> Self {
        let delays = delays.into_iter().map(|d| d.max(Duration::from_millis(1))).collect();
        Self { delays, jitter: true }
    }

    /// No retries: the first transient failure dead-letters.
    pub fn none() -> Self {
        Self::new([])
    }

    /// Turns the jitter (a random wait of up to a tenth of the delay, at most 1 s,
    /// before republishing) off, e.g. for tests that count on the schedule.
    pub fn without_jitter(mut self) -> Self {
        self.jitter = false;
        self
    }

    /// The longest time from a message's first delivery to its last attempt: every
    /// delay plus its largest jitter (handler run times not counted).
    pub fn horizon(&self) -> Duration {
        self.delays
            .iter()
            .map(|&delay| {
                delay + if self.jitter { (delay / 10).min(Duration::from_secs(1)) } else { Duration::ZERO }
            })
            .sum()
    }

    /// Attempts in all: one plus one per delay.
    pub fn max_attempts(&self) -> u32 {
        u32::try_from(self.delays.len()).unwrap_or(u32::MAX - 1) + 1
    }

    /// The delay before attempt `attempt + 1`, or `None` when `attempt` was the last.
    pub(crate) fn delay_after(&self, attempt: u32) -> Option<Duration> {
        let index = usize::try_from(attempt).ok()?.checked_sub(1)?;
        self.delays.get(index).copied()
    }

    /// The in-process wait before republishing a retry of `delay`.
    pub(crate) fn jitter_for(&self, delay: Duration) -> Duration {
        if !self.jitter {
            return Duration::ZERO;
        }
        (delay / 10).min(Duration::from_secs(1)).mul_f64(crate::base::backoff::jitter_fraction())
    }

    /// The wait queues this policy uses for `queue`, one per distinct delay.
    pub fn wait_queues(&self, queue: &str) -> Vec<(String, Duration)> {
        let mut delays = self.delays.clone();
        delays.sort();
        delays.dedup();
        delays.into_iter().map(|d| (wait_queue_name(queue, d), d)).collect()
    }
}

/// `<queue>.retry.<delay in ms>ms`.
pub(crate) fn wait_queue_name(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}ms", delay.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_one_attempt_plus_one_per_delay() {
        let policy = RetryPolicy::new([Duration::from_millis(10), Duration::from_millis(20)]);
        assert_eq!(policy.max_attempts(), 3);
        assert_eq!(policy.delay_after(1), Some(Duration::from_millis(10)));
        assert_eq!(policy.delay_after(2), Some(Duration::from_millis(20)));
        assert_eq!(policy.delay_after(3), None);
        assert_eq!(RetryPolicy::none().max_attempts(), 1);
        assert_eq!(RetryPolicy::default().max_attempts(), 6);
        assert_eq!(policy.wait_queues("q")[1].0, "q.retry.20ms");
    }

    #[test]
    fn jitter_is_bounded() {
        let policy = RetryPolicy::default();
        for _ in 0..100 {
            assert!(policy.jitter_for(Duration::from_secs(600)) <= Duration::from_secs(1));
            assert!(policy.jitter_for(Duration::from_secs(1)) <= Duration::from_millis(100));
        }
        assert_eq!(policy.without_jitter().jitter_for(Duration::from_secs(5)), Duration::ZERO);
    }
}
