//! The transactional outbox: messages published exactly when their transaction commits.
//!
//! A handler publishes through its [`Context`]: `ctx.publish(exchange, routing_key,
//! &msg)` only *buffers* the message. After the handler returned `Ok`, the runtime
//! writes the buffered messages of the whole batch into `idemq_outbox` in one
//! statement, in the transaction that holds the dedup rows, and COMMITs. Rolled back,
//! nothing is published; committed, the [relay](crate::Relay) publishes each row with
//! publisher confirms and `mandatory`, and deletes it once the broker confirmed it.
//!
//! Message ids are deterministic: the `n`-th message a handler publishes for key `k`
//! gets `message_id(handler scope, k, n)` (32 hex digits of a SHA-256). A retried
//! attempt publishes under the same ids (only one attempt ever commits), and a relay
//! re-send after a crash carries the id of its row: a downstream consumer keyed on
//! the message id applies it once. Outside a handler, [`enqueue`] writes a row in the
//! caller's transaction with the id the caller gave or a random (v4 UUID) one, stored
//! with the row — stable across re-sends, which is all the downstream dedup needs.
//!
//! Replies expire; events never do. A reply whose requester is gone (an auto-delete or
//! exclusive `reply_to` queue goes away with its client) is returned as unroutable on
//! every try, so the relay deletes a reply row unpublished once it is older than the
//! reply TTL ([`RelayBuilder::reply_ttl`](crate::RelayBuilder::reply_ttl), default
//! 1 h) or its request's own AMQP `expiration` has passed since the request was
//! consumed, whichever comes first.

use std::collections::BTreeMap;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use lapin::types::AMQPValue;
use lapin::BasicProperties;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::handler::key::hex;
use crate::handler::HandlerError;

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
/// [`Context::publish`], [`Context::send`]. Written by `#[derive(Message)]`
/// (`#[message(exchange = "payments", routing_key = "payment.applied")]`).
pub trait Message: Serialize {
    /// The exchange it is published to (`""`: the default exchange).
    const EXCHANGE: &'static str;
    /// Its routing key (on the default exchange: the queue's name).
    const ROUTING_KEY: &'static str;

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
    pub(crate) headers: BTreeMap<String, String>,
    /// `false`: best effort (direct reply-to): published once, without `mandatory`.
    pub(crate) mandatory: bool,
    /// The reply to a request, which expires (see the module docs); `None`: an event.
    pub(crate) reply: Option<Expiry>,
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
            headers: BTreeMap::new(),
            mandatory: true,
            reply: None,
        })
    }

    /// Sets the AMQP `message_id` (outside a handler; a handler's messages get
    /// deterministic ids).
    #[must_use]
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the AMQP `content_type`.
    #[must_use]
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
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

    /// The reply to a request: to `reply_to` on the default exchange, with the
    /// request's correlation id. Replies to direct reply-to are best effort.
    pub(crate) fn reply(request: &Request, message_id: String, body: Vec<u8>, ok: bool) -> Self {
        Self {
            exchange: REPLY_EXCHANGE.to_owned(),
            routing_key: request.reply_to.clone(),
            body,
            message_id: Some(message_id),
            content_type: Some("application/json".to_owned()),
            correlation_id: Some(request.correlation_id.clone()),
            headers: BTreeMap::from([(STATUS_HEADER.to_owned(), if ok { "ok" } else { "error" }.to_owned())]),
            mandatory: !request.reply_to.starts_with(DIRECT_REPLY_TO),
            reply: Some(Expiry { within: request.expires_in }),
        }
    }
}

