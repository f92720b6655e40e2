//! Exactly once across two hops: stage A applies payments and publishes an event per
//! payment through the outbox; stage B consumes the events and records each. Under
//! duplicates, a SIGKILL of either stage and the broker closing every connection,
//! every payment has exactly one effect in A and exactly one in B.

use std::time::Duration;

use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idemq::Queue;
use idemq_tests::fixture::{publish_stream, Bed, ConsumerProcess};
use idemq_tests::{eventually, in_both_modes, Broker};

const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");
const PAYMENTS: usize = 400;

async fn count(bed: &Bed, sql: &str) -> i64 {
    let mut conn = bed.db.connect().await;
    diesel::dsl::sql::<diesel::sql_types::BigInt>(sql).get_result(&mut conn).await.expect(sql)
}

async fn wait_for(bed: &Bed, what: &str, sql: &str, at_least: usize) {
    eventually(&format!("{what} ≥ {at_least}"), Duration::from_secs(120), || async {
        count(bed, sql).await >= at_least as i64
    })
    .await;
}

const APPLIED_IN_A: &str = "SELECT count(*) FROM ledger";
const APPLIED_IN_B: &str = "SELECT count(DISTINCT payment_id) FROM notified";

in_both_modes! {
/// Stage A is SIGKILLed (its relay with it: rows committed and not yet published,
/// publishes not yet deleted), later stage B, then the broker closes every
/// connection; each is brought back or reconnects by itself.
async fn a_two_stage_pipeline_has_one_effect_per_input_in_each_stage() {
    let bed = Bed::isolated().await;
    let next = idemq_tests::unique("stage-b");
    let mut conn = bed.db.connect().await;
    conn.batch_execute("CREATE TABLE notified (payment_id text NOT NULL, message_id text NOT NULL)")
        .await
        .expect("create the stage B table");
    let payments = publish_stream(&bed, PAYMENTS).await;
    // A racing duplicate burst: the first 50 payments once more, all at once.
    for payment in payments.iter().take(50) {
        bed.publish(payment).await;
    }
    let a_env = [("NEXT_QUEUE", next.as_str()), ("SLOW_MS", "3")];
    let b_env = [("QUEUE", next.as_str()), ("STAGE", "b"), ("SLOW_MS", "2")];
    let mut a = ConsumerProcess::spawn(CONSUMER, &bed, &a_env);
    // Stage A declares B's queue too; B starts once it exists.
    let mut b = ConsumerProcess::spawn(CONSUMER, &bed, &b_env);

    wait_for(&bed, "applied in A", APPLIED_IN_A, PAYMENTS / 4).await;
    a.kill();
    let a = ConsumerProcess::spawn(CONSUMER, &bed, &a_env);
    wait_for(&bed, "applied in B", APPLIED_IN_B, PAYMENTS / 2).await;
    b.kill();
    let b = ConsumerProcess::spawn(CONSUMER, &bed, &b_env);
    wait_for(&bed, "applied in A", APPLIED_IN_A, PAYMENTS * 3 / 4).await;
    bed.vhost.as_ref().expect("isolated").close_all_connections().await;

    wait_for(&bed, "applied in A", APPLIED_IN_A, PAYMENTS).await;
    wait_for(&bed, "applied in B", APPLIED_IN_B, PAYMENTS).await;
    let vhost = bed.vhost.as_ref().expect("isolated");
    for queue in [&bed.queue, &next] {
        vhost.await_drained(queue, Duration::from_secs(60)).await;
    }
    assert!(a.terminate(Duration::from_secs(20)).await.success(), "stage A exits 0 on SIGTERM");
    assert!(b.terminate(Duration::from_secs(20)).await.success(), "stage B exits 0 on SIGTERM");

    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice in A");
    assert_eq!(count(&bed, APPLIED_IN_A).await, PAYMENTS as i64, "every payment applied in A");
    assert_eq!(count(&bed, "SELECT count(*) FROM notified").await, PAYMENTS as i64, "one effect per payment in B");
    assert_eq!(count(&bed, APPLIED_IN_B).await, PAYMENTS as i64);
    assert_eq!(
        count(&bed, "SELECT count(DISTINCT message_id) FROM notified WHERE message_id <> ''").await,
        PAYMENTS as i64,
        "each event carried its own message id"
    );
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_outbox").await, 0, "the outbox is empty");
    let broker = Broker::connect(&bed.amqp_url).await;
    let next_dlq = Queue::new(next.clone()).dead_letter_name().to_owned();
    for queue in [&bed.queue, &bed.dlq, &next, &next_dlq] {
        assert_eq!(broker.message_count(queue).await, 0, "{queue} is empty");
    }
}
}
