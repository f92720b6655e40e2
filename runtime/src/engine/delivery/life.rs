//! The life of a delivery, start to finish, in one file: the heart of idemq.
//!
//! Deliveries run in batches (group commit): up to `batch_size` deliveries of one
//! consumer that have arrived, in one transaction, acked together after COMMIT. A
//! lone delivery is a batch of one; per-message mode is `batch_size = 1`. The new
//! messages' handlers run in arrival order — or, for a batch handler
//! ([`crate::Batch`]), one call takes them all — and each delivery of a batch goes
//! through the same states ("handler" below is that one call for a batch handler):
//!
//! ```text
//!            ┌────────── too large / not JSON / bad shape / bad key ──────────┐
//!            │                                                                ▼
//! delivery ─ decode ─ key ─ BEGIN ─ INSERT dedup rows ─┬─ new ─ handler ─ outbox + results ─ checked COMMIT ─ ack
//!   │                               (the batch's, one  │          │      │  └ unknown ─┐
//!   │ redelivered:                  statement, keys    │          │      │             ▼
//!   │  · run alone                  sorted) ON CONFLICT│          │      │ refused: retry in-process on
//!   │  · copy recorded? ─ ack       DO NOTHING         │          │      │ rolled   a fresh connection:
//!   │  · count the start            RETURNING key      │          │      │ back     the dedup row decides
//!   │                                                  │          │      ▼
//!   │                                                  │     error, panic, timeout,
//!   │                                                  │     aborted or ended transaction
//!   │                                                  │          ▼
//!   │                                                  │      ROLLBACK ── in a batch of several:
//!   │                                                  │          │       re-run without it, it alone
//!   │                                                  │          ▼       (or in halves), no attempt spent
//!   │                                                  │   transient, attempts left:
//!   │                                                  │     copy → <queue>.retry.<ms>ms (TTL,
//!   │                                                  │     dead-letters back), then ack
//!   │                                                  │   transient, last attempt ───┐
//!   │                                                  │   permanent ─────────────────┤
//!   │                                                  ├─ exists, same payload ─ ack (duplicate; a request:
//!   │                                                  │    its stored reply into the outbox first)
//!   │                                                  ├─ exists, other payload ──────┤ (conflict)
//!   │                                                  └─ new, started ≥ limit ───────┤ (poison)
//!   │                                                                                 ▼
//!   └──────────────   dead-letter: publish (mandatory, confirmed) the original bytes with
//!                     x-idemq-* headers to the DLQ, record the copy, then ack; a copy that
//!                     cannot be published (retry or dead letter): nack with requeue instead
//! ```
//!
//! Invariants:
//! - The ack is sent only after COMMIT returned Ok, or after a copy (retry or dead
//!   letter) was confirmed and routed. Never before. A batch's acks go as one
//!   `multiple` ack only below the channel's watermark ([`Acks`]).
//! - The dedup rows and the handlers' writes share one transaction on one
//!   connection: all commit or none does. Concurrent duplicates block on the unique
//!   index and then see the committed row; nothing checks first and acts later. The
//!   same key twice in one batch is run once; the second waits for the first's fate.
//! - COMMIT is *checked* ([`db::commit_checked`]): a transaction aborted by a statement
//!   whose error the handler ignored, or ended by the handler itself, is rolled back
//!   and counted as a handler failure, never acked as applied.
//! - Only a delivery run alone is charged a failed attempt. In a batch of several,
//!   a handler that fails (error, panic, timeout) is re-run alone, the others without
//!   it ([`verdict::around`]); a batch that fails as a whole (a batch handler's
//!   failure, which names no message; a refused or aborted COMMIT, a lock timeout: batches wait [`db::BATCH_LOCK_TIMEOUT`] for a lock, far
//!   below the deadlock detector's second) is re-run in halves ([`verdict::halves`]).
//!   Outcomes are the ones per-message mode would give.
//! - A COMMIT the server answered with an error is a rollback (a handler failure;
//!   serialization failures and deadlocks are first run again in-process). Only a
//!   lost connection leaves COMMIT's outcome unknown: then, and for any other database
//!   fault, the deliveries stay unacked and the transaction is retried on a fresh
//!   connection with backoff; such a connection is never reused. Faults no retry can
//!   fix (idemq's tables missing, privileges lacking) stop the runtime instead.
//! - A handler that panics or times out fails its attempt; its running statement is
//!   cancelled on the server and its connection dropped, so its locks go at once. A
//!   timed-out handler whose connection then does not answer at all was waiting for
//!   an unreachable database: an outage, retried in-process, not a charged attempt.
//! - idemq's own statements are bounded on the client too ([`Consumer::bounded`]):
//!   no answer within the server's `statement_timeout` and a margin means the
//!   network is gone (a half-open connection, a pooler that stays up): a connection
//!   fault, retried on a fresh connection — a COMMIT's outcome is then unknown and
//!   the dedup row decides, as after any lost connection.
//! - A handler's kill switch ([`crate::engine::flow`]) is told each decision as it is
//!   made; once open, what is not yet decided goes back to the queue unprocessed
//!   (`Paused`, never an attempt) and the intake pauses the consumer.
//! - A batch of a consumer whose batches hand the runtime's relay outbox rows waits,
//!   before BEGIN and at most 100 ms, while that relay is behind
//!   ([`Wake::keep_pace`](crate::engine::relay::Wake::keep_pace)).
//! - No path leaves a delivery unsettled: a guard nacks a batch (requeue) if its
//!   task ends without settling it.
//! - Poison is what *started* `delivery_limit` times without an outcome: a redelivered
//!   message runs alone (a batch of one, nothing else of this process beside it) and
//!   its start is committed before its handler runs, so a crash is charged to the
//!   message that caused it, not to the prefetch window around it. What this process
//!   held and never started when its channel closed is no suspect: its redelivery
//!   comes in as a first delivery (`unstarted`).
//! - Every copy carries a copy id (lineage + attempt); a redelivered original whose
//!   copy the broker already confirmed is acked without running its handler. A
//!   recorded copy can only ever settle the message it was made from: the lineage
//!   hashes the message's scope, key, `message_id`, body and replay generation
//!   ([`crate::handler::identity`]), so two messages that differ to their handler never share one.
//! - What handlers publish (through their [`Context`], one per message, in a batch
//!   handler's [`Batch`](crate::Batch) too) and return (one result per message) goes
//!   into the batch's transaction after the last handler, one statement for the outbox rows
//!   (with a request's reply) and one for the results: published if and only if the
//!   effect commits. A duplicated request's stored reply is committed to the outbox
//!   before the duplicate is acked; a request's permanent failure is committed as its
//!   dedup row (holding the error reply) before it is dead-lettered.
//!
//! [`db::commit_checked`]: crate::store::db::commit_checked
//! [`db::BATCH_LOCK_TIMEOUT`]: crate::store::db::BATCH_LOCK_TIMEOUT
//! [`verdict::around`]: crate::base::verdict::around
//! [`verdict::halves`]: crate::base::verdict::halves
//! [`Context`]: crate::handler::context::Context
//!
//! # Reading on
//!
//! This file holds the life; each stage is done in a file of its own, which
//! returns where the run goes next and never calls back up:
//!
//! ```text
//! Consumer::process    a batch from the intake (session::intake): decided, then settled
//!  └ decide            its parts: the whole first, then smaller parts around what could
//!    │                 not be decided together, until every delivery is decided
//!    └ run_part        one part, run again in-process on database faults and
//!      │               contention (never charged as an attempt)
//!      └ run           one run of the part, Stage by Stage:
//!          decode      decode.rs    body → message → key; rejected → dead letter
//!          Alone       alone.rs     redelivered: copy confirmed? ack; else count its start
//!          Claim       claim.rs     BEGIN + INSERT dedup rows … RETURNING (one statement)
//!          Open        claim.rs     applied before → duplicate | conflict; nothing new,
//!                                   or poison → ROLLBACK
//!          Handle      handlers.rs  the handlers in the transaction; a failure splits the
//!                                   batch, or alone is a charged attempt
//!          Write       commit.rs    outbox rows, a request's reply, results
//!          Commit      commit.rs    checked COMMIT → applied | rolled back | unknown
//!  settle              settle.rs    ack | nack | copy (retry, dead letter) | stored reply
//! ```
//!
//! Beside them: `tx` (what the stages share: [`Tx`], [`Ran`], [`Step`]),
//! `contention` (collisions between batches), `faults` (why a run decided nothing)
//! and `counts` (what a delivery's properties say about its past).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use tokio_util::sync::CancellationToken;

