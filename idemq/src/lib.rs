//! # idemq — exactly-once effects for RabbitMQ consumers
//!
//! Brokers deliver at least once. idemq makes processing idempotent: each delivery's
//! effect commits in the same PostgreSQL transaction as a dedup row keyed by
//! handler and message key, and the ack is sent only after that COMMIT. A redelivery
//! finds the row and is acked without running the handler again.
//!
//! ```no_run
//! use diesel_async::AsyncPgConnection;
//! use idemq::{idempotent_handler, HandlerError, Queue, Runtime, Topology};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct PaymentRequested {
//!     payment_id: String,
//!     account: String,
//!     amount_cents: i64,
//! }
//!
//! #[idempotent_handler(key = "payment_id")]
//! async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
//!     // Write your effect with `conn`: it is inside the dedup transaction.
//!     # let _ = (conn, msg.account, msg.amount_cents);
//!     Ok(())
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), idemq::Error> {
//!     let database_url = std::env::var("DATABASE_URL").unwrap_or(idemq::connect::DEFAULT_DATABASE_URL.into());
//!     idemq::migrate(&database_url).await?;
//!     Runtime::builder()
//!         .database_url(database_url)
//!         .topology(Topology::new().queue(Queue::new("payments")))
//!         .consume("payments", apply_payment)
//!         .build()?
//!         .run(idemq::shutdown_signal())
//!         .await
//! }
//! ```
//!
//! ## Design
//!
//! The life of a delivery is one state machine, in one file of the engine's crate
//! (`runtime/src/engine/delivery/life.rs`, its stages as a type; each stage is done
//! in a file of its own beside it):
//!
//! batch → decode → key → BEGIN → `INSERT … ON CONFLICT DO NOTHING RETURNING` (the
//! batch's rows in one statement, which also reads the rows of the duplicates) →
//! handlers (or one batch handler call) → checked COMMIT → ack | retry | dead-letter
//!
//! - **Ack after commit, always.** Handlers never see the delivery or its acker. The
//!   COMMIT is *checked*, in the same round trip: a transaction aborted by a statement
//!   whose error the handler ignored (PostgreSQL answers its COMMIT with `ROLLBACK`
//!   and no error) or ended by the handler itself is a failed attempt, never acked.
//! - **The unique index decides.** Concurrent duplicates block on the dedup row's
//!   primary key and then see it committed; nothing checks first and acts later.
//! - **Dedup lives in the transaction**, never in a cache beside it.
//! - **Every message ends one way:** applied once and acked, acked as a duplicate,
//!   or dead-lettered with `x-idemq-error` / `x-idemq-error-kind` headers. Bad input
//!   (too large, not JSON, wrong shape, missing/empty/NUL key) is dead-lettered, never
//!   dropped, never looped. A known key with a different payload is a `conflict`
//!   (see [what "the same payload" means](#the-same-payload)).
//! - **Bounded retries:** a transient failure is retried later through TTL wait
//!   queues ([`RetryPolicy`]), the copy confirmed before the original is acked; after
//!   the last attempt it is dead-lettered. A panic is a failed attempt; a delivery is
//!   never left unsettled. Attempt counts are trusted only on copies back from
//!   idemq's own wait queues; a copy's id (lineage + attempt) is recorded once
//!   confirmed, so a lost ack never makes a second copy.
//! - **A message's identity is its own:** a recorded copy can only ever settle the
//!   message it was made from. Its lineage hashes the handler, the dedup key, the
//!   `message_id`, the body and the replay generation (`handler/identity.rs`), so two
//!   messages that differ to their handler never share one, and a replayed dead
//!   letter starts a new one. Keys are byte-exact, never a lossy reading.
//! - **Poison is judged by starts:** a redelivered message runs alone, its start
//!   committed before its handler runs; after `Queue::delivery_limit` starts without
//!   an outcome it is dead-lettered. The broker's delivery count only backs it up
//!   (`x-delivery-limit`): before RabbitMQ 4.3 a crash bumps it for the whole
//!   prefetch window, and from 4.3 a requeue by `basic.nack` (idemq's, always one
//!   tag, never `multiple`) does not count at all.
//! - **Database faults are not handler failures:** the delivery stays unacked and its
//!   transaction is retried in-process on a fresh connection. A COMMIT the server
//!   answered with an error is a rollback, a failed attempt; only a lost connection
//!   leaves it unknown. What no retry can fix (idemq's tables missing, privileges
//!   lacking) is refused at start-up and stops a running runtime.
//! - **PostgreSQL's errors are read by their SQLSTATE, in any language:** diesel-async
//!   drops the code and keeps only the message, which the server translates
//!   (`lc_messages`), so every connection idemq makes reads the codes of the errors
//!   its server sends off the wire (`tls/postgres/wire.rs`). Contention (40001, 40P01,
//!   55P03: run again in-process, never charged), an aborted transaction (25P02), a
//!   discarded COMMIT check (26000) are the server's word — never a message's text,
//!   nor what a handler's own error says.
//! - **Faults are ordinary:** a lost connection or channel, a broker restart, a
//!   silent broker (heartbeats) or a consumer cancelled by the broker ends a
//!   *session*; the runtime reconnects with backoff, declares again and resumes.
//!   Starting during an outage is waited out the same way (an unreachable broker or
//!   database, each attempt logged; [`RuntimeBuilder::startup_timeout`] bounds it),
//!   while a refused login, a missing vhost or database fails at once.
//!   Copies are published on a connection of their own, so a broker memory alarm
//!   never stalls consumption. SIGTERM drains within a deadline. Settings that could
//!   hold a delivery past the broker's `consumer_timeout` are refused by `build`
//!   ([`RuntimeBuilder::consumer_timeout`]); a channel the broker closes for it
//!   anyway is reported as that, and the late effect is acked as a duplicate.
//! - **A broken dependency pauses, it does not dead-letter:** with a kill switch
//!   ([`RuntimeBuilder::kill_switch`]), a handler whose attempts keep failing is
//!   paused — its held deliveries returned unprocessed, not charged — and one message
//!   is tried after each pause until one applies. Rate and concurrency limits per
//!   handler ([`RuntimeBuilder::rate_limit`], [`RuntimeBuilder::handler_concurrency`])
//!   hold under group commit and lanes.
//! - **Group commit, same guarantees:** up to [`RuntimeBuilder::batch_size`]
//!   deliveries that have arrived run in one transaction and are acked together (one
//!   `multiple` ack, only below the channel's watermark of unsettled deliveries); a
//!   lone message is a batch of one, never waiting for a timer. No delivery is
//!   charged for a neighbour: a failing handler is re-run alone and the others
//!   without it, a batch failing as a whole (refused COMMIT, a lock wait over 200 ms,
//!   a failed batch handler) in halves. Decisions are pure functions (`base/verdict.rs`), acks have their own
//!   module (`broker/acks.rs`). Per-message mode is `batch_size(1)`.
//! - **Lanes:** `#[idempotent_handler(key = "...", lane = "account")]` sends one lane
//!   value's deliveries to one pipeline, in arrival order: never applied concurrently
//!   or out of order within a process, and batches stop colliding on its rows.
//! - **Exactly once across hops:** a handler publishes through its [`Context`] into
//!   the transactional [`outbox`], in its own transaction; the [`Relay`](outbox::Relay) publishes
//!   committed rows with confirms and `mandatory`, at least once with one stable,
//!   deterministic `message_id`, and deletes them (module docs of [`outbox`] and
//!   `engine/relay/`). A handler's result is stored with its dedup row and is the reply
//!   to a request (`reply_to` + `correlation_id`); a duplicated request gets the
//!   stored reply again, byte for byte. A reply expires — after the reply TTL
//!   ([`RuntimeBuilder::reply_ttl`], 1 h) or its request's `expiration`, whichever
//!   comes first — and is then deleted unpublished, so one to a `reply_to` queue that
//!   is gone does not stay in the outbox for ever; events never expire.
//! - **Streams: the offset in the transaction.** A [`Queue::stream`] is consumed in
//!   offset order; each transaction applies a run of messages and moves the
//!   handler's offset (`idemq_stream_offsets`) to its last, in the same COMMIT, only
//!   from the value this consumer read (a fence against a zombie). After any failure
//!   the consumer subscribes again after the stored offset; one process per
//!   (handler, stream) consumes, holding a PostgreSQL advisory lock, and another
//!   takes over when it goes — or when it has not reached the broker for
//!   [`RuntimeBuilder::release_streams_after`]: a lock is held only by a process
//!   that can consume. No dedup row is needed (`dedup = false`), a new
//!   handler name replays the stream from its start, and a failing message holds the
//!   stream (retried in place) until it is applied or dead-lettered. [`Partitions`]
//!   split a stream by key over N streams that N processes share fairly (advisory
//!   locks again: each counts the others and owns at most its share). The life of a
//!   stream message is told in `engine/stream/mod.rs`.
//! - **Traces across hops:** a delivery's W3C `traceparent` is continued by what its
//!   handler publishes (stored with the outbox row when enqueued) and by its reply;
//!   handlers run in a `handler` span carrying the trace id (`base/trace.rs`).
//! - **The contract, generated:** [`RuntimeBuilder::asyncapi`] writes an AsyncAPI 3.0
//!   document of the queues, exchanges, handlers and message types (`broker/asyncapi.rs`;
//!   the CLI's `asyncapi`).
//! - **The producer side too:** [`Publisher`] publishes `mandatory` with confirms (a
//!   returned message is an error), reconnects and publishes again under the same
//!   `message_id`, and sends requests over direct reply-to; the same calls write
//!   into the outbox inside a transaction of yours ([`outbox::Outbox`]).
//! - **TLS or nothing:** `amqps://` URLs (RabbitMQ's `cacertfile`, `certfile`,
//!   `keyfile`, `server_name_indication`, `verify`) and PostgreSQL URLs (libpq's
//!   `sslmode`, `sslrootcert`, `sslcert`, `sslkey`, libpq's meanings) are read into one
//!   rustls configuration per server (`tls/`), used by every connection idemq makes; an
//!   `amqps://` URL never falls back to plaintext. A certificate that does not verify
//!   is [`Error::Tls`], naming the host and the reason, and ends start-up at once: it
//!   is a refusal, not an outage. [`connect`] connects the application's own code the
//!   same way.
//!
//! ## Where things are
//!
//! The crate root holds what a handler author needs: the attribute
//! [`idempotent_handler`] and the derive [`Message`], [`Runtime`] and its
//! [`RuntimeBuilder`], [`Topology`] / [`Queue`] / [`Exchange`], [`Handler`],
//! [`HandlerError`] / [`Permanent`] / [`ErrorClass`], [`Context`] /
//! [`HandlerOutput`], [`Batch`] (batch handlers), [`Key`] / [`Metadata`], [`RetryPolicy`], [`OnConflict`],
//! [`Outcome`] / [`FailureKind`], [`Error`] / [`Dependency`], [`migrate`], the
//! shutdown signals, and the producer side: [`Publisher`] and [`PublishError`].
//! Everything else lives in one module, under one path:
//!
//! | module | what |
//! |---|---|
//! | [`outbox`] | [`outbox::Outbox`] and [`outbox::enqueue`] in your own transactions, [`outbox::Outgoing`], the [`outbox::Relay`] run on its own |
//! | [`publisher`] | the [`Publisher`]'s builder and its requests' errors |
//! | [`observe`] | the [`observe::Observe`] trait, its events, [`observe::Stats`] |
//! | [`key`] | key extraction for handlers and key types written by hand |
//! | [`store`] | idemq's tables for operators: [`store::schema`], migrations, retention ([`store::sweep`]), [`store::forget`] |
//! | [`connect`] | connections as idemq makes them, the URLs from the environment, [`connect::redact`] |
//! | [`headers`] | the `x-idemq-*` header names |
//! | `cli`, `testing` | the application's command line (feature `cli`); the test kit (feature `testing`) |
//! | [`guide`] | the guide, one chapter per topic (`docs/` in the repository), every example a doctest |
//!
//! [`diesel`], [`diesel_async`] and [`lapin`] are re-exported at the versions idemq
//! is built with, as their types appear in idemq's signatures.
//!
//! ## Crates
//!
//! This crate is a facade over three: the engine, `idemq-core` (`runtime/` in the
//! repository, whose crate docs draw its layers and the rule that holds them, its
//! `tests/layers.rs`; the file paths above are under its `src/`), at the root; the command line, `idemq-cli`, as `idemq::cli`; the
//! test kits, `idemq-testing`, as `idemq::testing`. Depend on `idemq` alone: its features
//! turn the others on.
//!
//! ## Handlers
//!
//! `#[idempotent_handler(key = "field.path")]` turns `async fn f(conn: &mut
//! AsyncPgConnection, msg: M) -> Result<R, E>` into a unit struct `f` implementing
//! [`Handler`]; the original fn stays callable as `f::call(conn, msg)`. `R` is `()`
//! or a `Serialize` result (stored, replied to requests). An optional third argument
//! `ctx: &mut Context` (or `&Context`; before or after the message) publishes
//! through the outbox and reads the delivery's metadata. Besides a field path the key
//! may be a template (`"{tenant}:{order.id}"`, see [`Key::from_template`]),
//! `"@message_id"`, `"@header:<name>"`, `"@hash"` (see [`Metadata`]), a `key_fn`
//! ([`key::KeyFn`]) or the message type's own (`#[derive(Message)]`, [`key::KeyedMessage`]);
//! `queue`, `retry(..)`, `on_conflict`, `batch` and `dedup = false` tune the runtime
//! per handler (the attribute's docs list them all). The key is a
//! field path into the decoded message (`"order.id"` for nested fields) of a string,
//! integer, `uuid::Uuid` (feature `uuid`) or `Option` of one (`None` is a missing key).
//! `name = "..."` overrides the handler name, which scopes dedup keys; two different
//! handlers with one name are refused by [`RuntimeBuilder::build`], and
//! [`RuntimeBuilder::namespace`] scopes a whole runtime (services sharing a
//! database). `E` is any
//! error (transient: retried) or a [`HandlerError`]; wrap in [`Permanent`] to
//! dead-letter without retrying.
//!
//! A **batch handler** takes `batch: &mut` [`Batch<M>`](Batch) instead of the message
//! (and no context: each message in the batch has its own) and returns `Result<(),
//! E>` or `Result<Vec<R>, E>`, one result per message in order. It is called once per
//! transaction with the transaction's new messages, in arrival order, so its effect
//! can be a few multi-row statements instead of a few statements per message (the
//! demo's `apply_payment`). The guarantees are the same: duplicates are answered
//! before it runs; key, lane and options apply per message; results, replies and
//! outbox ids stay per message. Its failure (error, panic, timeout) names no message,
//! so the batch is rolled back and run again in halves ([`Handler::handle_batch`])
//! until the message at fault runs alone — only then is an attempt charged, as for a
//! handler of one message, which is re-run *around* the failing message instead. The
//! design keeps one erased path for both forms: a batch handler's decoded message
//! waits for its batch (`handler/prepare.rs`), where a handler of one message's is
//! already bound into its effect; a batch handler's `handle` is a batch of one, so
//! any caller of the trait still works. Prefer a handler of one message unless a hot
//! path can write multi-row statements (the guide's [batch
//! handlers](guide::handlers#batch-handlers-when-to-choose-them)).
//!
//! **Several message types on one queue** each go to the handler of their type: a type
//! named with `#[message(type = "...")]` ([`MessageType`]) is routed by the delivery's
//! AMQP `type` (else its routing key) when a queue has several handlers; each keeps
//! its own dedup scope. The session gives such a queue one channel and a router in
//! front of one intake per handler (`engine/session/intake.rs`); a type no handler
//! takes goes to an intake whose only outcome is an `unroutable-type` dead letter. A
//! **versioned** type (`#[message(version = 2, previous = V1)]`, [`Versioned`]) is
//! decoded as the version its `x-idemq-version` header says and upcast before the
//! handler, and fingerprinted after, so old and new encodings of one message are
//! duplicates. The attribute finds out at compile time which of the two the message
//! type is (`handler/wire.rs`).
//!
//! The stored key ([`Key`]) is the key as written — integers in decimal, uuids
//! hyphenated — when it has at most [`key::MAX_STORED_KEY_BYTES`] (256) UTF-8 bytes and
//! does not start with `sha256:`; any other key is stored as `sha256:` and the hex
//! SHA-256 of its bytes. A stored `sha256:…` therefore always means "hashed": a raw
//! key spelled like a long key's hash is hashed itself and cannot collide with it.
//!
//! ## The same payload
//!
//! A delivery whose key is already in `idemq_dedup` is acked as a duplicate if its
//! payload is the same as the applied one's, and dead-lettered as a `conflict` (or
//! acked, with [`OnConflict::Ignore`]) if not. "The same" is judged by what the
//! handler would see, not by the bytes: the dedup row stores the SHA-256 of a
//! canonical form of the decoded JSON, so a copy re-serialized by its publisher is
//! still a duplicate. Two bodies are the same payload when, after
//!
//! - removing every field the handler's message type ignores (an unknown field, at
//!   any depth: `serde` skipped it, so the handler cannot see it),
//! - sorting object members by key and dropping all whitespace,
//! - unescaping strings (`"A"` is `"A"`, `"\/"` is `"/"`) and
//! - reading numbers as numbers (`1.50` is `1.5`, `1.5e2` is `150.0`),
//!
//! they are equal. Everything else is a difference: another value, an added field
//! the message type reads, array order, `null` against an absent member, `100`
//! against `100.0`. Fields inside `#[serde(flatten)]`, untagged or internally tagged
//! parts and struct variants of an enum count as read even when unknown (serde buffers
//! them before the type looks). A body that decodes but has no canonical form (a
//! number beyond `f64` in an ignored field, a map key type the path tracking cannot
//! follow) is fingerprinted by its raw bytes. Changing which fields the message type
//! reads changes the fingerprints of messages that carry them: a copy of a message
//! applied before such a change can turn out a `conflict`.
//!
//! ## Features
//! - `uuid`: `uuid::Uuid` key fields.
//! - `cli`: `idemq::cli`, the application's command line (`run`, `migrate`, `declare`,
//!   `status`, `gc`, `dlq`); turns on `metrics`.
//! - `metrics`: Prometheus metrics and health endpoints (`RuntimeBuilder::http_addr`).
//! - `otel`: `idemq::otel`, OpenTelemetry: each handler's span continues its delivery's
//!   W3C trace (`traceparent`) and spans go over OTLP/HTTP to
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`. Without it the trace headers are propagated all the
//!   same.
//! - `schemars`: JSON Schemas of the payloads in the AsyncAPI document, for message
//!   types that derive `schemars::JsonSchema` (schemars 1.x).
//! - `testing`: `idemq::testing::TestKit`, `idemq::testing::NetworkProxy` (network faults),
//!   `TestCertificates` and `PostgresServer` (TLS servers), and the test-only fault hooks
//!   (`idemq::testing::fault`, `FaultHookExt::fault_hook`); for dev-dependencies only,
//!   never in production builds (it turns on `test-cluster`).
//! - `test-cluster`: `idemq::testing::Cluster`, a private RabbitMQ cluster on this host for
//!   node-loss tests and benchmarks (no fault hooks).

#![warn(missing_docs)]
// docs.rs (`[package.metadata.docs.rs]`): each feature-gated item says its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The facade: the engine is the crate `idemq-core` (`runtime/` in the repository), the
// command line `idemq-cli` (`cli/`) and the test kits `idemq-testing` (`testing/`);
// each is re-exported here, so an application names `idemq` only.
pub use idemq_core::*;

// Inlined: their docs read as modules of this crate, `idemq::cli` and `idemq::testing`.
#[cfg(feature = "cli")]
#[doc(inline)]
pub use idemq_cli as cli;
#[cfg(any(feature = "testing", feature = "test-cluster"))]
#[doc(inline)]
pub use idemq_testing as testing;

// The chapters link to each other with references (`[Retries][failures.md#retries]`),
// each defined at the chapter's end for the repository's page (`failures.md#retries`).
// Here the same labels are defined first, and the first definition wins: in rustdoc
// they point at the chapters' modules. A link to a new chapter or heading needs a
// line here (the test below names it).
macro_rules! guide_links {
    () => {
        "[../README.md]: crate\n\
        [README.md]: crate::guide\n\
        [contracts.md]: crate::guide::contracts\n\
        [contracts.md#the-contract-generated-asyncapi]: crate::guide::contracts#the-contract-generated-asyncapi\n\
        [failures.md]: crate::guide::failures\n\
        [failures.md#bad-input-from-other-clients]: crate::guide::failures#bad-input-from-other-clients\n\
        [failures.md#poison-messages]: crate::guide::failures#poison-messages\n\
        [guarantees.md]: crate::guide::guarantees\n\
        [guarantees.md#how-the-pitfalls-are-ruled-out]: crate::guide::guarantees#how-the-pitfalls-are-ruled-out\n\
        [handlers.md]: crate::guide::handlers\n\
        [handlers.md#batch-handlers-when-to-choose-them]: crate::guide::handlers#batch-handlers-when-to-choose-them\n\
        [high-availability.md]: crate::guide::high_availability\n\
        [high-availability.md#database-high-availability]: crate::guide::high_availability#database-high-availability\n\
        [operating.md]: crate::guide::operating\n\
        [operating.md#configuration]: crate::guide::operating#configuration\n\
        [operating.md#queues]: crate::guide::operating#queues\n\
        [operating.md#the-cli-the-payments-binary]: crate::guide::operating#the-cli-the-payments-binary\n\
        [outbox.md]: crate::guide::outbox\n\
        [outbox.md#requestreply-stored-results]: crate::guide::outbox#requestreply-stored-results\n\
        [performance.md]: crate::guide::performance\n\
        [performance.md#group-commit-and-lanes]: crate::guide::performance#group-commit-and-lanes\n\
        [performance.md#scaling-out]: crate::guide::performance#scaling-out\n\
        [publishing.md]: crate::guide::publishing\n\
        [rabbitmq-versions.md]: crate::guide::rabbitmq_versions\n\
        [rabbitmq-versions.md#delivery-counting-on-rabbitmq-43-and-later]: crate::guide::rabbitmq_versions#delivery-counting-on-rabbitmq-43-and-later\n\
        [sagas.md]: crate::guide::sagas\n\
        [security.md]: crate::guide::security\n\
        [security.md#least-privilege]: crate::guide::security#least-privilege\n\
        [security.md#secrets]: crate::guide::security#secrets\n\
        [security.md#tls]: crate::guide::security#tls\n\
        [streams.md]: crate::guide::streams\n\
        [streams.md#partitioned-streams]: crate::guide::streams#partitioned-streams\n\
        [testing.md]: crate::guide::testing\n\
        [testing.md#the-workspaces-own-fault-tests]: crate::guide::testing#the-workspaces-own-fault-tests\n"
    };
}

// The guide: one chapter per topic, written in `docs/` (readable on the repository's
// page) and compiled in here, so that every example in it is a doctest. Its docs are
// the chapters alone: a paragraph before the link definitions would swallow them.
pub mod guide {
    #![doc = guide_links!()]
    #![doc = include_str!("../../docs/README.md")]

    pub mod handlers {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/handlers.md")]
    }
    pub mod failures {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/failures.md")]
    }
    pub mod outbox {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/outbox.md")]
    }
    pub mod publishing {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/publishing.md")]
    }
    pub mod streams {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/streams.md")]
    }
    pub mod contracts {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/contracts.md")]
    }
    pub mod sagas {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/sagas.md")]
    }
    pub mod testing {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/testing.md")]
    }
    pub mod guarantees {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/guarantees.md")]
    }
    pub mod operating {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/operating.md")]
    }
    pub mod security {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/security.md")]
    }
    pub mod high_availability {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/high-availability.md")]
    }
    pub mod performance {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/performance.md")]
    }
    pub mod rabbitmq_versions {
        #![doc = guide_links!()]
        #![doc = include_str!("../../docs/rabbitmq-versions.md")]
    }

    #[cfg(test)]
    mod tests {
        /// Every chapter, as the repository holds it.
        const CHAPTERS: &[(&str, &str)] = &[
            ("README.md", include_str!("../../docs/README.md")),
            ("handlers.md", include_str!("../../docs/handlers.md")),
            ("failures.md", include_str!("../../docs/failures.md")),
            ("outbox.md", include_str!("../../docs/outbox.md")),
            ("publishing.md", include_str!("../../docs/publishing.md")),
            ("streams.md", include_str!("../../docs/streams.md")),
            ("contracts.md", include_str!("../../docs/contracts.md")),
            ("sagas.md", include_str!("../../docs/sagas.md")),
            ("testing.md", include_str!("../../docs/testing.md")),
            ("guarantees.md", include_str!("../../docs/guarantees.md")),
            ("operating.md", include_str!("../../docs/operating.md")),
            ("security.md", include_str!("../../docs/security.md")),
            ("high-availability.md", include_str!("../../docs/high-availability.md")),
            ("performance.md", include_str!("../../docs/performance.md")),
            ("rabbitmq-versions.md", include_str!("../../docs/rabbitmq-versions.md")),
        ];

        #[test]
        fn every_link_between_chapters_is_a_reference_that_rustdoc_resolves_to_a_module() {
            let rustdoc = guide_links!();
            for (chapter, text) in CHAPTERS {
                for link in text.split("](").skip(1) {
                    let target = link.split([')', ' ']).next().unwrap_or_default();
                    let file = target.split('#').next().unwrap_or_default();
                    let chapter_file =
                        file == "../README.md" || (file.ends_with(".md") && !file.contains('/'));
                    assert!(
                        !chapter_file,
                        "docs/{chapter} links to the chapter `{target}` inline: write it as a reference, \
                         `[text][{target}]`, defined at the chapter's end as `[{target}]: {target}`"
                    );
                }
                for reference in text.split("][").skip(1) {
                    let label = reference.split(']').next().unwrap_or_default();
                    if label.contains(".md") {
                        assert!(
                            text.contains(&format!("\n[{label}]: {label}\n")),
                            "docs/{chapter} uses the link `[{label}]` without defining it at its end"
                        );
                        assert!(
                            rustdoc.contains(&format!("[{label}]: crate")),
                            "docs/{chapter} links to `{label}`: add its rustdoc target to guide_links! \
                             in idemq/src/lib.rs"
                        );
                    }
                }
            }
        }
    }
}

/// The README's examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
