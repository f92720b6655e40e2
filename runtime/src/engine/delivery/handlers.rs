//! The handler stage of the transaction (see `life`): each new message's
//! handler in the open transaction, in arrival order — or a batch handler once, with
//! all of them — and what a failure means: in a batch of several a split (around the
//! failing message, or in halves when a batch handler failed, naming none), alone a
//! charged attempt (after in-process runs, when the server rolled it back for
//! contention).
//!
//! Contention is the server's word, not the handler's: a handler failed for it when
//! the latest error PostgreSQL sent on its connection while it ran was a
//! serialization failure, a deadlock or a lock timeout (40001, 40P01, 55P03; see
//! `store::db::contended_since`) — in any language, whether the handler returned the
//! driver's error or its own, and never because its error's text says "deadlock".

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncConnection, TransactionManager};
use futures_util::FutureExt;
use tracing::Instrument;

use super::contention::Collision;
use super::faults::{answers, cancel_statement, panic_message, Failure, Fault, InfraFault};
use super::tx::{infra, rerun_repeats, split, Done, Step, Tx};
use super::{Consumer, Delivered};
use crate::base::duration::human;
use crate::base::outcome::Outcome;
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::trace::Trace;
use crate::base::verdict;
use crate::handler::batch::length_mismatch;
use crate::handler::context::Context;
use crate::handler::key::Key;
use crate::handler::prepare::{Erased, Fingerprint, Payload, Prepared};
use crate::handler::{ErrorClass, HandlerError};
use crate::store::db::{self, Conn};

/// What one handler's run came to.
enum Handled {
    Done(Done),
    Failed(Failed),
}

/// A handler that failed in the open transaction.
struct Failed {
    index: usize,
    key: Key,
    fingerprint: Fingerprint,
    failure: Failure,
    /// The server rolled its statements back for contention (see the module docs).
    contended: bool,
    took: Duration,
}

/// How a handler's run ended when it did not finish with `Ok`.
enum Unfinished {
    Returned(HandlerError),
    Panicked(String),
    TimedOut,
}

impl Consumer {
    /// The new messages, in the open transaction: each handler in arrival order, or
    /// a batch handler once with all of them ([`Self::handle_together`]); the first
    /// failure ends the run ([`Self::handler_failure`]).
    pub(super) async fn handle(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        new: Vec<(usize, Prepared)>,
    ) -> Result<Step<Vec<Done>>, Fault> {
        let new = match batch_messages(new) {
            Ok(messages) if self.handler.batched() => return self.handle_together(conn, tx, messages).await,
            Ok(messages) => messages.into_iter().map(Waiting::into_prepared).collect(),
            Err(new) => new,
        };
        let cancel = conn.canceller();
        let mut done = Vec::with_capacity(new.len());
        let new_indices: Vec<usize> = new.iter().map(|(index, _)| *index).collect();
        for (position, (index, prepared)) in new.into_iter().enumerate() {
            match self.run_handler(conn, tx, &cancel, index, prepared).await? {
                Handled::Done(handled) => done.push(handled),
                Handled::Failed(failed) => {
                    self.handler_failure(conn, tx, &new_indices, Some(position), failed).await?;
                    return Ok(Step::Ended);
                }
            }
        }
        Ok(Step::Next(done))
    }

