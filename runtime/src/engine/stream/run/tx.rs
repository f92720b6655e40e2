//! One transaction over a run of a stream's messages: BEGIN, the dedup rows if
//! the handler keeps them, the handlers in offset order (or a batch handler once),
//! the outbox, the results and the offset moved by compare-and-set, the checked
//! COMMIT; and what it came to ([`Tx`]).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use futures_util::FutureExt;
use tracing::Instrument;

use super::{Item, Runner};
use crate::base::outcome::{FailureKind, Outcome};
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::verdict::OnConflict;
use crate::engine::delivery::{batch_span, cancel_statement, handler_span, panic_message};
use crate::handler::context::{Context, HandlerOutput};
use crate::handler::key::Key;
use crate::handler::prepare::{Erased, Payload, Prepared};
use crate::handler::HandlerError;
use crate::store::db::{self, Conn};

/// How one transaction over a run of messages ended.
pub(super) enum Tx {
    /// Committed: the offset is at the run's last.
    Committed,
    /// A message failed (`at`: which; `None`: the run as a whole, e.g. a COMMIT the
    /// server refused): rolled back.
    Failed { at: Option<usize>, error: HandlerError, kind: FailureKind, cut: bool },
    /// The same key twice: the run must end before `at` (dedup rows are claimed once
    /// per key and transaction).
    Repeat { at: usize },
    /// The database failed: run it again on a fresh connection.
    Fault(String),
    /// The offset was not where this consumer left it.
    Fenced,
}

/// What a run's handlers did, for the transaction's end: each message's outcome
/// (its index in the run, key, outcome, handler time), the messages they
/// published, their results.
#[derive(Default)]
pub(super) struct Written {
    applied: Vec<(usize, Option<String>, Outcome, Option<Duration>)>,
    published: Vec<Outgoing>,
    results: Vec<(String, Vec<u8>)>,
}

/// What a handler ran for one message: its result, what it published, how long
/// it took.
type Ran = (Option<Vec<u8>>, Vec<Outgoing>, Duration);

impl Runner {
    /// The transaction over `items` (see the module docs).
    pub(super) async fn transact(&mut self, items: &[Item], attempt: u32) -> Tx {
        // Beside the others (a queue's batches), unless a redelivered message runs
        // alone in the process — per transaction, not across in-place retry waits.
        let shared = Arc::clone(&self.shared);
        let _turn = match self.alone_in_process {
            true => None,
            false => Some(shared.turns.read().await),
        };
        let mut conn = match self.shared.pool.get().await {
            Ok(conn) => conn,
            Err(err) => return Tx::Fault(err.to_string()),
        };
        let began_at = Instant::now();
        let tx = self.run_tx(&mut conn, items, attempt, began_at).await;
        let cut = matches!(tx, Tx::Failed { cut: true, .. }) || std::mem::take(&mut self.unknown_commit);
        if cut || matches!(tx, Tx::Fault(_)) || PoolableConnection::is_broken(&mut **conn) {
            drop(db::Pooled::take(conn));
        }
        tx
    }

