//! One transaction of part of a batch, as phases in the order they run, each a
//! small function that hands the next what it needs ([`Step::Next`]) or ends the
//! run ([`Step::Ended`]: what it decided, and what runs next, are in [`Tx::ran`]):
//!
//! ```text
//! claim   BEGIN + the dedup rows, inserted where
//!         absent, and the rows applied before
//!         (one statement, one round trip)            → Claimed { new, applied before }
//! open    the applied-before decided; nothing new,
//!         or poison: ROLLBACK                         → Open { xid, new }
//! handle  the handlers, in arrival order, or a batch
//!         handler once with them all (`handlers`)   → every message Done
//! write   outbox rows and results (one statement each)
//! commit  checked COMMIT                              → applied | rolled back | unknown
//! ```
//!
//! Whatever cannot be decided together is split (see [`verdict::around`] and
//! [`verdict::halves`]) for `batch` to run next.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, TransactionManager};

use super::faults::{no_answer, rollback, Fault, InfraFault};
use super::{Collision, Consumer, Decision, Delivered, Ran};
use crate::base::observe::Commit;
use crate::base::outcome::Outcome;
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::verdict;
use crate::handler::context::HandlerOutput;
use crate::handler::prepare::{Fingerprint, Prepared};
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

/// Where a phase of the transaction leads.
pub(super) enum Step<T> {
    /// On to the next phase, with what it needs.
    Next(T),
    /// The run ends here: its decisions and the parts to run next are in [`Tx::ran`].
    Ended,
}

/// What the phases of one transaction share.
pub(super) struct Tx<'a> {
    pub(super) items: &'a [Delivered],
    /// Whether the handler keeps dedup rows (without them every delivery runs).
    pub(super) dedup: bool,
    /// Deliveries in the transaction (each decision's `batch`).
    pub(super) batch: usize,
    pub(super) began_at: Instant,
    /// Deliveries whose key an earlier one of the batch holds: decided by its fate.
    pub(super) repeats: Vec<Repeat>,
    /// The rows applied under each key (payload, result), for the repeats.
    payloads: HashMap<String, Stored>,
    /// What the run decided so far, and what runs next.
    pub(super) ran: Ran,
}

/// The dedup rows are claimed and the transaction is open.
struct Claimed {
    /// The transaction's id, if it inserted any row.
    xid: Option<i64>,
    /// Whose rows it inserted, in arrival order.
    new: Vec<(usize, Prepared)>,
    /// Applied before: only their keys and fingerprints matter now.
    applied_before: Vec<Repeat>,
    /// Their rows, as far as the claim read them.
    stored: HashMap<String, Stored>,
}

/// New messages to run in the open transaction, none of them poison.
struct Open {
    xid: i64,
    new: Vec<(usize, Prepared)>,
}

impl Tx<'_> {
    /// The same key twice: the first is run, the others wait for its fate. (A
    /// handler without dedup rows runs every delivery.) Returns the firsts.
    fn set_repeats_aside(&mut self, runnable: Vec<(usize, Prepared)>) -> Vec<(usize, Prepared)> {
        let dedup = self.dedup;
        let mut seen = HashSet::new();
        let (firsts, repeats): (Vec<_>, Vec<_>) = runnable
            .into_iter()
            .partition(|(_, prepared)| !dedup || seen.insert(prepared.key.as_str().to_owned()));
        self.repeats = repeats.into_iter().map(Repeat::from).collect();
        firsts
    }
}

/// A statement of idemq's own failed: nothing is decided (see [`Consumer::diagnose`]).
pub(super) fn infra(err: diesel::result::Error) -> Fault {
    Fault::Infra(InfraFault::Database(err))
}

