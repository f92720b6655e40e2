//! The chaos suite: real faults while a stream of payments with duplicates flows
//! through several consumers. After each, the books must balance: every payment
//! applied exactly once, nothing left in the queue, nothing in the DLQ.
//!
//! Every test has its own vhost and database, so faults scoped by vhost (closing
//! connections) or by database (killing sessions) run beside other tests. Faults
//! that touch the whole broker live in `broker_faults.rs`, which runs serially;
//! those of a whole PostgreSQL server in `database_faults.rs`, on a server of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::testing::fault::FaultHookExt;
use idemq::testing::fault::{FaultContext, FaultHook, FaultPoint};
use idemq::testing::NetworkProxy;
use idemq::{observe::ConnectionEvent, Outcome};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{
    ledger_payment, payment, publish_stream, slow_payment, Bed, ConsumerProcess, Running,
};
use idemq_tests::in_both_modes;
use idemq_tests::{eventually, Broker};
use tokio::process::Command;

const CONSUMER: &str = env!("CARGO_BIN_EXE_consumer");
const PAYMENTS: usize = 600;

async fn wait_applied(bed: &Bed, at_least: usize) {
    eventually(&format!("{at_least} payments applied"), Duration::from_secs(120), || async {
        bed.ledger_total().await >= at_least as i64
    })
    .await;
}

/// Lets the last redeliveries settle before the consumers stop: nothing ready,
/// nothing delivered and unacked (group commit's prefetch window is large, and every
/// redelivered message in it runs alone). Twice, a second apart: a channel a fault
/// just closed returns its window to the queue a moment later.
async fn wait_drained(bed: &Bed) {
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    for _ in 0..2 {
        vhost.await_drained(&bed.queue, Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The books after the consumers stopped: each payment once, nothing left anywhere.
async fn assert_books_balance(bed: &Bed, payments: &[PaymentRequested]) {
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice");
    assert_eq!(bed.ledger_total().await, payments.len() as i64, "every payment applied");
    for p in payments.iter().step_by(53) {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{}", p.payment_id);
    }
    // A fresh client: faults may have closed the bed's own connection.
    let broker = Broker::connect(&bed.amqp_url).await;
    assert_eq!(broker.message_count(&bed.queue).await, 0, "nothing left in the queue");
    assert_eq!(broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
}

/// Sessions of the bed's database sitting inside a handler's transaction (slow
/// handlers: their last statement was the payment's balance upsert). Only those: the
/// outbox relay's short claim transactions sit idle in transaction too.
async fn open_transactions(bed: &Bed) -> i64 {
    use diesel_async::RunQueryDsl;
    let mut conn = bed.db.connect().await;
    diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state LIKE 'idle in transaction%' \
         AND query LIKE '%accounts%'",
        bed.db.name()
    ))
    .get_result(&mut conn)
    .await
    .unwrap_or(0)
}

/// Terminates the sessions [`open_transactions`] counts, in one statement.
async fn kill_open_transactions(bed: &Bed) {
    use diesel_async::RunQueryDsl;
    let mut conn = bed.db.connect().await;
    let _: Result<i64, _> = diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{}' \
         AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' AND query LIKE '%accounts%'",
        bed.db.name()
    ))
    .get_result(&mut conn)
    .await;
}

fn two_runtimes(bed: &Bed, tune: impl Fn(idemq::RuntimeBuilder) -> idemq::RuntimeBuilder) -> [Running; 2] {
    let start = || {
        Running::start(tune(
            bed.runtime().consume(&bed.queue, slow_payment).reconnect_max_backoff(Duration::from_millis(500)),
        ))
    };
    [start(), start()]
}

fn lost(running: &Running) -> usize {
    running.connection_events().iter().filter(|e| matches!(e, ConnectionEvent::Lost { .. })).count()
}

