//! Run with: cargo run --release -p idemq-bench --bin streams
//!
//! A stream consumer against a queue consumer on the payments workload (issue 23),
//! side by side in one run. Every contender applies the same effect per payment
//! (`record_payment`: a ledger row and a balance upsert) with idemq's defaults
//! (group commit, `batch_size` 64), in this process:
//!
//! 1. `queue`: a quorum queue, a **dedup row per message**, the demo's lane on the
//!    account, `concurrency` 16 (the best queue configuration: `bench`'s contender 5);
//! 2. `stream`: a stream, **no dedup row** (`dedup = false`): each transaction moves
//!    the handler's offset once for its whole run of messages;
//! 3. `stream+dedup`: the same stream consumer keeping dedup rows too (what catches a
//!    publisher's retransmission on a stream);
//! 4. `4 partitions`: the `stream` handler on four partitioned streams
//!    (`idemq::Partitions`, the payments routed by account), all four owned by this one
//!    process: a stream is applied in order, one transaction at a time, so this is how
//!    a stream's work goes wider.
//!
//! Each run: the tables truncated and a CHECKPOINT taken, a fresh queue or stream
//! holding the whole backlog (`--messages` distinct payments, no duplicates: a stream
//! without dedup rows would apply a duplicate twice, by design) before the runtime
//! starts; the clock runs from the runtime's start to the last settled payment. Per
//! run: payments/s, the process's CPU per payment (user + system, this process's
//! only: PostgreSQL and RabbitMQ are apart), and **WAL bytes per payment**
//! (`pg_current_wal_lsn()` before and after: what the database wrote). Checked after
//! each run (exit 1 if one fails): ledger rows = payments, each once; every balance
//! right; dedup rows as the contender keeps them (payments, or none); a stream's offset
//! at its last message; nothing dead-lettered. Rounds alternate the contenders; the
//! summary gives medians and each stream contender's ratios to `queue`. Absolute numbers
//! move with the machine: read the ratios.
//!
//! Flags: `--messages N` (default 20000), `--rounds R` (default 3), `--accounts A`
//! (default 10), `--contenders queue,stream,stream+dedup,4 partitions` (default all). Environment: `AMQP_URL` (default the local node), `DATABASE_URL`
//! (default `postgres://postgres@127.0.0.1:5432/idemq_streams_bench`, created,
//! migrated, and dropped at the end).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemq::outbox::Outgoing;
use idemq::{idempotent_handler, Outcome, Partitions, Publisher, Queue, Runtime, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};
use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_streams_bench";

/// The queue contender: a dedup row per payment, lanes on the account.
#[idempotent_handler(key = "payment_id", name = "bench_queue", lane = "account")]
async fn queue_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// The stream contender: the offset alone.
#[idempotent_handler(key = "payment_id", name = "bench_stream", dedup = false)]
async fn stream_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// The stream contender keeping dedup rows too.
#[idempotent_handler(key = "payment_id", name = "bench_stream_dedup")]
async fn stream_dedup_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Contender {
    Queue,
    Stream,
    StreamDedup,
    Partitioned,
}

/// The partitions of the `4 partitions` contender.
const PARTITIONS: u16 = 4;

impl Contender {
    const ALL: [Contender; 4] =
        [Contender::Queue, Contender::Stream, Contender::StreamDedup, Contender::Partitioned];

    fn label(self) -> &'static str {
        match self {
            Contender::Queue => "queue",
            Contender::Stream => "stream",
            Contender::StreamDedup => "stream+dedup",
            Contender::Partitioned => "4 partitions",
        }
    }

    fn handler_name(self) -> &'static str {
        match self {
            Contender::Queue => "bench_queue",
            Contender::Stream | Contender::Partitioned => "bench_stream",
            Contender::StreamDedup => "bench_stream_dedup",
        }
    }

    /// What it consumes, declared.
    fn topology(self, name: &str) -> Topology {
        match self {
            Contender::Queue => Topology::new().queue(Queue::new(name)),
            Contender::Stream | Contender::StreamDedup => Topology::new().queue(Queue::stream(name)),
            Contender::Partitioned => Topology::new().partitions(Partitions::new(name, PARTITIONS)),
        }
    }

    /// Its queues or streams.
    fn queues(self, name: &str) -> Vec<String> {
        match self {
            Contender::Partitioned => Partitions::new(name, PARTITIONS).streams().collect(),
            _ => vec![name.to_owned()],
        }
    }

    /// The exchange and routing key `payment` is published with.
    fn route(self, name: &str, payment: &PaymentRequested) -> (String, String) {
        match self {
            Contender::Partitioned => {
                let partitions = Partitions::new(name, PARTITIONS);
                // By account: what the payments' writes share (as the queue's lane), so
                // no two streams' transactions wait on one balance row.
                (partitions.name().to_owned(), partitions.routing_key(&payment.account))
            }
            _ => (String::new(), name.to_owned()),
        }
    }

    fn dedup_rows(self, payments: usize) -> i64 {
        match self {
            Contender::Stream | Contender::Partitioned => 0,
            Contender::Queue | Contender::StreamDedup => i64::try_from(payments).unwrap_or(i64::MAX),
        }
    }
}

