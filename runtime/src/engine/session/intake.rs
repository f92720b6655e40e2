//! A consumer's intake: its stream of deliveries into batches, each run as a task
//! ([`consume`]), or, for a handler with a lane, into the lane pipelines
//! ([`consume_in_lanes`]) — until the stream ends ([`Loss`]) or the session stops.
//! A queue consumed by several handlers, one per message type, has one stream and
//! a router in front of its handlers' intakes ([`consume_routed`]). A handler's rate
//! limit is taken here, a token per delivery started; its kill switch pauses the
//! intake (`pause`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::BasicCancelOptions;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::loss::Loss;
use super::pause::{pause, Ended};
use super::source::{registered, Next, Source};
use super::{bounded, closed};
use crate::base::pace::Pace;
use crate::engine::delivery::{Consumer, Item};

/// What an intake loop needs from the session's context.
#[derive(Clone)]
pub(super) struct Intake {
    pub(super) permits: Arc<Semaphore>,
    pub(super) tracker: TaskTracker,
    pub(super) hard_stop: CancellationToken,
}

/// One consumer's intake loop. Returns why it stopped on its own (the channel or
/// connection went away, or the broker cancelled the consumer, e.g. because its
/// queue was deleted); after `stop` it cancels the consumer and returns
/// [`Loss::Stopped`].
///
/// A handler without a lane: receive a delivery, wait for a slot (one running
/// transaction), take whatever else has arrived, and run a batch of it as a task —
/// its share among the idle slots, up to the batch size as the handler's pace
/// allows (`base::pace`; waiting at most the linger for more) — repeat. Receiving
/// comes first: a consumer waiting on an idle queue holds no permit, so it cannot
/// starve the busy ones. A handler with a lane: see [`consume_in_lanes`].
pub(super) async fn consume(
    consumer: Arc<Consumer>,
    mut stream: Source,
    tag: String,
    intake: Intake,
    stop: CancellationToken,
) -> Loss {
    if consumer.handler.lane_path().is_some() {
        return consume_in_lanes(consumer, stream, tag, intake, stop).await;
    }
    let mut taken = Taken { pending: VecDeque::new(), ended: None };
    let loss = loop {
        if taken.pending.is_empty() {
            if let Some(loss) = taken.ended.take() {
                break Some(loss);
            }
            tokio::select! {
                () = stop.cancelled() => break None,
                next = stream.next(&consumer) => match next {
                    Next::Delivery(delivery) => taken.pending.push_back(delivery),
                    Next::Ended(loss) => break Some(loss),
                },
            }
        }
        if consumer.flow.is_open() {
            match pause(&consumer, &mut stream, &mut taken.pending, &tag, &intake.hard_stop, &stop).await {
                Ok(()) => continue,
                Err(Ended::Stopped) => return Loss::Stopped,
                Err(Ended::Lost(loss)) => break Some(loss),
            }
        }
        // A rate-limited handler: a token per delivery of the batch, taken before a
        // slot, so that waiting for tokens holds none of the runtime's permits.
        let granted = match &consumer.rate {
            Some(rate) => tokio::select! {
                granted = rate.take(taken.pending.len().min(consumer.batch_most())) => granted,
                () = stop.cancelled() => break None,
                () = closed(&consumer.channel) => break Some(closing_reason(&consumer, &mut stream).await),
            },
            None => consumer.batch_most(),
        };
        let slot = tokio::select! {
            slot = BatchSlot::take(&consumer, &intake.permits) => slot,
            () = stop.cancelled() => break None,
            // Waiting for a slot must not hide a dead channel: its deliveries can no
            // longer be settled (the broker requeues them), and the session must end.
            () = closed(&consumer.channel) => break Some(closing_reason(&consumer, &mut stream).await),
        };
        taken.arrived(&consumer, &mut stream).await;
        // Share what waits with the idle transaction slots: a few deliveries and free
        // slots run side by side (slow handlers stay concurrent), a backlog fills
        // whole batches.
        let idle = intake.permits.available_permits().min(consumer.width.free()) + 1;
        let mut batch = taken.batch(&consumer, idle, granted);
        taken.linger(&consumer, &mut stream, &mut batch, granted).await;
        if let Some(rate) = &consumer.rate {
            rate.give_back(granted.saturating_sub(batch.len()));
        }
        let batch_consumer = Arc::clone(&consumer);
        let hard_stop = intake.hard_stop.clone();
        intake.tracker.spawn(async move {
            batch_consumer.process(batch, &hard_stop).await;
            drop(slot);
        });
    };
    for delivery in taken.pending {
        if !consumer.channel.status().connected() {
            consumer.shared.unstarted.remember(&consumer.queue, &delivery);
        }
        let _ = consumer.acks.requeue(&delivery).await;
    }
    intake_ended(&consumer, &stream, &tag, loss).await
}

