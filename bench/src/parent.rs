//! The parent process: the plan of runs, and for each one a fresh queue, the
//! backlog published, the contender in a child process, the checks, the queues
//! deleted.

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use lapin::{Connection, ConnectionProperties};

use crate::check;
use crate::config::{ChildSpec, Config, LightSpec, Shape};
use crate::contenders::Contender;
use crate::metrics;
use crate::plan::{light_warmup, Load, Phase, Run, RunResult};
use crate::report;
use crate::results::{self, Results};
use crate::spawn;
use crate::urls::Urls;
use crate::workload::{publish, Leftovers, RunQueues, Workload};
use crate::BenchError;

/// The backlog contenders of a round, in order (the numbers of BENCHMARKS.md).
fn round_runs(concurrency: usize, shape: Shape) -> Vec<Run> {
    let run = |contender, load| Run::new(contender, load, concurrency, shape);
    vec![
        run(Contender::Raw, Load::Backlog),
        run(Contender::Baseline, Load::Backlog),
        run(Contender::IdemqPerMessage, Load::Backlog),
        run(Contender::IdemqGroup, Load::Backlog),
        run(Contender::IdemqLanes, Load::Backlog),
        run(Contender::IdemqOutbox, Load::Backlog),
        run(Contender::IdemqBatch, Load::Backlog),
        run(Contender::BrokerEvents, Load::Backlog),
        run(Contender::Database, Load::Backlog),
        run(Contender::Expert, Load::Backlog),
        run(Contender::IdemqTuned, Load::Backlog),
        run(Contender::IdemqLanes, Load::DuplicatesOnly),
        run(Contender::Baseline, Load::DuplicatesOnly),
    ]
}

/// The light-load contenders of a round.
fn light_runs(concurrency: usize, shape: Shape) -> Vec<Run> {
    [Contender::Baseline, Contender::IdemqPerMessage, Contender::IdemqGroup, Contender::IdemqLanes]
        .into_iter()
        .map(|contender| Run::new(contender, Load::Light, concurrency, shape))
        .collect()
}

/// The advisory lock a bench holds on its database for the whole invocation: two
/// benches on one database would truncate each other's tables mid-run.
const BENCH_LOCK: i64 = 0x6964_656d_715f_6265; // "idemq_be"

/// The whole program. `Ok(false)` when a check failed.
pub(crate) async fn run(config: &Config, urls: &Urls) -> Result<bool, BenchError> {
    if let Some(svg) = &config.plot {
        results::prepare(svg).map_err(|err| format!("--plot {}: {err}", svg.display()))?;
    }
    idemq_example_payments::migrate(&urls.database).await?;
    let mut bench = Bench {
        urls,
        admin: Connection::connect(&urls.amqp, ConnectionProperties::default()).await?,
        db: idemq::connect::database(&urls.database).await?,
        results: Vec::new(),
    };
    lock_database(&mut bench.db).await?;
    let busy_before = machine_busy(report::IDLE_SAMPLE).await;
    let postgres = bench.postgres_version().await?;
    report::header(config, &postgres, busy_before);
    // The sweep picks the baseline's concurrency, for the rows that take one.
    let takes_concurrency = ["baseline", "idemq-per-message", "baseline dups-only"];
    let concurrency = match config.baseline_concurrency {
        Some(concurrency) => concurrency,
        None if !takes_concurrency.iter().any(|label| config.runs(label)) => {
            idemq::RuntimeBuilder::DEFAULT_CONCURRENCY
        }
        None => bench.sweep(config).await?,
    };
    report::chosen_concurrency(config, concurrency);
    let light_shape = Shape { messages: config.light, duplicates_every: 0, accounts: config.shape.accounts };
    for round in 1..=config.rounds {
        report::round_header(round, config.rounds);
        for run in round_runs(concurrency, config.shape).into_iter().filter(|run| config.runs(&run.label())) {
            bench.measure(Phase::Round(round), run).await?;
        }
        if config.light > 0 {
            for run in light_runs(concurrency, light_shape) {
                bench.measure(Phase::Round(round), run).await?;
            }
        }
    }
    if let Some(messages) = config.rss_check {
        report::rss_check_header(messages);
        let shape = Shape { messages, ..config.shape };
        // The rounds' contenders only (`--only`): one not in the rounds has nothing to compare.
        let checked = round_runs(concurrency, shape)
            .into_iter()
            .filter(|run| run.load == Load::Backlog && config.runs(&run.label()));
        for run in checked {
            bench.measure(Phase::RssCheck, run).await?;
        }
    }
    bench.curves(&results::Context { config, concurrency, postgres: &postgres, busy_before }).await?;
    let _ = bench.admin.close(200, "bench done".into()).await;
    let ok = report::summary(config, concurrency, &bench.results);
    if let Some(svg) = &config.plot {
        let context = results::Context { config, concurrency, postgres: &postgres, busy_before };
        let json = Results::collect(&context, &bench.results)
            .write(svg)
            .map_err(|err| format!("writing the plot to {}: {err}", svg.display()))?;
        println!("\nplot: {} (the medians above), results: {}", svg.display(), json.display());
    }
    Ok(ok)
}

