//! The producer side: `idemq::Publisher` publishes confirmed and routed messages,
//! refuses what no queue takes, reconnects and publishes again under the same
//! message id, and sends requests whose replies (or error replies, or silence) it
//! returns typed. Each test runs in a vhost of its own.

use std::collections::BTreeSet;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::outbox::Outgoing;
use idemq::publisher::RequestError;
use idemq::{idempotent_handler, HandlerError, Permanent, PublishError, Publisher};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, with_timeout};

/// The reply of [`answer`]: `run` is new on every run of the handler, so a reply
/// made by a second run would differ from the first.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Receipt {
    payment_id: String,
    run: String,
}

#[idempotent_handler(key = "payment_id", name = "quote")]
async fn answer(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<Receipt, HandlerError> {
    if msg.amount_cents == 13 {
        return Err(Permanent("thirteen is refused").into());
    }
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id, run: idemq_tests::unique("run") })
}

/// A payment addressed to a queue of the test's (a route known only at run time:
/// `Message::routing_key` overridden, as a hand-written impl may).
#[derive(serde::Serialize)]
struct ToQueue {
    #[serde(skip)]
    queue: String,
    #[serde(flatten)]
    payment: PaymentRequested,
}

impl idemq::Message for ToQueue {
    const EXCHANGE: &'static str = "";
    const ROUTING_KEY: &'static str = "";

    fn routing_key(&self) -> &str {
        &self.queue
    }
}

/// Version 1 of a quote request: whole euros.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, idemq::Message)]
#[message(version = 1)]
struct QuoteV1 {
    payment_id: String,
    euros: i64,
}

/// Version 2, named on the wire: cents. A version-2 body read as version 1 does
/// not decode (it has no `euros`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, idemq::Message)]
#[message(type = "quote.requested", version = 2, previous = QuoteV1)]
struct QuoteV2 {
    payment_id: String,
    cents: i64,
}

impl From<QuoteV1> for QuoteV2 {
    fn from(v1: QuoteV1) -> Self {
        Self { payment_id: v1.payment_id, cents: v1.euros * 100 }
    }
}

/// What [`quote`] answers: the cents it read.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Quoted {
    payment_id: String,
    cents: i64,
}

#[idempotent_handler(key = "payment_id", name = "quote_v2")]
async fn quote(conn: &mut AsyncPgConnection, msg: QuoteV2) -> Result<Quoted, HandlerError> {
    let _ = conn;
    Ok(Quoted { payment_id: msg.payment_id, cents: msg.cents })
}

/// A [`QuoteV2`] addressed to a queue of the test's, with its type and version as
/// the derive declares them.
#[derive(serde::Serialize)]
struct QuoteTo {
    #[serde(skip)]
    queue: String,
    #[serde(flatten)]
    quote: QuoteV2,
}

impl idemq::Message for QuoteTo {
    const EXCHANGE: &'static str = "";
    const ROUTING_KEY: &'static str = "";
    const TYPE: Option<&'static str> = Some(<QuoteV2 as idemq::MessageType>::TYPE);
    const VERSION: Option<u32> = Some(<QuoteV2 as idemq::Versioned>::VERSION);

    fn routing_key(&self) -> &str {
        &self.queue
    }
}