/// What an intake has taken from its stream and not yet put in a batch, and why the
/// stream ended, if it has (reported once what was taken has run).
struct Taken {
    pending: VecDeque<Delivery>,
    ended: Option<Loss>,
}

impl Taken {
    /// Takes whatever has arrived meanwhile, without waiting.
    async fn arrived(&mut self, consumer: &Consumer, stream: &mut Source) {
        while self.ended.is_none() {
            match next_within(consumer, stream, Duration::ZERO).await {
                None => break,
                Some(Next::Delivery(delivery)) => self.pending.push_back(delivery),
                Some(Next::Ended(loss)) => self.ended = Some(loss),
            }
        }
    }

    /// The next batch: the pending deliveries' share among `idle` slots, up to the
    /// batch size and the `granted` tokens; a redelivered message runs in a batch of
    /// its own.
    fn batch(&mut self, consumer: &Consumer, idle: usize, granted: usize) -> Vec<Item> {
        let share = self.pending.len().div_ceil(idle).clamp(1, consumer.batch_most().min(granted).max(1));
        let mut batch = Vec::with_capacity(share);
        while batch.len() < share {
            match self.pending.front() {
                Some(next) if next.redelivered && !batch.is_empty() => break,
                Some(_) => {}
                None => break,
            }
            let Some(delivery) = self.pending.pop_front() else { break };
            let alone = delivery.redelivered;
            batch.push(Item::new(delivery, consumer, None));
            if alone {
                break;
            }
        }
        batch
    }

    /// With a linger, and nothing else waiting, fills `batch` with what arrives
    /// within it; a redelivered message is kept for a batch of its own.
    async fn linger(
        &mut self,
        consumer: &Consumer,
        stream: &mut Source,
        batch: &mut Vec<Item>,
        granted: usize,
    ) {
        let limits = consumer.batch;
        let most = consumer.batch_most().min(granted);
        if limits.linger.is_zero()
            || self.ended.is_some()
            || !self.pending.is_empty()
            || batch[0].runs_alone()
        {
            return;
        }
        let deadline = tokio::time::Instant::now() + limits.linger;
        while batch.len() < most {
            let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
            match next_within(consumer, stream, wait).await {
                None => break,
                Some(Next::Delivery(delivery)) if delivery.redelivered => {
                    self.pending.push_back(delivery);
                    break;
                }
                Some(Next::Delivery(delivery)) => batch.push(Item::new(delivery, consumer, None)),
                Some(Next::Ended(loss)) => {
                    self.ended = Some(loss);
                    break;
                }
            }
        }
    }
}

