//! What runs together: a batch is decided in parts — the whole first, then smaller
//! parts around whatever could not be decided together (see `transact`) — each part
//! retried in-process on database faults and contention, never charged as an
//! attempt. A redelivered message runs alone: its copy checked, its start counted.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use lapin::message::Delivery;

use super::faults::{panic_message, Fault, InfraFault};
use super::{Collision, Consumer, Decision, Delivered, Ran};
use crate::base::backoff::Backoff;
use crate::base::duration::human;
use crate::base::observe::{DecidedBatch, InfrastructureRetry};
use crate::base::outcome::{FailureKind, Outcome};
use crate::base::verdict;
use crate::handler::prepare::{Prepared, Rejection};
use crate::handler::ErrorClass;
use crate::store::db::{self, Conn};

/// How often a transaction refused for contention (serialization failure,
/// deadlock) is run again in-process before it counts as a failed attempt.
const CONTENTION_RETRIES: u32 = 3;

/// How often at most a consumer warns that its batches collide (for each
/// [`Collision`]: one cause's warnings never hide another's).
const COLLISION_WARNING_EVERY: Duration = Duration::from_secs(60);

/// A consumer's batches that collided since it last warned about them, by where
/// they collided.
#[derive(Debug, Default)]
pub(crate) struct Collisions(std::sync::Mutex<[CollisionCount; 3]>); // one per `Collision`

#[derive(Debug, Default)]
struct CollisionCount {
    since_warning: u64,
    warned_at: Option<Instant>,
}

impl Collisions {
    /// Counts one batch collided `on`; `Some(n)` when a warning of it is due, with
    /// the collisions it reports (this one included).
    fn note(&self, on: Collision, now: Instant) -> Option<u64> {
        let mut counts = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = &mut counts[on as usize];
        count.since_warning += 1;
        let due = count.warned_at.is_none_or(|at| now.duration_since(at) >= COLLISION_WARNING_EVERY);
        due.then(|| {
            count.warned_at = Some(now);
            std::mem::take(&mut count.since_warning)
        })
    }
}

impl Consumer {
    /// Decides every delivery of the batch: runs it in one transaction, and runs
    /// again smaller whatever could not be decided together.
    pub(super) async fn decide(
        &self,
        items: &[Delivered],
        mut prepared: Vec<Option<Result<Prepared, Rejection>>>,
    ) -> Vec<Decision> {
        // A redelivered message may be what crashed the last consumer: it runs alone.
        let _turn = if items.iter().any(Delivered::runs_alone) {
            Turn::Alone(self.shared.turns.write().await)
        } else {
            Turn::Shared(self.shared.turns.read().await)
        };
        let mut decisions: Vec<Option<Decision>> = items.iter().map(|_| None).collect();
        let mut parts: VecDeque<Vec<usize>> = VecDeque::from([(0..items.len()).collect()]);
        let (mut splits, mut collided) = (0_u64, Vec::new());
        let started = Instant::now();
        while let Some(part) = parts.pop_front() {
            let ran = self.run_part(items, &part, &mut prepared).await;
            if !ran.next.is_empty() {
                splits += 1;
            }
            if let Some(on) = ran.collided.filter(|on| !collided.contains(on)) {
                collided.push(on);
            }
            for (index, decision) in ran.decided {
                decisions[index] = Some(decision);
            }
            for next in ran.next.into_iter().rev() {
                parts.push_front(next);
            }
        }
        let contended = !collided.is_empty();
        self.width.adapt(splits > 0, contended);
        for on in collided {
            self.collided(on);
        }
        self.shared.observers.batch(&DecidedBatch {
            queue: &self.queue,
            deliveries: items.len(),
            splits,
            contended,
            width: self.width.current(),
            took: started.elapsed(),
        });
        decisions
            .into_iter()
            .map(|decision| {
                decision.unwrap_or_else(|| {
                    // Every path decides every delivery; this only guards the invariant.
                    tracing::error!(queue = %self.queue, "a delivery was left undecided; returning it to the queue");
                    Decision::new(Outcome::Requeued { error: "left undecided".into() })
                })
            })
            .collect()
    }

