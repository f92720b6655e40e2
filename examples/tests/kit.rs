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
