//! How a delivery ended, as reported to observers and counted in [`Stats`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Why a message was dead-lettered; the value of its `x-idemq-error-kind` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The body is not a valid message (not JSON, wrong shape or types, too deep).
    Decode,
    /// The key is missing, null, empty or holds a NUL byte.
    Key,
    /// The handler returned a permanent error.
    Handler,
    /// The handler failed on every allowed attempt.
    AttemptsExhausted,
    /// The key was already applied with a different payload.
    Conflict,
    /// The body is over the size limit.
    TooLarge,
    /// The content-type is not JSON.
    ContentType,
    /// The message's handler started too many times without an outcome (it crashes
    /// or hangs the consumer).
    Poison,
    /// On a queue consumed by several handlers, one for each message type: no
    /// handler takes the delivery's type (its AMQP `type`, else the routing key it
    /// was first published with).
    /// The type is in the dead letter's `x-idemq-message-type` header.
    UnroutableType,
    /// The message's version (its `x-idemq-version` header) is not one its
    /// handler's versioned type reads, or is not a number.
    UnknownVersion,
}

impl FailureKind {
    /// Every kind.
    pub const ALL: [Self; 10] = [
        Self::Decode,
        Self::Key,
        Self::Handler,
        Self::AttemptsExhausted,
        Self::Conflict,
        Self::TooLarge,
        Self::ContentType,
        Self::Poison,
        Self::UnroutableType,
        Self::UnknownVersion,
    ];

    /// The header value: `decode`, `key`, `handler`, `attempts-exhausted`, `conflict`,
    /// `too-large`, `content-type`, `poison`, `unroutable-type` or `unknown-version`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Key => "key",
            Self::Handler => "handler",
            Self::AttemptsExhausted => "attempts-exhausted",
            Self::Conflict => "conflict",
            Self::TooLarge => "too-large",
            Self::ContentType => "content-type",
            Self::Poison => "poison",
            Self::UnroutableType => "unroutable-type",
            Self::UnknownVersion => "unknown-version",
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the runtime decided for one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its transaction, with the dedup row, committed.
    Applied,
    /// The dedup row already existed: the handler was skipped.
    Duplicate,
    /// A redelivered original whose copy (retry or dead letter) the broker had
    /// already confirmed (the ack after it was lost): acked without running the
    /// handler, so the message keeps one lineage and at most one dead letter.
    AlreadyCopied {
        /// The copy's `x-idemq-copy-id`.
        copy_id: String,
    },
    /// The handler failed transiently: rolled back; a copy waits `delay` in a wait
    /// queue, then returns for the next attempt.
    Retry {
        /// The handler's error.
        error: String,
        /// How long until the next attempt.
        delay: std::time::Duration,
    },
    /// A retry or dead-letter copy could not be published: the delivery was returned
    /// to the queue (nack) instead, and will come again.
    Requeued {
        /// Why the copy failed.
        error: String,
    },
    /// Published to the dead-letter queue with the reason in its headers.
    DeadLettered {
        /// Why.
        kind: FailureKind,
        /// The error, as in `x-idemq-error`.
        error: String,
    },
    /// Returned to the queue unprocessed because its handler's kill switch is open
    /// (see [`RuntimeBuilder::kill_switch`](crate::RuntimeBuilder::kill_switch)): not an
    /// attempt.
    Paused,
    /// Cut off before it was settled — by the shutdown deadline, or because its
    /// channel closed while it waited: any open transaction is rolled back and the
    /// delivery returns to the queue.
    Abandoned,
}

impl Outcome {
    /// `applied`, `duplicate`, `already_copied`, `retried`, `requeued`,
    /// `dead_lettered`, `paused` or `abandoned` (the `outcome` label of the metrics).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Duplicate => "duplicate",
            Self::AlreadyCopied { .. } => "already_copied",
            Self::Retry { .. } => "retried",
            Self::Requeued { .. } => "requeued",
            Self::DeadLettered { .. } => "dead_lettered",
            Self::Paused => "paused",
            Self::Abandoned => "abandoned",
        }
    }
}

