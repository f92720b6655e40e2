//! What the test kit delivers ([`TestMessage`]: a body with the AMQP properties and
//! headers a real publisher sets; [`IntoTestMessage`]: what each helper takes) and
//! what it reads back ([`Reply`], and the [`Outgoing`] rows a handler published).

use idemq_core::__private::sibling;
use std::collections::BTreeMap;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use serde::de::DeserializeOwned;
use serde::Serialize;

use idemq_core::headers::VERSION as VERSION_HEADER;
use idemq_core::Outcome;
use idemq_core::{
    outbox::{Outgoing, STATUS_HEADER},
    Message,
};

/// A message as a publisher sends it: a body, and the properties and headers that
/// `@message_id`, `@header:` and `@correlation_id` keys, requests (`reply_to` and
/// `correlation_id`), content-type checks, message types and versions read. Every
/// helper of [`TestKit`](super::TestKit) takes one (see [`IntoTestMessage`]).
///
/// [`TestMessage::of`] makes one of an [`idemq::Message`](idemq_core::Message) type
/// exactly as [`Publisher::send`](idemq_core::Publisher::send) publishes it: its AMQP
/// `type` and its [`x-idemq-version`](idemq_core::headers::VERSION) header set, so a
/// queue's handlers route it by its type and a versioned handler reads it as the
/// version it is. [`TestMessage::json`] is the bare body (no type, no version: a
/// versioned handler reads it as version 1), as an old or foreign publisher sends it.
///
/// ```
/// # use idemq::testing::TestMessage;
/// #[derive(serde::Serialize, serde::Deserialize, idemq::Message)]
/// #[message(type = "payment.requested", version = 2, exchange = "payments", routing_key = "requested")]
/// struct PaymentRequested { payment_id: String, amount_cents: i64 }
///
/// let typed = TestMessage::of(&PaymentRequested { payment_id: "p-1".into(), amount_cents: 250 });
/// assert_eq!(typed.properties().kind().as_ref().map(|t| t.as_str()), Some("payment.requested"));
/// let headers = typed.properties().headers().clone().unwrap_or_default();
/// assert!(headers.inner().keys().any(|name| name.as_str() == idemq::headers::VERSION));
/// ```
///
/// A type that names itself without a route (`#[message(type = "...")]` alone is an
/// [`idemq::MessageType`](idemq_core::MessageType), not a `Message`) is typed by hand,
/// and so is any version a test wants to send:
///
/// ```
/// # use idemq::testing::TestMessage;
/// # use idemq::MessageType;
/// #[derive(serde::Serialize, idemq::Message)]
/// #[message(type = "payment.refunded")]
/// struct Refund { payment_id: String }
///
/// let refund = TestMessage::json(&Refund { payment_id: "p-1".into() })
///     .message_type(Refund::TYPE)
///     .version(1);
/// # let _ = refund;
/// ```
///
/// Properties and headers, as any publisher may set them:
///
/// ```
/// # use idemq::testing::TestMessage;
/// # #[derive(serde::Serialize)] struct Payment { payment_id: String }
/// let message = TestMessage::json(&Payment { payment_id: "p-1".into() })
///     .message_id("m-1")
///     .header("tenant", "acme")
///     .header("x-priority", 3);
/// # let _ = message;
/// ```
#[derive(Debug, Clone)]
pub struct TestMessage {
    pub(super) body: Vec<u8>,
    pub(super) properties: BasicProperties,
}

impl TestMessage {
    /// `message` as JSON, `content-type: application/json`, persistent — what the
    /// kit's [`deliver`](super::TestKit::deliver) sends.
    ///
    /// # Panics
    /// If `message` does not serialize to JSON.
    pub fn json<M: Serialize + ?Sized>(message: &M) -> Self {
        let body = serde_json::to_vec(message).expect("the test message serializes to JSON");
        Self::bytes(body).content_type("application/json")
    }

