//! The order saga with the test kit: a real runtime, broker and database; time
//! driven forward without sleeping (`advance`, `deliver_due`).

use idemq::saga::Saga;
use idemq::testing::{TestKit, TestMessage};
use idemq::{FailureKind, Outcome};
use idemq_example_payments::orders::{
    order_placed, order_shipped, payment_expired, payment_reserved, CapturePayment, Order, OrderPlaced,
    OrderShipped, PaymentExpired, PaymentReserved, ReleasePayment, Status, PAYMENT_WINDOW,
};

async fn kit() -> TestKit {
    TestKit::builder()
        .handler(order_placed)
        .handler(payment_reserved)
        .handler(order_shipped)
        .handler(payment_expired)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up")
}

/// The saga's state as stored, and whether it has finished.
async fn stored(kit: &TestKit, order_id: &str) -> Option<(Order, bool)> {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        finished: bool,
    }
    let mut conn = kit.connect().await;
    let row: Option<Row> = diesel::sql_query(
        "SELECT state::text AS state, finished_at IS NOT NULL AS finished FROM idemq_saga \
         WHERE saga = 'order' AND key = $1",
    )
    .bind::<diesel::sql_types::Text, _>(order_id)
    .get_result(&mut conn)
    .await
    .ok();
    row.map(|row| (serde_json::from_str(&row.state).expect("an Order"), row.finished))
}

/// What the saga sent of the AMQP type `kind`, decoded, oldest first.
async fn sent<T: serde::de::DeserializeOwned>(kit: &TestKit, kind: &str) -> Vec<T> {
    let published = kit.published().await;
    published
        .iter()
        .filter(|m| m.kind() == Some(kind))
        .map(|m| serde_json::from_slice(m.body()).expect(kind))
        .collect()
}

fn placed(order_id: &str) -> OrderPlaced {
    OrderPlaced { order_id: order_id.into(), amount_cents: 4_200 }
}

fn reserved(order_id: &str) -> PaymentReserved {
    PaymentReserved { order_id: order_id.into(), payment_id: format!("pay-{order_id}") }
}

/// Placed, reserved, shipped: the payment is captured once, the saga completes and
/// its timeout is cancelled — a quarter hour later nothing fires. Every step
/// delivered twice runs once.
#[tokio::test(flavor = "multi_thread")]
async fn an_order_that_ships_captures_its_payment_once_and_its_timeout_never_fires() {
    let kit = kit().await;
    let order = "o-ship";
    let twice = kit.deliver_twice(TestMessage::of(&placed(order))).await;
    assert_eq!(twice, [Outcome::Applied, Outcome::Duplicate]);
    assert_eq!(kit.scheduled().await.len(), 1, "one timeout waits");
    let twice = kit.deliver_twice(TestMessage::of(&reserved(order))).await;
    assert_eq!(twice, [Outcome::Applied, Outcome::Duplicate]);
    let twice = kit.deliver_twice(TestMessage::of(&OrderShipped { order_id: order.into() })).await;
    assert_eq!(twice, [Outcome::Applied, Outcome::Duplicate]);

    let captures: Vec<CapturePayment> = sent(&kit, "payment.capture").await;
    assert_eq!(
        captures,
        vec![CapturePayment {
            order_id: order.into(),
            payment_id: format!("pay-{order}"),
            amount_cents: 4_200
        }]
    );
    let (state, finished) = stored(&kit, order).await.expect("kept finished");
    assert!(finished);
    assert_eq!(state.status, Status::Shipped);
    assert!(kit.scheduled().await.is_empty(), "the timeout was cancelled with the completing step");
    kit.advance(PAYMENT_WINDOW * 2).await;
    assert!(kit.deliver_due().await.is_empty(), "nothing fires");
    kit.finish().await;
}

