//! Run with: cargo run --release -p idemq-bench --bin sagas
//!
//! What sagas cost, measured in one run (read the ratios: absolute numbers move with
//! the machine's load):
//!
//! 1. **Saga steps against plain handlers**: one backlog, `--keys` keys × 5 messages
//!    each (every message its own dedup key `{key}:{n}`, the keys interleaved: the
//!    5 messages of a key are `--keys` apart), published persistent with confirms to
//!    a fresh quorum queue (idemq's [`Topology`]) before the consumer starts, taken
//!    by an idemq [`Runtime`] (builder defaults: group commit) with
//!    (a) a saga step (`saga(start)`; the state counts the messages and completes
//!    the saga at the 5th), or (b) a plain `#[idempotent_handler]` making the
//!    equivalent hand-written update in its transaction (an upsert adding 1 to the
//!    key's row of `bench_counters`). The runs alternate (a)/(b) for `--rounds`;
//!    before each, `idemq_saga`, `idemq_dedup` and `bench_counters` are truncated and
//!    the server CHECKPOINTs. The clock runs from the runtime's start to the last
//!    delivery settled (`observe::on_settled`). Per-round and median msg/s and
//!    saga / plain; then the same with `.batch_size(1)` (one message per
//!    transaction). Checks after each run: every key's final state is 5 (every saga
//!    finished with count 5, or every counter 5), nothing dead-lettered or retried,
//!    the queue and its dead-letter queue empty.
//! 2. **Due-time precision**: `--scheduled` scheduled messages written to the outbox
//!    in one statement (`Outbox::publish_all`, each `Outgoing::deliver`ed at its due
//!    time: what `Context::schedule` and `outbox::enqueue` write), due uniformly over
//!    `--spread` seconds from `--lead` seconds ahead, each body carrying its due time
//!    (epoch ms), to a fresh queue through the default exchange; the relay's claim
//!    planned and run (`EXPLAIN ANALYZE`) with all of them pending; then one
//!    [`Relay`] (default settings: 1 s poll interval) publishes them while a lapin
//!    consumer (no-ack) records each arrival (the machine's clock, which the
//!    database's `now()` shares) minus its due time. Reported: arrived, missing,
//!    duplicated (by message id), the earliest against its due time, lateness p50 /
//!    p90 / p99 / max. Checks: every row published once, none more than 50 ms before
//!    it was due (the tolerance is for clock granularity), the outbox empty.
//!
//! Checks print `ok` or `FAILED`; the run exits 1 if one failed.
//!
//! Flags: `--keys N` (default 2000), `--rounds N` (default 3), `--no-light` (skips
//! the `.batch_size(1)` pair), `--scheduled N` (default 100000; 0 skips part 2),
//! `--spread S` (default 30), `--lead S` (default 10). Environment: `AMQP_URL`
//! (default the local node), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/idemq_bench_sagas`, created, migrated, and
//! dropped at the end).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use idemq::observe::{Observe, RelayPass, Settled};
use idemq::outbox::{Outbox, Outgoing, Relay};
use idemq::saga::Saga;
use idemq::{idempotent_handler, CancellationToken, HandlerError, Outcome, Queue, Runtime, Topology};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use serde::{Deserialize, Serialize};

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_bench_sagas";
/// Messages per key: the saga completes at the last.
const STEPS: u32 = 5;
/// How early a scheduled message may arrive before it was due and still count as
/// on time: the clocks' granularity, not a slack of the relay's.
const EARLY_TOLERANCE_MS: i64 = 50;

/// One message of a key: the `n`-th of `of`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tick {
    tally: String,
    n: u32,
    of: u32,
}

/// The saga of a key: the messages it took.
#[derive(Debug, Clone, Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "bench_tally", key = "tally", takes(Tick))]
struct Tally {
    count: u32,
}

/// (a) A saga step: counts the message, completes the saga at the last.
#[idempotent_handler(key = "{tally}:{n}", name = "bench_saga_tick", saga(start))]
async fn saga_tick(
    _conn: &mut AsyncPgConnection,
    msg: Tick,
    saga: &mut Saga<Tally>,
) -> Result<(), HandlerError> {
    saga.count += 1;
    if saga.count == msg.of {
        saga.complete();
    }
    Ok(())
}

/// (b) The same count, written by hand in the handler's transaction.
#[idempotent_handler(key = "{tally}:{n}", name = "bench_plain_tick")]
async fn plain_tick(conn: &mut AsyncPgConnection, msg: Tick) -> Result<(), diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    diesel::sql_query(
        "INSERT INTO bench_counters (key, n) VALUES ($1, 1) \
         ON CONFLICT (key) DO UPDATE SET n = bench_counters.n + 1",
    )
    .bind::<Text, _>(&msg.tally)
    .execute(conn)
    .await
    .map(drop)
}

