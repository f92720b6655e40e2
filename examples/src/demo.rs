//! `payments demo`: publish a burst with duplicates and bad messages, consume it,
//! and check the ledger against what was meant to happen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::RunQueryDsl;
use idemq::{observe::StatsSnapshot, Runtime};
use tokio_util::sync::CancellationToken;

use crate::{
    accounts, apply_payment, apply_stream_payment, ledger, topology, PaymentApplied, PaymentRequested,
    EVENTS_EXCHANGE, EVENTS_QUEUE, QUEUE, STREAM,
};

/// How big a burst to send.
#[derive(Debug, Clone, Copy)]
pub struct DemoConfig {
    /// Distinct payments.
    pub payments: usize,
    /// Every n-th payment is published twice.
    pub duplicate_every: usize,
    /// Accounts the payments spread over.
    pub accounts: usize,
    /// Deliveries processed at once.
    pub concurrency: usize,
    /// Distinct payments published to the stream (`payments.stream`).
    pub stream_payments: usize,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self { payments: 2_000, duplicate_every: 10, accounts: 10, concurrency: 16, stream_payments: 200 }
    }
}

/// What the demo saw.
#[derive(Debug)]
pub struct DemoReport {
    /// Messages published to the queue (payments, their duplicates, bad ones).
    pub published: usize,
    /// Payments published to the stream, and how many of them were applied.
    pub stream: (usize, usize),
    /// The runtime's counters.
    pub stats: StatsSnapshot,
    /// Time from the consumer's start to the last settled delivery.
    pub consume_time: Duration,
    /// Whether the ledger and balances equal the expected sums.
    pub ledger_ok: bool,
    /// Lines explaining any mismatch.
    pub mismatches: Vec<String>,
    /// What this run's events looked like.
    pub events: EventsReport,
}

/// This run's `PaymentApplied` events, as the demo's own queue on the events exchange
/// saw them (they land in `payments.applied` too, and stay there).
#[derive(Debug, Default)]
pub struct EventsReport {
    /// Copies seen (a relay re-send after a crash would be a second copy).
    pub copies: usize,
    /// Payments with at least one event.
    pub payments: usize,
    /// Lines explaining any mismatch.
    pub mismatches: Vec<String>,
}

type DemoError = Box<dyn std::error::Error + Send + Sync>;

