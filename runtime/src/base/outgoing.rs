//! What goes into the outbox: messages, their properties and ids, requests and
//! their replies, as values (no I/O). Written by handlers through their
//! [`Context`](crate::Context), stored by the store layer, published by the relay.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::types::AMQPValue;
use lapin::BasicProperties;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::base::hex;

/// The exchange of replies: the default exchange routes by queue name.
const REPLY_EXCHANGE: &str = "";

/// The prefix of RabbitMQ's direct reply-to pseudo-queues, whose replies cannot be
/// confirmed as routed (see [`Outgoing`]'s best-effort rows).
const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// The header that tells a reply's requester whether its request succeeded.
pub const STATUS_HEADER: &str = "x-idemq-status";

/// The shortest a reply is kept: a request's `expiration` below it (RabbitMQ's `0`:
/// deliver now or drop) says how long the request may wait in its queue, not how long
/// its requester waits for the answer; and a reply TTL below it would drop replies
/// before a relay's first try.
pub(crate) const MIN_REPLY_WINDOW: Duration = Duration::from_secs(1);

/// A message type that knows where it is published: the typed form of
/// [`Context::publish`](crate::Context::publish), [`Context::send`](crate::Context::send). Written by `#[derive(Message)]`
/// (`#[message(exchange = "payments", routing_key = "payment.applied")]`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say where it is published: it is not an `idemq::Message`",
    label = "publishing it by type needs its exchange and routing key",
    note = "add `#[message(exchange = \"...\", routing_key = \"...\")]` on `{Self}` beside its \
            `#[derive(idemq::Message)]` (`#[message(key)]` alone gives handlers its key, not a route), \
            or name the route where you publish it: `ctx.publish(exchange, routing_key, &message)`"
)]
pub trait Message: Serialize {
    /// The exchange it is published to (`""`: the default exchange).
    const EXCHANGE: &'static str;
    /// Its routing key (on the default exchange: the queue's name).
    const ROUTING_KEY: &'static str;
    /// Its name on the wire, sent as the AMQP `type` (`#[message(type = "...")]`:
    /// see [`MessageType`](crate::MessageType)); `None`: untyped.
    const TYPE: Option<&'static str> = None;
    /// Its version, sent as the [`x-idemq-version`](crate::headers::VERSION) header
    /// (`#[message(version = N)]`: see [`Versioned`](crate::Versioned)); `None`:
    /// unversioned.
    const VERSION: Option<u32> = None;

    /// Its payload's JSON Schema, for the AsyncAPI document (feature `schemars`,
    /// for a type deriving `JsonSchema`). Written by `#[derive(Message)]`.
    #[doc(hidden)]
    fn payload_schema() -> Option<serde_json::Value> {
        None
    }

    /// The routing key of this message (default: [`Message::ROUTING_KEY`]).
    fn routing_key(&self) -> &str {
        Self::ROUTING_KEY
    }
}

/// A message on its way into the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) body: Vec<u8>,
    pub(crate) message_id: Option<String>,
    pub(crate) content_type: Option<String>,
    pub(crate) correlation_id: Option<String>,
    /// The AMQP `type`.
    pub(crate) message_type: Option<String>,
    pub(crate) headers: BTreeMap<String, String>,
    /// `false`: best effort (direct reply-to): published once, without `mandatory`.
    pub(crate) mandatory: bool,
    /// The reply to a request, which expires (see the module docs); `None`: an event.
    pub(crate) reply: Option<Expiry>,
    /// When the relay publishes it ([`Outgoing::deliver`]); `None`: at once.
    pub(crate) due: Option<When>,
}

/// When a scheduled message is due: at a time, or after a delay counted from the
/// start of the transaction that writes it (PostgreSQL's `now()`, so the database's
/// clock decides, as it does for the relay). `Duration` and `SystemTime` convert into
/// it: `ctx.schedule(&msg, Duration::from_secs(900))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum When {
    /// At this time.
    At(std::time::SystemTime),
    /// This long after the transaction's start.
    After(Duration),
}

impl From<Duration> for When {
    fn from(delay: Duration) -> Self {
        When::After(delay)
    }
}