    async fn run_tx(&mut self, conn: &mut Conn, items: &[Item], attempt: u32, began_at: Instant) -> Tx {
        let prepared = match self.prepare_run(items) {
            Ok(prepared) => prepared,
            Err(tx) => return tx,
        };
        let rows: Vec<(&str, &[u8])> =
            prepared.iter().map(|p| (p.key.as_str(), p.fingerprint.as_slice())).collect();
        let claimed = self.claim(conn, &rows).await;
        drop(rows);
        let claim = match claimed {
            Ok(claim) => claim,
            Err(err) => return Tx::Fault(err.to_string()),
        };
        let mut written = Written::default();
        // A batch handler's new messages: run together once the loop is done.
        let mut together = Vec::new();
        for (index, prepared) in prepared.into_iter().enumerate() {
            let Prepared { key, fingerprint, payload, .. } = prepared;
            if self.handler.dedup() && !claim.inserted.contains(key.as_str()) {
                let stored = match self.known(conn, &claim, &key, &fingerprint, index).await {
                    Ok(stored) => stored,
                    Err(tx) => return self.abort(conn, tx).await,
                };
                // A duplicated request gets the stored reply again, in this COMMIT,
                // under the first reply's message id.
                if let (Some(request), Some(stored)) =
                    (Request::of(&items[index].delivery.properties), stored)
                {
                    let id = outgoing::message_id(&self.scope, key.as_str(), "reply");
                    let body = HandlerOutput::reply_body(stored.result.as_deref());
                    written.published.push(Outgoing::reply(&request, id, body, !stored.failed));
                }
                written.applied.push((index, Some(key.as_str().to_owned()), Outcome::Duplicate, None));
                continue;
            }
            let effect = match payload {
                Payload::Effect(effect) => effect,
                Payload::Message(message) => {
                    let ctx = self.context(&items[index], &key, attempt);
                    together.push((index, key, message, ctx));
                    continue;
                }
            };
            let mut ctx = self.context(&items[index], &key, attempt);
            let span = handler_span(self.handler.name(), key.as_str(), ctx.trace());
            let guarded = self
                .guarded(conn, async |conn| {
                    effect(conn, &mut ctx).instrument(span).await.map(|output| output.0)
                })
                .await;
            match guarded {
                Ok((output, took)) => {
                    let published = ctx.take_published();
                    self.record(&mut written, &items[index], index, &key, (output, published, took));
                }
                Err((error, cut)) => {
                    let failed = Tx::Failed { at: Some(index), error, kind: FailureKind::Handler, cut };
                    return self.abort(conn, failed).await;
                }
            }
        }
        if !together.is_empty() {
            match self.together(conn, together).await {
                Ok(done) => {
                    for (index, key, ran) in done {
                        self.record(&mut written, &items[index], index, &key, ran);
                    }
                }
                Err((at, error, cut)) => {
                    let failed = Tx::Failed { at, error, kind: FailureKind::Handler, cut };
                    return self.abort(conn, failed).await;
                }
            }
        }
        written.applied.sort_by_key(|(index, ..)| *index);
        self.finish(conn, items, claim.xid, written, began_at).await
    }

    /// What a handler ran for the message at `index` into `written`: what it
    /// published, its reply if the message is a request, its result.
    fn record(&self, written: &mut Written, item: &Item, index: usize, key: &Key, ran: Ran) {
        let (output, published, took) = ran;
        written.published.extend(published);
        if let Some(request) = Request::of(&item.delivery.properties) {
            // Without dedup rows two requests may share a key: random ids.
            let id = match self.handler.dedup() {
                true => outgoing::message_id(&self.scope, key.as_str(), "reply"),
                false => crate::base::random_id(),
            };
            let body = HandlerOutput::reply_body(output.as_deref());
            written.published.push(Outgoing::reply(&request, id, body, true));
        }
        if let Some(result) = output {
            written.results.push((key.as_str().to_owned(), result));
        }
        written.applied.push((index, Some(key.as_str().to_owned()), Outcome::Applied, Some(took)));
    }