    /// One handler in the open transaction, within the handler timeout (see
    /// [`Self::guarded`] and [`Self::unfinished`]).
    async fn run_handler(
        &self,
        conn: &mut Conn,
        tx: &Tx<'_>,
        cancel: &db::Canceller,
        index: usize,
        prepared: Prepared,
    ) -> Result<Handled, Fault> {
        let Prepared { key, fingerprint, payload, .. } = prepared;
        let effect = match payload {
            Payload::Effect(effect) => effect,
            // `batch_messages` sends a batch handler's messages to `handle_together`
            // whenever they are all messages, and a handler prepares one form only
            // (handler/prepare.rs): this is a bug of idemq's, failed, never a panic.
            Payload::Message(_) => {
                let failure =
                    Failure::Cut("idemq bug: a batch handler's message reached the per-message path".into());
                return Ok(Handled::Failed(Failed {
                    index,
                    key,
                    fingerprint,
                    failure,
                    contended: false,
                    took: Duration::ZERO,
                }));
            }
        };
        let mut ctx = self.context(tx, index, &key);
        let span = handler_span(self.handler.name(), key.as_str(), ctx.trace());
        let mark = conn.mark();
        let (ran, took) = self.guarded(effect(conn, &mut ctx).instrument(span), 1).await;
        let unfinished = match ran {
            Ok(output) => {
                let published = ctx.take_published();
                let saga = ctx.take_saga_step();
                return Ok(Handled::Done(Done { index, key, fingerprint, output, published, took, saga }));
            }
            Err(unfinished) => unfinished,
        };
        let failure = self.unfinished(conn, cancel, unfinished).await?;
        // Read before anything else runs on the connection (a cut-off handler's
        // cancelled statement answers 57014, which is no contention).
        refused_as_read_only(conn, mark, &failure)?;
        let contended = matches!(failure, Failure::Returned(_)) && db::contended_since(conn, mark);
        Ok(Handled::Failed(Failed { index, key, fingerprint, failure, contended, took }))
    }

    /// A batch handler, once, with every new message of the transaction (arrival
    /// order), each with its own context, within the handler timeout. Its results
    /// are one per message (another number fails it); each message is then `Done`
    /// as if its own handler had run, with the call's time as its handler time. A
    /// failure is the whole call's: in a batch of several it runs again in halves
    /// (no message named), alone it is that message's charged attempt.
    async fn handle_together(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        new: Vec<Waiting>,
    ) -> Result<Step<Vec<Done>>, Fault> {
        let cancel = conn.canceller();
        let count = new.len();
        let (mut heads, mut messages, mut contexts) =
            (Vec::with_capacity(count), Vec::with_capacity(count), Vec::with_capacity(count));
        for Waiting { index, key, fingerprint, message } in new {
            contexts.push(self.context(tx, index, &key));
            messages.push(message);
            heads.push((index, key, fingerprint));
        }
        let mark = conn.mark();
        let span = batch_span(self.handler.name(), &contexts);
        let (ran, took) =
            self.guarded(self.handler.run_batch(conn, messages, contexts).instrument(span), count).await;
        let unfinished = match ran {
            Ok((outputs, contexts)) if outputs.len() == count => {
                let done = heads
                    .into_iter()
                    .zip(outputs)
                    .zip(contexts)
                    .map(|(((index, key, fingerprint), output), mut ctx)| {
                        let published = ctx.take_published();
                        let saga = ctx.take_saga_step();
                        Done { index, key, fingerprint, output, published, took, saga }
                    })
                    .collect();
                return Ok(Step::Next(done));
            }
            Ok((outputs, _)) => Unfinished::Returned(length_mismatch(outputs.len(), count)),
            Err(unfinished) => unfinished,
        };
        let failure = self.unfinished(conn, &cancel, unfinished).await?;
        refused_as_read_only(conn, mark, &failure)?;
        let contended = matches!(failure, Failure::Returned(_)) && db::contended_since(conn, mark);
        let indices: Vec<usize> = heads.iter().map(|(index, ..)| *index).collect();
        // Alone, the failure is this message's; in a batch of several, the key is
        // only the first's (for the log): no message is named.
        let (index, key, fingerprint) = heads.swap_remove(0);
        let failed = Failed { index, key, fingerprint, failure, contended, took };
        self.handler_failure(conn, tx, &indices, None, failed).await?;
        Ok(Step::Ended)
    }

    /// The context of the message at `index`, keyed `key`.
    fn context(&self, tx: &Tx<'_>, index: usize, key: &Key) -> Context {
        let delivered = &tx.items[index];
        let mut ctx = Context::new(
            &self.scope,
            key.as_str(),
            delivered.counts.attempt,
            delivered.counts.redelivered,
            &delivered.delivery.properties,
        );
        if !tx.dedup {
            // Two deliveries with one key are two messages here: their outbox
            // rows must not share ids.
            ctx.use_random_ids();
        }
        ctx
    }

