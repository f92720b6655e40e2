//! Pure decisions, no I/O: what a delivery's outcome is, given what its transaction
//! found and what its handler did; and how a batch that cannot decide its deliveries
//! together is re-run. Everything here is unit-tested without services.

use std::ops::Range;

use crate::base::hex;
use crate::base::outcome::{FailureKind, Outcome};
use crate::base::retry::RetryPolicy;

/// What to do with a known key that arrives with a different payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnConflict {
    /// Dead-letter it (kind `conflict`): reusing a key for another payload is a
    /// client bug, the idempotency-key rule.
    #[default]
    DeadLetter,
    /// Ack it as a duplicate and log a warning.
    Ignore,
}

/// Whether a failed attempt may succeed later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// Retry later (the default for any error returned with `?`).
    Transient,
    /// Retrying cannot help: dead-letter now.
    Permanent,
}

/// A handler's failed attempt number `attempt`: retried later while the policy
/// allows, else dead-lettered; a permanent error is dead-lettered at once.
pub(crate) fn handler_failed(class: ErrorClass, error: String, attempt: u32, retry: &RetryPolicy) -> Outcome {
    match class {
        ErrorClass::Permanent => Outcome::DeadLettered { kind: FailureKind::Handler, error },
        ErrorClass::Transient => match retry.delay_after(attempt) {
            Some(delay) => Outcome::Retry { error, delay },
            None => Outcome::DeadLettered {
                kind: FailureKind::AttemptsExhausted,
                error: format!("failed {attempt} of {} attempts; last error: {error}", retry.max_attempts()),
            },
        },
    }
}

/// A message whose key was applied before, with `stored` as the applied payload's
/// fingerprint (`None` for rows stored without one): a duplicate, unless the payload
/// differs and conflicts are dead-lettered.
pub(crate) fn already_applied(
    key: &str,
    stored: Option<&[u8]>,
    fingerprint: &[u8],
    on_conflict: OnConflict,
) -> Outcome {
    match stored {
        Some(stored) if stored != fingerprint && on_conflict == OnConflict::DeadLetter => {
            Outcome::DeadLettered {
                kind: FailureKind::Conflict,
                error: format!(
                    "key `{key}` was already applied with a different payload \
                 (stored sha256 {}, this message sha256 {}); a key must identify one payload",
                    hex(stored),
                    hex(fingerprint)
                ),
            }
        }
        _ => Outcome::Duplicate,
    }
}

/// A redelivered message whose handler started `starts` times (this one included)
/// without an outcome: poison once that reaches the queue's delivery limit.
pub(crate) fn poison(starts: i32, delivery_limit: u32) -> Option<Outcome> {
    (u32::try_from(starts).unwrap_or(0) >= delivery_limit).then(|| Outcome::DeadLettered {
        kind: FailureKind::Poison,
        error: format!(
            "its handler started {starts} times without an outcome (limit {delivery_limit}): \
             it likely crashes or hangs the consumer"
        ),
    })
}

/// How a batch of `len` deliveries whose handler at `failed` failed (returned an
/// error, panicked, timed out) is run again: the ones before it together, it alone
/// (only a delivery run alone is ever charged an attempt: its failure may have been
/// a neighbour's lock or an aborted transaction), the ones after it together. In
/// order, so a lane's order holds.
pub(crate) fn around(len: usize, failed: usize) -> Vec<Range<usize>> {
    debug_assert!(failed < len);
    [0..failed, failed..failed + 1, failed + 1..len].into_iter().filter(|r| !r.is_empty()).collect()
}

/// How a batch of `len` (≥ 2) deliveries that failed together without naming one
/// (a refused COMMIT, an aborted transaction, a lock timeout in idemq's own insert)
/// is run again: in two halves, in order. Repeated, a failure that belongs to one
/// delivery ends with that delivery alone, after about log₂(len) re-runs.
pub(crate) fn halves(len: usize) -> Vec<Range<usize>> {
    debug_assert!(len >= 2);
    let mid = len / 2;
    vec![0..mid, mid..len]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy::new([Duration::from_millis(10), Duration::from_millis(20)]).without_jitter()
    }

    #[test]
    fn a_transient_failure_is_retried_until_the_attempts_run_out() {
        let retry = policy();
        let first = handler_failed(ErrorClass::Transient, "boom".into(), 1, &retry);
        assert_eq!(first, Outcome::Retry { error: "boom".into(), delay: Duration::from_millis(10) });
        let last = handler_failed(ErrorClass::Transient, "boom".into(), 3, &retry);
        assert!(
            matches!(&last, Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, error } if error.contains("failed 3 of 3 attempts; last error: boom")),
            "{last:?}"
        );
    }

    #[test]
    fn a_permanent_failure_is_dead_lettered_on_its_first_attempt() {
        let outcome = handler_failed(ErrorClass::Permanent, "bad".into(), 1, &policy());
        assert_eq!(outcome, Outcome::DeadLettered { kind: FailureKind::Handler, error: "bad".into() });
    }

    #[test]
    fn a_known_key_with_the_same_payload_is_a_duplicate_and_with_another_a_conflict() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(already_applied("k", Some(&a), &a, OnConflict::DeadLetter), Outcome::Duplicate);
        assert!(matches!(
            already_applied("k", Some(&a), &b, OnConflict::DeadLetter),
            Outcome::DeadLettered { kind: FailureKind::Conflict, .. }
        ));
        assert_eq!(already_applied("k", Some(&a), &b, OnConflict::Ignore), Outcome::Duplicate);
        // A row stored without a fingerprint (an older idemq) cannot conflict.
        assert_eq!(already_applied("k", None, &b, OnConflict::DeadLetter), Outcome::Duplicate);
    }

    #[test]
    fn poison_is_a_start_count_at_the_delivery_limit() {
        assert_eq!(poison(2, 3), None);
        assert!(matches!(poison(3, 3), Some(Outcome::DeadLettered { kind: FailureKind::Poison, .. })));
    }

    #[test]
    fn a_failed_handler_is_re_run_alone_between_its_neighbours_in_order() {
        assert_eq!(around(5, 2), vec![0..2, 2..3, 3..5]);
        assert_eq!(around(5, 0), vec![0..1, 1..5]);
        assert_eq!(around(5, 4), vec![0..4, 4..5]);
        assert_eq!(around(1, 0), vec![0..1]);
    }

    #[test]
    fn a_batch_failing_as_a_whole_is_halved_until_the_culprit_is_alone() {
        assert_eq!(halves(2), vec![0..1, 1..2]);
        assert_eq!(halves(5), vec![0..2, 2..5]);
        // Repeated halving reaches a single delivery within ceil(log2(len)) steps.
        let (mut len, mut steps) = (64, 0);
        while len > 1 {
            len = halves(len).into_iter().map(|r| r.len()).max().unwrap_or(1);
            steps += 1;
        }
        assert_eq!(steps, 6);
    }
}
