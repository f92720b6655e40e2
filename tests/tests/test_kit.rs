//! The handler test kit, `idemq::testing::TestKit` (issue 37, frictions 1 and 2):
//! it delivers a typed and versioned message as `Publisher::send` publishes it,
//! tests the typed handlers of one queue as one, fails at once naming what
//! happened, and leaves no database or queue behind when a test panics or
//! `prepare` fails part-way.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use futures_util::FutureExt;
use idemq::testing::{TestKit, TestMessage};
use idemq::{idempotent_handler, FailureKind, HandlerError, Message, Outcome, Publisher};
use idemq_example_payments::{migrate, record_payment, PaymentRequested};
use idemq_tests::{amqp_url, database_admin_url, Broker};
use serde::{Deserialize, Serialize};

/// Version 1 of a payment: whole euros.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "kit.payment", version = 1)]
struct PaymentV1 {
    payment_id: String,
    account: String,
    amount: i64,
}

/// The queue [`Payment`] is published to (by `Publisher::send`, in
/// [`a_test_message_of_a_type_carries_what_publisher_send_sets`]).
const PAYMENTS: &str = "idemq-test-kit-payments";

/// Version 2, in cents: what [`take_payment`] takes.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "kit.payment", version = 2, previous = PaymentV1, exchange = "", routing_key = "idemq-test-kit-payments")]
struct Payment {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

impl From<PaymentV1> for Payment {
    fn from(v1: PaymentV1) -> Self {
        Self { payment_id: v1.payment_id, account: v1.account, amount_cents: v1.amount * 100 }
    }
}

/// A refund, by the payment's id: another type on the same queue.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "kit.refund", exchange = "", routing_key = "idemq-test-kit-refunds")]
struct Refund {
    payment_id: String,
    account: String,
    amount_cents: i64,
}

#[idempotent_handler(key = "payment_id", name = "kit_pay")]
async fn take_payment(conn: &mut AsyncPgConnection, msg: Payment) -> Result<(), HandlerError> {
    let Payment { payment_id, account, amount_cents } = msg;
    record_payment(conn, &PaymentRequested { payment_id, account, amount_cents }).await?;
    Ok(())
}

#[idempotent_handler(key = "payment_id", name = "kit_refund")]
async fn take_refund(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
    let payment_id = format!("refund:{}", msg.payment_id);
    record_payment(
        conn,
        &PaymentRequested { payment_id, account: msg.account, amount_cents: -msg.amount_cents },
    )
    .await?;
    Ok(())
}

fn payment(id: &str) -> Payment {
    Payment { payment_id: id.to_owned(), account: format!("acct-{id}"), amount_cents: 300 }
}

async fn payments_kit() -> TestKit {
    TestKit::prepare(
        take_payment,
        |builder| builder,
        |url| async move { migrate(&url).await.map_err(Into::into) },
    )
    .await
    .expect("PostgreSQL and RabbitMQ are up")
}

/// The panic message a task ended with.
fn panic_message(err: tokio::task::JoinError) -> String {
    let payload = err.try_into_panic().expect("the task panicked");
    message_of(&*payload)
}

fn message_of(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// The database a kit's URL names.
fn database_of(url: &str) -> String {
    let path = url.rsplit('/').next().expect("a path");
    path.split('?').next().unwrap_or(path).to_owned()
}

async fn database_exists(name: &str) -> bool {
    let (client, connection) = tokio_postgres::connect(&database_admin_url(), tokio_postgres::NoTls)
        .await
        .expect("PostgreSQL is up");
    let connection = tokio::spawn(connection);
    let row = client
        .query_one("SELECT count(*) FROM pg_database WHERE datname = $1", &[&name])
        .await
        .expect("read pg_database");
    drop(client);
    let _ = connection.await;
    row.get::<_, i64>(0) == 1
}

/// The queues of `names` that exist.
async fn existing(broker: &Broker, names: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for name in names {
        if broker.queue_exists(name).await {
            found.push(name.clone());
        }
    }
    found
}

/// `TestMessage::of` sets what `Publisher::send` sets: the same properties, read
/// back from the broker, but the random `message_id` (32 hex digits in both).
#[tokio::test(flavor = "multi_thread")]
async fn a_test_message_of_a_type_carries_what_publisher_send_sets() {
    let broker = Broker::connect(&amqp_url()).await;
    broker.delete_queue(PAYMENTS).await;
    broker.declare_queue(PAYMENTS).await;
    let publisher = Publisher::connect(&amqp_url()).await.expect("a publisher");
    let sent_id = publisher.send(&payment("probe")).await.expect("send");
    publisher.close().await;
    let sent = broker.get(PAYMENTS).await.expect("the sent message");
    broker.delete_queue(PAYMENTS).await;

    let typed = TestMessage::of(&payment("probe"));
    let kit_id = typed.properties().message_id().as_ref().expect("a message id").to_string();
    assert_eq!(sent.properties.message_id().as_ref().map(|id| id.to_string()), Some(sent_id));
    assert_eq!(kit_id.len(), 32, "{kit_id}");
    let same_id = |p: &lapin::BasicProperties| p.clone().with_message_id("m".into());
    assert_eq!(same_id(typed.properties()), same_id(&sent.properties));
    assert_eq!(typed.body(), sent.data.as_slice());
    assert_eq!(typed.properties().kind().as_ref().map(|t| t.as_str()), Some("kit.payment"));
    assert_eq!(idemq_tests::header_str(typed.properties(), idemq::headers::VERSION).as_deref(), Some("2"));
}

/// A versioned handler under the kit: a bare version-2 body is read as version 1
/// and dead-lettered (what the kit did with every message before); the same payment
/// sent typed (`send`, `TestMessage::of`) is applied, and every helper takes the
/// typed form; a version-1 body with its header is upcast and found a duplicate.
#[tokio::test(flavor = "multi_thread")]
async fn every_helper_delivers_a_versioned_message_as_send_does() {
    let kit = payments_kit().await;

    match kit.deliver(&payment("bare")).await {
        Outcome::DeadLettered { kind: FailureKind::Decode, error } => {
            assert!(error.contains("version 1") && error.contains("amount"), "{error}");
        }
        other => panic!("a bare v2 body is read as v1: {other:?}"),
    }
    assert_eq!(kit.send(&payment("sent")).await, Outcome::Applied);
    assert_eq!(
        kit.deliver_twice(TestMessage::of(&payment("twice"))).await,
        [Outcome::Applied, Outcome::Duplicate]
    );
    let racing = kit.deliver_concurrently(TestMessage::of(&payment("racing")), 3).await;
    assert_eq!(racing.iter().filter(|o| **o == Outcome::Applied).count(), 1, "{racing:?}");
    assert_eq!(racing.iter().filter(|o| **o == Outcome::Duplicate).count(), 2, "{racing:?}");
    assert_eq!(
        kit.crash_after_commit(TestMessage::of(&payment("crashed"))).await,
        [Outcome::Applied, Outcome::Duplicate]
    );
    let batch = [TestMessage::of(&payment("batch-1")), TestMessage::of(&payment("batch-2"))];
    assert_eq!(kit.deliver_batch(&batch).await, [Outcome::Applied, Outcome::Applied]);

    // 3 euros are the 300 cents applied: one payment in two encodings.
    let v1 = PaymentV1 { payment_id: "sent".into(), account: "acct-sent".into(), amount: 3 };
    let old = TestMessage::json(&v1).message_type("kit.payment").version(1);
    assert_eq!(kit.deliver(old).await, Outcome::Duplicate);
    kit.finish().await;
}

/// Two typed handlers of one queue, tested as one kit: each type reaches its own
/// handler (its own dedup scope: the same key in both applies once in each), a
/// second copy is a duplicate, and a bare message — no type to route by — is
/// dead-lettered `unroutable-type`.
#[tokio::test(flavor = "multi_thread")]
async fn the_typed_handlers_of_one_queue_are_tested_as_one() {
    let kit = TestKit::builder()
        .handler(take_payment)
        .handler(take_refund)
        .tune(|builder| builder.batch_size(1))
        .setup(|url| async move { migrate(&url).await.map_err(Into::into) })
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    let pay = payment("shared");
    let refund =
        Refund { payment_id: pay.payment_id.clone(), account: pay.account.clone(), amount_cents: 100 };

    assert_eq!(kit.send(&pay).await, Outcome::Applied);
    assert_eq!(kit.deliver_twice(TestMessage::of(&refund)).await, [Outcome::Applied, Outcome::Duplicate]);
    assert!(matches!(
        kit.deliver(&refund).await,
        Outcome::DeadLettered { kind: FailureKind::UnroutableType, .. }
    ));
    let handlers: Vec<&str> = kit.settled().iter().map(|s| s.handler).collect();
    assert_eq!(&handlers[..3], ["kit_pay", "kit_refund", "kit_refund"], "{:?}", kit.settled());
    assert_eq!(kit.queues().len(), 7, "the queue, its DLQ and five wait queues: {:?}", kit.queues());
    kit.finish().await;
}

/// `crash_after_commit` of a message its handler does not apply (a bare v2 body,
/// dead-lettered as version 1) fails at once — not after 30 s — naming the outcome,
/// the dead letter's `x-idemq-error` and how to send it typed; the kit goes on,
/// and its next delivery keeps its ack.
#[tokio::test(flavor = "multi_thread")]
async fn a_helper_whose_delivery_ends_unexpectedly_fails_at_once_naming_it() {
    let kit = Arc::new(payments_kit().await);
    let started = Instant::now();
    let crashing = Arc::clone(&kit);
    let failed = tokio::spawn(async move { crashing.crash_after_commit(&payment("bare")).await })
        .await
        .expect_err("a bare v2 body is not applied");
    let elapsed = started.elapsed();
    let message = panic_message(failed);
    assert!(elapsed < Duration::from_secs(10), "failed after {elapsed:?}: {message}");
    for part in [
        "crash_after_commit: its delivery was not applied",
        "`kit_pay`: dead-lettered (x-idemq-error-kind: decode; x-idemq-error: ",
        "version 1",
        "the kit's handlers on queue idemq-kit-",
        "`kit_pay` (type kit.payment, versions 1 to 2)",
        "hint: a message was sent bare",
        "TestMessage::of(&message)",
    ] {
        assert!(message.contains(part), "{part:?} missing from:\n{message}");
    }
    assert_eq!(
        kit.deliver_twice(TestMessage::of(&payment("after"))).await,
        [Outcome::Applied, Outcome::Duplicate]
    );
    assert!(kit.settled().last().expect("settled").settled_with_broker, "its ack was sent");
    Arc::into_inner(kit).expect("the only owner").finish().await;
}

/// What a failing test made: its database and its queues.
type Made = Mutex<Option<(String, Vec<String>)>>;

/// Starts a kit, delivers once, records its database and queues in `made`, then
/// fails an assertion.
async fn a_failing_test(made: Arc<Made>) {
    let kit = payments_kit().await;
    assert_eq!(kit.send(&payment("before-the-panic")).await, Outcome::Applied);
    *made.lock().unwrap() = Some((database_of(kit.database_url()), kit.queues().to_vec()));
    assert_eq!(kit.send(&payment("before-the-panic")).await, Outcome::Applied, "fails: a duplicate");
    kit.finish().await;
}

/// After `a_failing_test` panicked: its database and queues are gone, and stay
/// gone (the kit's runtime did not declare them again).
async fn nothing_left_by(made: &Made) {
    let (database, queues) = made.lock().unwrap().clone().expect("the test body ran up to its assertion");
    assert_eq!(queues.len(), 7, "{queues:?}");
    let broker = Broker::connect(&amqp_url()).await;
    assert!(!database_exists(&database).await, "database {database} left behind");
    assert_eq!(existing(&broker, &queues).await, Vec::<String>::new(), "queues left behind");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(existing(&broker, &queues).await, Vec::<String>::new(), "queues declared again");
}

/// A test body that panics (a failing assertion) on tokio's default current-thread
/// runtime, caught as `catch_unwind` does: the kit, dropped without `finish`,
/// removes its database and its seven queues.
#[tokio::test]
async fn a_panicking_test_leaves_nothing_behind_on_a_current_thread_runtime() {
    let made = Arc::new(Mutex::new(None));
    let panicked = AssertUnwindSafe(a_failing_test(Arc::clone(&made))).catch_unwind().await;
    let message = message_of(&*panicked.expect_err("the assertion fails"));
    assert!(message.contains("fails: a duplicate"), "{message}");
    nothing_left_by(&made).await;
}

/// The same on a multi-thread runtime, the body in a task of its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_test_leaves_nothing_behind_on_a_multi_thread_runtime() {
    let made = Arc::new(Mutex::new(None));
    let failed = tokio::spawn(a_failing_test(Arc::clone(&made))).await.expect_err("the assertion fails");
    assert!(panic_message(failed).contains("fails: a duplicate"));
    nothing_left_by(&made).await;
}

/// A kit whose broker cannot be reached fails to start, and drops the database it
/// made first (the setup, which runs before the broker is tried, saw it); so does
/// one whose setup fails, and one whose setup panics.
#[tokio::test(flavor = "multi_thread")]
async fn a_kit_that_cannot_start_leaves_no_database() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = |seen: &Arc<Mutex<Vec<String>>>, url: &str| seen.lock().unwrap().push(database_of(url));

