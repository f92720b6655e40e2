//! The life of one delivery, start to finish. This module is the heart of idemq.
//!
//! ```text
//!            ┌────────── too large / not JSON / bad shape / bad key ──────────┐
//!            │                                                                ▼
//! delivery ─ decode ─ key ─ BEGIN ─ INSERT dedup row ─┬─ new ─ handler ─ COMMIT ─ ack
//!                                   ON CONFLICT       │          │   └ unknown ─┐
//!                                   DO NOTHING        │          │              ▼
//!                                   RETURNING         │          │ error   retry in-process on
//!                                                     │          ▼         a fresh connection:
//!                                                     │      ROLLBACK      the dedup row decides
//!                                                     │   transient, attempts left:
//!                                                     │     copy → <queue>.retry.<ms>ms (TTL,
//!                                                     │     dead-letters back), then ack
//!                                                     │   transient, last attempt ───┐
//!                                                     │   permanent ─────────────────┤
//!                                                     ├─ exists, same body ─ ack (duplicate)
//!                                                     ├─ exists, other body ─────────┤ (conflict)
//!                                                     └─ new, delivered ≥ limit ─────┤ (poison)
//!                                                                                    ▼
//!                   dead-letter: publish (mandatory, confirmed) the original bytes with
//!                   x-idemq-* headers to the DLQ, then ack; a copy that cannot be
//!                   published (retry or dead letter): nack with requeue instead
//! ```
//!
//! Invariants:
//! - The ack is sent only after COMMIT returned Ok, or after a copy (retry or dead
//!   letter) was confirmed and routed. Never before.
//! - The dedup row and the handler's writes share one transaction on one connection:
//!   both commit or neither does. Concurrent duplicates block on the unique index and
//!   then see the committed row; nothing checks first and acts later.
//! - A database fault (lost connection, failed COMMIT or ROLLBACK, pool timeout) is
//!   not a handler failure: the delivery stays unacked and the transaction is retried
//!   on a fresh connection with backoff; such a connection is never reused.
//! - A timed-out handler's connection is dropped, never returned to the pool (a
//!   cancelled transaction would stay open there, holding its locks).

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::pooled_connection::deadpool::{Object, Pool};
use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::AMQPValue;
use lapin::Channel;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::dead_letter::{self, headers, Letter};
use crate::handler::{ErrorClass, HandlerError};
use crate::key::hex;
use crate::outcome::{FailureKind, Outcome, Settled, Stats};
use crate::prepare::{ErasedHandler, InputLimits, Prepared};
use crate::retry::{wait_queue_name, RetryPolicy};

diesel::table! {
    idemq_dedup (handler, key) {
        handler -> Text,
        key -> Text,
        fingerprint -> Nullable<Bytea>,
    }
}

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

/// Everything one consumer's deliveries need; shared by its delivery tasks.
pub(crate) struct Consumer {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    pub(crate) delivery_limit: u32,
    pub(crate) retry: RetryPolicy,
    pub(crate) handler: Arc<dyn ErasedHandler>,
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
    #[cfg(feature = "fault-injection")]
    pub(crate) fault_hook: Option<crate::fault::FaultHook>,
}

/// The decision for one delivery, before it is settled with the broker.
struct Decision {
    outcome: Outcome,
    key: Option<String>,
    began_at: Option<Instant>,
}

