//! What the bench prints: a row per run as it ends, then the medians, the ratios,
//! light-load latency, the RSS check and the verdict.

use serde::Serialize;

use crate::child::ChildReport;
use crate::config::Config;
use crate::contenders::Contender;
use crate::metrics::{median, Percentiles};
use crate::plan::{Load, Phase, RunResult};

/// How long the machine's load is sampled before the first run.
pub(crate) const IDLE_SAMPLE: std::time::Duration = std::time::Duration::from_secs(1);
/// Busier than this (a share of all cores) before the start, and the header warns.
const QUIET_BELOW: f64 = 0.10;

const COLUMNS: &str = "contender                 conc   deliv    secs  1st ms    msg/s   p50 ms   p99 ms  \
                       rss MiB  cpu us  all us   mq us   pg us  applied   dups  check";

pub(crate) fn header(config: &Config, postgres_version: &str, busy_before: Option<f64>) {
    let shape = config.shape;
    let deliveries = crate::workload::Workload::new("x", shape).deliveries();
    let cores = std::thread::available_parallelism().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    println!(
        "idemq bench: {} payments over {} accounts, {} published twice = {deliveries} deliveries per backlog run",
        shape.messages,
        shape.accounts,
        match shape.duplicates_every {
            0 => "no payment".to_owned(),
            1 => "every payment".to_owned(),
            k => format!("every {k}th"),
        },
    );
    println!("machine: {cores} cores, PostgreSQL {postgres_version}; persistent messages to quorum queues");
    if let Some(busy) = busy_before {
        let warning =
            if busy >= QUIET_BELOW { "  !!! other load is running: expect noisy numbers" } else { "" };
        println!(
            "machine busy before the start: {:.0}% of all cores over {IDLE_SAMPLE:?}{warning}",
            busy * 100.0
        );
    }
    println!("contenders, each in a child process of its own:");
    for contender in Contender::ALL {
        println!("  {:<18} {}", contender.name(), contender.describe());
    }
    println!("  … dups-only        the same backlog, every payment applied before the run");
    println!(
        "  … light            one message at a time (published, settled, the next); the child publishes \
         too, so its rows show latency only"
    );
    println!(
        "columns: msg/s = deliveries settled / secs (from the consumer's start, connects included, to the last \
         settlement); 1st ms = time to the first settlement;"
    );
    println!(
        "  p50/p99 = in-process latency, delivery received → settled (a backlog waits in the broker before \
         that); for light rows, end to end, publish → settled;"
    );
    println!(
        "  rss = the child's peak RSS (VmHWM); cpu us = the child's own CPU (user + sys) per delivery; all us = \
         the whole machine's busy CPU per delivery (broker, PostgreSQL and all);"
    );
    println!(
        "  mq us = the broker's CPU (beam.smp) per delivery; pg us = PostgreSQL's (every postgres process) per \
         delivery"
    );
}

pub(crate) fn sweep_header(sweep: &[usize]) {
    let list: Vec<String> = sweep.iter().map(usize::to_string).collect();
    println!("\n== baseline concurrency sweep: {} (one run each) ==\n{COLUMNS}", list.join(", "));
}

pub(crate) fn chosen_concurrency(config: &Config, concurrency: usize) {
    match config.baseline_concurrency {
        Some(_) => {
            println!("\nbaseline and idemq per-message concurrency: {concurrency} (--baseline-concurrency)")
        }
        None => println!("\nbaseline and idemq per-message concurrency: {concurrency} (the sweep's best)"),
    }
}

pub(crate) fn round_header(round: usize, rounds: usize) {
    println!("\n== round {round} of {rounds} ==\n{COLUMNS}");
}

pub(crate) fn rss_check_header(messages: usize) {
    println!("\n== peak RSS check: one backlog run per contender with {messages} payments ==\n{COLUMNS}");
}

fn num(value: Option<f64>, precision: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.precision$}"))
}

fn ms(percentile: Option<f64>) -> Option<f64> {
    percentile.map(|us| us / 1000.0)
}

fn mib(report: &ChildReport) -> Option<f64> {
    report.peak_rss_kib.map(|kib| kib as f64 / 1024.0)
}

fn per_delivery_us(report: &ChildReport, cpu_s: Option<f64>) -> Option<f64> {
    cpu_s.map(|s| s * 1e6 / report.counts.settled().max(1) as f64)
}

/// The latency a row shows: end to end for light load, in-process otherwise.
fn shown_latency(result: &RunResult, report: &ChildReport) -> Percentiles {
    match (result.run.load, report.end_to_end) {
        (Load::Light, Some(end_to_end)) => end_to_end,
        _ => report.latency,
    }
}

