//! Applying a stream's messages in offset order: runs of messages in one
//! transaction with the offset, a failing message alone (retried in place, then
//! dead-lettered), and what each settled as.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, TransactionManager};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use lapin::Channel;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::{End, StreamContext, StreamSpec};
use crate::base::backoff::Backoff;
use crate::base::outcome::{FailureKind, Outcome, Settled};
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::retry::RetryPolicy;
use crate::broker::dead_letter::{self, Letter};
use crate::engine::delivery::{cancel_statement, panic_message, Shared};
use crate::handler::context::{Context, HandlerOutput};
use crate::handler::prepare::{ErasedHandler, Payload, Prepared};
use crate::handler::{ErrorClass, HandlerError};
use crate::store::db::{self, Conn};

/// A delivery and its offset.
pub(super) struct Item {
    offset: i64,
    delivery: Delivery,
    received_at: Instant,
}

/// How one transaction over a run of messages ended.
enum Tx {
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
/// (key, outcome, handler time), the messages they published, their results.
#[derive(Default)]
struct Written {
    applied: Vec<(Option<String>, Outcome, Option<Duration>)>,
    published: Vec<Outgoing>,
    results: Vec<(String, Vec<u8>)>,
}

/// One subscription's state: where the offset is, and the channels.
pub(super) struct Runner {
    stream: String,
    dead_letter: String,
    delivery_limit: u32,
    handler: Arc<dyn ErasedHandler>,
    scope: String,
    retry: RetryPolicy,
    shared: Arc<Shared>,
    /// Acks (for the stream's credit: they remove nothing).
    channel: Channel,
    /// Confirm mode: dead letters.
    publisher: Channel,
    /// The last offset applied or dead-lettered, as stored.
    last: i64,
    session: u64,
    frame_max: u32,
    /// The subscription's first message is yet to come: it runs alone.
    fresh: bool,
    /// The first message runs, holding the process's turn for writing.
    alone_in_process: bool,
    /// The last COMMIT's outcome was unknown: its connection is dropped.
    unknown_commit: bool,
}

impl Runner {
    pub(super) fn new(
        spec: &StreamSpec,
        ctx: &StreamContext,
        channel: Channel,
        publisher: Channel,
        last: i64,
        session: u64,
        frame_max: u32,
    ) -> Self {
        Self {
            stream: spec.stream().to_owned(),
            dead_letter: spec.declared.dead_letter_name().to_owned(),
            delivery_limit: spec.declared.delivery_limit,
            handler: Arc::clone(&spec.handler),
            scope: spec.scope.clone(),
            retry: spec.retry.clone(),
            shared: Arc::clone(&ctx.shared),
            channel,
            publisher,
            last,
            session,
            frame_max,
            fresh: true,
            alone_in_process: false,
            unknown_commit: false,
        }
    }

    /// Closes both channels (each handshake bounded), before their connection.
    pub(super) async fn close_channels(&self) {
        for channel in [&self.channel, &self.publisher] {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                channel.close(200, "stream session ended".into()),
            )
            .await;
        }
    }

    /// Applies a batch in offset order (what is at or below the offset skipped),
    /// then acks it.
    pub(super) async fn batch(&mut self, batch: Vec<Delivery>, stop: &CancellationToken) -> Result<(), End> {
        let received_at = Instant::now();
        let last_tag = batch.last().map(|delivery| delivery.delivery_tag);
        let mut items = Vec::with_capacity(batch.len());
        for delivery in batch {
            let Some(offset) = offset_of(&delivery) else {
                return Err(End::Fatal(crate::Error::Config(format!(
                    "'{}' is consumed as a stream but its deliveries carry no x-stream-offset: is it a stream?",
                    self.stream
                ))));
            };
            if offset > self.last {
                items.push(Item { offset, delivery, received_at });
            }
        }
        self.alone_in_process = false;
        let mut rest = items.as_slice();
        if self.fresh {
            if let Some((first, after)) = rest.split_first() {
                self.first(first, stop).await?;
                rest = after;
                self.fresh = false;
            }
        }
        self.segments(rest, stop).await?;
        if let Some(tag) = last_tag {
            let ack = BasicAckOptions { multiple: true };
            self.channel.basic_ack(tag, ack).await.map_err(|err| End::Lost(err.to_string()))?;
        }
        Ok(())
    }

