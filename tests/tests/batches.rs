//! Group commit and lanes: a backlog runs in batches, a failing delivery never sinks
//! its batch, one lane's messages are applied one at a time, in arrival order, and
//! batches that collide are told apart by where they collided. What was logged is
//! read from the process's capture ([`idemq_tests::logs`]): each test reads the lines
//! naming its own queue.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, FailureKind, HandlerError, Outcome, Permanent};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::{eventually, logs, unique};

/// The payments handler, except that an amount of 13 is refused (permanently).
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn refuses_thirteen(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if msg.amount_cents == 13 {
        return Err(Permanent("thirteen is refused").into());
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// A backlog published before the consumer starts is applied in batches of several
/// deliveries per transaction; the one delivery whose handler fails is dead-lettered
/// alone, its batch neighbours are applied, and none of them is charged an attempt.
#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_runs_in_batches_and_a_failing_delivery_does_not_sink_its_neighbours() {
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=40).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let running = Running::start(bed.runtime().concurrency(2).consume(&bed.queue, refuses_thirteen));
    running.wait_settled(payments.len()).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    assert!(events.iter().any(|e| e.batch > 1), "some transaction held several deliveries: {events:?}");
    let dead: Vec<_> = events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. })).collect();
    assert_eq!(dead.len(), 1, "{events:?}");
    assert!(matches!(dead[0].outcome, Outcome::DeadLettered { kind: FailureKind::Handler, .. }));
    assert_eq!(dead[0].batch, 1, "the failing delivery was decided alone");
    assert_eq!(events.iter().filter(|e| e.outcome == Outcome::Applied).count(), payments.len() - 1);
    assert_eq!(stats.retried, 0, "no neighbour was charged an attempt");
    assert!(stats.batch_splits >= 1, "the batch holding it was split: {stats:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64 - 1);
    assert_eq!(bed.doubled().await, Vec::<String>::new());
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}

/// The payments handler, waiting 40 ms inside its transaction (an API call, say).
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn waits_forty_ms(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    tokio::time::sleep(Duration::from_millis(40)).await;
    Ok(())
}

/// A slow handler does not hold a batch-size transaction: the first batch takes at
/// most 16 deliveries (its pace unknown), and once one run is timed a batch takes
/// what runs in about 100 ms — two deliveries of 40 ms — though the batch size is
/// 256 and the whole backlog waits.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_handler_runs_in_batches_its_pace_allows_not_the_batch_size() {
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=30).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    // One transaction at a time: each batch takes what waits, up to its limit.
    let runtime = bed.runtime().concurrency(1).batch_size(256);
    let running = Running::start(runtime.consume(&bed.queue, waits_forty_ms));
    running.wait_settled(payments.len()).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    let first = events[0].batch;
    assert!(first <= 16, "the first batch, its pace unknown, takes at most 16: {first}");
    let later: Vec<usize> = events[first..].iter().map(|e| e.batch).collect();
    assert!(later.iter().all(|&batch| batch <= 2), "then 100 ms of 40 ms handlers, at most 2: {later:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
}

/// The consuming connection is lost while a backlog is held (prefetched, waiting in
/// the process for a transaction): the broker redelivers all of it, flagged
/// redelivered. What this process held and never started comes back as a first
/// delivery and runs in batches; only what had started runs alone (it could be what
/// crashed a consumer) — one transaction at a time, with nothing else running. Each
/// payment once, nothing left.
#[tokio::test(flavor = "multi_thread")]
async fn deliveries_held_unstarted_at_a_lost_connection_come_back_in_batches_not_alone() {
    let bed = Bed::isolated().await;
    let payments: Vec<_> = (1..=1500).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let running = Running::start(
        bed.runtime()
            .concurrency(2)
            .reconnect_max_backoff(Duration::from_millis(200))
            .consume(&bed.queue, idemq_tests::fixture::slow_payment),
    );
    eventually("a few applied", Duration::from_secs(60), || async { bed.ledger_total().await >= 50 }).await;
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    assert_eq!(vhost.close_connections_named("idemq consumer").await, 1, "the consuming connection");
    eventually("every payment applied", Duration::from_secs(120), || async {
        bed.ledger_total().await >= payments.len() as i64
    })
    .await;
    vhost.await_drained(&bed.queue, Duration::from_secs(60)).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    // What had started before the loss committed (its ack was lost with the
    // channel): it comes back redelivered, runs alone and is a duplicate now. What
    // the process held unstarted — most of the channel's prefetch of 2 × 256 — comes
    // back as first deliveries. Only what was still on its way (sent by the broker,
    // not yet read from the socket) comes back redelivered without having started,
    // and runs alone, applied.
    let alone: Vec<_> = events.iter().filter(|e| e.redelivered).collect();
    assert!(alone.iter().all(|e| e.batch == 1), "a redelivered message runs alone");
    let applied_alone = alone.iter().filter(|e| e.outcome != Outcome::Duplicate).count();
    assert!(applied_alone * 4 < 512, "{applied_alone} unstarted deliveries ran alone ({stats:?})");
    let after: Vec<_> = events.iter().filter(|e| e.session > 1 && e.outcome == Outcome::Applied).collect();
    assert!(after.len() > 100, "a backlog was left for the new connection: {}", after.len());
    assert!(after.iter().any(|e| e.batch > 1), "and it ran in batches");
    assert_eq!(bed.doubled().await, Vec::<String>::new());
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}

