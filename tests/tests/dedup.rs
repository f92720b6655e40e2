//! The dedup core against real RabbitMQ and PostgreSQL: duplicates are skipped,
//! racing duplicates apply once, and a lost ack after COMMIT is harmless.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::testing::fault::FaultHookExt;
use idemq::{idempotent_handler, observe::ConnectionEvent, observe::Settled, Outcome};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};
use idemq_tests::in_both_modes;
use idemq_tests::with_timeout;

use crate::support::faults;

in_both_modes! {
/// The same message published twice: one ledger row, both deliveries acked, queue empty.
async fn the_same_message_twice_is_applied_once_and_both_are_acked() {
    let bed = Bed::new().await;
    let p = payment(1_250);
    bed.publish(&p).await;
    bed.publish(&p).await;

    let events = Running::settle(bed.runtime().consume(&bed.queue, ledger_payment), 2).await;

    let outcomes: Vec<_> = events.iter().map(|e| e.outcome.clone()).collect();
    assert_eq!(outcomes, [Outcome::Applied, Outcome::Duplicate]);
    assert!(events.iter().all(|e| e.settled_with_broker), "both deliveries acked: {events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 1);
    // After the consumer's channel closed, nothing unacked came back.
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
}

/// Like `apply_payment`, but holds its transaction open a while, so a duplicate on
/// another consumer arrives while the first is still uncommitted.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn slow_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await?;
    tokio::time::sleep(Duration::from_millis(40)).await;
    Ok(())
}

in_both_modes! {
/// Two consumers (two runtimes, two connections), every message published twice
/// back to back: the broker hands the copies to different consumers at the same
/// moment. Exactly one applies per key; the test also proves the copies' transactions
/// really overlapped in time (the loser blocked on the unique index, no check-then-act).
async fn racing_duplicates_on_two_consumers_apply_exactly_once() {
    const KEYS: usize = 60;
    let bed = Bed::new().await;
    let a = Running::start(bed.runtime().consume(&bed.queue, slow_payment));
    let b = Running::start(bed.runtime().consume(&bed.queue, slow_payment));
    // Both subscribed before the burst, so deliveries alternate between them (a
    // fixed pause was not always enough on a loaded machine: one consumer took the
    // whole burst and nothing raced).
    idemq_tests::eventually("both consumers subscribed", Duration::from_secs(30), || async {
        bed.broker.consumer_count(&bed.queue).await == 2
    })
    .await;

    let payments: Vec<_> = (0..KEYS).map(|i| payment(100 + i as i64)).collect();
    for p in &payments {
        bed.publish(p).await;
        bed.publish(p).await;
    }
    with_timeout("all copies settled", Duration::from_secs(60), async {
        while a.events().len() + b.events().len() < 2 * KEYS {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let (events_a, events_b) = (a.events(), b.events());
    a.stop().await.expect("clean shutdown a");
    b.stop().await.expect("clean shutdown b");

    let mut by_key: HashMap<String, Vec<(char, Settled)>> = HashMap::new();
    for (who, events) in [('a', &events_a), ('b', &events_b)] {
        for e in events {
            by_key.entry(e.key.clone().expect("every copy has a key")).or_default().push((who, e.clone()));
        }
    }
    let mut overlapping = 0;
    for p in &payments {
        let copies = &by_key[&p.payment_id];
        let applied = copies.iter().filter(|(_, e)| e.outcome == Outcome::Applied).count();
        let duplicates = copies.iter().filter(|(_, e)| e.outcome == Outcome::Duplicate).count();
        assert_eq!((applied, duplicates), (1, 1), "key {}: {copies:?}", p.payment_id);
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "key {}", p.payment_id);
        if let [(who1, e1), (who2, e2)] = copies.as_slice() {
            let (start1, start2) = (e1.began_at.expect("began"), e2.began_at.expect("began"));
            if who1 != who2 && start1 < e2.settled_at && start2 < e1.settled_at {
                overlapping += 1;
            }
        }
    }
    eprintln!("{overlapping} of {KEYS} keys had both copies in flight at once, on different consumers");
    assert_eq!(bed.ledger_total().await, KEYS as i64);
    // A loaded machine stages fewer races (10 of 60 with eight tests beside this
    // one, 20 or more alone); a handful proves the index settled real races.
    assert!(
        overlapping >= 5,
        "only {overlapping} of {KEYS} keys had copies in flight on both consumers at once; the race was not staged"
    );
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// COMMIT succeeded, then the channel died before the ack (a fault hook closes it at
/// exactly that point). The ack must fail visibly; the runtime reconnects, the broker
/// redelivers to the new session, and the redelivery is skipped as a duplicate.
async fn commit_then_lost_ack_redelivery_is_skipped_as_duplicate() {
    let bed = Bed::new().await;
    let p = payment(990);
    bed.publish(&p).await;

    let (hook, fired) = faults::lose_the_first_ack();
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment).fault_hook(hook));
    running.wait_settled(2).await;
    let events = running.events();
    let connection_events = running.connection_events();
    running.stop().await.expect("clean shutdown");

    assert!(fired.load(Ordering::SeqCst), "the fault hook ran");
    // Told apart by what they are, not by the order they were reported in.
    let (Some(first), Some(second)) =
        (events.iter().find(|e| !e.redelivered), events.iter().find(|e| e.redelivered))
    else {
        panic!("the delivery and its redelivery: {events:?}")
    };
    assert_eq!(first.outcome, Outcome::Applied);
    assert!(!first.settled_with_broker, "the ack after the closed channel must fail: {events:?}");
    assert_eq!(second.outcome, Outcome::Duplicate, "{events:?}");
    assert!(second.delivery_count >= 1, "it was a redelivery: {events:?}");
    assert!(second.settled_with_broker);
    assert_eq!((first.session, second.session), (1, 2), "redelivered to the reconnected session");
    assert!(
        matches!(
            connection_events.as_slice(),
            [
                ConnectionEvent::Connected { session: 1 },
                ConnectionEvent::Lost { session: 1, .. },
                ConnectionEvent::Connected { session: 2 }
            ]
        ),
        "{connection_events:?}"
    );
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

/// Every COMMIT of a ledger row takes a while on the server (a deferred trigger
/// sleeps), so the test can cut the connection while the COMMIT is in progress.
/// 3 s: with 1.5 s a loaded fresh-clone CI run saw the COMMIT, and its answer got
/// through before the cut (the outcome was Applied, not Duplicate).
const SLOW_COMMIT: &str = "
    CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();";

in_both_modes! {
/// The network drops while PostgreSQL is committing: the COMMIT lands, its answer
/// never arrives. The runtime cannot know the outcome, so it must not ack and must
/// not count a failed attempt: it runs the transaction again on a fresh connection,
/// where the dedup row (committed by the first) makes it a duplicate. The payment is
/// applied once and the delivery acked once.
async fn a_commit_that_landed_but_whose_answer_was_lost_is_found_as_a_duplicate_by_the_retry() {
    use diesel_async::SimpleAsyncConnection;
    let bed = Bed::new().await;
    bed.db.connect().await.batch_execute(SLOW_COMMIT).await.expect("create the slow trigger");
    let proxy = idemq::testing::NetworkProxy::in_front_of(&bed.db.url()).await.expect("start the proxy");
    let url = proxy.url_for(&bed.db.url());
    assert_ne!(url, bed.db.url(), "the database URL goes through the proxy");
    let p = payment(77);
    bed.publish(&p).await;
    let running = Running::start(bed.runtime().database_url(url).consume(&bed.queue, ledger_payment));

    let committing = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state = 'active' \
         AND query LIKE '%COMMIT' AND pid <> pg_backend_pid()",
        bed.db.name()
    );
    idemq_tests::eventually("a COMMIT in progress on the server", Duration::from_secs(20), || async {
        bed.db.count(&committing).await > 0
    })
    .await;
    proxy.reset_all();

    running.wait_settled(1).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].outcome, Outcome::Duplicate, "the retry found the landed COMMIT's row: {events:?}");
    assert!(events[0].settled_with_broker);
    assert!(stats.infrastructure_retries >= 1, "{stats:?}");
    assert_eq!(stats.retried, 0, "no handler attempt was counted: {stats:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// The first copy of a message commits its dedup row while the duplicate's claim is
/// waiting on it (the claim's own read of the rows applied before cannot see a row
/// committed after its statement began): the duplicate is still settled as one —
/// its row read after the wait — never applied, never failed.
async fn a_duplicate_whose_first_copy_commits_while_its_claim_waits_is_a_duplicate() {
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

    let bed = Bed::new().await;
    let p = payment(700);
    // The first copy, in flight: its dedup row inserted, not yet committed.
    let mut first = bed.db.connect().await;
    first.batch_execute("BEGIN").await.expect("BEGIN");
    diesel::sql_query("INSERT INTO idemq_dedup (handler, key) VALUES ('apply_payment', $1)")
        .bind::<diesel::sql_types::Text, _>(&p.payment_id)
        .execute(&mut first)
        .await
        .expect("the first copy's row");
    // With a new payment beside it: in group commit they share a claim (one
    // statement for both, which reads the rows applied before from its snapshot).
    let q = payment(701);
    bed.publish(&p).await;
    bed.publish(&q).await;
    let builder = bed.runtime().linger(Duration::from_millis(300)).consume(&bed.queue, ledger_payment);
    let running = Running::start(builder);
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    idemq_tests::eventually("the duplicate's claim waits on the first copy's row", Duration::from_secs(30), || async {
        bed.db.count(waiting).await == 1
    })
    .await;
    first.batch_execute("COMMIT").await.expect("COMMIT");

    running.wait_settled(2).await;
    let events = running.events();
    let retries = running.stats.snapshot().infrastructure_retries;
    running.stop().await.expect("clean shutdown");
    let outcome_of = |id: &str| events.iter().find(|e| e.key.as_deref() == Some(id)).map(|e| e.outcome.clone());
    assert_eq!(outcome_of(&p.payment_id), Some(Outcome::Duplicate), "{events:?}");
    assert_eq!(outcome_of(&q.payment_id), Some(Outcome::Applied), "{events:?}");
    assert_eq!(retries, 0, "decided in its first transaction, not by a retry");
    assert!(events.iter().all(|e| e.settled_with_broker), "acked: {events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 0, "not applied: the first copy holds the key");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}
