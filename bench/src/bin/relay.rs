//! Run with: cargo run --release -p idemq-bench --bin relay
//!
//! The outbox relay against issue 21's bar ("keeps up with 10,000 events/s and drains a
//! 1,000,000-row backlog at a steady rate"), one relay (`idemq::outbox::Relay`, default
//! settings, printed) in this process, measured in one run:
//!
//! 1. **Backlog drain**: `--backlog` rows written by one `INSERT … SELECT generate_series`
//!    (unique message ids, ~100-byte JSON bodies, the default exchange, the run's queue
//!    as routing key), `ANALYZE`d (as autovacuum would), the claim's plan and the
//!    server's autovacuum setting printed; then the relay starts (the bench runs no
//!    `VACUUM` during the drain; autovacuum, if on, may). Progress each second (stderr);
//!    the total time and rate, the rate in each tenth of the backlog, and last tenth /
//!    first tenth: below 0.5 the relay slows down with the backlog, and the run fails.
//! 2. **Keeping up**: the same relay, on an outbox in the state a relay idling beside an
//!    autovacuumed outbox sees (`VACUUM`ed while empty, then 6 events published one at
//!    a time); a producer commits `--rate`/100 rows every 10 ms for `--seconds` (one
//!    multi-row `INSERT … unnest(..)` each, the runtime's shape) and sends `NOTIFY
//!    idemq_outbox` as a runtime without its own relay does (outside transactions, at
//!    most once per 50 ms). The backlog (committed minus published) sampled every 100 ms:
//!    max, p50, p99, the last quarter's mean against the first's (it must not grow); and
//!    how long after the producer stopped the outbox was empty, and at what rate.
//!
//! Progress is what the relay reports (`Observe::relay`, `RelayPass::published`), not
//! `count(*)`, slow on a big table and a load on the machine measured. Checks (exit 1 if
//! one fails): after each part `count(*)` is 0, the relay published exactly the rows
//! written and postponed none, and the queue holds the newest messages. The queue has
//! `x-max-length` 10000 and `x-overflow` `drop-head`, so the broker keeps 10,000 messages,
//! not a million; publishes are still persistent, mandatory, routed and confirmed.
//!
//! First, **the broker's ceiling** for the same publishes without the database:
//! `--ceiling N` messages (default 100000; 0 skips it) published as the relay does
//! (persistent, mandatory, confirmed, in rounds of 256 handed to lapin at once); the
//! relay's rates are also shown against it.
//!
//! Flags: `--ceiling N`, `--backlog N` (default 1000000; 0 skips part 1), `--rate R` (rows/s, default
//! 10000), `--seconds S` (default 20; 0 skips part 2). Environment: `AMQP_URL` (default
//! the local node), `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/idemq_relay`,
//! created, migrated, and dropped at the end).

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::sql_types::{Array, BigInt, Bytea, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idemq::observe::{Observe, RelayPass};
use idemq::outbox::Relay;
use idemq::CancellationToken;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

type BenchError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_relay";
/// The most messages the run's queue keeps (`x-max-length`, dropping the oldest).
const QUEUE_MAX: u64 = 10_000;
/// The body of row `seq`, in SQL (`g`) and in Rust alike: ~100 bytes of JSON.
const PAD: &str = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";

/// What the relay reported: rows published (deleted) and postponed, and after each
/// pass that claimed rows, when and how many published so far.
#[derive(Default)]
struct Counter {
    published: AtomicU64,
    postponed: AtomicU64,
    log: Mutex<Vec<(Instant, u64)>>,
}

impl Observe for Counter {
    fn relay(&self, pass: &RelayPass) {
        let now = Instant::now();
        let total = self.published.fetch_add(pass.published as u64, Ordering::SeqCst) + pass.published as u64;
        self.postponed.fetch_add(pass.postponed as u64, Ordering::SeqCst);
        self.log.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push((now, total));
    }
}

impl Counter {
    fn published(&self) -> u64 {
        self.published.load(Ordering::SeqCst)
    }
}

struct Options {
    ceiling: u64,
    backlog: u64,
    rate: u64,
    seconds: u64,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, String> {
        let mut options = Self { ceiling: 100_000, backlog: 1_000_000, rate: 10_000, seconds: 20 };
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"));
            let number = |v: &String| v.parse::<u64>().map_err(|_| format!("{flag}: not a number: {v}"));
            match flag.as_str() {
                "--ceiling" => options.ceiling = number(value?)?,
                "--backlog" => options.backlog = number(value?)?,
                "--rate" => options.rate = number(value?)?.max(100),
                "--seconds" => options.seconds = number(value?)?,
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
                "{message}\nusage: relay [--ceiling N] [--backlog N] [--rate ROWS_PER_S] [--seconds S]"
            );
            return if message.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) };
        }
    };
    match run(&options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("relay: a check FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("relay: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

/// What both parts share.
struct Bench {
    database_url: String,
    queue: String,
    channel: lapin::Channel,
    db: AsyncPgConnection,
    counter: Arc<Counter>,
    /// All checks passed so far.
    ok: bool,
    /// The broker's ceiling measured first (msg/s; 0: not measured).
    ceiling: f64,
}

async fn run(options: &Options) -> Result<bool, BenchError> {
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let amqp_url =
        std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    recreate_database(&database_url).await?;
    idemq::migrate(&database_url).await?;
    let broker = idemq::connect::broker(&amqp_url, "relay-bench").await?;
    let channel = broker.create_channel().await?;
    let queue = format!("idemq-relay-bench-{}", std::process::id());
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(QUEUE_MAX as i64));
    args.insert("x-overflow".into(), AMQPValue::LongString("drop-head".into()));
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    channel.queue_declare(queue.as_str().into(), durable, args).await?;

    let counter = Arc::new(Counter::default());
    let builder =
        Relay::builder().amqp_url(amqp_url).database_url(database_url.clone()).observe(Arc::clone(&counter));
    println!("relay: {builder:?}");
    let relay = builder.build()?;
    let db = idemq::connect::database(&database_url).await?;
    let mut bench =
        Bench { database_url: database_url.clone(), queue, channel, db, counter, ok: true, ceiling: 0.0 };
    let stop = CancellationToken::new();
    let mut running = None;
    let measured = async {
        if options.ceiling > 0 {
            bench.ceiling(&broker, options.ceiling).await?;
        }
        if options.backlog > 0 {
            bench.fill(options.backlog).await?;
        }
        let started = Instant::now();
        running = Some(tokio::spawn(relay.run(stop.clone())));
        if options.backlog > 0 {
            bench.drain(options.backlog, started).await?;
        }
        if options.seconds > 0 {
            bench.keep_up(options.rate, options.seconds).await?;
        }
        Ok::<_, BenchError>(())
    }
    .await;
    stop.cancel();
    let stopped: Result<(), BenchError> = match running {
        Some(running) => running.await.map_err(BenchError::from).and_then(|ran| Ok(ran?)),
        None => Ok(()),
    };
    let _ = bench.channel.queue_delete(bench.queue.as_str().into(), QueueDeleteOptions::default()).await;
    let _ = broker.close(200, "done".into()).await;
    drop(bench.db);
    drop_database(&database_url).await?;
    measured.and(stopped).map(|()| bench.ok)
}

impl Bench {
    fn check(&mut self, passed: bool, what: String) {
        println!("  check: {what}: {}", if passed { "ok" } else { "FAILED" });
        self.ok &= passed;
    }

    /// The broker's ceiling for what the relay does, without the database: `n`
    /// messages like the relay's (persistent, mandatory, ~100-byte JSON, to the run's
    /// queue) on a confirm channel of their own, in rounds of the relay's batch size
    /// (256): every publish of a round handed to lapin at once, then the round's
    /// confirms awaited.
    async fn ceiling(&mut self, broker: &lapin::Connection, n: u64) -> Result<(), BenchError> {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        println!("\n== The broker alone: {n} publishes as the relay makes them, no database");
        let channel = broker.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let properties = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let started = Instant::now();
        let mut sent = 0;
        while sent < n {
            let round: Vec<Vec<u8>> = (sent..n.min(sent + 256))
                .map(|seq| format!(r#"{{"event":"relay-bench","seq":{seq},"pad":"{PAD}"}}"#).into_bytes())
                .collect();
            let publishes = round.iter().map(|body| {
                channel.basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    options,
                    body,
                    properties.clone(),
                )
            });
            for confirm in futures_util::future::join_all(publishes).await {
                if !confirm?.await?.is_ack() {
                    return Err("the broker refused a publish of the ceiling's".into());
                }
            }
            sent += round.len() as u64;
        }
        let secs = started.elapsed().as_secs_f64();
        self.ceiling = sent as f64 / secs;
        println!("  {sent} confirmed in {secs:.2} s: {:.0} msg/s", self.ceiling);
        let _ = channel.close(200, "done".into()).await;
        Ok(())
    }

    /// `rate` against the broker's ceiling, if it was measured.
    fn of_ceiling(&self, rate: f64) -> String {
        if self.ceiling > 0.0 {
            format!(" = {:.2}× the broker's ceiling", rate / self.ceiling)
        } else {
            String::new()
        }
    }

    async fn fill(&mut self, rows: u64) -> Result<(), BenchError> {
        // Here and in the other fns that query, not at the top: in scope, its
        // blanket `load` and `first` shadow `AtomicU64::load` and `Vec::first`.
        use diesel_async::RunQueryDsl;
        println!("\n== Backlog drain: {rows} rows");
        let started = Instant::now();
        diesel::sql_query(
            r#"INSERT INTO idemq_outbox (message_id, exchange, routing_key, body, content_type)
               SELECT 'backlog-' || g, '', $1,
                      convert_to(format('{"event":"relay-bench","seq":%s,"pad":"%s"}', g, $3), 'UTF8'),
                      'application/json'
               FROM generate_series(1, $2) AS g"#,
        )
        .bind::<Text, _>(&self.queue)
        .bind::<BigInt, _>(rows as i64)
        .bind::<Text, _>(PAD)
        .execute(&mut self.db)
        .await?;
        self.db.batch_execute("ANALYZE idemq_outbox").await?;
        let bytes = count(&mut self.db, "SELECT avg(length(body))::bigint FROM idemq_outbox").await?;
        println!(
            "  filled in {:.1} s (one INSERT, then ANALYZE), {bytes}-byte bodies",
            started.elapsed().as_secs_f64()
        );
        let plan: Vec<String> = diesel::dsl::sql::<Text>(
            "EXPLAIN (COSTS OFF) SELECT id FROM idemq_outbox WHERE available_at <= now() \
             ORDER BY id LIMIT 256 FOR UPDATE SKIP LOCKED",
        )
        .load(&mut self.db)
        .await?;
        let plan: Vec<&str> = plan.iter().map(|line| line.trim().trim_start_matches("->").trim()).collect();
        println!("  the claim's plan (its shape, as planned now): {}", plan.join(" <- "));
        // Off, the drain's dead rows stay (and their index entries, which each claim
        // walks past from the head of the id index) until part 2's VACUUM.
        let autovacuum: String =
            diesel::dsl::sql::<Text>("SELECT current_setting('autovacuum')").get_result(&mut self.db).await?;
        println!("  autovacuum on this server: {autovacuum}");
        Ok(())
    }

    /// Waits for the relay started at `started` to publish the `rows` of the backlog.
    async fn drain(&mut self, rows: u64, started: Instant) -> Result<(), BenchError> {
        let (mut last, mut last_change) = (0, Instant::now());
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        while self.counter.published() < rows {
            tick.tick().await;
            let published = self.counter.published();
            eprintln!(
                "  {:>4.0} s: {:>8} left, {:>6} rows/s",
                started.elapsed().as_secs_f64(),
                rows.saturating_sub(published),
                published - last
            );
            if published != last {
                last_change = Instant::now();
            } else if last_change.elapsed() > Duration::from_secs(60) {
                return Err(
                    format!("the relay published nothing for 60 s, {published} of {rows} done").into()
                );
            }
            last = published;
        }
        let log = self.counter.log.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let Some(&(finished, _)) = log.iter().find(|(_, total)| *total >= rows) else {
            return Err("the relay's reports do not add up to the backlog".into());
        };
        let total = finished - started;
        let rate = rows as f64 / total.as_secs_f64();
        println!(
            "  drained in {:.2} s: {rate:.0} rows/s overall{}",
            total.as_secs_f64(),
            self.of_ceiling(rate)
        );
        // Each tenth from the first report at or past its start to the first past its end.
        let mut bounds = vec![(started, 0)];
        for k in 1..=10 {
            let bound = (rows * k).div_ceil(10);
            bounds.extend(log.iter().find(|(_, total)| *total >= bound).copied());
        }
        let rates: Vec<f64> = bounds
            .windows(2)
            .map(|w| (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0).as_secs_f64().max(1e-9))
            .collect();
        let tenths: Vec<String> = rates.iter().map(|rate| format!("{rate:.0}")).collect();
        println!("  rows/s per tenth of the backlog, first to last: {}", tenths.join(" "));
        let steady = rates.last().copied().unwrap_or(0.0) / rates.first().copied().unwrap_or(f64::NAN);
        println!("  steady: last tenth / first tenth = {steady:.2}");
        self.check(steady >= 0.5, "last tenth at least half the first tenth's rate".into());
        self.check_after(rows, 0).await
    }

    /// Puts the outbox and the relay where a relay idling beside an autovacuumed outbox is:
    /// the table `VACUUM`ed while empty (its statistics: no pages, no rows), then a few
    /// events published one at a time — enough for PostgreSQL to settle on a generic
    /// plan for the relay's prepared `DELETE`, made for a nearly empty table.
    async fn idle_state(&mut self) -> Result<(), BenchError> {
        use diesel_async::RunQueryDsl;
        self.db.batch_execute("VACUUM idemq_outbox").await?;
        for i in 0..6 {
            let before = self.counter.published();
            diesel::sql_query(
                "INSERT INTO idemq_outbox (message_id, exchange, routing_key, body, content_type) \
                 VALUES ($1, '', $2, convert_to('{}', 'UTF8'), 'application/json')",
            )
            .bind::<Text, _>(format!("idle-{i}"))
            .bind::<Text, _>(&self.queue)
            .execute(&mut self.db)
            .await?;
            self.db.batch_execute("NOTIFY idemq_outbox").await?;
            let waited = Instant::now();
            while self.counter.published() == before {
                if waited.elapsed() > Duration::from_secs(10) {
                    return Err("the relay did not publish a single row in 10 s".into());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        println!("  (first the outbox VACUUMed while empty, then 6 single events published one by one)");
        Ok(())
    }

    /// The outbox is empty, the relay published `expected` rows since it had published
    /// `since` and postponed none, and the queue holds the newest messages.
    async fn check_after(&mut self, expected: u64, since: u64) -> Result<(), BenchError> {
        let left = count(&mut self.db, "SELECT count(*) FROM idemq_outbox").await?;
        self.check(left == 0, format!("outbox empty ({left} rows left)"));
        let published = self.counter.published() - since;
        self.check(published == expected, format!("relay published exactly {expected} ({published})"));
        let postponed = self.counter.postponed.load(Ordering::SeqCst);
        self.check(postponed == 0, format!("none postponed ({postponed})"));
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        let declared =
            self.channel.queue_declare(self.queue.as_str().into(), passive, FieldTable::default()).await?;
        let (held, want) = (u64::from(declared.message_count()), self.counter.published().min(QUEUE_MAX));
        self.check(held == want, format!("the queue holds the newest {want} messages ({held})"));
        Ok(())
    }

    async fn keep_up(&mut self, rate: u64, seconds: u64) -> Result<(), BenchError> {
        let per_tick = rate / 100;
        println!("\n== Keeping up: {per_tick} rows every 10 ms ({rate} rows/s) for {seconds} s");
        self.idle_state().await?;
        let base = self.counter.published();
        let published = || self.counter.published() - base;
        let inserted = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let (url, queue, count) = (self.database_url.clone(), self.queue.clone(), Arc::clone(&inserted));
        let producer = tokio::spawn(produce(url, queue, per_tick, seconds * 100, count));
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.tick().await;
        while !producer.is_finished() {
            tick.tick().await;
            samples.push(inserted.load(Ordering::SeqCst).saturating_sub(published()));
        }
        producer.await??;
        let stopped = Instant::now();
        let (produced, published_by_stop) = (inserted.load(Ordering::SeqCst), published());
        let (mut last, mut last_change) = (published(), Instant::now());
        while published() < produced {
            if published() != last {
                (last, last_change) = (published(), Instant::now());
            } else if last_change.elapsed() > Duration::from_secs(60) {
                return Err(format!("the relay published nothing for 60 s, {last} of {produced} done").into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let empty_after = stopped.elapsed();
        let left_at_stop = produced - published_by_stop;
        let window = (stopped - started).as_secs_f64();
        println!("  inserted {produced} rows in {window:.2} s: {:.0} rows/s", produced as f64 / window);
        let rate = published_by_stop as f64 / window;
        println!("  relay published {rate:.0} rows/s while the producer ran{}", self.of_ceiling(rate));
        let mut sorted = samples.clone();
        sorted.sort_unstable();
        let at = |q: f64| sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1];
        if !sorted.is_empty() {
            println!(
                "  backlog over {} samples (100 ms): max {}, p50 {}, p99 {} rows",
                sorted.len(),
                at(1.0),
                at(0.50),
                at(0.99)
            );
            let quarter = sorted.len().div_ceil(4);
            let mean = |s: &[u64]| s.iter().sum::<u64>() as f64 / s.len() as f64;
            let (first, last) = (mean(&samples[..quarter]), mean(&samples[samples.len() - quarter..]));
            // Grown: the last quarter's mean over twice the first's (or one tick's rows, so
            // that a near-empty start is not read as growth).
            let grew = last > 2.0 * first.max(per_tick as f64);
            println!(
                "  mean backlog, first quarter {first:.0} rows, last quarter {last:.0} rows: {}",
                if grew { "it GREW, the relay falls behind" } else { "it did not grow, the relay keeps up" }
            );
        }
        println!(
            "  outbox empty {:.0} ms after the producer stopped: its {left_at_stop} rows at {:.0} rows/s",
            empty_after.as_secs_f64() * 1000.0,
            left_at_stop as f64 / empty_after.as_secs_f64()
        );
        self.check_after(produced, base).await
    }
}

/// Commits `per_tick` rows every 10 ms for `ticks` ticks, each transaction one multi-row
/// insert (the runtime's shape: arrays `unnest`ed), and wakes relays as a runtime without
/// a relay of its own does (`OutboxSignal::notify_elsewhere`): after commits, one
/// `NOTIFY idemq_outbox` per 50 ms at most, outside any transaction.
async fn produce(
    url: String,
    queue: String,
    per_tick: u64,
    ticks: u64,
    inserted: Arc<AtomicU64>,
) -> Result<(), BenchError> {
    use diesel_async::RunQueryDsl;
    let mut conn = idemq::connect::database(&url).await?;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for n in 0..ticks {
        tick.tick().await;
        let seqs = n * per_tick..(n + 1) * per_tick;
        let ids: Vec<String> = seqs.clone().map(|i| format!("live-{i}")).collect();
        let bodies: Vec<Vec<u8>> = seqs
            .map(|i| format!(r#"{{"event":"relay-bench","seq":{i},"pad":"{PAD}"}}"#).into_bytes())
            .collect();
        conn.transaction::<_, diesel::result::Error, _>(async |conn| {
            diesel::sql_query(
                "INSERT INTO idemq_outbox (message_id, exchange, routing_key, body, content_type) \
                 SELECT m, '', $3, b, 'application/json' FROM unnest($1::text[], $2::bytea[]) AS u(m, b)",
            )
            .bind::<Array<Text>, _>(&ids)
            .bind::<Array<Bytea>, _>(&bodies)
            .bind::<Text, _>(&queue)
            .execute(conn)
            .await
        })
        .await?;
        inserted.fetch_add(per_tick, Ordering::SeqCst);
        // Every tick commits: the runtime's 50 ms timer always finds one pending.
        if n % 5 == 4 || n + 1 == ticks {
            conn.batch_execute("NOTIFY idemq_outbox").await?;
        }
    }
    Ok(())
}

async fn count(db: &mut AsyncPgConnection, sql: &str) -> Result<i64, BenchError> {
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
