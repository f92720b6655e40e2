//! Run with: cargo run --release -p idemq-bench --bin scale
//!
//! What scaling out buys on this machine, measured side by side in one run:
//!
//! 1. **Processes × broker**: the payments workload (idemq with group commit and
//!    the demo's lane, as contender 5 of `bench`) consumed by 1, 2 and 4 consumer
//!    processes (children of this binary), against the machine's one RabbitMQ node
//!    and against a private 3-node cluster (`idemq::testing::Cluster`, quorum queue
//!    replicated on all three; each process given the three addresses starting at a
//!    different node). Rounds alternate the configurations; medians and ratios to
//!    one process on one node. Next to it, **PostgreSQL's commit ceiling**: 1, 4 and
//!    8 connections committing one-row transactions as fast as they can.
//! 2. **The dedup table at 10 million rows**: one process on a table holding
//!    `--dedup-rows` rows of its own scope (random keys, as the runs' are: inserts
//!    land all over the index; half older than the retention) against the same on
//!    an empty table, medians of 3; then one run while `idemq::store::sweep` deletes the
//!    old half, with the sweeper's delete rate; bytes per row measured; a sizing rule.
//!
//! Each run: fresh queue with the whole backlog (persistent, confirmed) before the
//! consumers start; the clock runs from spawning the processes until every payment
//! is in the ledger and the queue is empty; then the processes get SIGTERM (each
//! must exit 0) and the check runs: ledger rows = distinct payments, none twice.
//! Absolute numbers move with the machine's load: read the ratios.
//!
//! Flags: `--messages N` (default 20000), `--processes 1,2,4`, `--rounds N`
//! (default 2), `--dedup-rows N` (default 10000000; 0 skips part 2), `--no-cluster`.
//! Environment: `AMQP_URL` (default the local node), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/idemq_scale`, created, migrated, and dropped
//! at the end).

