//! The lanes of a consumer whose handler has one: its deliveries wait in *slots*
//! (a lane value always hashes to the same slot), and one scheduler forms batches
//! from the slots that have no batch running ([`Lanes::schedule`]).
//!
//! - **A lane never runs twice at once, nor out of order.** A batch marks every slot
//!   it takes from as busy until it ends; a slot's deliveries are taken in arrival
//!   order. So batches running side by side never hold the same lane's rows.
//! - **A batch takes the oldest deliveries of every idle slot**, in arrival order, up
//!   to the batch size (as the handler's pace allows, `base::pace`): on a backlog a
//!   transaction carries many lanes, not one slot's share. A batch per slot drained a
//!   laned backlog in sixteen small transactions at once (about 130 deliveries each
//!   on the bench), and their fixed cost (BEGIN, the claim, COMMIT and its flush, a
//!   round trip per statement, a relay pass) took the CPU the broker and PostgreSQL
//!   needed: one transaction of 500 at a time ran at ×0.99 of the hand-written loop,
//!   sixteen of 130 at ×0.80.
//! - **A batch that is not full waits for room**: it starts only while fewer than
//!   [`ROOM`] batches run, or once its oldest delivery has waited [`ROOM_WAIT`],
//!   taking what arrives meanwhile. A full batch starts at once: a slow handler's
//!   pace makes its batches small, so they still run side by side.
//! - A delivery that must run alone (a redelivery, see `delivery::life`) is a batch
//!   of its own, and its slot's later deliveries wait for it.
//!
//! At most `concurrency` batches run at once, each with one of the runtime's
//! permits. When the intake ends ([`Lanes::end`]) the scheduler runs what the slots
//! hold, waits for the batches running, and returns.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::engine::delivery::{Consumer, Item};

/// The fewest slots lane values hash to (a consumer with more concurrency has one
/// per unit): more slots than batches at once, so that small batches of a slow
/// handler, each taking a few slots, still find idle ones.
const SLOTS: usize = 64;

/// How many of one consumer's batches that are not full may run at once: one
/// writing while another commits.
const ROOM: usize = 2;

/// The longest a delivery waits for room in a batch that is not full.
const ROOM_WAIT: Duration = Duration::from_millis(100);

/// One laned consumer's slots and its scheduler's state.
pub(super) struct Lanes {
    state: Mutex<State<Item>>,
    /// Told when a delivery arrives, a batch ends or the intake ends.
    changed: Notify,
    /// Slots, fixed at the start.
    slots: usize,
}

/// A delivery waiting in its slot.
struct Waiting<T> {
    /// Arrival order across all slots.
    seq: u64,
    arrived: Instant,
    item: T,
}

/// The slots, over any kind of delivery (an [`Item`] in the runtime, a number in
/// the tests).
struct State<T> {
    slots: Vec<VecDeque<Waiting<T>>>,
    /// Whether a batch running holds deliveries of the slot.
    busy: Vec<bool>,
    next_seq: u64,
    /// Batches running.
    running: usize,
    /// The intake ended: no more deliveries come; run what is left without waiting.
    ended: bool,
}

/// The scheduler's next step.
#[derive(Debug)]
enum Next<T> {
    /// Run `batch`, which holds deliveries of `slots`.
    Run { batch: Vec<T>, slots: Vec<usize> },
    /// Nothing to start before something changes, or before this instant.
    Wait(Option<Instant>),
    /// The intake ended, and everything it took has run.
    Done,
}

impl Lanes {
    /// The lanes of a consumer running at most `concurrency` batches at once.
    pub(super) fn new(concurrency: usize) -> Self {
        let slots = concurrency.max(SLOTS);
        Self { state: Mutex::new(State::new(slots)), changed: Notify::new(), slots }
    }

    /// The slot of a lane value: a stable hash, so one process always puts one lane
    /// in one slot.
    pub(super) fn slot_of(&self, lane: &str) -> usize {
        use std::hash::{Hash, Hasher};
        // SipHash with fixed keys: the same in every run.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        lane.hash(&mut hasher);
        usize::try_from(hasher.finish() % self.slots as u64).unwrap_or(0)
    }

    /// How many slots there are.
    pub(super) fn slots(&self) -> usize {
        self.slots
    }

    /// A delivery for `slot`.
    pub(super) fn push(&self, slot: usize, item: Item) {
        self.lock().push(slot % self.slots, item, Instant::now());
        self.changed.notify_one();
    }

