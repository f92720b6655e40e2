//! The life of a delivery, start to finish. This module is the heart of idemq.
//!
//! Deliveries run in batches (group commit): up to `batch_size` deliveries of one
//! consumer that have arrived, in one transaction, acked together after COMMIT. A
//! lone delivery is a batch of one; per-message mode is `batch_size = 1`. Each
//! delivery of a batch goes through the same states:
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
//!   it ([`verdict::around`]); a batch that fails as a whole (refused or aborted
//!   COMMIT, a lock timeout: batches wait [`db::BATCH_LOCK_TIMEOUT`] for a lock, far
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
//! - No path leaves a delivery unsettled: a guard nacks a batch (requeue) if its
//!   task ends without settling it.
//! - Poison is what *started* `delivery_limit` times without an outcome: a redelivered
//!   message runs alone (a batch of one, nothing else of this process beside it) and
//!   its start is committed before its handler runs, so a crash is charged to the
//!   message that caused it, not to the prefetch window around it.
//! - Every copy carries a copy id (lineage + attempt); a redelivered original whose
//!   copy the broker already confirmed is acked without running its handler. A
//!   recorded copy can only ever settle the message it was made from: the lineage
//!   hashes the message's scope, key, `message_id`, body and replay generation
//!   ([`crate::handler::identity`]), so two messages that differ to their handler never share one.
//! - What handlers publish (through their [`Context`]) and return goes into the
//!   batch's transaction after the last handler, one statement for the outbox rows
//!   (with a request's reply) and one for the results: published if and only if the
//!   effect commits. A duplicated request's stored reply is committed to the outbox
//!   before the duplicate is acked; a request's permanent failure is committed as its
//!   dedup row (holding the error reply) before it is dead-lettered.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::deadpool::{Object, Pool};
use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncConnection, AsyncPgConnection, TransactionManager};
use futures_util::FutureExt;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use lapin::Acker;
use lapin::Channel;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::amqp_value;
use crate::base::backoff::Backoff;
use crate::base::headers;
use crate::base::observe::{Batch, Commit, InfrastructureRetry, Observers};
use crate::base::outcome::{FailureKind, Outcome, Settled};
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::retry::{wait_queue_name, RetryPolicy};
use crate::base::verdict;
use crate::base::verdict::OnConflict;
use crate::base::width::Width;
use crate::broker::acks::Acks;
use crate::broker::dead_letter::{self, Letter};
use crate::error::Error;
use crate::handler::context::{Context, HandlerOutput};
use crate::handler::identity::Identity;
use crate::handler::prepare::{ErasedHandler, Fingerprint, InputLimits, Prepared, Rejection};
use crate::handler::{ErrorClass, HandlerError};
use crate::store::db::Stored;
use crate::store::db::{self, CommitFailure};

/// How often a transaction refused for contention (serialization failure,
/// deadlock) is run again in-process before it counts as a failed attempt.
const CONTENTION_RETRIES: u32 = 3;

/// How long a copy being published when the shutdown cut-off fires may still take to
/// be confirmed: cutting it off would leave the copy and the original both alive.
const COPY_GRACE: Duration = Duration::from_secs(5);

/// The longest idemq waits for its own best-effort bookkeeping (cancelling a
/// statement, recording a copy, clearing start marks).
const BOOKKEEPING_TIMEOUT: Duration = Duration::from_secs(5);

/// What a handler failure says when the handler ignored a failed statement.
const ABORTED: &str = "a statement in the handler failed and its error was ignored; \
                       the transaction was rolled back (PostgreSQL aborts a transaction at its first failed \
                       statement: return the error with `?`, or run the statement in a nested \
                       `conn.transaction(..)`, a savepoint, to recover from it)";

/// What a handler failure says when the handler ran its own COMMIT or ROLLBACK.
const ENDED: &str = "the handler ended idemq's transaction itself (COMMIT or ROLLBACK); \
                     whatever it did after was rolled back. Don't end the transaction in a handler: \
                     idemq commits it with the dedup row (use `conn.transaction(..)` for a savepoint)";

/// What a handler failure says when the handler discarded idemq's prepared check.
const DISCARDED: &str = "the handler discarded idemq's prepared statements (DISCARD ALL or DEALLOCATE); \
                         the transaction was rolled back. Don't reset the session in a handler";

/// Everything one consumer's deliveries need; shared by its batches.
pub(crate) struct Consumer {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) delivery_limit: u32,
    pub(crate) retry: RetryPolicy,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// The handler's dedup scope: the `handler` column of its rows (its name, under
    /// the runtime's namespace if one is set).
    pub(crate) scope: String,
    /// The channel the deliveries come on.
    pub(crate) channel: Channel,
    /// How deliveries of this channel session are settled: every ack and nack goes
    /// through it (see [`Acks`] for when one `multiple` ack is safe).
    pub(crate) acks: Arc<Acks>,
    /// The confirm-mode channel for copies, on the session's publishing connection.
    pub(crate) publisher: Channel,
    /// Where copies settle in tasks of their own (the runtime's: shutdown waits).
    pub(crate) tracker: TaskTracker,
    /// The publishing connection's negotiated frame size: copies stay under it.
    pub(crate) frame_max: u32,
    /// Which connection session this consumer belongs to (1, 2, … after reconnects).
    pub(crate) session: u64,
    /// How many of this consumer's batches may run at once (a handler without a
    /// lane); narrows while its batches collide (see [`Width`]).
    pub(crate) width: Width,
    /// How its batches are formed (the handler's `batch = N` applied).
    pub(crate) batch: BatchLimits,
    /// The handler's `on_conflict`, else the runtime's.
    pub(crate) on_conflict: OnConflict,
    pub(crate) shared: Arc<Shared>,
}

