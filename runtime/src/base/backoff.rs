//! Exponential backoff with jitter, shared by the in-process retry of database
//! faults and the reconnect loop.

use std::time::Duration;

/// Waits that start at `first`, double after each wait and never exceed `max`; each
/// wait is jittered to between half and one and a half times its nominal length.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
    /// Waits so far.
    pub(crate) attempts: u32,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max, attempts: 0 }
    }

    /// Sleeps for the next jittered interval.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled wait leaves the schedule as if it had not begun,
    /// except for the attempt count.
    pub(crate) async fn wait(&mut self) {
        self.attempts += 1;
        let delay = self.jittered();
        tokio::time::sleep(delay).await;
        self.next = (self.next * 2).min(self.max);
    }

    /// The next jittered interval, taken now (the schedule moves on), for a caller
    /// that says how long it will wait before it waits (see [`Backoff::wait`]).
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.attempts += 1;
        let delay = self.jittered();
        self.next = (self.next * 2).min(self.max);
        delay
    }

    fn jittered(&self) -> Duration {
        self.next.mul_f64(0.5 + jitter_fraction()).min(self.max)
    }
}

/// A random number in [0, 1), for jitter.
pub(crate) fn jitter_fraction() -> f64 {
    fastrand::f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waits_double_and_stay_under_the_bound() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(300));
        let mut waits = Vec::new();
        for _ in 0..5 {
            let start = tokio::time::Instant::now();
            backoff.wait().await;
            waits.push(start.elapsed());
        }
        assert!(waits[0] >= Duration::from_millis(50) && waits[0] <= Duration::from_millis(150), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= Duration::from_millis(300)), "{waits:?}");
        assert_eq!(backoff.attempts, 5);
    }

    #[test]
    fn a_delay_taken_ahead_moves_the_schedule_like_a_wait() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(300));
        let delays: Vec<Duration> = (0..4).map(|_| backoff.next_delay()).collect();
        assert!(
            delays[0] >= Duration::from_millis(50) && delays[0] <= Duration::from_millis(150),
            "{delays:?}"
        );
        assert!(delays[1] >= Duration::from_millis(100), "doubled: {delays:?}");
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(300)), "{delays:?}");
        assert_eq!(backoff.attempts, 4);
    }
}