    /// `message` exactly as [`Publisher::send`](idemq_core::Publisher::send) publishes it:
    /// JSON, `content-type: application/json`, persistent, a fresh random
    /// `message_id` (32 hex digits; [`message_id`](Self::message_id) replaces it),
    /// its [`Message::TYPE`] as the AMQP `type` and its [`Message::VERSION`] in the
    /// [`x-idemq-version`](idemq_core::headers::VERSION) header (a text, as `send` writes
    /// it). Delivered again (as [`TestKit::deliver_twice`](super::TestKit::deliver_twice)
    /// does), it keeps its `message_id`: a publisher's retry, not a new message.
    ///
    /// The kit publishes to its own queue: the type's exchange and routing key are
    /// not used.
    ///
    /// # Panics
    /// If `send` would refuse it (it does not serialize to JSON, or its type name is
    /// longer than AMQP's 255 bytes), saying why.
    pub fn of<M: Message>(message: &M) -> Self {
        let outgoing = Outgoing::of(message)
            .and_then(|outgoing| sibling::validate(&outgoing).map(|()| outgoing))
            .unwrap_or_else(|err| {
                panic!("Publisher::send would refuse this {}: {err}", std::any::type_name::<M>())
            });
        let id = sibling::random_id();
        let properties = sibling::properties(&outgoing, &id);
        Self { body: outgoing.body().to_vec(), properties }
    }

    /// An outbox row as the relay publishes it: its body, and its properties with
    /// its message id.
    pub(super) fn relayed(outgoing: &Outgoing) -> Self {
        let id = outgoing.id().unwrap_or_default();
        Self { body: outgoing.body().to_vec(), properties: sibling::properties(outgoing, id) }
    }

    /// A body as it is, persistent, with no content type (e.g. to test what is not
    /// JSON, or a publisher that sets none).
    pub fn bytes(body: impl Into<Vec<u8>>) -> Self {
        Self { body: body.into(), properties: BasicProperties::default().with_delivery_mode(2) }
    }

    /// The AMQP `content_type`.
    #[must_use]
    pub fn content_type(mut self, content_type: &str) -> Self {
        self.properties = self.properties.with_content_type(ShortString::from(content_type));
        self
    }

    /// The AMQP `message_id`.
    #[must_use]
    pub fn message_id(mut self, id: &str) -> Self {
        self.properties = self.properties.with_message_id(ShortString::from(id));
        self
    }

    /// The AMQP `correlation_id`.
    #[must_use]
    pub fn correlation_id(mut self, id: &str) -> Self {
        self.properties = self.properties.with_correlation_id(ShortString::from(id));
        self
    }

    /// The AMQP `type`: the message type's name, which routes it on a queue several
    /// handlers consume.
    #[must_use]
    pub fn message_type(mut self, name: &str) -> Self {
        self.properties = self.properties.with_type(ShortString::from(name));
        self
    }

    /// The [`x-idemq-version`](idemq_core::headers::VERSION) header, as
    /// [`Publisher::send`](idemq_core::Publisher::send) writes it (the number as text):
    /// which version of its [`Versioned`](idemq_core::Versioned) type the body is. Without
    /// it, a versioned handler reads the body as version 1.
    #[must_use]
    pub fn version(self, version: u32) -> Self {
        self.header(VERSION_HEADER, version.to_string())
    }

    /// The AMQP `reply_to`: with a `correlation_id`, the message is a request.
    #[must_use]
    pub fn reply_to(mut self, queue: &str) -> Self {
        self.properties = self.properties.with_reply_to(ShortString::from(queue));
        self
    }

    /// The AMQP `expiration`, in milliseconds (as RabbitMQ takes it).
    #[must_use]
    pub fn expiration_ms(mut self, ms: u64) -> Self {
        self.properties = self.properties.with_expiration(ShortString::from(ms.to_string()));
        self
    }