/// What every consumer of a runtime shares.
pub(crate) struct Shared {
    pub(crate) pool: Pool<AsyncPgConnection>,
    /// The pool's TLS, for cancel requests (sent on a connection of their own).
    pub(crate) cancel_tls: tokio_postgres_rustls::MakeRustlsConnect,
    pub(crate) limits: InputLimits,
    pub(crate) handler_timeout: Duration,
    /// How long idemq waits for an answer to one of its own statements (see
    /// [`Consumer::bounded`]).
    pub(crate) statement_deadline: Duration,
    pub(crate) database_retry_limit: Duration,
    /// Every subscriber: the runtime's stats, the user's observers.
    pub(crate) observers: Observers,
    /// Wakes the outbox relay(s) after a COMMIT that wrote outbox rows.
    pub(crate) outbox: crate::engine::relay::OutboxSignal,
    /// Taken for writing by a redelivered message (it runs alone), for reading by
    /// every batch: a crash while a redelivered message runs is its own.
    pub(crate) turns: RwLock<()>,
    /// Raised by a delivery that met a fault no retry can fix: the runtime stops.
    pub(crate) fatal: Fatal,
    #[cfg(feature = "fault-injection")]
    pub(crate) fault_hook: Option<crate::engine::fault::FaultHook>,
}

/// How batches are formed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchLimits {
    /// The most deliveries in one transaction (1: per-message mode).
    pub(crate) size: usize,
    /// How long a batch that is not full waits for more (zero: not at all).
    pub(crate) linger: Duration,
    /// Pipelines per laned consumer (the runtime's concurrency).
    pub(crate) pipelines: usize,
}

/// A fault that stops the runtime, raised from a delivery task.
pub(crate) struct Fatal {
    pub(crate) stop: CancellationToken,
    error: std::sync::Mutex<Option<Error>>,
}

impl Fatal {
    /// `stop` is what the runtime's consumers stop on: a child of the caller's
    /// shutdown token, cancelled here too when a fatal fault is raised.
    pub(crate) fn new(stop: CancellationToken) -> Self {
        Self { stop, error: std::sync::Mutex::default() }
    }

    fn raise(&self, error: Error) {
        tracing::error!(%error, "stopping the runtime: a fault no retry can fix");
        self.error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(error);
        self.stop.cancel();
    }

