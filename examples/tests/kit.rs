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