/// The intake of a handler with a lane: each delivery is decoded as it arrives and
/// sent to the pipeline its lane value hashes to (one per unit of concurrency, or
/// [`ROOM`] of them for a quick batch handler: see [`pipelines_wanted`]). A pipeline
/// runs its deliveries in arrival order, one batch at a time, so one lane's messages
/// are never applied concurrently or out of order in this process, and batches on
/// different pipelines do not lock the same hot rows. A delivery that cannot be
/// decoded (it will be dead-lettered) goes to any pipeline.
///
/// The number of pipelines in use changes only once every delivery sent to them has
/// run (the intake stops taking deliveries until then), so a lane is never in two
/// pipelines at once.
async fn consume_in_lanes(
    consumer: Arc<Consumer>,
    mut stream: Source,
    tag: String,
    intake: Intake,
    stop: CancellationToken,
) -> Loss {
    let room = Arc::new(Semaphore::new(ROOM));
    let in_flight = Arc::new(InFlight::default());
    let pipelines: Vec<mpsc::UnboundedSender<Item>> = (0..consumer.batch.pipelines.max(1))
        .map(|_| {
            let (sender, receiver) = mpsc::unbounded_channel();
            intake.tracker.spawn(pipeline(
                Arc::clone(&consumer),
                receiver,
                Arc::clone(&room),
                Arc::clone(&in_flight),
                Arc::clone(&intake.permits),
                intake.hard_stop.clone(),
            ));
            sender
        })
        .collect();
    let mut in_use = pipelines.len();
    let mut spread = 0_usize;
    let loss = loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break None,
            next = stream.next(&consumer) => match next {
                Next::Delivery(delivery) => delivery,
                Next::Ended(loss) => break Some(loss),
            },
        };
        if let Some(rate) = &consumer.rate {
            tokio::select! {
                _ = rate.take(1) => {}
                () = stop.cancelled() => {
                    let _ = consumer.acks.requeue(&delivery).await;
                    break None;
                }
            }
        }
        if consumer.flow.is_open() {
            let mut held = VecDeque::from([delivery]);
            match pause(&consumer, &mut stream, &mut held, &tag, &intake.hard_stop, &stop).await {
                Ok(()) => continue,
                Err(Ended::Stopped) => {
                    drop(pipelines);
                    return Loss::Stopped;
                }
                Err(Ended::Lost(loss)) => break Some(loss),
            }
        }
        let wanted = pipelines_wanted(
            consumer.handler.batched(),
            &consumer.pace,
            consumer.batch_most(),
            pipelines.len(),
            in_use,
        );
        if wanted != in_use {
            tokio::select! {
                () = in_flight.drained() => in_use = wanted,
                () = stop.cancelled() => {
                    let _ = consumer.acks.requeue(&delivery).await;
                    break None;
                }
            }
        }
        let prepared = consumer.prepare(&delivery);
        let slot = match prepared.as_ref().ok().and_then(|prepared| prepared.lane.as_ref()) {
            Some(lane) => lane_slot(lane.as_str(), in_use),
            None => {
                spread = spread.wrapping_add(1);
                spread % in_use
            }
        };
        in_flight.sent();
        // A pipeline ends only when its sender is dropped (below).
        let _ = pipelines[slot].send(Item::new(delivery, &consumer, Some(prepared)));
    };
    // The pipelines finish what they hold (in flight, within the shutdown deadline).
    drop(pipelines);
    intake_ended(&consumer, &stream, &tag, loss).await
}

/// How many of its `all` pipelines a laned consumer sends its deliveries to, using
/// `in_use` now: [`ROOM`] for a quick batch handler (as [`waits_for_room`] means
/// it), else all. A quick batch handler's batches run at most [`ROOM`] at once
/// anyway; spread over all the pipelines, each would be a sixteenth of what the
/// prefetch holds (at 1,000 accounts the demo's batches averaged 117 payments of
/// 256), folded into [`ROOM`] a half (146–157: the intake is fed at the broker's
/// rate). Once folded, a handler unfolds only when its pace is past twice
/// [`QUICK`], so that one slow call does not make the intake drain its pipelines
/// back and forth. The cost of the fold: a handler that turns slow runs what the
/// two pipelines already hold (up to the prefetch) two batches at a time before it
/// unfolds.
fn pipelines_wanted(batched: bool, pace: &Pace, most: usize, all: usize, in_use: usize) -> usize {
    let folded = all.min(ROOM);
    let quick = if in_use == folded { QUICK * 2 } else { QUICK };
    if batched && pace.runs_within(most, quick) {
        folded
    } else {
        all
    }
}

/// The deliveries a laned intake has sent to its pipelines that have not yet run.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    drained: Notify,
}