    /// The first fatal error raised, if any.
    pub(crate) fn take(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

/// One delivery of a batch, as the intake hands it over.
pub(crate) struct Item {
    delivered: Delivered,
    /// Decoded at intake when the handler has a lane (its value picks the pipeline);
    /// taken by the first run, decoded again for any later one.
    prepared: Option<Result<Prepared, Rejection>>,
}

impl Item {
    pub(crate) fn new(
        delivery: Delivery,
        consumer: &Consumer,
        prepared: Option<Result<Prepared, Rejection>>,
    ) -> Self {
        consumer.shared.observers.received(&consumer.queue);
        let counts = Counts::of(&delivery, &consumer.queue);
        Self { delivered: Delivered { delivery, counts, received_at: Instant::now() }, prepared }
    }

    /// A redelivered message runs alone: in a batch of its own, with nothing else of
    /// this process running beside it.
    pub(crate) fn runs_alone(&self) -> bool {
        self.delivered.runs_alone()
    }
}

/// A delivery and what its properties say.
struct Delivered {
    delivery: Delivery,
    counts: Counts,
    received_at: Instant,
}

impl Delivered {
    fn runs_alone(&self) -> bool {
        self.counts.redelivered
    }
}

/// The decision for one delivery, before it is settled with the broker.
struct Decision {
    outcome: Outcome,
    key: Option<String>,
    began_at: Option<Instant>,
    /// Whether a start mark was written for it (cleared once it has an outcome).
    marked: bool,
    /// Deliveries in the transaction that decided it (0: decided without one).
    batch: usize,
    /// The stored reply a duplicated request is answered with, published (and
    /// confirmed) before its ack.
    reply: Option<Outgoing>,
    /// How long its handler ran, if it ran.
    handler_time: Option<Duration>,
}

impl Decision {
    fn new(outcome: Outcome) -> Self {
        Self { outcome, key: None, began_at: None, marked: false, batch: 0, reply: None, handler_time: None }
    }

    /// Whether settling it waits for a publish (a copy, or a reply).
    fn publishes(&self) -> bool {
        self.reply.is_some() || matches!(self.outcome, Outcome::Retry { .. } | Outcome::DeadLettered { .. })
    }
}

/// What one run of part of a batch settled: decisions, and parts to run next (in
/// order, before anything else of the batch).
#[derive(Default)]
struct Ran {
    decided: Vec<(usize, Decision)>,
    next: Vec<Vec<usize>>,
    /// It was split because its transactions collided (a lock wait, a deadlock, a
    /// serialization failure): the consumer's batches should shrink.
    contended: bool,
}

/// Why a run of part of a batch decided nothing.
enum Fault {
    /// The database or pool failed; the outcome is unknown: try again.
    Infra(InfraFault),
    /// A delivery run alone was rolled back for contention (serialization failure,
    /// deadlock): run it again.
    Contention { error: String, key: String },
    /// No retry can fix it: return the deliveries and stop the runtime.
    Fatal(Error),
}

/// How a handler's run in the transaction failed.
enum Failure {
    /// It returned an error; the transaction is open (maybe aborted).
    Returned(HandlerError),
    /// It panicked or timed out: its statement was cancelled, and the connection,
    /// still in the transaction, is dropped.
    Cut(String),
}

impl Consumer {
    /// Processes a batch of deliveries to their end: decided, then settled with the
    /// broker — unless `cut_off` fires first (the shutdown deadline passed): then the
    /// work in flight is dropped (an open transaction rolls back when its connection
    /// closes) and the deliveries are returned to the queue. A copy already being
    /// published is given [`COPY_GRACE`] to be confirmed and acked first.
    pub(crate) async fn process(self: &Arc<Self>, batch: Vec<Item>, cut_off: &CancellationToken) {
        let (items, prepared): (Vec<Delivered>, Vec<_>) =
            batch.into_iter().map(|item| (item.delivered, item.prepared)).unzip();
        let mut guard = Unsettled::new(&self.acks, items.iter());
        // A batch whose channel closed while it waited cannot be settled: the broker
        // has already requeued it. Running it would only apply what is redelivered.
        let decided = if self.channel.status().connected() {
            let span = tracing::debug_span!("batch", queue = %self.queue, deliveries = items.len());
            tokio::select! {
                decisions = tracing::Instrument::instrument(self.decide(&items, prepared), span) => Some(decisions),
                () = cut_off.cancelled() => None,
            }
        } else {
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

    /// Clears a settled delivery's start marks and reports it.
    async fn finish(&self, item: &Delivered, decision: Decision, settled_with_broker: bool) {
        if decision.marked && !matches!(decision.outcome, Outcome::Requeued { .. } | Outcome::Abandoned) {
            if let Some(key) = &decision.key {
                self.bookkeeping("clear the start marks", async |conn| {
                    db::clear_starts(conn, &self.scope, key).await
                })
                .await;
            }
        }
        let settled = Settled {
            queue: self.queue.clone(),
            handler: self.handler.name(),
            key: decision.key,
            outcome: decision.outcome,
            settled_with_broker,
            delivery_count: item.counts.delivery_count,
            attempt: item.counts.attempt,
            redelivered: item.counts.redelivered,
            session: self.session,
            batch: decision.batch,
            received_at: item.received_at,
            began_at: decision.began_at,
            settled_at: Instant::now(),
            handler_time: decision.handler_time,
        };
        // One event per delivery, with what an operator greps for (cheap when the
        // level is off; `RUST_LOG=idemq::delivery=debug` shows them).
        tracing::debug!(
            queue = %settled.queue,
            handler = settled.handler,
            key = settled.key.as_deref().unwrap_or("-"),
            message_id = item.delivery.properties.message_id().as_ref().map_or("-", |id| id.as_str()),
            attempt = settled.attempt,
            outcome = settled.outcome.name(),
            batch = settled.batch,
            duration_ms = settled.settled_at.saturating_duration_since(settled.received_at).as_secs_f64() * 1e3,
            "settled"
        );
        self.shared.observers.settled(&settled);
    }

    /// Decides every delivery of the batch: runs it in one transaction, and runs
    /// again smaller whatever could not be decided together.
    async fn decide(
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
        let (mut splits, mut contended) = (0_u64, false);
        let started = Instant::now();
        while let Some(part) = parts.pop_front() {
            let ran = self.run_part(items, &part, &mut prepared).await;
            if !ran.next.is_empty() {
                splits += 1;
            }
            contended |= ran.contended;
            for (index, decision) in ran.decided {
                decisions[index] = Some(decision);
            }
            for next in ran.next.into_iter().rev() {
                parts.push_front(next);
            }
        }
        self.width.adapt(splits > 0, contended);
        self.shared.observers.batch(&Batch {
            queue: &self.queue,
            deliveries: items.len(),
            splits,
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
                    "the database stayed unavailable for {:?} ({fault}); returned to the queue",
                    self.shared.database_retry_limit
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
        if matches!(result, Err(Fault::Infra(_))) || PoolableConnection::is_broken(&mut *conn) {
            // Never return a connection in an unknown state to the pool.
            drop(Object::take(conn));
        }
        result
    }

    /// A redelivered message, alone: acked at once if its copy was confirmed before;
    /// else its start is counted (committed before its handler runs), then the
    /// transaction, which dead-letters it as poison once the starts reach the limit.
    async fn attempt_alone(
        &self,
        conn: &mut AsyncPgConnection,
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

    /// The transaction of `runnable` (batch index, decoded message): the dedup rows
    /// of the batch in one statement, the handlers of the new messages in arrival
    /// order, the checked COMMIT. `starts` is how often the handler of a message run
    /// alone started (this time included).
    ///
    /// Deliveries it cannot decide together go to `next` (see [`verdict::around`]
    /// and [`verdict::halves`]); a delivery whose key is already in the batch waits
    /// for the first one's fate (the same key twice keeps one dedup row).
    async fn transact(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[Delivered],
        runnable: Vec<(usize, Prepared)>,
        starts: Option<i32>,
        mut ran: Ran,
    ) -> Result<Ran, Fault> {
        let infra = |err| Fault::Infra(InfraFault::Database(err));
        let batch = runnable.len();
        let began_at = Instant::now();
        // The same key twice: the first is run, the others wait for its fate. (A
        // handler without dedup rows runs every delivery.)
        let dedup = self.handler.dedup();
        let mut seen = HashSet::new();
        let (firsts, repeats): (Vec<_>, Vec<_>) = runnable
            .into_iter()
            .partition(|(_, prepared)| !dedup || seen.insert(prepared.key.as_str().to_owned()));
        let repeats: Vec<Repeat> = repeats.into_iter().map(Repeat::from).collect();
        let rows: Vec<(&str, &[u8])> =
            firsts.iter().map(|(_, p)| (p.key.as_str(), p.fingerprint.as_slice())).collect();
        let claimed = if dedup {
            self.bounded(db::begin_and_claim(conn, &self.scope, &rows)).await
        } else {
            let keys: Vec<&str> = rows.iter().map(|(key, _)| *key).collect();
            self.bounded(db::begin_without_claim(conn, &keys)).await
        };
        let claim = match claimed {
            Ok(claim) => claim,
            Err(err) => {
                let rolled_back = !db::is_connection_error(&err)
                    && self.bounded(AnsiTransactionManager::rollback_transaction(conn)).await.is_ok()
                    && !PoolableConnection::is_broken(conn);
                if firsts.len() > 1 && rolled_back {
                    // Refused with the connection up (its lock timeout behind another
                    // batch holding one of these keys): smaller batches.
                    tracing::debug!(queue = %self.queue, error = %err, batch, "the batch's dedup insert failed; running it in halves");
                    let indices: Vec<usize> = firsts.iter().map(|(index, _)| *index).collect();
                    ran.next = split(&indices, verdict::halves(indices.len()), &repeats);
                    ran.contended = true;
                    return Ok(ran);
                }
                return Err(infra(err));
            }
        };
        drop(rows);
        let (new, applied_before): (Vec<_>, Vec<_>) =
            firsts.into_iter().partition(|(_, prepared)| claim.inserted.contains(prepared.key.as_str()));
        // Applied before: only their keys and fingerprints matter now.
        let applied_before: Vec<Repeat> = applied_before.into_iter().map(Repeat::from).collect();

        // The rows applied under each key (payload, result), for the repeats.
        let mut payloads: HashMap<String, Stored> = HashMap::new();
        if !applied_before.is_empty() {
            let keys: Vec<&str> = applied_before.iter().map(|known| known.key.as_str()).collect();
            let stored = match self.bounded(db::stored_rows(conn, &self.scope, &keys)).await {
                Ok(stored) => stored,
                Err(err) => return Err(rollback(conn, infra(err)).await),
            };
            // Gone since the insert found it (deleted by hand or by retention): the
            // next run decides again.
            if applied_before.iter().any(|known| !stored.contains_key(&known.key)) {
                return Err(rollback(conn, infra(diesel::result::Error::NotFound)).await);
            }
            payloads = stored;
            self.resolve_repeats(&mut ran, items, applied_before, &payloads, began_at, batch);
        }
        let Some(xid) = claim.xid.filter(|_| !new.is_empty()) else {
            // Nothing new: nothing to keep.
            self.bounded(AnsiTransactionManager::rollback_transaction(conn)).await.map_err(infra)?;
            self.resolve_repeats(&mut ran, items, repeats, &payloads, began_at, batch);
            return Ok(ran);
        };
        if let Some(outcome) = starts.and_then(|starts| verdict::poison(starts, self.delivery_limit)) {
            self.bounded(AnsiTransactionManager::rollback_transaction(conn)).await.map_err(infra)?;
            let (index, prepared) = &new[0];
            ran.decided.push((*index, self.decision(outcome, prepared.key.as_str(), Some(began_at), batch)));
            return Ok(ran);
        }

        if new.len() > 1 {
            if let Err(err) = self.bounded(db::limit_batch_lock_waits(conn)).await {
                return Err(rollback(conn, infra(err)).await);
            }
        }
        let cancel = conn.cancel_token();
        let mut done = Vec::with_capacity(new.len());
        let new_indices: Vec<usize> = new.iter().map(|(index, _)| *index).collect();
        for (position, (index, prepared)) in new.into_iter().enumerate() {
            let Prepared { key, fingerprint, effect, .. } = prepared;
            let delivered = &items[index];
            let mut ctx = Context::new(
                &self.scope,
                key.as_str(),
                delivered.counts.attempt,
                delivered.counts.redelivered,
                &delivered.delivery.properties,
            );
            if !dedup {
                // Two deliveries with one key are two messages here: their outbox
                // rows must not share ids.
                ctx.use_random_ids();
            }
            let run = AssertUnwindSafe(effect(conn, &mut ctx)).catch_unwind();
            let started = Instant::now();
            let ran_for = tokio::time::timeout(self.shared.handler_timeout, run).await;
            let took = started.elapsed();
            let failure = match ran_for {
                Ok(Ok(Ok(output))) => {
                    let published = ctx.take_published();
                    done.push(Done { index, key, fingerprint, output, published, took });
                    continue;
                }
                Ok(Ok(Err(error))) => Failure::Returned(error),
                // Both leave the transaction open and maybe a statement running: cancel
                // it on the server (dropping the connection alone would not stop it, and
                // it would keep its locks); `attempt` then drops the connection (it is in
                // a transaction, so broken), which ends the transaction server-side.
                Ok(Err(panic)) => {
                    cancel_statement(&cancel, &self.shared.cancel_tls).await;
                    Failure::Cut(format!("the handler panicked: {}", panic_message(&*panic)))
                }
                Err(_elapsed) => {
                    cancel_statement(&cancel, &self.shared.cancel_tls).await;
                    if !answers(conn).await {
                        // Its connection does not answer either: the handler was most
                        // likely waiting for an unreachable database, which is an
                        // outage, not the handler's failed attempt. The transaction
                        // runs again on a fresh connection (not counted).
                        return Err(Fault::Infra(InfraFault::Broken(format!(
                            "the handler did not finish within {:?}, and its database connection did \
                             not answer after its statement was cancelled",
                            self.shared.handler_timeout
                        ))));
                    }
                    Failure::Cut(format!(
                        "the handler did not finish within {:?}",
                        self.shared.handler_timeout
                    ))
                }
            };
            if let Failure::Returned(_) = &failure {
                match self.bounded(AnsiTransactionManager::rollback_transaction(conn)).await {
                    // A failed ROLLBACK means the connection broke: whatever the
                    // handler wrapped, this is an infrastructure fault.
                    Err(err) => return Err(infra(err)),
                    Ok(()) if PoolableConnection::is_broken(conn) => {
                        return Err(Fault::Infra(InfraFault::Broken(failure.to_string())))
                    }
                    Ok(()) => {}
                }
            }
            if new_indices.len() > 1 {
                // Maybe a neighbour's doing (a lock, an aborted transaction): the
                // others run without it (those after it never ran), and it runs alone.
                tracing::debug!(queue = %self.queue, key = %key, error = %failure, batch, "a handler failed in a batch; running it alone");
                ran.next = split(&new_indices, verdict::around(new_indices.len(), position), &repeats);
                ran.contended = db::is_contention_message(&failure.to_string());
                return Ok(ran);
            }
            let error = match failure {
                Failure::Returned(error) => error,
                Failure::Cut(message) => HandlerError::transient(message),
            };
            let class = error.class();
            let outcome = self.handler_failed(error, items[index].counts.attempt);
            if class == ErrorClass::Permanent && dedup {
                self.store_failure(conn, &items[index], &key, &fingerprint, &outcome).await?;
            }
            let mut decision = self.decision(outcome, key.as_str(), Some(began_at), batch);
            decision.handler_time = Some(took);
            ran.decided.push((index, decision));
            ran.next = rerun_repeats(repeats);
            return Ok(ran);
        }

        // The outbox rows and stored results of the whole batch: one statement each.
        let mut rows: Vec<Outgoing> = Vec::new();
        let mut results: Vec<(&str, &[u8])> = Vec::new();
        for done in &done {
            rows.extend(done.published.iter().cloned());
            if let Some(request) = Request::of(&items[done.index].delivery.properties) {
                let body = HandlerOutput::reply_body(done.output.0.as_deref());
                // Without dedup rows two requests may share a key: random reply ids.
                let id = if dedup {
                    self.reply_id(done.key.as_str())
                } else {
                    uuid::Uuid::new_v4().simple().to_string()
                };
                rows.push(Outgoing::reply(&request, id, body, true));
            }
            match &done.output.0 {
                Some(result) if dedup => results.push((done.key.as_str(), result)),
                _ => {}
            }
        }
        let written = async {
            self.bounded(db::insert_outbox(conn, &rows)).await?;
            self.bounded(db::store_results(conn, &self.scope, &results)).await
        };
        if let Err(err) = written.await {
            return Err(rollback(conn, infra(err)).await);
        }
        drop(results);

        let committing = Instant::now();
        let commit = tokio::time::timeout(self.shared.statement_deadline, db::commit_checked(conn, xid));
        let committed = commit
            .await
            .unwrap_or_else(|_| Err(CommitFailure::Unknown(no_answer(self.shared.statement_deadline))));
        let failure = match committed {
            Ok(()) => {
                let commit =
                    Commit { queue: &self.queue, deliveries: done.len(), took: committing.elapsed() };
                self.shared.observers.committed(&commit);
                if !rows.is_empty() {
                    self.shared.outbox.committed();
                }
                for Done { index, key, fingerprint, output, took, .. } in done {
                    let stored =
                        Stored { fingerprint: Some(fingerprint.to_vec()), result: output.0, failed: false };
                    payloads.insert(key.as_str().to_owned(), stored);
                    let mut decision = self.decision(Outcome::Applied, key.as_str(), Some(began_at), batch);
                    decision.handler_time = Some(took);
                    ran.decided.push((index, decision));
                }
                self.resolve_repeats(&mut ran, items, repeats, &payloads, began_at, batch);
                return Ok(ran);
            }
            // COMMIT's fate is unknown: retry; the dedup rows decide.
            Err(CommitFailure::Unknown(err)) => return Err(Fault::Infra(InfraFault::Commit(err))),
            Err(failure) => failure,
        };
        if done.len() > 1 {
            tracing::debug!(queue = %self.queue, ?failure, batch, "the batch's COMMIT failed; running it in halves");
            let indices: Vec<usize> = done.iter().map(|done| done.index).collect();
            ran.next = split(&indices, verdict::halves(indices.len()), &repeats);
            ran.contended = matches!(failure, CommitFailure::Refused { contention: true, .. })
                || matches!(&failure, CommitFailure::Refused { error, .. } if db::is_contention_message(&error.to_string()));
            return Ok(ran);
        }
        let Done { index, key, .. } = done.pop().expect("a transaction with an xid ran a handler");
        let attempt = items[index].counts.attempt;
        let error = match failure {
            CommitFailure::Aborted => HandlerError::transient(ABORTED),
            CommitFailure::Ended => HandlerError::transient(ENDED),
            CommitFailure::CheckMissing => HandlerError::transient(DISCARDED),
            CommitFailure::Refused { error, contention: true } => {
                return Err(Fault::Contention {
                    error: format!("PostgreSQL rolled the transaction back at COMMIT: {error}"),
                    key: key.as_str().to_owned(),
                });
            }
            CommitFailure::Refused { error, contention: false } => HandlerError::transient(format!(
                "PostgreSQL refused the COMMIT and rolled the transaction back: {error}"
            )),
            CommitFailure::Unknown(_) => unreachable!("handled above"),
        };
        let outcome = self.handler_failed(error, attempt);
        ran.decided.push((index, self.decision(outcome, key.as_str(), Some(began_at), batch)));
        ran.next = rerun_repeats(repeats);
        Ok(ran)
    }

    /// Decides the repeats of keys whose payload is known (applied by this
    /// transaction or before it); any other runs next. A duplicated request is
    /// answered with the stored result (or stored error).
    fn resolve_repeats(
        &self,
        ran: &mut Ran,
        items: &[Delivered],
        repeats: Vec<Repeat>,
        payloads: &HashMap<String, Stored>,
        began_at: Instant,
        batch: usize,
    ) {
        let mut unresolved = Vec::new();
        for repeat in repeats {
            match payloads.get(&repeat.key) {
                Some(stored) => {
                    let outcome = verdict::already_applied(
                        &repeat.key,
                        stored.fingerprint.as_deref(),
                        &repeat.fingerprint,
                        self.on_conflict,
                    );
                    let mut decision = self.decision(outcome, &repeat.key, Some(began_at), batch);
                    if decision.outcome == Outcome::Duplicate {
                        if let Some(request) = Request::of(&items[repeat.index].delivery.properties) {
                            let body = HandlerOutput::reply_body(stored.result.as_deref());
                            let id = self.reply_id(&repeat.key);
                            decision.reply = Some(Outgoing::reply(&request, id, body, !stored.failed));
                        }
                    }
                    ran.decided.push((repeat.index, decision));
                }
                None => unresolved.push(repeat.index),
            }
        }
        if !unresolved.is_empty() {
            ran.next.push(unresolved);
        }
    }

    /// One of idemq's own statements, bounded on the client too: past
    /// [`Shared::statement_deadline`] (the server's `statement_timeout` and a margin)
    /// the server would have answered, if only with an error, so no answer means the
    /// network to it is gone — a half-open connection (a pooler or proxy that stays
    /// up, a black hole) must not hold a delivery for the whole outage. The error is a
    /// connection error: the transaction is retried on a fresh connection.
    async fn bounded<T>(
        &self,
        statement: impl Future<Output = diesel::QueryResult<T>>,
    ) -> diesel::QueryResult<T> {
        let deadline = self.shared.statement_deadline;
        tokio::time::timeout(deadline, statement).await.unwrap_or_else(|_| Err(no_answer(deadline)))
    }

    fn decision(&self, outcome: Outcome, key: &str, began_at: Option<Instant>, batch: usize) -> Decision {
        Decision {
            outcome,
            key: Some(key.to_owned()),
            began_at,
            marked: false,
            batch,
            reply: None,
            handler_time: None,
        }
    }

    /// The message id of the reply to the request with `key` (every copy of it).
    fn reply_id(&self, key: &str) -> String {
        outgoing::message_id(&self.scope, key, "reply")
    }

    /// A request that failed permanently (its transaction rolled back): its failure
    /// is committed as its dedup row, holding the error reply, with that reply in the
    /// outbox — so a duplicate of it gets the same error, without running the handler
    /// (see [`crate::forget`] to apply it after a fix). Other failures store nothing.
    async fn store_failure(
        &self,
        conn: &mut AsyncPgConnection,
        item: &Delivered,
        key: &crate::Key,
        fingerprint: &Fingerprint,
        outcome: &Outcome,
    ) -> Result<(), Fault> {
        let (Some(request), Outcome::DeadLettered { kind, error }) =
            (Request::of(&item.delivery.properties), outcome)
        else {
            return Ok(());
        };
        let body = outgoing::error_reply(kind.as_str(), error);
        let reply = Outgoing::reply(&request, self.reply_id(key.as_str()), body, false);
        let scope = &self.scope;
        let stored = self
            .bounded(conn.transaction::<bool, diesel::result::Error, _>(async |conn| {
                let new =
                    db::store_failure(conn, scope, key.as_str(), fingerprint.as_slice(), &reply.body).await?;
                if new {
                    db::insert_outbox(conn, std::slice::from_ref(&reply)).await?;
                }
                Ok(new)
            }))
            .await
            .map_err(|err| Fault::Infra(InfraFault::Database(err)))?;
        if stored {
            self.shared.outbox.committed();
        }
        Ok(())
    }

    fn handler_failed(&self, error: HandlerError, attempt: u32) -> Outcome {
        verdict::handler_failed(error.class(), error.to_string(), attempt, &self.retry)
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

    /// A statement of idemq's own failed. A server error with the connection still
    /// up may mean idemq's schema is missing or unusable — no retry fixes that, so
    /// the runtime stops; anything else (a lock timeout behind a zombie, a restart in
    /// progress) is retried.
    async fn diagnose(&self, conn: &mut AsyncPgConnection, err: diesel::result::Error) -> Fault {
        if db::is_connection_error(&err) || PoolableConnection::is_broken(conn) {
            return Fault::Infra(InfraFault::Database(err));
        }
        match crate::store::migrate::check_schema(conn).await {
            Ok(Some(problem)) => Fault::Fatal(problem.into()),
            Ok(None) | Err(_) => Fault::Infra(InfraFault::Database(err)),
        }
    }

    /// Tells the broker what was decided without a copy: one ack for everything
    /// applied or skipped (see [`Acks::ack`]), then nacks. Returns, per delivery,
    /// whether its frame was sent (`false`: the channel is gone and the broker will
    /// redeliver; the dedup row or the copy record makes that harmless).
    async fn settle(&self, settled: &[(Delivered, Decision)]) -> Vec<bool> {
        let mut sent = vec![false; settled.len()];
        let acked: Vec<usize> =
            (0..settled.len()).filter(|&i| !needs_requeue(&settled[i].1.outcome)).collect();
        #[cfg(feature = "fault-injection")]
        for &i in &acked {
            self.fault(crate::engine::fault::FaultPoint::AfterCommit, &settled[i].1).await;
        }
        if !acked.is_empty() {
            let deliveries: Vec<&Delivery> = acked.iter().map(|&i| &settled[i].0.delivery).collect();
            for (&i, result) in acked.iter().zip(self.acks.ack(&deliveries).await) {
                sent[i] = report(result, self, &settled[i].1);
            }
        }
        for (i, (item, decision)) in settled.iter().enumerate() {
            if needs_requeue(&decision.outcome) {
                sent[i] = report(self.acks.requeue(&item.delivery).await, self, decision);
            }
        }
        sent
    }

    /// Publishes the retry copy or dead letter `decision` asks for, then acks the
    /// original; a copy that cannot be published requeues the original instead.
    async fn settle_copy(
        &self,
        item: &Delivered,
        decision: &mut Decision,
        cut_off: &CancellationToken,
    ) -> bool {
        let (delivery, counts) = (&item.delivery, &item.counts);
        if let Some(reply) = decision.reply.take() {
            return self.settle_reply(delivery, decision, reply, cut_off).await;
        }
        // (target queue, kind, error, retry_of) of the copy.
        let (target, kind, error, retry_of) = match &decision.outcome {
            Outcome::Retry { error, delay } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, attempt = counts.attempt, ?delay, %error, "handler failed; retrying later");
                let (error, delay) = (error.clone(), *delay);
                let jitter = tokio::time::sleep(self.retry.jitter_for(delay));
                if tokio::select! { () = jitter => false, () = cut_off.cancelled() => true } {
                    decision.outcome = Outcome::Abandoned;
                    return report(self.acks.requeue(delivery).await, self, decision);
                }
                (wait_queue_name(&self.queue, delay), None, error, Some(self.queue.as_str()))
            }
            Outcome::DeadLettered { kind, error } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, kind = %kind, %error, "dead-lettering");
                (self.dead_letter_queue.clone(), Some(*kind), error.clone(), None)
            }
            _ => return report(self.acks.ack_one(delivery).await, self, decision),
        };
        let copy_id = self.identity(item, decision.key.as_deref()).copy_id(counts.attempt);
        let letter = Letter {
            kind,
            error: &error,
            handler: self.handler.name(),
            queue: &self.queue,
            attempts: counts.attempt,
            copy_id: &copy_id,
            retry_of,
        };
        let publish = dead_letter::publish(&self.publisher, &target, delivery, &letter, self.frame_max);
        tokio::pin!(publish);
        let published = tokio::select! {
            published = &mut publish => published,
            // A copy half-way must not be split from its ack: give it a moment.
            () = cut_off.cancelled() => tokio::time::timeout(COPY_GRACE, &mut publish)
                .await
                .unwrap_or(Err(dead_letter::PublishError::CutOff { queue: target.clone() })),
        };
        if let Err(err) = published {
            tracing::error!(queue = %self.queue, error = %err, "could not publish the copy; the delivery is requeued");
            if matches!(err, dead_letter::PublishError::Nacked { .. }) {
                // A nack is the broker refusing on this channel, and on RabbitMQ 3.10 a
                // channel that first published to a quorum queue during its leader
                // election stays refused (seen with the outbox relay on a cluster):
                // the session ends on the closed publishing channel and reconnects
                // with fresh ones, instead of nacking this copy until the broker's
                // own delivery limit dead-letters the original.
                let _ = tokio::time::timeout(
                    BOOKKEEPING_TIMEOUT,
                    self.publisher.close(200, "a copy was nacked: reconnecting".into()),
                )
                .await;
            }
            decision.outcome = Outcome::Requeued { error: err.to_string() };
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = cut_off.cancelled() => {}
            }
            return report(self.acks.requeue(delivery).await, self, decision);
        }
        // Were the ack lost now, the redelivered original finds this record and
        // is acked without a second copy (a crash before it: see the README).
        self.bookkeeping("record the copy", async |conn| db::record_copy(conn, &copy_id).await).await;
        #[cfg(feature = "fault-injection")]
        self.fault(crate::engine::fault::FaultPoint::AfterCopy, decision).await;
        report(self.acks.ack_one(delivery).await, self, decision)
    }

    /// A duplicated request: its stored reply goes into the outbox (committed on its
    /// own, before the ack: a crash between them only sends the reply once more,
    /// under the same message id), then the duplicate is acked. If the row cannot be
    /// written, the delivery is requeued and answered when it comes back.
    async fn settle_reply(
        &self,
        delivery: &Delivery,
        decision: &mut Decision,
        reply: Outgoing,
        cut_off: &CancellationToken,
    ) -> bool {
        let write = async {
            let mut conn = self.shared.pool.get().await.map_err(|err| err.to_string())?;
            db::insert_outbox(&mut conn, std::slice::from_ref(&reply)).await.map_err(|err| err.to_string())
        };
        let written = tokio::time::timeout(BOOKKEEPING_TIMEOUT, write)
            .await
            .unwrap_or_else(|_| Err(format!("the outbox insert took over {BOOKKEEPING_TIMEOUT:?}")));
        if let Err(error) = written {
            tracing::error!(queue = %self.queue, key = ?decision.key, %error, "could not queue the stored reply of a duplicated request; the delivery is requeued");
            decision.outcome =
                Outcome::Requeued { error: format!("the stored reply could not be queued: {error}") };
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = cut_off.cancelled() => {}
            }
            return report(self.acks.requeue(delivery).await, self, decision);
        }
        self.shared.outbox.committed();
        report(self.acks.ack_one(delivery).await, self, decision)
    }

    /// What makes `item` itself (see [`crate::handler::identity`]): `key` is its stored dedup key,
    /// `None` when it could not be decoded.
    fn identity<'a>(&'a self, item: &'a Delivered, key: Option<&'a str>) -> Identity<'a> {
        let delivery = &item.delivery;
        Identity {
            scope: &self.scope,
            key,
            message_id: delivery.properties.message_id().as_ref().map(|id| id.as_str()),
            body: &delivery.data,
            replay: item.counts.replay,
        }
    }