impl Consumer {
    /// Processes one delivery to its end: decided, then settled with the broker —
    /// unless `cut_off` fires first (the shutdown deadline passed): then the work in
    /// flight is dropped (an open transaction rolls back when its connection closes)
    /// and the delivery is returned to the queue.
    pub(crate) async fn process(&self, delivery: Delivery, cut_off: &CancellationToken) {
        let received_at = Instant::now();
        let counts = Counts::of(&delivery);
        let acker = delivery.acker.clone();
        let work = async {
            let mut decision = self.decide(&delivery, counts).await;
            let settled_with_broker = self.settle(&delivery, &mut decision, counts).await;
            (decision, settled_with_broker)
        };
        let (decision, settled_with_broker) = tokio::select! {
            done = work => done,
            () = cut_off.cancelled() => {
                let decision = Decision { outcome: Outcome::Abandoned, key: None, began_at: None };
                let requeue = BasicNackOptions { requeue: true, ..Default::default() };
                let sent = report(acker.nack(requeue).await, self, &decision);
                (decision, sent)
            }
        };
        let settled = Settled {
            queue: self.queue.clone(),
            handler: self.handler.name(),
            key: decision.key,
            outcome: decision.outcome,
            settled_with_broker,
            delivery_count: counts.delivery_count,
            attempt: counts.attempt,
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

    /// decode → key → transaction (retried in-process on infrastructure faults).
    async fn decide(&self, delivery: &Delivery, counts: Counts) -> Decision {
        let content_type = delivery.properties.content_type().as_ref().map(|ct| ct.as_str());
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        let mut last_logged: Option<String> = None;
        let first_try = Instant::now();
        loop {
            let prepared = match self.handler.prepare(&delivery.data, content_type, self.shared.limits) {
                Ok(prepared) => prepared,
                Err(rejection) => {
                    let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
                    return Decision { outcome, key: None, began_at: None };
                }
            };
            let key = Some(prepared.key.as_str().to_owned());
            let began_at = Some(Instant::now());
            let fault = match self.transact(prepared, counts).await {
                Ok(outcome) => return Decision { outcome, key, began_at },
                Err(fault) => fault,
            };
            if first_try.elapsed() >= self.shared.database_retry_limit {
                // Held longer, the broker's consumer_timeout (30 min by default) would
                // close the channel and return every delivery on it.
                let error = format!(
                    "the database stayed unavailable for {:?} ({fault}); returned to the queue",
                    self.shared.database_retry_limit
                );
                return Decision { outcome: Outcome::Requeued { error }, key, began_at };
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

    /// One attempt at the transaction. `Err` is an infrastructure fault: the outcome
    /// is unknown and the attempt must be repeated on a fresh connection.
    async fn transact(&self, prepared: Prepared, counts: Counts) -> Result<Outcome, InfraFault> {
        let mut conn = self.shared.pool.get().await.map_err(|err| InfraFault::Pool(err.to_string()))?;
        let result = self.transact_on(&mut conn, prepared, counts).await;
        if result.is_err() || PoolableConnection::is_broken(&mut *conn) {
            // Never return a connection in an unknown state to the pool.
            drop(Object::take(conn));
        }
        result
    }

    async fn transact_on(
        &self,
        conn: &mut AsyncPgConnection,
        prepared: Prepared,
        counts: Counts,
    ) -> Result<Outcome, InfraFault> {
        let delivery_count = counts.delivery_count;
        let Prepared { key, fingerprint, effect } = prepared;
        let handler = self.handler.name();
        AnsiTransactionManager::begin_transaction(conn).await.map_err(InfraFault::Database)?;

        let inserted = diesel::insert_into(idemq_dedup::table)
            .values((
                idemq_dedup::handler.eq(handler),
                idemq_dedup::key.eq(key.as_str()),
                idemq_dedup::fingerprint.eq(&fingerprint[..]),
            ))
            .on_conflict_do_nothing()
            .returning(idemq_dedup::key)
            .get_result::<String>(conn)
            .await
            .optional();
        let inserted = match inserted {
            Ok(inserted) => inserted.is_some(),
            Err(err) => return Err(rollback(conn, InfraFault::Database(err)).await),
        };

        if !inserted {
            let stored = idemq_dedup::table
                .find((handler, key.as_str()))
                .select(idemq_dedup::fingerprint)
                .get_result::<Option<Vec<u8>>>(conn)
                .await;
            let outcome = match stored {
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
                Err(err) => return Err(rollback(conn, InfraFault::Database(err)).await),
            };
            // Nothing to keep: the row is someone else's, committed.
            return match AnsiTransactionManager::rollback_transaction(conn).await {
                Ok(()) => Ok(outcome),
                Err(err) => Err(InfraFault::Database(err)),
            };
        }

        if delivery_count >= self.delivery_limit {
            let outcome = Outcome::DeadLettered {
                kind: FailureKind::Poison,
                error: format!(
                    "delivered {delivery_count} times without an outcome (limit {}): it likely crashes or hangs the consumer",
                    self.delivery_limit
                ),
            };
            return match AnsiTransactionManager::rollback_transaction(conn).await {
                Ok(()) => Ok(outcome),
                Err(err) => Err(InfraFault::Database(err)),
            };
        }

        let error = match tokio::time::timeout(self.shared.handler_timeout, effect(conn)).await {
            Ok(Ok(())) => {
                return match AnsiTransactionManager::commit_transaction(conn).await {
                    Ok(()) => Ok(Outcome::Applied),
                    // COMMIT's fate is unknown: retry; the dedup row decides.
                    Err(err) => Err(InfraFault::Commit(err)),
                };
            }
            Ok(Err(error)) => error,
            // The query in flight was cancelled mid-protocol and the transaction is
            // still open: no ROLLBACK on such a connection. `transact` sees it open
            // (broken) and drops it, which ends the transaction server-side.
            Err(_elapsed) => {
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
            Err(err) => Err(InfraFault::Database(err)),
            Ok(()) if PoolableConnection::is_broken(conn) => Err(InfraFault::Broken(error.to_string())),
            Ok(()) => Ok(self.handler_failed(error, counts.attempt)),
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
    /// gone and the broker will redeliver; the dedup row makes that harmless). A copy
    /// (retry or dead letter) that cannot be published turns the outcome into
    /// [`Outcome::Requeued`]: the original goes back to the queue instead.
    async fn settle(&self, delivery: &Delivery, decision: &mut Decision, counts: Counts) -> bool {
        let acker = &delivery.acker;
        let requeue = BasicNackOptions { requeue: true, ..Default::default() };
        let handler = self.handler.name();
        let copy = match &decision.outcome {
            Outcome::Applied | Outcome::Duplicate => {
                #[cfg(feature = "fault-injection")]
                self.fault(crate::fault::FaultPoint::AfterCommit, decision).await;
                None
            }
            Outcome::Abandoned | Outcome::Requeued { .. } => {
                return report(acker.nack(requeue).await, self, decision)
            }
            Outcome::Retry { error, delay } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, attempt = counts.attempt, ?delay, %error, "handler failed; retrying later");
                tokio::time::sleep(self.retry.jitter_for(*delay)).await;
                let letter = Letter { kind: None, error, handler, attempts: counts.attempt };
                Some((wait_queue_name(&self.queue, *delay), letter))
            }
            Outcome::DeadLettered { kind, error } => {
                tracing::warn!(queue = %self.queue, key = ?decision.key, kind = %kind, %error, "dead-lettering");
                let letter = Letter { kind: Some(*kind), error, handler, attempts: counts.attempt };
                Some((self.dead_letter_queue.clone(), letter))
            }
        };
        if let Some((target, letter)) = copy {
            if let Err(err) =
                dead_letter::publish(&self.publisher, &target, delivery, &letter, self.frame_max).await
            {
                tracing::error!(queue = %self.queue, error = %err, "could not publish the copy; the delivery is requeued");
                decision.outcome = Outcome::Requeued { error: err.to_string() };
                tokio::time::sleep(Duration::from_secs(1)).await;
                return report(acker.nack(requeue).await, self, decision);
            }
        }
        report(acker.ack(BasicAckOptions::default()).await, self, decision)
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
async fn rollback(conn: &mut AsyncPgConnection, fault: InfraFault) -> InfraFault {
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

/// What a delivery's headers say about its past.
#[derive(Debug, Clone, Copy)]
struct Counts {
    /// The broker's delivery count (`x-delivery-count` on quorum queues; absent = 0):
    /// how often this copy was delivered without an outcome. Bounds poison messages.
    delivery_count: u32,
    /// This handler attempt's number: 1 + the `x-idemq-attempts` a retry copy carries.
    attempt: u32,
}

impl Counts {
    fn of(delivery: &Delivery) -> Self {
        let header = |name: &str| {
            let value = delivery.properties.headers().as_ref().and_then(|h| h.inner().get(name).cloned());
            let number = match value {
                Some(AMQPValue::LongLongInt(v)) => v,
                Some(AMQPValue::LongInt(v)) => i64::from(v),
                Some(AMQPValue::LongUInt(v)) => i64::from(v),
                Some(AMQPValue::ShortInt(v)) => i64::from(v),
                Some(AMQPValue::ShortUInt(v)) => i64::from(v),
                Some(AMQPValue::ShortShortInt(v)) => i64::from(v),
                Some(AMQPValue::ShortShortUInt(v)) => i64::from(v),
                _ => 0,
            };
            u32::try_from(number.max(0)).unwrap_or(u32::MAX)
        };
        Self {
            delivery_count: header(headers::DELIVERY_COUNT),
            attempt: header(headers::ATTEMPTS).saturating_add(1),
        }
    }
}
