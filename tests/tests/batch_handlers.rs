//! Batch handlers (`batch: &mut Batch<M>`): one call per transaction with its new
//! messages, each applied once; a failing, panicking or miscounting batch is run in
//! halves until the message at fault is alone, and only that one is charged; results,
//! replies and outbox events stay per message. Each test has its own handler (and
//! counters), database and queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};
// `AtomicUsize::load` by its path: `RunQueryDsl::load` is in scope too.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::testing::TestKit;
use idemq::{idempotent_handler, Batch, FailureKind, HandlerError, Outcome, Permanent};
use idemq_example_payments::{accounts, record_payments, PaymentApplied, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, unique};
use lapin::message::BasicGetMessage;

static COUNTED_CALLS: AtomicUsize = AtomicUsize::new(0);
static COUNTED_MESSAGES: AtomicUsize = AtomicUsize::new(0);

/// The demo's effect, counting its calls and the messages they held.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn counted(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    COUNTED_CALLS.fetch_add(1, Ordering::SeqCst);
    COUNTED_MESSAGES.fetch_add(batch.len(), Ordering::SeqCst);
    record_payments(conn, batch.messages()).await?;
    Ok(())
}

/// A backlog over three accounts (three lanes), every fourth payment published twice:
/// each payment is applied once and each double acked as a duplicate, in fewer handler
/// calls than payments (several per call), and each account's balance is the sum of
/// its payments (the per-account totals of one upsert).
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_handler_applies_each_message_once_in_fewer_calls_than_messages() {
    let bed = Bed::new().await;
    let accounts: Vec<String> = (0..3).map(|_| unique("acct")).collect();
    let payments: Vec<PaymentRequested> = (0..60)
        .map(|i| PaymentRequested { account: accounts[i % 3].clone(), ..payment(i as i64 + 1) })
        .collect();
    let mut deliveries = 0;
    for (i, p) in payments.iter().enumerate() {
        bed.publish(p).await;
        deliveries += 1;
        if i % 4 == 0 {
            bed.publish(p).await;
            deliveries += 1;
        }
    }
    let running = Running::start(bed.runtime().consume(&bed.queue, counted));
    running.wait_settled(deliveries).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    let applied = events.iter().filter(|e| e.outcome == Outcome::Applied).count();
    let duplicates = events.iter().filter(|e| e.outcome == Outcome::Duplicate).count();
    assert_eq!(applied, payments.len(), "{events:?}");
    assert_eq!(duplicates, deliveries - payments.len(), "{events:?}");
    let calls = AtomicUsize::load(&COUNTED_CALLS, Ordering::SeqCst);
    assert!(calls < payments.len(), "{calls} calls for {} payments: one per transaction", payments.len());
    assert_eq!(
        AtomicUsize::load(&COUNTED_MESSAGES, Ordering::SeqCst),
        payments.len(),
        "each new message handed over once"
    );
    assert!(events.iter().any(|e| e.batch > 1), "some transaction held several deliveries");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    assert_eq!(bed.doubled().await, Vec::<String>::new());
    let mut conn = bed.db.connect().await;
    let balances: HashMap<String, i64> = accounts::table
        .filter(accounts::account.eq_any(&accounts))
        .select((accounts::account, accounts::balance_cents))
        .load(&mut conn)
        .await
        .expect("read balances")
        .into_iter()
        .collect();
    for account in &accounts {
        let sum: i64 = payments.iter().filter(|p| &p.account == account).map(|p| p.amount_cents).sum();
        assert_eq!(balances.get(account), Some(&sum), "account {account}");
    }
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}

/// What the folding handler saw: per account, the amounts in the order applied,
/// and the accounts that ever had two calls running at once.
#[derive(Default)]
struct FoldLog {
    running: HashMap<String, u32>,
    applied: HashMap<String, Vec<i64>>,
    overlapped: BTreeSet<String>,
}

static FOLD_LOG: std::sync::Mutex<Option<FoldLog>> = std::sync::Mutex::new(None);

fn fold_log<T>(f: impl FnOnce(&mut FoldLog) -> T) -> T {
    f(FOLD_LOG.lock().expect("fold log").get_or_insert_with(FoldLog::default))
}