/// A handler keyed on the AMQP `message_id`: `run` tells its runs apart.
#[idempotent_handler(key = "@message_id", name = "receipt_by_message_id")]
async fn receipt_by_message_id(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<Receipt, HandlerError> {
    let _ = conn;
    Ok(Receipt { payment_id: msg.payment_id, run: idemq_tests::unique("run") })
}

async fn publisher(bed: &Bed) -> Publisher {
    Publisher::builder()
        .amqp_url(&bed.amqp_url)
        .name(idemq_tests::unique("publisher"))
        .timeout(Duration::from_secs(20))
        .connect()
        .await
        .expect("connect the publisher")
}

/// A publisher whose connection is named `name` (for the test to close it), with
/// time to reconnect.
async fn named_publisher(bed: &Bed, name: &str) -> Publisher {
    Publisher::builder()
        .amqp_url(&bed.amqp_url)
        .name(name)
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .expect("connect")
}

fn unique_id() -> String {
    idemq_tests::unique("quote")
}

fn message_id(message: &lapin::message::BasicGetMessage) -> String {
    message.delivery.properties.message_id().as_ref().map(|id| id.to_string()).expect("a message id")
}

/// `send` returns once the broker confirmed; the message is in the queue as JSON,
/// persistent, with the id `send` returned.
#[tokio::test(flavor = "multi_thread")]
async fn a_sent_message_is_in_its_queue_when_send_returns_with_the_id_it_returned() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let sent = payment(250);
    let id =
        publisher.send(&ToQueue { queue: bed.queue.clone(), payment: sent.clone() }).await.expect("send");
    assert_eq!(id.len(), 32, "a random id of 32 hex digits: {id}");
    let message = bed.broker.get(&bed.queue).await.expect("the message is in the queue once send returned");
    let props = &message.delivery.properties;
    assert_eq!(message_id(&message), id);
    assert_eq!(props.content_type().as_ref().map(|c| c.as_str()), Some("application/json"));
    assert_eq!(*props.delivery_mode(), Some(2), "persistent");
    let received: PaymentRequested = serde_json::from_slice(&message.delivery.data).expect("JSON");
    assert_eq!(received, sent);

    let given = Outgoing::json("", &bed.queue, &sent)
        .expect("outgoing")
        .message_id("order-7")
        .header("x-tenant", "acme");
    assert_eq!(publisher.publish_outgoing(given).await.expect("publish"), "order-7", "a given id is kept");
    let message = bed.broker.get(&bed.queue).await.expect("the second message");
    assert_eq!(message_id(&message), "order-7");
    assert_eq!(idemq_tests::header_str(&message.delivery.properties, "x-tenant").as_deref(), Some("acme"));
}

/// A message no queue takes is returned by the broker (it is published
/// `mandatory`): an error naming the route, never an `Ok`.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_no_queue_takes_is_an_error_not_a_success() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let err = publisher.publish("", "nobody.listens.here", &payment(1)).await.expect_err("unroutable");
    assert!(
        matches!(&err, PublishError::Unroutable { exchange, routing_key } if exchange.is_empty() && routing_key == "nobody.listens.here"),
        "{err:?}"
    );
    assert!(err.to_string().contains("declare and bind a queue"), "says what to do: {err}");
}

/// A missing exchange is refused before anything is published (a publish to it
/// would close the channel under every publish in flight), and the publisher goes
/// on publishing.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_exchange_is_refused_and_the_publisher_goes_on() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let err = publisher.publish("no.such.exchange", "x", &payment(1)).await.expect_err("no exchange");
    assert!(
        matches!(&err, PublishError::NoExchange { exchange } if exchange == "no.such.exchange"),
        "{err:?}"
    );
    publisher.publish("", &bed.queue, &payment(2)).await.expect("the next publish goes through");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 1);
}

/// A batch is published pipelined: every message once, with the ids returned, in
/// order.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_is_confirmed_as_a_whole_every_message_once() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let batch: Vec<Outgoing> =
        (0..500).map(|i| Outgoing::json("", &bed.queue, &payment(i)).expect("outgoing")).collect();
    let ids = publisher.publish_all(batch).await.expect("publish the batch");
    assert_eq!(ids.len(), 500);
    let received: Vec<String> = bed.broker.drain(&bed.queue).await.iter().map(message_id).collect();
    assert_eq!(received, ids, "each once, in order");
}