struct Options {
    messages: usize,
    rounds: usize,
    accounts: usize,
    contenders: Vec<Contender>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut options =
            Options { messages: 20_000, rounds: 3, accounts: 10, contenders: Contender::ALL.to_vec() };
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || -> Result<usize, String> {
                let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
                value.parse().map_err(|_| format!("{flag}: not a number: {value}"))
            };
            match flag.as_str() {
                "--messages" => options.messages = value()?.max(1),
                "--rounds" => options.rounds = value()?.max(1),
                "--accounts" => options.accounts = value()?.max(1),
                "--contenders" => {
                    let list = args.next().ok_or("--contenders needs a value")?;
                    options.contenders = list
                        .split(',')
                        .map(|label| {
                            Contender::ALL
                                .into_iter()
                                .find(|contender| contender.label() == label.trim())
                                .ok_or_else(|| format!("unknown contender {label}"))
                        })
                        .collect::<Result<_, _>>()?;
                }
                "--help" | "-h" => return Err(String::new()),
                other => return Err(format!("unknown flag {other}")),
            }
        }
        Ok(options)
    }
}

/// One run's measures.
struct Measured {
    contender: Contender,
    elapsed: Duration,
    cpu: Option<Duration>,
    wal_bytes: i64,
    failures: Vec<String>,
}