    /// Runs a handler's future, for `messages` messages, within the handler timeout,
    /// a panic caught; returns how it ended and how long it ran (which the consumer's
    /// pace learns from).
    async fn guarded<T>(
        &self,
        run: impl std::future::Future<Output = Result<T, HandlerError>>,
        messages: usize,
    ) -> (Result<T, Unfinished>, Duration) {
        let run = AssertUnwindSafe(run).catch_unwind();
        let started = Instant::now();
        let ran_for = tokio::time::timeout(self.shared.handler_timeout, run).await;
        let took = started.elapsed();
        self.pace.record(took, messages);
        let ran = match ran_for {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(error))) => Err(Unfinished::Returned(error)),
            Ok(Err(panic)) => Err(Unfinished::Panicked(panic_message(&*panic))),
            Err(_elapsed) => Err(Unfinished::TimedOut),
        };
        (ran, took)
    }

    /// What a handler's run that did not finish with `Ok` means. One cut off (panic,
    /// timeout) has its statement cancelled on the server; one whose connection then
    /// does not answer at all met an outage, not a failure of its own.
    async fn unfinished(
        &self,
        conn: &mut Conn,
        cancel: &db::Canceller,
        unfinished: Unfinished,
    ) -> Result<Failure, Fault> {
        Ok(match unfinished {
            Unfinished::Returned(error) => Failure::Returned(error),
            // Both leave the transaction open and maybe a statement running: cancel
            // it on the server (dropping the connection alone would not stop it, and
            // it would keep its locks); `life`'s `run` then drops the connection (it is in
            // a transaction, so broken), which ends the transaction server-side.
            Unfinished::Panicked(message) => {
                cancel_statement(cancel).await;
                Failure::Cut(format!("the handler panicked: {message}"))
            }
            Unfinished::TimedOut => {
                cancel_statement(cancel).await;
                if !answers(conn).await {
                    // Its connection does not answer either: the handler was most
                    // likely waiting for an unreachable database, which is an
                    // outage, not the handler's failed attempt. The transaction
                    // runs again on a fresh connection (not counted).
                    return Err(Fault::Infra(InfraFault::Broken(format!(
                        "the handler did not finish within {}, and its database connection did \
                         not answer after its statement was cancelled",
                        human(self.shared.handler_timeout)
                    ))));
                }
                Failure::Cut(format!(
                    "the handler did not finish within {}",
                    human(self.shared.handler_timeout)
                ))
            }
        })
    }

    /// A handler failed, at `culprit` of the new messages (`None`: a batch handler,
    /// which names none): the transaction is rolled back. In a batch of several the
    /// others run without it and it runs alone (without a culprit: the batch runs in
    /// halves); alone and rolled back for contention (not a permanent error), it runs
    /// again in-process ([`Fault::Contention`]); else its attempt is charged (a
    /// request's permanent failure is stored first) and the repeats of its key run
    /// next.
    async fn handler_failure(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        new_indices: &[usize],
        culprit: Option<usize>,
        failed: Failed,
    ) -> Result<(), Fault> {
        let Failed { index, key, fingerprint, failure, contended, took } = failed;
        if let Failure::Returned(_) = &failure {
            match self.bounded(AnsiTransactionManager::rollback_transaction(&mut **conn)).await {
                // A failed ROLLBACK means the connection broke: whatever the
                // handler wrapped, this is an infrastructure fault.
                Err(err) => return Err(infra(err)),
                Ok(()) if PoolableConnection::is_broken(&mut **conn) => {
                    return Err(Fault::Infra(InfraFault::Broken(failure.to_string())))
                }
                Ok(()) => {}
            }
        }
        if new_indices.len() > 1 {
            // Maybe a neighbour's doing (a lock, an aborted transaction): the
            // others run without it (those after it never ran), and it runs alone.
            let ranges = match culprit {
                Some(position) => {
                    crate::base::log::debug!(queue = %self.queue, key = %key, error = %failure, batch = tx.batch, "a handler failed in a batch; running it alone");
                    verdict::around(new_indices.len(), position)
                }
                None => {
                    crate::base::log::debug!(queue = %self.queue, error = %failure, batch = tx.batch, "a batch handler failed; running its batch in halves");
                    verdict::halves(new_indices.len())
                }
            };
            tx.ran.next = split(new_indices, ranges, &tx.repeats);
            tx.ran.collided = contended.then_some(Collision::HandlerRows);
            return Ok(());
        }
        let error = match failure {
            Failure::Returned(error) => error,
            Failure::Cut(message) => HandlerError::transient(message),
        };
        if contended && error.class() != ErrorClass::Permanent {
            return Err(Fault::Contention {
                error: format!("PostgreSQL rolled the handler's transaction back: {error}"),
                key: key.as_str().to_owned(),
            });
        }
        let class = error.class();
        let outcome = self.handler_failed(error, tx.items[index].counts.attempt);
        if class == ErrorClass::Permanent && tx.dedup {
            self.store_failure(conn, &tx.items[index], &key, &fingerprint, &outcome).await?;
        }
        let mut decision = self.decision(outcome, key.as_str(), Some(tx.began_at), tx.batch);
        decision.handler_time = Some(took);
        tx.ran.decided.push((index, decision));
        tx.ran.next = rerun_repeats(std::mem::take(&mut tx.repeats));
        Ok(())
    }

    /// A request that failed permanently (its transaction rolled back): its failure
    /// is committed as its dedup row, holding the error reply, with that reply in the
    /// outbox — so a duplicate of it gets the same error, without running the handler
    /// (see [`crate::store::forget`] to apply it after a fix). Other failures store nothing.
    async fn store_failure(
        &self,
        conn: &mut Conn,
        item: &Delivered,
        key: &Key,
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
}