impl From<std::time::SystemTime> for When {
    fn from(at: std::time::SystemTime) -> Self {
        When::At(at)
    }
}

/// How a reply row expires, besides the relay's reply TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expiry {
    /// The request's own window (its `expiration`), from when it was consumed.
    pub(crate) within: Option<Duration>,
}

impl Outgoing {
    /// `message` as JSON (`content-type: application/json`), to `exchange` with
    /// `routing_key`.
    ///
    /// # Errors
    /// [`PublishError::Serialize`], or [`PublishError::TooLong`] for a name over
    /// AMQP's 255 bytes.
    pub fn json<T: Serialize + ?Sized>(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        message: &T,
    ) -> Result<Self, PublishError> {
        let body = serde_json::to_vec(message).map_err(PublishError::Serialize)?;
        Self::bytes(exchange, routing_key, body).map(|outgoing| outgoing.content_type("application/json"))
    }

    /// A [`Message`] as JSON, where its type says it goes, with its name on the
    /// wire (the AMQP `type`) and its version (the `x-idemq-version` header) if it
    /// declares them: what `send` publishes, and what `request` sends. Set more on
    /// it (a message id, headers) and publish it with `publish_outgoing`, or send it
    /// as a request with [`Publisher::request_with`](crate::Publisher::request_with).
    ///
    /// # Errors
    /// As [`Outgoing::json`].
    pub fn of<M: Message>(message: &M) -> Result<Self, PublishError> {
        let mut outgoing = Self::json(M::EXCHANGE, message.routing_key(), message)?;
        outgoing.message_type = M::TYPE.map(str::to_owned);
        if let Some(version) = M::VERSION {
            outgoing.headers.insert(crate::base::headers::VERSION.to_owned(), version.to_string());
        }
        Ok(outgoing)
    }

    /// A body as it is, without a content type.
    ///
    /// # Errors
    /// [`PublishError::TooLong`] for a name over AMQP's 255 bytes.
    pub fn bytes(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: Vec<u8>,
    ) -> Result<Self, PublishError> {
        let (exchange, routing_key) = (exchange.into(), routing_key.into());
        short("the exchange name", &exchange)?;
        short("the routing key", &routing_key)?;
        Ok(Self {
            exchange,
            routing_key,
            body,
            message_id: None,
            content_type: None,
            correlation_id: None,
            message_type: None,
            headers: BTreeMap::new(),
            mandatory: true,
            reply: None,
            due: None,
        })
    }