    /// A batch collided with another transaction `on` (the width has narrowed):
    /// says so, at most every [`COLLISION_WARNING_EVERY`] for each cause, with
    /// [`advice`] (the metric `idemq_contended_batches_total` counts every collision).
    fn collided(&self, on: Collision) {
        let Some(collisions) = self.collisions.note(on, Instant::now()) else { return };
        let (width, lane) = (self.width.current(), self.handler.lane_path());
        match advice(on, lane, width) {
            (Level::Harmless, advice) => {
                tracing::info!(queue = %self.queue, collisions, width, lane, "{advice}")
            }
            (Level::Warning, advice) => {
                tracing::warn!(queue = %self.queue, collisions, width, lane, "{advice}")
            }
        }
    }

    /// Runs `part` (indices into the batch) until it is decided or split, retrying
    /// in-process on infrastructure faults (not counted as attempts).
    async fn run_part(
        &self,
        items: &[Delivered],
        part: &[usize],
        prepared: &mut [Option<Result<Prepared, Rejection>>],
    ) -> Ran {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        let mut contention = 0;
        let mut marked: Option<i32> = None;
        let mut last_logged: Option<String> = None;
        // Held since the oldest of them was received, not since this run: waiting
        // for a turn (behind a redelivered message, an earlier part of its batch)
        // keeps a delivery unacked too, and the broker's consumer_timeout counts it.
        let held_since =
            part.iter().map(|&index| items[index].received_at).min().unwrap_or_else(Instant::now);
        let all = |outcome: Outcome| Ran {
            decided: part.iter().map(|&index| (index, Decision::new(outcome.clone()))).collect(),
            ..Ran::default()
        };
        loop {
            let fault = match self.attempt(items, part, prepared, &mut marked).await {
                Ok(ran) => return ran,
                Err(fault) => fault,
            };
            let fault = match fault {
                Fault::Infra(fault) => fault,
                Fault::Contention { error, .. } if contention < CONTENTION_RETRIES => {
                    contention += 1;
                    tracing::info!(queue = %self.queue, %error, contention, "transaction rolled back for contention; running it again");
                    tokio::time::sleep(Duration::from_millis(10 * u64::from(contention))).await;
                    continue;
                }
                Fault::Contention { error, key } => {
                    // Only a delivery run alone reports contention (a batch splits).
                    let error = format!("{error} (still after {CONTENTION_RETRIES} runs in-process)");
                    let attempt = items[part[0]].counts.attempt;
                    let outcome = verdict::handler_failed(ErrorClass::Transient, error, attempt, &self.retry);
                    let decision = Decision {
                        outcome,
                        key: Some(key),
                        began_at: None,
                        marked: marked.is_some(),
                        batch: 1,
                        reply: None,
                        handler_time: None,
                    };
                    return Ran { decided: vec![(part[0], decision)], ..Ran::default() };
                }
                Fault::Fatal(error) => {
                    let outcome = Outcome::Requeued { error: error.to_string() };
                    self.shared.fatal.raise(error);
                    return all(outcome);
                }
            };
            if held_since.elapsed() >= self.shared.database_retry_limit {
                // Held longer, the broker's consumer_timeout (30 min by default) would
                // close the channel and return every delivery on it.
                let error = format!(
                    "the database stayed unavailable for {} ({fault}); returned to the queue",
                    human(self.shared.database_retry_limit)
                );
                return all(Outcome::Requeued { error });
            }
            // Logged once per change of fault, not once per retry.
            let message = fault.to_string();
            let redacted = crate::base::redact::redact(&message);
            self.shared
                .observers
                .infrastructure_retry(&InfrastructureRetry { queue: &self.queue, fault: &redacted });
            if last_logged.as_deref() != Some(message.as_str()) {
                tracing::error!(queue = %self.queue, fault = %message, "database fault; retrying the transaction on a fresh connection (not counted as an attempt)");
                last_logged = Some(message);
            }
            backoff.wait().await;
        }
    }