    /// Runs a best-effort statement of idemq's own on a pooled connection, bounded;
    /// a failure is logged, never fatal to the delivery.
    async fn bookkeeping<F>(&self, what: &str, statement: F)
    where
        F: for<'c> AsyncFnOnce(&'c mut AsyncPgConnection) -> diesel::QueryResult<()>,
    {
        let run = async {
            let mut conn = self.shared.pool.get().await.map_err(|err| err.to_string())?;
            statement(&mut conn).await.map_err(|err| err.to_string())
        };
        match tokio::time::timeout(BOOKKEEPING_TIMEOUT, run).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(queue = %self.queue, %error, "could not {what}"),
            Err(_) => tracing::warn!(queue = %self.queue, "could not {what} within {BOOKKEEPING_TIMEOUT:?}"),
        }
    }

    #[cfg(feature = "fault-injection")]
    async fn fault(&self, point: crate::engine::fault::FaultPoint, decision: &Decision) {
        if let Some(hook) = &self.shared.fault_hook {
            let context = crate::engine::fault::FaultContext {
                point,
                channel: self.channel.clone(),
                key: decision.key.clone(),
                outcome: decision.outcome.clone(),
            };
            hook(context).await;
        }
    }
}

/// Whether the delivery goes back to the queue (the rest without a copy is acked).
fn needs_requeue(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Abandoned | Outcome::Requeued { .. })
}