/// The broker closes the publisher's connection while it publishes: whatever was
/// not confirmed is published again on a new connection under the same message id,
/// so every message is in the queue (a redelivered one under its own id).
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_connection_is_made_again_and_nothing_is_lost() {
    let bed = Bed::isolated().await;
    let name = idemq_tests::unique("publisher");
    let publisher = named_publisher(&bed, &name).await;
    let queue = bed.queue.clone();
    let publishing = {
        let publisher = publisher.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..300 {
                ids.push(publisher.publish("", &queue, &payment(i)).await.expect("publish"));
            }
            ids
        })
    };
    eventually("some messages published", Duration::from_secs(20), || async {
        bed.broker.message_count(&bed.queue).await >= 50
    })
    .await;
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    assert_eq!(vhost.close_connections_named(&name).await, 1, "the publisher's one connection");
    let ids = with_timeout("publishing", Duration::from_secs(60), publishing).await.expect("no panic");
    let received: BTreeSet<String> = bed.broker.drain(&bed.queue).await.iter().map(message_id).collect();
    let sent: BTreeSet<String> = ids.into_iter().collect();
    assert_eq!(sent.len(), 300);
    assert_eq!(received, sent, "every confirmed message is in the queue");
}

/// The first address refuses connections: the next one is used.
#[tokio::test(flavor = "multi_thread")]
async fn the_next_address_is_used_when_the_first_does_not_answer() {
    let bed = Bed::isolated().await;
    let urls = format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", bed.amqp_url);
    let publisher = Publisher::connect(&urls).await.expect("the second address answers");
    publisher.publish("", &bed.queue, &payment(3)).await.expect("publish");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 1);
    assert!(!format!("{publisher:?}").contains("guest:guest"), "Debug redacts passwords: {publisher:?}");
}

/// A login the broker refuses fails at once, with the reason and no password.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_login_fails_at_once_without_the_password() {
    let bed = Bed::isolated().await;
    let url = bed.amqp_url.replacen("guest:guest", "guest:s3cret-wrong", 1);
    assert_ne!(url, bed.amqp_url, "the test URL carries guest's password");
    let err = with_timeout("a refused login", Duration::from_secs(15), Publisher::connect(&url))
        .await
        .expect_err("refused");
    let report = err.report();
    assert!(!report.contains("s3cret-wrong"), "{report}");
    assert!(report.contains("RabbitMQ"), "{report}");
}

/// After `close`, every call says the publisher is closed.
#[tokio::test(flavor = "multi_thread")]
async fn a_closed_publisher_says_so() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    publisher.close().await;
    let err = publisher.publish("", &bed.queue, &payment(1)).await.expect_err("closed");
    assert!(matches!(err, PublishError::Closed), "{err:?}");
}

/// A request gets its handler's reply, decoded; asked again (same payment), it
/// gets the stored reply, byte for byte, and the handler ran once.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_returns_the_handlers_reply_and_a_repeat_the_same_reply() {
    let bed = Bed::isolated().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, answer));
    let publisher = publisher(&bed).await;
    let asked = payment(400);
    let request = ToQueue { queue: bed.queue.clone(), payment: asked.clone() };
    let first: Receipt = publisher.request(&request, Duration::from_secs(20)).await.expect("a reply");
    assert_eq!(first.payment_id, asked.payment_id);
    let again: Receipt = publisher.request(&request, Duration::from_secs(20)).await.expect("a reply");
    running.stop().await.expect("clean shutdown");
    assert_eq!(again, first, "a repeated request is answered with the stored reply");
    assert_eq!(bed.ledger_rows(&asked.payment_id).await, 1, "applied once");
}

