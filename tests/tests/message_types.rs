//! Several message types on one queue, and versioned messages (issue 24, parts 3
//! and 4): a delivery goes to the handler of its type (its AMQP `type`, else its
//! routing key), each handler keeps its own dedup scope, a type no handler takes is
//! dead-lettered as `unroutable-type`; a versioned message's old encodings are
//! upcast before the handler, and one payment in two encodings is a duplicate.

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, FailureKind, HandlerError, Message, Outcome, Publisher};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{Bed, Running};
use idemq_tests::{header_str, in_both_modes, unique};
use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;
use serde::{Deserialize, Serialize};

/// The exchange typed messages are published to: a topic exchange in the test's
/// own vhost, whose routing keys are type names (for publishers that set no `type`).
const EVENTS: &str = "payments.typed";

/// A payment, named on the wire, published to [`EVENTS`].
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "payment.requested", exchange = "payments.typed", routing_key = "payment.requested")]
struct Pay {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

/// A refund of a payment, by the payment's id: the same key as the payment's, in
/// another handler's dedup scope.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "payment.refunded")]
struct Refund {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

#[idempotent_handler(key = "payment_id", name = "typed_pay")]
async fn take_payment(conn: &mut AsyncPgConnection, msg: Pay) -> Result<(), HandlerError> {
    let Pay { payment_id, account, amount_cents } = msg;
    record_payment(conn, &PaymentRequested { payment_id, account, amount_cents }).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "typed_refund")]
async fn take_refund(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
    let payment = PaymentRequested {
        payment_id: format!("refund:{}", msg.payment_id),
        account: msg.account,
        amount_cents: -msg.amount_cents,
    };
    record_payment(conn, &payment).await?;
    Ok(())
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("serialize")
}

fn typed(kind: &str) -> BasicProperties {
    BasicProperties::default().with_content_type("application/json".into()).with_type(kind.into())
}

in_both_modes! {
    /// One queue, two handlers: a payment and a refund with the same key each reach
    /// their own handler and are applied once each (two dedup scopes); a second copy
    /// of the payment is a duplicate; a delivery without a `type` goes by its routing
    /// key; an unknown type, and one with neither, are dead-lettered
    /// `unroutable-type` with what they carried in `x-idemq-message-type`, their
    /// `type` kept. `Publisher::send` sets the type.
    async fn each_message_type_reaches_its_own_handler_and_an_unknown_one_is_dead_lettered() {
        let bed = Bed::isolated().await;
        let key = unique("pay");
        let pay = Pay { payment_id: key.clone(), account: unique("acct"), amount_cents: 500 };
        let refund = Refund { payment_id: key.clone(), account: pay.account.clone(), amount_cents: 200 };
        let by_key = Refund { payment_id: unique("pay"), ..refund.clone() };
        let channel = bed.broker.connection().create_channel().await.expect("a channel");
        channel.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.expect("confirms");
        let (topic, bind) = (ExchangeDeclareOptions::default(), QueueBindOptions::default());
        channel.exchange_declare(EVENTS.into(), lapin::ExchangeKind::Topic, topic, FieldTable::default()).await.expect("declare");
        channel.queue_bind(bed.queue.as_str().into(), EVENTS.into(), "#".into(), bind, FieldTable::default()).await.expect("bind");

        let running = Running::start(bed.runtime().consume(&bed.queue, take_payment).consume(&bed.queue, take_refund));
        let publisher = Publisher::builder().amqp_url(bed.amqp_url.clone()).connect().await.expect("a publisher");
        // `send` publishes to the type's exchange with its `type`.
        publisher.send(&pay).await.expect("send the payment");
        publisher.close().await;
        bed.broker.publish_bytes(&bed.queue, &json(&refund), typed("payment.refunded")).await;
        bed.broker.publish_bytes(&bed.queue, &json(&pay), typed("payment.requested")).await;
        bed.broker.publish_bytes(&bed.queue, &json(&pay), typed("payment.cancelled")).await;
        let untyped = BasicProperties::default().with_content_type("application/json".into());
        bed.broker.publish_bytes(&bed.queue, &json(&pay), untyped.clone()).await;
        // No `type`: the routing key names it.
        let options = BasicPublishOptions { mandatory: true, ..Default::default() };
        let confirm = channel
            .basic_publish(EVENTS.into(), "payment.refunded".into(), options, &json(&by_key), untyped.with_delivery_mode(2))
            .await
            .expect("publish by routing key")
            .await
            .expect("confirmed");
        assert!(matches!(confirm, lapin::Confirmation::Ack(None)), "{confirm:?}");

        running.wait_settled(6).await;
        let events = running.events();
        running.stop().await.expect("clean shutdown");
        let outcomes = |handler: &str| {
            let mut found: Vec<String> = events.iter().filter(|e| e.handler == handler).map(|e| e.outcome.name().to_owned()).collect();
            found.sort();
            found
        };
        assert_eq!(outcomes("typed_pay"), ["applied", "duplicate"], "{events:#?}");
        assert_eq!(outcomes("typed_refund"), ["applied", "applied"], "{events:#?}");
        let dead: Vec<_> = events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { kind: FailureKind::UnroutableType, .. })).collect();
        assert_eq!(dead.len(), 2, "{events:#?}");
        assert_eq!(bed.ledger_rows(&key).await, 1);
        assert_eq!(bed.ledger_rows(&format!("refund:{key}")).await, 1);
        assert_eq!(bed.ledger_rows(&format!("refund:{}", by_key.payment_id)).await, 1);
        assert_eq!(bed.dedup_rows(&key).await, 2, "one row in each handler's scope");