use super::claim::{Claimed, Open};
use super::decode::Decoded;
use super::faults::{Fault, InfraFault};
use super::settle::Unsettled;
use super::tx::{Done, Ran, Step, Tx};
use super::{Consumer, Decision, Delivered, Item};
use crate::base::backoff::Backoff;
use crate::base::duration::human;
use crate::base::observe::{DecidedBatch, InfrastructureRetry};
use crate::base::outcome::Outcome;
use crate::base::verdict;
use crate::handler::prepare::{Prepared, Rejection};
use crate::handler::ErrorClass;
use crate::store::db::{self, Conn};

/// How often a transaction refused for contention (serialization failure,
/// deadlock) is run again in-process before it counts as a failed attempt.
const CONTENTION_RETRIES: u32 = 3;

/// Where one run of part of a batch stands, after decoding: the stages of the
/// diagram, in order. Each is done in a file of its own and ends with a [`Step`]:
/// on to the next stage with what it needs, or the run's end (what it decided is
/// in [`Tx::ran`]). [`Consumer::stages`] moves from one to the next.
enum Stage {
    /// A redelivered message, alone (`alone`): acked if its copy was confirmed
    /// before, dead-lettered if it did not decode, else its start counted.
    Alone { index: usize, decoded: Decoded },
    /// BEGIN and the dedup rows of the first delivery of each key, one statement
    /// (`claim`). `starts`: how often a message run alone has started.
    Claim { runnable: Vec<(usize, Prepared)>, starts: Option<i32> },
    /// The rows applied before decide their deliveries; nothing new, or poison,
    /// ends the transaction (`claim`).
    Open { claimed: Claimed, starts: Option<i32> },
    /// The new messages' handlers, in the open transaction (`handlers`).
    Handle(Open),
    /// What the handlers published and returned, into the transaction (`commit`).
    Write { xid: i64, done: Vec<Done> },
    /// The checked COMMIT (`commit`).
    Commit { xid: i64, done: Vec<Done>, outbox: Option<super::commit::Written> },
    /// The run decided what it could.
    Ended,
}