    /// One run of `part`: decode, then (for messages that need the database) one
    /// connection for the copy check and start mark of a message run alone, and the
    /// transaction. A server error on one of idemq's own statements is diagnosed
    /// (see [`Self::diagnose`]).
    async fn attempt(
        &self,
        items: &[Delivered],
        part: &[usize],
        prepared: &mut [Option<Result<Prepared, Rejection>>],
        marked: &mut Option<i32>,
    ) -> Result<Ran, Fault> {
        let alone = part.len() == 1 && items[part[0]].runs_alone();
        let mut ran = Ran::default();
        let mut runnable = Vec::with_capacity(part.len());
        let mut rejected = None;
        for &index in part {
            let decoded = prepared[index].take().unwrap_or_else(|| self.prepare(&items[index].delivery));
            match decoded {
                Ok(decoded) => runnable.push((index, decoded)),
                // A redelivered message's copy may exist: check that first.
                Err(rejection) if alone => rejected = Some(rejection),
                Err(rejection) => {
                    let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
                    ran.decided.push((index, Decision::new(outcome)));
                }
            }
        }
        if runnable.is_empty() && !alone {
            return Ok(ran);
        }
        let mut conn =
            self.shared.pool.get().await.map_err(|err| Fault::Infra(InfraFault::Pool(err.to_string())))?;
        let result = if alone {
            let prepared = runnable.pop().map(|(_, prepared)| prepared);
            self.attempt_alone(&mut conn, items, part[0], prepared, rejected, marked).await
        } else {
            self.transact(&mut conn, items, runnable, None, ran).await
        };
        let result = match result {
            Err(Fault::Infra(InfraFault::Database(err))) => Err(self.diagnose(&mut conn, err).await),
            decided => decided,
        };
        if matches!(result, Err(Fault::Infra(_))) || PoolableConnection::is_broken(&mut **conn) {
            // Never return a connection in an unknown state to the pool.
            drop(db::Pooled::take(conn));
        }
        result
    }

    /// A redelivered message, alone: acked at once if its copy was confirmed before;
    /// else its start is counted (committed before its handler runs), then the
    /// transaction, which dead-letters it as poison once the starts reach the limit.
    async fn attempt_alone(
        &self,
        conn: &mut Conn,
        items: &[Delivered],
        index: usize,
        prepared: Option<Prepared>,
        rejected: Option<Rejection>,
        marked: &mut Option<i32>,
    ) -> Result<Ran, Fault> {
        let item = &items[index];
        let infra = |err| Fault::Infra(InfraFault::Database(err));
        let decided = |decision: Decision| Ran { decided: vec![(index, decision)], ..Ran::default() };
        let key = prepared.as_ref().map(|prepared| prepared.key.as_str());
        let copy_id = self.identity(item, key).copy_id(item.counts.attempt);
        if self.bounded(db::copy_recorded(conn, &copy_id)).await.map_err(infra)? {
            return Ok(decided(Decision::new(Outcome::AlreadyCopied { copy_id })));
        }
        let Some(prepared) = prepared else {
            let rejection = rejected.expect("a message run alone is either decoded or rejected");
            let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
            return Ok(decided(Decision::new(outcome)));
        };
        let starts = match *marked {
            Some(starts) => starts,
            None => {
                let starts = self
                    .bounded(db::mark_start(conn, &self.scope, prepared.key.as_str()))
                    .await
                    .map_err(infra)?;
                *marked = Some(starts);
                starts
            }
        };
        let mut ran =
            self.transact(conn, items, vec![(index, prepared)], Some(starts), Ran::default()).await?;
        for (_, decision) in &mut ran.decided {
            decision.marked = true;
        }
        Ok(ran)
    }

    /// Decodes the body; a panicking `Deserialize` impl or key is a decode failure.
    pub(crate) fn prepare(&self, delivery: &Delivery) -> Result<Prepared, Rejection> {
        let prepare = || self.handler.prepare(&delivery.data, &delivery.properties, self.shared.limits);
        std::panic::catch_unwind(AssertUnwindSafe(prepare)).unwrap_or_else(|panic| {
            Err(Rejection {
                kind: FailureKind::Decode,
                message: format!(
                    "decoding the message or reading its key panicked: {}",
                    panic_message(&*panic)
                ),
            })
        })
    }
}

/// How loud a collision's line is.
#[derive(Debug, PartialEq, Eq)]
enum Level {
    /// Nothing to change (INFO).
    Harmless,
    /// The handler could do better (WARN).
    Warning,
}

