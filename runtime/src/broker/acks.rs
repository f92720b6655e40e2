//! Settling deliveries with the broker, for one channel session: single acks and
//! nacks, and one `multiple` ack for a run of deliveries where that is safe.
//!
//! `basic.ack(multiple)` with tag `T` acks *every* unacked delivery of the channel up
//! to `T`, including ones still in flight elsewhere, and a later ack of one of them
//! is a 406 that closes the channel. So a multiple ack is sent only below the
//! *watermark*: the lowest tag of this channel still undecided, or whose frame has
//! not gone out, other than the ones being acked. A tag is forgotten only once its
//! frame was sent, so every tag below the watermark is settled and the only unacked
//! tags a multiple ack covers are the ones it means to ack. No lock is held while a
//! frame goes out.
//!
//! Tags to ack *above* the watermark are **deferred**: the next multiple ack that the
//! watermark lets past them covers them (sent by whichever settlement moves the
//! watermark: an ack, a requeue, or a frame of its own going out). Lane pipelines
//! and concurrent batches settle out of tag order — on the bench's laned backlog 80%
//! of the acks went one by one before, each a frame through lapin and a message in
//! the broker's channel — and a deferred ack rides in a neighbour's multiple ack
//! instead. Deferred acks hold prefetch, so a slow neighbour must not keep them
//! long: an ack deferred for [`DEFER_AT_MOST`] goes alone (a flusher wakes for it
//! when nothing else settles), and so does every deferred ack past the prefetch
//! (or [`MAX_DEFERRED`], without one). A bound on the count alone did not do: at
//! half the prefetch, a backlog of sixteen lane pipelines sent 16,000 of its
//! 22,000 acks one by one, and the broker's CPU per delivery rose by a fifth. The
//! acks deferred when a channel dies are redelivered, as any unacked delivery is:
//! the dedup row makes that harmless.
//!
//! This relies on every delivery of the channel being [`Acks::received`] in delivery
//! order before any later one is settled: one consumer per channel, whose intake
//! registers each delivery as it takes it from the stream.
//!
//! Deliveries that go back to the queue go one by one, as [`REQUEUE`] says: never a
//! `multiple` nack (it would return every unacked tag below, in flight elsewhere or
//! not), and a `basic.nack`, not a `basic.reject`, so that on RabbitMQ 4.3+ a requeue
//! does not count towards a quorum queue's delivery limit.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Mutex;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Acker;

/// The most acks a channel without a prefetch limit defers (see the module docs);
/// past it, deferred acks go one by one.
pub(crate) const MAX_DEFERRED: usize = 4_096;

/// The longest an ack waits for the watermark; then it goes alone.
pub(crate) const DEFER_AT_MOST: Duration = Duration::from_millis(250);

/// The settling state of one channel.
#[derive(Debug)]
pub(crate) struct Acks {
    state: Mutex<State<Acker>>,
    /// Held while deferred acks go out other than by a settlement — the flusher's
    /// pass, the final [`flush`](Acks::flush) — so that the final flush starts once
    /// the flusher's frames are out.
    sending: tokio::sync::Mutex<()>,
    /// The channel's prefetch ([`MAX_DEFERRED`] without one): past it, deferred
    /// acks go one by one.
    max_deferred: usize,
}

/// Which tags are unsettled and which acks are deferred; `A` is what sends a tag's
/// ack (lapin's [`Acker`]; a unit in the tests).
#[derive(Debug)]
struct State<A> {
    /// Tags received whose ack or nack frame has not gone out yet (deferred ones
    /// aside). A tag leaves only after its frame was sent, so the watermark never
    /// passes a frame in flight.
    unsettled: BTreeSet<u64>,
    /// Tags to ack that wait for the watermark to pass them, with their ackers and
    /// since when.
    deferred: BTreeMap<u64, (A, Instant)>,
}

impl<A> Default for State<A> {
    fn default() -> Self {
        Self { unsettled: BTreeSet::new(), deferred: BTreeMap::new() }
    }
}

/// The frames one [`Acks::ack`] sends: a run below the watermark (one `multiple`
/// ack, or one ack), and deferred acks past the bounds (one by one). Every tag in
/// either is unsettled until its frame is out.
struct Plan<A> {
    run: Vec<(u64, A)>,
    overflow: Vec<(u64, A)>,
}

