//! What the runtime logs when a channel is lost with deliveries in flight: one WARN
//! when the first ack (or copy) cannot be sent and one with the count once the lost
//! session's last delivery is done — not one per delivery (a network cut wrote 3,808
//! lines to one consumer's log). What was logged is read from the process's capture
//! ([`idemq_tests::logs`]): each test reads the lines naming its own queue.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use idemq::testing::fault::FaultHookExt;
use idemq::{idempotent_handler, HandlerError, Outcome};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};
use idemq_tests::logs;

use crate::support::faults;

/// Stages a batch whose COMMIT succeeded and whose channel is then closed before the
/// ack (a fault hook at `AfterCommit`), with more batches in flight: every delivery of
/// the lost channel is redelivered and skipped as before, and the log holds one line
/// saying the channel is gone and one counting what was not settled — as many as the
/// deliveries reported `settled_with_broker: false` — and no line per delivery.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_channel_logs_one_line_and_a_count_not_one_line_per_unsettled_delivery() {
    let captured = logs::captured();
    let bed = Bed::new().await;
    const PAYMENTS: usize = 96;
    for i in 0..PAYMENTS {
        bed.publish(&payment(5000 + i as i64)).await;
    }
    let (hook, fired) = faults::lose_the_first_ack();
    let running =
        Running::start(bed.runtime().batch_size(32).consume(&bed.queue, ledger_payment).fault_hook(hook));
    let events = running
        .wait_until("every payment settled with the broker", |events| {
            let settled: HashSet<_> =
                events.iter().filter(|e| e.settled_with_broker).filter_map(|e| e.key.clone()).collect();
            settled.len() == PAYMENTS
        })
        .await;
    running.stop().await.expect("clean shutdown");

    assert!(fired.load(Ordering::SeqCst), "the fault hook ran");
    let unsent = events.iter().filter(|e| !e.settled_with_broker).count();
    assert!(unsent >= 2, "a batch's acks were lost together: {unsent}");
    assert_eq!(bed.doubled().await, Vec::<String>::new());
    let lines = |words: &str| captured.lines(&bed.queue, words);
    let log = lines("");
    assert_eq!(lines("the channel is gone").len(), 1, "{log:#?}");
    let counted = lines("deliveries of the lost channel were not settled");
    assert_eq!(counted.len(), 1, "{log:#?}");
    assert!(counted[0].contains(&format!("unsettled={unsent}")), "{unsent} expected: {log:#?}");
    assert!(lines("not settled").len() == 2, "no line per delivery: {log:#?}");
}

/// Every delivery fails, for now.
#[idempotent_handler(key = "payment_id", name = "always_down")]
async fn always_down(_conn: &mut AsyncPgConnection, _msg: PaymentRequested) -> Result<(), HandlerError> {
    Err(HandlerError::transient("the service behind it is down"))
}

/// A batch of failed deliveries is being copied to its retry wait queue when the
/// publishing channel goes (a fault hook closes it before the first copy): one WARN
/// says the channel is gone and one counts the copies it cost once the session is
/// done — not an ERROR per delivery. Each delivery is requeued and, on a new
/// session, retried to the end: all dead-lettered.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_publishing_channel_logs_one_line_and_a_count_not_an_error_per_copy() {
    use idemq::testing::fault::{FaultContext, FaultHook, FaultPoint};
    let captured = logs::captured();
    let bed = Bed::new().await;
    const PAYMENTS: usize = 32;
    for i in 0..PAYMENTS {
        bed.publish(&payment(7000 + i as i64)).await;
    }
    // The first copy closes the publishing channel; every copy of that batch waits
    // for it, so all of them meet the closed channel.
    let fired = Arc::new(AtomicBool::new(false));
    let closed = Arc::new(AtomicBool::new(false));
    let (fired_in_hook, closed_in_hook) = (Arc::clone(&fired), Arc::clone(&closed));
    let hook: FaultHook = Arc::new(move |ctx: FaultContext| {
        let (fired, closed) = (Arc::clone(&fired_in_hook), Arc::clone(&closed_in_hook));
        Box::pin(async move {
            if ctx.point != FaultPoint::BeforeCopy {
                return;
            }
            if !fired.swap(true, Ordering::SeqCst) {
                ctx.publisher
                    .close(200, "fault: publishing channel lost".into())
                    .await
                    .expect("close the channel");
                closed.store(true, Ordering::SeqCst);
            }
            while !closed.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
    });
    let running =
        Running::start(bed.runtime().batch_size(PAYMENTS).consume(&bed.queue, always_down).fault_hook(hook));
    running
        .wait_until("every payment dead-lettered", |events| {
            let dead: HashSet<_> = events
                .iter()
                .filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. }))
                .filter_map(|e| e.key.clone())
                .collect();
            dead.len() == PAYMENTS
        })
        .await;
    let lines = |words: &str| captured.lines(&bed.queue, words);
    // The count is logged when the lost session's consumer is dropped: after its
    // last copy settled (a failed copy waits a second before its delivery is
    // requeued, and the session may have reconnected and dead-lettered everything
    // by then), so every `Requeued` event of it is in by the time the line is.
    idemq_tests::eventually(
        "the count of lost copies logged",
        std::time::Duration::from_secs(20),
        || async { !lines("could not be published on the lost channel").is_empty() },
    )
    .await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");

    assert!(fired.load(Ordering::SeqCst), "the fault hook ran");
    let requeued = events.iter().filter(|e| matches!(e.outcome, Outcome::Requeued { .. })).count();
    assert!(requeued >= 1, "a copy met the closed channel: {requeued}");
    let log = lines("");
    assert_eq!(lines("could not publish the copy").len(), 0, "no ERROR per copy: {log:#?}");
    assert_eq!(lines("the publishing channel is gone").len(), 1, "{log:#?}");
    let counted = lines("could not be published on the lost channel");
    assert_eq!(counted.len(), 1, "{log:#?}");
    assert!(counted[0].contains(&format!("requeued={requeued}")), "{requeued} expected: {log:#?}");
}