    /// Sets the AMQP `message_id`: outside a handler (the [`Publisher`](crate::Publisher),
    /// its requests included, and the outbox) it is kept, on every copy; a
    /// handler's messages get deterministic ids instead.
    #[must_use]
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Schedules it: the relay publishes it when it is due, not before (to within
    /// its poll interval, 1 s by default), and a restart in between changes nothing
    /// (the row waits in the outbox). Only the outbox schedules: [`enqueue`](crate::outbox::enqueue),
    /// a handler's [`Context::schedule`](crate::Context::schedule); the
    /// [`Publisher`](crate::Publisher) refuses a scheduled message
    /// ([`PublishError::Scheduled`]). Cancel it before it is due with
    /// [`outbox::cancel`](crate::outbox::cancel), by the id it was given.
    #[must_use]
    pub fn deliver(mut self, when: impl Into<When>) -> Self {
        self.due = Some(when.into());
        self
    }

    /// When it is due, if it is scheduled.
    pub fn due(&self) -> Option<When> {
        self.due
    }

    /// Sets the AMQP `content_type`.
    #[must_use]
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Sets the AMQP `type`: the message type's name on the wire, which routes it
    /// on a queue consumed by several handlers (see [`MessageType`](crate::MessageType)).
    #[must_use]
    pub fn message_type(mut self, name: impl Into<String>) -> Self {
        self.message_type = Some(name.into());
        self
    }

    /// Sets the AMQP `correlation_id`.
    #[must_use]
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Adds a string header.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The exchange it goes to (`""`: the default exchange).
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// Its routing key (a queue's name, on the default exchange).
    pub fn routing_key(&self) -> &str {
        &self.routing_key
    }

    /// Its body, as published.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Its AMQP `type`, if it has one.
    pub fn kind(&self) -> Option<&str> {
        self.message_type.as_deref()
    }

    /// Its AMQP `message_id`: a handler's messages have theirs set when published.
    pub fn id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// Its string headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The reply to a request: to `reply_to` on the default exchange, with the
    /// request's correlation id. Replies to direct reply-to are best effort.
    pub(crate) fn reply(request: &Request, message_id: String, body: Vec<u8>, ok: bool) -> Self {
        let mut headers =
            BTreeMap::from([(STATUS_HEADER.to_owned(), if ok { "ok" } else { "error" }.to_owned())]);
        if let Some(trace) = &request.trace {
            headers.extend(trace.child_headers());
        }
        Self {
            exchange: REPLY_EXCHANGE.to_owned(),
            routing_key: request.reply_to.clone(),
            body,
            message_id: Some(message_id),
            content_type: Some("application/json".to_owned()),
            correlation_id: Some(request.correlation_id.clone()),
            message_type: None,
            headers,
            mandatory: !request.reply_to.starts_with(DIRECT_REPLY_TO),
            reply: Some(Expiry { within: request.expires_in }),
            due: None,
        }
    }
}

impl Outgoing {
    /// The AMQP properties this message is published with, under `message_id`
    /// (persistent): what `Publisher::send` and the test kit set alike.
    pub(crate) fn properties(&self, message_id: &str) -> BasicProperties {
        properties(
            message_id,
            self.content_type.as_deref(),
            self.correlation_id.as_deref(),
            self.message_type.as_deref(),
            &self.headers,
        )
    }
}

/// The AMQP properties an outbox row is published with (persistent).
pub(crate) fn properties(
    message_id: &str,
    content_type: Option<&str>,
    correlation_id: Option<&str>,
    message_type: Option<&str>,
    headers: &BTreeMap<String, String>,
) -> BasicProperties {
    let mut properties = BasicProperties::default().with_delivery_mode(2).with_message_id(message_id.into());
    if let Some(content_type) = content_type {
        properties = properties.with_content_type(content_type.into());
    }
    if let Some(correlation_id) = correlation_id {
        properties = properties.with_correlation_id(correlation_id.into());
    }
    if let Some(message_type) = message_type {
        properties = properties.with_type(message_type.into());
    }
    if !headers.is_empty() {
        let mut table = lapin::types::FieldTable::default();
        for (name, value) in headers {
            table.insert(name.as_str().into(), AMQPValue::LongString(value.as_str().into()));
        }
        properties = properties.with_headers(table);
    }
    properties
}

fn short(what: &'static str, name: &str) -> Result<(), PublishError> {
    if name.len() > 255 {
        return Err(PublishError::TooLong { what, len: name.len() });
    }
    no_nul(what, name)
}

/// The most header bytes an outgoing message may carry: its header frame must stay
/// well under the broker's `frame_max` (131,072 bytes by default).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// PostgreSQL `text` cannot hold a NUL byte: a row holding one could never be written,
/// and its whole batch would fail with it, again and again.
fn no_nul(what: &'static str, text: &str) -> Result<(), PublishError> {
    if text.contains('\0') {
        return Err(PublishError::Nul { what });
    }
    Ok(())
}

impl Outgoing {
    /// Checks what the builder methods took unchecked.
    pub(crate) fn validate(&self) -> Result<(), PublishError> {
        for (what, text) in [
            ("the message id", self.message_id.as_deref()),
            ("the content type", self.content_type.as_deref()),
            ("the correlation id", self.correlation_id.as_deref()),
            ("the message type", self.message_type.as_deref()),
        ] {
            no_nul(what, text.unwrap_or_default())?;
        }
        if let Some(message_type) = &self.message_type {
            short("the message type", message_type)?;
        }
        let mut header_bytes = 0;
        for (name, value) in &self.headers {
            no_nul("a header", name)?;
            no_nul("a header", value)?;
            header_bytes += name.len() + value.len();
        }
        if header_bytes > MAX_HEADER_BYTES {
            // A header frame over the broker's frame_max (~128 KiB) closes the connection.
            return Err(PublishError::TooLong { what: "the headers", len: header_bytes });
        }
        Ok(())
    }
}

/// Why a message could not go into the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The message could not be serialized to JSON (serde's error is the source).
    #[error("the message cannot be serialized to JSON")]
    Serialize(#[source] serde_json::Error),
    /// An exchange name or routing key over AMQP's limit (255 bytes), or headers
    /// over [`MAX_HEADER_BYTES`].
    #[error("{what} is {len} bytes, over what one message may carry (names 255, headers 65,536)")]
    TooLong {
        /// Which name.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// A name, id or header holds a NUL byte (PostgreSQL `text` cannot store it).
    #[error("{what} holds a NUL byte, which the outbox (PostgreSQL text) cannot store")]
    Nul {
        /// Which part.
        what: &'static str,
    },
    /// Writing the outbox row failed (the transaction is aborted: return the error).
    /// The driver's error is the source.
    #[error("writing the outbox row failed")]
    Database(#[source] diesel::result::Error),
    /// [`Publisher`](crate::Publisher): the broker took the message but no queue is
    /// bound to take it (it was published `mandatory` and returned): nothing has it.
    #[error(
        "no queue takes messages published to exchange '{exchange}' with routing key '{routing_key}' \
         (the broker returned it unroutable): declare and bind a queue for them, or publish where one is bound"
    )]
    Unroutable {
        /// The exchange it was published to (`""`: the default exchange).
        exchange: String,
        /// Its routing key.
        routing_key: String,
    },
    /// [`Publisher`](crate::Publisher): the exchange does not exist on the broker
    /// (nothing was published).
    #[error(
        "exchange '{exchange}' does not exist: declare it first (Topology::declare, or `<app> declare`)"
    )]
    NoExchange {
        /// The exchange's name.
        exchange: String,
    },
    /// [`Publisher`](crate::Publisher): no confirm came within the publisher's
    /// timeout, reconnecting and publishing again included (the broker out of reach,
    /// or nacking). The broker may have it or not: publishing it again under the same
    /// message id is safe for consumers keyed on it.
    #[error(
        "the broker did not confirm the message within {}: {reason}; it may or may not have it \
         (publishing it again under the same message id is safe for consumers keyed on it)",
        crate::base::duration::human(*after)
    )]
    Unconfirmed {
        /// How long the publisher tried.
        after: std::time::Duration,
        /// The last fault met, passwords redacted.
        reason: String,
    },
    /// [`Publisher`](crate::Publisher): the broker refused the publisher's connection
    /// in a way no retry mends (the login, the vhost, a certificate).
    #[error("the publisher cannot connect to RabbitMQ")]
    Connect(#[source] Box<crate::error::Error>),
    /// [`Publisher`](crate::Publisher): it was closed ([`Publisher::close`](crate::Publisher::close)).
    #[error("the publisher is closed")]
    Closed,
    /// [`Publisher`](crate::Publisher): the message is scheduled
    /// ([`Outgoing::deliver`]), and only the outbox keeps a message until it is due.
    #[error(
        "a scheduled message goes through the outbox, which keeps it until it is due: write it with \
         outbox::enqueue in a transaction (or Context::schedule in a handler), not with the Publisher"
    )]
    Scheduled,
}