/// A handler's permanent failure comes back as a typed error with its words.
#[tokio::test(flavor = "multi_thread")]
async fn an_error_reply_is_a_typed_error_with_the_handlers_words() {
    let bed = Bed::isolated().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, answer));
    let publisher = publisher(&bed).await;
    let request = ToQueue { queue: bed.queue.clone(), payment: payment(13) };
    let err = publisher.request::<_, Receipt>(&request, Duration::from_secs(20)).await.expect_err("refused");
    running.stop().await.expect("clean shutdown");
    match err {
        RequestError::Failed { error, .. } => assert!(error.contains("thirteen is refused"), "{error}"),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// Nobody consumes the queue: the request times out, saying so.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_nobody_answers_times_out() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let request = ToQueue { queue: bed.queue.clone(), payment: payment(5) };
    let err =
        publisher.request::<_, Receipt>(&request, Duration::from_millis(500)).await.expect_err("no reply");
    assert!(matches!(err, RequestError::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("is a consumer running"), "{err}");
}

/// The requester's connection is lost after its request went out and before any
/// reply: it publishes the request again on a new connection (same ids), the
/// handler answers that duplicate with its stored reply, and the payment is
/// applied once.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_whose_connection_is_lost_is_answered_on_the_next() {
    let bed = Bed::isolated().await;
    let name = idemq_tests::unique("requester");
    let publisher = named_publisher(&bed, &name).await;
    let asked = payment(700);
    let request = ToQueue { queue: bed.queue.clone(), payment: asked.clone() };
    let requesting =
        tokio::spawn(async move { publisher.request::<_, Receipt>(&request, Duration::from_secs(30)).await });
    eventually("the request in the queue", Duration::from_secs(20), || async {
        bed.broker.message_count(&bed.queue).await >= 1
    })
    .await;
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    assert_eq!(vhost.close_connections_named(&name).await, 1, "the requester's connection");
    let running = Running::start(bed.runtime().consume(&bed.queue, answer));
    let receipt = with_timeout("the reply", Duration::from_secs(40), requesting)
        .await
        .expect("no panic")
        .expect("answered on the new connection");
    running.stop().await.expect("clean shutdown");
    assert_eq!(receipt.payment_id, asked.payment_id);
    assert_eq!(bed.ledger_rows(&asked.payment_id).await, 1, "applied once");
}

/// A request of a versioned, named type goes with its type and version, as `send`
/// publishes it: its handler reads it as version 2 and answers (a request that
/// said nothing would be read as version 1 and fail to decode).
#[tokio::test(flavor = "multi_thread")]
async fn a_request_goes_with_its_type_and_version_and_is_read_as_that_version() {
    let bed = Bed::isolated().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, quote));
    let publisher = publisher(&bed).await;
    let request =
        QuoteTo { queue: bed.queue.clone(), quote: QuoteV2 { payment_id: unique_id(), cents: 1250 } };
    let quoted: Result<Quoted, _> = publisher.request(&request, Duration::from_secs(20)).await;
    running.stop().await.expect("clean shutdown");
    let quoted = quoted.expect("answered, read as version 2");
    assert_eq!(quoted, Quoted { payment_id: request.quote.payment_id, cents: 1250 });
}

/// What a request carries, read off the queue (nobody consumes it): `request` sets
/// the type and version `send` sets; `request_with` sends what its `Outgoing` holds
/// — its own message id and headers, the type and version of `Outgoing::of` — with
/// the request's `reply_to` and a correlation id.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_carries_what_send_sets_and_request_with_its_own_message_id() {
    let bed = Bed::isolated().await;
    let publisher = publisher(&bed).await;
    let message =
        || QuoteTo { queue: bed.queue.clone(), quote: QuoteV2 { payment_id: unique_id(), cents: 5 } };
    let wire = |message: &lapin::message::BasicGetMessage| {
        let props = &message.delivery.properties;
        (
            props.kind().as_ref().map(|kind| kind.to_string()),
            idemq_tests::header_str(props, idemq::headers::VERSION),
        )
    };
    publisher.send(&message()).await.expect("send");
    let sent = bed.broker.get(&bed.queue).await.expect("the sent message");
    assert_eq!(wire(&sent), (Some("quote.requested".to_owned()), Some("2".to_owned())));

    let err =
        publisher.request::<_, Quoted>(&message(), Duration::from_millis(500)).await.expect_err("unanswered");
    assert!(matches!(err, RequestError::Timeout { .. }), "{err:?}");
    let requested = bed.broker.get(&bed.queue).await.expect("the request");
    assert_eq!(wire(&requested), wire(&sent), "a request's type and version are send's");

    let built = Outgoing::of(&message()).expect("outgoing").message_id("order-7").header("x-tenant", "acme");
    let err =
        publisher.request_with::<Quoted>(built, Duration::from_millis(500)).await.expect_err("unanswered");
    assert!(matches!(err, RequestError::Timeout { .. }), "{err:?}");
    let requested = bed.broker.get(&bed.queue).await.expect("the request");
    let props = &requested.delivery.properties;
    assert_eq!(message_id(&requested), "order-7", "the given message id is kept");
    assert_eq!(wire(&requested), wire(&sent));
    assert_eq!(idemq_tests::header_str(props, "x-tenant").as_deref(), Some("acme"));
    let reply_to = props.reply_to().as_ref().map(|to| to.to_string()).unwrap_or_default();
    assert!(reply_to.starts_with("amq.rabbitmq.reply-to"), "direct reply-to: {reply_to}");
    assert!(props.correlation_id().is_some(), "a correlation id its reply comes back with");
}