    /// The subscription's first message (where a crash restarts): alone in the
    /// process, its start committed before its handler runs; past the queue's
    /// delivery limit of starts, it is poison.
    async fn first(&mut self, item: &Item, stop: &CancellationToken) -> Result<(), End> {
        let shared = Arc::clone(&self.shared);
        let _alone = shared.turns.write().await;
        self.alone_in_process = true;
        let mark = format!("{}@{}", self.stream, item.offset);
        let starts = {
            let mut conn = self.shared.pool.get().await.map_err(|err| End::Lost(err.to_string()))?;
            db::mark_start(&mut conn, &self.scope, &mark).await.map_err(|err| End::Lost(err.to_string()))?
        };
        if u32::try_from(starts).unwrap_or(u32::MAX) > self.delivery_limit {
            let error = format!(
                "its handler started {} times without an outcome (the process crashed or hung each time)",
                starts - 1
            );
            self.dead_letter(item, FailureKind::Poison, &error, None, 0, stop).await?;
        } else {
            self.segments(std::slice::from_ref(item), stop).await?;
        }
        self.alone_in_process = false;
        if let Ok(mut conn) = self.shared.pool.get().await {
            let _ = db::clear_starts(&mut conn, &self.scope, &mark).await;
        }
        Ok(())
    }

    /// Runs of messages that decode, in order; a message that does not is
    /// dead-lettered between them.
    async fn segments(&mut self, items: &[Item], stop: &CancellationToken) -> Result<(), End> {
        let mut start = 0;
        for (index, item) in items.iter().enumerate() {
            if let Err(rejection) = self.prepare(item) {
                self.apply(&items[start..index], stop).await?;
                self.dead_letter(item, rejection.kind, &rejection.message, None, 0, stop).await?;
                start = index + 1;
            }
        }
        self.apply(&items[start..], stop).await
    }

    fn prepare(&self, item: &Item) -> Result<Prepared, crate::handler::prepare::Rejection> {
        self.handler.prepare(&item.delivery.data, &item.delivery.properties, self.shared.limits)
    }

