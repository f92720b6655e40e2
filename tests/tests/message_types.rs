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