    /// A header: text (a long string, as most publishers send), an integer or a
    /// boolean.
    #[must_use]
    pub fn header(mut self, name: &str, value: impl Into<HeaderValue>) -> Self {
        let mut headers = self.properties.headers().clone().unwrap_or_default();
        headers.insert(ShortString::from(name), value.into().0);
        self.properties = self.properties.with_headers(headers);
        self
    }

    /// The properties it is published with.
    pub fn properties(&self) -> &BasicProperties {
        &self.properties
    }

    /// The body it is published with.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// Whether it carries neither an AMQP `type` nor a version header: what a
    /// typed or versioned handler may misread (see [`TestMessage::of`]).
    pub(super) fn is_bare(&self) -> bool {
        self.properties.kind().is_none() && sibling::header(&self.properties, VERSION_HEADER).is_none()
    }

    /// Whether it is a request (`reply_to` and `correlation_id` set).
    pub(super) fn is_request(&self) -> bool {
        self.properties.reply_to().is_some() && self.properties.correlation_id().is_some()
    }

    pub(super) fn correlation(&self) -> Option<&str> {
        self.properties.correlation_id().as_ref().map(ShortString::as_str)
    }
}

/// What the helpers of [`TestKit`](super::TestKit) deliver: a [`TestMessage`], or a
/// reference to any `Serialize` value, sent as bare JSON ([`TestMessage::json`]: no
/// type, no version). For a message as [`Publisher::send`](idemq_core::Publisher::send)
/// publishes it, pass [`TestMessage::of`]`(&message)` (or call
/// [`TestKit::send`](super::TestKit::send)).
///
/// ```no_run
/// # use idemq::testing::{TestKit, TestMessage};
/// # #[derive(serde::Serialize, idemq::Message)]
/// # #[message(type = "payment.requested", exchange = "payments", routing_key = "requested")]
/// # struct PaymentRequested { payment_id: String }
/// # async fn example(kit: TestKit, payment: PaymentRequested) {
/// kit.deliver_twice(&payment).await; // bare JSON
/// kit.deliver_twice(TestMessage::of(&payment)).await; // typed and versioned, as `send` sends it
/// kit.deliver_twice(TestMessage::json(&payment).message_id("m-1")).await; // a property of the test's own
/// # }
/// ```
#[diagnostic::on_unimplemented(
    message = "the test kit cannot deliver `{Self}`",
    label = "not a `TestMessage` nor a reference to a `Serialize` value",
    note = "pass `&message` (bare JSON), `idemq::testing::TestMessage::of(&message)` (an `idemq::Message`, \
            typed and versioned as `Publisher::send` sends it) or a `TestMessage` built by hand"
)]
pub trait IntoTestMessage {
    /// The message the kit publishes.
    fn into_test_message(self) -> TestMessage;
}

impl<M: Serialize + ?Sized> IntoTestMessage for &M {
    fn into_test_message(self) -> TestMessage {
        TestMessage::json(self)
    }
}

impl IntoTestMessage for TestMessage {
    fn into_test_message(self) -> TestMessage {
        self
    }
}

impl IntoTestMessage for &TestMessage {
    fn into_test_message(self) -> TestMessage {
        self.clone()
    }
}

/// A header's value for [`TestMessage::header`].
#[derive(Debug, Clone)]
pub struct HeaderValue(AMQPValue);

impl From<&str> for HeaderValue {
    fn from(text: &str) -> Self {
        Self(AMQPValue::LongString(LongString::from(text)))
    }
}

impl From<String> for HeaderValue {
    fn from(text: String) -> Self {
        Self(AMQPValue::LongString(LongString::from(text)))
    }
}

impl From<i64> for HeaderValue {
    fn from(number: i64) -> Self {
        Self(AMQPValue::LongLongInt(number))
    }
}

impl From<i32> for HeaderValue {
    fn from(number: i32) -> Self {
        Self(AMQPValue::LongInt(number))
    }
}

impl From<bool> for HeaderValue {
    fn from(flag: bool) -> Self {
        Self(AMQPValue::Boolean(flag))
    }
}