/// Takes [`BENCH_LOCK`] on `db`'s session, waiting (and saying so) while another
/// bench holds it.
async fn lock_database(db: &mut AsyncPgConnection) -> Result<(), BenchError> {
    #[derive(diesel::QueryableByName)]
    struct Locked {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        locked: bool,
    }
    let query = format!("SELECT pg_try_advisory_lock({BENCH_LOCK}) AS locked");
    let tried: Locked = diesel::sql_query(query).get_result(db).await?;
    if !tried.locked {
        eprintln!("bench: another bench is running on this database; waiting until it ends");
        db.batch_execute(&format!("SELECT pg_advisory_lock({BENCH_LOCK})")).await?;
    }
    Ok(())
}

/// The share of all cores the machine is busy over `sample` (from `/proc/stat`).
async fn machine_busy(sample: std::time::Duration) -> Option<f64> {
    let start = metrics::machine_cpu();
    tokio::time::sleep(sample).await;
    let busy = metrics::since(metrics::machine_cpu(), start)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    Some(busy.as_secs_f64() / (sample.as_secs_f64() * cores as f64))
}

struct Bench<'a> {
    urls: &'a Urls,
    /// Declares, publishes and deletes the runs' queues.
    admin: Connection,
    /// Resets and checks the ledger.
    db: AsyncPgConnection,
    results: Vec<RunResult>,
}

