//! Flow control per handler: the kill switch.
//!
//! A handler whose attempts keep failing has a broken dependency (a database of its
//! own, an HTTP service), not bad messages: every further attempt only burns a
//! message's retries and, once they are spent, fills the dead-letter queue with
//! messages nothing is wrong with. The kill switch (as MassTransit's: by default 15 %
//! of at least 10 attempts within a minute) stops that:
//!
//! ```text
//!            failures ≥ ratio of ≥ min attempts in the window
//!  Closed ───────────────────────────────────────────────────▶ Open (pause)
//!    ▲                                                          │  the consumer is cancelled;
//!    │ the probe applied,                                       │  what it holds goes back to
//!    │ or the queue is empty                                    │  the queue unprocessed
//!    │                                                          ▼
//!    └──────────────────────────────────────────────────────── Probing: after the pause,
//!                          the probe failed: Open again,         one message (basic.get),
//!                          the pause doubled (at most 8×)        run alone
//! ```
//!
//! What counts: a transient handler failure (an error, a panic, a timeout: a retry,
//! or a dead letter for exhausted attempts) is a failure; an applied message is a
//! success. Duplicates, bad input, permanent errors (the message's fault, not the
//! dependency's) and infrastructure faults (retried in-process, never charged) count
//! neither way. A delivery returned to the queue by an open switch is not an attempt:
//! a redelivery is charged only when its handler starts.
//!
//! The switch is per handler of a queue of its own; [`build`] refuses it for a queue
//! several handlers share (one handler's pause would pause the others) and for
//! streams (a stream consumer stops at its offset anyway: its failures are retried in
//! place, not dead-lettered).
//!
//! [`build`]: crate::RuntimeBuilder::build

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::base::observe::{KillSwitchEvent, Observers};
use crate::base::outcome::{FailureKind, Outcome};

/// When a handler's kill switch trips, and how long it stays open: see
/// [`RuntimeBuilder::kill_switch`](crate::RuntimeBuilder::kill_switch).
///
/// The defaults are MassTransit's: trip at 15 % failures of at least 10 attempts
/// within one minute, try again after one minute. As text (the `--kill-switch` flag,
/// `IDEMQ_KILL_SWITCH`): `15%/10/1m/1m` — ratio, attempts, window, pause — or `off`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KillSwitch {
    ratio: f64,
    min_attempts: u32,
    window: Duration,
    pause: Duration,
}

impl Default for KillSwitch {
    fn default() -> Self {
        Self {
            ratio: 0.15,
            min_attempts: 10,
            window: Duration::from_secs(60),
            pause: Duration::from_secs(60),
        }
    }
}

impl KillSwitch {
    /// The share of failed attempts that trips the switch (`0.15`: 15 %), clamped to
    /// (0, 1].
    pub fn trip_ratio(mut self, ratio: f64) -> Self {
        self.ratio = if ratio.is_finite() { ratio.clamp(f64::MIN_POSITIVE, 1.0) } else { 1.0 };
        self
    }

    /// The fewest attempts within the window before the ratio counts (at least 1).
    pub fn min_attempts(mut self, attempts: u32) -> Self {
        self.min_attempts = attempts.max(1);
        self
    }

    /// How far back attempts are counted (at least one second).
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window.max(Duration::from_secs(1));
        self
    }

    /// How long the switch stays open before one message is tried (at least 100 ms);
    /// doubled after each failed try, up to 8 times this.
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause.max(Duration::from_millis(100));
        self
    }

    /// The pause before the first try.
    pub fn first_pause(&self) -> Duration {
        self.pause
    }
}

impl std::fmt::Display for KillSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}%/{}/{}/{}",
            (self.ratio * 100.0 * 100.0).round() / 100.0,
            self.min_attempts,
            crate::base::duration::human(self.window),
            crate::base::duration::human(self.pause)
        )
    }
}