/// `<sha256(scope, key, part) in hex, 32 digits>`: the message id of a handler's
/// `part`-th published message (or its reply) for `key`.
pub(crate) fn message_id(scope: &str, key: &str, part: &str) -> String {
    let digest = Sha256::new()
        .chain_update(scope.as_bytes())
        .chain_update([0])
        .chain_update(key.as_bytes())
        .chain_update([0])
        .chain_update(part.as_bytes())
        .finalize();
    hex(&digest[..16])
}

/// The idempotency key of a handler's outbound call for `purpose` on the message
/// keyed `key`: a UUID (RFC 9562 version 8, made of a SHA-256 of the three), so
/// APIs that insist on a UUID take it.
pub(crate) fn idempotency_key(scope: &str, key: &str, purpose: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"idemq idempotency key\0")
        .chain_update(scope.as_bytes())
        .chain_update([0])
        .chain_update(key.as_bytes())
        .chain_update([0])
        .chain_update(purpose.as_bytes())
        .finalize();
    let mut bytes = [0_u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = hex(&bytes);
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// What a request carries: where its reply goes, and for how long it is wanted.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) reply_to: String,
    pub(crate) correlation_id: String,
    /// How long its requester waits, counted from now (its consumption): its AMQP
    /// `expiration` — or, on a retry copy (which never carries one), the original's
    /// kept in `x-idemq-original-expiration` — at least [`MIN_REPLY_WINDOW`]. Counted
    /// from consumption rather than publication (unknown), so it is an upper bound:
    /// a reply is never dropped while its requester may still wait.
    pub(crate) expires_in: Option<Duration>,
    /// The request's W3C trace: its reply continues it.
    pub(crate) trace: Option<crate::base::trace::Trace>,
}