impl Bench<'_> {
    async fn postgres_version(&mut self) -> Result<String, BenchError> {
        #[derive(diesel::QueryableByName)]
        struct Version {
            #[diesel(sql_type = diesel::sql_types::Text)]
            server_version: String,
        }
        let version: Version = diesel::sql_query("SHOW server_version").get_result(&mut self.db).await?;
        Ok(version.server_version)
    }

    /// The baseline at each of `config.sweep`, one run each; the best rate wins
    /// (among runs whose checks passed, if any did).
    async fn sweep(&mut self, config: &Config) -> Result<usize, BenchError> {
        report::sweep_header(&config.sweep);
        let first = self.results.len();
        for &concurrency in &config.sweep {
            self.measure(
                Phase::Sweep,
                Run::new(Contender::Baseline, Load::Backlog, concurrency, config.shape),
            )
            .await?;
        }
        let swept = &self.results[first..];
        let rate = |r: &&RunResult| r.report.as_ref().map_or(0.0, |report| report.rate());
        let best = swept.iter().filter(|r| r.ok()).max_by(|a, b| rate(a).total_cmp(&rate(b)));
        let best = best.or_else(|| swept.iter().max_by(|a, b| rate(a).total_cmp(&rate(b))));
        Ok(best.and_then(|r| r.run.concurrency).unwrap_or(idemq::RuntimeBuilder::DEFAULT_CONCURRENCY))
    }

    /// One run, start to finish; its result is printed and kept. An error here is
    /// the bench's own (database or broker unreachable), not the contender's.
    async fn measure(&mut self, phase: Phase, run: Run) -> Result<(), BenchError> {
        self.reconnect_if_lost().await?;
        self.reset().await?;
        let run_id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let workload = Workload::new(&run_id, run.shape);
        let mut result = RunResult { phase, run, report: None, issues: Vec::new(), notes: Vec::new() };
        if run.load == Load::DuplicatesOnly {
            result.issues.extend(self.prime(&run_id, &workload).await?);
        }
        if result.ok() {
            let mut queues = RunQueues::new(format!("idemq-bench-{run_id}"), run.contender.is_idemq());
            if run.contender.events().is_some() {
                queues = queues.with_events();
            }
            queues.declare(&self.admin).await?;
            let report = self.consume(&run, &run_id, &workload, &queues).await;
            let left = self.delete(&queues).await?;
            result.issues.extend(check::leftovers(&left));
            result.issues.extend(check::events(&left, &workload, run.contender.events()));
            match report {
                Ok(report) => {
                    result.issues.extend(check::counts(&run, &workload, &report));
                    if report.infrastructure_retries > 0 {
                        result.notes.push(format!("{} in-process db retries", report.infrastructure_retries));
                    }
                    result.report = Some(report);
                }
                Err(err) => result.issues.push(err),
            }
            if run.contender.uses_database() {
                self.reconnect_if_lost().await?;
                result.issues.extend(check::ledger(&mut self.db, &workload).await?);
            }
        }
        report::row(&result);
        self.results.push(result);
        Ok(())
    }

    /// Publishes the backlog (not for light load, whose child publishes its own)
    /// and runs the contender's child on it.
    async fn consume(
        &self,
        run: &Run,
        run_id: &str,
        workload: &Workload,
        queues: &RunQueues,
    ) -> Result<crate::child::ChildReport, String> {
        let light = (run.load == Load::Light).then(|| LightSpec {
            run_id: run_id.to_owned(),
            messages: run.shape.messages,
            accounts: run.shape.accounts,
            warmup: light_warmup(run.shape.messages),
        });
        if light.is_none() {
            self.publish(queues.name(), workload.bodies()).await.map_err(|err| format!("publish: {err}"))?;
        }
        let spec = ChildSpec {
            contender: run.contender,
            queue: queues.name().to_owned(),
            concurrency: run.concurrency,
            expect: workload.deliveries(),
            light,
        };
        spawn::child(&spec, self.urls).await
    }

    async fn publish<'b>(
        &self,
        queue: &str,
        bodies: impl Iterator<Item = &'b [u8]>,
    ) -> Result<(), BenchError> {
        let channel = self.admin.create_channel().await?;
        publish(&channel, queue, bodies).await?;
        let _ = channel.close(200, "published".into()).await;
        Ok(())
    }

    /// Applies every payment of `workload` once, before a duplicates-only run: idemq
    /// with `apply_payment` (so the dedup rows carry idemq's fingerprints) on a queue
    /// of its own, in a child. Returns what went wrong, if anything.
    async fn prime(&mut self, run_id: &str, workload: &Workload) -> Result<Vec<String>, BenchError> {
        let queues = RunQueues::new(format!("idemq-bench-{run_id}-prime"), true);
        queues.declare(&self.admin).await?;
        let primed = async {
            self.publish(queues.name(), workload.distinct_bodies()).await.map_err(|err| err.to_string())?;
            let spec = ChildSpec {
                contender: Contender::IdemqLanes,
                queue: queues.name().to_owned(),
                concurrency: None,
                expect: workload.distinct(),
                light: None,
            };
            spawn::child(&spec, self.urls).await
        }
        .await;
        let mut issues = check::leftovers(&self.delete(&queues).await?);
        match primed {
            Ok(report) if report.counts.applied == workload.distinct() => {}
            Ok(report) => {
                issues.push(format!("priming applied {} of {}", report.counts.applied, workload.distinct()))
            }
            Err(err) => issues.push(format!("priming failed: {err}")),
        }
        self.reconnect_if_lost().await?;
        issues.extend(check::ledger(&mut self.db, workload).await?);
        self.checkpoint().await?;
        Ok(issues.into_iter().map(|issue| format!("priming: {issue}")).collect())
    }

    /// Connects again to a broker or database that went away (someone restarted
    /// it) since the last run, or during a run before its check: the contender has
    /// been judged by its own counts, and the ledger check reads what committed.
    async fn reconnect_if_lost(&mut self) -> Result<(), BenchError> {
        if !self.admin.status().connected() {
            eprintln!("bench: the broker connection was lost; connecting again");
            self.admin = Connection::connect(&self.urls.amqp, ConnectionProperties::default()).await?;
        }
        if self.db.batch_execute("SELECT 1").await.is_err() {
            eprintln!("bench: the database connection was lost; connecting again");
            self.db = idemq::connect::database(&self.urls.database).await?;
            lock_database(&mut self.db).await?;
        }
        Ok(())
    }

    /// Deletes a run's queues, on a new broker connection if the old one was lost
    /// during the run.
    async fn delete(&mut self, queues: &RunQueues) -> Result<Leftovers, BenchError> {
        match queues.delete(&self.admin).await {
            Ok(left) => Ok(left),
            Err(err) if !self.admin.status().connected() => {
                eprintln!(
                    "bench: the broker connection was lost during the run ({}); connecting again",
                    idemq::connect::redact(&err.to_string())
                );
                self.admin = Connection::connect(&self.urls.amqp, ConnectionProperties::default()).await?;
                queues.delete(&self.admin).await
            }
            Err(err) => Err(err),
        }
    }

    /// Empties the tables, so no run inherits another's work, and flushes dirty pages.
    async fn reset(&mut self) -> Result<(), BenchError> {
        self.db
            .batch_execute(
                "TRUNCATE ledger, accounts, idemq_dedup, idemq_started, idemq_copies, idemq_outbox",
            )
            .await?;
        self.checkpoint().await
    }

    async fn checkpoint(&mut self) -> Result<(), BenchError> {
        self.db.batch_execute("CHECKPOINT").await?;
        Ok(())
    }
}

impl Bench<'_> {
    /// The curves of `--curve-backlog` and `--curve-concurrency` ([`crate::curves`]):
    /// each one's runs, then its chart and JSON beside `--plot`'s.
    async fn curves(&mut self, context: &results::Context<'_>) -> Result<(), BenchError> {
        use crate::curves::{self, CurveResults};
        for curve in crate::plan::Curve::ALL {
            let runs = curves::runs(context.config, curve, context.concurrency, round_runs);
            let Some(plot) = context.config.plot.as_deref().filter(|_| !runs.is_empty()) else { continue };
            curves::header(curve, context.config);
            for run in runs {
                self.measure(Phase::Curve(curve), run).await?;
            }
            let svg = curves::path(plot, curve);
            let json = CurveResults::collect(context, curve, &self.results)
                .write(&svg)
                .map_err(|err| format!("writing the {} curve to {}: {err}", curve.name(), svg.display()))?;
            println!(
                "\ncurve: {} (msg/s against {}), results: {}",
                svg.display(),
                curve.name(),
                json.display()
            );
        }
        Ok(())
    }
}