impl InFlight {
    fn sent(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    fn ran(&self, deliveries: usize) {
        if self.count.fetch_sub(deliveries, Ordering::SeqCst) == deliveries {
            self.drained.notify_waiters();
        }
    }

    /// Waits until every delivery sent has run.
    async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            // Registered before the count is read: a `ran` in between still wakes it.
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The intake of a queue several handlers consume, one per message type: one
/// stream, registered with the channel's acks in delivery order (as [`Acks`]
/// requires), each delivery sent to the intake of the handler of its type — its
/// AMQP `type`, else its routing key — and one no handler takes to `unroutable`,
/// whose only outcome is a dead letter. Each handler keeps everything of its own
/// (dedup scope, batches, lanes, retries); they share the channel and its acks.
///
/// [`Acks`]: crate::broker::acks::Acks
pub(super) async fn consume_routed(
    routes: Vec<(&'static str, Arc<Consumer>)>,
    unroutable: Arc<Consumer>,
    mut stream: lapin::Consumer,
    tag: String,
    intake: Intake,
    stop: CancellationToken,
) -> Loss {
    let mut intakes = JoinSet::new();
    let mut spawn = |consumer: &Arc<Consumer>| {
        let (sender, receiver) = mpsc::unbounded_channel();
        let source = Source::Routed(receiver);
        intakes.spawn(consume(Arc::clone(consumer), source, tag.clone(), intake.clone(), stop.clone()));
        sender
    };
    let senders: HashMap<&'static str, mpsc::UnboundedSender<Delivery>> =
        routes.iter().map(|(name, consumer)| (*name, spawn(consumer))).collect();
    let unroutable_sender = spawn(&unroutable);
    let loss = loop {
        tokio::select! {
            () = stop.cancelled() => break None,
            next = stream.next() => match registered(&unroutable, next) {
                Next::Delivery(delivery) => {
                    let name = crate::base::amqp_value::routed_type(&delivery.properties, delivery.routing_key.as_str());
                    // A handler's intake ends only after the senders are dropped (below).
                    let _ = senders.get(name).unwrap_or(&unroutable_sender).send(delivery);
                }
                Next::Ended(loss) => break Some(loss),
            },
            // A handler's intake ends on its own only when it finds the channel closed.
            Some(ended) = intakes.join_next() => break Some(ended.unwrap_or_else(Loss::ConsumerTask)),
        }
    };
    drop((senders, unroutable_sender));
    while intakes.join_next().await.is_some() {}
    intake_ended(&unroutable, &Source::Broker(stream), &tag, loss).await
}

/// Takes the next delivery, if it is there now (`wait` zero) or arrives within `wait`.
async fn next_within(consumer: &Consumer, stream: &mut Source, wait: Duration) -> Option<Next> {
    if wait.is_zero() {
        return stream.next(consumer).now_or_never();
    }
    tokio::time::timeout(wait, stream.next(consumer)).await.ok()
}

/// Why `consumer`'s channel closed, from its stream: lapin hands the broker's close
/// to the consumer after the deliveries still buffered (dropped here: the broker
/// requeues them). Waits a moment for it; else a plain "the channel closed". (A
/// routed intake has no stream: its router hears the close.)
async fn closing_reason(consumer: &Consumer, stream: &mut Source) -> Loss {
    let Source::Broker(stream) = stream else {
        return Loss::ChannelClosed { queue: consumer.queue.clone() };
    };
    let told = async {
        loop {
            match stream.next().await {
                // Never started: its redelivery need not run alone.
                Some(Ok(buffered)) => consumer.shared.unstarted.remember(&consumer.queue, &buffered),
                Some(Err(err)) => return Some(Loss::of_consumer(&consumer.queue, err)),
                None => return None,
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(1), told).await {
        Ok(Some(loss)) => loss,
        _ => Loss::ChannelClosed { queue: consumer.queue.clone() },
    }
}

/// Why an intake loop ended: `loss` if the stream did; after `stop` (`None`) it
/// cancels the consumer (a routed intake leaves that to its router) — prefetched
/// deliveries not yet taken return when the channel closes — and says [`Loss::Stopped`].
async fn intake_ended(consumer: &Consumer, source: &Source, tag: &str, loss: Option<Loss>) -> Loss {
    match loss {
        Some(loss) => loss,
        None if matches!(source, Source::Routed(_)) => Loss::Stopped,
        None => {
            bounded(consumer.channel.basic_cancel(tag.into(), BasicCancelOptions::default())).await;
            Loss::Stopped
        }
    }
}

/// A running batch's place: one of its consumer's slots and one of the runtime's
/// permits, both given back when it is dropped.
struct BatchSlot {
    consumer: Arc<Consumer>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl BatchSlot {
    /// Waits for a slot of `consumer`'s (its width shrinks while its batches
    /// collide), then for one of the runtime's `permits`.
    async fn take(consumer: &Arc<Consumer>, permits: &Arc<Semaphore>) -> Self {
        consumer.width.acquire().await;
        // Counted off again on drop, even if this wait is given up.
        let mut slot = Self { consumer: Arc::clone(consumer), permit: None };
        let permit = Arc::clone(permits).acquire_owned().await;
        slot.permit = Some(permit.expect("the semaphore is never closed"));
        slot
    }
}

impl Drop for BatchSlot {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.consumer.width.release();
    }
}

/// The pipeline a lane value belongs to: a stable hash, so one process always sends
/// one lane to one pipeline.
fn lane_slot(lane: &str, pipelines: usize) -> usize {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same in every run.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    lane.hash(&mut hasher);
    usize::try_from(hasher.finish() % pipelines as u64).unwrap_or(0)
}

/// One lane pipeline: batches of what it holds, one at a time, in order.
///
/// A batch starts when it is full (the batch size, or what the handler's pace
/// allows), or when there is room: fewer than [`ROOM`] of the consumer's batches
/// that waited for it are running. So a backlog on a busy machine runs in a few
/// large transactions — each costs the same fixed work (BEGIN, the claim, COMMIT and
/// its flush, a round trip per statement), and sixteen small ones at once spend the
/// CPU the broker and PostgreSQL need — while a slow handler, whose pace makes its
/// batches small, still runs one batch per pipeline at once. A quick batch
/// handler's full batch waits for room as well ([`waits_for_room`]). A batch waits for
/// room at most [`ROOM_WAIT`], taking what arrives meanwhile.
async fn pipeline(
    consumer: Arc<Consumer>,
    mut deliveries: mpsc::UnboundedReceiver<Item>,
    room: Arc<Semaphore>,
    in_flight: Arc<InFlight>,
    permits: Arc<Semaphore>,
    hard_stop: CancellationToken,
) {
    let limits = consumer.batch;
    let mut held: Option<Item> = None;
    loop {
        let first = match held.take() {
            Some(first) => first,
            None => match deliveries.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + limits.linger;
        let most = consumer.batch_most();
        let mut ended = false;
        while batch.len() < most && !batch[0].runs_alone() {
            let next = match deliveries.try_recv() {
                Ok(next) => next,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    ended = true;
                    break;
                }
                Err(_) if limits.linger.is_zero() => break,
                Err(_) => match tokio::time::timeout_at(deadline, deliveries.recv()).await {
                    Ok(Some(next)) => next,
                    Ok(None) => {
                        ended = true;
                        break;
                    }
                    Err(_) => break,
                },
            };
            if next.runs_alone() {
                held = Some(next);
                break;
            }
            batch.push(next);
        }
        let waits = waits_for_room(consumer.handler.batched(), &consumer.pace, batch.len(), most);
        let roomed = if ended || held.is_some() || batch[0].runs_alone() || !waits {
            None
        } else {
            wait_for_room(&room, &mut deliveries, &mut batch, most, &mut held).await
        };
        let permit = Arc::clone(&permits).acquire_owned().await.expect("the semaphore is never closed");
        let deliveries = batch.len();
        consumer.process(batch, &hard_stop).await;
        drop((permit, roomed));
        in_flight.ran(deliveries);
    }
}

/// How many of one laned consumer's batches that are not full (or quick: see
/// [`waits_for_room`]) may run at once (see [`pipeline`]): one writing while another
/// commits.
const ROOM: usize = 2;

/// Whether a batch of `messages` (of at most `most`) waits for room: one that is not
/// full, and a quick batch handler's full one — a batch handler's (`batched`) whose
/// pace says the call runs within [`QUICK`]. Such a batch is bound by the machine —
/// one call's few set-based statements for the whole batch — and more of them at
/// once only contend for the CPU and the index the dedup rows go in, while waiting
/// for room costs at most one such batch's run: the demo's `apply_payment`, 256
/// payments in a few ms, went from ×0.85 to ×0.94 of the hand-written expert loop at
/// 10 accounts this way (BENCHMARKS.md, *Quick batches wait for room*). A
/// per-message handler's full batch starts at once: its statements run one message
/// after another, each a round trip, and its throughput is the overlap of its
/// batches (one at a time halved `idemq-lanes`'s). So does a slow batch handler's,
/// whose call waits on something else.
fn waits_for_room(batched: bool, pace: &Pace, messages: usize, most: usize) -> bool {
    messages < most || (batched && pace.runs_within(messages, QUICK))
}

/// How long a batch handler's call may run, by its pace, for its full batches to
/// wait for room (see [`waits_for_room`]).
const QUICK: Duration = Duration::from_millis(25);

/// The longest a batch that is not full waits for room.
const ROOM_WAIT: Duration = Duration::from_millis(100);

/// Waits for room for `batch` — at most [`ROOM_WAIT`] — taking the pipeline's
/// deliveries into it meanwhile while it is not full. Returns the room taken, if any
/// (none when the wait ran out, the intake ended, or a delivery that must run alone
/// arrived: held for the next batch).
async fn wait_for_room(
    room: &Arc<Semaphore>,
    deliveries: &mut mpsc::UnboundedReceiver<Item>,
    batch: &mut Vec<Item>,
    most: usize,
    held: &mut Option<Item>,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let acquire = Arc::clone(room).acquire_owned();
    tokio::pin!(acquire);
    let give_up = tokio::time::sleep(ROOM_WAIT);
    tokio::pin!(give_up);
    loop {
        tokio::select! {
            biased;
            permit = &mut acquire => return Some(permit.expect("the semaphore is never closed")),
            next = deliveries.recv(), if batch.len() < most => match next {
                Some(next) if next.runs_alone() => {
                    *held = Some(next);
                    return None;
                }
                Some(next) => batch.push(next),
                None => return None,
            },
            () = &mut give_up => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{pipelines_wanted, waits_for_room, InFlight, Pace, QUICK, ROOM};

    #[test]
    fn a_full_batch_waits_for_room_only_from_a_quick_batch_handler() {
        let quick = Pace::default();
        quick.record(Duration::from_millis(4), 256);
        let slow = Pace::default();
        slow.record(Duration::from_millis(80), 1);
        assert!(waits_for_room(false, &slow, 1, 2), "not full: waits, whatever the handler");
        assert!(waits_for_room(true, &quick, 256, 256), "a quick batch handler's full batch waits");
        assert!(!waits_for_room(false, &quick, 256, 256), "a per-message handler's starts at once");
        assert!(!waits_for_room(true, &slow, 1, 1), "a batch handler waiting on an API: at once");
        assert!(!waits_for_room(true, &Pace::default(), 16, 16), "a pace not yet known: at once");
    }

    #[test]
    fn a_quick_batch_handler_folds_its_pipelines_into_room_and_unfolds_only_when_clearly_slower() {
        let quick = Pace::default();
        quick.record(Duration::from_millis(4), 256);
        assert_eq!(pipelines_wanted(true, &quick, 256, 16, 16), ROOM, "quick batch handler: folded");
        assert_eq!(pipelines_wanted(false, &quick, 256, 16, 16), 16, "per-message handler: never folded");
        assert_eq!(pipelines_wanted(true, &Pace::default(), 16, 16, 16), 16, "pace unknown: all");
        assert_eq!(pipelines_wanted(true, &quick, 256, 1, 1), 1, "fewer pipelines than room: as they are");

        let between = Pace::default();
        between.record(QUICK + QUICK / 2, 1);
        assert_eq!(pipelines_wanted(true, &between, 1, 16, 16), 16, "past QUICK: not folded");
        assert_eq!(pipelines_wanted(true, &between, 1, 16, ROOM), ROOM, "within twice QUICK: stays folded");
        let slow = Pace::default();
        slow.record(QUICK * 3, 1);
        assert_eq!(pipelines_wanted(true, &slow, 1, 16, ROOM), 16, "past twice QUICK: unfolded");
    }

    #[tokio::test]
    async fn in_flight_is_drained_only_once_every_delivery_sent_has_run() {
        let in_flight = std::sync::Arc::new(InFlight::default());
        in_flight.drained().await;
        in_flight.sent();
        in_flight.sent();
        let waiter = tokio::spawn({
            let in_flight = std::sync::Arc::clone(&in_flight);
            async move { in_flight.drained().await }
        });
        in_flight.ran(1);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one of two still to run");
        in_flight.ran(1);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("drained").expect("no panic");
    }
}