in_both_modes! {
/// Fault 1: a consumer process is SIGKILLed mid-stream (its prefetch window and any
/// open transaction die with it), then started again.
async fn chaos_sigkill_a_consumer_process_mid_stream() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, PAYMENTS).await;
    let env = [("SLOW_MS", "3")];
    let mut a = ConsumerProcess::spawn(CONSUMER, &bed, &env);
    let b = ConsumerProcess::spawn(CONSUMER, &bed, &env);
    wait_applied(&bed, PAYMENTS / 3).await;
    a.kill();
    assert!(a.exited().is_some(), "killed");
    let a = ConsumerProcess::spawn(CONSUMER, &bed, &env);
    wait_applied(&bed, PAYMENTS).await;
    wait_drained(&bed).await;
    assert!(a.terminate(Duration::from_secs(20)).await.success());
    assert!(b.terminate(Duration::from_secs(20)).await.success());
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// Fault 2: the broker closes every connection of the vhost, twice, mid-stream
/// (`rabbitmqctl close_all_connections -p <vhost>`). Both runtimes reconnect by
/// themselves.
async fn chaos_broker_closes_the_consumers_connections() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, PAYMENTS).await;
    let runtimes = two_runtimes(&bed, |b| b);
    let vhost = bed.vhost.as_ref().expect("isolated");
    wait_applied(&bed, PAYMENTS / 3).await;
    vhost.close_all_connections().await;
    wait_applied(&bed, PAYMENTS * 2 / 3).await;
    vhost.close_all_connections().await;
    wait_applied(&bed, PAYMENTS).await;
    // Every payment is applied, but the redeliveries of what the closed channels held
    // (duplicates, acked without running) may still be on their way: stopping now
    // would leave them in the queue (seen: 34 left).
    wait_drained(&bed).await;
    for running in runtimes {
        assert!(lost(&running) >= 2, "{:?}", running.connection_events());
        running.stop().await.expect("clean shutdown");
    }
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// Fault 4: PostgreSQL kills the consumers' sessions (`pg_terminate_backend`, scoped
/// to the test's database) three times mid-stream.
async fn chaos_postgres_kills_the_consumers_sessions() {
    let bed = Bed::isolated().await;
    let mut payments = publish_stream(&bed, PAYMENTS).await;
    let runtimes = two_runtimes(&bed, |b| b);
    // Early in the stream a kill must hit a transaction: group commit applies the
    // stream fast, and a kill landing between batches only closes idle pooled
    // connections (seen twice in fresh-clone CI runs, once after waiting for an open
    // transaction: the 3 ms window had closed before `psql` started). So the first
    // kill aims at the sessions inside a handler's transaction, in one statement,
    // until the runtimes report a transaction retried. And the stream may end before
    // one lands (the likely cause of 60 s of kills without a hit, seen once with six
    // tests at a time): while none has, more payments keep transactions coming.
    wait_applied(&bed, PAYMENTS / 8).await;
    let retried = || runtimes.iter().map(|running| running.stats.snapshot().infrastructure_retries).sum::<u64>();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while retried() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no kill hit a handler's transaction in 60 s");
        if bed.ledger_total().await >= payments.len() as i64 {
            payments.extend(publish_stream(&bed, PAYMENTS / 4).await);
        }
        kill_open_transactions(&bed).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for fraction in 2..=3 {
        wait_applied(&bed, PAYMENTS * fraction / 8).await;
        bed.db.kill_sessions().await;
    }
    wait_applied(&bed, payments.len()).await;
    wait_drained(&bed).await;
    let mut infrastructure_retries = 0;
    for running in runtimes {
        let stats = running.stats.snapshot();
        infrastructure_retries += stats.infrastructure_retries;
        assert_eq!((stats.retried, stats.dead_lettered), (0, 0), "database faults burn no attempts");
        running.stop().await.expect("clean shutdown");
    }
    assert!(infrastructure_retries > 0, "the kills hit transactions");
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// Fault 5: COMMIT succeeds and then the ack is lost — the channel is closed between
/// the two, on every 100th commit of each runtime. Each loss forces a reconnect and
/// a redelivery that must be skipped as a duplicate.
async fn chaos_ack_lost_after_commit() {
    let bed = Bed::isolated().await;
    let payments = publish_stream(&bed, PAYMENTS).await;
    let hook = || -> FaultHook {
        let commits = Arc::new(AtomicU64::new(0));
        Arc::new(move |ctx: FaultContext| {
            let commits = Arc::clone(&commits);
            Box::pin(async move {
                if ctx.point == FaultPoint::AfterCommit
                    && ctx.outcome == Outcome::Applied
                    && commits.fetch_add(1, Ordering::SeqCst) % 100 == 99
                {
                    let _ = ctx.channel.close(200, "fault: ack lost after commit".into()).await;
                }
            })
        })
    };
    let runtimes = two_runtimes(&bed, |b| b.fault_hook(hook()));
    wait_applied(&bed, PAYMENTS).await;
    wait_drained(&bed).await;
    let mut unsettled = 0;
    for running in runtimes {
        unsettled += running.stats.snapshot().unsettled;
        running.stop().await.expect("clean shutdown");
    }
    assert!(unsettled >= 2, "acks were lost after commit: {unsettled}");
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// Fault 6: SIGTERM while a handler is slower than the shutdown deadline (1 s). The
/// process exits 0 soon after the deadline, the cut-off transactions roll back, their
/// messages return to the queue, and a later consumer applies them exactly once.
async fn chaos_sigterm_with_a_handler_slower_than_the_shutdown_deadline() {
    let bed = Bed::isolated().await;
    let payments: Vec<_> = (0..3).map(|i| payment(500 + i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let slow = ConsumerProcess::spawn(CONSUMER, &bed, &[("SLOW_MS", "60000"), ("SHUTDOWN_MS", "1000")]);
    // Wait until all three handlers sleep inside their open transactions (the
    // process starts, migrates and connects first: slow on a loaded machine).
    eventually("the slow handlers are in flight", Duration::from_secs(60), || async {
        open_transactions(&bed).await >= 3
    })
    .await;
    let signalled = Instant::now();
    let status = slow.terminate(Duration::from_secs(15)).await;
    let took = signalled.elapsed();
    assert!(status.success(), "exit 0 after SIGTERM: {status:?}");
    assert!(took < Duration::from_secs(8), "exited {took:?} after SIGTERM with a 1 s deadline");
    assert_eq!(bed.ledger_total().await, 0, "the cut-off transactions rolled back");

    let fast = ConsumerProcess::spawn(CONSUMER, &bed, &[]);
    wait_applied(&bed, payments.len()).await;
    assert!(fast.terminate(Duration::from_secs(20)).await.success());
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// Fault 6b: SIGTERM while eight handlers (2 s each) are in flight and the shutdown
/// deadline (10 s) leaves them time. The drain lets them finish: exit 0 before the
/// deadline, every payment committed after the signal, and each delivery acked by
/// that process — once the broker has seen it go, nothing came back to the queue,
/// and a consumer started afterwards has nothing to settle.
async fn chaos_sigterm_with_handlers_faster_than_the_shutdown_deadline_acks_them() {
    let bed = Bed::isolated().await;
    let payments: Vec<_> = (0..8).map(|i| payment(800 + i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let env = [("SLOW_MS", "2000"), ("SHUTDOWN_MS", "10000"), ("CONCURRENCY", "8")];
    let consumer = ConsumerProcess::spawn(CONSUMER, &bed, &env);
    eventually("the eight handlers are in flight", Duration::from_secs(20), || async {
        open_transactions(&bed).await >= 8
    })
    .await;
    let committed_before = bed.ledger_total().await;
    let signalled = Instant::now();
    let status = consumer.terminate(Duration::from_secs(15)).await;
    let took = signalled.elapsed();
    assert!(status.success(), "exit 0 after SIGTERM: {status:?}");
    assert!(took < Duration::from_secs(10), "drained in {took:?}, within the 10 s deadline");
    assert!(
        committed_before < 8,
        "SIGTERM came while handlers were in flight ({committed_before} committed)"
    );
    assert_eq!(bed.ledger_total().await, 8, "the in-flight handlers finished and committed");

    // Acked by that process: when the broker drops a consumer it returns its unacked
    // deliveries to the queue, so with no consumer left the queue must be empty.
    let broker = Broker::connect(&bed.amqp_url).await;
    eventually("the broker saw the consumer go", Duration::from_secs(10), || async {
        broker.consumer_count(&bed.queue).await == 0
    })
    .await;
    assert_eq!(broker.message_count(&bed.queue).await, 0, "no delivery was returned unacked");
    let after = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    eventually("a second consumer is subscribed", Duration::from_secs(10), || async {
        after.connection_events().contains(&ConnectionEvent::Connected { session: 1 })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let redelivered = after.events();
    after.stop().await.expect("clean shutdown");
    assert!(redelivered.is_empty(), "nothing was redelivered: {redelivered:?}");
    assert_books_balance(&bed, &payments).await;
}
}

in_both_modes! {
/// A broker that goes silent without closing (a TCP proxy black-holes the
/// connection) is detected by heartbeats within a bounded time; once the network is
/// back, the runtime reconnects (through the proxy) and goes on consuming.
async fn a_silent_broker_is_detected_by_heartbeats_and_the_runtime_reconnects() {
    let bed = Bed::isolated().await;
    let proxy = NetworkProxy::in_front_of(&bed.amqp_url).await.expect("start the proxy");
    let via_proxy = proxy.url_for(&bed.amqp_url);
    let running = Running::start(
        bed.runtime()
            .amqp_url(via_proxy)
            .heartbeat(Duration::from_secs(1))
            .reconnect_max_backoff(Duration::from_millis(500))
            .consume(&bed.queue, ledger_payment),
    );
    let first = payment(1);
    bed.publish(&first).await;
    running.wait_settled(1).await;

    proxy.black_hole();
    let frozen = Instant::now();
    eventually("the silent connection is detected", Duration::from_secs(15), || async {
        lost(&running) >= 1
    })
    .await;
    let detected = frozen.elapsed();
    assert!(detected < Duration::from_secs(6), "detected after {detected:?} with a 1 s heartbeat");
    proxy.restore();
    eventually("reconnected", Duration::from_secs(15), || async {
        running.connection_events().contains(&ConnectionEvent::Connected { session: 2 })
    })
    .await;

    let second = payment(2);
    bed.publish(&second).await;
    running.wait_settled(2).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events[1].session, 2, "consumed on the new connection");
    assert_eq!(bed.ledger_rows(&first.payment_id).await, 1);
    assert_eq!(bed.ledger_rows(&second.payment_id).await, 1);
}
}

in_both_modes! {
/// The broker cancels the consumer (`basic.cancel`) because its queue was deleted:
/// the runtime declares the topology again and re-subscribes.
async fn a_consumer_cancelled_by_the_broker_resubscribes() {
    let bed = Bed::isolated().await;
    let running = Running::start(
        bed.runtime().reconnect_max_backoff(Duration::from_millis(500)).consume(&bed.queue, ledger_payment),
    );
    eventually("consuming", Duration::from_secs(10), || async {
        running.connection_events().contains(&ConnectionEvent::Connected { session: 1 })
    })
    .await;
    bed.broker.delete_queue(&bed.queue).await;
    eventually("re-subscribed", Duration::from_secs(15), || async {
        running.connection_events().contains(&ConnectionEvent::Connected { session: 2 })
    })
    .await;
    let p = payment(9);
    bed.publish(&p).await;
    running.wait_settled(1).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}
}

in_both_modes! {
/// A second SIGTERM during the drain exits at once (status 130) instead of waiting
/// out the shutdown deadline; still safe: the unacked delivery is redelivered and a
/// later consumer applies it exactly once.
async fn a_second_signal_exits_at_once_and_loses_nothing() {
    let bed = Bed::isolated().await;
    let p = payment(42);
    bed.publish(&p).await;
    let slow = ConsumerProcess::spawn(CONSUMER, &bed, &[("SLOW_MS", "60000"), ("SHUTDOWN_MS", "30000")]);
    eventually("the slow handler is in flight", Duration::from_secs(20), || async {
        open_transactions(&bed).await >= 1
    })
    .await;
    let pid = slow.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let signalled = Instant::now();
    let status = slow.terminate(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(130), "the second signal exits at once: {status:?}");
    assert!(signalled.elapsed() < Duration::from_secs(5), "well before the 30 s deadline");

    let fast = ConsumerProcess::spawn(CONSUMER, &bed, &[]);
    wait_applied(&bed, 1).await;
    assert!(fast.terminate(Duration::from_secs(20)).await.success());
    assert_books_balance(&bed, &[p]).await;
}
}