        let letters = bed.broker.drain(&bed.dlq).await;
        assert_eq!(letters.len(), 2);
        let mut said: Vec<(Option<String>, Option<String>, Option<String>)> = letters
            .iter()
            .map(|letter| {
                let props = &letter.delivery.properties;
                (
                    header_str(props, idemq::headers::MESSAGE_TYPE),
                    props.kind().as_ref().map(ToString::to_string),
                    header_str(props, idemq::headers::ERROR_KIND),
                )
            })
            .collect();
        said.sort();
        let unroutable = Some("unroutable-type".to_owned());
        let mut expected = vec![
            (Some(bed.queue.clone()), None, unroutable.clone()),
            (Some("payment.cancelled".to_owned()), Some("payment.cancelled".to_owned()), unroutable),
        ];
        expected.sort();
        assert_eq!(said, expected);
        let error = header_str(&letters[0].delivery.properties, idemq::headers::ERROR).expect("an error header");
        assert!(error.contains("'payment.requested'") && error.contains("'payment.refunded'"), "{error}");
    }
}

/// A queue consumed by handlers whose messages have no name on the wire, or the
/// same one, is refused when the runtime is built, saying what to add.
#[test]
fn build_refuses_a_shared_queue_without_a_type_for_each_handler() {
    #[idempotent_handler(key = "payment_id", name = "untyped")]
    async fn untyped(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
        record_payment(conn, &msg).await?;
        Ok(())
    }
    #[idempotent_handler(key = "payment_id", name = "typed_pay_again")]
    async fn again(conn: &mut AsyncPgConnection, msg: Pay) -> Result<(), HandlerError> {
        take_payment::call(conn, msg).await
    }
    let builder = || idemq::Runtime::builder().database_url("postgres://u@h/db");
    let err = builder().consume("q", take_payment).consume("q", untyped).build().unwrap_err().to_string();
    assert!(err.contains("no name on the wire") && err.contains("#[message(type"), "{err}");
    let err = builder().consume("q", take_payment).consume("q", again).build().unwrap_err().to_string();
    assert!(err.contains("both take message type 'payment.requested'"), "{err}");
    // One handler per queue needs no type, and two typed ones are fine.
    builder().consume("q", untyped).build().expect("one untyped handler");
    builder().consume("q", take_payment).consume("q", take_refund).build().expect("two types");
}

/// Version 1 of a payment: whole euros.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(version = 1)]
struct PaymentV1 {
    payment_id: String,
    account: String,
    euros: i64,
}

/// Version 2: cents. Upcast from version 1 by `From`.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(version = 2, previous = PaymentV1)]
struct PaymentV2 {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

impl From<PaymentV1> for PaymentV2 {
    fn from(v1: PaymentV1) -> Self {
        Self { payment_id: v1.payment_id, account: v1.account, amount_cents: v1.euros * 100 }
    }
}

#[idempotent_handler(key = "payment_id", name = "versioned_pay")]
async fn take_versioned(conn: &mut AsyncPgConnection, msg: PaymentV2) -> Result<(), HandlerError> {
    let PaymentV2 { payment_id, account, amount_cents } = msg;
    record_payment(conn, &PaymentRequested { payment_id, account, amount_cents }).await?;
    Ok(())
}

/// A chain with a gap: version 3 upcast straight from version 1.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(version = 3, previous = PaymentV1)]
struct PaymentV3 {
    payment_id: String,
}

impl From<PaymentV1> for PaymentV3 {
    fn from(v1: PaymentV1) -> Self {
        Self { payment_id: v1.payment_id }
    }
}

#[idempotent_handler(key = "payment_id", name = "gapped")]
async fn take_gapped(conn: &mut AsyncPgConnection, msg: PaymentV3) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

/// A version chain must go down one version per step: a gap is refused when the
/// runtime is built, naming both ends of it.
#[test]
fn build_refuses_a_version_chain_with_a_gap() {
    let builder = idemq::Runtime::builder().database_url("postgres://u@h/db");
    let err = builder.consume("q", take_gapped).build().unwrap_err().to_string();
    assert!(err.contains("gap") && err.contains("PaymentV3") && err.contains("version 1"), "{err}");
    let builder = idemq::Runtime::builder().database_url("postgres://u@h/db");
    builder.consume("q", take_versioned).build().expect("versions 2 and 1");
}

fn version(v: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from(idemq::headers::VERSION), AMQPValue::LongString(LongString::from(v)));
    BasicProperties::default().with_content_type("application/json".into()).with_headers(headers)
}