impl<T> Step<T> {
    /// On to the stage `next` makes of what this one handed over, or the end.
    fn then(self, next: impl FnOnce(T) -> Stage) -> Stage {
        match self {
            Step::Next(value) => next(value),
            Step::Ended => Stage::Ended,
        }
    }
}

impl Consumer {
    /// Processes a batch of deliveries to their end: decided, then settled with the
    /// broker — unless `cut_off` fires first (the shutdown deadline passed): then the
    /// work in flight is dropped (an open transaction rolls back when its connection
    /// closes) and the deliveries are returned to the queue. A copy already being
    /// published is given [`COPY_GRACE`] to be confirmed and acked first.
    ///
    /// [`COPY_GRACE`]: super::settle::COPY_GRACE
    pub(crate) async fn process(self: &Arc<Self>, batch: Vec<Item>, cut_off: &CancellationToken) {
        let (items, prepared): (Vec<Delivered>, Vec<_>) =
            batch.into_iter().map(|item| (item.delivered, item.prepared)).unzip();
        let mut guard = Unsettled::new(&self.acks, items.iter());
        // A batch whose channel closed while it waited cannot be settled: the broker
        // has already requeued it. Running it would only apply what is redelivered.
        // An open kill switch returns what reaches it unprocessed (not an attempt);
        // the intake is pausing the consumer meanwhile (`session::intake`).
        let decided = if self.flow.is_open() {
            Some(items.iter().map(|_| Decision::new(Outcome::Paused)).collect())
        } else if self.channel.status().connected() {
            let span = crate::base::log::debug_span!("batch", queue = %self.queue, deliveries = items.len());
            let decide = async {
                // A batch that will write outbox rows waits while the relay is behind.
                if self.sends.load(std::sync::atomic::Ordering::Relaxed) {
                    self.shared.outbox.keep_pace().await;
                }
                self.decide(&items, prepared).await
            };
            tokio::select! {
                decisions = tracing::Instrument::instrument(decide, span) => Some(decisions),
                () = cut_off.cancelled() => None,
            }
        } else {
            for item in &items {
                self.shared.unstarted.remember(&self.queue, &item.delivery);
            }
            None
        };
        let decisions = decided
            .unwrap_or_else(|| items.iter().map(|_| Decision::new(Outcome::Abandoned)).collect::<Vec<_>>());
        let (copies, settled): (Vec<_>, Vec<_>) =
            items.into_iter().zip(decisions).partition(|(_, decision)| decision.publishes());
        // Copies wait for the broker's confirm (and, under a resource alarm, for the
        // alarm to end): they settle in a task of their own, so the next batch (of
        // this lane) does not wait for them.
        let mut copy_guard = Unsettled::new(&self.acks, copies.iter().map(|(item, _)| item));
        let sent = self.settle(&settled).await;
        guard.disarm();
        for ((item, decision), settled_with_broker) in settled.into_iter().zip(sent) {
            self.finish(&item, decision, settled_with_broker).await;
        }
        if copies.is_empty() {
            copy_guard.disarm();
            return;
        }
        let (consumer, cut_off) = (Arc::clone(self), cut_off.clone());
        self.tracker.spawn(async move {
            let mut copies = copies;
            let settling =
                copies.iter_mut().map(|(item, decision)| consumer.settle_copy(item, decision, &cut_off));
            let sent = futures_util::future::join_all(settling).await;
            copy_guard.disarm();
            for ((item, decision), settled_with_broker) in copies.into_iter().zip(sent) {
                consumer.finish(&item, decision, settled_with_broker).await;
            }
        });
    }