impl<A> State<A> {
    /// The lowest tag still unsettled, but for `ours`.
    fn watermark(&self, ours: &BTreeSet<u64>) -> u64 {
        self.unsettled.iter().find(|tag| !ours.contains(tag)).copied().unwrap_or(u64::MAX)
    }

    /// Takes the deferred acks below `watermark` to send now: unsettled again until
    /// their frame is out.
    fn take_deferred_below(&mut self, watermark: u64) -> Vec<(u64, A)> {
        let kept = self.deferred.split_off(&watermark);
        let taken = std::mem::replace(&mut self.deferred, kept);
        self.unsettled.extend(taken.keys().copied());
        taken.into_iter().map(|(tag, (acker, _))| (tag, acker)).collect()
    }

    /// What acking `ours` at `now` sends: ours below the watermark with the deferred
    /// acks below it; ours above it deferred; and one by one the acks deferred since
    /// [`DEFER_AT_MOST`] before `now`, or every deferred ack once more than
    /// `max_deferred` wait.
    fn plan_ack(&mut self, ours: Vec<(u64, A)>, max_deferred: usize, now: Instant) -> Plan<A> {
        let tags: BTreeSet<u64> = ours.iter().map(|(tag, _)| *tag).collect();
        let watermark = self.watermark(&tags);
        let mut run = self.take_deferred_below(watermark);
        for (tag, acker) in ours {
            if tag < watermark {
                run.push((tag, acker));
            } else {
                self.unsettled.remove(&tag);
                self.deferred.insert(tag, (acker, now));
            }
        }
        let overflow = self.overdue(max_deferred, now);
        Plan { run, overflow }
    }

    /// The deferred acks to send one by one at `now`: every one past `max_deferred`,
    /// else those deferred for [`DEFER_AT_MOST`]. Unsettled again until their frames
    /// are out.
    fn overdue(&mut self, max_deferred: usize, now: Instant) -> Vec<(u64, A)> {
        let overdue: Vec<u64> = if self.deferred.len() > max_deferred {
            self.deferred.keys().copied().collect()
        } else {
            let since = now.checked_sub(DEFER_AT_MOST);
            self.deferred
                .iter()
                .filter(|(_, (_, deferred))| since.is_some_and(|since| *deferred <= since))
                .map(|(tag, _)| *tag)
                .collect()
        };
        self.unsettled.extend(overdue.iter().copied());
        overdue
            .into_iter()
            .filter_map(|tag| self.deferred.remove(&tag).map(|(acker, _)| (tag, acker)))
            .collect()
    }

    /// The deferred acks the watermark has passed, to send now.
    fn due(&mut self) -> Vec<(u64, A)> {
        let watermark = self.watermark(&BTreeSet::new());
        self.take_deferred_below(watermark)
    }

    /// Every deferred ack, to send now: those the watermark has passed as the run
    /// (one `multiple` ack), the rest as overflow (one by one: a frame below them is
    /// still out).
    fn flush(&mut self) -> Plan<A> {
        let run = self.due();
        let overflow = self.take_deferred_below(u64::MAX);
        Plan { run, overflow }
    }
}

/// How a delivery goes back to its queue: one `basic.nack` of its own tag, with
/// `requeue`.
///
/// - **Never `multiple`.** A multiple nack settles *every* unacked delivery of the
///   channel up to its tag, including ones still running elsewhere, whose own
///   settlement would then be a 406 that closes the channel. Acks may go as one
///   `multiple` below the watermark because every tag there is settled already;
///   requeues are rare and go one by one, so a requeue only ever returns the
///   delivery it names. (Invariant, checked when compiling: see below.)
/// - **`nack`, not `reject`.** From RabbitMQ 4.3 on, a quorum queue counts a
///   `basic.reject` with requeue as a failed delivery (`x-delivery-count` + 1; the
///   queue's `x-delivery-limit`, RabbitMQ's default 20 or idemq's
///   `delivery_limit + BROKER_LIMIT_MARGIN`, dead-letters at it), and a
///   `basic.nack` with requeue as "not processed", which it does not count (its
///   `x-acquired-count` still goes up). idemq requeues only what it has not
///   finished — a database outage past `database_retry_limit`, a fault that stops
///   the runtime, a shutdown, a retry or dead-letter copy it could not publish, a
///   delivery its batch left undecided — none of them the message's fault, so none
///   brings it nearer the broker's limit. Handler failures are counted by idemq
///   itself: retry copies carry the attempt, and poison is judged by the handler
///   starts it records (`idemq_started`).
pub(crate) const REQUEUE: BasicNackOptions = BasicNackOptions { multiple: false, requeue: true };