struct Options {
    keys: u64,
    rounds: usize,
    light: bool,
    scheduled: u64,
    spread: u64,
    lead: u64,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut options =
            Self { keys: 2_000, rounds: 3, light: true, scheduled: 100_000, spread: 30, lead: 10 };
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
            let number = |v: &String| v.parse::<u64>().map_err(|_| format!("{flag}: not a number: {v}"));
            match flag.as_str() {
                "--keys" => options.keys = number(value()?)?.max(1),
                "--rounds" => options.rounds = number(value()?)?.max(1) as usize,
                "--no-light" => options.light = false,
                "--scheduled" => options.scheduled = number(value()?)?,
                "--spread" => options.spread = number(value()?)?,
                "--lead" => options.lead = number(value()?)?,
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
    let options = match Options::parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!(
                "{message}\nusage: sagas [--keys N] [--rounds N] [--no-light] [--scheduled N] [--spread S] [--lead S]"
            );
            return if message.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    match run(&options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("sagas: a check FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("sagas: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

/// What both parts share.
struct Bench {
    database_url: String,
    amqp_url: String,
    broker: lapin::Connection,
    channel: lapin::Channel,
    db: AsyncPgConnection,
    /// Runs so far (each names its queue).
    run: usize,
    /// All checks passed so far.
    ok: bool,
}

async fn run(options: &Options) -> Result<bool, BenchError> {
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let amqp_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    recreate_database(&database_url).await?;
    idemq::migrate(&database_url).await?;
    let mut db = idemq::connect::database(&database_url).await?;
    db.batch_execute("CREATE TABLE bench_counters (key text PRIMARY KEY, n integer NOT NULL)").await?;
    let broker = idemq::connect::broker(&amqp_url, "sagas-bench").await?;
    let channel = broker.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut bench =
        Bench { database_url: database_url.clone(), amqp_url, broker, channel, db, run: 0, ok: true };
    let measured = async {
        bench.steps(options, false).await?;
        if options.light {
            bench.steps(options, true).await?;
        }
        if options.scheduled > 0 {
            bench.due_times(options).await?;
        }
        Ok::<_, BenchError>(())
    }
    .await;
    let _ = bench.broker.close(200, "done".into()).await;
    drop(bench.db);
    drop_database(&database_url).await?;
    measured.map(|()| bench.ok)
}

/// The two consumers of part 1.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Saga,
    Plain,
}

/// Counts a run's deliveries as the runtime settles them, and when the last came.
struct Settles {
    expected: u64,
    done: AtomicU64,
    /// Settled otherwise than applied (or as a duplicate) with the broker told.
    other: AtomicU64,
    last: Mutex<Option<Instant>>,
}

impl Settles {
    fn settled(&self, settled: &Settled) {
        if !settled.settled_with_broker || !matches!(settled.outcome, Outcome::Applied | Outcome::Duplicate) {
            self.other.fetch_add(1, Ordering::SeqCst);
            return;
        }
        if self.done.fetch_add(1, Ordering::SeqCst) + 1 == self.expected {
            *self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(settled.settled_at);
        }
    }
}

impl Bench {
    fn check(&mut self, passed: bool, what: String) {
        if !passed {
            println!("  check: {what}: FAILED");
        }
        self.ok &= passed;
    }

    /// Part 1 at one mode: `rounds` × (saga, plain), the table of rates.
    async fn steps(&mut self, options: &Options, light: bool) -> Result<(), BenchError> {
        let messages = options.keys * u64::from(STEPS);
        println!(
            "\n== Saga steps against plain handlers{}: {} keys × {STEPS} = {messages} messages, {} rounds",
            if light { ", .batch_size(1)" } else { ", builder defaults (group commit)" },
            options.keys,
            options.rounds
        );
        let (mut sagas, mut plains) = (Vec::new(), Vec::new());
        for round in 1..=options.rounds {
            let saga = self.measure(Kind::Saga, options.keys, light).await?;
            let plain = self.measure(Kind::Plain, options.keys, light).await?;
            println!(
                "  round {round}: saga {saga:>7.0} msg/s, plain {plain:>7.0} msg/s, saga/plain {:.2}",
                saga / plain
            );
            sagas.push(saga);
            plains.push(plain);
        }
        let (saga, plain) = (median(&sagas), median(&plains));
        println!(
            "  median:  saga {saga:>7.0} msg/s, plain {plain:>7.0} msg/s, saga/plain {:.2}",
            saga / plain
        );
        println!("  checks (every run): every key at {STEPS}, none dead-lettered or retried, queue and DLQ empty: {}",
            if self.ok { "ok" } else { "FAILED" });
        Ok(())
    }

    /// One run: a fresh queue with the backlog, the runtime until every delivery
    /// settled, the checks. Returns msg/s.
    async fn measure(&mut self, kind: Kind, keys: u64, light: bool) -> Result<f64, BenchError> {
        self.run += 1;
        let queue = format!("idemq-sagas-bench-{}-{}", std::process::id(), self.run);
        self.db.batch_execute("TRUNCATE idemq_saga, idemq_dedup, bench_counters; CHECKPOINT").await?;
        let topology = || Topology::new().queue(Queue::new(queue.clone()));
        topology().declare(&self.channel).await?;
        let messages = self.publish(&queue, keys).await?;

        let settles = Arc::new(Settles {
            expected: messages,
            done: AtomicU64::new(0),
            other: AtomicU64::new(0),
            last: Mutex::new(None),
        });
        let builder = Runtime::builder()
            .amqp_url(&self.amqp_url)
            .database_url(&self.database_url)
            .topology(topology())
            .observe(idemq::observe::on_settled({
                let settles = Arc::clone(&settles);
                move |settled| settles.settled(settled)
            }));
        let builder = match kind {
            Kind::Saga => builder.consume(&queue, saga_tick),
            Kind::Plain => builder.consume(&queue, plain_tick),
        };
        let builder = if light { builder.batch_size(1) } else { builder };
        let runtime = builder.build()?;
        let stats = runtime.stats();
        let stop = CancellationToken::new();
        let started = Instant::now();
        let task = tokio::spawn(runtime.run(stop.clone()));
        while settles.done.load(Ordering::SeqCst) < messages {
            if task.is_finished() {
                return Err(format!("run {queue}: the runtime stopped early").into());
            }
            if started.elapsed() > Duration::from_secs(600) {
                return Err(format!(
                    "run {queue}: {} of {messages} settled after 600 s",
                    settles.done.load(Ordering::SeqCst)
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let last =
            settles.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).unwrap_or_else(Instant::now);
        let elapsed = last.saturating_duration_since(started);
        stop.cancel();
        task.await??;

        let stats = stats.snapshot();
        let (done, other) = (settles.done.load(Ordering::SeqCst), settles.other.load(Ordering::SeqCst));
        self.check(
            done == messages && other == 0 && stats.retried == 0 && stats.dead_lettered == 0,
            format!(
                "{queue}: {done} settled applied, {other} otherwise (retried {}, dead-lettered {})",
                stats.retried, stats.dead_lettered
            ),
        );
        let (total, at_five) = match kind {
            Kind::Saga => (
                count(&mut self.db, "SELECT count(*) FROM idemq_saga WHERE saga = 'bench_tally'").await?,
                count(
                    &mut self.db,
                    &format!(
                        "SELECT count(*) FROM idemq_saga WHERE saga = 'bench_tally' \
                         AND finished_at IS NOT NULL AND (state->>'count')::int = {STEPS} AND version = {STEPS}"
                    ),
                )
                .await?,
            ),
            Kind::Plain => (
                count(&mut self.db, "SELECT count(*) FROM bench_counters").await?,
                count(&mut self.db, &format!("SELECT count(*) FROM bench_counters WHERE n = {STEPS}")).await?,
            ),
        };
        self.check(
            total == keys as i64 && at_five == keys as i64,
            format!("{queue}: {total} keys stored, {at_five} of {keys} at {STEPS}"),
        );
        let mut names = vec![queue.clone(), format!("{queue}.dlq")];
        for name in [queue.clone(), format!("{queue}.dlq")] {
            let left = ready(&self.channel, &name).await?;
            self.check(left == 0, format!("{name} empty ({left} left)"));
        }
        names.extend(idemq::RetryPolicy::default().wait_queues(&queue).into_iter().map(|(name, _)| name));
        for name in names {
            let _ = self.channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await;
        }
        Ok(messages as f64 / elapsed.as_secs_f64())
    }

    /// Publishes `keys` × [`STEPS`] ticks, persistent, confirmed in windows of 1,000:
    /// every key's first, then every key's second, and so on.
    async fn publish(&mut self, queue: &str, keys: u64) -> Result<u64, BenchError> {
        let properties =
            BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
        let options = BasicPublishOptions { mandatory: true, immediate: false };
        let mut pending = Vec::new();
        let mut sent = 0;
        for n in 0..STEPS {
            for key in 0..keys {
                let body = serde_json::to_vec(&Tick { tally: format!("k{key}"), n, of: STEPS })?;
                pending.push(
                    self.channel
                        .basic_publish("".into(), queue.into(), options, &body, properties.clone())
                        .await?,
                );
                sent += 1;
                if pending.len() >= 1_000 || sent == keys * u64::from(STEPS) {
                    for confirm in pending.drain(..) {
                        match confirm.await? {
                            Confirmation::Ack(None) => {}
                            other => {
                                return Err(format!("publish not confirmed and routed: {other:?}").into())
                            }
                        }
                    }
                }
            }
        }
        Ok(sent)
    }

    /// Part 2: scheduled messages, published by the relay when due.
    async fn due_times(&mut self, options: &Options) -> Result<(), BenchError> {
        let n = options.scheduled;
        println!(
            "\n== Due-time precision: {n} scheduled messages due over {} s from {} s ahead, one relay",
            options.spread, options.lead
        );
        let queue = format!("idemq-sagas-bench-{}-due", std::process::id());
        Topology::new().queue(Queue::new(queue.clone())).declare(&self.channel).await?;

        // The consumer first: every arrival, stamped on this machine's clock.
        let consumer_channel = self.broker.create_channel().await?;
        let options_consume = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
        let mut deliveries = consumer_channel
            .basic_consume(
                queue.as_str().into(),
                "sagas-bench-due".into(),
                options_consume,
                FieldTable::default(),
            )
            .await?;
        let arrivals: Arc<Mutex<Vec<(String, i64, i64)>>> =
            Arc::new(Mutex::new(Vec::with_capacity(n as usize)));
        let received = Arc::new(AtomicU64::new(0));
        let consumer = tokio::spawn({
            let (arrivals, received) = (Arc::clone(&arrivals), Arc::clone(&received));
            async move {
                while let Some(delivery) = deliveries.next().await {
                    let at = epoch_ms(SystemTime::now());
                    let delivery = delivery?;
                    let id = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string())
                        .unwrap_or_default();
                    let due = serde_json::from_slice::<serde_json::Value>(&delivery.data)?["due_ms"]
                        .as_i64()
                        .unwrap_or(i64::MIN);
                    arrivals.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push((id, due, at));
                    received.fetch_add(1, Ordering::SeqCst);
                }
                Ok::<_, BenchError>(())
            }
        });

        let first_due = epoch_ms(SystemTime::now()) + (options.lead * 1000) as i64;
        let spread_ms = (options.spread * 1000) as i64;
        let dues: Vec<i64> = (0..n).map(|i| first_due + spread_ms * i as i64 / n as i64).collect();
        let rows = dues
            .iter()
            .enumerate()
            .map(|(i, &due)| {
                Ok(Outgoing::json("", queue.as_str(), &serde_json::json!({ "seq": i, "due_ms": due }))?
                    .message_id(format!("due-{i}"))
                    .deliver(UNIX_EPOCH + Duration::from_millis(due as u64)))
            })
            .collect::<Result<Vec<_>, idemq::PublishError>>()?;
        let written = Instant::now();
        Outbox::new(&mut self.db).publish_all(rows).await?;
        let took = written.elapsed();
        let ahead = first_due - epoch_ms(SystemTime::now());
        println!(
            "  written in {:.2} s (one statement, Outbox::publish_all); the first due {:.2} s after",
            took.as_secs_f64(),
            ahead as f64 / 1000.0
        );
        self.check(ahead > 0, "every row written before the first was due".into());
        let stored = count(
            &mut self.db,
            "SELECT count(*) FROM idemq_outbox WHERE due_at IS NOT NULL AND available_at = due_at",
        )
        .await?;
        self.check(stored == n as i64, format!("{n} rows stored with available_at = due_at ({stored})"));

        // The claim of `claim_outbox` (runtime/src/store/db/outbox.rs), its batch (256)
        // and reply TTL (1 h) inlined.
        let claim =
            "SELECT id, message_id, exchange, routing_key, body, content_type, correlation_id, headers, \
                     message_type, mandatory, attempts, last_error, coalesce(CASE WHEN reply THEN \
                     least(expires_at, created_at + 3600000 * interval '1 millisecond') END <= now(), false) \
                     AS expired FROM idemq_outbox WHERE available_at <= now() ORDER BY id LIMIT 256 \
                     FOR UPDATE SKIP LOCKED";
        for (when, analyze) in [("as written (no statistics yet)", false), ("after ANALYZE", true)] {
            if analyze {
                self.db.batch_execute("ANALYZE idemq_outbox").await?;
            }
            let explain = diesel::dsl::sql::<Text>(&format!(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY ON) {claim}"
            ));
            let plan: Vec<String> = diesel_async::RunQueryDsl::load(explain, &mut self.db).await?;
            println!("  the relay's claim with {n} pending, {when}:");
            for line in plan {
                println!("    {line}");
            }
        }

        let relayed = Arc::new(Relayed::default());
        let builder = Relay::builder()
            .amqp_url(self.amqp_url.clone())
            .database_url(self.database_url.clone())
            .observe(Arc::clone(&relayed));
        println!("  relay: {builder:?}");
        let relay = builder.build()?;
        let stop = CancellationToken::new();
        let running = tokio::spawn(relay.run(stop.clone()));
        let deadline = Instant::now() + Duration::from_secs(options.lead + options.spread + 120);
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        while received.load(Ordering::SeqCst) < n && Instant::now() < deadline && !running.is_finished() {
            tokio::select! {
                _ = tick.tick() => eprintln!(
                    "  {} of {n} arrived, {} published",
                    received.load(Ordering::SeqCst),
                    relayed.published.load(Ordering::SeqCst)
                ),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        // Time for a duplicate (none expected) to show.
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.cancel();
        running.await??;
        let _ = consumer_channel.close(200, "done".into()).await;
        consumer.await??;

        let arrivals = std::mem::take(&mut *arrivals.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let mut seen: HashMap<&str, u32> = HashMap::with_capacity(arrivals.len());
        for (id, _, _) in &arrivals {
            *seen.entry(id.as_str()).or_default() += 1;
        }
        let duplicated = seen.values().filter(|&&times| times > 1).count();
        let missing = (0..n).filter(|i| !seen.contains_key(format!("due-{i}").as_str())).count();
        let mut lateness: Vec<i64> = arrivals.iter().map(|(_, due, at)| at - due).collect();
        lateness.sort_unstable();
        println!(
            "  arrived {} ({} distinct), missing {missing}, duplicated {duplicated}",
            arrivals.len(),
            seen.len()
        );
        if !lateness.is_empty() {
            let at =
                |q: f64| lateness[((lateness.len() as f64 * q).ceil() as usize).clamp(1, lateness.len()) - 1];
            println!(
                "  arrival − due (ms): earliest {}, p50 {}, p90 {}, p99 {}, max {}",
                lateness[0],
                at(0.50),
                at(0.90),
                at(0.99),
                at(1.0)
            );
            let early = lateness.iter().filter(|&&ms| ms < -EARLY_TOLERANCE_MS).count();
            self.check(early == 0, format!("none before due − {EARLY_TOLERANCE_MS} ms ({early} were)"));
        }
        self.check(
            missing == 0 && duplicated == 0 && arrivals.len() as u64 == n,
            format!("every row published once ({} arrivals)", arrivals.len()),
        );
        let published = relayed.published.load(Ordering::SeqCst);
        let postponed = relayed.postponed.load(Ordering::SeqCst);
        self.check(
            published == n && postponed == 0,
            format!("relay published {published}, postponed {postponed}"),
        );
        let left = count(&mut self.db, "SELECT count(*) FROM idemq_outbox").await?;
        self.check(left == 0, format!("outbox empty ({left} rows left)"));
        println!(
            "  checks: every row published once, none early, outbox empty: {}",
            if self.ok { "ok" } else { "FAILED" }
        );
        for name in [queue.clone(), format!("{queue}.dlq")] {
            let _ = self.channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await;
        }
        Ok(())
    }
}

/// What the relay reported: rows published (deleted) and postponed.
#[derive(Default)]
struct Relayed {
    published: AtomicU64,
    postponed: AtomicU64,
}

impl Observe for Relayed {
    fn relay(&self, pass: &RelayPass) {
        self.published.fetch_add(pass.published as u64, Ordering::SeqCst);
        self.postponed.fetch_add(pass.postponed as u64, Ordering::SeqCst);
    }
}

fn epoch_ms(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as i64)
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

async fn ready(channel: &lapin::Channel, queue: &str) -> Result<u32, BenchError> {
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    Ok(channel.queue_declare(queue.into(), options, FieldTable::default()).await?.message_count())
}

async fn count(db: &mut AsyncPgConnection, sql: &str) -> Result<i64, BenchError> {
    // Here, not at the top: in scope, its blanket `load` shadows `AtomicU64::load`.
    use diesel_async::RunQueryDsl;
    Ok(diesel::dsl::sql::<BigInt>(sql).get_result(db).await?)
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
