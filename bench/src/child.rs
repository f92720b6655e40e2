//! A child process, `bench --child <contender> …`: one contender on one queue, in a
//! process of its own so that its peak RSS and CPU time are its own. It reports as
//! one JSON line on stdout ([`ChildReport`]); errors go to stderr with exit code 1.
//!
//! - Backlog run: the parent has published the whole backlog; the clock runs from
//!   the consumer's start (its connects included) until `--expect` deliveries are
//!   settled.
//! - Light load (`--light`): the child starts the consumer, waits until the broker
//!   lists it, then publishes one message at a time and waits until it is settled
//!   before publishing the next; end-to-end latency is publish → settled.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};

use crate::config::{ChildSpec, LightSpec, Shape};
use crate::contenders::Consumer;
use crate::metrics::{self, Counts, Histogram, Percentiles, Recorder};
use crate::urls::Urls;
use crate::workload::{confirmed, properties, Workload, PUBLISH};
use crate::BenchError;

/// A backlog not settled by then is a failure, not a slow result.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a consumer may take to drain and close once everything is settled
/// (outside the measured time); past it the run is flagged and the consumer aborted.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the settled count is polled during a backlog run (the clock's resolution).
const POLL: Duration = Duration::from_millis(2);
/// Light load: how long one message may take to settle, and the consumer to appear.
const LIGHT_TIMEOUT: Duration = Duration::from_secs(30);

/// What a child measured, as it prints it (one JSON line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildReport {
    pub(crate) counts: Counts,
    /// Transactions retried in-process after a database fault (idemq only).
    pub(crate) infrastructure_retries: u64,
    /// From the consumer's start to its first settled delivery.
    pub(crate) first_s: Option<f64>,
    /// The measured time: from the consumer's start to the last settled delivery.
    pub(crate) elapsed_s: f64,
    /// This process's CPU time (user + system) over the measured time.
    pub(crate) process_cpu_s: Option<f64>,
    /// The whole machine's busy CPU time over the measured time (all cores).
    pub(crate) machine_cpu_s: Option<f64>,
    /// The broker's CPU time over the measured time (`beam.smp`).
    #[serde(default)]
    pub(crate) broker_cpu_s: Option<f64>,
    /// PostgreSQL's CPU time over the measured time (every `postgres` process).
    #[serde(default)]
    pub(crate) postgres_cpu_s: Option<f64>,
    /// In-process latency: delivery received → settled.
    pub(crate) latency: Percentiles,
    /// Light load only: publish → settled.
    pub(crate) end_to_end: Option<Percentiles>,
    /// `VmHWM` at the end of the run.
    pub(crate) peak_rss_kib: Option<u64>,
    /// Whether the consumer drained and closed within [`SHUTDOWN_TIMEOUT`].
    pub(crate) drained: bool,
    /// The outbox contender: from the last settled delivery until the relay had
    /// published every event (`None`: not an outbox run, or it never emptied).
    #[serde(default)]
    pub(crate) outbox_lag_s: Option<f64>,
}

impl ChildReport {
    pub(crate) fn rate(&self) -> f64 {
        self.counts.settled() as f64 / self.elapsed_s.max(1e-9)
    }
}