/// A kill switch that could not be read from text.
#[derive(Debug, thiserror::Error)]
#[error("invalid kill switch '{given}': {reason} (expected RATIO%/ATTEMPTS/WINDOW/PAUSE, e.g. 15%/10/1m/1m, or off)")]
pub struct KillSwitchParseError {
    given: String,
    reason: String,
}

impl FromStr for KillSwitch {
    type Err = KillSwitchParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let fail = |reason: &str| KillSwitchParseError { given: text.to_owned(), reason: reason.to_owned() };
        let parts: Vec<&str> = text.trim().split('/').map(str::trim).collect();
        let [ratio, attempts, window, pause] = parts[..] else {
            return Err(fail("four parts are needed"));
        };
        let percent: f64 = ratio
            .strip_suffix('%')
            .ok_or_else(|| fail("the ratio is a percentage, like 15%"))?
            .trim()
            .parse()
            .map_err(|_| fail("the ratio is not a number"))?;
        if !(percent > 0.0 && percent <= 100.0) {
            return Err(fail("the ratio must be above 0% and at most 100%"));
        }
        let attempts: u32 = attempts.parse().map_err(|_| fail("the attempts are not a whole number"))?;
        let window =
            humantime::parse_duration(window).map_err(|_| fail("the window is not a duration (1m)"))?;
        let pause = humantime::parse_duration(pause).map_err(|_| fail("the pause is not a duration (1m)"))?;
        Ok(Self::default().trip_ratio(percent / 100.0).min_attempts(attempts).window(window).pause(pause))
    }
}

/// How the switch weighs one settled delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Weight {
    Success,
    Failure,
    /// Says nothing about the handler's dependencies.
    Neither,
}

fn weigh(outcome: &Outcome) -> Weight {
    match outcome {
        Outcome::Applied => Weight::Success,
        Outcome::Retry { .. } | Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, .. } => {
            Weight::Failure
        }
        _ => Weight::Neither,
    }
}

/// Where a switch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Consuming.
    Closed,
    /// Not consuming until `until`; then one message is tried.
    Open { until: tokio::time::Instant },
    /// One message, received at or after `since`, is being tried.
    Probing { since: Instant },
}

/// What a probe ended in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// It applied: consume again.
    Passed,
    /// It failed: the switch is open again.
    Failed,
    /// It said nothing (a duplicate, bad input…): try the next message.
    Inconclusive,
}

/// Attempts counted in one slice of the window.
#[derive(Debug, Clone, Copy)]
struct Slice {
    start: Instant,
    attempts: u32,
    failures: u32,
}

/// The window is counted in this many slices.
const SLICES: u32 = 12;

struct State {
    phase: Phase,
    /// The current pause (doubles after a failed probe, back to the first on close).
    pause: Duration,
    slices: VecDeque<Slice>,
    /// The last probe's end, taken by the intake.
    probe: Option<Probe>,
}

/// One handler's kill switch, shared by its consumers across sessions. A handler
/// without one has a switch that never trips.
pub(crate) struct Flow {
    config: Option<KillSwitch>,
    handler: &'static str,
    queue: String,
    state: Mutex<State>,
    changed: Notify,
    observers: Observers,
}

impl std::fmt::Debug for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flow").field("config", &self.config).field("phase", &self.phase()).finish()
    }
}