/// A handler that ran to `Ok` in the open transaction.
struct Done {
    index: usize,
    key: crate::Key,
    fingerprint: Fingerprint,
    output: HandlerOutput,
    /// What it published, for the outbox.
    published: Vec<Outgoing>,
    /// How long it ran.
    took: Duration,
}

/// A delivery whose key an earlier one of its batch holds: decided by that one's fate.
struct Repeat {
    index: usize,
    key: String,
    fingerprint: Fingerprint,
}

impl From<(usize, Prepared)> for Repeat {
    fn from((index, prepared): (usize, Prepared)) -> Self {
        Self { index, key: prepared.key.as_str().to_owned(), fingerprint: prepared.fingerprint }
    }
}

/// `indices` cut into `ranges` (in order), the repeats joining the last part: they
/// wait for their keys' first deliveries.
fn split(indices: &[usize], ranges: Vec<std::ops::Range<usize>>, repeats: &[Repeat]) -> Vec<Vec<usize>> {
    let mut parts: Vec<Vec<usize>> = ranges.into_iter().map(|range| indices[range].to_vec()).collect();
    if let Some(last) = parts.last_mut() {
        last.extend(repeats.iter().map(|repeat| repeat.index));
    }
    parts
}

/// The repeats of keys whose first delivery was decided without being applied: run
/// next, as new messages (per-message mode would run them after it, too).
fn rerun_repeats(repeats: Vec<Repeat>) -> Vec<Vec<usize>> {
    if repeats.is_empty() {
        Vec::new()
    } else {
        vec![repeats.into_iter().map(|repeat| repeat.index).collect()]
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Returned(error) => write!(f, "{error}"),
            Self::Cut(message) => f.write_str(message),
        }
    }
}