/// The demo's effect, logging each account's payments in the order applied.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn folds(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    let accounts: BTreeSet<String> = batch.messages().iter().map(|p| p.account.clone()).collect();
    fold_log(|log| {
        for account in &accounts {
            let running = log.running.entry(account.clone()).or_default();
            *running += 1;
            if *running > 1 {
                log.overlapped.insert(account.clone());
            }
        }
    });
    // Long enough for a concurrent call holding the same account to be caught.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let recorded = record_payments(conn, batch.messages()).await;
    fold_log(|log| {
        for account in &accounts {
            *log.running.entry(account.clone()).or_default() -= 1;
        }
        if recorded.is_ok() {
            for p in batch.messages() {
                log.applied.entry(p.account.clone()).or_default().push(p.amount_cents);
            }
        }
    });
    recorded?;
    Ok(())
}

/// A quick batch handler's lanes are folded into two pipelines once its pace is
/// known, part way through a backlog several prefetches long (the intake first
/// waits for every delivery it sent to the pipelines to run): no account ever has
/// two calls at once, and each account's payments are applied once, in the order
/// published, before, across and after the fold.
#[tokio::test(flavor = "multi_thread")]
async fn folding_a_quick_batch_handlers_lanes_keeps_each_lane_in_order() {
    let bed = Bed::new().await;
    let accounts: Vec<String> = (0..40).map(|_| unique("fold")).collect();
    let per_account = 15;
    for amount in 1..=per_account {
        for account in &accounts {
            bed.publish(&PaymentRequested {
                payment_id: unique("pay"),
                account: account.clone(),
                amount_cents: amount,
            })
            .await;
        }
    }
    let total = accounts.len() * per_account as usize;
    // Six pipelines, a prefetch of 6 × 16 = 96: the backlog is over six prefetches.
    let running = Running::start(bed.runtime().concurrency(6).batch_size(16).consume(&bed.queue, folds));
    running.wait_settled(total).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    let (applied, overlapped) = fold_log(|log| {
        let applied: HashMap<String, Vec<i64>> =
            accounts.iter().map(|a| (a.clone(), log.applied.get(a).cloned().unwrap_or_default())).collect();
        let overlapped: Vec<String> =
            log.overlapped.iter().filter(|a| accounts.contains(a)).cloned().collect();
        (applied, overlapped)
    });
    assert_eq!(overlapped, Vec::<String>::new(), "one lane ran two calls at once");
    let in_order: Vec<i64> = (1..=per_account).collect();
    for (account, amounts) in &applied {
        assert_eq!(amounts, &in_order, "account {account}: applied in the order published, each once");
    }
    assert_eq!(bed.ledger_total().await, total as i64);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}

/// Refuses 13 (permanently), and 14 on its first attempt (transiently).
static WAITING_NOW: AtomicUsize = AtomicUsize::new(0);
static WAITING_MOST: AtomicUsize = AtomicUsize::new(0);

/// The demo's effect, then 80 ms waiting on something else (an API, say), counting
/// the calls running at once.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn waits_on_an_api(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    let now = WAITING_NOW.fetch_add(1, Ordering::SeqCst) + 1;
    WAITING_MOST.fetch_max(now, Ordering::SeqCst);
    let recorded = record_payments(conn, batch.messages()).await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    WAITING_NOW.fetch_sub(1, Ordering::SeqCst);
    recorded?;
    Ok(())
}

/// A batch handler that waits on something else keeps its lanes side by side: once
/// its pace is known (80 ms a call, so batches of one), each lane pipeline's batch
/// starts as it arrives — only a quick batch handler's full batches wait for room.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_handler_waiting_on_an_api_runs_its_lanes_side_by_side() {
    let bed = Bed::new().await;
    let running = Running::start(bed.runtime().concurrency(8).consume(&bed.queue, waits_on_an_api));
    bed.publish(&payment(1)).await;
    running.wait_settled(1).await;
    WAITING_MOST.store(0, Ordering::SeqCst);
    // Each payment its own account: its own lane.
    let payments: Vec<_> = (2..=25).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    running.wait_settled(payments.len() + 1).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    let most = AtomicUsize::load(&WAITING_MOST, Ordering::SeqCst);
    assert!(most >= 4, "calls at once: {most}, of 8 pipelines (2 means they waited for room)");
    assert_eq!(bed.ledger_total().await, payments.len() as i64 + 1);
}