    /// `items` in one transaction; when one fails, the ones before it commit first,
    /// then it runs alone ([`Self::alone`]), then the ones after it.
    fn apply<'a>(
        &'a mut self,
        items: &'a [Item],
        stop: &'a CancellationToken,
    ) -> BoxFuture<'a, Result<(), End>> {
        Box::pin(async move {
            match items {
                [] => return Ok(()),
                [item] => return self.alone(item, stop).await,
                _ => {}
            }
            let mut backoff = database_backoff();
            loop {
                let (before, culprit, after) = match self.transact(items, 1).await {
                    Tx::Committed => return Ok(()),
                    Tx::Failed { at: Some(at), .. } => (&items[..at], Some(&items[at]), &items[at + 1..]),
                    Tx::Failed { at: None, .. } => {
                        let (left, right) = items.split_at(items.len() / 2);
                        (left, None, right)
                    }
                    Tx::Repeat { at } => (&items[..at], None, &items[at..]),
                    Tx::Fenced => return Err(End::Fenced),
                    Tx::Fault(reason) => {
                        self.wait_out(&reason, &mut backoff, stop).await?;
                        continue;
                    }
                };
                self.apply(before, stop).await?;
                if let Some(culprit) = culprit {
                    self.alone(culprit, stop).await?;
                }
                return self.apply(after, stop).await;
            }
        })
    }

    /// One message alone: a transient failure is retried in place after the
    /// policy's delay, until its attempts run out; then, or on a permanent failure,
    /// it is dead-lettered and the offset moves past it.
    async fn alone(&mut self, item: &Item, stop: &CancellationToken) -> Result<(), End> {
        let mut attempt = 1;
        let mut backoff = database_backoff();
        loop {
            match self.transact(std::slice::from_ref(item), attempt).await {
                Tx::Committed => return Ok(()),
                Tx::Fenced => return Err(End::Fenced),
                Tx::Fault(reason) => self.wait_out(&reason, &mut backoff, stop).await?,
                Tx::Repeat { .. } => unreachable!("one message cannot repeat its key"),
                Tx::Failed { error, kind, .. } => {
                    let (delay, kind) = match error.class() {
                        ErrorClass::Permanent => (None, kind),
                        _ => (self.retry.delay_after(attempt), FailureKind::AttemptsExhausted),
                    };
                    let Some(delay) = delay else {
                        let key = self.prepare(item).ok().map(|prepared| prepared.key.as_str().to_owned());
                        return self.dead_letter(item, kind, &error.to_string(), key, attempt, stop).await;
                    };
                    tracing::warn!(stream = %self.stream, offset = item.offset, attempt, delay = %crate::base::duration::human(delay), error = %error, "handler failed; retrying in place (the stream waits for it)");
                    tokio::select! {
                        () = stop.cancelled() => return Err(End::Stopped),
                        () = tokio::time::sleep(delay) => {}
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// A database fault: wait (or stop), then the caller runs the transaction again.
    async fn wait_out(
        &self,
        reason: &str,
        backoff: &mut Backoff,
        stop: &CancellationToken,
    ) -> Result<(), End> {
        tracing::warn!(stream = %self.stream, %reason, "database fault; running the transaction again on a fresh connection (not an attempt)");
        tokio::select! {
            () = stop.cancelled() => Err(End::Stopped),
            () = backoff.wait() => Ok(()),
        }
    }

    /// The transaction over `items` (see the module docs).
    async fn transact(&mut self, items: &[Item], attempt: u32) -> Tx {
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
                written.applied.push((Some(key.as_str().to_owned()), Outcome::Duplicate, None));
                continue;
            }
            let Payload::Effect(effect) = payload else {
                let error = HandlerError::permanent("batch handlers do not consume streams yet");
                let failed = Tx::Failed { at: Some(index), error, kind: FailureKind::Handler, cut: false };
                return self.abort(conn, failed).await;
            };
            match self.effect(conn, &items[index], &key, effect, attempt).await {
                Ok((output, published, took)) => {
                    written.published.extend(published);
                    if let Some(request) = Request::of(&items[index].delivery.properties) {
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
                    written.applied.push((Some(key.as_str().to_owned()), Outcome::Applied, Some(took)));
                }
                Err((error, cut)) => {
                    let failed = Tx::Failed { at: Some(index), error, kind: FailureKind::Handler, cut };
                    return self.abort(conn, failed).await;
                }
            }
        }
        self.finish(conn, items, claim.xid, written, began_at).await
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
        key: &crate::Key,
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
        if conflict && self.handler.on_conflict() != Some(crate::OnConflict::Ignore) {
            let error =
                HandlerError::permanent(format!("key '{key}' was applied before with another payload"));
            return Err(Tx::Failed { at: Some(index), error, kind: FailureKind::Conflict, cut: false });
        }
        Ok(stored.filter(|_| !conflict))
    }

    /// One handler in the open transaction, within the handler timeout, a panic
    /// caught: its result and what it published, or its error (`true`: cut off, its
    /// statement cancelled; the connection is then dropped).
    async fn effect(
        &self,
        conn: &mut Conn,
        item: &Item,
        key: &crate::Key,
        effect: crate::handler::prepare::Effect,
        attempt: u32,
    ) -> Result<(Option<Vec<u8>>, Vec<Outgoing>, Duration), (HandlerError, bool)> {
        let mut ctx = Context::new(&self.scope, key.as_str(), attempt, false, &item.delivery.properties);
        if !self.handler.dedup() {
            // Two messages with one key are two messages here: their outbox rows
            // must not share ids.
            ctx.use_random_ids();
        }
        let cancel = conn.canceller();
        let started = Instant::now();
        let ran = tokio::time::timeout(
            self.shared.handler_timeout,
            AssertUnwindSafe(effect(conn, &mut ctx)).catch_unwind(),
        )
        .await;
        let took = started.elapsed();
        let cut = match ran {
            Ok(Ok(Ok(output))) => return Ok((output.0, ctx.take_published(), took)),
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
        self.last = target;
        if !published.is_empty() {
            self.shared.outbox.committed();
        }
        for (item, (key, outcome, took)) in items.iter().zip(applied) {
            self.settled(item, key, outcome, items.len(), Some(began_at), took);
        }
        Tx::Committed
    }

    /// After a COMMIT whose outcome is unknown: `Some(true)` if the offset is at
    /// `target` (it committed), `Some(false)` if still at the old value, `None` if
    /// another consumer moved it.
    async fn landed(&self, target: i64) -> Option<bool> {
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

    /// Publishes `item` to the dead-letter queue (confirmed), then moves the offset
    /// past it.
    async fn dead_letter(
        &mut self,
        item: &Item,
        kind: FailureKind,
        error: &str,
        key: Option<String>,
        attempts: u32,
        stop: &CancellationToken,
    ) -> Result<(), End> {
        tracing::warn!(stream = %self.stream, offset = item.offset, kind = %kind, %error, "dead-lettering; the stream moves past it");
        let copy_id = copy_id(&self.scope, &self.stream, item.offset);
        let letter = Letter {
            kind: Some(kind),
            error,
            handler: self.handler.name(),
            queue: &self.stream,
            attempts,
            copy_id: &copy_id,
            retry_of: None,
        };
        dead_letter::publish(&self.publisher, &self.dead_letter, &item.delivery, &letter, self.frame_max)
            .await
            .map_err(|err| End::Lost(crate::error::report(&err)))?;
        let mut backoff = database_backoff();
        loop {
            let moved = async {
                let mut conn = self.shared.pool.get().await.map_err(|err| err.to_string())?;
                db::advance_offset(&mut conn, &self.scope, &self.stream, self.last, item.offset)
                    .await
                    .map_err(|err| err.to_string())
            };
            match moved.await {
                Ok(true) => break,
                Ok(false) => match self.landed(item.offset).await {
                    Some(true) => break,
                    _ => return Err(End::Fenced),
                },
                Err(reason) => self.wait_out(&reason, &mut backoff, stop).await?,
            }
        }
        self.last = item.offset;
        let outcome = Outcome::DeadLettered { kind, error: error.to_owned() };
        self.settled(item, key, outcome, 0, None, None);
        Ok(())
    }

    fn settled(
        &self,
        item: &Item,
        key: Option<String>,
        outcome: Outcome,
        batch: usize,
        began_at: Option<Instant>,
        handler_time: Option<Duration>,
    ) {
        self.shared.observers.settled(&Settled {
            queue: self.stream.clone(),
            handler: self.handler.name(),
            key,
            outcome,
            settled_with_broker: true,
            delivery_count: 0,
            redelivered: false,
            attempt: 1,
            session: self.session,
            batch,
            received_at: item.received_at,
            began_at,
            settled_at: Instant::now(),
            handler_time,
        });
    }
}

/// The waits between runs of a transaction the database failed.
fn database_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
}

/// A stream delivery's offset (`x-stream-offset`, set by the broker).
fn offset_of(delivery: &Delivery) -> Option<i64> {
    match crate::base::amqp_value::header(&delivery.properties, "x-stream-offset")? {
        AMQPValue::LongLongInt(offset) => Some(*offset),
        AMQPValue::LongInt(offset) => Some(i64::from(*offset)),
        AMQPValue::LongUInt(offset) => Some(i64::from(*offset)),
        AMQPValue::Timestamp(offset) => i64::try_from(*offset).ok(),
        _ => None,
    }
}

/// The copy id of a stream message's dead letter: one per (handler, stream, offset).
fn copy_id(scope: &str, stream: &str, offset: i64) -> String {
    let digest = Sha256::new()
        .chain_update(scope)
        .chain_update([0])
        .chain_update(stream)
        .chain_update([0])
        .chain_update(offset.to_be_bytes())
        .finalize();
    format!("{}:1", crate::base::hex(&digest[..16]))
}

diesel::define_sql_function! {
    /// The current transaction's id.
    fn txid_current() -> diesel::sql_types::BigInt;
}