    /// Decides every delivery of the batch: runs it in one transaction, and runs
    /// again smaller whatever could not be decided together.
    async fn decide(
        &self,
        items: &[Delivered],
        mut prepared: Vec<Option<Result<Prepared, Rejection>>>,
    ) -> Vec<Decision> {
        // A redelivered message may be what crashed the last consumer: it runs alone.
        let _turn = self.turn(items).await;
        let mut decisions: Vec<Option<Decision>> = items.iter().map(|_| None).collect();
        let mut parts: VecDeque<Vec<usize>> = VecDeque::from([(0..items.len()).collect()]);
        let (mut splits, mut collided) = (0_u64, Vec::new());
        let started = Instant::now();
        while let Some(part) = parts.pop_front() {
            // The kill switch tripped (on this batch's failures or another's): what
            // is not yet decided goes back to the queue unprocessed, not charged.
            if self.flow.is_open() {
                for index in part {
                    decisions[index] = Some(Decision::new(Outcome::Paused));
                }
                continue;
            }
            let ran = self.run_part(items, &part, &mut prepared).await;
            if !ran.next.is_empty() {
                splits += 1;
            }
            if let Some(on) = ran.collided.filter(|on| !collided.contains(on)) {
                collided.push(on);
            }
            for (index, decision) in ran.decided {
                // As decided, not as settled: a batch's failures trip the switch
                // before the rest of it is run.
                self.flow.record(&decision.outcome, items[index].received_at);
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
                    crate::base::log::error!(queue = %self.queue, "a delivery was left undecided; returning it to the queue");
                    Decision::new(Outcome::Requeued { error: "left undecided".into() })
                })
            })
            .collect()
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
            let fault = match self.run(items, part, prepared, &mut marked).await {
                Ok(ran) => return ran,
                Err(fault) => fault,
            };
            let fault = match fault {
                Fault::Infra(fault) => fault,
                Fault::Contention { error, .. } if contention < CONTENTION_RETRIES => {
                    contention += 1;
                    crate::base::log::info!(queue = %self.queue, %error, contention, "transaction rolled back for contention; running it again");
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
                crate::base::log::error!(queue = %self.queue, fault = %message, "database fault; retrying the transaction on a fresh connection (not counted as an attempt)");
                last_logged = Some(message);
            }
            backoff.wait().await;
        }
    }

    /// One run of `part`: decode, then — for messages that need the database — one
    /// connection for the [`Stage`]s. A server error on one of idemq's own
    /// statements is diagnosed (see [`Self::diagnose`]); a connection in an unknown
    /// state never goes back to the pool.
    async fn run(
        &self,
        items: &[Delivered],
        part: &[usize],
        prepared: &mut [Option<Result<Prepared, Rejection>>],
        marked: &mut Option<i32>,
    ) -> Result<Ran, Fault> {
        let alone = part.len() == 1 && items[part[0]].runs_alone();
        let mut tx = Tx::new(items, self.handler.dedup());
        let decoded = self.decode(items, part, prepared, alone, &mut tx.ran);
        if decoded.runnable.is_empty() && !alone {
            return Ok(tx.ran);
        }
        let mut conn =
            self.shared.pool.get().await.map_err(|err| Fault::Infra(InfraFault::Pool(err.to_string())))?;
        let first = if alone {
            Stage::Alone { index: part[0], decoded }
        } else {
            Stage::Claim { runnable: decoded.runnable, starts: None }
        };
        let result = match self.stages(&mut conn, &mut tx, first, marked).await {
            Err(Fault::Infra(InfraFault::Database(err))) => Err(self.diagnose(&mut conn, err).await),
            ran => ran,
        };
        if matches!(result, Err(Fault::Infra(_))) || PoolableConnection::is_broken(&mut **conn) {
            // Never return a connection in an unknown state to the pool.
            drop(db::Pooled::take(conn));
        }
        result.map(|()| tx.ran)
    }

    /// The run's stages on `conn`, from `stage` to the end.
    async fn stages(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        mut stage: Stage,
        marked: &mut Option<i32>,
    ) -> Result<(), Fault> {
        // A message run alone whose start was counted: its decision clears the mark.
        let mut started = false;
        loop {
            stage = match stage {
                Stage::Alone { index, decoded } => {
                    let step = self.alone(conn, tx, index, decoded, marked).await?;
                    started = matches!(step, Step::Next(_));
                    step.then(|(prepared, starts)| Stage::Claim {
                        runnable: vec![prepared],
                        starts: Some(starts),
                    })
                }
                Stage::Claim { runnable, starts } => {
                    self.claim(conn, tx, runnable).await?.then(|claimed| Stage::Open { claimed, starts })
                }
                Stage::Open { claimed, starts } => {
                    self.open(conn, tx, claimed, starts).await?.then(Stage::Handle)
                }
                Stage::Handle(Open { xid, new }) => {
                    self.handle(conn, tx, new).await?.then(|done| Stage::Write { xid, done })
                }
                Stage::Write { xid, done } => {
                    let outbox = self.write(conn, tx, &done).await?;
                    Stage::Commit { xid, done, outbox }
                }
                Stage::Commit { xid, done, outbox } => {
                    self.commit(conn, tx, xid, done, outbox).await?;
                    Stage::Ended
                }
                Stage::Ended => break,
            };
        }
        if started {
            for (_, decision) in &mut tx.ran.decided {
                decision.marked = true;
            }
        }
        Ok(())
    }
}