impl Request {
    /// A delivery with both `reply_to` and `correlation_id` is a request.
    pub(crate) fn of(properties: &BasicProperties) -> Option<Self> {
        let reply_to = properties.reply_to().as_ref()?.as_str();
        let correlation_id = properties.correlation_id().as_ref()?.as_str();
        if reply_to.is_empty() {
            return None;
        }
        if reply_to.contains('\0') || correlation_id.contains('\0') {
            // Unanswerable: the reply's row could not be stored (a NUL in text).
            crate::base::log::warn!(
                "a request whose reply_to or correlation_id holds a NUL byte gets no reply"
            );
            return None;
        }
        let expiration = properties.expiration().as_ref().map(|e| e.as_str().to_owned()).or_else(|| {
            crate::base::amqp_value::header(properties, crate::base::headers::ORIGINAL_EXPIRATION)
                .and_then(crate::base::amqp_value::string)
        });
        // RabbitMQ accepts only a count of milliseconds; anything else is ignored.
        let expires_in = expiration
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .map(|ms| Duration::from_millis(ms).max(MIN_REPLY_WINDOW));
        Some(Self {
            reply_to: reply_to.to_owned(),
            correlation_id: correlation_id.to_owned(),
            expires_in,
            trace: crate::base::trace::Trace::of(properties),
        })
    }
}

/// The body of the error reply to a request that failed permanently.
pub(crate) fn error_reply(kind: &str, error: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "error": error, "kind": kind }))
        .unwrap_or_else(|_| b"{}".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Typed {
        id: u32,
    }
    impl Message for Typed {
        const EXCHANGE: &'static str = "events";
        const ROUTING_KEY: &'static str = "typed";
        const TYPE: Option<&'static str> = Some("thing.happened");
        const VERSION: Option<u32> = Some(3);
    }

    #[derive(Serialize)]
    struct Plain;
    impl Message for Plain {
        const EXCHANGE: &'static str = "";
        const ROUTING_KEY: &'static str = "q";
    }

    #[test]
    fn a_typed_message_is_sent_with_its_type_and_version() {
        let outgoing = Outgoing::of(&Typed { id: 1 }).unwrap();
        assert_eq!((outgoing.exchange(), outgoing.routing_key()), ("events", "typed"));
        assert_eq!(outgoing.kind(), Some("thing.happened"));
        assert_eq!(outgoing.headers().get(crate::base::headers::VERSION).map(String::as_str), Some("3"));
        let properties = properties("m", None, None, outgoing.kind(), outgoing.headers());
        assert_eq!(properties.kind().as_ref().map(|k| k.as_str()), Some("thing.happened"));
        let plain = Outgoing::of(&Plain).unwrap();
        assert_eq!((plain.kind(), plain.headers().len()), (None, 0));
    }

    #[test]
    fn a_message_type_over_255_bytes_is_refused() {
        let outgoing = Outgoing::of(&Plain).unwrap().message_type("t".repeat(256));
        assert!(matches!(outgoing.validate(), Err(PublishError::TooLong { .. })));
    }
}
