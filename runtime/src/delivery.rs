//! The life of one delivery, start to finish. This module is the heart of idemq.
//!
//! ```text
//!            ┌────────── too large / not JSON / bad shape / bad key ──────────┐
//!            │                                                                ▼
//! delivery ─ decode ─ key ─ BEGIN ─ INSERT dedup row ─┬─ new ─ handler ─ checked COMMIT ─ ack
//!   │                               ON CONFLICT       │          │      │  └ unknown ─┐
//!   │ redelivered:                  DO NOTHING        │          │      │             ▼
//!   │  · run alone                  RETURNING         │          │      │ refused: retry in-process on
//!   │  · copy recorded? ─ ack                         │          │      │ rolled   a fresh connection:
//!   │  · count the start                              │          │      │ back     the dedup row decides
//!   │                                                 │          │      ▼
//!   │                                                 │     error, panic, timeout,
//!   │                                                 │     aborted or ended transaction
//!   │                                                 │          ▼
//!   │                                                 │      ROLLBACK
//!   │                                                 │   transient, attempts left:
//!   │                                                 │     copy → <queue>.retry.<ms>ms (TTL,
//!   │                                                 │     dead-letters back), then ack
//!   │                                                 │   transient, last attempt ───┐
//!   │                                                 │   permanent ─────────────────┤
//!   │                                                 ├─ exists, same payload ─ ack (duplicate)
//!   │                                                 ├─ exists, other payload ──────┤ (conflict)
//!   │                                                 └─ new, started ≥ limit ───────┤ (poison)
//!   │                                                                                ▼
//!   └──────────────   dead-letter: publish (mandatory, confirmed) the original bytes with
//!                     x-idemq-* headers to the DLQ, record the copy, then ack; a copy that
//!                     cannot be published (retry or dead letter): nack with requeue instead
//! ```
//!
//! Invariants:
//! - The ack is sent only after COMMIT returned Ok, or after a copy (retry or dead
//!   letter) was confirmed and routed. Never before.
//! - The dedup row and the handler's writes share one transaction on one connection:
//!   both commit or neither does. Concurrent duplicates block on the unique index and
//!   then see the committed row; nothing checks first and acts later.
//! - COMMIT is *checked* ([`db::commit_checked`]): a transaction aborted by a statement
//!   whose error the handler ignored, or ended by the handler itself, is rolled back
//!   and counted as a handler failure, never acked as applied.
//! - A COMMIT the server answered with an error is a rollback (a handler failure;
//!   serialization failures and deadlocks are first run again in-process). Only a
//!   lost connection leaves COMMIT's outcome unknown: then, and for any other database
//!   fault, the delivery stays unacked and the transaction is retried on a fresh
//!   connection with backoff; such a connection is never reused. Faults no retry can
//!   fix (idemq's tables missing, privileges lacking) stop the runtime instead.
//! - A handler that panics or times out fails its attempt; its running statement is
//!   cancelled on the server and its connection dropped, so its locks go at once.
//! - No path leaves a delivery unsettled: a guard nacks it (requeue) if the task
//!   ends without settling.
//! - Poison is what *started* `delivery_limit` times without an outcome: a redelivered
//!   message runs alone (nothing else of this process runs beside it) and its start
//!   is committed before its handler runs, so a crash is charged to the message that
//!   caused it, not to the prefetch window around it.
//! - Every copy carries a copy id (lineage + attempt); a redelivered original whose
//!   copy the broker already confirmed is acked without running its handler.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::deadpool::{Object, Pool};
use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use futures_util::FutureExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use lapin::Acker;
use lapin::Channel;
use sha2::{Digest, Sha256};
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::db::{self, CommitFailure};
use crate::dead_letter::{self, headers, Letter};
use crate::error::Error;
use crate::handler::{ErrorClass, HandlerError};
use crate::key::hex;
use crate::outcome::{FailureKind, Outcome, Settled, Stats};
use crate::prepare::{ErasedHandler, InputLimits, Prepared, Rejection};
use crate::retry::{wait_queue_name, RetryPolicy};