/// What the laned handler saw: per account, the amounts in the order applied, and
/// whether one account ever had two handlers running at once.
#[derive(Default)]
struct LaneLog {
    running: HashMap<String, u32>,
    applied: HashMap<String, Vec<i64>>,
    overlapped: Vec<String>,
}

static LANES: Mutex<Option<LaneLog>> = Mutex::new(None);

fn lane_log<T>(f: impl FnOnce(&mut LaneLog) -> T) -> T {
    f(LANES.lock().expect("lane log").get_or_insert_with(LaneLog::default))
}

#[idempotent_handler(key = "payment_id", lane = "account")]
async fn laned(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    lane_log(|log| {
        let running = log.running.entry(msg.account.clone()).or_default();
        *running += 1;
        if *running > 1 {
            log.overlapped.push(msg.account.clone());
        }
    });
    // Long enough for a concurrent run of the same lane to be caught.
    tokio::time::sleep(Duration::from_millis(2)).await;
    let (account, amount) = (msg.account.clone(), msg.amount_cents);
    let result = record_payment(conn, &msg).await;
    lane_log(|log| {
        *log.running.entry(account.clone()).or_default() -= 1;
        if result.is_ok() {
            log.applied.entry(account).or_default().push(amount);
        }
    });
    result.map_err(Into::into)
}

/// With a lane, deliveries of one account go to one pipeline: never two at once, in
/// the order published, while several accounts (pipelines) proceed side by side.
#[tokio::test(flavor = "multi_thread")]
async fn one_lanes_messages_are_applied_one_at_a_time_in_arrival_order() {
    let bed = Bed::new().await;
    let accounts: Vec<String> = (0..4).map(|_| unique("lane")).collect();
    let per_account = 30;
    for amount in 1..=per_account {
        for account in &accounts {
            let p = PaymentRequested {
                payment_id: unique("pay"),
                account: account.clone(),
                amount_cents: amount,
            };
            bed.publish(&p).await;
        }
    }
    let total = accounts.len() * per_account as usize;
    let running = Running::start(bed.runtime().consume(&bed.queue, laned));
    running.wait_settled(total).await;
    running.stop().await.expect("clean shutdown");

    let (applied, overlapped) = lane_log(|log| {
        let applied: HashMap<String, Vec<i64>> =
            accounts.iter().map(|a| (a.clone(), log.applied.get(a).cloned().unwrap_or_default())).collect();
        let overlapped: Vec<String> =
            log.overlapped.iter().filter(|a| accounts.contains(a)).cloned().collect();
        (applied, overlapped)
    });
    assert_eq!(overlapped, Vec::<String>::new(), "one lane ran two handlers at once");
    let in_order: Vec<i64> = (1..=per_account).collect();
    for (account, amounts) in &applied {
        assert_eq!(amounts, &in_order, "account {account}: applied in arrival order, each once");
    }
    assert_eq!(bed.ledger_total().await, total as i64);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}

/// The amount whose handler holds its transaction open (1.5 s) after its writes.
const HOLDS: i64 = 700;