/// One run's row, printed as it ends; a failed check is also shouted on stderr.
pub(crate) fn row(result: &RunResult) {
    let run = &result.run;
    let conc = run.concurrency.map_or_else(|| "dflt".to_owned(), |c| c.to_string());
    let conc = if run.contender == Contender::Raw { "-".to_owned() } else { conc };
    let check = if result.ok() {
        let notes =
            if result.notes.is_empty() { String::new() } else { format!(" ({})", result.notes.join("; ")) };
        format!("ok{notes}")
    } else {
        format!("FAILED: {}", result.issues.join("; "))
    };
    let cells = match &result.report {
        None => format!(
            "{:>7} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6}",
            "-", "", "", "", "", "", "", "", "", "", "", "", ""
        ),
        Some(report) => {
            let latency = shown_latency(result, report);
            // A light-load child publishes too, and mostly waits: its rate, RSS and
            // CPU per message are not the consumer's.
            let backlog = run.load != Load::Light;
            let rate = backlog.then(|| report.rate());
            let rss = mib(report).filter(|_| backlog);
            let cpu = |cpu_s| per_delivery_us(report, cpu_s).filter(|_| backlog);
            let (applied, dups) = if run.contender.uses_database() {
                (report.counts.applied.to_string(), report.counts.duplicates.to_string())
            } else {
                ("-".to_owned(), "-".to_owned())
            };
            format!(
                "{:>7} {:>7.2} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6}",
                report.counts.settled(),
                report.elapsed_s,
                num(report.first_s.map(|s| s * 1000.0), 0),
                num(rate, 0),
                num(ms(latency.p50_us), 2),
                num(ms(latency.p99_us), 2),
                num(rss, 1),
                num(cpu(report.process_cpu_s), 0),
                num(cpu(report.machine_cpu_s), 0),
                num(cpu(report.broker_cpu_s), 0),
                num(cpu(report.postgres_cpu_s), 0),
                applied,
                dups,
            )
        }
    };
    println!("{:<24} {conc:>5} {cells}  {check}", run.label());
    if !result.ok() {
        eprintln!("!!! CHECK FAILED: {} ({:?}): {}", run.label(), result.phase, result.issues.join("; "));
    }
}

/// The passed runs of the rounds with this label.
fn rounds<'a>(results: &'a [RunResult], label: &str) -> Vec<&'a ChildReport> {
    results
        .iter()
        .filter(|r| matches!(r.phase, Phase::Round(_)) && r.run.label() == label)
        .filter_map(RunResult::passed)
        .collect()
}

fn median_of(reports: &[&ChildReport], metric: impl Fn(&ChildReport) -> Option<f64>) -> Option<f64> {
    median(reports.iter().filter_map(|&r| metric(r)))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn times(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "-".to_owned(), |r| format!("x{r:.2}"))
}

/// The backlog contenders of the summary: number (as in BENCHMARKS.md), label.
const BACKLOG: [(&str, &str); 13] = [
    ("1", "raw"),
    ("9", "broker-events"),
    ("10", "database"),
    ("11", "expert"),
    ("2", "baseline"),
    ("3", "idemq-per-message"),
    ("4", "idemq-group"),
    ("5", "idemq-lanes"),
    ("7", "idemq-outbox"),
    ("8", "idemq-batch"),
    ("12", "idemq-tuned"),
    ("6", "idemq-lanes dups-only"),
    ("", "baseline dups-only"),
];

/// The ratios of the summary: numbers, what, the two labels divided.
const RATIOS: [(&str, &str, &str, &str); 17] = [
    ("3/2", "idemq per-message / baseline", "idemq-per-message", "baseline"),
    ("4/2", "idemq group commit / baseline", "idemq-group", "baseline"),
    ("5/2", "idemq group commit + lanes / baseline", "idemq-lanes", "baseline"),
    ("4/1", "idemq group commit / raw broker", "idemq-group", "raw"),
    ("5/1", "idemq group commit + lanes / raw broker", "idemq-lanes", "raw"),
    ("6/5", "idemq-lanes: duplicates only / first deliveries", "idemq-lanes dups-only", "idemq-lanes"),
    ("7/5", "an outbox event per payment / idemq-lanes", "idemq-outbox", "idemq-lanes"),
    ("7/2", "idemq-lanes + outbox / baseline (no event)", "idemq-outbox", "baseline"),
    ("8/7", "batch handler / per-message (lanes, events)", "idemq-batch", "idemq-outbox"),
    ("8/2", "demo's apply_payment / baseline (no event)", "idemq-batch", "baseline"),
    ("8/9", "demo's apply_payment / the broker's ceiling", "idemq-batch", "broker-events"),
    ("8/10", "demo's apply_payment / the database's ceiling", "idemq-batch", "database"),
    ("8/11", "demo's apply_payment / the expert loop", "idemq-batch", "expert"),
    ("12/11", "idemq-batch at the expert's batch shape / expert", "idemq-tuned", "expert"),
    ("11/9", "the expert loop / the broker's ceiling", "expert", "broker-events"),
    ("11/10", "the expert loop / the database's ceiling", "expert", "database"),
    ("", "baseline: duplicates only / first deliveries", "baseline dups-only", "baseline"),
];