// One tag, never the run below it; back to the queue, not dropped or dead-lettered.
const _: () = assert!(!REQUEUE.multiple && REQUEUE.requeue, "a requeue returns only the delivery it names");

/// Whether each frame was sent (`false`: the channel is gone, the broker redelivers).
pub(crate) type Sent = lapin::Result<bool>;

/// The longest one ack or nack frame may take to go out. A connection whose I/O
/// died may never answer; the lock must not be held forever (the broker redelivers
/// whatever was not settled).
const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

async fn bounded(frame: impl Future<Output = Sent>) -> Sent {
    tokio::time::timeout(FRAME_TIMEOUT, frame).await.unwrap_or(Ok(false))
}

impl Acks {
    /// The state of a channel consuming with `prefetch` (0: no limit).
    pub(crate) fn new(prefetch: u16) -> Self {
        let max_deferred = if prefetch == 0 { MAX_DEFERRED } else { usize::from(prefetch) };
        Self { state: Mutex::default(), sending: tokio::sync::Mutex::new(()), max_deferred }
    }

    /// Sends, one by one, the acks deferred for [`DEFER_AT_MOST`] when nothing else
    /// settles on the channel (a neighbour stuck below them: without this their
    /// prefetch would stay held), until the channel's `Acks` are dropped.
    pub(crate) fn flush_overdue_acks(acks: &Arc<Self>) {
        let acks: Weak<Self> = Arc::downgrade(acks);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(DEFER_AT_MOST / 2);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(acks) = acks.upgrade() else { return };
                let _sending = acks.sending.lock().await;
                let overdue = acks.lock().overdue(acks.max_deferred, Instant::now());
                send_alone(&overdue).await;
                acks.settled(overdue.into_iter().map(|(tag, _)| tag)).await;
            }
        });
    }

    /// Sends every ack still deferred, once the flusher's frames are out: those the
    /// watermark lets past in one `multiple` ack, any above a frame still out one by
    /// one. Called on a shutdown after the last delivery is settled, before the
    /// channel closes: a deferred ack the close overtook returned its delivery,
    /// applied and committed, to the queue — a duplicate for the next consumer, and a
    /// queue not empty after a drained backlog (a bench run left 362 so, the
    /// flusher's single acks still going out when the channel closed).
    pub(crate) async fn flush(&self) {
        let _sending = self.sending.lock().await;
        let Plan { run, overflow } = self.lock().flush();
        let _ = send_run(&run).await;
        send_alone(&overflow).await;
        self.settled(run.iter().chain(&overflow).map(|(tag, _)| *tag)).await;
    }

    /// Registers a delivery as taken from the channel's stream.
    pub(crate) fn received(&self, delivery: &Delivery) {
        self.lock().unsettled.insert(delivery.delivery_tag);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Acker>> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets tags whose frames went out, then acks the deferred tags that lets
    /// past the watermark — whose frames going out may let more past, until none.
    async fn settled(&self, tags: impl IntoIterator<Item = u64>) {
        let mut sent: Vec<u64> = tags.into_iter().collect();
        loop {
            let due = {
                let mut state = self.lock();
                for tag in &sent {
                    state.unsettled.remove(tag);
                }
                state.due()
            };
            if due.is_empty() {
                return;
            }
            let _ = send_run(&due).await;
            sent = due.into_iter().map(|(tag, _)| tag).collect();
        }
    }

    /// Acks `deliveries` (of this channel): those below the watermark, with the
    /// deferred acks below it, in one `multiple` ack; those above it deferred (and
    /// overdue deferred acks one by one). Returns one result per delivery, in order:
    /// a deferred ack counts as sent (if its channel dies first, the broker
    /// redelivers, as for any unacked delivery).
    pub(crate) async fn ack(&self, deliveries: &[&Delivery]) -> Vec<Sent> {
        let ours = deliveries.iter().map(|d| (d.delivery_tag, d.acker.clone())).collect();
        let Plan { run, overflow } = self.lock().plan_ack(ours, self.max_deferred, Instant::now());
        let run_sent = send_run(&run).await;
        let mut singles = send_alone(&overflow).await;
        let in_run: BTreeSet<u64> = run.iter().map(|(tag, _)| *tag).collect();
        let sent = deliveries
            .iter()
            .map(|delivery| {
                let tag = delivery.delivery_tag;
                if in_run.contains(&tag) {
                    clone_result(&run_sent)
                } else {
                    singles.remove(&tag).unwrap_or(Ok(true))
                }
            })
            .collect();
        self.settled(run.iter().chain(&overflow).map(|(tag, _)| *tag)).await;
        sent
    }

    /// Nacks one delivery with requeue.
    pub(crate) async fn requeue(&self, delivery: &Delivery) -> Sent {
        self.requeue_tag(delivery.delivery_tag, &delivery.acker).await
    }

    /// Like [`requeue`](Self::requeue), for a delivery known by its tag and acker.
    pub(crate) async fn requeue_tag(&self, tag: u64, acker: &Acker) -> Sent {
        let sent = bounded(acker.nack(REQUEUE)).await;
        self.settled([tag]).await;
        sent
    }

    /// Acks one delivery.
    pub(crate) async fn ack_one(&self, delivery: &Delivery) -> Sent {
        self.ack(&[delivery]).await.pop().unwrap_or(Ok(false))
    }
}