/// A delivery's place beside the others: alone (redelivered) or shared.
enum Turn<'a> {
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'a, ()>),
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'a, ()>),
}

/// Nacks (requeue) the deliveries of a batch whose task ends without settling them:
/// nothing may hold a delivery until the broker's `consumer_timeout`.
struct Unsettled {
    acks: Arc<Acks>,
    deliveries: Vec<(u64, Acker)>,
}

impl Unsettled {
    fn new<'a>(acks: &Arc<Acks>, items: impl Iterator<Item = &'a Delivered>) -> Self {
        let deliveries =
            items.map(|item| (item.delivery.delivery_tag, item.delivery.acker.clone())).collect();
        Self { acks: Arc::clone(acks), deliveries }
    }

    fn disarm(&mut self) {
        self.deliveries.clear();
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        let deliveries = std::mem::take(&mut self.deliveries);
        if deliveries.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            tracing::error!("a batch ended without settling its deliveries; returning them to the queue");
            let acks = Arc::clone(&self.acks);
            runtime.spawn(async move {
                for (tag, acker) in deliveries {
                    let _ = acks.requeue_tag(tag, &acker).await;
                }
            });
        }
    }
}

/// Cancels the statement running on the connection `cancel` belongs to, bounded.
async fn cancel_statement(
    cancel: &tokio_postgres::CancelToken,
    tls: &tokio_postgres_rustls::MakeRustlsConnect,
) {
    match tokio::time::timeout(BOOKKEEPING_TIMEOUT, cancel.cancel_query(tls.clone())).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "could not cancel the handler's statement"),
        Err(_) => tracing::warn!("cancelling the handler's statement timed out"),
    }
}

