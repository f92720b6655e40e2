//! The payments handler under `idemq::testing`: what a user's own handler tests look
//! like — once, twice, concurrently, and with the ack lost after COMMIT.

use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use idemq::testing::TestKit;
use idemq::Outcome;
use idemq_example_payments::{apply_payment, ledger, migrate, PaymentRequested};

fn payment(id: &str) -> PaymentRequested {
    PaymentRequested { payment_id: id.to_owned(), account: format!("acct-{id}"), amount_cents: 250 }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payment_is_applied_once_however_often_it_arrives() {
    let kit = TestKit::prepare(
        apply_payment,
        |builder| builder,
        |url| async move { migrate(&url).await.map_err(Into::into) },
    )
    .await
    .expect("PostgreSQL and RabbitMQ are up");

    assert_eq!(kit.deliver_twice(&payment("twice")).await, [Outcome::Applied, Outcome::Duplicate]);
    let racing = kit.deliver_concurrently(&payment("racing"), 4).await;
    assert_eq!(racing.iter().filter(|o| **o == Outcome::Applied).count(), 1, "{racing:?}");
    assert_eq!(racing.iter().filter(|o| **o == Outcome::Duplicate).count(), 3, "{racing:?}");
    assert_eq!(kit.crash_after_commit(&payment("crashed")).await, [Outcome::Applied, Outcome::Duplicate]);

    let mut conn = kit.connect().await;
    for id in ["twice", "racing", "crashed"] {
        let rows: i64 = ledger::table
            .filter(ledger::payment_id.eq(id))
            .count()
            .get_result(&mut conn)
            .await
            .expect("count");
        assert_eq!(rows, 1, "{id} applied once");
    }
    drop(conn);
    kit.finish().await;
}

/// The batch handler's own logic, called directly (`apply_payment::call`, the fn
/// under the attribute) on a batch built by hand — no broker, no dedup rows, no
/// runtime: each payment's effect, and one event per payment with the message id
/// the runtime would give it.
#[tokio::test(flavor = "multi_thread")]
async fn the_batch_fn_called_directly_applies_each_payment_and_publishes_its_event() {
    use diesel_async::{AnsiTransactionManager, TransactionManager};
    use idemq::{Batch, Context};

    let kit = TestKit::prepare(
        apply_payment,
        |builder| builder,
        |url| async move { migrate(&url).await.map_err(Into::into) },
    )
    .await
    .expect("PostgreSQL and RabbitMQ are up");
    let mut conn = kit.connect().await;
    let mut batch: Batch<PaymentRequested> = ["direct-1", "direct-2"]
        .into_iter()
        .map(|id| (payment(id), Context::standalone("apply_payment", id)))
        .collect();
    AnsiTransactionManager::begin_transaction(&mut conn).await.expect("BEGIN");
    apply_payment::call(&mut conn, &mut batch).await.expect("the batch applies");
    AnsiTransactionManager::commit_transaction(&mut conn).await.expect("COMMIT");

    let contexts = batch.into_contexts();
    for (id, ctx) in ["direct-1", "direct-2"].into_iter().zip(&contexts) {
        let rows: i64 = ledger::table
            .filter(ledger::payment_id.eq(id))
            .count()
            .get_result(&mut conn)
            .await
            .expect("count");
        assert_eq!(rows, 1, "{id} applied");
        let [event] = ctx.published() else { panic!("one event for {id}: {:?}", ctx.published()) };
        assert!(String::from_utf8_lossy(event.body()).contains(id), "{event:?}");
        let again = Context::standalone("apply_payment", id)
            .send(&idemq_example_payments::PaymentApplied::from(payment(id)))
            .expect("serializes");
        assert_eq!(event.id(), Some(again.as_str()), "a stable message id: every run publishes the same");
    }
    drop(conn);
    kit.finish().await;
}

/// What a batch handler gets when several payments arrive together: with a linger,
/// three payments of one account (one lane) published back to back run in one
/// transaction, and each publishes its event — read back from the kit's outbox.
#[tokio::test(flavor = "multi_thread")]
async fn payments_delivered_together_run_in_one_batch_and_each_publishes_its_event() {
    use idemq::testing::TestMessage;

    let kit = TestKit::prepare(
        apply_payment,
        |builder| builder.linger(std::time::Duration::from_millis(200)),
        |url| async move { migrate(&url).await.map_err(Into::into) },
    )
    .await
    .expect("PostgreSQL and RabbitMQ are up");
    let payments: Vec<PaymentRequested> = ["b-1", "b-2", "b-3"]
        .into_iter()
        .map(|id| PaymentRequested { account: "acct-shared".to_owned(), ..payment(id) })
        .collect();
    let outcomes = kit.deliver_batch(payments.iter().map(TestMessage::json)).await;
    assert_eq!(outcomes, [Outcome::Applied, Outcome::Applied, Outcome::Applied]);
    assert!(kit.settled().iter().all(|s| s.batch == 3), "one transaction: {:?}", kit.settled());

    let published = kit.published().await;
    assert_eq!(published.len(), 3, "an event per payment: {published:?}");
    for (event, payment) in published.iter().zip(&payments) {
        let applied: serde_json::Value = serde_json::from_slice(event.body()).expect("JSON");
        assert_eq!(applied["payment_id"], payment.payment_id.as_str(), "{applied}");
    }
    kit.finish().await;
}

/// The reply to a quote: what the handler returned, with a field that differs on
/// every run of it (a second run would give another reply).
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Quote {
    payment_id: String,
    fee_cents: i64,
    run: u64,
}

/// A request handler keyed by the publisher's `message_id`: it answers with a quote.
#[idemq::idempotent_handler(key = "@message_id", name = "quote")]
async fn quote(
    _conn: &mut diesel_async::AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<Quote, idemq::HandlerError> {
    Ok(Quote { payment_id: msg.payment_id, fee_cents: msg.amount_cents / 100, run: fastrand_run() })
}

fn fastrand_run() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}

/// A request delivered with the properties a real requester sets, answered from
/// the outbox: the second delivery of the same `message_id` is a duplicate and gets
/// the first reply, byte for byte; another `message_id` with the same body is a new
/// request.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_keyed_by_its_message_id_is_answered_once_and_the_same_way_again() {
    use idemq::testing::TestMessage;

    let kit = TestKit::start(quote).await.expect("PostgreSQL and RabbitMQ are up");
    let asked =
        |message_id: &str| TestMessage::json(&payment("q-1")).message_id(message_id).header("tenant", "acme");

    let first = kit.request_message(asked("m-1")).await;
    assert_eq!(first.outcome, Outcome::Applied);
    assert!(!first.is_error());
    let answer: Quote = first.json();
    assert_eq!((answer.payment_id.as_str(), answer.fee_cents), ("q-1", 2));

    let again = kit.request_message(asked("m-1")).await;
    assert_eq!(again.outcome, Outcome::Duplicate);
    let (first, again) = (first.message.expect("a reply"), again.message.expect("a reply"));
    assert_eq!(again.body(), first.body(), "the stored reply, byte for byte");
    assert_eq!(again.id(), first.id());

    let other = kit.request_message(asked("m-2")).await;
    assert_eq!(other.outcome, Outcome::Applied, "another message_id: another request");
    assert_ne!(other.json::<Quote>().run, answer.run);
    kit.finish().await;
}