/// Acks a run of tags, all below the watermark: one `multiple` ack with the
/// highest's acker, or the one's own ack.
async fn send_run(run: &[(u64, Acker)]) -> Sent {
    match run.iter().max_by_key(|(tag, _)| *tag) {
        None => Ok(true),
        Some((_, acker)) => {
            let multiple = run.len() > 1;
            bounded(acker.ack(BasicAckOptions { multiple })).await
        }
    }
}

/// Acks each of `acks` with a frame of its own; each tag's result.
async fn send_alone(acks: &[(u64, Acker)]) -> BTreeMap<u64, Sent> {
    let mut sent = BTreeMap::new();
    for (tag, acker) in acks {
        sent.insert(*tag, bounded(acker.ack(BasicAckOptions::default())).await);
    }
    sent
}

fn clone_result(result: &lapin::Result<bool>) -> lapin::Result<bool> {
    match result {
        Ok(sent) => Ok(*sent),
        // lapin's error is not Clone; the channel is gone either way.
        Err(_) => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn received(tags: impl IntoIterator<Item = u64>) -> State<()> {
        State { unsettled: tags.into_iter().collect(), deferred: BTreeMap::new() }
    }

    fn ours(tags: impl IntoIterator<Item = u64>) -> Vec<(u64, ())> {
        tags.into_iter().map(|tag| (tag, ())).collect()
    }

    fn now() -> Instant {
        Instant::now()
    }

    fn tags(frames: &[(u64, ())]) -> Vec<u64> {
        let mut tags: Vec<u64> = frames.iter().map(|(tag, ())| *tag).collect();
        tags.sort_unstable();
        tags
    }

    /// `plan`'s frames went out: their tags leave the unsettled ones.
    fn sent(state: &mut State<()>, plan: &Plan<()>) {
        for (tag, ()) in plan.run.iter().chain(&plan.overflow) {
            state.unsettled.remove(tag);
        }
    }

    #[test]
    fn deliveries_settled_in_order_go_in_one_run_and_nothing_waits() {
        let mut state = received(1..=6);
        let plan = state.plan_ack(ours(1..=3), 8, now());
        assert_eq!(tags(&plan.run), [1, 2, 3]);
        assert!(plan.overflow.is_empty() && state.deferred.is_empty());
    }

    #[test]
    fn acks_above_an_unsettled_neighbour_wait_and_ride_in_its_run() {
        let mut state = received(1..=6);
        // A lane pipeline finishes 4..=6 while 1..=3 still run: nothing goes out.
        let first = state.plan_ack(ours(4..=6), 8, now());
        assert!(first.run.is_empty() && first.overflow.is_empty());
        assert_eq!(state.deferred.keys().copied().collect::<Vec<_>>(), [4, 5, 6]);
        // The neighbour's run covers both: one multiple ack up to 6.
        let second = state.plan_ack(ours(1..=3), 8, now());
        assert_eq!(tags(&second.run), [1, 2, 3, 4, 5, 6]);
        sent(&mut state, &second);
        assert!(state.unsettled.is_empty() && state.deferred.is_empty());
    }

    #[test]
    fn a_deferred_ack_never_passes_a_frame_still_in_flight() {
        let mut state = received(1..=4);
        // 1 is being acked (its frame not yet out) when 3 is acked: 3 waits.
        let first = state.plan_ack(ours([1]), 8, now());
        assert_eq!(tags(&first.run), [1]);
        let second = state.plan_ack(ours([3]), 8, now());
        assert!(second.run.is_empty(), "1 is still unsettled");
        // 1's frame is out and 2 is requeued: the watermark passes 3, which is due.
        sent(&mut state, &first);
        state.unsettled.remove(&2);
        assert_eq!(tags(&state.due()), [3]);
        assert!(state.unsettled.contains(&3), "unsettled again until its own frame is out");
        assert_eq!(state.watermark(&BTreeSet::new()), 3);
    }

    #[test]
    fn past_the_bound_every_deferred_ack_goes_one_by_one() {
        let mut state = received(1..=10);
        let first = state.plan_ack(ours(2..=4), 4, now());
        assert!(first.overflow.is_empty());
        // A slow delivery (1) holds the watermark: past 4 deferred, all go alone.
        let second = state.plan_ack(ours(5..=6), 4, now());
        assert!(second.run.is_empty());
        assert_eq!(tags(&second.overflow), [2, 3, 4, 5, 6]);
        assert!(state.deferred.is_empty());
        assert!((2..=6).all(|tag| state.unsettled.contains(&tag)), "unsettled until their frames are out");
    }

    #[test]
    fn an_ack_deferred_for_too_long_goes_alone_and_a_fresh_one_waits() {
        let mut state = received(1..=10);
        let start = now();
        let first = state.plan_ack(ours(2..=3), 8, start);
        assert!(first.overflow.is_empty(), "just deferred");
        // A slow delivery (1) still holds the watermark past the limit: the old acks
        // go alone, the one deferred now waits.
        let later = start + DEFER_AT_MOST;
        let second = state.plan_ack(ours([5]), 8, later);
        assert!(second.run.is_empty());
        assert_eq!(tags(&second.overflow), [2, 3]);
        assert_eq!(state.deferred.keys().copied().collect::<Vec<_>>(), [5]);
        // With nothing else settling, the flusher's look finds 5 overdue in turn.
        assert!(state.overdue(8, later + DEFER_AT_MOST / 2).is_empty());
        assert_eq!(tags(&state.overdue(8, later + DEFER_AT_MOST)), [5]);
        assert!(state.unsettled.contains(&5), "unsettled until its frame is out");
    }

    #[test]
    fn a_final_flush_sends_every_deferred_ack_those_above_a_frame_still_out_alone() {
        let mut state = received(1..=6);
        let plan = state.plan_ack(ours([3, 5]), 100, now());
        assert!(plan.run.is_empty(), "1 is unsettled: 3 and 5 wait");
        state.unsettled.remove(&1); // 1's frame went out
        let plan = state.plan_ack(ours([6]), 100, now());
        assert!(plan.run.is_empty(), "2 is unsettled: 6 waits");
        let plan = state.flush();
        assert_eq!(tags(&plan.run), Vec::<u64>::new(), "2 is still out: nothing may go as multiple");
        assert_eq!(tags(&plan.overflow), vec![3, 5, 6]);
        assert!(state.deferred.is_empty());

        let mut state = received(1..=4);
        let _ = state.plan_ack(ours([2, 4]), 100, now());
        state.unsettled.remove(&1); // 1's frame went out; 3's is still out
        let plan = state.flush();
        assert_eq!(tags(&plan.run), vec![2], "below 3: one multiple ack");
        assert_eq!(tags(&plan.overflow), vec![4], "above 3: alone");
    }

    #[test]
    fn a_channel_defers_at_most_its_prefetch() {
        assert_eq!(Acks::new(0).max_deferred, MAX_DEFERRED, "no prefetch limit");
        assert_eq!(Acks::new(8).max_deferred, 8);
        assert_eq!(Acks::new(u16::MAX).max_deferred, usize::from(u16::MAX));
    }
}