/// Whether a connection whose handler was cut off (its statement cancelled) still
/// answers, within [`BOOKKEEPING_TIMEOUT`]: any answer counts, an error too (the
/// cancelled statement aborted the transaction, which stays open: the connection is
/// dropped after). A cancel request is sent blind, so only an answer on the
/// connection itself tells an unreachable database from a slow handler.
async fn answers(conn: &mut AsyncPgConnection) -> bool {
    use diesel_async::SimpleAsyncConnection;
    match tokio::time::timeout(BOOKKEEPING_TIMEOUT, conn.batch_execute("SELECT 1")).await {
        Ok(Ok(())) => true,
        Ok(Err(error)) => !db::is_connection_error(&error),
        Err(_) => false,
    }
}

/// The error of one of idemq's own statements that got no answer within `deadline`:
/// a connection error (the connection is in an unknown state and is dropped).
fn no_answer(deadline: Duration) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::ClosedConnection,
        Box::new(format!(
            "no answer from PostgreSQL within {deadline:?} (its own statement_timeout would have answered by \
             then): the network to the database is down"
        )),
    )
}

/// The message of a panic payload (`panic!` with a literal or a format string).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic payload that is not a string)".to_owned())
}

/// Whether an ack/nack frame was sent; logs when it was not.
fn report(sent: lapin::Result<bool>, consumer: &Consumer, decision: &Decision) -> bool {
    match sent {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!(queue = %consumer.queue, key = ?decision.key, "the channel is gone: not settled, the broker will redeliver");
            false
        }
        Err(err) => {
            tracing::warn!(queue = %consumer.queue, key = ?decision.key, error = %err, "settling failed: the broker will redeliver");
            false
        }
    }
}