in_both_modes! {
    /// One payment sent as version 1 (no header: the default) and again as version
    /// 2 is applied once, upcast, and the second is a duplicate — the fingerprint is
    /// the upcast message's; version 2 with another amount is a conflict; version 3
    /// is dead-lettered `unknown-version`, and a version-2 body that says nothing is
    /// read as version 1 and fails to decode, naming the version.
    async fn an_old_and_a_new_encoding_of_one_payment_are_duplicates_not_conflicts() {
        let bed = Bed::new().await;
        let v1 = PaymentV1 { payment_id: unique("pay"), account: unique("acct"), euros: 7 };
        let v2: PaymentV2 = v1.clone().into();
        // One at a time where the order matters: three copies of one key racing
        // would let any of them be the one applied.
        let running = Running::start(bed.runtime().consume(&bed.queue, take_versioned));
        bed.broker.publish_bytes(&bed.queue, &json(&v1), BasicProperties::default()).await;
        running.wait_settled(1).await;
        bed.broker.publish_bytes(&bed.queue, &json(&v2), version("2")).await;
        running.wait_settled(2).await;
        let other = PaymentV2 { amount_cents: 1, ..v2.clone() };
        bed.broker.publish_bytes(&bed.queue, &json(&other), version("2")).await;
        let fresh = PaymentV2 { payment_id: unique("pay"), ..v2.clone() };
        bed.broker.publish_bytes(&bed.queue, &json(&fresh), version("3")).await;
        bed.broker.publish_bytes(&bed.queue, &json(&fresh), BasicProperties::default()).await;
        running.wait_settled(5).await;
        let events = running.events();
        running.stop().await.expect("clean shutdown");
        let of = |key: &str| events.iter().filter(|e| e.key.as_deref() == Some(key)).map(|e| e.outcome.clone()).collect::<Vec<_>>();
        let first = of(&v1.payment_id);
        assert_eq!(first[..2], [Outcome::Applied, Outcome::Duplicate], "{events:#?}");
        assert!(matches!(first[2], Outcome::DeadLettered { kind: FailureKind::Conflict, .. }), "{events:#?}");
        assert_eq!(bed.ledger_rows(&v1.payment_id).await, 1);
        let sql = format!("SELECT amount_cents FROM ledger WHERE payment_id = '{}'", v1.payment_id);
        let cents = bed.db.count(&sql).await;
        assert_eq!(cents, 700, "version 1's euros, upcast to cents");

        let letters = bed.broker.drain(&bed.dlq).await;
        let kinds: Vec<Option<String>> = letters.iter().map(|l| header_str(&l.delivery.properties, idemq::headers::ERROR_KIND)).collect();
        assert_eq!(kinds.len(), 3, "{kinds:?}");
        let errors: Vec<String> = letters.iter().filter_map(|l| header_str(&l.delivery.properties, idemq::headers::ERROR)).collect();
        assert!(kinds.contains(&Some("unknown-version".to_owned())), "{kinds:?}");
        assert!(errors.iter().any(|e| e.contains("version 3") && e.contains("versions 1 to 2")), "{errors:?}");
        assert!(errors.iter().any(|e| e.contains("PaymentV1") && e.contains("version 1") && e.contains("euros")), "{errors:?}");
        assert_eq!(bed.ledger_rows(&fresh.payment_id).await, 0);
    }
}

// ---------------------------------------------------------------------------
// Routing that survives copies (issue 34, items 1 and 2): a message routed by the
// key it was published with (no AMQP `type`) comes back from a wait queue, and is
// replayed from the DLQ, with the queue's name as routing key; it must still reach
// its handler, whatever the handler's shape (one message, a batch, a lane).

