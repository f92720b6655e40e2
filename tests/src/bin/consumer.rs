//! A consumer process for fault tests: the payments handler under an idemq runtime,
//! with knobs to crash or slow it. Tests run it as a child and kill it.
//!
//! Environment: `AMQP_URL`, `DATABASE_URL`, `QUEUE` (required), `CONCURRENCY`
//! (default 8), `DELIVERY_LIMIT` (default 20), `SLOW_MS` (the handler sleeps this long
//! inside its transaction), `KILL_ON` (SIGKILL this process when a payment id starts
//! with it, inside the transaction), `RETRY_MS` (comma-separated retry delays),
//! `SHUTDOWN_MS` (the shutdown deadline), `BATCH_SIZE` (empty or absent: the default).
//! Exits 0 after SIGTERM/SIGINT, 1 on a runtime error.

use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, Queue, RetryPolicy, Runtime, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};

struct Knobs {
    slow: Duration,
    kill_on: Option<String>,
}

fn knobs() -> &'static Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    KNOBS.get_or_init(|| Knobs {
        slow: Duration::from_millis(env_number("SLOW_MS", 0)),
        kill_on: std::env::var("KILL_ON").ok().filter(|s| !s.is_empty()),
    })
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The payments handler, with the knobs; same name, so its dedup rows are shared.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn payments(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), diesel::result::Error> {
    let kill = knobs().kill_on.as_deref().is_some_and(|prefix| msg.payment_id.starts_with(prefix));
    record_payment(conn, &msg).await?;
    if kill {
        // Killed mid-transaction, after the effect was written: nothing is recorded.
        let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(knobs().slow).await;
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let Ok(queue) = std::env::var("QUEUE") else {
        eprintln!("consumer: set QUEUE");
        return ExitCode::from(2);
    };
    let limit = u32::try_from(env_number("DELIVERY_LIMIT", 20)).unwrap_or(20);
    let mut builder = Runtime::builder()
        .topology(Topology::new().queue(Queue::new(queue.clone()).delivery_limit(limit)))
        .consume(queue, payments)
        .concurrency(usize::try_from(env_number("CONCURRENCY", 8)).unwrap_or(8));
    // The test's mode (empty: the runtime's default, group commit).
    if let Some(size) = std::env::var("BATCH_SIZE").ok().and_then(|v| v.parse().ok()) {
        builder = builder.batch_size(size);
    }
    if let Ok(ms) = std::env::var("SHUTDOWN_MS") {
        builder = builder.shutdown_deadline(Duration::from_millis(ms.parse().unwrap_or(10_000)));
    }
    if let Ok(delays) = std::env::var("RETRY_MS") {
        let delays = delays.split(',').filter_map(|d| d.trim().parse().ok()).map(Duration::from_millis);
        builder = builder.retry(RetryPolicy::new(delays));
    }
    let result = match builder.build() {
        Ok(runtime) => runtime.run(idemq::shutdown_signal()).await,
        Err(err) => Err(err),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("consumer: {err}");
            ExitCode::FAILURE
        }
    }
}