impl Flow {
    pub(crate) fn new(
        config: Option<KillSwitch>,
        handler: &'static str,
        queue: &str,
        observers: Observers,
    ) -> Self {
        Self {
            config,
            handler,
            queue: queue.to_owned(),
            state: Mutex::new(State {
                phase: Phase::Closed,
                pause: config.map_or(Duration::ZERO, |c| c.pause),
                slices: VecDeque::new(),
                probe: None,
            }),
            changed: Notify::new(),
            observers,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn phase(&self) -> Phase {
        self.state().phase
    }

    /// Whether the switch is open: deliveries are returned to the queue unprocessed.
    pub(crate) fn is_open(&self) -> bool {
        // The hot path of a handler without a switch takes no lock.
        self.config.is_some() && matches!(self.phase(), Phase::Open { .. })
    }

    /// Counts one decided delivery of the handler, received at `received_at` (told as
    /// each is decided, before it is settled: see `delivery::life`).
    pub(crate) fn record(&self, outcome: &Outcome, received_at: Instant) {
        let Some(config) = self.config else { return };
        let weight = weigh(outcome);
        let now = Instant::now();
        let mut state = self.state();
        match state.phase {
            Phase::Closed if weight != Weight::Neither => {
                let slice = config.window / SLICES;
                if state.slices.back().is_none_or(|last| now.saturating_duration_since(last.start) >= slice) {
                    state.slices.push_back(Slice { start: now, attempts: 0, failures: 0 });
                }
                while state
                    .slices
                    .front()
                    .is_some_and(|first| now.saturating_duration_since(first.start) > config.window)
                {
                    state.slices.pop_front();
                }
                if let Some(last) = state.slices.back_mut() {
                    last.attempts += 1;
                    last.failures += u32::from(weight == Weight::Failure);
                }
                let (attempts, failures) =
                    state.slices.iter().fold((0, 0), |(a, f), s| (a + s.attempts, f + s.failures));
                if attempts >= config.min_attempts
                    && f64::from(failures) >= config.ratio * f64::from(attempts)
                {
                    let pause = config.pause;
                    self.trip(&mut state, pause);
                    drop(state);
                    self.tell(Some(pause));
                    crate::base::log::warn!(
                        handler = self.handler,
                        queue = %self.queue,
                        failures,
                        attempts,
                        pause = %crate::base::duration::human(pause),
                        "kill switch tripped: the handler's attempts keep failing (a dependency is down?); \
                         its queue is paused, its messages stay in it, one is tried after the pause"
                    );
                }
            }
            // A probe's outcome, not a straggler's from before the trip.
            Phase::Probing { since } if received_at >= since => {
                let probe = match weight {
                    Weight::Success => {
                        state.phase = Phase::Closed;
                        state.pause = config.pause;
                        state.slices.clear();
                        Probe::Passed
                    }
                    Weight::Failure => {
                        let pause = (state.pause * 2).min(config.pause * 8);
                        self.trip(&mut state, pause);
                        crate::base::log::info!(
                            handler = self.handler,
                            queue = %self.queue,
                            pause = %crate::base::duration::human(pause),
                            "kill switch: the message tried failed too; the queue stays paused"
                        );
                        Probe::Failed
                    }
                    Weight::Neither => Probe::Inconclusive,
                };
                state.probe = Some(probe);
                let open_for = matches!(state.phase, Phase::Open { .. }).then_some(state.pause);
                drop(state);
                if probe != Probe::Inconclusive {
                    self.tell(open_for);
                }
                self.changed.notify_waiters();
            }
            _ => {}
        }
    }

    /// Tells the observers where the switch is now.
    fn tell(&self, open_for: Option<Duration>) {
        self.observers.kill_switch(&KillSwitchEvent { queue: &self.queue, handler: self.handler, open_for });
    }

    fn trip(&self, state: &mut State, pause: Duration) {
        state.phase = Phase::Open { until: tokio::time::Instant::now() + pause };
        state.pause = pause;
        state.slices.clear();
    }

    /// Waits out the pause, then starts a probe: returns when one message may be
    /// tried.
    pub(crate) async fn pause_over(&self) {
        loop {
            let Phase::Open { until } = self.phase() else { return };
            tokio::time::sleep_until(until).await;
            let mut state = self.state();
            if let Phase::Open { until } = state.phase {
                if until <= tokio::time::Instant::now() {
                    state.phase = Phase::Probing { since: Instant::now() };
                    state.probe = None;
                    return;
                }
            }
        }
    }

    /// The queue was empty when a probe was due: nothing to try, so consume again.
    pub(crate) fn close(&self) {
        let mut state = self.state();
        state.phase = Phase::Closed;
        state.slices.clear();
        if let Some(config) = self.config {
            state.pause = config.pause;
        }
        drop(state);
        self.tell(None);
    }

    /// Waits for the running probe's end.
    pub(crate) async fn probed(&self) -> Probe {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(probe) = self.state().probe.take() {
                return probe;
            }
            changed.await;
        }
    }

    /// Logs that consuming resumes after a passed probe (or an empty queue).
    pub(crate) fn resumed(&self) {
        crate::base::log::info!(handler = self.handler, queue = %self.queue, "kill switch closed: consuming again");
    }
}

/// A handler's rate limit: a token bucket of one second's worth, shared by its
/// consumers across sessions. The intake takes a token for each delivery it starts
/// (a batch takes as many as it holds, and gives back what it did not use), so the
/// limit holds under group commit and lanes alike: at most `per_second × t` plus one
/// second's worth start in any `t`.
#[derive(Debug)]
pub(crate) struct Rate {
    /// Deliveries per second, and the bucket's size.
    limit: u32,
    /// Tokens in the bucket, and when they were counted.
    state: Mutex<(f64, tokio::time::Instant)>,
}

impl Rate {
    pub(crate) fn new(per_second: u32) -> Self {
        let limit = per_second.max(1);
        Self { limit, state: Mutex::new((f64::from(limit), tokio::time::Instant::now())) }
    }