#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn picky(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    for (msg, ctx) in batch.iter() {
        if msg.amount_cents == 13 {
            return Err(Permanent("thirteen is refused").into());
        }
        if msg.amount_cents == 14 && ctx.attempt() == 1 {
            return Err(HandlerError::transient("fourteen: not yet"));
        }
    }
    record_payments(conn, batch.messages()).await?;
    Ok(())
}

/// A batch whose handler fails names no message: it runs in halves until the
/// failing message is alone. That one alone is charged — 13 dead-lettered, 14 retried
/// and applied on its second attempt — and every neighbour is applied, uncharged.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_message_is_isolated_and_its_neighbours_are_applied() {
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=40).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let thirteen = payments[12].payment_id.clone();
    let fourteen = payments[13].payment_id.clone();
    let running = Running::start(bed.runtime().concurrency(2).consume(&bed.queue, picky));
    let fourteens = running.wait_for_end(&fourteen).await;
    running.wait_settled(payments.len() + 1).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    let dead: Vec<_> = events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. })).collect();
    assert_eq!(dead.len(), 1, "{events:?}");
    assert_eq!(dead[0].key.as_deref(), Some(thirteen.as_str()));
    assert!(matches!(dead[0].outcome, Outcome::DeadLettered { kind: FailureKind::Handler, .. }));
    assert_eq!(dead[0].batch, 1, "the failing message was decided alone");
    let outcomes: Vec<_> = fourteens.iter().map(|e| (e.attempt, e.outcome.clone(), e.batch)).collect();
    assert!(matches!(outcomes[0], (1, Outcome::Retry { .. }, 1)), "{outcomes:?}");
    assert!(matches!(outcomes[1], (2, Outcome::Applied, _)), "{outcomes:?}");
    assert_eq!(events.iter().filter(|e| e.outcome == Outcome::Applied).count(), payments.len() - 1);
    assert_eq!(stats.retried, 1, "only fourteen was charged an attempt");
    assert!(stats.batch_splits >= 1, "the batches holding them were split: {stats:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64 - 1);
    assert_eq!(bed.doubled().await, Vec::<String>::new());
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 1);
}

/// Panics when it sees 13.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn panicky(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    record_payments(conn, batch.messages()).await?;
    assert!(batch.messages().iter().all(|msg| msg.amount_cents != 13), "thirteen panics");
    Ok(())
}

/// A panicking batch handler is cut off (its transaction rolled back, with what it
/// wrote) and its batch runs in halves: the message that panics, alone, is retried
/// and dead-lettered after its last attempt; its neighbours are applied once.
#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_batch_handler_fails_only_the_message_it_panics_on() {
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=30).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let thirteen = payments[12].payment_id.clone();
    let running = Running::start(bed.runtime().concurrency(2).consume(&bed.queue, panicky));
    let attempts = running.wait_for_end(&thirteen).await;
    running.wait_settled(payments.len() - 1 + attempts.len()).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    let last = attempts.last().expect("an end");
    match &last.outcome {
        Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, error } => {
            assert!(error.contains("panicked") && error.contains("thirteen panics"), "{error}");
        }
        other => panic!("thirteen ends dead-lettered, not {other:?}"),
    }
    assert!(attempts.iter().all(|e| e.batch == 1), "charged only alone: {attempts:?}");
    assert_eq!(events.iter().filter(|e| e.outcome == Outcome::Applied).count(), payments.len() - 1);
    assert_eq!(bed.ledger_rows(&thirteen).await, 0, "its rolled-back writes are gone");
    assert_eq!(bed.ledger_total().await, payments.len() as i64 - 1);
    assert_eq!(bed.doubled().await, Vec::<String>::new());
}

/// A receipt: what the handler returned for one payment. `run` is new on every call,
/// so a reply made by a second run would differ.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Receipt {
    payment_id: String,
    run: String,
}

