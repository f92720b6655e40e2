//! How the kit waits for its deliveries, and what it says when they do not end as
//! its helper expects: [`Settlements`].
//!
//! A helper publishes its messages, then waits until as many deliveries have
//! settled. It gives up at once — not after [`SETTLE_TIMEOUT`] — when a delivery
//! ended in a way the helper cannot go on from ([`Expect`]), or when the kit's
//! runtime stopped; and its panic names what happened: each delivery settled so
//! far, with its handler, its outcome and, for a dead letter, its `x-idemq-error`;
//! the kit's handlers with the type and versions each reads; and, for a bare
//! message a typed or versioned handler misread, how to send it typed.

use idemq_core::__private::sibling;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use idemq_core::__private::sibling::human;
use idemq_core::Handler;
use idemq_core::{observe::Settled, FailureKind, Outcome};

/// How long a delivery may take to settle before the kit gives up.
pub(super) const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// What a handler of the kit reads from the wire, for what the kit reports.
#[derive(Debug, Clone)]
pub(super) struct HandlerWire {
    name: &'static str,
    /// Its message type's name (the AMQP `type` it takes), if it has one.
    type_name: Option<&'static str>,
    /// The oldest and newest versions it reads, if its type is versioned.
    versions: Option<(u32, u32)>,
}

impl HandlerWire {
    pub(super) fn of<H: Handler>(handler: &H) -> Self {
        let (type_name, versions) = sibling::wire_of(&handler.wire());
        Self { name: handler.name(), type_name, versions }
    }

    /// The handler's name.
    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self) -> String {
        let mut reads = Vec::new();
        if let Some(name) = self.type_name {
            reads.push(format!("type {name}"));
        }
        match self.versions {
            Some((oldest, newest)) if oldest == newest => reads.push(format!("version {newest}")),
            Some((oldest, newest)) => reads.push(format!("versions {oldest} to {newest}")),
            None => {}
        }
        if reads.is_empty() {
            format!("`{}` (untyped, unversioned)", self.name)
        } else {
            format!("`{}` ({})", self.name, reads.join(", "))
        }
    }
}

/// What a helper expects of its deliveries besides their number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    /// Any outcome: the helper returns them.
    Settled,
    /// The first applied (its ack is then lost, and it comes again):
    /// [`TestKit::crash_after_commit`](super::TestKit::crash_after_commit).
    FirstApplied,
}

/// One wait of a helper: what it sent and what it waits for.
pub(super) struct Waiting<'a> {
    /// The helper's name, as the test calls it.
    pub(super) helper: &'static str,
    /// How many deliveries had settled before it published.
    pub(super) before: usize,
    /// How many it waits for.
    pub(super) count: usize,
    pub(super) expect: Expect,
    /// Whether any of its messages went without a type and a version header.
    pub(super) sent_bare: bool,
    /// The kit's queue and handlers.
    pub(super) queue: &'a str,
    pub(super) handlers: &'a [HandlerWire],
}

/// Every delivery the kit's runtime settled, in order, and how the runtime ended if
/// it did. Shared with the runtime's observer and the task that runs it.
#[derive(Debug, Clone, Default)]
pub(super) struct Settlements {
    settled: Arc<Mutex<Vec<Settled>>>,
    ended: Arc<Mutex<Option<String>>>,
}

impl Settlements {
    /// A delivery settled (the runtime's observer).
    pub(super) fn push(&self, settled: &Settled) {
        self.settled.lock().unwrap_or_else(PoisonError::into_inner).push(settled.clone());
    }