/// The AMQP properties an outbox row is published with (persistent).
pub(crate) fn properties(
    message_id: &str,
    content_type: Option<&str>,
    correlation_id: Option<&str>,
    headers: &BTreeMap<String, String>,
) -> BasicProperties {
    let mut properties = BasicProperties::default().with_delivery_mode(2).with_message_id(message_id.into());
    if let Some(content_type) = content_type {
        properties = properties.with_content_type(content_type.into());
    }
    if let Some(correlation_id) = correlation_id {
        properties = properties.with_correlation_id(correlation_id.into());
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
    fn validate(&self) -> Result<(), PublishError> {
        for (what, text) in [
            ("the message id", self.message_id.as_deref()),
            ("the content type", self.content_type.as_deref()),
            ("the correlation id", self.correlation_id.as_deref()),
        ] {
            no_nul(what, text.unwrap_or_default())?;
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
    /// The message could not be serialized to JSON.
    #[error("the message cannot be serialized to JSON: {0}")]
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
    #[error("writing the outbox row failed: {0}")]
    Database(#[source] diesel::result::Error),
}

/// Writes `outgoing` into the outbox in the caller's open transaction (any
/// diesel-async transaction: it is published once that commits, never if it rolls
/// back). Returns the message id: the one given with [`Outgoing::message_id`], or a
/// random one stored with the row.
///
/// Inside a handler, use [`Context::publish`] instead (deterministic ids, one
/// statement per batch). The relay of a running [`Runtime`](crate::Runtime) picks
/// the row up within its poll interval, or at once if something notifies it.
///
/// ```no_run
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// use diesel_async::AsyncConnection;
/// use idemq::{enqueue, Outgoing};
///
/// conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
///     // ... the application's own writes ...
///     enqueue(conn, Outgoing::json("orders", "order.placed", &serde_json::json!({"id": 7}))?.message_id("order-7"))
///         .await?;
///     Ok(())
/// })
/// .await
/// .map_err(|err| err.to_string())?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`PublishError::Database`].
pub async fn enqueue(conn: &mut AsyncPgConnection, outgoing: Outgoing) -> Result<String, PublishError> {
    outgoing.validate()?;
    let id = outgoing.message_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let row = Outgoing { message_id: Some(id.clone()), ..outgoing };
    crate::store::db::insert_outbox(conn, std::slice::from_ref(&row))
        .await
        .map_err(PublishError::Database)?;
    Ok(id)
}

/// Deletes the dedup row of `key` under `handler` (its scope: the name, or
/// `<namespace>/<name>`), so the next message with that key is applied as new.
/// Returns whether there was one.
///
/// For operators: a request whose permanent failure was stored (its duplicates get
/// the same error reply) can be applied after the cause is fixed by forgetting its
/// key and replaying its dead letter. Forgetting the key of an *applied* message
/// makes its next copy apply again: only do it for a message whose effect you know
/// did not happen.
///
/// ```no_run
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// // The handler `apply_payment` may now apply payment p-17 again (its dead letter replayed).
/// idemq::forget(conn, "apply_payment", "p-17").await?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// The database's.
pub async fn forget(conn: &mut AsyncPgConnection, handler: &str, key: &str) -> diesel::QueryResult<bool> {
    crate::store::db::forget(conn, handler, key).await
}

/// Rows waiting in the outbox (due or postponed): the relay's backlog.
///
/// # Errors
/// The database's.
pub async fn backlog(conn: &mut AsyncPgConnection) -> diesel::QueryResult<i64> {
    crate::store::db::outbox_backlog(conn).await
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
            tracing::warn!("a request whose reply_to or correlation_id holds a NUL byte gets no reply");
            return None;
        }
        let expiration = properties.expiration().as_ref().map(|e| e.as_str().to_owned()).or_else(|| {
            crate::base::amqp_value::header(
                properties,
                crate::broker::dead_letter::headers::ORIGINAL_EXPIRATION,
            )
            .and_then(crate::base::amqp_value::string)
        });
        // RabbitMQ accepts only a count of milliseconds; anything else is ignored.
        let expires_in = expiration
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .map(|ms| Duration::from_millis(ms).max(MIN_REPLY_WINDOW));
        Some(Self { reply_to: reply_to.to_owned(), correlation_id: correlation_id.to_owned(), expires_in })
    }
}

/// What a handler's run gives a message: the delivery's metadata, and the outbox.
///
/// Take it as a third argument (`ctx: &mut Context`, or `&Context` to read only):
///
/// ```
/// use diesel_async::AsyncPgConnection;
/// use idemq::{idempotent_handler, Context, HandlerError};
/// # #[derive(serde::Deserialize)] struct Order { id: String }
/// # #[derive(serde::Serialize)] struct Shipped<'a> { order_id: &'a str }
///
/// #[idempotent_handler(key = "id")]
/// async fn ship(conn: &mut AsyncPgConnection, order: Order, ctx: &mut Context) -> Result<(), HandlerError> {
///     // ... write the shipment with `conn` ...
///     # let _ = conn;
///     ctx.publish("", "orders.shipped", &Shipped { order_id: &order.id })?;
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct Context {
    scope: String,
    key: String,
    attempt: u32,
    redelivered: bool,
    properties: BasicProperties,
    published: Vec<Outgoing>,
    /// `dedup = false`: message ids are random (stored with their rows).
    random_ids: bool,
}

impl Context {
    pub(crate) fn new(
        scope: &str,
        key: &str,
        attempt: u32,
        redelivered: bool,
        properties: &BasicProperties,
    ) -> Self {
        Self {
            scope: scope.to_owned(),
            key: key.to_owned(),
            attempt,
            redelivered,
            properties: properties.clone(),
            published: Vec::new(),
            random_ids: false,
        }
    }

    /// Gives published messages random ids (a handler without dedup rows).
    pub(crate) fn use_random_ids(&mut self) {
        self.random_ids = true;
    }

    /// Publishes `message` as JSON to `exchange` with `routing_key` once this
    /// handler's transaction commits (never if it rolls back). Returns its message id.
    ///
    /// # Errors
    /// [`PublishError::Serialize`] or [`PublishError::TooLong`]; with `?` a
    /// transient handler error (retried).
    pub fn publish<T: Serialize + ?Sized>(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: &T,
    ) -> Result<String, PublishError> {
        self.publish_outgoing(Outgoing::json(exchange, routing_key, message)?)
    }

    /// Publishes a [`Message`] where it says it goes; see [`Context::publish`].
    ///
    /// # Errors
    /// As [`Context::publish`].
    pub fn send<M: Message>(&mut self, message: &M) -> Result<String, PublishError> {
        self.publish(M::EXCHANGE, message.routing_key(), message)
    }

    /// Publishes a message built by hand (headers, a body that is not JSON); its
    /// message id is the handler's deterministic one, whatever it set.
    ///
    /// # Errors
    /// None today; kept fallible like [`Context::publish`].
    pub fn publish_outgoing(&mut self, outgoing: Outgoing) -> Result<String, PublishError> {
        outgoing.validate()?;
        let id = if self.random_ids {
            uuid::Uuid::new_v4().simple().to_string()
        } else {
            message_id(&self.scope, &self.key, &self.published.len().to_string())
        };
        self.published.push(Outgoing { message_id: Some(id.clone()), ..outgoing });
        Ok(id)
    }

    /// The handler's dedup scope (its name, or `<namespace>/<name>`).
    pub fn handler(&self) -> &str {
        &self.scope
    }

    /// The message's stored dedup key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This attempt's number: 1, then one more per retry.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether the broker redelivered this delivery (a consumer before may have
    /// started it; its transaction, if any, did not commit).
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The delivery's AMQP `message_id`, if it has one.
    pub fn message_id(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|id| id.as_str())
    }

    /// The delivery's AMQP `correlation_id`, if it has one.
    pub fn correlation_id(&self) -> Option<&str> {
        self.properties.correlation_id().as_ref().map(|id| id.as_str())
    }

    /// The delivery's AMQP `reply_to`, if it has one. A request (`reply_to` and
    /// `correlation_id`) is answered with the handler's result by idemq itself.
    pub fn reply_to(&self) -> Option<&str> {
        self.properties.reply_to().as_ref().map(|queue| queue.as_str())
    }

    /// A header of the delivery, if it is a string (valid UTF-8: a byte string that
    /// is not is `None`, never a lossy reading).
    pub fn header(&self, name: &str) -> Option<String> {
        crate::base::amqp_value::header(&self.properties, name).and_then(crate::base::amqp_value::string)
    }

    /// The messages published so far, taken by the runtime after the handler ran.
    pub(crate) fn take_published(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.published)
    }
}