/// A dispute of a payment: the third type of the routed queue, for a handler with a lane.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "payment.disputed")]
struct Dispute {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

/// Keys whose handler fails permanently (until the test takes them out).
static BROKEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
/// Keys whose handler fails transiently at attempt 1.
static FLAKY: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The failure the test staged for `key` at `attempt`, if any.
fn staged_failure(key: &str, attempt: u32) -> Option<HandlerError> {
    if BROKEN.lock().expect("broken keys").iter().any(|k| k == key) {
        return Some(HandlerError::permanent("the ledger refuses it (staged)"));
    }
    let flaky = FLAKY.lock().expect("flaky keys").iter().any(|k| k == key);
    (flaky && attempt == 1).then(|| HandlerError::transient("the ledger is busy (staged, attempt 1)"))
}

fn ledger_entry(prefix: &str, payment_id: &str, account: &str, amount_cents: i64) -> PaymentRequested {
    PaymentRequested {
        payment_id: format!("{prefix}{payment_id}"),
        account: account.to_owned(),
        amount_cents,
    }
}

#[idempotent_handler(key = "payment_id", name = "routed_pay")]
async fn routed_pay(
    conn: &mut AsyncPgConnection,
    msg: Pay,
    ctx: &idemq::Context,
) -> Result<(), HandlerError> {
    if let Some(err) = staged_failure(&msg.payment_id, ctx.attempt()) {
        return Err(err);
    }
    record_payment(conn, &ledger_entry("", &msg.payment_id, &msg.account, msg.amount_cents)).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "routed_refunds")]
async fn routed_refunds(
    conn: &mut AsyncPgConnection,
    batch: &mut idemq::Batch<Refund>,
) -> Result<(), HandlerError> {
    for (msg, ctx) in batch.iter() {
        if let Some(err) = staged_failure(&msg.payment_id, ctx.attempt()) {
            return Err(err);
        }
    }
    for msg in batch.messages() {
        record_payment(conn, &ledger_entry("refund:", &msg.payment_id, &msg.account, -msg.amount_cents))
            .await?;
    }
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "routed_disputes", lane = "account")]
async fn routed_disputes(
    conn: &mut AsyncPgConnection,
    msg: Dispute,
    ctx: &idemq::Context,
) -> Result<(), HandlerError> {
    if let Some(err) = staged_failure(&msg.payment_id, ctx.attempt()) {
        return Err(err);
    }
    record_payment(conn, &ledger_entry("dispute:", &msg.payment_id, &msg.account, msg.amount_cents)).await?;
    Ok(())
}

/// A runtime consuming the bed's queue with the three routed handlers.
fn routed(bed: &Bed) -> idemq::RuntimeBuilder {
    bed.runtime()
        .consume(&bed.queue, routed_pay)
        .consume(&bed.queue, routed_refunds)
        .consume(&bed.queue, routed_disputes)
}

/// The bed's queue bound to a topic exchange with `#`, and a confirming channel on it.
async fn topic_exchange(bed: &Bed) -> lapin::Channel {
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    channel.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.expect("confirms");
    let (topic, bind) = (ExchangeDeclareOptions::default(), QueueBindOptions::default());
    channel
        .exchange_declare(EVENTS.into(), lapin::ExchangeKind::Topic, topic, FieldTable::default())
        .await
        .expect("declare");
    channel
        .queue_bind(bed.queue.as_str().into(), EVENTS.into(), "#".into(), bind, FieldTable::default())
        .await
        .expect("bind");
    channel
}

/// Publishes `body` to [`EVENTS`] with `routing_key` and no AMQP `type`.
async fn publish_untyped(channel: &lapin::Channel, routing_key: &str, body: &[u8]) {
    let props = BasicProperties::default().with_content_type("application/json".into()).with_delivery_mode(2);
    let options = BasicPublishOptions { mandatory: true, ..Default::default() };
    let confirm = channel
        .basic_publish(EVENTS.into(), routing_key.into(), options, body, props)
        .await
        .expect("publish by routing key")
        .await
        .expect("confirmed");
    assert!(matches!(confirm, lapin::Confirmation::Ack(None)), "{confirm:?}");
}

/// One untyped message of each routed type, published by routing key; returns their keys.
async fn publish_one_of_each(channel: &lapin::Channel, keys: &[String; 3]) {
    let account = unique("acct");
    let pay = Pay { payment_id: keys[0].clone(), account: account.clone(), amount_cents: 500 };
    let refund = Refund { payment_id: keys[1].clone(), account: account.clone(), amount_cents: 200 };
    let dispute = Dispute { payment_id: keys[2].clone(), account, amount_cents: 50 };
    publish_untyped(channel, "payment.requested", &json(&pay)).await;
    publish_untyped(channel, "payment.refunded", &json(&refund)).await;
    publish_untyped(channel, "payment.disputed", &json(&dispute)).await;
}