/// What a consumer says of batches that collided `on`, its handler's lane path
/// `lane`, its width now `width`. On the handler's rows: idemq cannot know which rows
/// a handler locks, so it cannot order them for the handler; a lane can. On the dedup
/// rows: copies of one key raced, which the unique index settles — no lane is
/// needed, and the line must not ask for one. Where the runtime cannot tell, it says
/// so, and advises a lane only for messages that do share rows.
fn advice(on: Collision, lane: Option<&str>, width: usize) -> (Level, String) {
    match (on, lane) {
        (Collision::DedupRows, _) => (
            Level::Harmless,
            format!(
                "batches of this queue's handler waited on each other's dedup rows: copies of one \
                 message (the same key: a redelivery, a publisher's retry, a message published twice) \
                 were in two transactions at once (or something locked the table idemq_dedup). \
                 Harmless: the unique index on the dedup rows lets one copy apply, and the other is \
                 settled as a duplicate once its batch has run again smaller; the consumer now runs at \
                 most {width} batch(es) at once. No lane is needed for this; many such lines mean many \
                 copies arrive together"
            ),
        ),
        (Collision::HandlerRows, None) => (
            Level::Warning,
            format!(
                "batches of this queue's handler collide on row locks (lock waits past the batch limit, \
                 deadlocks): each collision rolls a batch back and runs it again smaller, and the \
                 consumer now runs at most {width} batch(es) at once. If its messages update shared rows \
                 (an account's balance), give the handler a lane on what they share \
                 (`#[idempotent_handler(key = \"..\", lane = \"account\")]`): a lane never runs two \
                 of its messages at once"
            ),
        ),
        (Collision::HandlerRows, Some(lane)) => (
            Level::Warning,
            format!(
                "batches of this queue's handler collide on row locks although it has a lane: its \
                 messages share rows across lanes (rows that `{lane}` does not identify). Make the lane \
                 what they share, or lock the rows in one order (sort them) in the handler"
            ),
        ),
        (Collision::Unknown, lane) => (
            Level::Warning,
            format!(
                "batches of this queue's handler were rolled back for contention where idemq cannot \
                 tell on which rows (at COMMIT: a serialization failure, or a deadlock in deferred \
                 checks): each such batch runs again smaller, and the consumer now runs at most {width} \
                 batch(es) at once. If its messages update shared rows{}, a lane on what they share \
                 keeps them apart (`#[idempotent_handler(key = \"..\", lane = \"account\")]`)",
                lane.map(|lane| format!(" that `{lane}` does not identify")).unwrap_or_default()
            ),
        ),
    }
}

/// A delivery's place beside the others: alone (redelivered) or shared.
enum Turn<'a> {
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'a, ()>),
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'a, ()>),
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{advice, Collision, Collisions, Level, COLLISION_WARNING_EVERY};

    #[test]
    fn collisions_are_reported_at_once_then_at_most_once_a_minute_with_their_count() {
        let collisions = Collisions::default();
        let start = Instant::now();
        let note = |at| collisions.note(Collision::HandlerRows, at);
        assert_eq!(note(start), Some(1), "the first is reported at once");
        assert_eq!(note(start + Duration::from_secs(1)), None);
        assert_eq!(note(start + Duration::from_secs(30)), None);
        assert_eq!(note(start + COLLISION_WARNING_EVERY), Some(3), "the count since the last");
        assert_eq!(note(start + COLLISION_WARNING_EVERY), None);
    }

    #[test]
    fn each_cause_of_collisions_is_reported_on_its_own() {
        let collisions = Collisions::default();
        let start = Instant::now();
        assert_eq!(collisions.note(Collision::DedupRows, start), Some(1));
        assert_eq!(collisions.note(Collision::HandlerRows, start), Some(1), "not hidden by the other");
        assert_eq!(collisions.note(Collision::Unknown, start), Some(1));
        assert_eq!(collisions.note(Collision::DedupRows, start), None);
    }

    #[test]
    fn copies_racing_on_the_dedup_rows_are_harmless_and_want_no_lane() {
        for lane in [None, Some("account")] {
            let (level, said) = advice(Collision::DedupRows, lane, 4);
            assert_eq!(level, Level::Harmless);
            assert!(said.contains("copies of one message") && said.contains("Harmless"), "{said}");
            assert!(said.contains("No lane is needed") && !said.contains("lane = "), "{said}");
        }
    }

    #[test]
    fn collisions_on_the_handlers_rows_ask_for_a_lane_and_unknown_ones_say_so() {
        let (level, said) = advice(Collision::HandlerRows, None, 2);
        assert_eq!(level, Level::Warning);
        assert!(said.contains("give the handler a lane") && said.contains("at most 2 batch"), "{said}");
        let (_, said) = advice(Collision::HandlerRows, Some("account"), 2);
        assert!(said.contains("although it has a lane") && said.contains("`account`"), "{said}");
        let (level, said) = advice(Collision::Unknown, None, 2);
        assert_eq!(level, Level::Warning);
        assert!(said.contains("cannot tell") && !said.contains("copies"), "{said}");
        assert!(said.contains("If its messages update shared rows"), "a lane only if they do: {said}");
    }
}
