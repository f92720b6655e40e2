//! A consumer process for fault tests: the payments handler under an idemq runtime,
//! with knobs to crash or slow it. Tests run it as a child and kill it.
//!
//! Environment: `AMQP_URL`, `DATABASE_URL`, `QUEUE` (required), `CONCURRENCY`
//! (default 8), `DELIVERY_LIMIT` (default 20), `SLOW_MS` (the handler sleeps this long
//! inside its transaction), `KILL_ON` (SIGKILL this process when a payment id starts
//! with it, inside the transaction), `RETRY_MS` (comma-separated retry delays),
//! `SHUTDOWN_MS` (the shutdown deadline), `BATCH_SIZE` (empty or absent: the default).
//!
//! A two-stage pipeline: with `NEXT_QUEUE`, each applied payment also publishes a
//! `PaymentApplied` event to that queue through the outbox (stage A); with
//! `STAGE=b`, the process consumes those events instead and records each in the
//! table `notified (payment_id, message_id)`, which the test creates (stage B).
//! With `STREAM=1`, `QUEUE` is a stream, consumed by a handler keeping no dedup rows
//! (the offset alone keeps it exact), with the same `KILL_ON` and `SLOW_MS` knobs.
//! With `PARTITIONS=N` (and `STREAM=1`), `QUEUE` names N partitioned streams
//! (`idemq::Partitions`), all consumed by that handler, which also records in the
//! table `handled_by (payment_id, pid)` (the test creates it) which process applied
//! each payment.
//!
//! Exits 0 after SIGTERM/SIGINT, 1 on a runtime error.

use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use diesel_async::RunQueryDsl;
use idemq::{idempotent_handler, Context, HandlerError, Partitions, Queue, RetryPolicy, Runtime, Topology};
use idemq_example_payments::{record_payment, PaymentApplied, PaymentRequested};

struct Knobs {
    slow: Duration,
    kill_on: Option<String>,
    next_queue: String,
}

fn knobs() -> &'static Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    KNOBS.get_or_init(|| Knobs {
        slow: Duration::from_millis(env_number("SLOW_MS", 0)),
        kill_on: std::env::var("KILL_ON").ok().filter(|s| !s.is_empty()),
        next_queue: std::env::var("NEXT_QUEUE").unwrap_or_default(),
    })
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The payments handler, with the knobs; same name, so its dedup rows are shared.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn payments(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), diesel::result::Error> {
    payments_effect(conn, &msg).await
}

/// The payments handler of a stream: no dedup rows, the same knobs.
#[idempotent_handler(key = "payment_id", name = "stream_payments", dedup = false)]
async fn stream_payments(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    payments_effect(conn, &msg).await
}

/// The partitioned streams' handler: the stream handler's effect, and which
/// process applied the payment, in the same transaction.
#[idempotent_handler(key = "payment_id", name = "partitioned_payments", dedup = false)]
async fn partitioned_payments(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    diesel::sql_query("INSERT INTO handled_by (payment_id, pid) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Text, _>(&msg.payment_id)
        .bind::<diesel::sql_types::BigInt, _>(i64::from(std::process::id()))
        .execute(conn)
        .await?;
    payments_effect(conn, &msg).await
}

/// The payment, and the knobs: killed mid-transaction after the effect was written
/// (nothing is recorded), or slowed inside it.
async fn payments_effect(
    conn: &mut AsyncPgConnection,
    msg: &PaymentRequested,
) -> Result<(), diesel::result::Error> {
    let kill = knobs().kill_on.as_deref().is_some_and(|prefix| msg.payment_id.starts_with(prefix));
    record_payment(conn, msg).await?;
    if kill {
        let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(knobs().slow).await;
    Ok(())
}

/// Stage A of the pipeline: the payment, then its event through the outbox.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn payments_then_notify(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let event = PaymentApplied::from(msg);
    ctx.publish("", &knobs().next_queue, &event)?;
    tokio::time::sleep(knobs().slow).await;
    Ok(())
}

/// Stage B: one `notified` row per event applied (no unique constraint: the
/// witness that idemq prevents doubles), with the message id it came with.
#[idempotent_handler(key = "payment_id", name = "stage_b")]
async fn notify(
    conn: &mut AsyncPgConnection,
    event: PaymentApplied,
    ctx: &Context,
) -> Result<(), HandlerError> {
    diesel::sql_query("INSERT INTO notified (payment_id, message_id) VALUES ($1, $2)")
        .bind::<diesel::sql_types::Text, _>(&event.payment_id)
        .bind::<diesel::sql_types::Text, _>(ctx.message_id().unwrap_or_default())
        .execute(conn)
        .await?;
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
    let stream = std::env::var("STREAM").is_ok_and(|v| v == "1");
    let declared = if stream { Queue::stream(queue.clone()) } else { Queue::new(queue.clone()) };
    let partitions = u16::try_from(env_number("PARTITIONS", 0)).ok().filter(|n| *n > 0);
    let partitions = partitions.map(|count| Partitions::new(queue.clone(), count));
    let mut topology = match &partitions {
        Some(partitions) => Topology::new().partitions(partitions.clone()),
        None => Topology::new().queue(declared.delivery_limit(limit)),
    };
    let next = &knobs().next_queue;
    if !next.is_empty() {
        topology = topology.queue(Queue::new(next.clone()).delivery_limit(limit));
    }
    let builder = Runtime::builder().topology(topology);
    let builder = match (&partitions, std::env::var("STAGE").as_deref(), next.is_empty()) {
        (Some(partitions), _, _) => builder.consume_partitions(partitions, partitioned_payments),
        _ if stream => builder.consume(queue, stream_payments),
        (_, Ok("b"), _) => builder.consume(queue, notify),
        (_, _, false) => builder.consume(queue, payments_then_notify),
        (_, _, true) => builder.consume(queue, payments),
    };
    let mut builder = builder.concurrency(usize::try_from(env_number("CONCURRENCY", 8)).unwrap_or(8));
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
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("consumer: {err}");
            return ExitCode::FAILURE;
        }
    };
    // The first signal drains; a second exits at once with 130, as `idemq::cli`
    // does (safe: the broker redelivers whatever was unacked). The exit is this
    // binary's: the library's signal helpers never end the process.
    let signals = idemq::shutdown_signals();
    let result = tokio::select! {
        result = runtime.run(signals.graceful.clone()) => result,
        () = signals.immediate.cancelled() => return ExitCode::from(130),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("consumer: {err}");
            ExitCode::FAILURE
        }
    }
}