/// Runs the demo against `amqp_url` and `database_url` (migrations included).
///
/// # Errors
/// When a service is unreachable or the burst is not consumed within two minutes.
pub async fn run(amqp_url: &str, database_url: &str, config: DemoConfig) -> Result<DemoReport, DemoError> {
    crate::migrate(database_url).await?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();

    // As idemq connects (TLS for amqps:// with RabbitMQ's URI parameters, a list of
    // addresses): lapin's own `Connection::connect` would ignore `cacertfile`.
    let connection = idemq::connect::broker(amqp_url, "demo").await?;
    let channel = connection.create_channel().await?;
    topology().declare(&channel).await?;

    // The burst: distinct payments, some published twice, and a few bad messages.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    for i in 0..config.payments {
        let account = format!("demo-{run_id}-acct-{}", i % config.accounts.max(1));
        let amount_cents = 100 + (i as i64 * 37) % 9_900;
        let payment =
            PaymentRequested { payment_id: format!("demo-{run_id}-pay-{i}"), account, amount_cents };
        *expected.entry(payment.account.clone()).or_default() += amount_cents;
        let body = serde_json::to_vec(&payment)?;
        if config.duplicate_every > 0 && i % config.duplicate_every == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    let bad: [&[u8]; 5] = [
        b"this is not json",
        br#"{"account": "x", "amount_cents": 1}"#,
        br#"{"payment_id": "", "account": "x", "amount_cents": 1}"#,
        br#"{"payment_id": "p", "account": "x", "amount_cents": "ten"}"#,
        br#"{"payment_id": null, "account": "x", "amount_cents": 1}"#,
    ];
    bodies.extend(bad.iter().map(|b| b.to_vec()));
    // Same key, different payload: a client bug, dead-lettered as a conflict.
    let first = PaymentRequested {
        payment_id: format!("demo-{run_id}-pay-0"),
        account: format!("demo-{run_id}-acct-0"),
        amount_cents: 1,
    };
    bodies.push(serde_json::to_vec(&first)?);

    // Published as any client would, with idemq's publisher: confirmed, and
    // `mandatory` (a payment no queue takes would be an error, not a silent loss).
    let publisher = idemq::Publisher::builder().amqp_url(amqp_url).name("demo publisher").connect().await?;
    let outgoing = bodies.iter().map(|body| {
        idemq::outbox::Outgoing::bytes("", QUEUE, body.clone()).map(|o| o.content_type("application/json"))
    });
    publisher.publish_all(outgoing.collect::<Result<Vec<_>, _>>()?).await?;
    // And to the stream, other payments to accounts of their own (the two consumers
    // never update one row).
    let mut stream_batch = Vec::with_capacity(config.stream_payments);
    for i in 0..config.stream_payments {
        let account = format!("demo-{run_id}-stream-acct-{}", i % config.accounts.max(1));
        let amount_cents = 100 + (i as i64 * 53) % 9_900;
        let payment =
            PaymentRequested { payment_id: format!("demo-{run_id}-stream-{i}"), account, amount_cents };
        *expected.entry(payment.account.clone()).or_default() += amount_cents;
        stream_batch.push(idemq::outbox::Outgoing::json("", STREAM, &payment)?);
    }
    publisher.publish_all(stream_batch).await?;
    publisher.close().await;
    // This run's events, watched on a queue of the demo's own bound to the events
    // exchange (`payments.applied` keeps every event, of every run, for you).
    let watcher = channel
        .queue_declare(
            "".into(),
            lapin::options::QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            watcher.name().clone(),
            EVENTS_EXCHANGE.into(),
            "".into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await?;
    let published = bodies.len();

    // This run's stream payments applied, counted as they settle.
    let stream_applied = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&stream_applied);
    let prefix = format!("demo-{run_id}-stream-");
    let runtime = Runtime::builder()
        .amqp_url(amqp_url)
        .database_url(database_url)
        .topology(topology())
        .consume(QUEUE, apply_payment)
        .consume(STREAM, apply_stream_payment)
        .concurrency(config.concurrency)
        .observe(idemq::observe::on_settled(move |settled| {
            let ours = settled.key.as_deref().is_some_and(|key| key.starts_with(&prefix));
            if settled.queue == STREAM && ours && settled.outcome == idemq::Outcome::Applied {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }))
        .build()?;
    let stats = runtime.stats();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let consumer = tokio::spawn(runtime.run(shutdown.clone()));

    let deadline = started + Duration::from_secs(120);
    // The queue's deliveries (the stream's applied ones are counted apart).
    // (`AtomicUsize::load` by path: diesel_async::RunQueryDsl has a `load` too.)
    let stream_done = || AtomicUsize::load(&stream_applied, Ordering::Relaxed);
    let settled =
        |s: StatsSnapshot| (s.applied + s.duplicates + s.dead_lettered).saturating_sub(stream_done() as u64);
    // Progress on stderr while it consumes (drawn only on a terminal).
    let progress = indicatif::ProgressBar::new(published as u64).with_style(
        indicatif::ProgressStyle::with_template("consuming {bar:40} {pos}/{len} deliveries, {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    while settled(stats.snapshot()) < published as u64 || stream_done() < config.stream_payments {
        progress.set_position(settled(stats.snapshot()));
        if Instant::now() > deadline || consumer.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.finish_and_clear();
    let consume_time = started.elapsed();
    // The relay publishes what was committed; wait for it before stopping.
    let mut conn = idemq::connect::database(database_url).await?;
    while idemq::outbox::backlog(&mut conn).await? > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(conn);
    shutdown.cancel();
    consumer.await??;
    let stats = stats.snapshot();
    if settled(stats) < published as u64 {
        return Err(format!(
            "only {} of {published} messages were settled within two minutes",
            settled(stats)
        )
        .into());
    }

    let stream = (config.stream_payments, stream_done());
    if stream.1 != stream.0 {
        return Err(format!(
            "only {} of the stream's {} payments were applied within two minutes",
            stream.1, stream.0
        )
        .into());
    }
    let rows = config.payments + config.stream_payments;
    let mut mismatches = check_ledger(database_url, &run_id, &expected, rows).await?;
    let events = check_events(&channel, watcher.name().as_str(), &run_id, config.payments).await?;
    let _ = connection.close(200, "checked".into()).await;
    mismatches.extend(events.mismatches.iter().cloned());
    Ok(DemoReport {
        published,
        stream,
        stats,
        consume_time,
        ledger_ok: mismatches.is_empty(),
        mismatches,
        events,
    })
}

/// Takes this run's events off the demo's watcher queue: each payment must have one,
/// and every copy of one payment's event the same message id.
async fn check_events(
    channel: &lapin::Channel,
    watcher: &str,
    run_id: &str,
    payments: usize,
) -> Result<EventsReport, DemoError> {
    use futures_util::StreamExt;
    let mut consumer = channel
        .basic_consume(
            watcher.into(),
            "idemq-demo-events".into(),
            lapin::options::BasicConsumeOptions { no_ack: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await?;
    let prefix = format!("demo-{run_id}-pay-");
    let mut ids: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    let mut copies = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.len() < payments && Instant::now() < deadline {
        let Ok(Some(delivery)) = tokio::time::timeout(Duration::from_secs(5), consumer.next()).await else {
            break;
        };
        let delivery = delivery?;
        let Ok(event) = serde_json::from_slice::<PaymentApplied>(&delivery.data) else { continue };
        if !event.payment_id.starts_with(&prefix) {
            continue;
        }
        copies += 1;
        let message_id =
            delivery.properties.message_id().as_ref().map(|id| id.to_string()).unwrap_or_default();
        ids.entry(event.payment_id).or_default().insert(message_id);
    }
    let mut mismatches = Vec::new();
    if ids.len() != payments {
        mismatches.push(format!("{} of this run's {payments} payments published their event", ids.len()));
    }
    let split = ids.values().filter(|ids| ids.len() != 1 || ids.iter().any(String::is_empty)).count();
    if split > 0 {
        mismatches.push(format!("{split} payments' events do not share one message id"));
    }
    Ok(EventsReport { copies, payments: ids.len(), mismatches })
}

/// Compares this run's ledger rows and balances with the expected sums.
async fn check_ledger(
    database_url: &str,
    run_id: &str,
    expected: &BTreeMap<String, i64>,
    payments: usize,
) -> Result<Vec<String>, DemoError> {
    let mut conn = idemq::connect::database(database_url).await?;
    let pattern = format!("demo-{run_id}-%");
    let rows: i64 =
        ledger::table.filter(ledger::payment_id.like(&pattern)).count().get_result(&mut conn).await?;
    let mut mismatches = Vec::new();
    if rows != payments as i64 {
        mismatches
            .push(format!("ledger has {rows} rows for this run, expected {payments} (one per payment)"));
    }
    let sums: Vec<(String, Option<diesel::data_types::PgNumeric>)> = ledger::table
        .filter(ledger::payment_id.like(&pattern))
        .group_by(ledger::account)
        .select((ledger::account, diesel::dsl::sum(ledger::amount_cents)))
        .load(&mut conn)
        .await?;
    let ledger_sums: BTreeMap<String, i64> =
        sums.into_iter().map(|(account, sum)| (account, sum.map_or(0, |n| numeric_to_i64(&n)))).collect();
    let balances: BTreeMap<String, i64> = accounts::table
        .filter(accounts::account.like(&pattern))
        .load::<(String, i64)>(&mut conn)
        .await?
        .into_iter()
        .collect();
    for (account, want) in expected {
        let in_ledger = ledger_sums.get(account).copied().unwrap_or(0);
        let balance = balances.get(account).copied().unwrap_or(0);
        if in_ledger != *want || balance != *want {
            mismatches.push(format!("{account}: expected {want}, ledger {in_ledger}, balance {balance}"));
        }
    }
    Ok(mismatches)
}

/// PostgreSQL's `sum(bigint)` is numeric; the demo's sums are whole numbers.
fn numeric_to_i64(n: &diesel::data_types::PgNumeric) -> i64 {
    use diesel::data_types::PgNumeric;
    let (negative, weight, digits) = match n {
        PgNumeric::Positive { weight, digits, .. } => (false, *weight, digits),
        PgNumeric::Negative { weight, digits, .. } => (true, *weight, digits),
        PgNumeric::NaN => return 0,
    };
    let mut value: i64 = 0;
    for i in 0..=i32::from(weight) {
        let digit = digits.get(i as usize).copied().unwrap_or(0);
        value = value * 10_000 + i64::from(digit);
    }
    if negative {
        -value
    } else {
        value
    }
}

impl std::fmt::Display for DemoReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.stats;
        let secs = self.consume_time.as_secs_f64();
        let total = s.applied + s.duplicates + s.dead_lettered;
        let (stream_published, stream_applied) = self.stream;
        writeln!(f, "published:           {}", self.published)?;
        writeln!(f, "applied:             {}", s.applied.saturating_sub(stream_applied as u64))?;
        writeln!(f, "duplicates skipped:  {}", s.duplicates)?;
        writeln!(f, "dead-lettered:       {}  (see queue payments.dlq)", s.dead_lettered)?;
        writeln!(f, "handler retries:     {}", s.retried)?;
        // The quick start's build is a debug build (it shares its dependencies with
        // `cargo test`'s): its rate is not idemq's, and the line says so.
        let build = if cfg!(debug_assertions) { "; a debug build: --release for idemq's rates" } else { "" };
        writeln!(f, "consumed in:         {secs:.2} s ({:.0} msg/s{build})", total as f64 / secs.max(1e-9))?;
        writeln!(
            f,
            "stream:              {stream_applied} of {stream_published} payments from {STREAM} applied once each (offset in the transaction, no dedup rows)"
        )?;
        writeln!(
            f,
            "events (outbox):     {} payments, {} events (one message_id each), also kept in {EVENTS_QUEUE}",
            self.events.payments, self.events.copies
        )?;
        if self.ledger_ok {
            write!(f, "ledger check:        OK (every payment applied exactly once; balances equal the sums)")
        } else {
            writeln!(f, "ledger check:        MISMATCH")?;
            for line in &self.mismatches {
                writeln!(f, "  {line}")?;
            }
            Ok(())
        }
    }
}
