//! Run with: cargo run --release -p idemq-bench --bin streams
//!
//! A stream consumer against a queue consumer on the payments workload (issue 23), and
//! against a stream consumer written by hand (issue 39), side by side in one run, in
//! this process. The idemq contenders run with idemq's defaults (group commit,
//! `batch_size` 256, a stream's prefetch twice that; `--batch-size` changes the batch
//! size of all five):
//!
//! 1. `queue`: a quorum queue, a **dedup row per message**, the demo's lane on the
//!    account, `concurrency` 16 (the best queue configuration: `bench`'s contender 5);
//! 2. `stream`: a stream, **no dedup row** (`dedup = false`): each transaction moves
//!    the handler's offset once for its whole run of messages;
//! 3. `stream batch`: the `stream` consumer with a **batch handler** (`dedup = false`,
//!    `&mut Batch<PaymentRequested>`): one handler call per transaction;
//! 4. `stream+dedup`: the `stream` consumer keeping dedup rows too (what catches a
//!    publisher's retransmission on a stream);
//! 5. `4 partitions`: the `stream` handler on four partitioned streams
//!    (`idemq::Partitions`, the payments routed by account), all four owned by this one
//!    process: a stream is applied in order, one transaction at a time, so this is how
//!    a stream's work goes wider;
//! 6. `raw stream`: **no idemq runtime**, lapin and diesel-async by hand: what an
//!    expert writes for `stream`'s guarantee (the effect and the offset in one
//!    transaction, so a crash re-applies nothing). A stream declared as `stream`'s
//!    (`Queue::stream`); one channel with prefetch 2,000 and manual acks (a stream
//!    over AMQP needs both: acks only grant credit, they remove nothing); the consumer
//!    argument `x-stream-offset` = its stored offset + 1 (`first` when none), and any
//!    delivery at or below the stored offset skipped (a stream starts a consumer at
//!    the chunk holding the offset). A reader task takes every delivery ready (up to
//!    500) and decodes them (`serde_json`) while a writer task, on one connection,
//!    runs the batch before: BEGIN, `record_payments`, an upsert of the batch's last
//!    `x-stream-offset` into its own table `bench_raw_stream_offset (stream,
//!    "offset")`, COMMIT, then one `multiple` ack. What it leaves out is what idemq
//!    adds: retries, dead letters and poison detection (a bad message or a failed
//!    transaction ends its run), fencing and the ownership lock, reconnects.
//!
//! The effect is the demo's: `record_payment` (a ledger row and a balance upsert) per
//! payment for 1, 2, 4 and 5; the batch form `record_payments` (one multi-row ledger
//! insert and one upsert of per-account totals per transaction) for 3 and 6, so
//! `stream batch` against `raw stream` is like against like but for the batch: idemq's
//! default 256 per transaction against the hand-written 500 (`--batch-size 500` gives
//! idemq the same), and idemq takes and decodes the next batch only after the last
//! one's ack, where the hand-written one overlaps them.
//!
//! Each run: the tables truncated and a CHECKPOINT taken, a fresh queue or stream
//! holding the whole backlog (`--messages` distinct payments, no duplicates: a stream
//! without dedup rows would apply a duplicate twice, by design; published in chunks
//! of 10,000 with their confirms, two chunks at a time, never held whole in memory)
//! before the consumer starts; the clock runs from its start to the last settled
//! payment. Per run: payments/s, the process's CPU per payment (user + system, this
//! process's only: PostgreSQL and RabbitMQ are apart), and **WAL bytes per payment**
//! (`pg_current_wal_lsn()` before and after: what the database wrote). Checked after
//! each run (exit 1 if one fails): ledger rows = payments, each once; every balance
//! right; dedup rows as the contender keeps them (payments, or none); a stream's
//! offset (idemq's, or `raw stream`'s own) at its last message; nothing
//! dead-lettered. Rounds alternate the contenders; the summary gives medians and each
//! contender's ratios to `queue` and, when it ran, to `raw stream`. Absolute numbers
//! move with the machine: read the ratios.
//!
//! Flags: `--messages N` (default 20000; 1000000 works), `--rounds R` (default 3),
//! `--accounts A` (default 10), `--batch-size B` (the idemq contenders' `batch_size`,
//! default idemq's 64; `raw stream` keeps its 500), `--contenders` (a comma-separated
//! list of `queue`, `stream`, `stream batch`, `stream+dedup`, `4 partitions`, `raw
//! stream`; default all). A run waits for its payments up to 600 s or 2 ms per
//! payment, whichever is longer. Environment: `AMQP_URL` (default the local node),
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/idemq_streams_bench`,
//! created, migrated, and dropped at the end).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use idemq::outbox::Outgoing;
use idemq::{
    idempotent_handler, Batch, HandlerError, Outcome, Partitions, Publisher, Queue, Runtime, Topology,
};
use idemq_example_payments::{record_payment, record_payments, PaymentRequested};
use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_streams_bench";

/// The backlog is published in chunks of this many, each awaited for its confirms…
const PUBLISH_CHUNK: usize = 10_000;
/// …this many chunks at a time: a million payments never sit in memory at once.
const PUBLISH_IN_FLIGHT: usize = 2;

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

/// The stream contender as a batch handler: one call per transaction, the demo's
/// batch effect (what `raw stream` runs per transaction too).
#[idempotent_handler(key = "payment_id", name = "bench_stream_batch", dedup = false)]
async fn stream_batch_payments(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    record_payments(conn, batch.messages()).await?;
    Ok(())
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
    StreamBatch,
    StreamDedup,
    Partitioned,
    RawStream,
}

/// The partitions of the `4 partitions` contender.
const PARTITIONS: u16 = 4;

impl Contender {
    const ALL: [Contender; 6] = [
        Contender::Queue,
        Contender::Stream,
        Contender::StreamBatch,
        Contender::StreamDedup,
        Contender::Partitioned,
        Contender::RawStream,
    ];

    fn label(self) -> &'static str {
        match self {
            Contender::Queue => "queue",
            Contender::Stream => "stream",
            Contender::StreamBatch => "stream batch",
            Contender::StreamDedup => "stream+dedup",
            Contender::Partitioned => "4 partitions",
            Contender::RawStream => "raw stream",
        }
    }

    /// The idemq handler whose offset rows the check reads (none for the queue and
    /// for `raw stream`, which keeps its offset in a table of its own).
    fn stream_handler(self) -> Option<&'static str> {
        match self {
            Contender::Queue | Contender::RawStream => None,
            Contender::Stream | Contender::Partitioned => Some("bench_stream"),
            Contender::StreamBatch => Some("bench_stream_batch"),
            Contender::StreamDedup => Some("bench_stream_dedup"),
        }
    }

    /// What it consumes, declared.
    fn topology(self, name: &str) -> Topology {
        match self {
            Contender::Queue => Topology::new().queue(Queue::new(name)),
            Contender::Stream | Contender::StreamBatch | Contender::StreamDedup | Contender::RawStream => {
                Topology::new().queue(Queue::stream(name))
            }
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
            Contender::Stream | Contender::StreamBatch | Contender::Partitioned | Contender::RawStream => 0,
            Contender::Queue | Contender::StreamDedup => i64::try_from(payments).unwrap_or(i64::MAX),
        }
    }

    /// Its idemq runtime, built (not started); `None` for `raw stream`, which has none.
    fn runtime(
        self,
        name: &str,
        options: &Options,
        urls: (&str, &str),
        counters: (&Arc<AtomicU64>, &Arc<AtomicU64>),
    ) -> Result<Option<Runtime>, BenchError> {
        let (settled, others) = (Arc::clone(counters.0), Arc::clone(counters.1));
        let builder = Runtime::builder()
            .amqp_url(urls.0)
            .database_url(urls.1)
            .topology(self.topology(name))
            .relay(false)
            .observe(idemq::observe::on_settled(move |event| {
                let counter = if event.outcome == Outcome::Applied { &settled } else { &others };
                counter.fetch_add(1, Ordering::SeqCst);
            }));
        let builder = match options.batch_size {
            Some(size) => builder.batch_size(size),
            None => builder,
        };
        let builder = match self {
            Contender::Queue => builder.concurrency(16).consume(name, queue_payment),
            Contender::Stream => builder.consume(name, stream_payment),
            Contender::StreamBatch => builder.consume(name, stream_batch_payments),
            Contender::StreamDedup => builder.consume(name, stream_dedup_payment),
            Contender::Partitioned => {
                builder.consume_partitions(&Partitions::new(name, PARTITIONS), stream_payment)
            }
            Contender::RawStream => return Ok(None),
        };
        Ok(Some(builder.build()?))
    }
}

struct Options {
    messages: usize,
    rounds: usize,
    accounts: usize,
    /// The idemq contenders' `batch_size` (`None`: idemq's default).
    batch_size: Option<usize>,
    contenders: Vec<Contender>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut options = Options {
            messages: 20_000,
            rounds: 3,
            accounts: 10,
            batch_size: None,
            contenders: Contender::ALL.to_vec(),
        };
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
                "--batch-size" => options.batch_size = Some(value()?.max(1)),
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
                "{message}\nusage: streams [--messages N] [--rounds R] [--accounts A] [--batch-size B] \
                 [--contenders A,B]\ncontenders: {}",
                Contender::ALL.map(Contender::label).join(", ")
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
    db.batch_execute(raw_stream::TABLE).await?;
    let admin = Connection::connect(amqp_url, ConnectionProperties::default()).await?;
    println!(
        "streams: {} payments per run over {} accounts, {} rounds; idemq: batch_size {}; \
         the queue: concurrency 16, lane on the account; raw stream: batches of up to {}, prefetch {}",
        options.messages,
        options.accounts,
        options.rounds,
        options.batch_size.map_or_else(
            || format!("{} (the default)", idemq::RuntimeBuilder::DEFAULT_BATCH_SIZE),
            |size| size.to_string()
        ),
        raw_stream::BATCH,
        raw_stream::PREFETCH,
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
    summary(&results, options);
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
        "TRUNCATE ledger, accounts, idemq_dedup, idemq_started, idemq_stream_offsets, \
         bench_raw_stream_offset; CHECKPOINT",
    )
    .await?;
    let name = format!(
        "bench-streams-{}-{round}-{}",
        contender.label().replace(['+', ' '], "-"),
        std::process::id()
    );
    let channel = admin.create_channel().await?;
    contender.topology(&name).declare(&channel).await?;
    publish_backlog(contender, &name, options, amqp_url).await?;

    let settled = Arc::new(AtomicU64::new(0));
    let others = Arc::new(AtomicU64::new(0));
    let runtime = contender.runtime(&name, options, (amqp_url, database_url), (&settled, &others))?;
    let wal_before = wal_lsn(db).await?;
    let cpu_before = process_cpu();
    let started = Instant::now();
    let stop = idemq::CancellationToken::new();
    let running = match runtime {
        Some(runtime) => {
            let run = runtime.run(stop.clone());
            tokio::spawn(async move { run.await.map_err(BenchError::from) })
        }
        None => tokio::spawn(raw_stream::consume(
            amqp_url.to_owned(),
            database_url.to_owned(),
            name.clone(),
            Arc::clone(&settled),
            stop.clone(),
        )),
    };
    let target = options.messages as u64;
    let patience = Duration::from_secs(600).max(Duration::from_millis(2 * target));
    let deadline = started + patience;
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
        failures.push(format!("the consumer failed: {}", idemq::connect::report(&*err)));
    }
    let applied = AtomicU64::load(&settled, Ordering::SeqCst);
    if applied != target || AtomicU64::load(&others, Ordering::SeqCst) != 0 {
        failures.push(format!(
            "settled {applied} applied of {target}, {} otherwise",
            AtomicU64::load(&others, Ordering::SeqCst)
        ));
    }
    check(db, contender, &name, options, &mut failures).await?;
    for queue in contender.queues(&name) {
        let dead_letter = format!("{queue}.dlq");
        let dead_letters =
            channel.queue_delete(dead_letter.as_str().into(), QueueDeleteOptions::default()).await?;
        if dead_letters != 0 {
            failures.push(format!("{dead_letters} dead-lettered from {queue}"));
        }
        channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
        if contender == Contender::Queue {
            // Its runtime declared the retry policy's wait queues too.
            for (wait_queue, _) in idemq::RetryPolicy::default().wait_queues(&queue) {
                channel.queue_delete(wait_queue.as_str().into(), QueueDeleteOptions::default()).await?;
            }
        }
    }
    if contender == Contender::Partitioned {
        channel
            .exchange_delete(name.as_str().into(), lapin::options::ExchangeDeleteOptions::default())
            .await?;
    }
    let _ = channel.close(200, "run done".into()).await;
    Ok(Measured { contender, elapsed, cpu, wal_bytes, failures })
}

/// Publishes the run's payments where `contender` consumes them: chunks of
/// [`PUBLISH_CHUNK`], each built when its turn comes and pipelined with its confirms,
/// [`PUBLISH_IN_FLIGHT`] chunks at a time.
async fn publish_backlog(
    contender: Contender,
    name: &str,
    options: &Options,
    amqp_url: &str,
) -> Result<(), BenchError> {
    let publisher = Publisher::connect(amqp_url).await?;
    let began = Instant::now();
    let publisher_ref = &publisher;
    let chunk = |from: usize| {
        (from..(from + PUBLISH_CHUNK).min(options.messages))
            .map(|i| {
                let payment = payment(name, i, options.accounts);
                let (exchange, routing_key) = contender.route(name, &payment);
                Outgoing::json(exchange, routing_key, &payment)
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let mut chunks = futures_util::stream::iter((0..options.messages).step_by(PUBLISH_CHUNK))
        .map(|from| async move {
            publisher_ref.publish_all(chunk(from)?).await?;
            Ok::<_, BenchError>(())
        })
        .buffer_unordered(PUBLISH_IN_FLIGHT);
    let mut published = Ok(());
    while let Some(done) = chunks.next().await {
        if let Err(err) = done {
            published = Err(err);
            break;
        }
    }
    drop(chunks);
    publisher.close().await;
    published?;
    if options.messages >= 100_000 {
        eprintln!(
            "streams: {} payments published to {name} in {:.1} s",
            options.messages,
            began.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// The run's `i`th payment: distinct ids, over `accounts` accounts.
fn payment(prefix: &str, i: usize, accounts: usize) -> PaymentRequested {
    PaymentRequested {
        payment_id: format!("{prefix}-pay-{i}"),
        account: account(prefix, i % accounts),
        amount_cents: amount(i),
    }
}

fn account(prefix: &str, index: usize) -> String {
    format!("{prefix}-acct-{index}")
}

fn amount(i: usize) -> i64 {
    100 + (i as i64 * 37) % 9_900
}

/// Each account's balance once every payment of the run is applied.
fn balances(prefix: &str, options: &Options) -> BTreeMap<String, i64> {
    let mut totals = vec![0_i64; options.accounts.min(options.messages)];
    for i in 0..options.messages {
        totals[i % options.accounts] += amount(i);
    }
    totals.into_iter().enumerate().map(|(index, total)| (account(prefix, index), total)).collect()
}

async fn check(
    db: &mut AsyncPgConnection,
    contender: Contender,
    name: &str,
    options: &Options,
    failures: &mut Vec<String>,
) -> Result<(), BenchError> {
    let rows = count(db, "SELECT count(*) FROM ledger".into()).await?;
    let distinct = count(db, "SELECT count(DISTINCT payment_id) FROM ledger".into()).await?;
    let expected = i64::try_from(options.messages)?;
    if (rows, distinct) != (expected, expected) {
        failures.push(format!("ledger: {rows} rows, {distinct} distinct, of {expected} payments"));
    }
    for (account, balance) in balances(name, options) {
        let stored =
            count(db, format!("SELECT balance_cents FROM accounts WHERE account = '{account}'")).await?;
        if stored != balance {
            failures.push(format!("{account}: balance {stored}, expected {balance}"));
            break;
        }
    }
    let dedup = count(db, "SELECT count(*) FROM idemq_dedup".into()).await?;
    if dedup != contender.dedup_rows(options.messages) {
        failures.push(format!("{dedup} dedup rows, expected {}", contender.dedup_rows(options.messages)));
    }
    // Each stream's offset at its last message: offsets + 1 add up to the payments.
    let covered = match contender.stream_handler() {
        Some(handler) => {
            Some(format!("SELECT sum(last_offset + 1) FROM idemq_stream_offsets WHERE handler = '{handler}'"))
        }
        None if contender == Contender::RawStream => {
            Some(format!("SELECT \"offset\" + 1 FROM bench_raw_stream_offset WHERE stream = '{name}'"))
        }
        None => None,
    };
    if let Some(covered) = covered {
        let covered = count(db, covered).await?;
        if covered != expected {
            failures.push(format!("the offsets cover {covered} messages, expected {expected}"));
        }
    }
    Ok(())
}

fn summary(results: &[Measured], options: &Options) {
    let messages = options.messages;
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
    let medians =
        |contender: Contender| [median(contender, &rate), median(contender, &cpu), median(contender, &wal)];
    let ratio = |value: Option<f64>, base: Option<f64>| {
        value.zip(base).map_or("-".into(), |(value, base)| format!("{:.2}", value / base))
    };
    let show = |value: Option<f64>| value.map_or("-".into(), |value| format!("{value:.0}"));
    let ran: Vec<Contender> =
        Contender::ALL.into_iter().filter(|contender| options.contenders.contains(contender)).collect();

    println!("\nmedians (passing runs), and each against `queue`:");
    println!(
        "{:<13} {:>11} {:>8} {:>11} {:>8} {:>14} {:>8}",
        "contender", "payments/s", "×", "CPU µs/pay", "×", "WAL bytes/pay", "×"
    );
    let base = medians(Contender::Queue);
    for &contender in &ran {
        let [r, c, w] = medians(contender);
        println!(
            "{:<13} {:>11} {:>8} {:>11} {:>8} {:>14} {:>8}",
            contender.label(),
            show(r),
            ratio(r, base[0]),
            show(c),
            ratio(c, base[1]),
            show(w),
            ratio(w, base[2])
        );
    }
    if !ran.contains(&Contender::RawStream) {
        return;
    }
    println!("\neach against `raw stream` (lapin + diesel-async by hand), medians' ratios:");
    println!("{:<13} {:>11} {:>11} {:>14}", "contender", "payments/s", "CPU µs/pay", "WAL bytes/pay");
    let raw = medians(Contender::RawStream);
    for &contender in &ran {
        let [r, c, w] = medians(contender);
        println!(
            "{:<13} {:>11} {:>11} {:>14}",
            contender.label(),
            ratio(r, raw[0]),
            ratio(c, raw[1]),
            ratio(w, raw[2])
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

/// The `raw stream` contender: a stream consumer written by hand with lapin and
/// diesel-async, no idemq runtime. Exactly once as `stream` is: each transaction
/// applies a batch and moves the consumer's offset to the batch's last, and a
/// restart consumes after the stored offset.
mod raw_stream {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use diesel::sql_types::{BigInt, Text};
    use diesel::OptionalExtension;
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    use futures_util::{FutureExt, StreamExt};
    use idemq_example_payments::{record_payments, PaymentRequested};
    use lapin::message::Delivery;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::{Connection, ConnectionProperties};
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;

    use super::BenchError;

    /// The channel's prefetch (a stream consumer needs one): four batches, so the
    /// broker keeps sending while one batch commits and the next is read.
    pub(super) const PREFETCH: u16 = 2_000;
    /// Deliveries per transaction, at most: every one ready when a batch is taken.
    pub(super) const BATCH: usize = 500;
    /// Its offset's table, a row per stream (created by the bench).
    pub(super) const TABLE: &str =
        "CREATE TABLE IF NOT EXISTS bench_raw_stream_offset (stream text PRIMARY KEY, \"offset\" bigint NOT NULL)";

    /// A batch read: its new payments, the offset of the last of them (`None`: all
    /// were at or below the stored offset), and its last delivery, whose `multiple`
    /// ack grants the credit of them all.
    struct Batch {
        payments: Vec<PaymentRequested>,
        offset: Option<i64>,
        last: Delivery,
    }

    /// Consumes `stream` after its stored offset until `stop`, adding each
    /// committed payment to `settled`. Any failure ends it (no retry, no dead letter).
    pub(super) async fn consume(
        amqp_url: String,
        database_url: String,
        stream: String,
        settled: Arc<AtomicU64>,
        stop: CancellationToken,
    ) -> Result<(), BenchError> {
        // idemq's connect helper only for the same transport as idemq's pool (TLS as
        // the URL says, keepalives): a plain diesel-async connection.
        let mut db = idemq::connect::database(&database_url).await?;
        let stored = stored_offset(&mut db, &stream).await?;
        let connection = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let mut arguments = FieldTable::default();
        let start = match stored {
            Some(offset) => AMQPValue::LongLongInt(offset + 1),
            None => AMQPValue::LongString(LongString::from("first")),
        };
        arguments.insert("x-stream-offset".into(), start);
        let deliveries = channel
            .basic_consume(
                stream.as_str().into(),
                "idemq-bench-raw-stream".into(),
                BasicConsumeOptions::default(),
                arguments,
            )
            .await?;
        // One batch waits while the writer commits the one before.
        let (batches, to_write) = mpsc::channel(1);
        let writer = tokio::spawn(write(db, stream, to_write, settled));
        let read = read(deliveries, stored, batches, &stop).await;
        // The reader's sender is gone: the writer commits what it was given, then ends.
        let written = writer.await?;
        let _ = channel.close(200, "done".into()).await;
        let _ = connection.close(200, "done".into()).await;
        written.and(read)
    }

    /// Takes every delivery ready (up to [`BATCH`]), decodes the new ones, and hands
    /// the batch to the writer; until `stop`, or the writer ends.
    async fn read(
        mut deliveries: lapin::Consumer,
        stored: Option<i64>,
        batches: mpsc::Sender<Batch>,
        stop: &CancellationToken,
    ) -> Result<(), BenchError> {
        loop {
            let first = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                next = deliveries.next() => next,
            };
            let mut next = Some(first.ok_or("the broker cancelled the stream's consumer")?);
            let mut payments = Vec::with_capacity(BATCH);
            let (mut offset, mut last, mut taken) = (None, None, 0);
            while let Some(delivery) = next {
                let delivery = delivery?;
                let at = offset_of(&delivery).ok_or("a delivery without x-stream-offset: is it a stream?")?;
                // A stream starts a consumer at the chunk holding the offset asked for.
                if stored.is_none_or(|stored| at > stored) {
                    payments.push(serde_json::from_slice::<PaymentRequested>(&delivery.data)?);
                    offset = Some(at);
                }
                last = Some(delivery);
                taken += 1;
                // Ready now, or the batch is done (a stream's end waits for the next turn).
                next = if taken < BATCH { deliveries.next().now_or_never().flatten() } else { None };
            }
            let Some(last) = last else { continue };
            if batches.send(Batch { payments, offset, last }).await.is_err() {
                // The writer ended: its result says why.
                return Ok(());
            }
        }
    }

    /// Per batch: the payments and the offset in one transaction, COMMIT, then one
    /// `multiple` ack (a stream's acks only grant credit).
    async fn write(
        mut db: AsyncPgConnection,
        stream: String,
        mut batches: mpsc::Receiver<Batch>,
        settled: Arc<AtomicU64>,
    ) -> Result<(), BenchError> {
        while let Some(Batch { payments, offset, last }) = batches.recv().await {
            if let Some(offset) = offset {
                db.transaction::<_, diesel::result::Error, _>(async |conn| {
                    record_payments(conn, &payments).await?;
                    diesel::sql_query(
                        "INSERT INTO bench_raw_stream_offset (stream, \"offset\") VALUES ($1, $2) \
                         ON CONFLICT (stream) DO UPDATE SET \"offset\" = excluded.\"offset\"",
                    )
                    .bind::<Text, _>(&stream)
                    .bind::<BigInt, _>(offset)
                    .execute(conn)
                    .await?;
                    Ok(())
                })
                .await?;
            }
            if !last.ack(BasicAckOptions { multiple: true }).await? {
                return Err("the ack was not sent (channel gone)".into());
            }
            settled.fetch_add(payments.len() as u64, Ordering::SeqCst);
        }
        Ok(())
    }

    /// The stored offset of `stream`, if any.
    async fn stored_offset(db: &mut AsyncPgConnection, stream: &str) -> Result<Option<i64>, BenchError> {
        #[derive(diesel::QueryableByName)]
        struct Stored {
            #[diesel(sql_type = BigInt)]
            offset: i64,
        }
        let stored: Option<Stored> =
            diesel::sql_query("SELECT \"offset\" FROM bench_raw_stream_offset WHERE stream = $1")
                .bind::<Text, _>(stream)
                .get_result(db)
                .await
                .optional()?;
        Ok(stored.map(|stored| stored.offset))
    }

    /// A delivery's `x-stream-offset` header, in whichever integer type it came.
    fn offset_of(delivery: &Delivery) -> Option<i64> {
        match delivery.properties.headers().as_ref()?.inner().get("x-stream-offset")? {
            AMQPValue::LongLongInt(offset) => Some(*offset),
            AMQPValue::LongInt(offset) => Some(i64::from(*offset)),
            AMQPValue::LongUInt(offset) => Some(i64::from(*offset)),
            AMQPValue::Timestamp(offset) => i64::try_from(*offset).ok(),
            _ => None,
        }
    }
}