/// The light-load contenders of the summary.
const LIGHT: [&str; 4] = ["baseline", "idemq-per-message", "idemq-group", "idemq-lanes"];

/// One backlog row of the summary: the medians over the rounds' runs that passed
/// their checks. What the summary prints, the plot draws and the JSON holds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Medians {
    /// The contender's number in BENCHMARKS.md (empty for the baseline's dups-only row).
    pub(crate) number: &'static str,
    pub(crate) label: &'static str,
    /// `None`: no run of it passed.
    pub(crate) msg_per_s: Option<f64>,
    /// Each passed round's msg/s, in order.
    pub(crate) rounds_msg_per_s: Vec<f64>,
    /// In-process latency, received → settled.
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) rss_mib: Option<f64>,
    /// The child's own CPU per delivery.
    pub(crate) cpu_us: Option<f64>,
    /// The whole machine's busy CPU per delivery.
    pub(crate) all_us: Option<f64>,
    /// The broker's CPU per delivery.
    pub(crate) mq_us: Option<f64>,
    /// PostgreSQL's CPU per delivery.
    pub(crate) pg_us: Option<f64>,
}

/// The backlog rows of the summary, in its order.
pub(crate) fn medians(results: &[RunResult]) -> Vec<Medians> {
    BACKLOG
        .into_iter()
        .map(|(number, label)| {
            let reports = rounds(results, label);
            Medians {
                number,
                label,
                msg_per_s: median_of(&reports, |r| Some(r.rate())),
                rounds_msg_per_s: reports.iter().map(|r| r.rate()).collect(),
                p50_ms: ms(median_of(&reports, |r| r.latency.p50_us)),
                p99_ms: ms(median_of(&reports, |r| r.latency.p99_us)),
                rss_mib: median_of(&reports, mib),
                cpu_us: median_of(&reports, |r| per_delivery_us(r, r.process_cpu_s)),
                all_us: median_of(&reports, |r| per_delivery_us(r, r.machine_cpu_s)),
                mq_us: median_of(&reports, |r| per_delivery_us(r, r.broker_cpu_s)),
                pg_us: median_of(&reports, |r| per_delivery_us(r, r.postgres_cpu_s)),
            }
        })
        .collect()
}

/// A ratio of two rows' median msg/s.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Ratio {
    /// The rows' numbers (`5/2`; empty for the baseline's dups-only ratio).
    pub(crate) numbers: &'static str,
    pub(crate) what: &'static str,
    pub(crate) value: Option<f64>,
}

/// The summary's ratios of the median msg/s.
pub(crate) fn ratios(medians: &[Medians]) -> Vec<Ratio> {
    let rate = |label: &str| medians.iter().find(|m| m.label == label).and_then(|m| m.msg_per_s);
    RATIOS
        .into_iter()
        .map(|(numbers, what, a, b)| Ratio { numbers, what, value: ratio(rate(a), rate(b)) })
        .collect()
}

/// A light-load row: end-to-end latency, publish → settled, medians over the rounds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LightMedians {
    pub(crate) label: &'static str,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
}

/// The light-load rows (`None` everywhere without `--light`).
pub(crate) fn light_medians(results: &[RunResult]) -> Vec<LightMedians> {
    LIGHT
        .into_iter()
        .map(|label| {
            let reports = rounds(results, &format!("{label} light"));
            let end_to_end = |p: fn(&Percentiles) -> Option<f64>| {
                ms(median_of(&reports, |r| r.end_to_end.as_ref().and_then(p)))
            };
            LightMedians { label, p50_ms: end_to_end(|p| p.p50_us), p99_ms: end_to_end(|p| p.p99_us) }
        })
        .collect()
}