/// The payments whose handler is holding its transaction open now.
static HOLDING: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn holding(payment_id: &str) -> bool {
    HOLDING.lock().expect("holding").iter().any(|held| held == payment_id)
}

/// The payments handler, which holds its transaction (its dedup row, its account's
/// row) open for a while on a payment of [`HOLDS`].
#[idempotent_handler(key = "payment_id", name = "holds_its_rows")]
async fn holds_its_rows(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    if msg.amount_cents == HOLDS {
        HOLDING.lock().expect("holding").push(msg.payment_id.clone());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        HOLDING.lock().expect("holding").retain(|held| *held != msg.payment_id);
    }
    Ok(())
}

/// Two batches of two deliveries at once (each full at once): `first`, whose
/// handler holds its transaction open on `first[0]` (a payment of [`HOLDS`]), then
/// `second`, published while it does. On a fresh runtime, whose connections are
/// fresh, the batch limit on lock waits covers the second's dedup insert too.
async fn while_a_batch_holds_its_rows(
    bed: &Bed,
    first: [&PaymentRequested; 2],
    second: [&PaymentRequested; 2],
) -> Running {
    for p in first {
        bed.publish(p).await;
    }
    let runtime = bed.runtime().concurrency(2).batch_size(2).linger(Duration::from_millis(500));
    let running = Running::start(runtime.consume(&bed.queue, holds_its_rows));
    let held = &first[0].payment_id;
    eventually("the first batch holding its rows", Duration::from_secs(20), || async { holding(held) }).await;
    for p in second {
        bed.publish(p).await;
    }
    running.wait_settled(4).await;
    running
}

/// Two copies of one payment in two batches at once: the second batch's dedup
/// insert waits on the first's dedup row past the batch limit and runs again
/// smaller. The payment is applied once, its copy settled as a duplicate, and the
/// log says copies raced, harmlessly — not that the handler needs a lane (it
/// would not help: nothing but the copies collided).
#[tokio::test(flavor = "multi_thread")]
async fn copies_of_one_key_racing_are_called_harmless_without_advising_a_lane() {
    let captured = logs::captured();
    let bed = Bed::new().await;
    let held = payment(HOLDS);
    let running = while_a_batch_holds_its_rows(&bed, [&held, &payment(1)], [&held, &payment(2)]).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    let outcomes: Vec<&Outcome> =
        events.iter().filter(|e| e.key.as_deref() == Some(&held.payment_id)).map(|e| &e.outcome).collect();
    assert_eq!(outcomes.len(), 2, "{events:?}");
    assert!(outcomes.contains(&&Outcome::Applied) && outcomes.contains(&&Outcome::Duplicate), "{outcomes:?}");
    assert_eq!(bed.ledger_rows(&held.payment_id).await, 1, "applied once");
    let lines = captured.lines(&bed.queue, "batches of this queue's handler");
    assert!(!lines.is_empty(), "the second batch's dedup insert collided: {events:?}");
    for line in &lines {
        assert!(line.contains("copies of one message") && line.contains("Harmless"), "{line}");
        assert!(line.contains("INFO"), "nothing to change: not a warning: {line}");
        assert!(!line.contains("give the handler a lane"), "no lane advised for copies: {line}");
    }
}

/// Two payments to one account in two batches at once: the second's handler waits
/// on the account's row past the batch limit. Both are applied, and the warning
/// advises a lane on what they share.
#[tokio::test(flavor = "multi_thread")]
async fn batches_colliding_on_the_handlers_rows_are_advised_a_lane() {
    let captured = logs::captured();
    let bed = Bed::new().await;
    let held = payment(HOLDS);
    let same_account = PaymentRequested { account: held.account.clone(), ..payment(3) };
    let running =
        while_a_batch_holds_its_rows(&bed, [&held, &payment(1)], [&same_account, &payment(2)]).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert_eq!(bed.ledger_rows(&held.payment_id).await, 1);
    assert_eq!(bed.ledger_rows(&same_account.payment_id).await, 1);
    let lines = captured.lines(&bed.queue, "batches of this queue's handler");
    assert!(!lines.is_empty(), "the second batch's handler collided on the account's row: {events:?}");
    for line in &lines {
        assert!(line.contains("WARN") && line.contains("give the handler a lane"), "{line}");
        assert!(!line.contains("copies of one message"), "{line}");
    }
}