    /// Each message decoded, in order; a key met twice ends the run before it.
    fn prepare_run(&self, items: &[Item]) -> Result<Vec<Prepared>, Tx> {
        let mut prepared: Vec<Prepared> = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            match self.prepare(item) {
                Ok(p) if self.handler.dedup() && prepared.iter().any(|q| q.key == p.key) => {
                    return Err(Tx::Repeat { at: index })
                }
                Ok(p) => prepared.push(p),
                Err(rejection) => {
                    let error = HandlerError::permanent(rejection.message);
                    return Err(Tx::Failed { at: Some(index), error, kind: rejection.kind, cut: false });
                }
            }
        }
        Ok(prepared)
    }

    /// BEGIN, and the dedup rows of `rows` (key, fingerprint) claimed, unless the
    /// handler keeps none.
    async fn claim(&self, conn: &mut Conn, rows: &[(&str, &[u8])]) -> diesel::QueryResult<db::Claim> {
        if self.handler.dedup() {
            db::begin_and_claim(conn, &self.scope, rows).await
        } else {
            let keys: Vec<&str> = rows.iter().map(|(key, _)| *key).collect();
            db::begin_without_claim(conn, &keys).await
        }
    }

    /// A key applied before (a message published twice, at two offsets): a
    /// duplicate if its payload is the same (its stored row returned, for a
    /// request's reply), else a conflict (dead-lettered unless the handler ignores
    /// conflicts: then `None`).
    async fn known(
        &self,
        conn: &mut Conn,
        claim: &db::Claim,
        key: &Key,
        fingerprint: &[u8],
        index: usize,
    ) -> Result<Option<db::Stored>, Tx> {
        let stored = match claim.stored.get(key.as_str()) {
            Some(stored) => Some(stored.clone()),
            None => match db::stored_rows(conn, &self.scope, &[key.as_str()]).await {
                Ok(mut rows) => rows.remove(key.as_str()),
                Err(err) => return Err(Tx::Fault(err.to_string())),
            },
        };
        let conflict =
            stored.as_ref().and_then(|s| s.fingerprint.as_deref()).is_some_and(|f| f != fingerprint);
        if conflict && self.handler.on_conflict() != Some(OnConflict::Ignore) {
            let error =
                HandlerError::permanent(format!("key '{key}' was applied before with another payload"));
            return Err(Tx::Failed { at: Some(index), error, kind: FailureKind::Conflict, cut: false });
        }
        Ok(stored.filter(|_| !conflict))
    }

    /// The context a handler of the message `item`, keyed `key`, runs with.
    fn context(&self, item: &Item, key: &Key, attempt: u32) -> Context {
        let mut ctx = Context::new(&self.scope, key.as_str(), attempt, false, &item.delivery.properties);
        if !self.handler.dedup() {
            // Two messages with one key are two messages here: their outbox rows
            // must not share ids.
            ctx.use_random_ids();
        }
        ctx
    }

    /// A handler's call in the open transaction, within the handler timeout, a
    /// panic caught: its value and how long it took, or its error (`true`: cut off,
    /// its statement cancelled; the connection is then dropped).
    async fn guarded<T>(
        &self,
        conn: &mut Conn,
        call: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, HandlerError>,
    ) -> Result<(T, Duration), (HandlerError, bool)> {
        let cancel = conn.canceller();
        let started = Instant::now();
        let ran = tokio::time::timeout(
            self.shared.handler_timeout,
            AssertUnwindSafe(call(&mut **conn)).catch_unwind(),
        )
        .await;
        let took = started.elapsed();
        let cut = match ran {
            Ok(Ok(Ok(value))) => return Ok((value, took)),
            Ok(Ok(Err(error))) => return Err((error, false)),
            Ok(Err(panic)) => format!("the handler panicked: {}", panic_message(&*panic)),
            Err(_) => format!(
                "the handler did not finish within {}",
                crate::base::duration::human(self.shared.handler_timeout)
            ),
        };
        cancel_statement(&cancel).await;
        Err((HandlerError::transient(cut), true))
    }

    /// A batch handler, once, with the run's new messages (in offset order), each
    /// with its context: what each ran, or the failure — of the message when it ran
    /// alone (`Some(index)`), else of the call (`None`: the run splits in halves).
    async fn together(
        &self,
        conn: &mut Conn,
        batch: Vec<(usize, Key, Erased, Context)>,
    ) -> Result<Vec<(usize, Key, Ran)>, (Option<usize>, HandlerError, bool)> {
        let count = batch.len();
        let alone = match batch.as_slice() {
            [(index, ..)] => Some(*index),
            _ => None,
        };
        let (mut heads, mut messages, mut contexts) =
            (Vec::with_capacity(count), Vec::with_capacity(count), Vec::with_capacity(count));
        for (index, key, message, ctx) in batch {
            heads.push((index, key));
            messages.push(message);
            contexts.push(ctx);
        }
        let handler = Arc::clone(&self.handler);
        let span = batch_span(handler.name(), &contexts);
        let ((outputs, contexts), took) = self
            .guarded(conn, async |conn| handler.run_batch(conn, messages, contexts).instrument(span).await)
            .await
            .map_err(|(error, cut)| (alone, error, cut))?;
        if outputs.len() != count {
            return Err((alone, crate::handler::batch::length_mismatch(outputs.len(), count), false));
        }
        Ok(heads
            .into_iter()
            .zip(outputs)
            .zip(contexts)
            .map(|(((index, key), output), mut ctx)| (index, key, (output.0, ctx.take_published(), took)))
            .collect())
    }

    /// Rolls the open transaction back and returns `tx` (a fault if the rollback
    /// failed: the connection is gone).
    async fn abort(&self, conn: &mut Conn, tx: Tx) -> Tx {
        match AnsiTransactionManager::rollback_transaction(&mut **conn).await {
            Ok(()) | Err(diesel::result::Error::NotInTransaction) => tx,
            Err(err) => Tx::Fault(format!("rolling back failed: {err}")),
        }
    }

    /// The outbox, the results and the offset, then the checked COMMIT.
    async fn finish(
        &mut self,
        conn: &mut Conn,
        items: &[Item],
        xid: Option<i64>,
        written: Written,
        began_at: Instant,
    ) -> Tx {
        let Written { applied, published, results } = written;
        let target = items.last().map_or(self.last, |item| item.offset);
        let writes = async {
            db::insert_outbox(conn, &published).await?;
            let results: Vec<(&str, &[u8])> =
                results.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            db::store_results(conn, &self.scope, &results).await?;
            let moved = db::advance_offset(conn, &self.scope, &self.stream, self.last, target).await?;
            let xid = match xid {
                Some(xid) => xid,
                None => {
                    diesel_async::RunQueryDsl::get_result(diesel::select(txid_current()), &mut **conn).await?
                }
            };
            Ok::<_, diesel::result::Error>((moved, xid))
        };
        let (moved, xid) = match writes.await {
            Ok(done) => done,
            Err(err) => return self.abort(conn, Tx::Fault(err.to_string())).await,
        };
        if !moved {
            return self.abort(conn, Tx::Fenced).await;
        }
        match db::commit_checked(conn, xid).await {
            Ok(()) => {}
            Err(db::CommitFailure::Unknown(err)) => {
                // Its connection's state is unknown too: never back to the pool.
                self.unknown_commit = true;
                match self.landed(target).await {
                    Some(true) => {}
                    Some(false) => {
                        return Tx::Fault(format!(
                            "the COMMIT's outcome is unknown and it did not land: {err}"
                        ))
                    }
                    None => return Tx::Fenced,
                }
            }
            Err(db::CommitFailure::Refused { contention: true, error }) => {
                return Tx::Fault(error.to_string())
            }
            Err(failure) => {
                let error = HandlerError::transient(format!("the transaction did not commit: {failure:?}"));
                let at = (items.len() == 1).then_some(0);
                return Tx::Failed { at, error, kind: FailureKind::Handler, cut: false };
            }
        }
        self.stored(target);
        if !published.is_empty() {
            self.shared.outbox.committed();
        }
        for (item, (_, key, outcome, took)) in items.iter().zip(applied) {
            self.settled(item, key, outcome, items.len(), Some(began_at), took);
        }
        Tx::Committed
    }

    /// After a COMMIT whose outcome is unknown: `Some(true)` if the offset is at
    /// `target` (it committed), `Some(false)` if still at the old value, `None` if
    /// another consumer moved it.
    pub(super) async fn landed(&self, target: i64) -> Option<bool> {
        for _ in 0..30 {
            if let Ok(mut conn) = self.shared.pool.get().await {
                if let Ok(offset) = db::read_offset(&mut conn, &self.scope, &self.stream).await {
                    return match offset {
                        offset if offset == target => Some(true),
                        offset if offset == self.last => Some(false),
                        _ => None,
                    };
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Some(false)
    }
}

diesel::define_sql_function! {
    /// The current transaction's id.
    fn txid_current() -> diesel::sql_types::BigInt;
}
