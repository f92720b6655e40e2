//! The claim: BEGIN and the dedup rows of a run's deliveries, inserted where
//! absent, in one statement (one round trip) — then what the rows say. A key
//! inserted is new: its handler runs (`handlers`). A key applied before decides its
//! delivery by the stored row (a duplicate, or a conflict when the payload differs).
//! With nothing new, or for poison (a message run alone that has started
//! `delivery_limit` times), the transaction is rolled back and the run ends.

use std::collections::HashMap;

use diesel_async::pooled_connection::PoolableConnection;
use diesel_async::{AnsiTransactionManager, TransactionManager};

use super::contention::Collision;
use super::faults::{rollback, Fault};
use super::tx::{infra, split, Repeat, Step, Tx};
use super::Consumer;
use crate::base::verdict;
use crate::handler::prepare::Prepared;
use crate::store::db::{self, Conn, Stored};

/// The dedup rows are claimed and the transaction is open.
pub(super) struct Claimed {
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
pub(super) struct Open {
    /// The transaction's id, for the checked COMMIT.
    pub(super) xid: i64,
    pub(super) new: Vec<(usize, Prepared)>,
}

impl Consumer {
    /// BEGIN and the dedup rows of the first delivery of each key (the others wait
    /// for its fate, see [`Tx::begin`]), in one statement: the keys it inserted are
    /// new, the others were applied before. A batch whose insert is refused with the
    /// connection up runs in halves.
    pub(super) async fn claim(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        runnable: Vec<(usize, Prepared)>,
    ) -> Result<Step<Claimed>, Fault> {
        let firsts = tx.begin(runnable);
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
                    crate::base::log::debug!(queue = %self.queue, error = %err, batch = tx.batch, "the batch's dedup insert failed; running it in halves");
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
    pub(super) async fn open(
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
}
