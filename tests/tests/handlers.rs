//! Handlers written the way people really write them: ignoring an error, ending the
//! transaction themselves, panicking, sleeping in the database, reusing a fn name,
//! tripping a constraint checked only at COMMIT. None of them may get a delivery
//! acked without its effect, or stuck.

use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemq::{
    headers, idempotent_handler, Error, FailureKind, HandlerError, Outcome, Queue, RetryPolicy, Topology,
};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{
    ignores_an_error, ledger_payment, next_attempt, payment, test_retry_policy, Bed, Running,
};
use idemq_tests::in_both_modes;
use idemq_tests::{eventually, header_str, unique};

/// Publishes one payment to a runtime with `handler`, whose first attempt must fail
/// with an error saying `phrase` and whose second must apply it, exactly once. (The
/// attempts are read by number once the payment came to its end: the retry can be
/// settled, and reported, before the attempt that made it.)
async fn first_attempt_fails_then_applies<H: idemq::Handler>(handler: H, phrase: &str) {
    let bed = Bed::new().await;
    let p = payment(10);
    bed.publish(&p).await;
    let events = Running::settle_message(bed.runtime().consume(&bed.queue, handler), &p.payment_id).await;
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");
    match &events[0].outcome {
        Outcome::Retry { error, .. } => assert!(error.contains(phrase), "{error}"),
        other => panic!("the first attempt must fail (\"{phrase}\"), not end {other:?}"),
    }
    assert_eq!(events[1].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "the first attempt's writes were rolled back");
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 1);
}

in_both_modes! {
/// The failed statement aborted the transaction, so PostgreSQL answers COMMIT with
/// `ROLLBACK` and no error: nothing was written, not even the dedup row. idemq must
/// see it, count a failed attempt and retry — not ack the message as applied.
async fn a_handler_that_ignores_a_failed_statement_is_rolled_back_and_retried_not_acked() {
    first_attempt_fails_then_applies(ignores_an_error, "its error was ignored").await;
}
}

