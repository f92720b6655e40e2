//! The life of a delivery, start to finish. This module is the heart of idemq.
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
//! The files of this module, one concern each (this file holds the shared nouns and
//! [`Consumer::process`], the life above):
//! - `batch`: what runs together — decoding, a redelivered message's turn alone,
//!   parts of a batch run and re-run smaller until each delivery is decided, and the
//!   in-process retries of database faults and contention.
//! - `transact`: one transaction, in phases that each return what the next needs
//!   (claim the dedup rows → sort the known from the new → run the handlers → write
//!   the outbox and results → checked COMMIT), or end the run with its decisions.
//! - `handlers`: the handler phase of that transaction — each handler in arrival
//!   order, or a batch handler once with every new message, cut off on panic or
//!   timeout, and what its failure means (a split in a batch, a charged attempt
//!   alone, a request's permanent failure stored).
//! - `settle`: telling the broker — acks, nacks, retry copies, dead letters, stored
//!   replies — and the bookkeeping after (copy records, start marks, the `settled`
//!   event); the guard that nacks what a task left unsettled.
//! - `faults`: why a run decided nothing (database, pool, contention, fatal), how a
//!   handler failed, and the statements of idemq's own that bound and diagnose them.
//! - `counts`: what a delivery's properties and headers say about its past (attempt,
//!   redelivery, replay) and its identity.

mod batch;
mod counts;
mod faults;
mod handlers;
mod settle;
mod transact;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::message::Delivery;
use lapin::Channel;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::observe::Observers;
use crate::base::outcome::Outcome;
use crate::base::outgoing::Outgoing;
use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::base::width::Width;
use crate::broker::acks::Acks;
use crate::error::Error;
use crate::handler::prepare::{ErasedHandler, InputLimits, Prepared, Rejection};
use crate::store::db;

use counts::Counts;
pub(crate) use faults::{cancel_statement, panic_message};
pub(crate) use handlers::{batch_span, handler_span};
pub(crate) use settle::Unsent;
use settle::Unsettled;

/// The longest idemq waits for its own best-effort bookkeeping (cancelling a
/// statement, recording a copy, clearing start marks).
const BOOKKEEPING_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Its batches that collided since it last said so (see `batch`).
    pub(crate) collisions: batch::Collisions,
    /// Its deliveries whose ack or nack could not be sent: logged as a count, not
    /// one line each (see [`Unsent`]).
    pub(crate) unsent: Unsent,
    /// How its batches are formed (the handler's `batch = N` applied).
    pub(crate) batch: BatchLimits,
    /// The handler's `on_conflict`, else the runtime's.
    pub(crate) on_conflict: OnConflict,
    pub(crate) shared: Arc<Shared>,
}

/// What every consumer of a runtime shares.
pub(crate) struct Shared {
    pub(crate) pool: db::Pool,
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
    #[cfg(feature = "testing")]
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

    pub(crate) fn raise(&self, error: Error) {
        tracing::error!(error = %error.report(), "stopping the runtime: a fault no retry can fix");
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
    /// It was split because its transaction collided with another (a lock wait, a
    /// deadlock, a serialization failure), and where: the consumer's batches should
    /// shrink, and the warning says what to do about it.
    collided: Option<Collision>,
}

/// Where a batch's transaction collided with another, as far as the runtime can
/// tell from the phase that was refused (see `batch`'s warning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collision {
    /// Its dedup insert (the claim: idemq's statement, on idemq's table only): it
    /// waited on another transaction's dedup row of one of its keys, so a copy of
    /// one of its messages was in that transaction (or the table itself was locked).
    DedupRows,
    /// A handler's statement: on the rows the handler writes or locks.
    HandlerRows,
    /// Where the runtime cannot tell: COMMIT (a serialization failure, a deadlock in
    /// deferred checks), whose error names no rows.
    Unknown,
}

impl Consumer {
    /// Processes a batch of deliveries to their end: decided, then settled with the
    /// broker — unless `cut_off` fires first (the shutdown deadline passed): then the
    /// work in flight is dropped (an open transaction rolls back when its connection
    /// closes) and the deliveries are returned to the queue. A copy already being
    /// published is given [`COPY_GRACE`] to be confirmed and acked first.
    ///
    /// [`COPY_GRACE`]: settle::COPY_GRACE
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
}