impl Measured {
    fn rate(&self, messages: usize) -> f64 {
        messages as f64 / self.elapsed.as_secs_f64()
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
    let options = match Options::parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!(
                "{message}\nusage: streams [--messages N] [--rounds R] [--accounts A] [--contenders A,B]"
            );
            return if message.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    let amqp_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let result = run(&options, &amqp_url, &database_url).await;
    if let Err(err) = drop_database(&database_url).await {
        eprintln!("streams: could not drop the bench database: {err}");
    }
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("streams: a check FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("streams: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

async fn run(options: &Options, amqp_url: &str, database_url: &str) -> Result<bool, BenchError> {
    drop_database(database_url).await?;
    idemq_example_payments::migrate(database_url).await?;
    let mut db = idemq::connect::database(database_url).await?;
    let admin = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    println!(
        "streams: {} payments per run over {} accounts, {} rounds; batch_size 64 (the default); \
         the queue: concurrency 16, lane on the account",
        options.messages, options.accounts, options.rounds
    );
    println!(
        "{:>5}  {:<13} {:>11} {:>13} {:>15}  check",
        "round", "contender", "payments/s", "CPU µs/pay", "WAL bytes/pay"
    );
    let mut results: Vec<Measured> = Vec::new();
    for round in 1..=options.rounds {
        for &contender in &options.contenders {
            let measured =
                one_run(contender, round, options, amqp_url, database_url, &mut db, &admin).await?;
            let per = |total: f64| total / options.messages as f64;
            println!(
                "{round:>5}  {:<13} {:>11.0} {:>13} {:>15.0}  {}",
                contender.label(),
                measured.rate(options.messages),
                measured.cpu.map_or("-".into(), |cpu| format!("{:.0}", per(cpu.as_secs_f64() * 1e6))),
                per(measured.wal_bytes as f64),
                if measured.failures.is_empty() {
                    "ok".into()
                } else {
                    format!("FAILED: {}", measured.failures.join("; "))
                },
            );
            results.push(measured);
        }
    }
    summary(&results, options.messages);
    let _ = admin.close(200, "done".into()).await;
    Ok(results.iter().all(|run| run.failures.is_empty()))
}

async fn one_run(
    contender: Contender,
    round: usize,
    options: &Options,
    amqp_url: &str,
    database_url: &str,
    db: &mut AsyncPgConnection,
    admin: &Connection,
) -> Result<Measured, BenchError> {
    db.batch_execute(
        "TRUNCATE ledger, accounts, idemq_dedup, idemq_started, idemq_stream_offsets; CHECKPOINT",
    )
    .await?;
    let name =
        format!("bench-streams-{}-{round}-{}", contender.label().replace('+', "-"), std::process::id());
    let channel = admin.create_channel().await?;
    contender.topology(&name).declare(&channel).await?;
    let (payments, balances) = workload(&name, options);
    let publisher = Publisher::connect(amqp_url).await?;
    let backlog = payments
        .iter()
        .map(|payment| {
            let (exchange, routing_key) = contender.route(&name, payment);
            Outgoing::json(exchange, routing_key, payment)
        })
        .collect::<Result<Vec<_>, _>>()?;
    publisher.publish_all(backlog).await?;
    publisher.close().await;

    let settled = Arc::new(AtomicU64::new(0));
    let others = Arc::new(AtomicU64::new(0));
    let builder = Runtime::builder()
        .amqp_url(amqp_url)
        .database_url(database_url)
        .topology(contender.topology(&name))
        .relay(false)
        .observe(idemq::observe::on_settled({
            let (settled, others) = (Arc::clone(&settled), Arc::clone(&others));
            move |event| {
                let counter = if event.outcome == Outcome::Applied { &settled } else { &others };
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }));
    let builder = match contender {
        Contender::Queue => builder.concurrency(16).consume(name.as_str(), queue_payment),
        Contender::Stream => builder.consume(name.as_str(), stream_payment),
        Contender::StreamDedup => builder.consume(name.as_str(), stream_dedup_payment),
        Contender::Partitioned => {
            builder.consume_partitions(&Partitions::new(name.as_str(), PARTITIONS), stream_payment)
        }
    };
    let runtime = builder.build()?;
    let wal_before = wal_lsn(db).await?;
    let cpu_before = process_cpu();
    let started = Instant::now();
    let stop = idemq::CancellationToken::new();
    let running = tokio::spawn(runtime.run(stop.clone()));
    let target = options.messages as u64;
    let deadline = started + Duration::from_secs(600);
    while AtomicU64::load(&settled, Ordering::SeqCst) + AtomicU64::load(&others, Ordering::SeqCst) < target {
        if Instant::now() > deadline || running.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    let cpu = process_cpu().zip(cpu_before).map(|(after, before)| after.saturating_sub(before));
    let wal_bytes = wal_lsn(db).await? - wal_before;
    stop.cancel();
    let ended = running.await?;

    let mut failures = Vec::new();
    if let Err(err) = ended {
        failures.push(format!("the runtime failed: {err}"));
    }
    let applied = AtomicU64::load(&settled, Ordering::SeqCst);
    if applied != target || AtomicU64::load(&others, Ordering::SeqCst) != 0 {
        failures.push(format!(
            "settled {applied} applied of {target}, {} otherwise",
            AtomicU64::load(&others, Ordering::SeqCst)
        ));
    }
    check(db, contender, &payments, &balances, &mut failures).await?;
    for queue in contender.queues(&name) {
        let dead_letter = format!("{queue}.dlq");
        let dead_letters =
            channel.queue_delete(dead_letter.as_str().into(), QueueDeleteOptions::default()).await?;
        if dead_letters != 0 {
            failures.push(format!("{dead_letters} dead-lettered from {queue}"));
        }
        channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
    }
    if contender == Contender::Partitioned {
        channel
            .exchange_delete(name.as_str().into(), lapin::options::ExchangeDeleteOptions::default())
            .await?;
    }
    let _ = channel.close(200, "run done".into()).await;
    Ok(Measured { contender, elapsed, cpu, wal_bytes, failures })
}

/// `messages` distinct payments over `accounts` accounts, and each account's balance.
fn workload(prefix: &str, options: &Options) -> (Vec<PaymentRequested>, BTreeMap<String, i64>) {
    let mut balances = BTreeMap::new();
    let payments = (0..options.messages)
        .map(|i| {
            let payment = PaymentRequested {
                payment_id: format!("{prefix}-pay-{i}"),
                account: format!("{prefix}-acct-{}", i % options.accounts),
                amount_cents: 100 + (i as i64 * 37) % 9_900,
            };
            *balances.entry(payment.account.clone()).or_insert(0) += payment.amount_cents;
            payment
        })
        .collect();
    (payments, balances)
}

async fn check(
    db: &mut AsyncPgConnection,
    contender: Contender,
    payments: &[PaymentRequested],
    balances: &BTreeMap<String, i64>,
    failures: &mut Vec<String>,
) -> Result<(), BenchError> {
    let rows = count(db, "SELECT count(*) FROM ledger".into()).await?;
    let distinct = count(db, "SELECT count(DISTINCT payment_id) FROM ledger".into()).await?;
    let expected = i64::try_from(payments.len())?;
    if (rows, distinct) != (expected, expected) {
        failures.push(format!("ledger: {rows} rows, {distinct} distinct, of {expected} payments"));
    }
    for (account, balance) in balances {
        let stored =
            count(db, format!("SELECT balance_cents FROM accounts WHERE account = '{account}'")).await?;
        if stored != *balance {
            failures.push(format!("{account}: balance {stored}, expected {balance}"));
            break;
        }
    }
    let dedup = count(db, "SELECT count(*) FROM idemq_dedup".into()).await?;
    if dedup != contender.dedup_rows(payments.len()) {
        failures.push(format!("{dedup} dedup rows, expected {}", contender.dedup_rows(payments.len())));
    }
    if contender != Contender::Queue {
        // Each stream's offset at its last message: offsets + 1 add up to the payments.
        let covered = count(
            db,
            format!(
                "SELECT sum(last_offset + 1) FROM idemq_stream_offsets WHERE handler = '{}'",
                contender.handler_name()
            ),
        )
        .await?;
        if covered != expected {
            failures.push(format!("the offsets cover {covered} messages, expected {expected}"));
        }
    }
    Ok(())
}

fn summary(results: &[Measured], messages: usize) {
    let median = |contender: Contender, measure: &dyn Fn(&Measured) -> Option<f64>| {
        let mut values: Vec<f64> = results
            .iter()
            .filter(|run| run.contender == contender && run.failures.is_empty())
            .filter_map(measure)
            .collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().filter(|_| values.len() % 2 == 1).or_else(|| {
            (!values.is_empty()).then(|| (values[values.len() / 2 - 1] + values[values.len() / 2]) / 2.0)
        })
    };
    let rate = |run: &Measured| Some(run.rate(messages));
    let cpu = |run: &Measured| run.cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / messages as f64);
    let wal = |run: &Measured| Some(run.wal_bytes as f64 / messages as f64);
    println!("\nmedians (passing runs), and each against `queue`:");
    println!(
        "{:<13} {:>11} {:>8} {:>11} {:>8} {:>14} {:>8}",
        "contender", "payments/s", "×", "CPU µs/pay", "×", "WAL bytes/pay", "×"
    );
    let base =
        (median(Contender::Queue, &rate), median(Contender::Queue, &cpu), median(Contender::Queue, &wal));
    for contender in Contender::ALL {
        let (r, c, w) = (median(contender, &rate), median(contender, &cpu), median(contender, &wal));
        let ratio = |value: Option<f64>, base: Option<f64>| {
            value.zip(base).map_or("-".into(), |(value, base)| format!("{:.2}", value / base))
        };
        let show = |value: Option<f64>| value.map_or("-".into(), |value| format!("{value:.0}"));
        println!(
            "{:<13} {:>11} {:>8} {:>11} {:>8} {:>14} {:>8}",
            contender.label(),
            show(r),
            ratio(r, base.0),
            show(c),
            ratio(c, base.1),
            show(w),
            ratio(w, base.2)
        );
    }
}

async fn count(db: &mut AsyncPgConnection, sql: String) -> Result<i64, BenchError> {
    #[derive(diesel::QueryableByName)]
    struct Value {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        value: i64,
    }
    let value: Value =
        diesel::sql_query(format!("SELECT COALESCE(({sql}), 0)::int8 AS value")).get_result(db).await?;
    Ok(value.value)
}

/// The server's WAL position, in bytes.
async fn wal_lsn(db: &mut AsyncPgConnection) -> Result<i64, BenchError> {
    count(db, "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8".into()).await
}

/// CPU time (user + system) this process has used, from `/proc/self/stat`.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(Duration::from_millis(ticks * 10))
}

async fn drop_database(url: &str) -> Result<(), BenchError> {
    let (admin, name) = url.rsplit_once('/').ok_or("DATABASE_URL has no database name")?;
    let name = name.split('?').next().unwrap_or(name);
    let mut conn = idemq::connect::database(&format!("{admin}/postgres")).await?;
    conn.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await?;
    Ok(())
}