impl Consumer {
    /// The transaction of `runnable` (batch index, decoded message): the dedup rows
    /// of the batch in one statement, the handlers of the new messages in arrival
    /// order (or one batch handler call), the checked COMMIT. `starts` is how often the handler of a message run
    /// alone started (this time included).
    ///
    /// Deliveries it cannot decide together go to `next` (see [`verdict::around`]
    /// and [`verdict::halves`]); a delivery whose key is already in the batch waits
    /// for the first one's fate (the same key twice keeps one dedup row).
    pub(super) async fn transact(
        &self,
        conn: &mut Conn,
        items: &[Delivered],
        runnable: Vec<(usize, Prepared)>,
        starts: Option<i32>,
        ran: Ran,
    ) -> Result<Ran, Fault> {
        let mut tx = Tx {
            items,
            dedup: self.handler.dedup(),
            batch: runnable.len(),
            began_at: Instant::now(),
            repeats: Vec::new(),
            payloads: HashMap::new(),
            ran,
        };
        let firsts = tx.set_repeats_aside(runnable);
        let Step::Next(claimed) = self.claim(conn, &mut tx, firsts).await? else { return Ok(tx.ran) };
        let Step::Next(open) = self.open(conn, &mut tx, claimed, starts).await? else { return Ok(tx.ran) };
        let Step::Next(done) = self.handle(conn, &mut tx, open.new).await? else { return Ok(tx.ran) };
        let wrote_outbox = self.write(conn, &tx, &done).await?;
        self.commit(conn, tx, open.xid, done, wrote_outbox).await
    }

    /// BEGIN and the dedup rows of the first deliveries of each key, in one
    /// statement: the keys it inserted are new, the others were applied before. A
    /// batch whose insert is refused with the connection up runs in halves.
    async fn claim(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        firsts: Vec<(usize, Prepared)>,
    ) -> Result<Step<Claimed>, Fault> {
        let rows: Vec<(&str, &[u8])> =
            firsts.iter().map(|(_, p)| (p.key.as_str(), p.fingerprint.as_slice())).collect();
        let mark = conn.mark();
        let claimed = if tx.dedup {
            self.bounded(db::begin_and_claim(conn, &self.scope, &rows)).await
        } else {
            let keys: Vec<&str> = rows.iter().map(|(key, _)| *key).collect();
            self.bounded(db::begin_without_claim(conn, &keys)).await
        };
        let claim = match claimed {
            Ok(claim) => claim,
            Err(err) => {
                let contended = db::contended_since(conn, mark);
                let rolled_back = !db::is_connection_error(&err)
                    && self.bounded(AnsiTransactionManager::rollback_transaction(&mut **conn)).await.is_ok()
                    && !PoolableConnection::is_broken(&mut **conn);
                if firsts.len() > 1 && rolled_back {
                    // Refused with the connection up (most often its lock timeout
                    // behind another batch holding one of these keys): smaller batches.
                    tracing::debug!(queue = %self.queue, error = %err, batch = tx.batch, "the batch's dedup insert failed; running it in halves");
                    let indices: Vec<usize> = firsts.iter().map(|(index, _)| *index).collect();
                    tx.ran.next = split(&indices, verdict::halves(indices.len()), &tx.repeats);
                    // The claim touches nothing but dedup rows (a handler without
                    // them has none to wait on: no telling, then).
                    let on = if tx.dedup { Collision::DedupRows } else { Collision::Unknown };
                    tx.ran.collided = contended.then_some(on);
                    return Ok(Step::Ended);
                }
                return Err(infra(err));
            }
        };
        drop(rows);
        let (new, applied_before): (Vec<_>, Vec<_>) =
            firsts.into_iter().partition(|(_, prepared)| claim.inserted.contains(prepared.key.as_str()));
        let applied_before = applied_before.into_iter().map(Repeat::from).collect();
        Ok(Step::Next(Claimed { xid: claim.xid, new, applied_before, stored: claim.stored }))
    }