impl From<FieldTable> for HeaderValue {
    fn from(table: FieldTable) -> Self {
        Self(AMQPValue::FieldTable(table))
    }
}

/// The answer to a request delivered by [`TestKit::request`](super::TestKit::request):
/// how the request settled, and the reply the handler's transaction put in the
/// outbox (what the relay would publish to its `reply_to`).
#[derive(Debug, Clone)]
pub struct Reply {
    /// How the request settled (a duplicated request settles as a duplicate and is
    /// answered again, with the stored reply).
    pub outcome: Outcome,
    /// The reply, if one was written (a request dead-lettered for bad input gets
    /// none).
    pub message: Option<Outgoing>,
}

impl Reply {
    /// Whether the reply says the request failed (`x-idemq-status: error`: its
    /// body is `{"error": …, "kind": …}`).
    pub fn is_error(&self) -> bool {
        self.message.as_ref().and_then(|m| m.headers().get(STATUS_HEADER)).is_some_and(|s| s == "error")
    }

    /// The reply's body, decoded.
    ///
    /// # Panics
    /// If there is no reply or it does not decode as `T`, saying which.
    pub fn json<T: DeserializeOwned>(&self) -> T {
        let message = self
            .message
            .as_ref()
            .unwrap_or_else(|| panic!("the request got no reply (it settled as {:?})", self.outcome));
        serde_json::from_slice(message.body()).unwrap_or_else(|err| {
            panic!(
                "the reply does not decode as {}: {err}; it is {}",
                std::any::type_name::<T>(),
                String::from_utf8_lossy(message.body())
            )
        })
    }
}

/// An outbox row, read back as what the handler published.
#[derive(diesel::QueryableByName)]
pub(super) struct PublishedRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    message_id: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    exchange: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    routing_key: String,
    #[diesel(sql_type = diesel::sql_types::Bytea)]
    body: Vec<u8>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    content_type: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    correlation_id: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    headers: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    message_type: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    mandatory: bool,
}

/// The columns of [`PublishedRow`] of the messages due (on the kit's clock: see
/// `TestKit::advance`), oldest row first.
pub(super) const PUBLISHED: &str =
    "SELECT message_id, exchange, routing_key, body, content_type, correlation_id, \
     headers, message_type, mandatory FROM idemq_outbox \
     WHERE coalesce(due_at, created_at) <= now() ORDER BY coalesce(due_at, created_at), id";

/// Takes the scheduled messages that are due out of the outbox (the relay's part,
/// for [`TestKit::deliver_due`](super::TestKit::deliver_due)), soonest first.
pub(super) const TAKE_DUE: &str =
    "WITH taken AS (DELETE FROM idemq_outbox WHERE due_at IS NOT NULL AND due_at <= now() \
     RETURNING id, due_at, message_id, exchange, routing_key, body, content_type, correlation_id, \
     headers, message_type, mandatory) \
     SELECT message_id, exchange, routing_key, body, content_type, correlation_id, headers, message_type, \
     mandatory FROM taken ORDER BY due_at, id";

/// The same of the scheduled messages not yet due, soonest first.
pub(super) const SCHEDULED: &str =
    "SELECT message_id, exchange, routing_key, body, content_type, correlation_id, \
     headers, message_type, mandatory FROM idemq_outbox WHERE due_at > now() ORDER BY due_at, id";

impl From<PublishedRow> for Outgoing {
    fn from(row: PublishedRow) -> Self {
        let headers: BTreeMap<String, String> =
            row.headers.and_then(|json| serde_json::from_str(&json).ok()).unwrap_or_default();
        Outgoing::from(sibling::OutboxColumns {
            exchange: row.exchange,
            routing_key: row.routing_key,
            body: row.body,
            message_id: row.message_id,
            content_type: row.content_type,
            correlation_id: row.correlation_id,
            message_type: row.message_type,
            headers,
            mandatory: row.mandatory,
        })
    }
}