use std::process::{Child, ExitCode, Stdio};
use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemq::{idempotent_handler, store::Retention, Queue, Runtime, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_scale";
/// The dedup scope of `apply` (its name), which the filler rows share.
const HANDLER: &str = "apply_payment";

/// The demo's effect under the demo's dedup name and lane.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
async fn apply(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

struct Options {
    messages: usize,
    processes: Vec<usize>,
    rounds: usize,
    dedup_rows: u64,
    cluster: bool,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut options = Self {
            messages: 20_000,
            processes: vec![1, 2, 4],
            rounds: 2,
            dedup_rows: 10_000_000,
            cluster: true,
        };
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
            let number = |v: &str| v.parse::<u64>().map_err(|_| format!("{flag}: not a number: {v}"));
            match flag.as_str() {
                "--messages" => options.messages = number(value()?)? as usize,
                "--rounds" => options.rounds = number(value()?)?.max(1) as usize,
                "--dedup-rows" => options.dedup_rows = number(value()?)?,
                "--processes" => {
                    options.processes = value()?
                        .split(',')
                        .map(|v| number(v.trim()).map(|n| n.max(1) as usize))
                        .collect::<Result<_, _>>()?;
                }
                "--no-cluster" => options.cluster = false,
                "--help" | "-h" => return Err(String::new()),
                other => return Err(format!("unknown flag {other}")),
            }
        }
        Ok(options)
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
    if let [flag, rest @ ..] = args.as_slice() {
        if flag == "--child" {
            return child(rest).await;
        }
    }
    let options = match Options::parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}\nusage: scale [--messages N] [--processes 1,2,4] [--rounds N] [--dedup-rows N] [--no-cluster]");
            return if message.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    match run(&options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("scale: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

/// A consumer process: `--child <queue>`, `AMQP_URL` and `DATABASE_URL` set.
async fn child(args: &[String]) -> ExitCode {
    let [queue, ..] = args else { return ExitCode::from(2) };
    let built = Runtime::builder()
        .topology(Topology::new().queue(Queue::new(queue.clone())))
        .consume(queue.clone(), apply)
        .relay(false)
        .build();
    // A second signal exits at once with 130, as `idemq::cli` does.
    let signals = idemq::shutdown_signals();
    match built {
        Ok(runtime) => tokio::select! {
            result = runtime.run(signals.graceful.clone()) => match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("scale child: {}", err.report());
                    ExitCode::FAILURE
                }
            },
            () = signals.immediate.cancelled() => ExitCode::from(130),
        },
        Err(err) => {
            eprintln!("scale child: {}", err.report());
            ExitCode::FAILURE
        }
    }
}

/// Where the consumers' broker is: one node, or the cluster's three.
#[derive(Clone, Copy, PartialEq, Default)]
enum Target {
    #[default]
    Node,
    Cluster,
}

/// One configuration's measurements, a sample per round.
#[derive(Default)]
struct Samples {
    target: Target,
    processes: usize,
    rates: Vec<f64>,
    cpu: Vec<f64>,
    busy: Vec<f64>,
}

struct Bench {
    database_url: String,
    node_url: String,
    cluster: Option<idemq::testing::Cluster>,
    messages: usize,
    run: usize,
}

async fn run(options: &Options) -> Result<(), BenchError> {
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let node_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    recreate_database(&database_url).await?;
    idemq_example_payments::migrate(&database_url).await?;
    let cluster = if options.cluster {
        eprintln!("starting a private 3-node RabbitMQ cluster…");
        Some(idemq::testing::Cluster::start().await?)
    } else {
        None
    };
    let mut bench =
        Bench { database_url: database_url.clone(), node_url, cluster, messages: options.messages, run: 0 };

    println!("== PostgreSQL's commit ceiling (one-row transactions, 3 s each)");
    for connections in [1, 4, 8] {
        let rate = commit_ceiling(&database_url, connections, Duration::from_secs(3)).await?;
        println!("  {connections} connection(s): {rate:>8.0} commits/s");
    }

    println!(
        "\n== Consumer processes × broker ({} payments + {} duplicates per run)",
        options.messages,
        options.messages / 10
    );
    let mut targets = vec![Target::Node];
    if bench.cluster.is_some() {
        targets.push(Target::Cluster);
    }
    let mut rates: Vec<Samples> = Vec::new();
    for &target in &targets {
        for &processes in &options.processes {
            rates.push(Samples { target, processes, ..Samples::default() });
        }
    }
    for round in 0..options.rounds {
        for Samples { target, processes, rates: samples, cpu, busy } in &mut rates {
            let measured = bench.measure(*target, *processes).await?;
            eprintln!("  round {}: {} × {processes}: {:.0} msg/s", round + 1, name(*target), measured.rate);
            samples.push(measured.rate);
            cpu.push(measured.cpu_per_message_us);
            busy.push(measured.machine_busy);
        }
    }
    let reference = median(&rates[0].rates);
    println!(
        "  {:<8} {:>9} {:>10} {:>8} {:>20} {:>13}",
        "broker", "processes", "msg/s", "ratio", "consumers µs CPU/msg", "machine busy"
    );
    for Samples { target, processes, rates: samples, cpu, busy } in &rates {
        let rate = median(samples);
        println!(
            "  {:<8} {:>9} {:>10.0} {:>7.2}× {:>20.0} {:>12.0}%",
            name(*target),
            processes,
            rate,
            rate / reference,
            median(cpu),
            median(busy) * 100.0
        );
    }

    if options.dedup_rows > 0 {
        bench.dedup_table(options.dedup_rows).await?;
    }
    drop(bench);
    drop_database(&database_url).await?;
    Ok(())
}

fn name(target: Target) -> &'static str {
    match target {
        Target::Node => "node",
        Target::Cluster => "cluster",
    }
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

struct Measured {
    rate: f64,
    cpu_per_message_us: f64,
    /// The whole machine's CPU busy during the run, 0..=1 of every core.
    machine_busy: f64,
}

/// The machine's (busy, total) CPU ticks so far (`/proc/stat`'s first line).
fn machine_ticks() -> (u64, u64) {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else { return (0, 0) };
    let Some(line) = stat.lines().next() else { return (0, 0) };
    let ticks: Vec<u64> = line.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

impl Bench {
    fn urls(&self, target: Target, first: usize) -> String {
        match (target, &self.cluster) {
            (Target::Cluster, Some(cluster)) => cluster.amqp_urls_from(first, "/"),
            _ => self.node_url.clone(),
        }
    }

    /// One run: a fresh queue with the backlog, `processes` consumers, the clock
    /// until the ledger is complete and the queue empty, SIGTERM, the check.
    async fn measure(&mut self, target: Target, processes: usize) -> Result<Measured, BenchError> {
        self.run += 1;
        let queue = format!("idemq-scale-{}-{}", std::process::id(), self.run);
        let prefix = format!("scale-{}-{}-", std::process::id(), self.run);
        let mut db = idemq::connect::database(&self.database_url).await?;
        db.batch_execute(
            "TRUNCATE ledger, accounts, idemq_started, idemq_copies, idemq_outbox; \
             DELETE FROM idemq_dedup WHERE processed_at > now() - interval '30 minutes'; CHECKPOINT",
        )
        .await?;
        let broker = connect(&self.urls(target, 0)).await?;
        let channel = broker.create_channel().await?;
        Topology::new().queue(Queue::new(queue.clone())).declare(&channel).await?;
        publish(&channel, &queue, &prefix, self.messages).await?;

        let started = Instant::now();
        let ticks_before = machine_ticks();
        let mut children: Vec<Child> = (0..processes)
            .map(|i| {
                std::process::Command::new(std::env::current_exe()?)
                    .args(["--child", &queue])
                    .env("AMQP_URL", self.urls(target, i))
                    .env("DATABASE_URL", &self.database_url)
                    .stdout(Stdio::null())
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        let distinct = self.messages as i64;
        loop {
            let applied = count(&mut db, "SELECT count(*) FROM ledger").await?;
            if applied >= distinct && ready(&channel, &queue).await? == 0 {
                break;
            }
            if started.elapsed() > Duration::from_secs(600) {
                return Err(format!("run {queue}: {applied} of {distinct} applied after 600 s").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let elapsed = started.elapsed();
        let ticks_after = machine_ticks();
        let cpu: f64 = children.iter().map(|child| cpu_seconds(child.id())).sum();
        for child in &children {
            let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        }
        for child in &mut children {
            let status = child.wait()?;
            if !status.success() {
                return Err(format!("a consumer process exited with {status} after SIGTERM").into());
            }
        }
        let rows = count(&mut db, "SELECT count(*) FROM ledger").await?;
        let ids = count(&mut db, "SELECT count(DISTINCT payment_id) FROM ledger").await?;
        if rows != distinct || ids != distinct {
            return Err(
                format!("check failed: {rows} ledger rows, {ids} payments, {distinct} expected").into()
            );
        }
        for name in [queue.clone(), format!("{queue}.dlq")] {
            channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await?;
        }
        let _ = broker.close(200, "done".into()).await;
        let deliveries = self.messages + self.messages / 10;
        Ok(Measured {
            rate: deliveries as f64 / elapsed.as_secs_f64(),
            cpu_per_message_us: cpu * 1e6 / deliveries as f64,
            machine_busy: (ticks_after.0 - ticks_before.0) as f64
                / (ticks_after.1 - ticks_before.1).max(1) as f64,
        })
    }

    /// Part 2: the dedup table at `rows` rows.
    async fn dedup_table(&mut self, rows: u64) -> Result<(), BenchError> {
        println!("\n== The dedup table at {rows} rows (one process, one node)");
        let mut samples = Vec::new();
        for _ in 0..3 {
            samples.push(self.measure(Target::Node, 1).await?.rate);
        }
        let empty = median(&samples);
        let mut db = idemq::connect::database(&self.database_url).await?;
        let filled = Instant::now();
        let chunk = 1_000_000u64;
        let mut done = 0;
        while done < rows {
            let upto = (done + chunk).min(rows);
            // The consumer's own scope, random keys (the runs' keys are random too,
            // so their inserts land all over the index, as UUID keys would); half
            // the rows 30 days old (for the sweeper), half an hour old (kept, and
            // apart from the runs' rows, which each run deletes).
            db.batch_execute(&format!(
                "INSERT INTO idemq_dedup (handler, key, fingerprint, processed_at) \
                 SELECT '{HANDLER}', md5(g::text), sha256(g::text::bytea), \
                        CASE WHEN g % 2 = 0 THEN now() - interval '30 days' ELSE now() - interval '1 hour' END \
                 FROM generate_series({}, {upto}) AS g",
                done + 1
            ))
            .await?;
            done = upto;
            eprintln!("  filled {done} rows");
        }
        // One statement each: VACUUM refuses to run inside a transaction block.
        for statement in ["VACUUM ANALYZE idemq_dedup", "CHECKPOINT"] {
            db.batch_execute(statement).await?;
        }
        let fill_rate = rows as f64 / filled.elapsed().as_secs_f64();
        let bytes = count(&mut db, "SELECT pg_total_relation_size('idemq_dedup')").await? as f64;
        let per_row = bytes / rows as f64;
        println!("  bulk fill (SQL, not the consumer path): {fill_rate:.0} rows/s");
        println!("  table + indexes: {:.2} GiB, {per_row:.0} bytes per row", bytes / f64::from(1u32 << 30));

        let mut samples = Vec::new();
        for _ in 0..3 {
            samples.push(self.measure(Target::Node, 1).await?.rate);
        }
        let full = median(&samples);
        println!("  consumer on an empty table (median of 3): {empty:>8.0} msg/s");
        println!(
            "  consumer beside {rows} rows (median of 3): {full:>8.0} msg/s ({:.2}× empty)",
            full / empty
        );

        // The sweeper deletes the old half while a run goes on.
        let database_url = self.database_url.clone();
        let sweeper = tokio::spawn(async move {
            let mut conn = idemq::connect::database(&database_url).await?;
            let started = Instant::now();
            // The children's retry policy: the default.
            let retention = Retention::keep(Duration::from_secs(15 * 24 * 3600))
                .check([&idemq::RetryPolicy::default()])?;
            let swept = idemq::store::sweep(&mut conn, &retention).await?;
            Ok::<_, BenchError>((swept.dedup_rows, started.elapsed()))
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        let during = self.measure(Target::Node, 1).await?;
        let sweep_running_at_end = !sweeper.is_finished();
        let (deleted, took) = sweeper.await??;
        println!(
            "  consumer while the sweeper runs (one run): {:>8.0} msg/s ({:.2}× beside the full table; the sweep {} the whole run)",
            during.rate,
            during.rate / full,
            if sweep_running_at_end { "lasted" } else { "did not last" }
        );
        println!(
            "  sweeper: {deleted} rows deleted in {:.1} s, {:.0} rows/s (5,000 per transaction)",
            took.as_secs_f64(),
            deleted as f64 / took.as_secs_f64()
        );
        println!(
            "  sizing: rows = rate × retention; at {per_row:.0} bytes per row, 100 msg/s kept 8 days is {:.1} GiB, 1,000 msg/s {:.0} GiB",
            100.0 * 8.0 * 86_400.0 * per_row / f64::from(1u32 << 30),
            1_000.0 * 8.0 * 86_400.0 * per_row / f64::from(1u32 << 30)
        );
        Ok(())
    }
}

/// Commits per second of `connections` connections, each committing one-row
/// transactions for `window`.
async fn commit_ceiling(url: &str, connections: usize, window: Duration) -> Result<f64, BenchError> {
    let mut setup = idemq::connect::database(url).await?;
    setup.batch_execute("CREATE TABLE IF NOT EXISTS scale_commits (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now()); TRUNCATE scale_commits").await?;
    let deadline = Instant::now() + window;
    let tasks: Vec<_> = (0..connections)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let mut conn = idemq::connect::database(&url).await?;
                let mut commits = 0u64;
                while Instant::now() < deadline {
                    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
                        diesel::sql_query("INSERT INTO scale_commits DEFAULT VALUES").execute(conn).await
                    })
                    .await?;
                    commits += 1;
                }
                Ok::<_, BenchError>(commits)
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    setup.batch_execute("DROP TABLE scale_commits").await?;
    Ok(total as f64 / window.as_secs_f64())
}

async fn connect(urls: &str) -> Result<Connection, BenchError> {
    let mut last = None;
    for url in urls.split(',') {
        match Connection::connect(url, ConnectionProperties::default()).await {
            Ok(connection) => return Ok(connection),
            Err(err) => last = Some(err),
        }
    }
    Err(last.map_or_else(|| "no broker address".into(), |err| err.to_string().into()))
}

/// `messages` distinct payments over `messages / 4` accounts, every tenth twice,
/// persistent, confirmed in windows of 1,000.
async fn publish(
    channel: &lapin::Channel,
    queue: &str,
    prefix: &str,
    messages: usize,
) -> Result<(), BenchError> {
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let properties =
        BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
    let options = BasicPublishOptions { mandatory: true, immediate: false };
    let mut pending = Vec::new();
    for i in 0..messages {
        let payment = PaymentRequested {
            // Random-looking keys, as UUIDs are: inserts spread over the index.
            payment_id: format!("{:016x}-{prefix}pay-{i}", spread(prefix, i)),
            account: format!("{prefix}acct-{}", i % (messages / 4).max(1)),
            amount_cents: 100 + (i as i64 * 37) % 9_900,
        };
        let body = serde_json::to_vec(&payment)?;
        for _ in 0..if i % 10 == 0 { 2 } else { 1 } {
            pending.push(
                channel.basic_publish("".into(), queue.into(), options, &body, properties.clone()).await?,
            );
        }
        if pending.len() >= 1_000 || i + 1 == messages {
            for confirm in pending.drain(..) {
                match confirm.await? {
                    Confirmation::Ack(None) => {}
                    other => return Err(format!("publish not confirmed and routed: {other:?}").into()),
                }
            }
        }
    }
    Ok(())
}

/// A well-mixed 64-bit hash of (`prefix`, `i`) (`SplitMix64`'s finaliser).
fn spread(prefix: &str, i: usize) -> u64 {
    let mut x = prefix.bytes().fold(i as u64, |h, b| h.rotate_left(5) ^ u64::from(b));
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

async fn ready(channel: &lapin::Channel, queue: &str) -> Result<u32, BenchError> {
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    Ok(channel.queue_declare(queue.into(), options, FieldTable::default()).await?.message_count())
}

async fn count(db: &mut AsyncPgConnection, sql: &str) -> Result<i64, BenchError> {
    Ok(diesel::dsl::sql::<diesel::sql_types::BigInt>(sql).get_result(db).await?)
}

/// User + system CPU seconds of process `pid` so far (Linux `/proc/<pid>/stat`).
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let Some((_, rest)) = stat.rsplit_once(") ") else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum());
    ticks / 100.0
}

async fn recreate_database(url: &str) -> Result<(), BenchError> {
    drop_database(url).await?;
    let (admin, name) = admin_url(url)?;
    let mut conn = idemq::connect::database(&admin).await?;
    conn.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await?;
    Ok(())
}

async fn drop_database(url: &str) -> Result<(), BenchError> {
    let (admin, name) = admin_url(url)?;
    let mut conn = idemq::connect::database(&admin).await?;
    conn.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await?;
    Ok(())
}

/// The URL of the `postgres` database on the same server, and `url`'s database name.
fn admin_url(url: &str) -> Result<(String, String), BenchError> {
    let (base, name) = url.rsplit_once('/').ok_or("DATABASE_URL has no database name")?;
    let name = name.split('?').next().unwrap_or(name).to_owned();
    if name.is_empty() || name.contains('"') {
        return Err(format!("DATABASE_URL's database name {name:?} is not usable").into());
    }
    Ok((format!("{base}/postgres"), name))
}