    /// The runtime stopped, `how`.
    pub(super) fn runtime_ended(&self, how: String) {
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) = Some(how);
    }

    /// Every delivery settled so far.
    pub(super) fn all(&self) -> Vec<Settled> {
        self.settled.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(super) fn len(&self) -> usize {
        self.settled.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn since(&self, before: usize) -> Vec<Settled> {
        let settled = self.settled.lock().unwrap_or_else(PoisonError::into_inner);
        settled.get(before..).map(<[Settled]>::to_vec).unwrap_or_default()
    }

    fn ended(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Waits until `waiting.count` deliveries settled after `waiting.before`, and
    /// returns them. `Err`: what happened instead, to panic with — a delivery the
    /// helper cannot go on from (at once), the runtime stopped (at once), or not
    /// enough settled within [`SETTLE_TIMEOUT`].
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub(super) async fn wait(&self, waiting: &Waiting<'_>) -> Result<Vec<Settled>, String> {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            let so_far = self.since(waiting.before);
            if let Some(instead) = unexpected(waiting.expect, &so_far) {
                return Err(report(waiting, &so_far, &instead));
            }
            if so_far.len() >= waiting.count {
                let settled = so_far[..waiting.count].to_vec();
                if let Some(hint) = hint(waiting, &settled) {
                    // Not a failure (the test may expect the dead letter), but worth
                    // seeing if it did not: the test harness shows it with a failure.
                    eprintln!("idemq test kit: {hint}");
                }
                return Ok(settled);
            }
            if let Some(how) = self.ended() {
                let instead = format!("the kit's runtime stopped before they settled: {how}");
                return Err(report(waiting, &so_far, &instead));
            }
            if Instant::now() >= deadline {
                let instead = format!(
                    "only {} of {} deliveries settled within {}",
                    so_far.len(),
                    waiting.count,
                    human(SETTLE_TIMEOUT)
                );
                return Err(report(waiting, &so_far, &instead));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// How the deliveries so far break `expect`, if they do.
fn unexpected(expect: Expect, so_far: &[Settled]) -> Option<String> {
    match (expect, so_far.first()) {
        (Expect::FirstApplied, Some(first)) if first.outcome != Outcome::Applied => Some(format!(
            "its delivery was not applied, so no COMMIT had an ack to lose (it must be a message the \
             handler has not applied yet): it was {}",
            outcome(&first.outcome)
        )),
        _ => None,
    }
}

/// The panic message: what the helper waited for, what happened instead, every
/// delivery settled so far, the kit's handlers, and the hint if there is one.
fn report(waiting: &Waiting<'_>, so_far: &[Settled], instead: &str) -> String {
    let mut text = format!("idemq test kit: {}: {instead}\n", waiting.helper);
    if so_far.is_empty() {
        text.push_str("no delivery settled since it published\n");
    } else {
        text.push_str(&format!("settled since it published ({} of {}):\n", so_far.len(), waiting.count));
        for (n, settled) in so_far.iter().enumerate() {
            text.push_str(&format!("  {}. {}\n", n + 1, describe(settled)));
        }
    }
    let handlers: Vec<String> = waiting.handlers.iter().map(HandlerWire::describe).collect();
    text.push_str(&format!("the kit's handlers on queue {}: {}", waiting.queue, handlers.join(", ")));
    if let Some(hint) = hint(waiting, so_far) {
        text.push_str(&format!("\nhint: {hint}"));
    }
    text
}

/// One settled delivery: its handler, its outcome, and whether its ack was sent.
pub(super) fn describe(settled: &Settled) -> String {
    let ack = if settled.settled_with_broker { "" } else { " (its ack was not sent: the channel was gone)" };
    format!("`{}`: {}{ack}", settled.handler, outcome(&settled.outcome))
}

/// An outcome in words, with its error (for a dead letter, its `x-idemq-error`).
fn outcome(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Applied => "applied".to_owned(),
        Outcome::Duplicate => "a duplicate (its dedup row was there: the handler did not run)".to_owned(),
        Outcome::AlreadyCopied { copy_id } => format!("already copied (copy {copy_id})"),
        Outcome::Retry { error, delay } => format!("retried, in {}: {error}", human(*delay)),
        Outcome::Requeued { error } => format!("requeued: {error}"),
        Outcome::DeadLettered { kind, error } => {
            format!("dead-lettered (x-idemq-error-kind: {kind}; x-idemq-error: {error})")
        }
        Outcome::Paused => {
            "paused (its handler's kill switch is open: it returns to the queue unprocessed)".to_owned()
        }
        Outcome::Abandoned => "abandoned (cut off before it settled: it returns to the queue)".to_owned(),
        // `Outcome` is `non_exhaustive` outside idemq-core: a new one reads as its Debug.
        other => format!("{other:?}"),
    }
}

/// How to send a message typed, when one sent bare was dead-lettered the way a
/// typed or versioned handler dead-letters a bare message.
fn hint(waiting: &Waiting<'_>, settled: &[Settled]) -> Option<String> {
    if !waiting.sent_bare {
        return None;
    }
    let misread = settled.iter().any(|s| {
        matches!(
            s.outcome,
            Outcome::DeadLettered {
                kind: FailureKind::Decode | FailureKind::UnroutableType | FailureKind::UnknownVersion,
                ..
            }
        )
    });
    let typed: Vec<String> = waiting
        .handlers
        .iter()
        .filter(|h| h.type_name.is_some() || h.versions.is_some())
        .map(HandlerWire::describe)
        .collect();
    if !misread || typed.is_empty() {
        return None;
    }
    Some(format!(
        "a message was sent bare (JSON with no AMQP type and no x-idemq-version header: a versioned \
         handler reads it as version 1, a queue of several typed handlers cannot route it) and was \
         dead-lettered; the kit's handlers read {}. Deliver `TestMessage::of(&message)` or call \
         `kit.send(&message)` to send an idemq::Message as Publisher::send does, or set them with \
         `TestMessage::json(&message).message_type(..).version(..)`",
        typed.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settled(handler: &'static str, outcome: Outcome) -> Settled {
        idemq_core::__private::sibling::settled(handler, outcome)
    }

    fn waiting<'a>(handlers: &'a [HandlerWire], sent_bare: bool) -> Waiting<'a> {
        Waiting {
            helper: "crash_after_commit",
            before: 0,
            count: 2,
            expect: Expect::FirstApplied,
            sent_bare,
            queue: "idemq-kit-1",
            handlers,
        }
    }

    #[test]
    fn a_report_names_each_outcome_its_error_and_the_handlers() {
        let handlers =
            [HandlerWire { name: "pay", type_name: Some("payment.requested"), versions: Some((1, 2)) }];
        let dead = Outcome::DeadLettered {
            kind: FailureKind::Decode,
            error: "the body is not a valid V1 message (version 1): missing field `amount`".into(),
        };
        let so_far = [settled("pay", dead)];
        let instead = unexpected(Expect::FirstApplied, &so_far).expect("not applied");
        let text = report(&waiting(&handlers, true), &so_far, &instead);
        for part in [
            "crash_after_commit: its delivery was not applied",
            "1. `pay`: dead-lettered (x-idemq-error-kind: decode; x-idemq-error: the body is not a valid V1",
            "(1 of 2)",
            "`pay` (type payment.requested, versions 1 to 2)",
            "hint: a message was sent bare",
            "TestMessage::of(&message)",
        ] {
            assert!(text.contains(part), "{part:?} missing from:\n{text}");
        }
    }

    #[test]
    fn no_hint_for_a_typed_message_or_untyped_handlers() {
        let dead = Outcome::DeadLettered { kind: FailureKind::Decode, error: "bad".into() };
        let so_far = [settled("pay", dead)];
        let typed = [HandlerWire { name: "pay", type_name: Some("payment.requested"), versions: None }];
        assert!(hint(&waiting(&typed, false), &so_far).is_none(), "sent typed");
        let plain = [HandlerWire { name: "pay", type_name: None, versions: None }];
        assert!(hint(&waiting(&plain, true), &so_far).is_none(), "no handler reads a type");
        assert!(hint(&waiting(&typed, true), &[settled("pay", Outcome::Applied)]).is_none(), "applied");
    }

    #[test]
    fn an_applied_first_delivery_is_what_crash_after_commit_expects() {
        assert_eq!(unexpected(Expect::FirstApplied, &[settled("pay", Outcome::Applied)]), None);
        assert_eq!(unexpected(Expect::FirstApplied, &[]), None);
        let duplicate = unexpected(Expect::FirstApplied, &[settled("pay", Outcome::Duplicate)]);
        assert!(duplicate.is_some_and(|d| d.contains("a duplicate")));
        assert_eq!(unexpected(Expect::Settled, &[settled("pay", Outcome::Duplicate)]), None);
    }
}