/// Runs the child named by `args` (what follows `--child`).
pub(crate) async fn main(args: &[String], urls: &Urls) -> ExitCode {
    let spec = match ChildSpec::parse(args) {
        Ok(spec) => spec,
        Err(err) => {
            eprintln!("bench --child: {err}");
            return ExitCode::from(2);
        }
    };
    let report = match &spec.light {
        None => backlog(&spec, urls).await,
        Some(light) => light_load(&spec, light, urls).await,
    };
    match report.and_then(|report| Ok(serde_json::to_string(&report)?)) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            // Each cause once; driver errors may quote a URL, password and all.
            eprintln!("bench --child {}: {}", spec.contender.name(), idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

/// The measured time and the CPU used over it.
struct Clock {
    started: Instant,
    process: Option<Duration>,
    machine: Option<Duration>,
    /// The broker's and PostgreSQL's.
    services: (Option<Duration>, Option<Duration>),
}

impl Clock {
    fn start() -> Self {
        Self {
            started: Instant::now(),
            process: metrics::process_cpu(),
            machine: metrics::machine_cpu(),
            services: metrics::services_cpu(),
        }
    }
}

/// The measured window, read off a [`Clock`] when the last delivery settled.
struct Window {
    elapsed: Duration,
    process: Option<Duration>,
    machine: Option<Duration>,
    broker: Option<Duration>,
    postgres: Option<Duration>,
}

impl Clock {
    fn stop(&self) -> Window {
        let (broker, postgres) = metrics::services_cpu();
        Window {
            elapsed: self.started.elapsed(),
            process: metrics::since(metrics::process_cpu(), self.process),
            machine: metrics::since(metrics::machine_cpu(), self.machine),
            broker: metrics::since(broker, self.services.0),
            postgres: metrics::since(postgres, self.services.1),
        }
    }
}

async fn start(spec: &ChildSpec, urls: &Urls) -> Result<(Arc<Recorder>, Clock, Consumer), BenchError> {
    let recorder = Arc::new(Recorder::new());
    let prepared = spec.contender.prepare(urls, &spec.queue, spec.expect).await?;
    let clock = Clock::start();
    let consumer =
        spec.contender.start(urls, &spec.queue, spec.concurrency, prepared, Arc::clone(&recorder)).await?;
    Ok((recorder, clock, consumer))
}

/// A backlog run: wait until `spec.expect` deliveries are settled.
async fn backlog(spec: &ChildSpec, urls: &Urls) -> Result<ChildReport, BenchError> {
    let (recorder, clock, consumer) = start(spec, urls).await?;
    let mut first = None;
    loop {
        let settled = recorder.counts().settled();
        if settled > 0 && first.is_none() {
            first = Some(clock.started.elapsed());
        }
        if settled >= spec.expect || consumer.is_finished() || clock.started.elapsed() >= RUN_TIMEOUT {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    // A contender that publishes events is done when the last one is out: a
    // publisher lagging behind its acks must not move work out of the window.
    let outbox_lag =
        if spec.contender.publishes_events() { outbox_drained(urls, Instant::now()).await? } else { None };
    let window = clock.stop();
    let mut report = finish(spec, &recorder, consumer, window, first, None).await?;
    report.outbox_lag_s = outbox_lag.map(|lag| lag.as_secs_f64());
    Ok(report)
}

/// Waits (at most [`RUN_TIMEOUT`]) until the outbox is empty; the time since `since`.
///
/// Asked as "is there a row left", the oldest by the primary key: a probe of the
/// index, not a count of the backlog. Counting every [`POLL`] took a scan of the
/// outbox each time (1.6 ms at 20,000 rows), the database's CPU taken from the
/// publisher being measured — the more, the longer it lagged.
async fn outbox_drained(urls: &Urls, since: Instant) -> Result<Option<Duration>, BenchError> {
    use diesel::{OptionalExtension, QueryDsl};
    use diesel_async::RunQueryDsl;
    use idemq::store::schema::idemq_outbox;

    let mut conn = idemq::connect::database(&urls.database).await?;
    while since.elapsed() < RUN_TIMEOUT {
        let oldest = idemq_outbox::table.select(idemq_outbox::id).order(idemq_outbox::id).limit(1);
        if oldest.get_result::<i64>(&mut conn).await.optional()?.is_none() {
            return Ok(Some(since.elapsed()));
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(None)
}

/// A light-load run: publish one message, wait until it is settled, the next.
async fn light_load(spec: &ChildSpec, light: &LightSpec, urls: &Urls) -> Result<ChildReport, BenchError> {
    let shape = Shape { messages: light.messages, duplicates_every: 0, accounts: light.accounts };
    let workload = Workload::new(&light.run_id, shape);
    let (recorder, clock, consumer) = start(spec, urls).await?;
    let publisher = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
    let channel = publisher.create_channel().await?;
    wait_until_consumed(&channel, &spec.queue).await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let end_to_end = Histogram::new();
    let props = properties();
    for (i, body) in workload.bodies().enumerate() {
        let published = Instant::now();
        let confirm = channel
            .basic_publish("".into(), spec.queue.as_str().into(), PUBLISH, body, props.clone())
            .await?;
        let settled = recorder
            .settled_at(i as u64 + 1, LIGHT_TIMEOUT)
            .await
            .ok_or_else(|| format!("message {} was not settled within {LIGHT_TIMEOUT:?}", i + 1))?;
        confirmed(confirm.await?)?;
        if i >= light.warmup {
            end_to_end.record(settled.saturating_duration_since(published));
        }
    }
    let window = clock.stop();
    let _ = publisher.close(200, "published".into()).await;
    finish(spec, &recorder, consumer, window, None, Some(end_to_end.percentiles())).await
}

/// Waits until the broker lists a consumer on `queue`.
async fn wait_until_consumed(channel: &lapin::Channel, queue: &str) -> Result<(), BenchError> {
    let deadline = Instant::now() + LIGHT_TIMEOUT;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    while channel.queue_declare(queue.into(), passive, FieldTable::default()).await?.consumer_count() == 0 {
        if Instant::now() >= deadline {
            return Err(format!("no consumer on {queue} after {LIGHT_TIMEOUT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Stops the consumer and puts the report together.
async fn finish(
    spec: &ChildSpec,
    recorder: &Recorder,
    consumer: Consumer,
    window: Window,
    first: Option<Duration>,
    end_to_end: Option<Percentiles>,
) -> Result<ChildReport, BenchError> {
    let infrastructure_retries = consumer.infrastructure_retries();
    let drained = consumer.shutdown(SHUTDOWN_TIMEOUT).await?;
    let counts = recorder.counts();
    if counts.settled() < spec.expect {
        return Err(format!(
            "only {} of {} deliveries settled in {:.1} s ({} returned to the queue)",
            counts.settled(),
            spec.expect,
            window.elapsed.as_secs_f64(),
            counts.returned
        )
        .into());
    }
    Ok(ChildReport {
        counts,
        infrastructure_retries,
        first_s: first.map(|d| d.as_secs_f64()),
        elapsed_s: window.elapsed.as_secs_f64(),
        process_cpu_s: window.process.map(|d| d.as_secs_f64()),
        machine_cpu_s: window.machine.map(|d| d.as_secs_f64()),
        broker_cpu_s: window.broker.map(|d| d.as_secs_f64()),
        postgres_cpu_s: window.postgres.map(|d| d.as_secs_f64()),
        latency: recorder.latency(),
        end_to_end,
        peak_rss_kib: metrics::peak_rss_kib(),
        drained,
        outbox_lag_s: None,
    })
}
