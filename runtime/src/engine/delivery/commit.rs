//! The end of a transaction: what the handlers published and returned (outbox rows,
//! a request's reply, stored results: one statement each), then the checked COMMIT.
//! Committed, every handler that ran is applied and the repeats of their keys
//! follow; answered with an error, it was a rollback (a batch of several runs again
//! in halves, a delivery alone is charged an attempt); without an answer its fate is
//! unknown, and the transaction runs again: the dedup rows decide.

use std::time::Instant;

use super::contention::Collision;
use super::faults::{no_answer, rollback, Fault, InfraFault};
use super::tx::{infra, rerun_repeats, split, Done, Tx};
use super::Consumer;
use crate::base::observe::{Commit, SagaStep};
use crate::base::outcome::Outcome;
use crate::base::outgoing::{Outgoing, Request};
use crate::base::verdict;
use crate::handler::context::HandlerOutput;
use crate::handler::HandlerError;
use crate::store::db::{self, CommitFailure, Conn, Stored};

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

/// The outbox rows a transaction wrote, for the relay once it commits.
pub(super) struct Written {
    /// The rows due at once, as written (handed to the runtime's own relay).
    fed: Vec<db::OutboxRow>,
    /// Whether `fed` is every row written (else the relay is woken to scan for the rest).
    whole: bool,
}

impl Consumer {
    /// The outbox rows (what the handlers published, a request's reply) and the
    /// stored results of the whole batch: one statement each. Returns the outbox
    /// rows it wrote, if any, for the relay after COMMIT.
    pub(super) async fn write(
        &self,
        conn: &mut Conn,
        tx: &Tx<'_>,
        done: &[Done],
    ) -> Result<Option<Written>, Fault> {
        let mut rows: Vec<Outgoing> = Vec::new();
        let mut results: Vec<(&str, &[u8])> = Vec::new();
        for done in done {
            rows.extend(done.published.iter().cloned());
            if let Some(request) = Request::of(&tx.items[done.index].delivery.properties) {
                let body = HandlerOutput::reply_body(done.output.0.as_deref());
                // Without dedup rows two requests may share a key: random reply ids.
                let id = if tx.dedup { self.reply_id(done.key.as_str()) } else { crate::base::random_id() };
                rows.push(Outgoing::reply(&request, id, body, true));
            }
            match &done.output.0 {
                Some(result) if tx.dedup => results.push((done.key.as_str(), result)),
                _ => {}
            }
        }
        let written = async {
            let inserted = self.bounded(db::insert_outbox(conn, &rows)).await?;
            self.bounded(db::store_results(conn, &self.scope, &results)).await?;
            Ok(inserted)
        };
        let inserted = match written.await {
            Ok(inserted) => inserted,
            Err(err) => return Err(rollback(conn, infra(err)).await),
        };
        if rows.is_empty() {
            return Ok(None);
        }
        let count = rows.len();
        let fed = db::written(rows, inserted);
        Ok(Some(Written { whole: fed.len() == count, fed }))
    }

    /// The checked COMMIT, bounded like idemq's other statements. Its fate unknown
    /// (a lost connection, no answer), the transaction is retried and the dedup rows
    /// decide; answered with an error, it was a rollback ([`Self::commit_failed`]).
    pub(super) async fn commit(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        xid: i64,
        done: Vec<Done>,
        outbox: Option<Written>,
    ) -> Result<(), Fault> {
        let committing = Instant::now();
        let commit = tokio::time::timeout(self.shared.statement_deadline, db::commit_checked(conn, xid));
        let committed = commit
            .await
            .unwrap_or_else(|_| Err(CommitFailure::Unknown(no_answer(self.shared.statement_deadline))));
        match committed {
            Ok(()) => {
                let commit =
                    Commit { queue: &self.queue, deliveries: done.len(), took: committing.elapsed() };
                self.shared.observers.committed(&commit);
                if let Some(Written { fed, whole }) = outbox {
                    if !whole {
                        self.shared.outbox.committed();
                    }
                    if !fed.is_empty() {
                        self.sends.store(true, std::sync::atomic::Ordering::Relaxed);
                        self.shared.outbox.committed_rows(fed);
                    }
                }
                self.applied(tx, done);
                Ok(())
            }
            // COMMIT's fate is unknown: retry; the dedup rows decide.
            Err(CommitFailure::Unknown(err)) => Err(Fault::Infra(InfraFault::Commit(err))),
            Err(failure) => self.commit_failed(tx, done, failure),
        }
    }

    /// Committed: every handler that ran is applied, and the repeats of their keys
    /// follow.
    fn applied(&self, tx: &mut Tx<'_>, done: Vec<Done>) {
        for Done { index, key, fingerprint, output, took, saga, .. } in done {
            if let Some(saga) = saga {
                self.shared.observers.saga_step(&SagaStep {
                    saga: saga.saga,
                    handler: self.handler.name(),
                    kind: saga.kind,
                    timeouts_scheduled: saga.scheduled,
                    timeouts_cancelled: saga.cancelled,
                    timeout_fired: saga.fired,
                });
            }
            let stored = Stored { fingerprint: Some(fingerprint.to_vec()), result: output.0, failed: false };
            tx.payloads.insert(key.as_str().to_owned(), stored);
            let mut decision = self.decision(Outcome::Applied, key.as_str(), Some(tx.began_at), tx.batch);
            decision.handler_time = Some(took);
            tx.ran.decided.push((index, decision));
        }
        let repeats = std::mem::take(&mut tx.repeats);
        self.resolve_repeats(tx, repeats);
    }

    /// PostgreSQL answered the COMMIT with an error or a rollback: a batch of several
    /// runs again in halves; a delivery alone is charged a failed attempt (after
    /// in-process runs for contention), and the repeats of its key run next.
    fn commit_failed(
        &self,
        tx: &mut Tx<'_>,
        mut done: Vec<Done>,
        failure: CommitFailure,
    ) -> Result<(), Fault> {
        if done.len() > 1 {
            crate::base::log::debug!(queue = %self.queue, ?failure, batch = tx.batch, "the batch's COMMIT failed; running it in halves");
            let indices: Vec<usize> = done.iter().map(|done| done.index).collect();
            tx.ran.next = split(&indices, verdict::halves(indices.len()), &tx.repeats);
            let contended = matches!(failure, CommitFailure::Refused { contention: true, .. });
            tx.ran.collided = contended.then_some(Collision::Unknown);
            return Ok(());
        }
        let Done { index, key, .. } = done.pop().expect("a transaction with an xid ran a handler");
        let attempt = tx.items[index].counts.attempt;
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
        tx.ran.decided.push((index, self.decision(outcome, key.as_str(), Some(tx.began_at), tx.batch)));
        tx.ran.next = rerun_repeats(std::mem::take(&mut tx.repeats));
        Ok(())
    }
}