/// What to do with a known key that arrives with a different payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnConflict {
    /// Dead-letter it (kind `conflict`): reusing a key for another payload is a
    /// client bug, the idempotency-key rule.
    #[default]
    DeadLetter,
    /// Ack it as a duplicate and log a warning.
    Ignore,
}

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

/// Everything one consumer's deliveries need; shared by its delivery tasks.
pub(crate) struct Consumer {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) delivery_limit: u32,
    pub(crate) retry: RetryPolicy,
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// The handler's dedup scope: the `handler` column of its rows (its name, under
    /// the runtime's namespace if one is set).
    pub(crate) scope: String,
    /// The channel the deliveries come on. Acks go through each delivery's own
    /// acker, which is bound to this channel: a tag from a dead channel can never be
    /// acked on a newer one (a future multi-ack batcher must key on `session`).
    pub(crate) channel: Channel,
    /// The confirm-mode channel for copies, on the session's publishing connection.
    pub(crate) publisher: Channel,
    /// The publishing connection's negotiated frame size: copies stay under it.
    pub(crate) frame_max: u32,
    /// Which connection session this consumer belongs to (1, 2, … after reconnects).
    pub(crate) session: u64,
    pub(crate) shared: Arc<Shared>,
}

/// What every consumer of a runtime shares.
pub(crate) struct Shared {
    pub(crate) pool: Pool<AsyncPgConnection>,
    pub(crate) limits: InputLimits,
    pub(crate) handler_timeout: Duration,
    pub(crate) database_retry_limit: Duration,
    pub(crate) on_conflict: OnConflict,
    pub(crate) stats: Arc<Stats>,
    pub(crate) observer: Option<crate::runtime::Observer>,
    /// Taken for writing by a redelivered message (it runs alone), for reading by
    /// every other: a crash while a redelivered message runs is its own.
    pub(crate) turns: RwLock<()>,
    /// Raised by a delivery that met a fault no retry can fix: the runtime stops.
    pub(crate) fatal: Fatal,
    #[cfg(feature = "fault-injection")]
    pub(crate) fault_hook: Option<crate::fault::FaultHook>,
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

/// The decision for one delivery, before it is settled with the broker.
struct Decision {
    outcome: Outcome,
    key: Option<String>,
    began_at: Option<Instant>,
    /// Whether a start mark was written for it (cleared once it has an outcome).
    marked: bool,
}

impl Decision {
    fn new(outcome: Outcome) -> Self {
        Self { outcome, key: None, began_at: None, marked: false }
    }
}

/// Why an attempt at the transaction did not decide the delivery.
enum Fault {
    /// The database or pool failed; the outcome is unknown: try again.
    Infra(InfraFault),
    /// Rolled back for contention (serialization failure, deadlock): run it again.
    Contention { error: String, key: String },
    /// No retry can fix it: return the delivery and stop the runtime.
    Fatal(Error),
}

impl Consumer {
    /// Processes one delivery to its end: decided, then settled with the broker —
    /// unless `cut_off` fires first (the shutdown deadline passed): then the work in
    /// flight is dropped (an open transaction rolls back when its connection closes)
    /// and the delivery is returned to the queue. A copy already being published is
    /// given [`COPY_GRACE`] to be confirmed and acked first.
    pub(crate) async fn process(&self, delivery: Delivery, cut_off: &CancellationToken) {
        let received_at = Instant::now();
        let counts = Counts::of(&delivery, &self.queue);
        let mut guard = Unsettled(Some(delivery.acker.clone()));
        let decided = tokio::select! {
            decision = self.decide(&delivery, &counts) => Some(decision),
            () = cut_off.cancelled() => None,
        };
        let (decision, settled_with_broker) = match decided {
            Some(mut decision) => {
                let sent = self.settle(&delivery, &mut decision, &counts, cut_off).await;
                (decision, sent)
            }
            None => {
                let decision = Decision::new(Outcome::Abandoned);
                let sent = report(delivery.acker.nack(requeue()).await, self, &decision);
                (decision, sent)
            }
        };
        guard.0 = None;
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
            delivery_count: counts.delivery_count,
            attempt: counts.attempt,
            redelivered: counts.redelivered,
            session: self.session,
            received_at,
            began_at: decision.began_at,
            settled_at: Instant::now(),
        };
        self.shared.stats.record(&settled);
        if let Some(observer) = &self.shared.observer {
            observer(&settled);
        }
    }