/// The medians, ratios, light-load latency, RSS check and verdict. `false` when a
/// check failed.
pub(crate) fn summary(config: &Config, concurrency: usize, results: &[RunResult]) -> bool {
    println!("\n== medians over {} rounds (runs whose checks failed are left out) ==", config.rounds);
    println!(
        "  # contender                    msg/s   p50 ms   p99 ms  rss MiB  cpu us  all us   mq us   pg us  runs (msg/s)\
         \n    (p50/p99: in-process, received → settled; baseline and per-message at concurrency {concurrency})"
    );
    let medians = medians(results);
    for row in &medians {
        let runs: Vec<String> = row.rounds_msg_per_s.iter().map(|rate| format!("{rate:.0}")).collect();
        println!(
            "{:>3} {:<24} {:>9} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7}  [{}]",
            row.number,
            row.label,
            num(row.msg_per_s, 0),
            num(row.p50_ms, 2),
            num(row.p99_ms, 2),
            num(row.rss_mib, 1),
            num(row.cpu_us, 0),
            num(row.all_us, 0),
            num(row.mq_us, 0),
            num(row.pg_us, 0),
            runs.join(", "),
        );
    }
    println!("\nratios of the median msg/s:");
    for ratio in ratios(&medians) {
        println!("  {:>5}  {:<48} {:>6}", ratio.numbers, ratio.what, times(ratio.value));
    }
    println!(
        "  events: the clock stops once every event is published too; medians of the time from the last \
         settled delivery until then:"
    );
    for label in Contender::ALL.into_iter().filter(|c| c.publishes_events()).map(Contender::name) {
        let lag = median_of(&rounds(results, label), |r| r.outbox_lag_s);
        println!("    {label}: {} s", num(lag, 3));
    }
    if config.light > 0 {
        light_summary(config, results);
    }
    let rss_ok = config.rss_check.is_none_or(|messages| rss_summary(config, messages, results));
    let failed = results.iter().filter(|r| !r.ok()).count();
    if failed == 0 && rss_ok {
        println!(
            "\ncorrectness: every run ok ({} runs, each ledger exact, every queue drained, no dead letters)",
            results.len()
        );
        true
    } else {
        println!(
            "\n!!! CORRECTNESS FAILED: {failed} of {} runs failed their checks (marked FAILED above){}",
            results.len(),
            if rss_ok { "" } else { "; peak RSS grows with the backlog" }
        );
        false
    }
}

fn light_summary(config: &Config, results: &[RunResult]) {
    let warmup = crate::plan::light_warmup(config.light);
    println!(
        "\nlight load: one message at a time, {} per run (the first {warmup} not counted); end-to-end latency, \
         publish → settled; medians over the rounds",
        config.light
    );
    println!("  contender                  p50 ms   p99 ms");
    let light = light_medians(results);
    for row in &light {
        println!("  {:<24} {:>8} {:>8}", row.label, num(row.p50_ms, 2), num(row.p99_ms, 2));
    }
    let of = |label: &str| light.iter().find(|row| row.label == label);
    let (group, single) = (of("idemq-group"), of("idemq-per-message"));
    println!(
        "  group commit / per-message: p50 {}, p99 {}",
        times(ratio(group.and_then(|r| r.p50_ms), single.and_then(|r| r.p50_ms))),
        times(ratio(group.and_then(|r| r.p99_ms), single.and_then(|r| r.p99_ms)))
    );
}

/// Peak RSS at `--rss-check` messages against the rounds'. `false` if it grew past
/// the tolerance for some contender.
fn rss_summary(config: &Config, messages: usize, results: &[RunResult]) -> bool {
    let tolerance = config.rss_tolerance_pct as f64 / 100.0;
    println!(
        "\npeak RSS against backlog size: {} payments (median of the rounds) vs {messages} (tolerance {}%)",
        config.shape.messages, config.rss_tolerance_pct
    );
    println!("  contender                 MiB small  MiB large   ratio  verdict");
    let mut ok = true;
    for contender in Contender::ALL.into_iter().filter(|contender| config.runs(contender.name())) {
        let small = median_of(&rounds(results, contender.name()), mib);
        let large = results
            .iter()
            .filter(|r| r.phase == Phase::RssCheck && r.run.contender == contender)
            .filter_map(RunResult::passed)
            .find_map(mib);
        let verdict = match (small, large) {
            (Some(small), Some(large)) if large <= small * (1.0 + tolerance) => "independent of the backlog",
            (Some(_), Some(_)) => {
                ok = false;
                "!!! GROWS with the backlog"
            }
            _ => {
                ok = false;
                "!!! not measured (a run failed)"
            }
        };
        println!(
            "  {:<24} {:>10} {:>10} {:>7}  {verdict}",
            contender.name(),
            num(small, 1),
            num(large, 1),
            times(ratio(large, small))
        );
    }
    ok
}
