//! A handler's [`Context`] (its delivery's metadata, and the outbox it publishes
//! into) and its [`HandlerOutput`].

use lapin::BasicProperties;
use serde::Serialize;

use crate::base::observe::SagaStepKind;
use crate::base::outgoing::{message_id, Message, Outgoing, PublishError};
use crate::base::trace::{Trace, TRACEPARENT};
use crate::handler::HandlerError;

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
    /// The delivery's W3C trace (`traceparent`), passed on to what it publishes.
    trace: Option<Trace>,
    /// The correlation key of the saga the handler is a transition of.
    saga_key: Option<String>,
    /// What the step did to its saga, reported once its transaction commits.
    saga_step: Option<SagaRecord>,
}

/// What a saga step did, as the context carries it to the COMMIT (the engine adds
/// the handler's name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SagaRecord {
    pub(crate) saga: &'static str,
    pub(crate) kind: SagaStepKind,
    pub(crate) scheduled: u32,
    pub(crate) cancelled: u32,
    pub(crate) fired: bool,
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
            trace: Trace::of(properties),
            saga_key: None,
            saga_step: None,
        }
    }

    /// A context of no delivery, for calling a handler fn directly — in a unit test
    /// of its logic, say — as the runtime would for a message with `key` under the
    /// dedup scope `handler` (the handler's name): [`Context::publish`] and
    /// [`Context::send`] give the message ids the runtime would, and what was
    /// published is in [`Context::published`] (it goes nowhere: only the runtime
    /// writes it to the outbox). The delivery's metadata is empty: attempt 1, no
    /// headers, no `reply_to`.
    ///
    /// ```
    /// let mut ctx = idemq::Context::standalone("apply_payment", "p-1");
    /// ctx.publish("", "payments.applied", &serde_json::json!({ "payment_id": "p-1" }))?;
    /// assert_eq!(ctx.published().len(), 1);
    /// # Ok::<(), idemq::PublishError>(())
    /// ```
    pub fn standalone(handler: &str, key: &str) -> Self {
        Self::new(handler, key, 1, false, &BasicProperties::default())
    }

    /// What the handler published so far (in a [`Context::standalone`]: everything
    /// it published; the runtime takes them after the handler ran).
    pub fn published(&self) -> &[Outgoing] {
        &self.published
    }

    /// A context of no message, held by a `&mut Context` while the context it held
    /// is lent to a batch of one (see `batch::as_batch_of_one`).
    pub(crate) fn detached() -> Self {
        Self::new("", "", 0, false, &BasicProperties::default())
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
        self.publish_outgoing(Outgoing::of(message)?)
    }

    /// Schedules a [`Message`]: written to the outbox with this transaction, published
    /// by the relay once it is due — `when` a [`Duration`](std::time::Duration) from
    /// the transaction's start, or a [`SystemTime`](std::time::SystemTime) — never if
    /// the transaction rolls back. Returns its message id (deterministic, as every
    /// message a handler publishes): keep it to cancel the message with
    /// [`outbox::cancel`](crate::outbox::cancel) before it is due, in this handler's
    /// transaction or a later one. A timeout: `ctx.schedule(&PaymentExpired { .. },
    /// Duration::from_secs(15 * 60))`.
    ///
    /// # Errors
    /// As [`Context::publish`].
    pub fn schedule<M: Message>(
        &mut self,
        message: &M,
        when: impl Into<crate::base::outgoing::When>,
    ) -> Result<String, PublishError> {
        self.publish_outgoing(Outgoing::of(message)?.deliver(when))
    }

    /// Publishes a message built by hand (headers, a body that is not JSON); its
    /// message id is the handler's deterministic one, whatever it set. Like every
    /// message published here, it carries the delivery's trace (`traceparent`:
    /// the same trace id, a span id of its own; `tracestate` as it came) unless it
    /// sets a `traceparent` itself. With the feature `otel`, a delivery without a
    /// trace is handled in a span that starts one, and what it publishes carries it.
    ///
    /// # Errors
    /// None today; kept fallible like [`Context::publish`].
    pub fn publish_outgoing(&mut self, mut outgoing: Outgoing) -> Result<String, PublishError> {
        outgoing.validate()?;
        if !outgoing.headers.contains_key(TRACEPARENT) {
            match &self.trace {
                Some(trace) => outgoing.headers.extend(trace.child_headers()),
                // An untraced delivery: with `otel`, the handler's span started a
                // trace, which what it publishes continues.
                None => {
                    if let Some(parent) = crate::base::trace::current_traceparent() {
                        outgoing.headers.insert(TRACEPARENT.to_owned(), parent);
                    }
                }
            }
        }
        let id = if self.random_ids {
            crate::base::random_id()
        } else {
            message_id(&self.scope, &self.key, &self.published.len().to_string())
        };
        self.published.push(Outgoing { message_id: Some(id.clone()), ..outgoing });
        Ok(id)
    }

    /// A key for an outbound call that accepts one (Stripe's `Idempotency-Key`,
    /// PayPal's `PayPal-Request-Id`, …): the same on every attempt and every
    /// redelivery of this message, and for a retransmission of it (derived from the
    /// handler's scope and the message's key), different for any other handler or
    /// key. A UUID. If the handler makes several such calls, give each its own with
    /// [`idempotency_key_for`](Self::idempotency_key_for).
    ///
    /// It protects the call only while the provider keeps the key (Stripe: 24
    /// hours): declare that with `#[idempotent_handler(.., idempotency_key_lifetime =
    /// "24h")]` and `build()` warns when the handler's retries outlast it. A dead
    /// letter replayed after it is called again.
    ///
    /// ```
    /// let ctx = idemq::Context::standalone("charge", "order-7");
    /// assert_eq!(ctx.idempotency_key(), idemq::Context::standalone("charge", "order-7").idempotency_key());
    /// assert_ne!(ctx.idempotency_key(), ctx.idempotency_key_for("refund"));
    /// assert_eq!(ctx.idempotency_key().len(), 36);
    /// ```
    pub fn idempotency_key(&self) -> String {
        self.idempotency_key_for("")
    }

    /// [`idempotency_key`](Self::idempotency_key) for one of several outbound calls
    /// of the handler, named by `purpose` (`"charge"`, `"refund"`).
    pub fn idempotency_key_for(&self, purpose: &str) -> String {
        crate::base::outgoing::idempotency_key(&self.scope, &self.key, purpose)
    }

    /// The W3C trace id (32 hex digits) of the delivery's `traceparent` header, if
    /// it carried a valid one: what the handler publishes continues that trace.
    pub fn trace_id(&self) -> Option<&str> {
        self.trace.as_ref().map(Trace::trace_id)
    }

    /// The delivery's W3C trace, if it carried a valid `traceparent`: the handler's
    /// span continues it.
    pub(crate) fn trace(&self) -> Option<&Trace> {
        self.trace.as_ref()
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
    /// started it; its transaction, if any, did not commit). `false` for a
    /// redelivery of one this process held and never started when its channel
    /// closed: no handler saw it.
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
    /// Sets the correlation key of the saga the handler is a transition of (read
    /// from the message while it was prepared).
    pub(crate) fn set_saga_key(&mut self, key: String) {
        self.saga_key = Some(key);
    }

    /// The correlation key of the saga the handler is a transition of, if any.
    pub(crate) fn saga_key(&self) -> Option<&str> {
        self.saga_key.as_deref()
    }

    /// Drops the buffered messages with these ids (a completing saga's timeouts
    /// scheduled by the same step).
    pub(crate) fn unpublish(&mut self, ids: &[String]) {
        self.published.retain(|outgoing| outgoing.message_id.as_ref().is_none_or(|id| !ids.contains(id)));
    }

    /// Records what the step did to its saga (the last record wins).
    pub(crate) fn record_saga_step(&mut self, record: SagaRecord) {
        self.saga_step = Some(record);
    }

    /// What the step did to its saga, taken for the COMMIT's report.
    pub(crate) fn take_saga_step(&mut self) -> Option<SagaRecord> {
        self.saga_step.take()
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use lapin::types::AMQPValue;

    use crate::base::outgoing::{Expiry, Request, MIN_REPLY_WINDOW};

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
    fn what_a_handler_publishes_continues_the_deliverys_trace_unless_it_sets_its_own() {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut headers = FieldTable::default();
        headers.insert("traceparent".into(), AMQPValue::LongString(LongString::from(parent)));
        let mut ctx = Context::new("h", "k", 1, false, &BasicProperties::default().with_headers(headers));
        assert_eq!(ctx.trace_id(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        ctx.publish("", "events", &1).unwrap();
        let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        ctx.publish_outgoing(Outgoing::json("", "events", &2).unwrap().header("traceparent", own)).unwrap();
        let continued = &ctx.published()[0].headers["traceparent"];
        assert!(continued.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{continued}");
        assert_ne!(continued, parent);
        assert_eq!(ctx.published()[1].headers["traceparent"], own);
        let mut untraced = Context::standalone("h", "k");
        untraced.publish("", "events", &3).unwrap();
        assert!(!untraced.published()[0].headers.contains_key("traceparent"));
    }

    #[test]
    fn an_idempotency_key_is_a_version_8_uuid_of_the_scope_key_and_purpose() {
        let key = Context::standalone("charge", "order-7").idempotency_key();
        let bytes = key.as_bytes();
        assert_eq!(
            (key.len(), bytes[8], bytes[13], bytes[18], bytes[23]),
            (36, b'-', b'-', b'-', b'-'),
            "{key}"
        );
        assert_eq!(bytes[14], b'8', "version 8: {key}");
        assert!(matches!(bytes[19], b'8' | b'9' | b'a' | b'b'), "RFC 9562 variant: {key}");
        let retried = Context::new("charge", "order-7", 3, true, &BasicProperties::default());
        assert_eq!(retried.idempotency_key(), key, "the same on a retry and a redelivery");
        assert_ne!(Context::standalone("charge", "order-8").idempotency_key(), key);
        assert_ne!(Context::standalone("refund", "order-7").idempotency_key(), key);
        assert_ne!(retried.idempotency_key_for("refund"), key);
    }

    #[test]
    fn replies_to_direct_reply_to_are_best_effort() {
        let request = Request {
            reply_to: "amq.rabbitmq.reply-to.g1h2AA".into(),
            correlation_id: "c".into(),
            expires_in: None,
            trace: None,
        };
        assert!(!Outgoing::reply(&request, "id".into(), b"1".to_vec(), true).mandatory);
        let named =
            Request { reply_to: "replies".into(), correlation_id: "c".into(), expires_in: None, trace: None };
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
        headers
            .insert(crate::base::headers::ORIGINAL_EXPIRATION.into(), AMQPValue::LongString("60000".into()));
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