/// One receipt per payment, in the batch's order.
#[idempotent_handler(key = "payment_id", name = "quote")]
async fn receipts(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<Vec<Receipt>, HandlerError> {
    record_payments(conn, batch.messages()).await?;
    let run = unique("run");
    Ok(batch
        .messages()
        .iter()
        .map(|msg| Receipt { payment_id: msg.payment_id.clone(), run: run.clone() })
        .collect())
}

async fn request(bed: &Bed, payment: &PaymentRequested, reply_to: &str, correlation_id: &str) {
    let body = serde_json::to_vec(payment).expect("serialize");
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_reply_to(reply_to.into())
        .with_correlation_id(correlation_id.into());
    bed.broker.publish_bytes(&bed.queue, &body, props).await;
}

async fn replies(bed: &Bed, queue: &str, n: u32) -> Vec<BasicGetMessage> {
    eventually(&format!("{n} replies"), Duration::from_secs(20), || async {
        bed.broker.message_count(queue).await >= n
    })
    .await;
    bed.broker.drain(queue).await
}

fn correlation(reply: &BasicGetMessage) -> String {
    reply.delivery.properties.correlation_id().as_ref().map(|c| c.to_string()).expect("a correlation id")
}

fn message_id(message: &BasicGetMessage) -> String {
    message.delivery.properties.message_id().as_ref().map(|id| id.to_string()).expect("a message id")
}

/// Requests answered by a batch handler: each reply is its own message's result
/// (stored with its dedup row), and a duplicated request gets its first reply again,
/// byte for byte, without the handler running.
#[tokio::test(flavor = "multi_thread")]
async fn each_request_of_a_batch_gets_its_own_result_and_a_duplicate_the_same_bytes() {
    let bed = Bed::isolated().await;
    let reply_queue = unique("replies");
    bed.broker.declare_queue(&reply_queue).await;
    let payments: Vec<_> = (1..=12).map(payment).collect();
    for (i, p) in payments.iter().enumerate() {
        request(&bed, p, &reply_queue, &format!("c-{i}")).await;
    }
    let running = Running::start(bed.runtime().consume(&bed.queue, receipts));
    running.wait_settled(payments.len()).await;
    let first = replies(&bed, &reply_queue, payments.len() as u32).await;
    request(&bed, &payments[5], &reply_queue, "c-5").await;
    running.wait_settled(payments.len() + 1).await;
    let again = replies(&bed, &reply_queue, 1).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert!(events.iter().any(|e| e.batch > 1), "some requests shared a call: {events:?}");
    assert_eq!(first.len(), payments.len());
    let by_correlation: BTreeMap<String, &BasicGetMessage> =
        first.iter().map(|r| (correlation(r), r)).collect();
    for (i, p) in payments.iter().enumerate() {
        let reply = by_correlation[&format!("c-{i}")];
        let receipt: Receipt = serde_json::from_slice(&reply.delivery.data).expect("a receipt");
        assert_eq!(receipt.payment_id, p.payment_id, "request c-{i} got its own payment's result");
    }
    let original = by_correlation["c-5"];
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].delivery.data, original.delivery.data, "the same reply bytes");
    assert_eq!(message_id(&again[0]), message_id(original));
    assert_eq!(bed.ledger_rows(&payments[5].payment_id).await, 1, "the handler ran once for it");
}

/// Publishes two events per payment, to the queue named in its account.
#[idempotent_handler(key = "payment_id", name = "notify")]
async fn notify(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    record_payments(conn, batch.messages()).await?;
    for (msg, ctx) in batch.iter_mut() {
        let event = PaymentApplied::from(msg.clone());
        ctx.publish("", &msg.account, &event)?;
        ctx.publish("", &msg.account, &event)?;
    }
    Ok(())
}

