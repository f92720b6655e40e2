//! Header names idemq writes on dead letters and copies.

/// Longest `x-idemq-error` value, in bytes.
pub const MAX_ERROR_HEADER_BYTES: usize = 1024;

/// Human-readable error, at most 1 KiB.
pub const ERROR: &str = "x-idemq-error";
/// One of `FailureKind::as_str`.
pub const ERROR_KIND: &str = "x-idemq-error-kind";
/// Handler attempts made so far (carried on retry copies; on a dead letter, all of them).
pub const ATTEMPTS: &str = "x-idemq-attempts";
/// The handler that consumed it.
pub const HANDLER: &str = "x-idemq-handler";
/// The exchange it was first published to.
pub const ORIGINAL_EXCHANGE: &str = "x-idemq-original-exchange";
/// The routing key it was first published with (set on every copy, kept by a
/// replay): on a queue several handlers consume, an untyped copy is routed by it,
/// not by the queue's name it comes back with.
pub const ORIGINAL_ROUTING_KEY: &str = "x-idemq-original-routing-key";
/// When it first failed (RFC 3339, UTC).
pub const FIRST_FAILURE: &str = "x-idemq-first-failure";
/// When it last failed (RFC 3339, UTC).
pub const LAST_FAILURE: &str = "x-idemq-last-failure";
/// Headers dropped from a copy to keep it under `frame_max`, comma-separated.
pub const TRIMMED: &str = "x-idemq-trimmed";
/// The broker's delivery counter on quorum queues; stripped from copies.
pub const DELIVERY_COUNT: &str = "x-delivery-count";
/// The copy's identity, `<lineage>:<attempt>`: the same for every copy of one
/// message made at one attempt, so a second one is recognised (set on every copy).
/// The lineage hashes what makes the message itself: its handler, dedup key,
/// `message_id`, body and [`REPLAY`] generation.
pub const COPY_ID: &str = "x-idemq-copy-id";
/// The queue the message was consumed from (set on every copy): where `dlq
/// replay` sends a dead letter back, and what `dlq list` shows.
pub const QUEUE: &str = "x-idemq-queue";
/// How often `dlq replay` sent this message back to its queue (absent: never).
/// Each replay is a new lineage generation, starting again at attempt 1; `dlq
/// replay` leaves a letter replayed `--max-replays` times in the DLQ.
pub const REPLAY: &str = "x-idemq-replay";
/// On retry copies only: the queue the copy returns to. With the broker's
/// `x-death` entry of that queue's wait queue, it is what makes idemq trust the
/// copy's `x-idemq-attempts`; a dead letter has none, so a replay starts afresh.
pub const RETRY_OF: &str = "x-idemq-retry-of";
/// The original's per-message TTL (`expiration` property), which copies do not
/// carry: a dead letter must not expire in the DLQ.
pub const ORIGINAL_EXPIRATION: &str = "x-idemq-original-expiration";
/// On an `unroutable-type` dead letter: the type no handler of its queue takes (its
/// AMQP `type`, else the routing key it was first published with; empty if it had
/// neither).
pub const MESSAGE_TYPE: &str = "x-idemq-message-type";
/// Which version of its type a message's body is (an integer, as a string or an
/// AMQP integer; absent: version 1), for a handler whose message type is
/// [`Versioned`](crate::Versioned). Set by `send` for a versioned type.
pub const VERSION: &str = "x-idemq-version";