    /// The limit, per second.
    pub(crate) fn per_second(&self) -> usize {
        usize::try_from(self.limit).unwrap_or(usize::MAX)
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, (f64, tokio::time::Instant)> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = tokio::time::Instant::now();
        let elapsed = now.saturating_duration_since(state.1).as_secs_f64();
        let limit = f64::from(self.limit);
        state.0 = (state.0 + elapsed * limit).min(limit);
        state.1 = now;
        state
    }

    /// Waits until a delivery may start, then takes tokens for up to `wanted` (at
    /// least one): how many were taken.
    pub(crate) async fn take(&self, wanted: usize) -> usize {
        loop {
            let wait = {
                let mut state = self.tokens();
                if state.0 >= 1.0 {
                    // Whole tokens only; `wanted` is at most a batch.
                    #[allow(
                        clippy::cast_possible_truncation,
                        clippy::cast_sign_loss,
                        clippy::cast_precision_loss
                    )]
                    let taken = (state.0.floor() as usize).min(wanted.max(1));
                    #[allow(clippy::cast_precision_loss)]
                    let spent = taken as f64;
                    state.0 -= spent;
                    return taken;
                }
                Duration::from_secs_f64((1.0 - state.0) / f64::from(self.limit))
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Gives back tokens taken and not used.
    pub(crate) fn give_back(&self, unused: usize) {
        if unused > 0 {
            let mut state = self.tokens();
            #[allow(clippy::cast_precision_loss)]
            let unused = unused as f64;
            state.0 = (state.0 + unused).min(f64::from(self.limit));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn failed() -> Outcome {
        Outcome::Retry { error: "down".into(), delay: Duration::from_secs(1) }
    }

    /// Counts the switch's openings (a failed try included), as the metrics do.
    #[derive(Default)]
    struct Trips(AtomicU64);

    impl crate::base::observe::Observe for Trips {
        fn kill_switch(&self, event: &KillSwitchEvent<'_>) {
            if event.open_for.is_some() {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A flow with `switch`, and what counts its openings.
    fn counted(switch: KillSwitch) -> (Flow, std::sync::Arc<Trips>) {
        let trips = std::sync::Arc::new(Trips::default());
        let mut observers = Observers::default();
        observers.push(trips.clone());
        (Flow::new(Some(switch), "h", "q", observers), trips)
    }

    #[test]
    fn the_text_form_reads_ratio_attempts_window_and_pause() {
        let switch: KillSwitch = "20%/5/30s/10s".parse().unwrap();
        assert_eq!(
            switch,
            KillSwitch::default()
                .trip_ratio(0.2)
                .min_attempts(5)
                .window(Duration::from_secs(30))
                .pause(Duration::from_secs(10))
        );
        assert_eq!(switch.to_string(), "20%/5/30s/10s");
        let err = "15/10/1m/1m".parse::<KillSwitch>().unwrap_err().to_string();
        assert!(err.contains("percentage") && err.contains("15%/10/1m/1m"), "{err}");
        assert!("0%/10/1m/1m".parse::<KillSwitch>().is_err());
        assert!("15%/10/1m".parse::<KillSwitch>().is_err());
    }

    #[test]
    fn it_trips_only_past_the_ratio_of_at_least_the_minimum_attempts() {
        let (flow, trips) = counted(KillSwitch::default());
        let now = Instant::now();
        for _ in 0..9 {
            flow.record(&failed(), now);
        }
        assert!(!flow.is_open(), "9 attempts are below the minimum of 10");
        flow.record(&failed(), now);
        assert!(flow.is_open());
        assert_eq!(trips.0.load(Ordering::Relaxed), 1);

        let flow = Flow::new(Some(KillSwitch::default()), "h", "q", Observers::default());
        for _ in 0..90 {
            flow.record(&Outcome::Applied, now);
        }
        for _ in 0..15 {
            flow.record(&failed(), now);
        }
        assert!(!flow.is_open(), "15 of 105 is below 15%");
        flow.record(&failed(), now);
        assert!(flow.is_open(), "16 of 106 is above 15%");
    }

    #[test]
    fn duplicates_bad_input_and_permanent_errors_do_not_count() {
        let flow = Flow::new(Some(KillSwitch::default()), "h", "q", Observers::default());
        let permanent = Outcome::DeadLettered { kind: FailureKind::Handler, error: "bad".into() };
        let decode = Outcome::DeadLettered { kind: FailureKind::Decode, error: "not json".into() };
        for _ in 0..50 {
            flow.record(&permanent, Instant::now());
            flow.record(&decode, Instant::now());
            flow.record(&Outcome::Duplicate, Instant::now());
        }
        assert!(!flow.is_open());
        let no_switch = Flow::new(None, "h", "q", Observers::default());
        for _ in 0..50 {
            no_switch.record(&failed(), Instant::now());
        }
        assert!(!no_switch.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_limit_lets_one_seconds_worth_through_then_the_rate() {
        let rate = Rate::new(10);
        let started = tokio::time::Instant::now();
        assert_eq!(rate.take(64).await, 10, "one second's worth at once");
        let mut taken = 0;
        while taken < 50 {
            taken += rate.take(64).await;
        }
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(4_900) && took <= Duration::from_millis(5_100), "{took:?}");
        rate.give_back(3);
        assert_eq!(rate.take(64).await, 3, "what was given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_doubles_the_pause_and_a_passed_one_closes_it() {
        let switch = KillSwitch::default().min_attempts(1).pause(Duration::from_secs(1));
        let (flow, trips) = counted(switch);
        flow.record(&failed(), Instant::now());
        assert!(flow.is_open());
        flow.pause_over().await;
        let Phase::Probing { since } = flow.phase() else { panic!("probing after the pause") };
        // A straggler received before the probe began says nothing.
        flow.record(&failed(), since - Duration::from_millis(1));
        assert_eq!(flow.phase(), Phase::Probing { since });
        flow.record(&Outcome::Duplicate, since);
        assert_eq!(flow.probed().await, Probe::Inconclusive);
        flow.record(&failed(), since);
        assert_eq!(flow.probed().await, Probe::Failed);
        assert_eq!(flow.state().pause, Duration::from_secs(2));
        assert_eq!(trips.0.load(Ordering::Relaxed), 2);
        flow.pause_over().await;
        let Phase::Probing { since } = flow.phase() else { panic!("probing again") };
        flow.record(&Outcome::Applied, since);
        assert_eq!(flow.probed().await, Probe::Passed);
        assert_eq!(flow.phase(), Phase::Closed);
        assert_eq!(flow.state().pause, Duration::from_secs(1));
    }
}
