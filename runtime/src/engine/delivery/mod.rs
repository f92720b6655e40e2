//! A delivery's life in the runtime: from the intake's batch to its ack. Read
//! `life` first: it holds the state machine (decode → key → begin → dedup insert →
//! handler → commit → ack | retry | dead-letter), its invariants and the
//! transitions between the stages, top to bottom; each stage is done in a file of
//! its own that never calls back up:
//!
//! - `decode`: a delivery's body to its message and key, or a rejection.
//! - `alone`: a redelivered message's turn alone — its copy checked, its start
//!   counted (poison is what started `delivery_limit` times).
//! - `claim`: BEGIN and the dedup rows in one statement; what the rows applied
//!   before say (duplicate, conflict); nothing new or poison ends the transaction.
//! - `handlers`: the handlers in the open transaction, cut off on panic or timeout,
//!   and what a failure means (a split in a batch, a charged attempt alone).
//! - `commit`: outbox rows and results, then the checked COMMIT.
//! - `settle`: telling the broker — acks, nacks, retry copies, dead letters, stored
//!   replies — and the bookkeeping after; the guard that nacks what a task left
//!   unsettled.
//!
//! Beside them: `tx` (what a run's stages share), `contention` (batches that
//! collide), `faults` (why a run decided nothing, and idemq's own statements that
//! bound and diagnose it), `counts` (what a delivery's properties say about its
//! past) and `unstarted` (what this process held unstarted when a channel closed).
//! This file holds the nouns every stage names: the [`Consumer`] and what its
//! consumers share, an [`Item`] of a batch and the [`Decision`] made for it.

mod alone;
mod claim;
mod commit;
mod contention;
mod counts;
mod decode;
mod faults;
mod handlers;
mod life;
mod settle;
mod tx;
mod unstarted;

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
use crate::base::pace::Pace;
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
pub(crate) use unstarted::Unstarted;

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
    /// Its handler's time per message: a batch takes what runs in about 100 ms, up
    /// to the batch size (see [`Pace`]).
    pub(crate) pace: Pace,
    /// Its batches that collided since it last said so (see `contention`).
    pub(crate) collisions: contention::Collisions,
    /// Its batches hand the runtime's relay outbox rows: they keep pace with it
    /// (see [`Wake::keep_pace`](crate::engine::relay::Wake::keep_pace)).
    pub(crate) sends: std::sync::atomic::AtomicBool,
    /// Its deliveries whose ack or nack could not be sent: logged as a count, not
    /// one line each (see [`Unsent`]).
    pub(crate) unsent: Unsent,
    /// How its batches are formed (the handler's `batch = N` applied).
    pub(crate) batch: BatchLimits,
    /// The handler's `on_conflict`, else the runtime's.
    pub(crate) on_conflict: OnConflict,
    /// Its kill switch: told every outcome; while open, batches go back unprocessed.
    pub(crate) flow: Arc<crate::engine::flow::Flow>,
    /// Its handler's rate limit, if any: the intake takes a token per delivery.
    pub(crate) rate: Option<Arc<crate::engine::flow::Rate>>,
    pub(crate) shared: Arc<Shared>,
}

impl Consumer {
    /// The most deliveries its next batch may take: the batch size, cut to what its
    /// handler runs in about 100 ms at its pace.
    pub(crate) fn batch_most(&self) -> usize {
        self.pace.batch(self.batch.size)
    }
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
    /// Deliveries held and never started when their channel closed: their
    /// redeliveries do not run alone (see [`Unstarted`]).
    pub(crate) unstarted: Unstarted,
    /// Raised by a delivery that met a fault no retry can fix: the runtime stops.
    pub(crate) fatal: Fatal,
    /// A test's fault hook (`engine/hook.rs`): `None` unless the test kit set one.
    pub(crate) fault_hook: Option<crate::engine::hook::FaultHook>,
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
        crate::base::log::error!(error = %error.report(), "stopping the runtime: a fault no retry can fix");
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