/// Placed and reserved but not shipped: 14 minutes on nothing happens; at 15 the
/// timeout fires once, releases the reservation and completes the saga. A shipment
/// that comes after is acked without running (the saga has finished).
#[tokio::test(flavor = "multi_thread")]
async fn an_order_not_shipped_within_the_window_is_released_by_its_timeout_once() {
    let kit = kit().await;
    let order = "o-late";
    assert_eq!(kit.send(&placed(order)).await, Outcome::Applied);
    assert_eq!(kit.send(&reserved(order)).await, Outcome::Applied);
    kit.advance(PAYMENT_WINDOW - std::time::Duration::from_secs(60)).await;
    assert!(kit.deliver_due().await.is_empty(), "a minute early");
    kit.advance(std::time::Duration::from_secs(60)).await;
    assert_eq!(kit.deliver_due().await, vec![Outcome::Applied], "due now, once");
    assert!(kit.deliver_due().await.is_empty(), "not again");

    let releases: Vec<ReleasePayment> = sent(&kit, "payment.release").await;
    assert_eq!(
        releases,
        vec![ReleasePayment { order_id: order.into(), payment_id: Some(format!("pay-{order}")) }]
    );
    assert_eq!(stored(&kit, order).await.map(|(s, f)| (s.status, f)), Some((Status::Released, true)));

    // Late: the saga has finished (`finished = "ignore"`): acked, no step, nothing sent.
    assert_eq!(kit.send(&OrderShipped { order_id: order.into() }).await, Outcome::Applied);
    assert!(sent::<CapturePayment>(&kit, "payment.capture").await.is_empty());
    assert_eq!(stored(&kit, order).await.map(|(s, _)| s.status), Some(Status::Released));
    kit.finish().await;
}

/// A copy of the timeout delivered again (a relay that re-sent it after a crash)
/// is a duplicate: one release.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_delivered_twice_releases_once() {
    let kit = kit().await;
    let order = "o-twice";
    assert_eq!(kit.send(&placed(order)).await, Outcome::Applied);
    let timeout = TestMessage::of(&PaymentExpired { order_id: order.into() });
    assert_eq!(kit.deliver_twice(timeout).await, [Outcome::Applied, Outcome::Duplicate]);
    let releases = sent::<ReleasePayment>(&kit, "payment.release").await.len();
    assert_eq!(releases, 1);
    kit.finish().await;
}

/// Shipped before its payment was reserved: the step refuses it, the message is
/// dead-lettered with the reason, and the saga is as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_shipment_before_the_reservation_is_dead_lettered_and_changes_nothing() {
    let kit = kit().await;
    let order = "o-early";
    assert_eq!(kit.send(&placed(order)).await, Outcome::Applied);
    let outcome = kit.send(&OrderShipped { order_id: order.into() }).await;
    assert!(
        matches!(&outcome, Outcome::DeadLettered { kind: FailureKind::Handler, error } if error.contains("shipped before its payment")),
        "{outcome:?}"
    );
    assert_eq!(stored(&kit, order).await.map(|(s, f)| (s.status, f)), Some((Status::Placed, false)));
    kit.finish().await;
}

/// A saga of no table, for unit tests of a step's logic: what a step does to it
/// (its state, the timeouts it schedules) reads back without the kit.
#[tokio::test]
async fn a_step_is_tested_alone_with_a_standalone_saga() {
    let mut saga = Saga::standalone("o-unit", Order::default(), true);
    let mut ctx = idemq::Context::standalone("order_placed", "o-unit");
    assert!(saga.is_new());
    saga.amount_cents = 100;
    assert_eq!(saga.state().amount_cents, 100);
    saga.schedule(&mut ctx, &PaymentExpired { order_id: "o-unit".into() }, PAYMENT_WINDOW)
        .expect("scheduled");
    assert_eq!(saga.timeouts().len(), 1);
    assert_eq!(ctx.published()[0].due(), Some(idemq::outbox::When::After(PAYMENT_WINDOW)));
}

/// What a real publisher may send: a reservation whose order id is empty is
/// dead-lettered as a key error naming the saga's key, and starts or changes no saga.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_without_a_usable_saga_key_is_dead_lettered_as_a_key_error() {
    let kit = kit().await;
    let blank = TestMessage::json(&serde_json::json!({ "order_id": "", "payment_id": "pay-x" }))
        .message_type("payment.reserved");
    let outcome = kit.deliver_message(blank).await;
    assert!(
        matches!(&outcome, Outcome::DeadLettered { kind: FailureKind::Key, error } if error.contains("saga key `order_id`")),
        "{outcome:?}"
    );
    let mut conn = kit.connect().await;
    use diesel_async::RunQueryDsl;
    let sagas = diesel::sql_query("SELECT 1 AS one FROM idemq_saga").execute(&mut conn).await.expect("count");
    assert_eq!(sagas, 0);
    kit.finish().await;
}