/// A decoded message waiting for its batch handler's call, at `index` of the batch.
struct Waiting {
    index: usize,
    key: Key,
    fingerprint: Fingerprint,
    message: Erased,
}

impl Waiting {
    /// Back as it came (a batch handler that is not one: never, see `handle`).
    fn into_prepared(self) -> (usize, Prepared) {
        let Self { index, key, fingerprint, message } = self;
        (index, Prepared { key, fingerprint, lane: None, payload: Payload::Message(message) })
    }
}

/// The new messages for one batch handler call ([`Consumer::handle_together`]): `Ok`
/// when every one of them is a decoded message waiting for its batch (what a batch
/// handler prepares), else the messages as they came, for one call each.
fn batch_messages(new: Vec<(usize, Prepared)>) -> Result<Vec<Waiting>, Vec<(usize, Prepared)>> {
    if new.is_empty() || !new.iter().all(|(_, prepared)| matches!(prepared.payload, Payload::Message(_))) {
        return Err(new);
    }
    Ok(new
        .into_iter()
        .filter_map(|(index, Prepared { key, fingerprint, payload, .. })| match payload {
            Payload::Message(message) => Some(Waiting { index, key, fingerprint, message }),
            Payload::Effect(_) => None,
        })
        .collect())
}

/// The span a handler of one message runs in: its name, the message's key and the
/// W3C trace id it came with (empty without one), so what it logs is found by any.
/// With the feature `otel`, its parent is the delivery's sender (`traceparent`).
pub(crate) fn handler_span(handler: &str, key: &str, trace: Option<&Trace>) -> tracing::Span {
    let trace_id = trace.map(Trace::trace_id).unwrap_or_default();
    let span = crate::base::log::info_span!("handler", handler, key, trace_id);
    #[cfg(feature = "otel")]
    if let Some(trace) = trace {
        trace.adopt(&span);
    }
    span
}

/// The span a batch handler runs in: its name and the number of messages. With the
/// feature `otel`, linked to each traced delivery's sender (one span, many parents:
/// OpenTelemetry's messaging conventions link rather than choose one).
pub(crate) fn batch_span(handler: &str, contexts: &[Context]) -> tracing::Span {
    let span = crate::base::log::info_span!("handler", handler, messages = contexts.len());
    #[cfg(feature = "otel")]
    for trace in contexts.iter().filter_map(Context::trace) {
        trace.link(&span);
    }
    span
}

/// A handler that returned after the server refused its write as read-only (25006:
/// a standby, or one being promoted — a transaction begun in recovery stays
/// read-only) did not fail: the server could not take writes. Not the message's
/// attempt: the transaction runs again on a fresh connection, as for any outage.
fn refused_as_read_only(
    conn: &Conn,
    mark: crate::tls::postgres::wire::Mark,
    failure: &Failure,
) -> Result<(), Fault> {
    if matches!(failure, Failure::Returned(_)) && db::read_only_since(conn, mark) {
        return Err(Fault::Infra(InfraFault::ReadOnly(failure.to_string())));
    }
    Ok(())
}
