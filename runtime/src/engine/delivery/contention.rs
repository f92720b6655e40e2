//! When batches collide: where a batch's transaction collided with another (its
//! dedup rows, a handler's rows, or where the runtime cannot tell), counted per
//! consumer and said at most once a minute for each cause, with advice that fits it.
//! (The batch itself is split and run again smaller: see `life`.)

use std::time::{Duration, Instant};

use super::Consumer;

/// Where a batch's transaction collided with another, as far as the runtime can
/// tell from the stage that was refused (see [`Consumer::collided`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Collision {
    /// Its dedup insert (the claim: idemq's statement, on idemq's table only): it
    /// waited on another transaction's dedup row of one of its keys, so a copy of
    /// one of its messages was in that transaction (or the table itself was locked).
    DedupRows,
    /// A handler's statement: on the rows the handler writes or locks.
    HandlerRows,
    /// Where the runtime cannot tell: COMMIT (a serialization failure, a deadlock in
    /// deferred checks), whose error names no rows.
    Unknown,
}

/// How often at most a consumer warns that its batches collide (for each
/// [`Collision`]: one cause's warnings never hide another's).
const COLLISION_WARNING_EVERY: Duration = Duration::from_secs(60);

/// A consumer's batches that collided since it last warned about them, by where
/// they collided.
#[derive(Debug, Default)]
pub(crate) struct Collisions(std::sync::Mutex<[CollisionCount; 3]>); // one per `Collision`

#[derive(Debug, Default)]
struct CollisionCount {
    since_warning: u64,
    warned_at: Option<Instant>,
}

impl Collisions {
    /// Counts one batch collided `on`; `Some(n)` when a warning of it is due, with
    /// the collisions it reports (this one included).
    fn note(&self, on: Collision, now: Instant) -> Option<u64> {
        let mut counts = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = &mut counts[on as usize];
        count.since_warning += 1;
        let due = count.warned_at.is_none_or(|at| now.duration_since(at) >= COLLISION_WARNING_EVERY);
        due.then(|| {
            count.warned_at = Some(now);
            std::mem::take(&mut count.since_warning)
        })
    }
}

impl Consumer {
    /// A batch collided with another transaction `on` (the width has narrowed):
    /// says so, at most every [`COLLISION_WARNING_EVERY`] for each cause, with
    /// [`advice`] (the metric `idemq_contended_batches_total` counts every collision).
    pub(super) fn collided(&self, on: Collision) {
        let Some(collisions) = self.collisions.note(on, Instant::now()) else { return };
        let (width, lane) = (self.width.current(), self.handler.lane_path());
        match advice(on, lane, width) {
            (Level::Harmless, advice) => {
                crate::base::log::info!(queue = %self.queue, collisions, width, lane, "{advice}")
            }
            (Level::Warning, advice) => {
                crate::base::log::warn!(queue = %self.queue, collisions, width, lane, "{advice}")
            }
        }
    }
}

/// How loud a collision's line is.
#[derive(Debug, PartialEq, Eq)]
enum Level {
    /// Nothing to change (INFO).
    Harmless,
    /// The handler could do better (WARN).
    Warning,
}