    /// decode → key → transaction, retried in-process on infrastructure faults.
    async fn decide(&self, delivery: &Delivery, counts: &Counts) -> Decision {
        // A redelivered message may be what crashed the last consumer: it runs alone.
        let _turn = if counts.redelivered {
            Turn::Alone(self.shared.turns.write().await)
        } else {
            Turn::Shared(self.shared.turns.read().await)
        };
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        let mut contention = 0;
        let mut marked: Option<i32> = None;
        let mut last_logged: Option<String> = None;
        let first_try = Instant::now();
        loop {
            let fault = match self.attempt(delivery, counts, &mut marked).await {
                Ok(decision) => return decision,
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
                    let error = HandlerError::transient(format!(
                        "{error} (still after {CONTENTION_RETRIES} runs in-process)"
                    ));
                    let outcome = self.handler_failed(error, counts.attempt);
                    return Decision { outcome, key: Some(key), began_at: None, marked: marked.is_some() };
                }
                Fault::Fatal(error) => {
                    let outcome = Outcome::Requeued { error: error.to_string() };
                    self.shared.fatal.raise(error);
                    return Decision::new(outcome);
                }
            };
            if first_try.elapsed() >= self.shared.database_retry_limit {
                // Held longer, the broker's consumer_timeout (30 min by default) would
                // close the channel and return every delivery on it.
                let error = format!(
                    "the database stayed unavailable for {:?} ({fault}); returned to the queue",
                    self.shared.database_retry_limit
                );
                return Decision::new(Outcome::Requeued { error });
            }
            self.shared.stats.infrastructure_retry();
            // Logged once per change of fault, not once per retry.
            let message = fault.to_string();
            if last_logged.as_deref() != Some(message.as_str()) {
                tracing::error!(queue = %self.queue, fault = %message, "database fault; retrying the transaction on a fresh connection (not counted as an attempt)");
                last_logged = Some(message);
            }
            backoff.wait().await;
        }
    }

    /// One attempt: decode, then (for a message that needs the database) one
    /// connection for the copy check, the start mark and the transaction. A server
    /// error on one of idemq's own statements is diagnosed (see [`Self::diagnose`]).
    async fn attempt(
        &self,
        delivery: &Delivery,
        counts: &Counts,
        marked: &mut Option<i32>,
    ) -> Result<Decision, Fault> {
        let prepared = self.prepare(delivery);
        if let (Err(rejection), false) = (&prepared, counts.redelivered) {
            let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message.clone() };
            return Ok(Decision::new(outcome));
        }
        let mut conn =
            self.shared.pool.get().await.map_err(|err| Fault::Infra(InfraFault::Pool(err.to_string())))?;
        let result = match self.attempt_steps(&mut conn, delivery, counts, prepared, marked).await {
            Err(Fault::Infra(InfraFault::Database(err))) => Err(self.diagnose(&mut conn, err).await),
            decided => decided,
        };
        if matches!(result, Err(Fault::Infra(_))) || PoolableConnection::is_broken(&mut *conn) {
            // Never return a connection in an unknown state to the pool.
            drop(Object::take(conn));
        }
        result
    }

    async fn attempt_steps(
        &self,
        conn: &mut AsyncPgConnection,
        delivery: &Delivery,
        counts: &Counts,
        prepared: Result<Prepared, Rejection>,
        marked: &mut Option<i32>,
    ) -> Result<Decision, Fault> {
        let infra = |err| Fault::Infra(InfraFault::Database(err));
        if counts.redelivered {
            let copy_id = self.copy_id(delivery, counts.attempt);
            if db::copy_recorded(conn, &copy_id).await.map_err(infra)? {
                return Ok(Decision::new(Outcome::AlreadyCopied { copy_id }));
            }
        }
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(rejection) => {
                let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
                return Ok(Decision::new(outcome));
            }
        };
        let key = prepared.key.as_str().to_owned();
        let starts = match (counts.redelivered, *marked) {
            (false, _) => None,
            (true, Some(starts)) => Some(starts),
            (true, None) => {
                let starts = db::mark_start(conn, &self.scope, &key).await.map_err(infra)?;
                *marked = Some(starts);
                Some(starts)
            }
        };
        let began_at = Some(Instant::now());
        let outcome = self.transact(conn, prepared, counts, starts).await?;
        Ok(Decision { outcome, key: Some(key), began_at, marked: marked.is_some() })
    }

    /// The transaction: dedup insert, handler, checked COMMIT. `starts` is how often
    /// the handler of this redelivered message started (this time included).
    async fn transact(
        &self,
        conn: &mut AsyncPgConnection,
        prepared: Prepared,
        counts: &Counts,
        starts: Option<i32>,
    ) -> Result<Outcome, Fault> {
        let Prepared { key, fingerprint, effect } = prepared;
        let infra = |err| Fault::Infra(InfraFault::Database(err));
        let xid = match db::begin_and_insert_dedup(conn, &self.scope, key.as_str(), &fingerprint).await {
            Ok(xid) => xid,
            Err(err) => return Err(rollback(conn, infra(err)).await),
        };

        let Some(xid) = xid else {
            let outcome = match db::stored_fingerprint(conn, &self.scope, key.as_str()).await {
                Ok(Some(stored))
                    if stored != fingerprint && self.shared.on_conflict == OnConflict::DeadLetter =>
                {
                    Outcome::DeadLettered {
                        kind: FailureKind::Conflict,
                        error: format!(
                            "key `{key}` was already applied with a different payload \
                             (stored sha256 {}, this message sha256 {}); a key must identify one payload",
                            hex(&stored),
                            hex(&fingerprint)
                        ),
                    }
                }
                Ok(_) => Outcome::Duplicate,
                Err(err) => return Err(rollback(conn, infra(err)).await),
            };
            // Nothing to keep: the row is someone else's, committed.
            return AnsiTransactionManager::rollback_transaction(conn).await.map(|()| outcome).map_err(infra);
        };

        if let Some(starts) = starts.filter(|&s| u32::try_from(s).unwrap_or(0) >= self.delivery_limit) {
            let outcome = Outcome::DeadLettered {
                kind: FailureKind::Poison,
                error: format!(
                    "its handler started {starts} times without an outcome (limit {}): \
                     it likely crashes or hangs the consumer",
                    self.delivery_limit
                ),
            };
            return AnsiTransactionManager::rollback_transaction(conn).await.map(|()| outcome).map_err(infra);
        }

        let cancel = conn.cancel_token();
        let run = AssertUnwindSafe(effect(conn)).catch_unwind();
        let error = match tokio::time::timeout(self.shared.handler_timeout, run).await {
            Ok(Ok(Ok(()))) => {
                return match db::commit_checked(conn, xid).await {
                    Ok(()) => Ok(Outcome::Applied),
                    Err(CommitFailure::Aborted) => {
                        Ok(self.handler_failed(HandlerError::transient(ABORTED), counts.attempt))
                    }
                    Err(CommitFailure::Ended) => {
                        Ok(self.handler_failed(HandlerError::transient(ENDED), counts.attempt))
                    }
                    Err(CommitFailure::CheckMissing) => {
                        Ok(self.handler_failed(HandlerError::transient(DISCARDED), counts.attempt))
                    }
                    Err(CommitFailure::Refused { error, contention: true }) => Err(Fault::Contention {
                        error: format!("PostgreSQL rolled the transaction back at COMMIT: {error}"),
                        key: key.as_str().to_owned(),
                    }),
                    Err(CommitFailure::Refused { error, contention: false }) => {
                        let error = HandlerError::transient(format!(
                            "PostgreSQL refused the COMMIT and rolled the transaction back: {error}"
                        ));
                        Ok(self.handler_failed(error, counts.attempt))
                    }
                    // COMMIT's fate is unknown: retry; the dedup row decides.
                    Err(CommitFailure::Unknown(err)) => Err(Fault::Infra(InfraFault::Commit(err))),
                };
            }
            Ok(Ok(Err(error))) => error,
            // Both leave the transaction open and maybe a statement running: cancel
            // it on the server (dropping the connection alone would not stop it, and
            // it would keep its locks); `attempt` then drops the connection (it is in
            // a transaction, so broken), which ends the transaction server-side.
            Ok(Err(panic)) => {
                cancel_statement(&cancel).await;
                let error =
                    HandlerError::transient(format!("the handler panicked: {}", panic_message(&*panic)));
                return Ok(self.handler_failed(error, counts.attempt));
            }
            Err(_elapsed) => {
                cancel_statement(&cancel).await;
                let error = HandlerError::transient(format!(
                    "the handler did not finish within {:?}",
                    self.shared.handler_timeout
                ));
                return Ok(self.handler_failed(error, counts.attempt));
            }
        };
        match AnsiTransactionManager::rollback_transaction(conn).await {
            // A failed ROLLBACK means the connection broke: whatever the handler
            // wrapped, this is an infrastructure fault, not a handler failure.
            Err(err) => Err(infra(err)),
            Ok(()) if PoolableConnection::is_broken(conn) => {
                Err(Fault::Infra(InfraFault::Broken(error.to_string())))
            }
            Ok(()) => Ok(self.handler_failed(error, counts.attempt)),
        }
    }

    /// Decodes the body; a panicking `Deserialize` impl or key is a decode failure.
    fn prepare(&self, delivery: &Delivery) -> Result<Prepared, Rejection> {
        let content_type = delivery.properties.content_type().as_ref().map(|ct| ct.as_str());
        let prepare = || self.handler.prepare(&delivery.data, content_type, self.shared.limits);
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
        match db::check_schema(conn).await {
            Ok(Some(problem)) => Fault::Fatal(problem.into()),
            Ok(None) | Err(_) => Fault::Infra(InfraFault::Database(err)),
        }
    }

    fn handler_failed(&self, error: HandlerError, attempt: u32) -> Outcome {
        match error.class() {
            ErrorClass::Permanent => {
                Outcome::DeadLettered { kind: FailureKind::Handler, error: error.to_string() }
            }
            ErrorClass::Transient => match self.retry.delay_after(attempt) {
                Some(delay) => Outcome::Retry { error: error.to_string(), delay },
                None => Outcome::DeadLettered {
                    kind: FailureKind::AttemptsExhausted,
                    error: format!(
                        "failed {attempt} of {} attempts; last error: {error}",
                        self.retry.max_attempts()
                    ),
                },
            },
        }
    }

    /// Tells the broker. Returns whether the frame was sent (`false`: the channel is
    /// gone and the broker will redeliver; the dedup row or the copy record makes
    /// that harmless). A copy (retry or dead letter) that cannot be published turns
    /// the outcome into [`Outcome::Requeued`]: the original goes back to the queue.
    async fn settle(
        &self,
        delivery: &Delivery,
        decision: &mut Decision,
        counts: &Counts,
        cut_off: &CancellationToken,
    ) -> bool {
        let acker = &delivery.acker;
        let handler = self.handler.name();
        // (target queue, kind, error, retry_of) of the copy to make, if any.
        let copy = match &decision.outcome {
            Outcome::Applied | Outcome::Duplicate | Outcome::AlreadyCopied { .. } => {
                #[cfg(feature = "fault-injection")]
                self.fault(crate::fault::FaultPoint::AfterCommit, decision).await;
                None
            }
            Outcome::Abandoned | Outcome::Requeued { .. } => {
                return report(acker.nack(requeue()).await, self, decision);
            }
            Outcome::Retry { error, delay } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, attempt = counts.attempt, ?delay, %error, "handler failed; retrying later");
                let (error, delay) = (error.clone(), *delay);
                let jitter = tokio::time::sleep(self.retry.jitter_for(delay));
                if tokio::select! { () = jitter => false, () = cut_off.cancelled() => true } {
                    decision.outcome = Outcome::Abandoned;
                    return report(acker.nack(requeue()).await, self, decision);
                }
                Some((wait_queue_name(&self.queue, delay), None, error, Some(self.queue.as_str())))
            }
            Outcome::DeadLettered { kind, error } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, kind = %kind, %error, "dead-lettering");
                Some((self.dead_letter_queue.clone(), Some(*kind), error.clone(), None))
            }
        };
        if let Some((target, kind, error, retry_of)) = copy {
            let copy_id = self.copy_id(delivery, counts.attempt);
            let letter = Letter {
                kind,
                error: &error,
                handler,
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
                decision.outcome = Outcome::Requeued { error: err.to_string() };
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = cut_off.cancelled() => {}
                }
                return report(acker.nack(requeue()).await, self, decision);
            }
            // Were the ack lost now, the redelivered original finds this record and
            // is acked without a second copy (a crash before it: see the README).
            self.bookkeeping("record the copy", async |conn| db::record_copy(conn, &copy_id).await).await;
            #[cfg(feature = "fault-injection")]
            self.fault(crate::fault::FaultPoint::AfterCopy, decision).await;
        }
        report(acker.ack(BasicAckOptions::default()).await, self, decision)
    }

    /// `<sha256(scope, body) in hex, 32 chars>:<attempt>`: the same for every copy
    /// of one message at one attempt (copies keep the body byte for byte).
    fn copy_id(&self, delivery: &Delivery, attempt: u32) -> String {
        let lineage = Sha256::new()
            .chain_update(self.scope.as_bytes())
            .chain_update([0])
            .chain_update(&delivery.data)
            .finalize();
        format!("{}:{attempt}", hex(&lineage[..16]))
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
    async fn fault(&self, point: crate::fault::FaultPoint, decision: &Decision) {
        if let Some(hook) = &self.shared.fault_hook {
            let context = crate::fault::FaultContext {
                point,
                channel: self.channel.clone(),
                key: decision.key.clone(),
                outcome: decision.outcome.clone(),
            };
            hook(context).await;
        }
    }
}