    /// The deliveries applied before are decided by their stored rows. With nothing
    /// new the transaction ends here, as it does for a message run alone that has
    /// started `delivery_limit` times (poison).
    async fn open(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        claimed: Claimed,
        starts: Option<i32>,
    ) -> Result<Step<Open>, Fault> {
        let Claimed { xid, new, applied_before, stored } = claimed;
        if !applied_before.is_empty() {
            self.read_applied(conn, tx, applied_before, stored).await?;
        }
        let Some(xid) = xid.filter(|_| !new.is_empty()) else {
            // Nothing new: nothing to keep.
            self.bounded(AnsiTransactionManager::rollback_transaction(&mut **conn)).await.map_err(infra)?;
            let repeats = std::mem::take(&mut tx.repeats);
            self.resolve_repeats(tx, repeats);
            return Ok(Step::Ended);
        };
        if let Some(outcome) = starts.and_then(|starts| verdict::poison(starts, self.delivery_limit)) {
            self.bounded(AnsiTransactionManager::rollback_transaction(&mut **conn)).await.map_err(infra)?;
            let (index, prepared) = &new[0];
            let decision = self.decision(outcome, prepared.key.as_str(), Some(tx.began_at), tx.batch);
            tx.ran.decided.push((*index, decision));
            return Ok(Step::Ended);
        }
        Ok(Step::Next(Open { xid, new }))
    }

    /// The rows applied under the known keys (payload, result): they decide those
    /// deliveries, and later the repeats of their keys. The claim read most of them
    /// (`stored`); a row committed while the claim waited for it is read now.
    async fn read_applied(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        applied_before: Vec<Repeat>,
        mut stored: HashMap<String, Stored>,
    ) -> Result<(), Fault> {
        let unread: Vec<&str> = applied_before
            .iter()
            .map(|known| known.key.as_str())
            .filter(|key| !stored.contains_key(*key))
            .collect();
        if !unread.is_empty() {
            match self.bounded(db::stored_rows(conn, &self.scope, &unread)).await {
                Ok(read) => stored.extend(read),
                Err(err) => return Err(rollback(conn, infra(err)).await),
            }
        }
        // Gone since the insert found it (deleted by hand or by retention): the
        // next run decides again.
        if applied_before.iter().any(|known| !stored.contains_key(&known.key)) {
            return Err(rollback(conn, infra(diesel::result::Error::NotFound)).await);
        }
        tx.payloads = stored;
        self.resolve_repeats(tx, applied_before);
        Ok(())
    }

