//! PostgreSQL failing under a running stream: sessions killed, the server restarted.
//! Database faults are not handler failures: nothing may be dead-lettered, no
//! attempt burned, nothing lost, nothing doubled.
//!
//! These tests disturb the whole PostgreSQL server (a restart drops every session on
//! the machine), so they live in their own test binary — `cargo test` runs binaries
//! one after another — and take a lock so they run one at a time.

use std::collections::HashSet;
use std::time::Duration;

use idemq::{Outcome, StatsSnapshot};
use idemq_tests::fixture::{publish_stream, slow_payment, stream_deliveries, Bed, Running};
use tokio::process::Command;
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// Streams 400 payments (+20% duplicates) and runs `fault` once 60 have settled;
/// returns the runtime's counters after everything settled.
async fn stream_through<F: std::future::Future<Output = ()>>(bed: &Bed, fault: F) -> StatsSnapshot {
    let payments = publish_stream(bed, 400).await;
    let total = stream_deliveries(payments.len());
    let running = Running::start(bed.runtime().consume(&bed.queue, slow_payment));
    running.wait_settled(60).await;
    fault.await;
    idemq_tests::with_timeout("every delivery settled after the fault", Duration::from_secs(120), async {
        while running.events().len() < total {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    let unexpected: Vec<_> =
        events.iter().filter(|e| !matches!(e.outcome, Outcome::Applied | Outcome::Duplicate)).collect();
    assert!(unexpected.is_empty(), "only applied or duplicate outcomes: {unexpected:?}");
    let applied: HashSet<_> =
        events.iter().filter(|e| e.outcome == Outcome::Applied).filter_map(|e| e.key.clone()).collect();
    assert_eq!(applied.len(), payments.len(), "each payment applied once");
    assert_eq!(bed.ledger_total().await, payments.len() as i64, "nothing doubled in the ledger");
    for p in payments.iter().step_by(37) {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{}", p.payment_id);
    }
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0, "nothing left behind");
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
    assert_eq!(stats.retried, 0, "no handler attempt was burned by the database fault");
    assert!(stats.infrastructure_retries > 0, "the fault hit transactions in flight: {stats:?}");
    stats
}

async fn psql(sql: &str) {
    let status = Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-qAtc", sql])
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .expect("run psql");
    assert!(status.success(), "psql {sql}");
}

async fn wait_for_postgres() {
    idemq_tests::eventually("PostgreSQL accepts connections", Duration::from_secs(60), || async {
        Command::new("pg_isready")
            .args(["-h", "127.0.0.1", "-p", "5432"])
            .status()
            .await
            .is_ok_and(|s| s.success())
    })
    .await;
}

/// PostgreSQL kills the consumer's sessions (`pg_terminate_backend`) three times
/// mid-stream: in-flight transactions fail, their deliveries stay unacked and are
/// retried in-process on fresh connections.
#[tokio::test(flavor = "multi_thread")]
async fn killed_database_sessions_mid_stream_lose_nothing_and_double_nothing() {
    let _serial = SERIAL.lock().await;
    let bed = Bed::new().await;
    let kill = format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{}' AND pid <> pg_backend_pid()",
        bed.db.name()
    );
    let stats = stream_through(&bed, async {
        for _ in 0..3 {
            psql(&kill).await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    })
    .await;
    eprintln!("after 3 session kills: {stats:?}");
}

/// The PostgreSQL server restarts mid-stream. Every pooled connection is dead
/// afterwards; the runtime rides it out without a handler failure.
#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_restart_mid_stream_loses_nothing_and_doubles_nothing() {
    let _serial = SERIAL.lock().await;
    let bed = Bed::new().await;
    let stats = stream_through(&bed, async {
        let status = Command::new("sh")
            .args(["-c", "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main restart"])
            .status()
            .await
            .expect("run pg_ctlcluster");
        wait_for_postgres().await;
        assert!(status.success(), "pg_ctlcluster restart failed");
    })
    .await;
    eprintln!("after a PostgreSQL restart: {stats:?}");
}
