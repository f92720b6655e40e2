//! What the stages of one run share (see `life`): the run's [`Tx`] — the
//! deliveries, what is decided so far and what runs next ([`Ran`]) — the [`Step`]
//! each stage ends with, the messages whose handlers ran ([`Done`]) and the
//! deliveries waiting for an earlier one of their key ([`Repeat`]); and how a
//! decision is made from them.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::contention::Collision;
use super::faults::{Fault, InfraFault};
use super::{Consumer, Decision, Delivered};
use crate::base::outcome::Outcome;
use crate::base::outgoing::{self, Outgoing, Request};
use crate::base::verdict;
use crate::handler::context::{HandlerOutput, SagaRecord};
use crate::handler::key::Key;
use crate::handler::prepare::{Fingerprint, Prepared};
use crate::handler::HandlerError;
use crate::store::db::Stored;

/// Where a stage of a run leads.
pub(super) enum Step<T> {
    /// On to the next stage, with what it needs.
    Next(T),
    /// The run ends here: its decisions and the parts to run next are in [`Tx::ran`].
    Ended,
}

/// What one run of part of a batch settled: decisions, and parts to run next (in
/// order, before anything else of the batch).
#[derive(Default)]
pub(super) struct Ran {
    pub(super) decided: Vec<(usize, Decision)>,
    pub(super) next: Vec<Vec<usize>>,
    /// It was split because its transaction collided with another (a lock wait, a
    /// deadlock, a serialization failure), and where: the consumer's batches should
    /// shrink, and the warning says what to do about it.
    pub(super) collided: Option<Collision>,
}

/// What the stages of one run share.
pub(super) struct Tx<'a> {
    pub(super) items: &'a [Delivered],
    /// Whether the handler keeps dedup rows (without them every delivery runs).
    pub(super) dedup: bool,
    /// Deliveries in the transaction (each decision's `batch`; set by the claim).
    pub(super) batch: usize,
    /// When the transaction began (set by the claim).
    pub(super) began_at: Instant,
    /// Deliveries whose key an earlier one of the batch holds: decided by its fate.
    pub(super) repeats: Vec<Repeat>,
    /// The rows applied under each key (payload, result), for the repeats.
    pub(super) payloads: HashMap<String, Stored>,
    /// What the run decided so far, and what runs next.
    pub(super) ran: Ran,
}

impl<'a> Tx<'a> {
    pub(super) fn new(items: &'a [Delivered], dedup: bool) -> Self {
        Self {
            items,
            dedup,
            batch: 0,
            began_at: Instant::now(),
            repeats: Vec::new(),
            payloads: HashMap::new(),
            ran: Ran::default(),
        }
    }

    /// The transaction begins with `runnable`: the same key twice, the first is run,
    /// the others wait for its fate. (A handler without dedup rows runs every
    /// delivery.) Returns the firsts.
    pub(super) fn begin(&mut self, runnable: Vec<(usize, Prepared)>) -> Vec<(usize, Prepared)> {
        self.batch = runnable.len();
        self.began_at = Instant::now();
        let dedup = self.dedup;
        let mut seen = HashSet::new();
        let (firsts, repeats): (Vec<_>, Vec<_>) = runnable
            .into_iter()
            .partition(|(_, prepared)| !dedup || seen.insert(prepared.key.as_str().to_owned()));
        self.repeats = repeats.into_iter().map(Repeat::from).collect();
        firsts
    }
}

/// A message whose handler ran to `Ok` in the open transaction (for a batch
/// handler: each message of the call, with its own output and published messages).
pub(super) struct Done {
    pub(super) index: usize,
    pub(super) key: Key,
    pub(super) fingerprint: Fingerprint,
    pub(super) output: HandlerOutput,
    /// What it published, for the outbox.
    pub(super) published: Vec<Outgoing>,
    /// How long it ran (a batch handler: the whole call, for each message).
    pub(super) took: Duration,
    /// What it did to its saga, if it is a saga's step.
    pub(super) saga: Option<SagaRecord>,
}

/// A delivery whose key an earlier one of its batch holds: decided by that one's fate.
pub(super) struct Repeat {
    pub(super) index: usize,
    pub(super) key: String,
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

/// A statement of idemq's own failed: nothing is decided (see [`Consumer::diagnose`]).
pub(super) fn infra(err: diesel::result::Error) -> Fault {
    Fault::Infra(InfraFault::Database(err))
}

impl Consumer {
    /// Decides the repeats of keys whose payload is known (applied by this
    /// transaction or before it); any other runs next. A duplicated request is
    /// answered with the stored result (or stored error).
    pub(super) fn resolve_repeats(&self, tx: &mut Tx<'_>, repeats: Vec<Repeat>) {
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

    /// The outcome of a failed attempt (`attempt` of the message): a retry while
    /// attempts are left and the error is transient, else a dead letter.
    pub(super) fn handler_failed(&self, error: HandlerError, attempt: u32) -> Outcome {
        verdict::handler_failed(error.class(), error.to_string(), attempt, &self.retry)
    }

    /// The message id of the reply to the request with `key` (every copy of it).
    pub(super) fn reply_id(&self, key: &str) -> String {
        outgoing::message_id(&self.scope, key, "reply")
    }
}