/// What a consumer says of batches that collided `on`, its handler's lane path
/// `lane`, its width now `width`. On the handler's rows: idemq cannot know which rows
/// a handler locks, so it cannot order them for the handler; a lane can. On the dedup
/// rows: copies of one key raced, which the unique index settles — no lane is
/// needed, and the line must not ask for one. Where the runtime cannot tell, it says
/// so, and advises a lane only for messages that do share rows.
fn advice(on: Collision, lane: Option<&str>, width: usize) -> (Level, String) {
    match (on, lane) {
        (Collision::DedupRows, _) => (
            Level::Harmless,
            format!(
                "batches of this queue's handler waited on each other's dedup rows: copies of one \
                 message (the same key: a redelivery, a publisher's retry, a message published twice) \
                 were in two transactions at once (or something locked the table idemq_dedup). \
                 Harmless: the unique index on the dedup rows lets one copy apply, and the other is \
                 settled as a duplicate once its batch has run again smaller; the consumer now runs at \
                 most {width} batch(es) at once. No lane is needed for this; many such lines mean many \
                 copies arrive together"
            ),
        ),
        (Collision::HandlerRows, None) => (
            Level::Warning,
            format!(
                "batches of this queue's handler collide on row locks (lock waits past the batch limit, \
                 deadlocks): each collision rolls a batch back and runs it again smaller, and the \
                 consumer now runs at most {width} batch(es) at once. If its messages update shared rows \
                 (an account's balance), give the handler a lane on what they share \
                 (`#[idempotent_handler(key = \"..\", lane = \"account\")]`): a lane never runs two \
                 of its messages at once"
            ),
        ),
        (Collision::HandlerRows, Some(lane)) => (
            Level::Warning,
            format!(
                "batches of this queue's handler collide on row locks although it has a lane: its \
                 messages share rows across lanes (rows that `{lane}` does not identify). Make the lane \
                 what they share, or lock the rows in one order (sort them) in the handler"
            ),
        ),
        (Collision::Unknown, lane) => (
            Level::Warning,
            format!(
                "batches of this queue's handler were rolled back for contention where idemq cannot \
                 tell on which rows (at COMMIT: a serialization failure, or a deadlock in deferred \
                 checks): each such batch runs again smaller, and the consumer now runs at most {width} \
                 batch(es) at once. If its messages update shared rows{}, a lane on what they share \
                 keeps them apart (`#[idempotent_handler(key = \"..\", lane = \"account\")]`)",
                lane.map(|lane| format!(" that `{lane}` does not identify")).unwrap_or_default()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{advice, Collision, Collisions, Level, COLLISION_WARNING_EVERY};

    #[test]
    fn collisions_are_reported_at_once_then_at_most_once_a_minute_with_their_count() {
        let collisions = Collisions::default();
        let start = Instant::now();
        let note = |at| collisions.note(Collision::HandlerRows, at);
        assert_eq!(note(start), Some(1), "the first is reported at once");
        assert_eq!(note(start + Duration::from_secs(1)), None);
        assert_eq!(note(start + Duration::from_secs(30)), None);
        assert_eq!(note(start + COLLISION_WARNING_EVERY), Some(3), "the count since the last");
        assert_eq!(note(start + COLLISION_WARNING_EVERY), None);
    }

    #[test]
    fn each_cause_of_collisions_is_reported_on_its_own() {
        let collisions = Collisions::default();
        let start = Instant::now();
        assert_eq!(collisions.note(Collision::DedupRows, start), Some(1));
        assert_eq!(collisions.note(Collision::HandlerRows, start), Some(1), "not hidden by the other");
        assert_eq!(collisions.note(Collision::Unknown, start), Some(1));
        assert_eq!(collisions.note(Collision::DedupRows, start), None);
    }

    #[test]
    fn copies_racing_on_the_dedup_rows_are_harmless_and_want_no_lane() {
        for lane in [None, Some("account")] {
            let (level, said) = advice(Collision::DedupRows, lane, 4);
            assert_eq!(level, Level::Harmless);
            assert!(said.contains("copies of one message") && said.contains("Harmless"), "{said}");
            assert!(said.contains("No lane is needed") && !said.contains("lane = "), "{said}");
        }
    }

    #[test]
    fn collisions_on_the_handlers_rows_ask_for_a_lane_and_unknown_ones_say_so() {
        let (level, said) = advice(Collision::HandlerRows, None, 2);
        assert_eq!(level, Level::Warning);
        assert!(said.contains("give the handler a lane") && said.contains("at most 2 batch"), "{said}");
        let (_, said) = advice(Collision::HandlerRows, Some("account"), 2);
        assert!(said.contains("although it has a lane") && said.contains("`account`"), "{said}");
        let (level, said) = advice(Collision::Unknown, None, 2);
        assert_eq!(level, Level::Warning);
        assert!(said.contains("cannot tell") && !said.contains("copies"), "{said}");
        assert!(said.contains("If its messages update shared rows"), "a lane only if they do: {said}");
    }
}