/// Ends idemq's transaction (ROLLBACK: the dedup row is gone) and begins its own,
/// on the first attempt.
#[idempotent_handler(key = "payment_id")]
async fn ends_the_transaction(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    if next_attempt(&msg.payment_id) == 1 {
        conn.batch_execute("ROLLBACK; BEGIN").await?;
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

in_both_modes! {
/// A handler that runs its own ROLLBACK/BEGIN would have its writes committed
/// without the dedup row (a redelivery would apply them again). idemq refuses the
/// COMMIT of a transaction that is not the one holding the dedup row.
async fn a_handler_that_ends_idemqs_transaction_itself_is_rolled_back_and_retried() {
    first_attempt_fails_then_applies(ends_the_transaction, "ended idemq's transaction").await;
}
}

/// Resets the session's prepared statements (idemq's COMMIT check among them) on
/// the first attempt.
#[idempotent_handler(key = "payment_id")]
async fn deallocates(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if next_attempt(&msg.payment_id) == 1 {
        conn.batch_execute("DEALLOCATE idemq_check").await?;
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

in_both_modes! {
/// Without its prepared check idemq cannot tell an aborted transaction from a good
/// one: the attempt fails, its connection is dropped, and the retry (on a fresh
/// connection, with the check prepared again) applies the payment.
async fn a_handler_that_discards_idemqs_prepared_check_fails_its_attempt_and_the_retry_applies() {
    first_attempt_fails_then_applies(deallocates, "discarded idemq's prepared statements").await;
}
}

/// Panics on every message whose payment id starts with `boom`.
#[idempotent_handler(key = "payment_id")]
async fn panics(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), diesel::result::Error> {
    if msg.payment_id.starts_with("boom") {
        panic!("boom: account {} exploded", msg.account);
    }
    record_payment(conn, &msg).await
}

in_both_modes! {
/// A panic is a failed attempt like any error: with one slot (`concurrency(1)`) the
/// next message is still consumed, and after its last attempt the panicking one is
/// dead-lettered with the panic message in `x-idemq-error`.
async fn a_panicking_handler_fails_its_attempt_and_frees_its_slot() {
    let bed = Bed::new().await;
    let boom = PaymentRequested { payment_id: unique("boom"), account: unique("acct"), amount_cents: 1 };
    let good = payment(2);
    bed.publish(&boom).await;
    bed.publish(&good).await;
    let two_attempts = RetryPolicy::new([Duration::from_millis(10)]);
    let builder = bed.runtime().concurrency(1).consume_with(&bed.queue, panics, two_attempts);
    let running = Running::start(builder);
    let good_events = running.wait_for_end(&good.payment_id).await;
    let boom_events = running.wait_for_end(&boom.payment_id).await;
    running.stop().await.expect("clean shutdown");

    assert_eq!(good_events.len(), 1, "{good_events:?}");
    assert_eq!(good_events[0].outcome, Outcome::Applied);
    assert_eq!(boom_events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{boom_events:?}");
    assert!(matches!(boom_events[0].outcome, Outcome::Retry { .. }), "{boom_events:?}");
    assert!(
        matches!(boom_events[1].outcome, Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, .. }),
        "{boom_events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1);
    let error = header_str(&dead[0].delivery.properties, headers::ERROR).unwrap_or_default();
    assert!(error.contains("panicked") && error.contains("exploded"), "{error}");
    assert_eq!(bed.ledger_rows(&boom.payment_id).await, 0);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

/// Writes the payment, then sleeps in the database (marked so the test can find
/// the statement), on the first attempt.
#[idempotent_handler(key = "payment_id")]
async fn sleeps_in_the_database(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    let first = next_attempt(&msg.payment_id) == 1;
    record_payment(conn, &msg).await?;
    if first {
        diesel::sql_query("SELECT pg_sleep(60) /* idemq-test-sleeper */").execute(conn).await?;
    }
    Ok(())
}

in_both_modes! {
/// Dropping a timed-out handler's connection does not stop its statement on the
/// server, which keeps its locks (here: the uncommitted dedup row the retry's insert
/// would wait on for a minute). idemq cancels the statement: the server-side sleep
/// ends at once and the retry applies the payment.
async fn a_timed_out_handler_stuck_in_the_database_is_cancelled_and_releases_its_locks() {
    let bed = Bed::new().await;
    let p = payment(30);
    bed.publish(&p).await;
    let builder = bed.runtime().handler_timeout(Duration::from_millis(300));
    let running = Running::start(builder.consume(&bed.queue, sleeps_in_the_database));
    let events = running.wait_until("attempt 1 settled", |events| events.iter().any(|e| e.attempt == 1)).await;
    match &events.iter().find(|e| e.attempt == 1).expect("attempt 1").outcome {
        Outcome::Retry { error, .. } => assert!(error.contains("did not finish"), "{error}"),
        other => panic!("a timeout is a failed attempt, not {other:?}"),
    }
    eventually("the sleeping statement ended on the server", Duration::from_secs(10), || async {
        let sleepers = "SELECT count(*) FROM pg_stat_activity \
             WHERE query LIKE '%idemq-test-sleeper%' AND state = 'active' AND pid <> pg_backend_pid()";
        bed.db.count(sleepers).await == 0
    })
    .await;
    // Had the sleeper kept the dedup row locked, this retry would wait a minute.
    let events = running.wait_for_end(&p.payment_id).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");
    assert_eq!(events[1].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}
}

/// A ledger row of 13 cents breaks a constraint checked only at COMMIT.
const REFUSE_13_AT_COMMIT: &str = "
    CREATE FUNCTION refuse_13() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.amount_cents = 13 THEN RAISE EXCEPTION 'thirteen is refused at commit'; END IF;
        RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER refuse_13 AFTER INSERT ON ledger
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_13();";

in_both_modes! {
/// A COMMIT answered with an error is a definite rollback, not an outage whose
/// outcome is unknown: a failed attempt like any other (retried, counted, then
/// dead-lettered), never retried in-process for the database retry limit.
async fn a_commit_refused_by_a_deferred_constraint_is_a_failed_attempt_not_an_outage() {
    let bed = Bed::new().await;
    bed.db.connect().await.batch_execute(REFUSE_13_AT_COMMIT).await.expect("create the trigger");
    let p = payment(13);
    bed.publish(&p).await;
    let three_attempts = RetryPolicy::new([10, 20].map(Duration::from_millis));
    let running = Running::start(bed.runtime().consume_with(&bed.queue, ledger_payment, three_attempts));
    let events = running.wait_for_end(&p.payment_id).await;
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2, 3], "{events:?}");
    assert!(matches!(events[0].outcome, Outcome::Retry { .. }), "{events:?}");
    assert!(matches!(events[1].outcome, Outcome::Retry { .. }), "{events:?}");
    match &events[2].outcome {
        Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, error } => {
            assert!(error.contains("refused the COMMIT") && error.contains("thirteen"), "{error}");
        }
        other => panic!("expected attempts-exhausted, got {other:?}"),
    }
    assert_eq!(stats.infrastructure_retries, 0, "a refused COMMIT is not a database fault: {stats:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 0);
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 0);
}
}

mod ledger_a {
    use super::*;

    /// One service's handler, named `handle`.
    #[idempotent_handler(key = "payment_id")]
    pub(super) async fn handle(
        conn: &mut AsyncPgConnection,
        msg: PaymentRequested,
    ) -> Result<(), diesel::result::Error> {
        record_payment(conn, &msg).await
    }
}

mod ledger_b {
    use super::*;

    /// Another module's handler, also named `handle`.
    #[idempotent_handler(key = "payment_id")]
    pub(super) async fn handle(
        conn: &mut AsyncPgConnection,
        msg: PaymentRequested,
    ) -> Result<(), diesel::result::Error> {
        record_payment(conn, &msg).await
    }
}

/// Two handlers with one fn name would share one dedup namespace, and the second's
/// messages would be acked as duplicates without running: the runtime refuses to
/// be built, naming both and the fix.
#[test]
fn two_handlers_with_the_same_name_are_refused_when_the_runtime_is_built() {
    let built = idemq::Runtime::builder()
        .topology(Topology::new().queue(Queue::new("a")).queue(Queue::new("b")))
        .consume("a", ledger_a::handle)
        .consume("b", ledger_b::handle)
        .build();
    let Err(Error::Config(message)) = built else { panic!("two handlers named `handle` must be refused") };
    assert!(message.contains("ledger_a::handle") && message.contains("ledger_b::handle"), "{message}");
    assert!(message.contains("name = "), "the message says how to fix it: {message}");
    // The same handler on two queues is one handler: allowed.
    let same =
        idemq::Runtime::builder().consume("a", ledger_a::handle).consume("b", ledger_a::handle).build();
    assert!(same.is_ok(), "{same:?}");
}

in_both_modes! {
/// Two services sharing one database, each with a handler of the same name and
/// its own namespace: the same key is applied once by each, not once in all.
async fn two_services_in_one_database_keep_their_dedup_rows_apart_by_namespace() {
    let bed = Bed::new().await;
    let other_queue = unique("q");
    let other_topology = Topology::new().queue(Queue::new(other_queue.clone()));
    let channel = bed.broker.connection().create_channel().await.expect("open a channel");
    other_topology.declare(&channel).await.expect("declare the other service's queue");
    let p = payment(40);
    bed.publish(&p).await;
    let billing = Running::start(bed.runtime().namespace("billing").consume(&bed.queue, ledger_payment));
    let audit = Running::start(
        bed.runtime().topology(other_topology).namespace("audit").consume(&other_queue, ledger_payment),
    );
    billing.wait_settled(1).await;
    let body = serde_json::to_vec(&p).unwrap();
    let props = lapin::BasicProperties::default().with_content_type("application/json".into());
    bed.broker.publish_bytes(&other_queue, &body, props).await;
    audit.wait_settled(1).await;
    assert_eq!(billing.events()[0].outcome, Outcome::Applied);
    assert_eq!(
        audit.events()[0].outcome,
        Outcome::Applied,
        "another service's row must not make it a duplicate"
    );
    billing.stop().await.expect("clean shutdown");
    audit.stop().await.expect("clean shutdown");
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 2);
    let wait_queues = test_retry_policy().wait_queues(&other_queue).into_iter().map(|(name, _)| name);
    for queue in [other_queue.clone(), format!("{other_queue}.dlq")].into_iter().chain(wait_queues) {
        bed.broker.delete_queue(&queue).await;
    }
}
}

/// The first two COMMITs of a ledger row fail with a serialization failure (40001);
/// a sequence counts them, since it is not rolled back with the transaction.
const SERIALIZATION_FAILURES_AT_COMMIT: &str = "
    CREATE SEQUENCE commit_failures;
    CREATE FUNCTION fail_twice() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF nextval('commit_failures') <= 2 THEN
            RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
        END IF;
        RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER fail_twice AFTER INSERT ON ledger
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_twice();";

in_both_modes! {
/// A serialization failure (or deadlock) at COMMIT is a rollback worth running
/// again at once: the transaction is run again in-process, with no attempt counted
/// and no copy made, and the payment is applied by the first delivery.
async fn a_commit_rolled_back_for_contention_is_run_again_in_process() {
    let bed = Bed::new().await;
    bed.db.connect().await.batch_execute(SERIALIZATION_FAILURES_AT_COMMIT).await.expect("create the trigger");
    let p = payment(50);
    bed.publish(&p).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    running.wait_settled(1).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(events[0].attempt, 1);
    assert_eq!((stats.retried, stats.infrastructure_retries), (0, 0), "{stats:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}
}