/// A delivery's place beside the others: alone (redelivered) or shared.
enum Turn<'a> {
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'a, ()>),
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'a, ()>),
}

/// Nacks (requeue) a delivery whose task ends without settling it: nothing may
/// hold a delivery until the broker's `consumer_timeout`.
struct Unsettled(Option<Acker>);

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let (Some(acker), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            tracing::error!("a delivery task ended without settling its delivery; returning it to the queue");
            runtime.spawn(async move {
                let _ = acker.nack(requeue()).await;
            });
        }
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions { requeue: true, ..Default::default() }
}

/// Cancels the statement running on the connection `cancel` belongs to, bounded.
async fn cancel_statement(cancel: &tokio_postgres::CancelToken) {
    match tokio::time::timeout(BOOKKEEPING_TIMEOUT, cancel.cancel_query(tokio_postgres::NoTls)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "could not cancel the handler's statement"),
        Err(_) => tracing::warn!("cancelling the handler's statement timed out"),
    }
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

/// Rolls back after a failed statement; the original fault is what is reported.
async fn rollback(conn: &mut AsyncPgConnection, fault: Fault) -> Fault {
    let _ = AnsiTransactionManager::rollback_transaction(conn).await;
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
}

impl Counts {
    fn of(delivery: &Delivery, queue: &str) -> Self {
        let table = delivery.properties.headers().as_ref().map(|h| h.inner());
        let header = |name: &str| table.and_then(|t| t.get(name));
        let redelivered = delivery.redelivered;
        let delivery_count =
            if redelivered { header(headers::DELIVERY_COUNT).map_or(0, as_count) } else { 0 };
        let retried_here = header(headers::RETRY_OF).and_then(as_str).is_some_and(|q| q == queue)
            && header("x-death").is_some_and(|death| came_from_wait_queue(death, queue));
        let attempt =
            if retried_here { header(headers::ATTEMPTS).map_or(0, as_count).saturating_add(1) } else { 1 };
        Self { redelivered, delivery_count, attempt }
    }
}

/// Whether the newest `x-death` entry says the message expired in one of `queue`'s
/// wait queues (`<queue>.retry.<ms>ms`): the broker's word that it took that path.
fn came_from_wait_queue(death: &AMQPValue, queue: &str) -> bool {
    let AMQPValue::FieldArray(entries) = death else { return false };
    let Some(AMQPValue::FieldTable(newest)) = entries.as_slice().first() else { return false };
    let field = |name: &str| newest.inner().get(name).and_then(as_str);
    let prefix = format!("{queue}.retry.");
    field("queue").is_some_and(|q| q.starts_with(&prefix)) && field("reason").as_deref() == Some("expired")
}

fn as_str(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
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