/// A request's own message id is its key for a handler keyed on `@message_id`:
/// the same request sent twice under one id is applied once and both get the first
/// reply; under another id it is applied again.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_sent_twice_under_its_own_message_id_is_applied_once() {
    let bed = Bed::isolated().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, receipt_by_message_id));
    let publisher = publisher(&bed).await;
    let asked = ToQueue { queue: bed.queue.clone(), payment: payment(21) };
    let under = |id: &str| Outgoing::of(&asked).expect("outgoing").message_id(id);
    let timeout = Duration::from_secs(20);
    let first: Result<Receipt, _> = publisher.request_with(under("order-7"), timeout).await;
    let again: Result<Receipt, _> = publisher.request_with(under("order-7"), timeout).await;
    let other: Result<Receipt, _> = publisher.request_with(under("order-8"), timeout).await;
    running.stop().await.expect("clean shutdown");
    let (first, again, other) = (first.expect("a reply"), again.expect("a reply"), other.expect("a reply"));
    assert_eq!(again, first, "one message id: applied once, the stored reply");
    assert_ne!(other.run, first.run, "another message id: another request");
}

/// The outbox as a sink, with the publisher's calls: what is written in a
/// transaction that rolls back is never published; what is written in one that
/// commits is published by a runtime's relay, under the ids the calls returned.
#[tokio::test(flavor = "multi_thread")]
async fn the_outbox_sink_publishes_what_commits_and_nothing_that_rolls_back() {
    use diesel_async::AsyncConnection;
    use idemq::outbox::Outbox;
    let bed = Bed::isolated().await;
    let mut conn = bed.db.connect().await;
    let queue = bed.queue.clone();
    let rolled_back = conn
        .transaction::<(), HandlerError, _>(async |conn| {
            Outbox::new(conn).send(&ToQueue { queue: queue.clone(), payment: payment(1) }).await?;
            Err(Permanent("changed my mind").into())
        })
        .await;
    assert!(rolled_back.is_err());
    let ids = conn
        .transaction::<Vec<String>, HandlerError, _>(async |conn| {
            let mut outbox = Outbox::new(conn);
            let mut ids = vec![outbox.send(&ToQueue { queue: queue.clone(), payment: payment(2) }).await?];
            ids.push(outbox.publish("", &queue, &payment(3)).await?);
            let batch = [Outgoing::json("", &queue, &payment(4))?.message_id("given")];
            ids.extend(outbox.publish_all(batch).await?);
            Ok(ids)
        })
        .await
        .expect("committed");
    assert_eq!(ids[2], "given");
    // A runtime's relay publishes the committed rows (its handler consumes another queue).
    let elsewhere = idemq_tests::unique("elsewhere");
    let topology = idemq::Topology::new().queue(idemq::Queue::new(elsewhere.clone()));
    let running = Running::start(
        idemq::Runtime::builder()
            .amqp_url(bed.amqp_url.clone())
            .database_url(bed.db.url())
            .topology(topology)
            .relay_poll_interval(Duration::from_millis(50))
            .consume(&elsewhere, answer),
    );
    eventually("three messages published", Duration::from_secs(20), || async {
        bed.broker.message_count(&bed.queue).await >= 3
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let received: Vec<String> = bed.broker.drain(&bed.queue).await.iter().map(message_id).collect();
    let sent: BTreeSet<&String> = ids.iter().collect();
    assert_eq!(received.len(), 3, "the rolled-back message never went out: {received:?}");
    assert_eq!(received.iter().collect::<BTreeSet<_>>(), sent);
}