    /// The outbox rows (what the handlers published, a request's reply) and the
    /// stored results of the whole batch: one statement each. Returns whether it
    /// wrote outbox rows (the relay is woken after COMMIT).
    async fn write(&self, conn: &mut Conn, tx: &Tx<'_>, done: &[Done]) -> Result<bool, Fault> {
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
            self.bounded(db::insert_outbox(conn, &rows)).await?;
            self.bounded(db::store_results(conn, &self.scope, &results)).await
        };
        if let Err(err) = written.await {
            return Err(rollback(conn, infra(err)).await);
        }
        Ok(!rows.is_empty())
    }

    /// The checked COMMIT, bounded like idemq's other statements. Its fate unknown
    /// (a lost connection, no answer), the transaction is retried and the dedup rows
    /// decide; answered with an error, it was a rollback ([`Self::commit_failed`]).
    async fn commit(
        &self,
        conn: &mut Conn,
        mut tx: Tx<'_>,
        xid: i64,
        done: Vec<Done>,
        wrote_outbox: bool,
    ) -> Result<Ran, Fault> {
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
                if wrote_outbox {
                    self.shared.outbox.committed();
                }
                self.applied(&mut tx, done);
                Ok(tx.ran)
            }
            // COMMIT's fate is unknown: retry; the dedup rows decide.
            Err(CommitFailure::Unknown(err)) => Err(Fault::Infra(InfraFault::Commit(err))),
            Err(failure) => self.commit_failed(tx, done, failure),
        }
    }

    /// Committed: every handler that ran is applied, and the repeats of their keys
    /// follow.
    fn applied(&self, tx: &mut Tx<'_>, done: Vec<Done>) {
        for Done { index, key, fingerprint, output, took, .. } in done {
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
        mut tx: Tx<'_>,
        mut done: Vec<Done>,
        failure: CommitFailure,
    ) -> Result<Ran, Fault> {
        if done.len() > 1 {
            tracing::debug!(queue = %self.queue, ?failure, batch = tx.batch, "the batch's COMMIT failed; running it in halves");
            let indices: Vec<usize> = done.iter().map(|done| done.index).collect();
            tx.ran.next = split(&indices, verdict::halves(indices.len()), &tx.repeats);
            let contended = matches!(failure, CommitFailure::Refused { contention: true, .. });
            tx.ran.collided = contended.then_some(Collision::Unknown);
            return Ok(tx.ran);
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
        tx.ran.next = rerun_repeats(tx.repeats);
        Ok(tx.ran)
    }

    /// Decides the repeats of keys whose payload is known (applied by this
    /// transaction or before it); any other runs next. A duplicated request is
    /// answered with the stored result (or stored error).
    fn resolve_repeats(&self, tx: &mut Tx<'_>, repeats: Vec<Repeat>) {
        let mut unresolved = Vec::new();
        for repeat in repeats {
            match tx.payloads.get(&repeat.key) {
                Some(stored) => {
                    let outcome = verdict::already_applied(
                        &repeat.key,
                        stored.fingerprint.as_deref(),
                        &repeat.fingerprint,
                        self.on_conflict,
                    );
                    let mut decision = self.decision(outcome, &repeat.key, Some(tx.began_at), tx.batch);
                    if decision.outcome == Outcome::Duplicate {
                        if let Some(request) = Request::of(&tx.items[repeat.index].delivery.properties) {
                            let body = HandlerOutput::reply_body(stored.result.as_deref());
                            let id = self.reply_id(&repeat.key);
                            decision.reply = Some(Outgoing::reply(&request, id, body, !stored.failed));
                        }
                    }
                    tx.ran.decided.push((repeat.index, decision));
                }
                None => unresolved.push(repeat.index),
            }
        }
        if !unresolved.is_empty() {
            tx.ran.next.push(unresolved);
        }
    }

    pub(super) fn decision(
        &self,
        outcome: Outcome,
        key: &str,
        began_at: Option<Instant>,
        batch: usize,
    ) -> Decision {
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
    pub(super) fn reply_id(&self, key: &str) -> String {
        outgoing::message_id(&self.scope, key, "reply")
    }
}

/// A message whose handler ran to `Ok` in the open transaction (for a batch
/// handler: each message of the call, with its own output and published messages).
pub(super) struct Done {
    pub(super) index: usize,
    pub(super) key: crate::handler::key::Key,
    pub(super) fingerprint: Fingerprint,
    pub(super) output: HandlerOutput,
    /// What it published, for the outbox.
    pub(super) published: Vec<Outgoing>,
    /// How long it ran (a batch handler: the whole call, for each message).
    pub(super) took: Duration,
}

/// A delivery whose key an earlier one of its batch holds: decided by that one's fate.
pub(super) struct Repeat {
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
pub(super) fn split(
    indices: &[usize],
    ranges: Vec<std::ops::Range<usize>>,
    repeats: &[Repeat],
) -> Vec<Vec<usize>> {
    let mut parts: Vec<Vec<usize>> = ranges.into_iter().map(|range| indices[range].to_vec()).collect();
    if let Some(last) = parts.last_mut() {
        last.extend(repeats.iter().map(|repeat| repeat.index));
    }
    parts
}

/// The repeats of keys whose first delivery was decided without being applied: run
/// next, as new messages (per-message mode would run them after it, too).
pub(super) fn rerun_repeats(repeats: Vec<Repeat>) -> Vec<Vec<usize>> {
    if repeats.is_empty() {
        Vec::new()
    } else {
        vec![repeats.into_iter().map(|repeat| repeat.index).collect()]
    }
}
