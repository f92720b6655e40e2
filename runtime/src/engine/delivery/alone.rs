//! A redelivered message runs alone: it may be what crashed the last consumer. It
//! takes its turn with nothing else of this process running beside it ([`Turn`]);
//! it is acked at once if its copy (retry or dead letter) was confirmed before; else
//! its start is counted, committed before its handler runs, so that a crash is
//! charged to it and the claim can dead-letter it as poison once its starts reach
//! the delivery limit.

use tokio::sync::{RwLockReadGuard, RwLockWriteGuard};

use super::decode::Decoded;
use super::faults::Fault;
use super::tx::{infra, Step, Tx};
use super::{Consumer, Decision, Delivered};
use crate::base::outcome::Outcome;
use crate::handler::prepare::Prepared;
use crate::store::db::{self, Conn};

/// A batch's place beside the others: alone (it holds a redelivered message) or
/// shared. Held while the batch is decided.
pub(super) enum Turn<'a> {
    Alone(#[allow(dead_code)] RwLockWriteGuard<'a, ()>),
    Shared(#[allow(dead_code)] RwLockReadGuard<'a, ()>),
}

impl Consumer {
    /// Waits for the batch's turn: alone if any of `items` is redelivered.
    pub(super) async fn turn(&self, items: &[Delivered]) -> Turn<'_> {
        if items.iter().any(Delivered::runs_alone) {
            Turn::Alone(self.shared.turns.write().await)
        } else {
            Turn::Shared(self.shared.turns.read().await)
        }
    }

    /// The message at `index`, alone: decided here if its copy was confirmed
    /// before (acked) or it did not decode (dead-lettered); else on to the claim
    /// with the number of times it started, this time included. `marked` keeps that
    /// number across in-process retries of the run (a start is counted once).
    pub(super) async fn alone(
        &self,
        conn: &mut Conn,
        tx: &mut Tx<'_>,
        index: usize,
        decoded: Decoded,
        marked: &mut Option<i32>,
    ) -> Result<Step<((usize, Prepared), i32)>, Fault> {
        let item = &tx.items[index];
        let Decoded { mut runnable, rejected } = decoded;
        let prepared = runnable.pop().map(|(_, prepared)| prepared);
        let key = prepared.as_ref().map(|prepared| prepared.key.as_str());
        let copy_id = self.identity(item, key).copy_id(item.counts.attempt);
        if self.bounded(db::copy_recorded(conn, &copy_id)).await.map_err(infra)? {
            tx.ran.decided.push((index, Decision::new(Outcome::AlreadyCopied { copy_id })));
            return Ok(Step::Ended);
        }
        let Some(prepared) = prepared else {
            let rejection = rejected.expect("a message run alone is either decoded or rejected");
            let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
            tx.ran.decided.push((index, Decision::new(outcome)));
            return Ok(Step::Ended);
        };
        let starts = match *marked {
            Some(starts) => starts,
            None => {
                let starts = self
                    .bounded(db::mark_start(conn, &self.scope, prepared.key.as_str()))
                    .await
                    .map_err(infra)?;
                *marked = Some(starts);
                starts
            }
        };
        Ok(Step::Next(((index, prepared), starts)))
    }
}