/// What a handler returned, serialized: stored with the dedup row and sent as the
/// reply to a request. `()` (and any value serializing to `null`) stores nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerOutput(pub(crate) Option<Vec<u8>>);

impl HandlerOutput {
    /// Nothing to store.
    pub fn none() -> Self {
        Self(None)
    }

    /// `value` as JSON.
    ///
    /// # Errors
    /// A permanent [`HandlerError`] if it cannot be serialized: the same value
    /// would fail again.
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<Self, HandlerError> {
        let bytes = serde_json::to_vec(value).map_err(|err| {
            HandlerError::permanent(format!("the handler's result cannot be serialized to JSON: {err}"))
        })?;
        Ok(Self((bytes != b"null").then_some(bytes)))
    }

    /// The reply body: the stored JSON, or `null`.
    pub(crate) fn reply_body(stored: Option<&[u8]>) -> Vec<u8> {
        stored.map_or_else(|| b"null".to_vec(), <[u8]>::to_vec)
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

    #[test]
    fn message_ids_are_deterministic_and_keep_their_parts_apart() {
        assert_eq!(message_id("h", "k", "0"), message_id("h", "k", "0"));
        assert_eq!(message_id("h", "k", "0").len(), 32);
        assert_ne!(message_id("h", "k", "0"), message_id("h", "k", "1"));
        assert_ne!(message_id("h", "k", "0"), message_id("h", "k", "reply"));
        // The separators keep `(ab, c)` apart from `(a, bc)`.
        assert_ne!(message_id("ab", "c", "0"), message_id("a", "bc", "0"));
    }

    #[test]
    fn published_messages_are_numbered_in_order() {
        let mut ctx = Context::new("h", "k", 1, false, &BasicProperties::default());
        let first = ctx.publish("", "q", &1).unwrap();
        let second = ctx.publish("", "q", &2).unwrap();
        assert_eq!(first, message_id("h", "k", "0"));
        assert_eq!(second, message_id("h", "k", "1"));
        let published = ctx.take_published();
        assert_eq!(published.len(), 2);
        assert_eq!(published[1].body, b"2");
    }

    #[test]
    fn without_dedup_two_deliveries_of_one_key_publish_under_different_ids() {
        let ids: Vec<String> = (0..2)
            .map(|_| {
                let mut ctx = Context::new("h", "k", 1, false, &BasicProperties::default());
                ctx.use_random_ids();
                ctx.publish("", "q", &1).unwrap()
            })
            .collect();
        assert_ne!(ids[0], ids[1]);
        assert_ne!(ids[0], message_id("h", "k", "0"));
    }

    #[test]
    fn a_name_over_255_bytes_is_refused_when_published_not_by_the_broker() {
        let mut ctx = Context::new("h", "k", 1, false, &BasicProperties::default());
        let err = ctx.publish("", &"q".repeat(256), &1).unwrap_err();
        assert!(matches!(err, PublishError::TooLong { len: 256, .. }), "{err}");
    }

    #[test]
    fn a_nul_byte_is_refused_when_published_and_a_request_holding_one_is_not_answered() {
        let mut ctx = Context::new("h", "k", 1, false, &BasicProperties::default());
        assert!(matches!(ctx.publish("", "q\0", &1), Err(PublishError::Nul { .. })));
        let header = Outgoing::json("", "q", &1).unwrap().header("x-a", "b\0c");
        assert!(matches!(ctx.publish_outgoing(header), Err(PublishError::Nul { .. })));
        let request = BasicProperties::default().with_reply_to("r".into()).with_correlation_id("c\0".into());
        assert!(Request::of(&request).is_none());
        let fine = BasicProperties::default().with_reply_to("r".into()).with_correlation_id("c".into());
        assert!(Request::of(&fine).is_some());
    }

    #[test]
    fn replies_to_direct_reply_to_are_best_effort() {
        let request = Request {
            reply_to: "amq.rabbitmq.reply-to.g1h2AA".into(),
            correlation_id: "c".into(),
            expires_in: None,
        };
        assert!(!Outgoing::reply(&request, "id".into(), b"1".to_vec(), true).mandatory);
        let named = Request { reply_to: "replies".into(), correlation_id: "c".into(), expires_in: None };
        assert!(Outgoing::reply(&named, "id".into(), b"1".to_vec(), true).mandatory);
    }

    #[test]
    fn a_reply_expires_within_its_requests_expiration_and_an_event_never() {
        let request = |properties: BasicProperties| {
            Request::of(&properties.with_reply_to("r".into()).with_correlation_id("c".into()))
                .expect("a request")
        };
        let within = |properties| request(properties).expires_in;
        let plain = BasicProperties::default();
        assert_eq!(within(plain.clone()), None);
        assert_eq!(within(plain.clone().with_expiration("2500".into())), Some(Duration::from_millis(2500)));
        // `0` (deliver now or drop) is not how long the requester waits.
        assert_eq!(within(plain.clone().with_expiration("0".into())), Some(MIN_REPLY_WINDOW));
        assert_eq!(within(plain.clone().with_expiration("soon".into())), None);
        // A retry copy carries the original's expiration in a header.
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(
            crate::broker::dead_letter::headers::ORIGINAL_EXPIRATION.into(),
            AMQPValue::LongString("60000".into()),
        );
        assert_eq!(within(plain.clone().with_headers(headers)), Some(Duration::from_secs(60)));

        let reply =
            Outgoing::reply(&request(plain.with_expiration("2500".into())), "id".into(), vec![], true);
        assert_eq!(reply.reply, Some(Expiry { within: Some(Duration::from_millis(2500)) }));
        assert_eq!(Outgoing::json("", "q", &1).unwrap().reply, None, "an event never expires");
    }

    #[test]
    fn unit_results_store_nothing() {
        assert_eq!(HandlerOutput::json(&()).unwrap(), HandlerOutput::none());
        assert_eq!(HandlerOutput::json(&Some(3)).unwrap().0.as_deref(), Some(&b"3"[..]));
    }
}