/// One settled delivery, as handed to an [observer](crate::RuntimeBuilder::observe).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled {
    /// The queue it came from.
    pub queue: String,
    /// The handler's name.
    pub handler: &'static str,
    /// The stored dedup key, when the message got that far.
    pub key: Option<String>,
    /// How it ended.
    pub outcome: Outcome,
    /// Whether the broker was told (ack, nack or reject) and the frame was sent.
    /// `false` means the channel was gone: the broker will redeliver. An ack above
    /// the channel's watermark counts as sent once it waits to ride in a
    /// neighbour's multiple ack; should the channel die first, the broker
    /// redelivers that delivery too, and it is settled again as a duplicate.
    pub settled_with_broker: bool,
    /// The broker's delivery count before this delivery (`x-delivery-count`; 0 if
    /// absent or if the broker did not redeliver it: a publisher can set the header).
    pub delivery_count: u32,
    /// Whether the broker redelivered it (delivered before, never acked).
    pub redelivered: bool,
    /// The handler attempt this delivery was (1 for the first; retries count up).
    pub attempt: u32,
    /// The connection session it came on (1, then one more per reconnect).
    pub session: u64,
    /// How many deliveries the transaction that decided it held (group commit; 1 when
    /// it ran alone, 0 when it was decided without a transaction: bad input, a
    /// database outage, shutdown).
    pub batch: usize,
    /// When the runtime received the delivery.
    pub received_at: Instant,
    /// When the handler's transaction began (the dedup insert), if it did.
    pub began_at: Option<Instant>,
    /// When the delivery was settled.
    pub settled_at: Instant,
    /// How long its handler ran (its last run), if it ran.
    pub handler_time: Option<std::time::Duration>,
}

/// Counters of a runtime's outcomes since it was built.
#[derive(Debug, Default)]
pub struct Stats {
    applied: AtomicU64,
    duplicates: AtomicU64,
    already_copied: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    requeued: AtomicU64,
    paused: AtomicU64,
    abandoned: AtomicU64,
    unsettled: AtomicU64,
    infrastructure_retries: AtomicU64,
    batch_splits: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Deliveries whose handler ran and committed.
    pub applied: u64,
    /// Deliveries skipped as duplicates.
    pub duplicates: u64,
    /// Redelivered originals acked because their copy was already confirmed.
    pub already_copied: u64,
    /// Deliveries sent to a wait queue for a later attempt after a handler error.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries returned to the queue because their copy could not be published.
    pub requeued: u64,
    /// Deliveries returned to the queue unprocessed by an open kill switch.
    pub paused: u64,
    /// Deliveries cut off by the shutdown deadline (returned to the queue).
    pub abandoned: u64,
    /// Deliveries whose ack/nack could not be sent (channel gone): the broker redelivers.
    pub unsettled: u64,
    /// Transactions retried in-process after a database fault (not handler attempts).
    pub infrastructure_retries: u64,
    /// Batches run again smaller because one of their deliveries failed, or the batch
    /// failed as a whole (no attempt is charged for that).
    pub batch_splits: u64,
}

impl Stats {
    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            applied: get(&self.applied),
            duplicates: get(&self.duplicates),
            already_copied: get(&self.already_copied),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            requeued: get(&self.requeued),
            paused: get(&self.paused),
            abandoned: get(&self.abandoned),
            unsettled: get(&self.unsettled),
            infrastructure_retries: get(&self.infrastructure_retries),
            batch_splits: get(&self.batch_splits),
        }
    }

    pub(crate) fn record(&self, settled: &Settled) {
        let counter = match settled.outcome {
            Outcome::Applied => &self.applied,
            Outcome::Duplicate => &self.duplicates,
            Outcome::AlreadyCopied { .. } => &self.already_copied,
            Outcome::Retry { .. } => &self.retried,
            Outcome::Requeued { .. } => &self.requeued,
            Outcome::DeadLettered { .. } => &self.dead_lettered,
            Outcome::Paused => &self.paused,
            Outcome::Abandoned => &self.abandoned,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !settled.settled_with_broker {
            self.unsettled.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn count_batch_splits(&self, splits: u64) {
        self.batch_splits.fetch_add(splits, Ordering::Relaxed);
    }

    pub(crate) fn count_infrastructure_retry(&self) {
        self.infrastructure_retries.fetch_add(1, Ordering::Relaxed);
    }
}
