//! Run with: cargo run --release -p idemq-bench
//!
//! How much idemq costs against the consumer a competent engineer would write by hand
//! for the same core guarantee (dedup row and effect in one transaction, ack after
//! COMMIT), measured side by side in one invocation on the payments workload.
//!
//! ```text
//! bench [--messages N] [--duplicates-every K] [--concurrency C] [--rounds R] [--accounts A]
//!   --messages N          distinct payments per run (default 20000)
//!   --duplicates-every K  every K-th payment is published twice, back to back (default 10; 0: none)
//!   --concurrency C       prefetch, in-flight deliveries and pool size, both contenders (default 16)
//!   --rounds R            runs per contender, alternating baseline, idemq, baseline, ... (default 3)
//!   --accounts A          accounts the payments spread over (default 10, as in the demo)
//! ```
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/idemq_bench`, created if
//! missing; its `ledger`, `accounts` and `idemq_dedup` tables are truncated between runs).
//!
//! **Workload**, per run: `PaymentRequested` JSON bodies, persistent, published with
//! pipelined confirms to a fresh quorum queue declared with idemq's [`Topology`] (the
//! same kind of queue for both contenders), all before the consumer starts. The clock
//! runs from the consumer's start (its AMQP connect and first database connection
//! included) until every delivery is settled: each one acked, the queue drained. The
//! queue, its `.dlq` and (after idemq) the retry policy's wait queues are deleted
//! afterwards; their leftover message counts are part of the check. `1st (ms)` is the
//! time to the first settled delivery: start-up (connect, declarations, first
//! database connection), a fixed cost inside the measured time. `cpu us/msg` is this
//! process's CPU time (user + system, from `/proc/self/stat`) over the measured time
//! per delivery: on a small machine shared with the broker and the database, the
//! consumer's own CPU is taken from theirs.
//!
//! **Contenders**:
//! - *baseline*, a hand-written lapin loop: one channel with `basic_qos(C)`, a task per
//!   delivery bounded by a `Semaphore(C)`, a deadpool diesel-async pool of `C`
//!   connections with `RecyclingMethod::Fast`. Per delivery: `serde_json` decode, BEGIN,
//!   `INSERT INTO idemq_dedup … ON CONFLICT DO NOTHING RETURNING key`, if new
//!   `apply_payment::call` (ledger row + balance upsert), COMMIT, ack; a duplicate
//!   commits the empty transaction. On an error it nacks with requeue. What it skips is
//!   what idemq adds: dead-lettering of bad input, conflict detection (a duplicate's
//!   stored fingerprint is read and compared), delayed retries and poison detection,
//!   in-process retry of database faults, handler timeouts, reconnects, graceful
//!   shutdown.
//! - *idemq*: [`Runtime`] consuming the queue with `apply_payment`, concurrency `C`,
//!   the default [`RetryPolicy`] (whose wait queues it declares at start-up).
//!
//! Shutting a contender down happens after the clock stops; one that has not returned
//! [`SHUTDOWN_TIMEOUT`] after its last delivery is aborted and its run flagged.
//!
//! **Report**: msg/s per run (deliveries settled / seconds), the median per contender
//! and the ratio idemq/baseline of the medians, plus a correctness check per run
//! (ledger rows and dedup rows equal the distinct payments, balances equal the
//! published sums, each contender's own counts of applied and duplicate deliveries
//! agree, nothing left in any of the run's queues). The machine
//! the numbers come from is shared and noisy: compare the two contenders within one
//! invocation, never absolute numbers across invocations.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use idemq::{Handler, Queue, RetryPolicy, Runtime, StatsSnapshot, Topology};
use idemq_example_payments::{apply_payment, migrate, PaymentRequested};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_bench";
const USAGE: &str =
    "usage: bench [--messages N] [--duplicates-every K] [--concurrency C] [--rounds R] [--accounts A]";
/// A run that has not settled every delivery by then is a failure, not a slow result.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a contender may take to shut down once everything is settled (outside
/// the measured time); past it the run is flagged and the consumer aborted.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often both contenders' settled counters are polled (the clock's resolution).
const POLL: Duration = Duration::from_millis(2);

diesel::table! {
    /// idemq's dedup table (created by `idemq::migrate`), written directly by the baseline.
    idemq_dedup (handler, key) {
        /// The handler name that scopes the key.
        handler -> Text,
        /// The dedup key.
        key -> Text,
        /// SHA-256 of the message body.
        fingerprint -> Nullable<Binary>,
    }
}

/// The command line.
#[derive(Debug, Clone, Copy)]
struct Config {
    messages: usize,
    duplicates_every: usize,
    concurrency: usize,
    rounds: usize,
    accounts: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self { messages: 20_000, duplicates_every: 10, concurrency: 16, rounds: 3, accounts: 10 }
    }
}

impl Config {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut config = Self::default();
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let n: usize = value.parse().map_err(|_| format!("{flag} takes a number, not '{value}'"))?;
            match flag.as_str() {
                "--messages" if n > 0 => config.messages = n,
                "--duplicates-every" => config.duplicates_every = n,
                "--concurrency" if n > 0 && n <= usize::from(u16::MAX) => config.concurrency = n,
                "--rounds" if n > 0 => config.rounds = n,
                "--accounts" if n > 0 => config.accounts = n,
                _ => return Err(format!("unknown flag or bad value: {flag} {value}")),
            }
        }
        Ok(config)
    }
}

/// Which consumer a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Baseline,
    Idemq,
}

impl Contender {
    fn short(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Idemq => "idemq",
        }
    }

    fn long(self) -> &'static str {
        match self {
            Self::Baseline => "baseline (hand-written lapin loop)",
            Self::Idemq => "idemq (Runtime + apply_payment)",
        }
    }
}

/// One run's messages and what they must add up to.
struct Workload {
    /// Every payment id and account of the run starts with this.
    prefix: String,
    bodies: Vec<Vec<u8>>,
    distinct: u64,
    duplicates: u64,
    total_cents: i64,
}

impl Workload {
    fn new(run_id: &str, config: &Config) -> Result<Self, BenchError> {
        let prefix = format!("bench-{run_id}-");
        let mut bodies =
            Vec::with_capacity(config.messages + config.messages / config.duplicates_every.max(1));
        let (mut duplicates, mut total_cents) = (0, 0);
        for i in 0..config.messages {
            let amount_cents = 100 + (i as i64 * 37) % 9_900;
            let payment = PaymentRequested {
                payment_id: format!("{prefix}pay-{i}"),
                account: format!("{prefix}acct-{}", i % config.accounts),
                amount_cents,
            };
            total_cents += amount_cents;
            let body = serde_json::to_vec(&payment)?;
            if config.duplicates_every > 0 && i % config.duplicates_every == 0 {
                bodies.push(body.clone());
                duplicates += 1;
            }
            bodies.push(body);
        }
        Ok(Self { prefix, bodies, distinct: config.messages as u64, duplicates, total_cents })
    }

    fn deliveries(&self) -> u64 {
        self.bodies.len() as u64
    }
}

/// What a contender reported about its run.
#[derive(Debug, Default)]
struct Consumed {
    /// From the consumer's start to the first settled delivery (connect, declare, ...).
    first: Duration,
    elapsed: Duration,
    /// CPU time this process used over `elapsed` (Linux only).
    cpu: Option<Duration>,
    applied: u64,
    duplicates: u64,
    /// Deliveries that ended otherwise (requeued after an error, dead-lettered, ...).
    other: u64,
    /// Set when the consumer did not shut down within [`SHUTDOWN_TIMEOUT`] (after the
    /// measured time) and was aborted.
    shutdown_hung: bool,
}

/// One measured run.
struct RunResult {
    contender: Contender,
    deliveries: u64,
    consumed: Consumed,
    issues: Vec<String>,
}

impl RunResult {
    fn rate(&self) -> f64 {
        self.deliveries as f64 / self.consumed.elapsed.as_secs_f64().max(1e-9)
    }

    /// This process's CPU time per delivery, in microseconds.
    fn cpu_per_delivery(&self) -> Option<f64> {
        self.consumed.cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / self.deliveries.max(1) as f64)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = match Config::parse(&args) {
        Ok(config) => config,
        Err(err) => {
            if err.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("{err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| idemq::DEFAULT_AMQP_URL.into());
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    match bench(&config, &amqp_url, &database_url).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench: a correctness check failed (see the table)");
            ExitCode::FAILURE
        }
        Err(err) => {
            // Driver errors may quote a URL, password and all.
            eprintln!("bench: {}", idemq::redact(&err.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// All rounds, then the summary. `Ok(false)` when a correctness check failed.
async fn bench(config: &Config, amqp_url: &str, database_url: &str) -> Result<bool, BenchError> {
    migrate(database_url).await?;
    let mut db = AsyncPgConnection::establish(database_url).await?;
    let admin = Connection::connect(amqp_url, ConnectionProperties::default()).await?;

    let per_run = Workload::new("x", config)?.deliveries();
    println!(
        "idemq bench: {} payments over {} accounts, {} published twice = {per_run} deliveries/run",
        config.messages,
        config.accounts,
        match config.duplicates_every {
            0 => "no payment".to_owned(),
            1 => "every payment".to_owned(),
            k => format!("every {k}th"),
        },
    );
    println!(
        "concurrency {} (prefetch = in-flight = pool size), quorum queue, {} rounds alternating baseline/idemq",
        config.concurrency, config.rounds
    );
    println!(
        "{:>3}  {:<9} {:>10} {:>8} {:>9} {:>8} {:>12} {:>8} {:>6}  check",
        "run", "contender", "deliveries", "seconds", "1st (ms)", "msg/s", "cpu us/msg", "applied", "dups"
    );

    let mut results = Vec::with_capacity(config.rounds * 2);
    for round in 1..=config.rounds {
        for contender in [Contender::Baseline, Contender::Idemq] {
            reset(&mut db).await?;
            let result = run_once(contender, config, amqp_url, database_url, &admin, &mut db).await?;
            let check = if result.issues.is_empty() { "ok".to_owned() } else { result.issues.join("; ") };
            println!(
                "{round:>3}  {:<9} {:>10} {:>8.2} {:>9.0} {:>8.0} {:>12} {:>8} {:>6}  {check}",
                contender.short(),
                result.deliveries,
                result.consumed.elapsed.as_secs_f64(),
                result.consumed.first.as_secs_f64() * 1000.0,
                result.rate(),
                result.cpu_per_delivery().map_or_else(|| "-".to_owned(), |us| format!("{us:.0}")),
                result.consumed.applied,
                result.consumed.duplicates,
            );
            results.push(result);
        }
    }
    let _ = admin.close(200, "bench done".into()).await;

    println!();
    let mut medians = Vec::new();
    for contender in [Contender::Baseline, Contender::Idemq] {
        let rates: Vec<f64> =
            results.iter().filter(|r| r.contender == contender).map(RunResult::rate).collect();
        let rate = median(&rates);
        let runs = rates.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ");
        let cpu: Vec<f64> = results
            .iter()
            .filter(|r| r.contender == contender)
            .filter_map(RunResult::cpu_per_delivery)
            .collect();
        let cpu = if cpu.is_empty() { String::new() } else { format!("  (cpu {:.0} us/msg)", median(&cpu)) };
        println!("{:<35} median {rate:>6.0} msg/s  runs [{runs}]{cpu}", contender.long());
        medians.push(rate);
    }
    println!("ratio idemq/baseline: {:.2}", medians[1] / medians[0]);
    let all_ok = results.iter().all(|r| r.issues.is_empty());
    println!("correctness: {}", if all_ok { "every run ok" } else { "FAILED (see the check column)" });
    Ok(all_ok)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Empties the tables and flushes dirty pages, so no run inherits another's work.
async fn reset(db: &mut AsyncPgConnection) -> Result<(), BenchError> {
    db.batch_execute("TRUNCATE ledger, accounts, idemq_dedup; CHECKPOINT;").await?;
    Ok(())
}

/// Declares a fresh queue, publishes the workload, runs `contender` on it, checks the
/// outcome and deletes the queue and its dead-letter queue (also on failure).
async fn run_once(
    contender: Contender,
    config: &Config,
    amqp_url: &str,
    database_url: &str,
    admin: &Connection,
    db: &mut AsyncPgConnection,
) -> Result<RunResult, BenchError> {
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let queue = Queue::new(format!("idemq-bench-{run_id}"));
    let (name, dead_letter) = (queue.name().to_owned(), queue.dead_letter_name().to_owned());
    let topology = Topology::new().queue(queue);
    let workload = Workload::new(&run_id, config)?;

    let measured = async {
        let channel = admin.create_channel().await?;
        topology.declare(&channel).await?;
        publish(&channel, &name, &workload.bodies).await?;
        let _ = channel.close(200, "published".into()).await;
        let expected = workload.deliveries();
        match contender {
            Contender::Baseline => {
                run_baseline(amqp_url, database_url, &name, config.concurrency, expected).await
            }
            Contender::Idemq => {
                run_idemq(amqp_url, database_url, topology.clone(), &name, config.concurrency, expected).await
            }
        }
    }
    .await;

    // Clean up whatever happened; what was left behind is part of the check.
    let cleanup = admin.create_channel().await?;
    let left = cleanup.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await;
    let left_dlq = cleanup.queue_delete(dead_letter.as_str().into(), QueueDeleteOptions::default()).await;
    let mut left_waiting = Ok(0);
    if contender == Contender::Idemq {
        // The runtime declares its retry policy's wait queues at start-up.
        for (wait_queue, _) in RetryPolicy::default().wait_queues(&name) {
            let left = cleanup.queue_delete(wait_queue.as_str().into(), QueueDeleteOptions::default()).await;
            left_waiting = left_waiting.and_then(|n| left.map(|m| n + m));
        }
    }
    let _ = cleanup.close(200, "deleted".into()).await;
    let consumed = measured?;

    let mut issues = check_ledger(db, &workload).await?;
    match left? {
        0 => {}
        n => issues.push(format!("{n} messages left in the queue")),
    }
    match left_dlq? {
        0 => {}
        n => issues.push(format!("{n} messages dead-lettered")),
    }
    match left_waiting? {
        0 => {}
        n => issues.push(format!("{n} messages left in retry wait queues")),
    }
    if consumed.applied != workload.distinct || consumed.duplicates != workload.duplicates {
        issues.push(format!(
            "counted {} applied / {} duplicates, expected {} / {}",
            consumed.applied, consumed.duplicates, workload.distinct, workload.duplicates
        ));
    }
    if consumed.other > 0 {
        issues.push(format!("{} deliveries requeued or dead-lettered", consumed.other));
    }
    if consumed.shutdown_hung {
        issues.push(format!("shutdown hung for {SHUTDOWN_TIMEOUT:?} after the last delivery; aborted"));
    }
    Ok(RunResult { contender, deliveries: workload.deliveries(), consumed, issues })
}

/// Publishes every body (persistent, JSON) with pipelined confirms: all frames first,
/// then every confirmation.
async fn publish(channel: &Channel, queue: &str, bodies: &[Vec<u8>]) -> Result<(), BenchError> {
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let props = BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
    let options = BasicPublishOptions { mandatory: true, ..Default::default() };
    let mut confirms = Vec::with_capacity(bodies.len());
    for body in bodies {
        confirms.push(channel.basic_publish("".into(), queue.into(), options, body, props.clone()).await?);
    }
    for confirm in confirms {
        match confirm.await? {
            Confirmation::Ack(None) => {}
            other => return Err(format!("publish not confirmed: {other:?}").into()),
        }
    }
    Ok(())
}

/// Polls `settled` until it reaches `expected`, `finished` says the consumer ended, or
/// the run times out. Returns the times since `started` of the first settled delivery
/// and of the end.
async fn wait_settled(
    started: Instant,
    expected: u64,
    settled: impl Fn() -> u64,
    finished: impl Fn() -> bool,
) -> (Duration, Duration) {
    let mut first = None;
    loop {
        let now = settled();
        if now > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        if now >= expected || finished() || started.elapsed() >= RUN_TIMEOUT {
            let elapsed = started.elapsed();
            return (first.unwrap_or(elapsed), elapsed);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The baseline's counters.
#[derive(Debug, Default)]
struct BaselineCounts {
    applied: AtomicU64,
    duplicates: AtomicU64,
    requeued: AtomicU64,
}

impl BaselineCounts {
    fn acked(&self) -> u64 {
        get(&self.applied) + get(&self.duplicates)
    }
}

/// Reads a counter. (Written out because diesel's `RunQueryDsl::load` would shadow
/// `AtomicU64::load` in method syntax.)
fn get(counter: &AtomicU64) -> u64 {
    AtomicU64::load(counter, Ordering::Relaxed)
}

/// Contender A: the plain lapin + diesel-async consumer.
async fn run_baseline(
    amqp_url: &str,
    database_url: &str,
    queue: &str,
    concurrency: usize,
    expected: u64,
) -> Result<Consumed, BenchError> {
    let counts = Arc::new(BaselineCounts::default());
    let (started, cpu_at_start) = (Instant::now(), process_cpu());

    let connection = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
    channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut config = ManagerConfig::default();
    config.recycling_method = RecyclingMethod::Fast;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config);
    let pool = Pool::builder(manager).max_size(concurrency).runtime(deadpool::Runtime::Tokio1).build()?;
    drop(pool.get().await?);
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "idemq-bench-baseline".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let permits = Arc::new(Semaphore::new(concurrency));
    let tracker = TaskTracker::new();
    let stop = CancellationToken::new();
    let intake = tokio::spawn({
        let (counts, tracker, stop) = (Arc::clone(&counts), tracker.clone(), stop.clone());
        async move {
            loop {
                let delivery = tokio::select! {
                    () = stop.cancelled() => break,
                    next = deliveries.next() => match next {
                        Some(delivery) => delivery?,
                        None => break,
                    },
                };
                let permit = Arc::clone(&permits).acquire_owned().await?;
                let (pool, counts) = (pool.clone(), Arc::clone(&counts));
                tracker.spawn(async move {
                    handle_delivery(&pool, delivery, &counts).await;
                    drop(permit);
                });
            }
            Ok::<(), BenchError>(())
        }
    });

    let (first, elapsed) = wait_settled(started, expected, || counts.acked(), || intake.is_finished()).await;
    let cpu = cpu_since(cpu_at_start);
    stop.cancel();
    let shutdown = async {
        let intake_result = intake.await;
        tracker.close();
        tracker.wait().await;
        let _ = connection.close(200, "done".into()).await;
        intake_result
    };
    let shutdown_hung = match tokio::time::timeout(SHUTDOWN_TIMEOUT, shutdown).await {
        Ok(intake_result) => {
            intake_result??;
            false
        }
        Err(_elapsed) => true,
    };
    if counts.acked() < expected {
        return Err(format!("baseline: only {} of {expected} deliveries acked", counts.acked()).into());
    }
    Ok(Consumed {
        first,
        elapsed,
        cpu,
        applied: get(&counts.applied),
        duplicates: get(&counts.duplicates),
        other: get(&counts.requeued),
        shutdown_hung,
    })
}

/// One delivery: the transaction, then the ack; on any error, back to the queue.
async fn handle_delivery(pool: &Pool<AsyncPgConnection>, delivery: Delivery, counts: &BaselineCounts) {
    match apply_once(pool, &delivery.data).await {
        Ok(applied) => match delivery.ack(BasicAckOptions::default()).await {
            Ok(_) => {
                let counter = if applied { &counts.applied } else { &counts.duplicates };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => eprintln!("baseline: ack failed: {}", idemq::redact(&err.to_string())),
        },
        Err(err) => {
            eprintln!("baseline: {}; requeueing", idemq::redact(&err.to_string()));
            counts.requeued.fetch_add(1, Ordering::Relaxed);
            let _ = delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
        }
    }
}

/// Decode, then BEGIN; dedup row; effect if new; COMMIT. `Ok(false)`: a duplicate.
async fn apply_once(pool: &Pool<AsyncPgConnection>, body: &[u8]) -> Result<bool, BenchError> {
    let message: PaymentRequested = serde_json::from_slice(body)?;
    let fingerprint = Sha256::digest(body).to_vec();
    let mut conn = pool.get().await?;
    let conn: &mut AsyncPgConnection = &mut conn;
    let applied = conn
        .transaction(async move |conn: &mut AsyncPgConnection| {
            let new = diesel::insert_into(idemq_dedup::table)
                .values((
                    idemq_dedup::handler.eq(apply_payment.name()),
                    idemq_dedup::key.eq(&message.payment_id),
                    idemq_dedup::fingerprint.eq(&fingerprint),
                ))
                .on_conflict_do_nothing()
                .returning(idemq_dedup::key)
                .get_result::<String>(conn)
                .await
                .optional()?
                .is_some();
            if new {
                apply_payment::call(conn, message).await?;
            }
            Ok::<bool, diesel::result::Error>(new)
        })
        .await?;
    Ok(applied)
}

/// Contender B: idemq's runtime with the demo's handler.
async fn run_idemq(
    amqp_url: &str,
    database_url: &str,
    topology: Topology,
    queue: &str,
    concurrency: usize,
    expected: u64,
) -> Result<Consumed, BenchError> {
    let runtime = Runtime::builder()
        .amqp_url(amqp_url)
        .database_url(database_url)
        .topology(topology)
        .consume(queue, apply_payment)
        .retry(RetryPolicy::default())
        .concurrency(concurrency)
        .build()?;
    let stats = runtime.stats();
    let settled = |s: StatsSnapshot| s.applied + s.duplicates + s.dead_lettered;
    let shutdown = CancellationToken::new();

    let (started, cpu_at_start) = (Instant::now(), process_cpu());
    let mut consumer = tokio::spawn(runtime.run(shutdown.clone()));
    let (first, elapsed) =
        wait_settled(started, expected, || settled(stats.snapshot()), || consumer.is_finished()).await;
    let cpu = cpu_since(cpu_at_start);
    shutdown.cancel();
    let shutdown_hung = match tokio::time::timeout(SHUTDOWN_TIMEOUT, &mut consumer).await {
        Ok(joined) => {
            joined??;
            false
        }
        Err(_elapsed) => {
            consumer.abort();
            true
        }
    };
    let s = stats.snapshot();
    if settled(s) < expected {
        return Err(format!("idemq: only {} of {expected} deliveries settled", settled(s)).into());
    }
    Ok(Consumed {
        first,
        elapsed,
        cpu,
        applied: s.applied,
        duplicates: s.duplicates,
        other: s.dead_lettered + s.retried + s.requeued + s.abandoned + s.infrastructure_retries,
        shutdown_hung,
    })
}

/// Counts in the database after a run.
#[derive(QueryableByName)]
struct LedgerCounts {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    ledger_rows: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    dedup_rows: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    balance_cents: i64,
}

/// Ledger rows and dedup rows equal the distinct payments; balances equal their sum.
async fn check_ledger(db: &mut AsyncPgConnection, workload: &Workload) -> Result<Vec<String>, BenchError> {
    let pattern = format!("{}%", workload.prefix);
    let counts: LedgerCounts = diesel::sql_query(
        "SELECT (SELECT count(*) FROM ledger WHERE payment_id LIKE $1) AS ledger_rows, \
                (SELECT count(*) FROM idemq_dedup WHERE key LIKE $1) AS dedup_rows, \
                (SELECT coalesce(sum(balance_cents), 0)::int8 FROM accounts WHERE account LIKE $1) AS balance_cents",
    )
    .bind::<diesel::sql_types::Text, _>(&pattern)
    .get_result(db)
    .await?;
    let distinct = workload.distinct as i64;
    let mut issues = Vec::new();
    if counts.ledger_rows != distinct {
        issues.push(format!("ledger has {} rows, expected {distinct}", counts.ledger_rows));
    }
    if counts.dedup_rows != distinct {
        issues.push(format!("idemq_dedup has {} rows, expected {distinct}", counts.dedup_rows));
    }
    if counts.balance_cents != workload.total_cents {
        issues.push(format!("balances sum to {}, expected {}", counts.balance_cents, workload.total_cents));
    }
    Ok(issues)
}

/// CPU time (user + system) this process has used so far, from `/proc/self/stat`;
/// `None` where that file does not exist. Resolution: one clock tick (10 ms).
fn process_cpu() -> Option<Duration> {
    /// `sysconf(_SC_CLK_TCK)`, 100 on every mainstream Linux.
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the parenthesised command name: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / TICKS_PER_SECOND))
}

fn cpu_since(start: Option<Duration>) -> Option<Duration> {
    Some(process_cpu()?.saturating_sub(start?))
}