fn three_keys() -> [String; 3] {
    [unique("pay"), unique("refund"), unique("dispute")]
}

/// Each key's ledger row (under the prefix its handler writes) exists exactly once.
async fn applied_once_each(bed: &Bed, keys: &[String; 3]) {
    assert_eq!(bed.ledger_rows(&keys[0]).await, 1, "the payment");
    assert_eq!(bed.ledger_rows(&format!("refund:{}", keys[1])).await, 1, "the refund (batch handler)");
    assert_eq!(bed.ledger_rows(&format!("dispute:{}", keys[2])).await, 1, "the dispute (lane)");
}

in_both_modes! {
    /// Three untyped messages, routed by their routing keys to a plain handler, a
    /// batch handler and a handler with a lane, each fail once (transiently): their
    /// retry copies come back from the wait queue with the queue's name as routing
    /// key, are routed by the key they were published with, and each is applied once
    /// at attempt 2 — none is dead-lettered `unroutable-type`. An unknown key is
    /// dead-lettered naming that key, not the queue.
    async fn an_untyped_message_routed_by_its_key_is_retried_and_applied_once() {
        let bed = Bed::isolated().await;
        let channel = topic_exchange(&bed).await;
        let keys = three_keys();
        FLAKY.lock().expect("flaky keys").extend(keys.iter().cloned());
        let running = Running::start(routed(&bed));
        publish_one_of_each(&channel, &keys).await;
        for key in &keys {
            let events = running.wait_for_end(key).await;
            let outcomes: Vec<(u32, String)> = events.iter().map(|e| (e.attempt, e.outcome.name().to_owned())).collect();
            assert_eq!(outcomes, [(1, "retried".to_owned()), (2, "applied".to_owned())], "{key}: {events:#?}");
        }
        publish_untyped(&channel, "payment.cancelled", br#"{"payment_id":"x"}"#).await;
        running.wait_until("the unknown key dead-lettered", |events| {
            events.iter().any(|e| matches!(e.outcome, Outcome::DeadLettered { kind: FailureKind::UnroutableType, .. }))
        }).await;
        let events = running.events();
        running.stop().await.expect("clean shutdown");
        applied_once_each(&bed, &keys).await;
        let letters = bed.broker.drain(&bed.dlq).await;
        assert_eq!(letters.len(), 1, "only the unknown key: {events:#?}");
        let said = header_str(&letters[0].delivery.properties, idemq::headers::MESSAGE_TYPE);
        assert_eq!(said.as_deref(), Some("payment.cancelled"));
    }
}

in_both_modes! {
    /// The same three messages fail permanently and are dead-lettered; once the
    /// cause is fixed, `dlq replay` sends them back to the queue by its name, and
    /// each reaches its own handler (plain, batch, lane) and is applied once.
    async fn an_untyped_dead_letter_replayed_reaches_its_handler_and_is_applied_once() {
        let bed = Bed::isolated().await;
        let channel = topic_exchange(&bed).await;
        let keys = three_keys();
        BROKEN.lock().expect("broken keys").extend(keys.iter().cloned());
        publish_one_of_each(&channel, &keys).await;
        let running = Running::start(routed(&bed));
        running.wait_until("three dead letters", |events| {
            events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. })).count() == 3
        }).await;
        let events = running.events();
        running.stop().await.expect("clean shutdown");
        assert!(
            events.iter().all(|e| matches!(e.outcome, Outcome::DeadLettered { kind: FailureKind::Handler, .. })),
            "each by its own handler, none unroutable: {events:#?}"
        );
        BROKEN.lock().expect("broken keys").retain(|k| !keys.contains(k));

        let db = bed.db.url();
        let argv = ["idemq-test", "--amqp-url", &bed.amqp_url, "--database-url", &db, "dlq", "replay"];
        let code = idemq::cli::Cli::new("idemq-test", routed(&bed)).run_from(argv).await;
        assert_eq!(code, std::process::ExitCode::SUCCESS, "dlq replay failed (its error is on stderr)");
        assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);

        let running = Running::start(routed(&bed));
        for key in &keys {
            let events = running.wait_for_end(key).await;
            assert_eq!(events.last().map(|e| e.outcome.clone()), Some(Outcome::Applied), "{key}: {events:#?}");
        }
        running.stop().await.expect("clean shutdown");
        applied_once_each(&bed, &keys).await;
        assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
        assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
    }
}