/// What each message of a batch publishes through its own context goes out once it
/// commits, under message ids of its own: two events per payment, every id distinct,
/// and nothing more for the duplicates.
#[tokio::test(flavor = "multi_thread")]
async fn each_message_of_a_batch_publishes_its_own_events_under_distinct_ids() {
    let bed = Bed::isolated().await;
    let target = unique("events");
    bed.broker.declare_queue(&target).await;
    let payments: Vec<_> =
        (1..=15).map(|i| PaymentRequested { account: target.clone(), ..payment(i) }).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    for p in payments.iter().step_by(3) {
        bed.publish(p).await;
    }
    let deliveries = payments.len() + payments.len().div_ceil(3);
    let running = Running::start(bed.runtime().consume(&bed.queue, notify));
    running.wait_settled(deliveries).await;
    eventually("every event published", Duration::from_secs(20), || async {
        bed.broker.message_count(&target).await >= 2 * payments.len() as u32
    })
    .await;
    running.stop().await.expect("clean shutdown");

    let events = bed.broker.drain(&target).await;
    assert_eq!(events.len(), 2 * payments.len(), "two per payment, none for a duplicate");
    let mut per_payment: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for event in &events {
        let applied: PaymentApplied = serde_json::from_slice(&event.delivery.data).expect("an event");
        per_payment.entry(applied.payment_id).or_default().insert(message_id(event));
    }
    assert_eq!(per_payment.len(), payments.len());
    assert!(per_payment.values().all(|ids| ids.len() == 2), "{per_payment:?}");
    let all: BTreeSet<&String> = per_payment.values().flatten().collect();
    assert_eq!(all.len(), 2 * payments.len(), "every message id distinct");
}

/// One result too many whenever 13 is in the batch.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn miscounts(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<Vec<i64>, HandlerError> {
    record_payments(conn, batch.messages()).await?;
    let mut results: Vec<i64> = batch.messages().iter().map(|msg| msg.amount_cents).collect();
    if results.contains(&13) {
        results.push(0);
    }
    Ok(results)
}

/// A `Vec` of results whose length is not the batch's fails the batch, with a message
/// saying so: 13 ends dead-lettered alone (after its retries); the others are applied.
#[tokio::test(flavor = "multi_thread")]
async fn results_of_the_wrong_number_fail_the_batch_with_a_clear_message() {
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=20).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let thirteen = payments[12].payment_id.clone();
    let running = Running::start(bed.runtime().consume(&bed.queue, miscounts));
    let attempts = running.wait_for_end(&thirteen).await;
    running.wait_settled(payments.len() - 1 + attempts.len()).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    match &attempts.last().expect("an end").outcome {
        Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, error } => {
            assert!(error.contains("returned 2 results for a batch of 1 messages"), "{error}");
        }
        other => panic!("thirteen ends dead-lettered, not {other:?}"),
    }
    assert_eq!(events.iter().filter(|e| e.outcome == Outcome::Applied).count(), payments.len() - 1);
    assert_eq!(bed.ledger_total().await, payments.len() as i64 - 1);
}

/// The test kit runs a batch handler as the runtime does: once, twice, concurrently,
/// and with the ack lost after COMMIT, each payment applied once.
#[tokio::test(flavor = "multi_thread")]
async fn the_test_kit_runs_a_batch_handler() {
    let kit = TestKit::prepare(
        idemq_example_payments::apply_payment,
        |builder| builder,
        |url| async move { idemq_example_payments::migrate(&url).await.map_err(Into::into) },
    )
    .await
    .expect("PostgreSQL and RabbitMQ are up");
    let twice = payment(250);
    assert_eq!(kit.deliver_twice(&twice).await, [Outcome::Applied, Outcome::Duplicate]);
    let racing = kit.deliver_concurrently(&payment(300), 4).await;
    assert_eq!(racing.iter().filter(|o| **o == Outcome::Applied).count(), 1, "{racing:?}");
    assert_eq!(kit.crash_after_commit(&payment(350)).await, [Outcome::Applied, Outcome::Duplicate]);
    let mut conn = kit.connect().await;
    let rows: i64 = idemq_example_payments::ledger::table
        .filter(idemq_example_payments::ledger::payment_id.eq(&twice.payment_id))
        .count()
        .get_result(&mut conn)
        .await
        .expect("count");
    assert_eq!(rows, 1);
    drop(conn);
    kit.finish().await;
}