/// Rolls back after a failed statement; the original fault is what is reported. A
/// connection that failed (or got no answer) is not rolled back: it is dropped, which
/// ends its transaction on the server, and a ROLLBACK could wait as long again.
async fn rollback(conn: &mut AsyncPgConnection, fault: Fault) -> Fault {
    let lost = matches!(&fault, Fault::Infra(InfraFault::Database(err)) if db::is_connection_error(err));
    if !lost {
        let rollback = AnsiTransactionManager::rollback_transaction(conn);
        let _ = tokio::time::timeout(BOOKKEEPING_TIMEOUT, rollback).await;
    }
    fault
}

/// A fault of the database or pool: the delivery's outcome is not decided.
#[derive(Debug, thiserror::Error)]
enum InfraFault {
    #[error("no database connection: {0}")]
    Pool(String),
    #[error("database error: {0}")]
    Database(diesel::result::Error),
    #[error("COMMIT failed, its outcome is unknown: {0}")]
    Commit(diesel::result::Error),
    #[error("the connection broke during the handler: {0}")]
    Broken(String),
}

/// What a delivery's properties say about its past — only as far as the broker and
/// idemq vouch for it: headers a publisher set are not trusted.
#[derive(Debug, Clone, Copy)]
struct Counts {
    /// The broker redelivered it (it was delivered before without an ack).
    redelivered: bool,
    /// The broker's delivery count (`x-delivery-count` on quorum queues), read only
    /// when the broker says it redelivered (a publisher can set the header too).
    /// Reported; poison is judged by recorded handler starts, not by this count.
    delivery_count: u32,
    /// This handler attempt's number: 1, or 1 + the `x-idemq-attempts` of a retry
    /// copy that came back through this queue's own wait queue.
    attempt: u32,
    /// Its replay generation: how often `dlq replay` sent it back (`x-idemq-replay`,
    /// 0 without). Part of its [`Identity`]; trusting a publisher's value costs
    /// nothing (another value only makes another lineage).
    replay: u32,
}

impl Counts {
    fn of(delivery: &Delivery, queue: &str) -> Self {
        let table = delivery.properties.headers().as_ref().map(|h| h.inner());
        let header = |name: &str| table.and_then(|t| t.get(name));
        let redelivered = delivery.redelivered;
        let delivery_count =
            if redelivered { header(headers::DELIVERY_COUNT).map_or(0, as_count) } else { 0 };
        let retried_here = header(headers::RETRY_OF).and_then(amqp_value::string).is_some_and(|q| q == queue)
            && header("x-death").is_some_and(|death| came_from_wait_queue(death, queue));
        let attempt =
            if retried_here { header(headers::ATTEMPTS).map_or(0, as_count).saturating_add(1) } else { 1 };
        let replay = header(headers::REPLAY).map_or(0, as_count);
        Self { redelivered, delivery_count, attempt, replay }
    }
}

/// Whether the newest `x-death` entry says the message expired in one of `queue`'s
/// wait queues (`<queue>.retry.<ms>ms`): the broker's word that it took that path.
fn came_from_wait_queue(death: &AMQPValue, queue: &str) -> bool {
    let AMQPValue::FieldArray(entries) = death else { return false };
    let Some(AMQPValue::FieldTable(newest)) = entries.as_slice().first() else { return false };
    let field = |name: &str| newest.inner().get(name).and_then(amqp_value::string);
    let prefix = format!("{queue}.retry.");
    field("queue").is_some_and(|q| q.starts_with(&prefix)) && field("reason").as_deref() == Some("expired")
}

fn as_count(value: &AMQPValue) -> u32 {
    let number = match *value {
        AMQPValue::LongLongInt(v) => v,
        AMQPValue::LongInt(v) => i64::from(v),
        AMQPValue::LongUInt(v) => i64::from(v),
        AMQPValue::ShortInt(v) => i64::from(v),
        AMQPValue::ShortUInt(v) => i64::from(v),
        AMQPValue::ShortShortInt(v) => i64::from(v),
        AMQPValue::ShortShortUInt(v) => i64::from(v),
        _ => 0,
    };
    u32::try_from(number.max(0)).unwrap_or(u32::MAX)
}
