//! What the runtime logs when a channel is lost with deliveries in flight: one WARN
//! when the first ack cannot be sent and one with the count once the lost session's
//! last delivery is done — not one per delivery (a network cut wrote 3,808 lines to
//! one consumer's log). A test binary of its own: it installs the process's global
//! subscriber, to read what was logged.

use std::collections::HashSet;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};

/// What the test's subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stages a batch whose COMMIT succeeded and whose channel is then closed before the
/// ack (a fault hook at `AfterCommit`), with more batches in flight: every delivery of
/// the lost channel is redelivered and skipped as before, and the log holds one line
/// saying the channel is gone and one counting what was not settled — as many as the
/// deliveries reported `settled_with_broker: false` — and no line per delivery.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_channel_logs_one_line_and_a_count_not_one_line_per_unsettled_delivery() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("idemq=warn"))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    let bed = Bed::new().await;
    const PAYMENTS: usize = 96;
    for i in 0..PAYMENTS {
        bed.publish(&payment(5000 + i as i64)).await;
    }
    let (hook, fired) = idemq_tests::fixture::lose_the_first_ack();
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
    let log = String::from_utf8_lossy(&captured.0.lock().expect("lock")).into_owned();
    let lines = |words: &str| log.lines().filter(|line| line.contains(words)).collect::<Vec<_>>();
    assert_eq!(lines("the channel is gone").len(), 1, "{log}");
    let counted = lines("deliveries of the lost channel were not settled");
    assert_eq!(counted.len(), 1, "{log}");
    assert!(counted[0].contains(&format!("unsettled={unsent}")), "{unsent} expected: {log}");
    assert!(lines("not settled").len() == 2, "no line per delivery: {log}");
}