    /// The intake ended: the scheduler runs what is left, then returns.
    pub(super) fn end(&self) {
        self.lock().ended = true;
        self.changed.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Item>> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The scheduler: starts each batch [`State::next`] forms as a task (tracked by
    /// `tracker`, with one of the runtime's `permits`), until the intake ended and
    /// every batch has run.
    pub(super) async fn schedule(
        self: Arc<Self>,
        consumer: Arc<Consumer>,
        permits: Arc<Semaphore>,
        hard_stop: CancellationToken,
        tracker: TaskTracker,
    ) {
        let concurrency = consumer.batch.pipelines.max(1);
        loop {
            let (most, linger) = (consumer.batch_most(), consumer.batch.linger);
            let next = self.lock().next(most, linger, concurrency, Instant::now(), Item::runs_alone);
            match next {
                Next::Run { batch, slots } => {
                    let running = Running { lanes: Arc::clone(&self), slots };
                    let (consumer, permits, hard_stop) =
                        (Arc::clone(&consumer), Arc::clone(&permits), hard_stop.clone());
                    tracker.spawn(async move {
                        let permit = permits.acquire_owned().await.expect("the semaphore is never closed");
                        consumer.process(batch, &hard_stop).await;
                        drop((permit, running));
                    });
                }
                Next::Wait(Some(until)) => {
                    tokio::select! {
                        () = self.changed.notified() => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                }
                Next::Wait(None) => self.changed.notified().await,
                Next::Done => return,
            }
        }
    }
}

/// A running batch's hold on its slots, let go when it ends (or its task panics).
struct Running {
    lanes: Arc<Lanes>,
    slots: Vec<usize>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.lanes.lock().finished(&self.slots);
        self.lanes.changed.notify_one();
    }
}

impl<T> State<T> {
    fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots).map(|_| VecDeque::new()).collect(),
            busy: vec![false; slots],
            next_seq: 0,
            running: 0,
            ended: false,
        }
    }

    fn push(&mut self, slot: usize, item: T, arrived: Instant) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.slots[slot].push_back(Waiting { seq, arrived, item });
    }

    /// The next batch, of at most `most` deliveries, with at most `concurrency`
    /// batches running; `alone` says which deliveries run alone (see the module
    /// docs).
    fn next(
        &mut self,
        most: usize,
        linger: Duration,
        concurrency: usize,
        now: Instant,
        alone: impl Fn(&T) -> bool,
    ) -> Next<T> {
        let most = most.max(1);
        if self.running >= concurrency {
            return Next::Wait(None);
        }
        // The idle slots' oldest deliveries, oldest first.
        let mut heads: BinaryHeap<Reverse<(u64, usize)>> = (0..self.slots.len())
            .filter(|&slot| !self.busy[slot])
            .filter_map(|slot| self.slots[slot].front().map(|waiting| Reverse((waiting.seq, slot))))
            .collect();
        let Some(&Reverse((_, oldest))) = heads.peek() else {
            let drained = self.ended && self.running == 0 && self.slots.iter().all(VecDeque::is_empty);
            return if drained { Next::Done } else { Next::Wait(None) };
        };
        let first = &self.slots[oldest][0];
        let arrived = first.arrived;
        if alone(&first.item) {
            let waiting = self.slots[oldest].pop_front().expect("a head");
            return self.start(vec![waiting.item], vec![oldest]);
        }
        // How many could go now: each idle slot's up to its first that runs alone.
        let ready = heads
            .iter()
            .map(|Reverse((_, slot))| self.slots[*slot].iter().take_while(|w| !alone(&w.item)).count())
            .sum::<usize>()
            .min(most);
        let full = ready >= most;
        if !full && !self.ended {
            let waited = now.saturating_duration_since(arrived);
            if waited < linger {
                return Next::Wait(Some(arrived + linger));
            }
            if self.running >= ROOM && waited < ROOM_WAIT {
                return Next::Wait(Some(arrived + ROOM_WAIT));
            }
        }
        let mut batch = Vec::with_capacity(ready);
        let mut slots = Vec::new();
        while batch.len() < most {
            let Some(Reverse((_, slot))) = heads.pop() else { break };
            batch.push(self.slots[slot].pop_front().expect("a head").item);
            if !slots.contains(&slot) {
                slots.push(slot);
            }
            if let Some(next) = self.slots[slot].front() {
                if !alone(&next.item) {
                    heads.push(Reverse((next.seq, slot)));
                }
            }
        }
        self.start(batch, slots)
    }

    /// Marks `slots` busy and counts the batch running.
    fn start(&mut self, batch: Vec<T>, slots: Vec<usize>) -> Next<T> {
        for &slot in &slots {
            self.busy[slot] = true;
        }
        self.running += 1;
        Next::Run { batch, slots }
    }

    /// A batch of `slots` ended.
    fn finished(&mut self, slots: &[usize]) {
        for &slot in slots {
            self.busy[slot] = false;
        }
        self.running -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A delivery in the tests: its lane's slot and a number; 0 runs alone.
    type D = (usize, u32);

    fn alone(d: &D) -> bool {
        d.1 == 0
    }

    fn state(deliveries: &[D], now: Instant) -> State<D> {
        let mut state = State::new(8);
        for &d in deliveries {
            state.push(d.0, d, now);
        }
        state
    }

    fn next(state: &mut State<D>, most: usize, now: Instant) -> Next<D> {
        state.next(most, Duration::ZERO, 16, now, alone)
    }

    fn run(next: Next<D>) -> (Vec<u32>, Vec<usize>) {
        match next {
            Next::Run { batch, mut slots } => {
                slots.sort_unstable();
                (batch.into_iter().map(|d| d.1).collect(), slots)
            }
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    #[test]
    fn a_backlog_across_lanes_goes_in_one_batch_of_the_oldest_deliveries() {
        let now = Instant::now();
        let mut state = state(&[(0, 1), (1, 2), (2, 3), (0, 4), (3, 5), (1, 6)], now);
        let (batch, slots) = run(next(&mut state, 4, now));
        assert_eq!(batch, [1, 2, 3, 4], "arrival order, across slots, up to the batch size");
        assert_eq!(slots, [0, 1, 2]);
        // 5's slot is idle; 6's slot is busy (its lane's 2 runs): only 5 may go.
        let (batch, slots) = run(next(&mut state, 4, now));
        assert_eq!((batch, slots), (vec![5], vec![3]));
    }

    #[test]
    fn a_lane_waits_until_its_running_batch_ends() {
        let now = Instant::now();
        let mut state = state(&[(0, 1), (0, 2)], now);
        let (batch, slots) = run(next(&mut state, 1, now));
        assert_eq!(batch, [1]);
        assert!(matches!(next(&mut state, 1, now), Next::Wait(None)), "2's lane is running");
        state.finished(&slots);
        assert_eq!(run(next(&mut state, 1, now)).0, [2]);
    }

    #[test]
    fn a_batch_that_is_not_full_waits_for_room_and_a_full_one_does_not() {
        let now = Instant::now();
        let mut state = state(&[(0, 1), (1, 2)], now);
        assert_eq!(run(next(&mut state, 1, now)).0, [1]);
        assert_eq!(run(next(&mut state, 8, now)).0, [2], "one runs: room for another");
        // Two run: a batch that is not full waits, at most ROOM_WAIT.
        state.push(3, (3, 3), now);
        assert!(matches!(next(&mut state, 8, now), Next::Wait(Some(until)) if until == now + ROOM_WAIT));
        assert_eq!(run(next(&mut state, 8, now + ROOM_WAIT)).0, [3]);
        // A full batch (a slow handler's are small) goes at once.
        state.push(4, (4, 4), now);
        assert_eq!(run(next(&mut state, 1, now)).0, [4]);
    }

    #[test]
    fn a_delivery_that_runs_alone_is_a_batch_of_its_own_and_its_lane_waits() {
        let now = Instant::now();
        let mut state = state(&[(0, 0), (0, 1), (1, 2), (1, 0), (1, 3)], now);
        let (batch, slots) = run(next(&mut state, 8, now));
        assert_eq!((batch, slots.clone()), (vec![0], vec![0]));
        // The others: slot 1's up to its own that runs alone.
        assert_eq!(run(next(&mut state, 8, now)).0, [2]);
        state.finished(&slots);
        assert_eq!(run(next(&mut state, 8, now)).0, [1]);
    }

    #[test]
    fn at_most_concurrency_batches_run() {
        let now = Instant::now();
        let mut state = state(&[(0, 1), (1, 2), (2, 3)], now);
        let mut running = Vec::new();
        for _ in 0..2 {
            running.push(run(state.next(1, Duration::ZERO, 2, now, alone)));
        }
        assert!(matches!(state.next(1, Duration::ZERO, 2, now, alone), Next::Wait(None)));
        let (_, slots) = running.pop().expect("two ran");
        state.finished(&slots);
        assert_eq!(run(state.next(1, Duration::ZERO, 2, now, alone)).0, [3]);
    }

    #[test]
    fn after_the_intake_ends_what_is_left_runs_at_once_then_it_is_done() {
        let now = Instant::now();
        let linger = Duration::from_secs(1);
        let mut state = state(&[(0, 1), (1, 2)], now);
        assert!(matches!(state.next(8, linger, 16, now, alone), Next::Wait(Some(_))), "lingers for more");
        state.ended = true;
        let (batch, slots) = run(state.next(8, linger, 16, now, alone));
        assert_eq!(batch, [1, 2], "no more come: no linger");
        assert!(matches!(next(&mut state, 8, now), Next::Wait(None)), "a batch still runs");
        state.finished(&slots);
        assert!(matches!(next(&mut state, 8, now), Next::Done));
    }
}
