//! Telling the broker what was decided: one ack for what needs no copy, nacks, retry
//! copies and dead letters (confirmed before the original is acked), a duplicated
//! request's stored reply; then the bookkeeping (the copy's record, the start marks)
//! and the `settled` event. [`Unsettled`] returns what a task left unsettled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use lapin::message::Delivery;
use lapin::Acker;
use tokio_util::sync::CancellationToken;

use super::{Consumer, Decision, Delivered, BOOKKEEPING_TIMEOUT};
use crate::base::duration::human;
use crate::base::outcome::{Outcome, Settled};
use crate::base::outgoing::Outgoing;
use crate::base::retry::wait_queue_name;
use crate::broker::acks::Acks;
use crate::broker::dead_letter::{self, Letter};
use crate::store::db;

/// How long a copy being published when the shutdown cut-off fires may still take to
/// be confirmed: cutting it off would leave the copy and the original both alive.
pub(super) const COPY_GRACE: Duration = Duration::from_secs(5);

impl Consumer {
    /// Clears a settled delivery's start marks and reports it.
    pub(super) async fn finish(&self, item: &Delivered, decision: Decision, settled_with_broker: bool) {
        if decision.marked && !needs_requeue(&decision.outcome) {
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
        // level is off; `RUST_LOG=idemq::engine::delivery=debug` shows them).
        crate::base::log::debug!(
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

    /// Tells the broker what was decided without a copy: one ack for everything
    /// applied or skipped (see [`Acks::ack`]), then nacks. Returns, per delivery,
    /// whether its frame was sent (`false`: the channel is gone and the broker will
    /// redeliver; the dedup row or the copy record makes that harmless).
    pub(super) async fn settle(&self, settled: &[(Delivered, Decision)]) -> Vec<bool> {
        let mut sent = vec![false; settled.len()];
        let acked: Vec<usize> =
            (0..settled.len()).filter(|&i| !needs_requeue(&settled[i].1.outcome)).collect();
        if self.shared.fault_hook.is_some() {
            for &i in &acked {
                self.fault(crate::engine::hook::FaultPoint::AfterCommit, &settled[i].1).await;
            }
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
    pub(super) async fn settle_copy(
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
                crate::base::log::warn!(queue = %self.queue, key = ?decision.key, attempt = counts.attempt, delay = %human(*delay), %error, "handler failed; retrying later");
                let (error, delay) = (error.clone(), *delay);
                let jitter = tokio::time::sleep(self.retry.jitter_for(delay));
                if tokio::select! { () = jitter => false, () = cut_off.cancelled() => true } {
                    decision.outcome = Outcome::Abandoned;
                    return report(self.acks.requeue(delivery).await, self, decision);
                }
                (wait_queue_name(&self.queue, delay), None, error, Some(self.queue.as_str()))
            }
            Outcome::DeadLettered { kind, error } => {
                crate::base::log::warn!(queue = %self.queue, key = ?decision.key, kind = %kind, %error, "dead-lettering");
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
        self.fault(crate::engine::hook::FaultPoint::BeforeCopy, decision).await;
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
            let error = crate::error::report(&err);
            let nacked = matches!(err, dead_letter::PublishError::Nacked { .. });
            self.copy_failed(&error, nacked, decision);
            if nacked {
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
            decision.outcome = Outcome::Requeued { error };
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = cut_off.cancelled() => {}
            }
            return report(self.acks.requeue(delivery).await, self, decision);
        }
        // Were the ack lost now, the redelivered original finds this record and
        // is acked without a second copy (a crash before it: see `docs/guarantees.md`).
        self.bookkeeping("record the copy", async |conn| db::record_copy(conn, &copy_id).await).await;
        self.fault(crate::engine::hook::FaultPoint::AfterCopy, decision).await;
        report(self.acks.ack_one(delivery).await, self, decision)
    }

    /// Logs a copy that could not be published: an ERROR for a refusal on a live
    /// channel (or a nack), but a lost channel, which fails every copy in flight
    /// alike, is one WARN now and a count later ([`Unsent`]).
    fn copy_failed(&self, error: &str, nacked: bool, decision: &Decision) {
        if nacked || self.publisher.status().connected() {
            crate::base::log::error!(queue = %self.queue, %error, "could not publish the copy; the delivery is requeued");
            return;
        }
        crate::base::log::debug!(queue = %self.queue, key = ?decision.key, %error, "could not publish the copy: the publishing channel is gone; the delivery is requeued");
        if self.unsent.note_copy() {
            crate::base::log::warn!(
                queue = %self.queue,
                session = self.session,
                %error,
                "the publishing channel is gone: retry copies and dead letters cannot be published, \
                 their deliveries are requeued (how many is logged once the last is done; \
                 RUST_LOG=idemq::engine::delivery=debug lists each)"
            );
        }
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
        let written = self
            .pooled(async |conn| db::insert_outbox(conn, std::slice::from_ref(&reply)).await.map(drop))
            .await;
        if let Err(err) = written {
            let error = crate::error::report(&err);
            crate::base::log::error!(queue = %self.queue, key = ?decision.key, %error, "could not queue the stored reply of a duplicated request; the delivery is requeued");
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

    /// Runs a best-effort statement of idemq's own on a pooled connection, bounded;
    /// a failure is logged, never fatal to the delivery.
    async fn bookkeeping<F>(&self, what: &str, statement: F)
    where
        F: for<'c> AsyncFnOnce(&'c mut AsyncPgConnection) -> diesel::QueryResult<()>,
    {
        if let Err(err) = self.pooled(statement).await {
            crate::base::log::warn!(queue = %self.queue, error = %crate::error::report(&err), "could not {what}");
        }
    }

    /// Runs one of idemq's own statements on a connection from the pool, the whole
    /// bounded by [`BOOKKEEPING_TIMEOUT`].
    async fn pooled<F>(&self, statement: F) -> Result<(), Bookkeeping>
    where
        F: for<'c> AsyncFnOnce(&'c mut AsyncPgConnection) -> diesel::QueryResult<()>,
    {
        let run = async {
            let mut conn = self.shared.pool.get().await.map_err(|err| Bookkeeping::Pool(err.into()))?;
            statement(&mut conn).await.map_err(Bookkeeping::Statement)
        };
        tokio::time::timeout(BOOKKEEPING_TIMEOUT, run)
            .await
            .unwrap_or(Err(Bookkeeping::TimedOut(BOOKKEEPING_TIMEOUT)))
    }

    /// Runs the test's fault hook at `point`, if one is set (never in production).
    async fn fault(&self, point: crate::engine::hook::FaultPoint, decision: &Decision) {
        if let Some(hook) = &self.shared.fault_hook {
            let context = crate::engine::hook::FaultContext {
                point,
                channel: self.channel.clone(),
                publisher: self.publisher.clone(),
                key: decision.key.clone(),
                outcome: decision.outcome.clone(),
            };
            hook(context).await;
        }
    }
}

/// Why one of idemq's own statements on a pooled connection ([`Consumer::pooled`])
/// did not run. Printed with its cause through [`report`](crate::error::report).
#[derive(Debug, thiserror::Error)]
enum Bookkeeping {
    /// No connection: the pool's error (only printed, so kept whatever the pool's
    /// error type).
    #[error("no database connection from the pool")]
    Pool(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The statement failed.
    #[error("the statement failed")]
    Statement(#[source] diesel::result::Error),
    /// No answer in time.
    #[error("no answer within {}", human(*.0))]
    TimedOut(Duration),
}

/// Whether the delivery goes back to the queue (the rest without a copy is acked).
fn needs_requeue(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Abandoned | Outcome::Paused | Outcome::Requeued { .. })
}

/// Nacks (requeue) the deliveries of a batch whose task ends without settling them:
/// nothing may hold a delivery until the broker's `consumer_timeout`.
pub(super) struct Unsettled {
    acks: Arc<Acks>,
    deliveries: Vec<(u64, Acker)>,
}

impl Unsettled {
    pub(super) fn new<'a>(acks: &Arc<Acks>, items: impl Iterator<Item = &'a Delivered>) -> Self {
        let deliveries =
            items.map(|item| (item.delivery.delivery_tag, item.delivery.acker.clone())).collect();
        Self { acks: Arc::clone(acks), deliveries }
    }

    pub(super) fn disarm(&mut self) {
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
            crate::base::log::error!(
                "a batch ended without settling its deliveries; returning them to the queue"
            );
            let acks = Arc::clone(&self.acks);
            runtime.spawn(async move {
                for (tag, acker) in deliveries {
                    let _ = acks.requeue_tag(tag, &acker).await;
                }
            });
        }
    }
}

/// Whether an ack/nack frame was sent. One that was not is a DEBUG line of its own
/// and counted in [`Unsent`]: a lost connection with thousands of deliveries in
/// flight is two WARN lines, not thousands.
fn report(sent: lapin::Result<bool>, consumer: &Consumer, decision: &Decision) -> bool {
    let error = match sent {
        Ok(true) => return true,
        Ok(false) => None,
        Err(err) => Some(err),
    };
    let error = error.as_ref().map(tracing::field::display);
    crate::base::log::debug!(queue = %consumer.queue, key = ?decision.key, error, "not settled: the broker will redeliver");
    if consumer.unsent.note() {
        crate::base::log::warn!(
            queue = %consumer.queue,
            session = consumer.session,
            error,
            "the channel is gone: its deliveries are not settled, the broker will redeliver them \
             (how many is logged once the last is done; RUST_LOG=idemq::engine::delivery=debug lists each)"
        );
    }
    false
}

/// The deliveries of one consumer's channel session whose ack or nack could not be
/// sent (the channel or its connection is gone), and those whose copy could not be
/// published (the publishing channel is gone). The first of each is a WARN at once;
/// the counts are WARNs when the session's [`Consumer`] is dropped, after its last
/// delivery is done. Counting changes nothing about what is settled.
#[derive(Debug)]
pub(crate) struct Unsent {
    queue: String,
    session: u64,
    count: AtomicU64,
    /// Copies that could not be published because the publishing channel was gone
    /// (their deliveries requeued).
    copies: AtomicU64,
}

impl Unsent {
    pub(crate) fn new(queue: &str, session: u64) -> Self {
        Self { queue: queue.to_owned(), session, count: AtomicU64::new(0), copies: AtomicU64::new(0) }
    }

    /// Counts one; `true` for the first of the session.
    fn note(&self) -> bool {
        self.count.fetch_add(1, Ordering::Relaxed) == 0
    }

    /// Counts one copy lost with its channel; `true` for the first of the session.
    fn note_copy(&self) -> bool {
        self.copies.fetch_add(1, Ordering::Relaxed) == 0
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        let copies = *self.copies.get_mut();
        if copies > 0 {
            crate::base::log::warn!(
                queue = %self.queue,
                session = self.session,
                requeued = copies,
                "{copies} copies (retries, dead letters) could not be published on the lost channel; \
                 their deliveries were requeued and are tried again"
            );
        }
        let count = *self.count.get_mut();
        if count > 0 {
            crate::base::log::warn!(
                queue = %self.queue,
                session = self.session,
                unsettled = count,
                "{count} deliveries of the lost channel were not settled; the broker redelivers them \
                 (their dedup rows or copy records make that harmless)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Unsent;

    #[test]
    fn only_the_first_unsent_frame_of_a_session_is_announced() {
        let unsent = Unsent::new("payments", 1);
        assert!(unsent.note(), "the first warns at once");
        assert!((0..3807).all(|_| !unsent.note()), "the rest are counted");
        assert_eq!(unsent.count.load(std::sync::atomic::Ordering::Relaxed), 3808);
    }

    /// The engine is the crate `idemq_core`, but its events keep the targets operators
    /// filter on (`RUST_LOG=idemq::engine::delivery=debug`, `base/log.rs`).
    #[test]
    fn an_engine_event_has_its_target_under_idemq_not_idemq_core() {
        let targets = crate::base::log::tests::targets_of(|| {
            let unsent = Unsent::new("payments", 1);
            unsent.note();
            drop(unsent); // logs the count of unsettled deliveries
        });
        assert_eq!(targets, ["idemq::engine::delivery::settle"]);
    }
}