    let saw = Arc::clone(&seen);
    let unreachable = TestKit::builder()
        .handler(take_payment)
        .amqp_url("amqp://guest:guest@127.0.0.1:1/%2f")
        .setup(move |url| async move {
            record(&saw, &url);
            migrate(&url).await.map_err(Into::into)
        })
        .start()
        .await
        .expect_err("no broker listens on port 1");
    assert!(unreachable.report().contains("127.0.0.1:1"), "{}", unreachable.report());

    let saw = Arc::clone(&seen);
    let failing = TestKit::builder()
        .handler(take_payment)
        .setup(move |url| async move {
            record(&saw, &url);
            Err("the application's migrations do not apply".into())
        })
        .start()
        .await
        .expect_err("the setup fails");
    assert!(failing.report().contains("the application's migrations do not apply"), "{}", failing.report());

    let saw = Arc::clone(&seen);
    let panicking = tokio::spawn(async move {
        TestKit::builder()
            .handler(take_payment)
            .setup(move |url| async move {
                record(&saw, &url);
                assert!(url.is_empty(), "the setup panics");
                Ok(())
            })
            .start()
            .await
    });
    assert!(panic_message(panicking.await.expect_err("the setup panics")).contains("the setup panics"));

    let none = TestKit::builder().start().await.expect_err("no handler");
    assert!(none.report().contains(".handler(h)"), "{}", none.report());

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for database in seen {
        assert!(!database_exists(&database).await, "database {database} left behind");
    }
}
