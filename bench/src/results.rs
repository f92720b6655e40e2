//! What a run leaves behind besides its printed tables (`--plot PATH`): the medians
//! of its backlog contenders as a bar chart (SVG, at `PATH`) and, with the ratios,
//! the light-load latency and the configuration, as JSON beside it (`PATH` with
//! `.json`). Both are filled from the run's results by the functions that print the
//! summary ([`report::medians`], [`report::ratios`]), so they hold the numbers the
//! summary printed, and nothing typed in. The curves of `--curve-backlog` and
//! `--curve-concurrency` go beside them ([`crate::curves`]), with the same
//! [`Provenance`] and written by the same [`write`].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::config::Config;
use crate::plan::RunResult;
use crate::plot::{thousands, Bar, BarChart, Series};
use crate::report::{self, LightMedians, Medians, Ratio};

/// What the JSON file holds.
#[derive(Debug, Serialize)]
pub(crate) struct Results {
    #[serde(flatten)]
    pub(crate) made: Provenance,
    pub(crate) config: Settings,
    /// The backlog contenders, medians over the rounds' runs that passed.
    pub(crate) contenders: Vec<Medians>,
    pub(crate) ratios: Vec<Ratio>,
    /// Light load, end to end (empty with `--light 0`).
    pub(crate) light: Vec<LightMedians>,
    /// Runs in all (sweep, rounds, RSS check, curves), and those that failed their checks.
    pub(crate) runs: usize,
    pub(crate) failed_runs: usize,
}

/// The configuration a run had.
#[derive(Debug, Serialize)]
pub(crate) struct Settings {
    pub(crate) messages: usize,
    pub(crate) duplicates_every: usize,
    pub(crate) accounts: usize,
    /// Deliveries per backlog run (payments and their duplicates).
    pub(crate) deliveries: u64,
    pub(crate) rounds: usize,
    /// The baseline's and per-message mode's concurrency, and where it came from
    /// (`--baseline-concurrency` or `sweep`).
    pub(crate) concurrency: usize,
    pub(crate) concurrency_from: &'static str,
    pub(crate) sweep: Vec<usize>,
    pub(crate) light: usize,
    pub(crate) rss_check: Option<usize>,
}

/// Where it ran.
#[derive(Debug, Serialize)]
pub(crate) struct Machine {
    pub(crate) cores: Option<usize>,
    pub(crate) postgres: String,
    /// The share of all cores busy in the second before the first run.
    pub(crate) busy_before: Option<f64>,
}

/// When, from which code, with which flags and where a run was made: the first
/// fields of every JSON file the bench writes, and a line of every chart.
#[derive(Debug, Serialize)]
pub(crate) struct Provenance {
    /// When the run ended, UTC, ISO 8601.
    pub(crate) date: String,
    /// `git rev-parse HEAD` in the bench's checkout; `None` if git did not answer.
    pub(crate) commit: Option<String>,
    /// Whether tracked files of the checkout differed from `commit` (`git status`);
    /// the bench's own code may or may not be among them.
    pub(crate) modified: Option<bool>,
    /// The flags the bench was started with.
    pub(crate) args: Vec<String>,
    pub(crate) machine: Machine,
}

/// What the parent knows besides the results.
pub(crate) struct Context<'a> {
    pub(crate) config: &'a Config,
    pub(crate) concurrency: usize,
    pub(crate) postgres: &'a str,
    pub(crate) busy_before: Option<f64>,
}

impl Provenance {
    /// Now, this checkout, this process's flags, this machine.
    pub(crate) fn collect(context: &Context<'_>) -> Self {
        Self {
            date: utc(SystemTime::now()),
            commit: git(&["rev-parse", "HEAD"]).map(|out| out.trim().to_owned()),
            modified: git(&["status", "--porcelain", "--untracked-files=no"])
                .map(|out| !out.trim().is_empty()),
            args: std::env::args().skip(1).collect(),
            machine: Machine {
                cores: std::thread::available_parallelism().ok().map(usize::from),
                postgres: context.postgres.to_owned(),
                busy_before: context.busy_before,
            },
        }
    }

    /// A chart's line: `2026-12-04 19:06 UTC · commit 0123456 · 2 cores · PostgreSQL 15.20`.
    pub(crate) fn line(&self) -> String {
        let commit = match (&self.commit, self.modified) {
            (Some(commit), Some(true)) => format!("commit {} (modified)", &commit[..commit.len().min(7)]),
            (Some(commit), _) => format!("commit {}", &commit[..commit.len().min(7)]),
            (None, _) => "commit unknown".to_owned(),
        };
        let cores = self.machine.cores.map_or_else(|| "? cores".to_owned(), |n| format!("{n} cores"));
        // `SHOW server_version` may add the distribution's build: "15.20 (Debian …)".
        let postgres = self.machine.postgres.split_whitespace().next().unwrap_or("?");
        let minute = self.date.get(..16).unwrap_or(&self.date).replace('T', " ");
        format!("{minute} UTC · {commit} · {cores} · PostgreSQL {postgres}")
    }

    /// A run's, for tests.
    #[cfg(test)]
    pub(crate) fn example() -> Self {
        Self {
            date: "2026-12-04T19:00:00Z".into(),
            commit: Some("0123456789abcdef".into()),
            modified: Some(false),
            args: vec!["--rounds".into(), "1".into()],
            machine: Machine {
                cores: Some(2),
                postgres: "15.20 (Debian 15.20-0+deb12u1)".into(),
                busy_before: Some(0.5),
            },
        }
    }

    /// A chart's last note: the command that made it.
    pub(crate) fn made_by(&self) -> String {
        format!("Made by: cargo run --release -p idemq-bench -- {}", self.args.join(" "))
    }
}

/// What a contender is, in the charts: a ceiling (no database, or no broker), a
/// hand-written loop, or idemq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// What the machine allows without a part of the work: the broker's ceilings
    /// (`raw`, `broker-events`) and the database's (`database`).
    Ceiling,
    /// A loop written by hand, ack after COMMIT (`baseline`, `expert`).
    HandWritten,
    /// One of idemq's modes.
    Idemq,
}

impl Kind {
    /// The kind of the contender of a run labelled `label` (`baseline dups-only`).
    pub(crate) fn of(label: &str) -> Self {
        match label.split(' ').next() {
            Some("raw" | "broker-events" | "database") => Self::Ceiling,
            Some("baseline" | "expert") => Self::HandWritten,
            _ => Self::Idemq,
        }
    }
}

/// Where a chart's value axis ends, given each value and whether it is a
/// ceiling's: `None` (at the highest value) unless a ceiling is over twice as high as
/// every other value; then at the highest value within twice the others', and the
/// values past it are cut there (the raw broker's, tens of times the others').
pub(crate) fn axis_end(values: impl IntoIterator<Item = (bool, f64)>) -> Option<f64> {
    let values: Vec<(bool, f64)> = values.into_iter().filter(|(_, value)| value.is_finite()).collect();
    let others = values.iter().filter(|(ceiling, _)| !ceiling).map(|&(_, value)| value).fold(0.0, f64::max);
    let highest = values.iter().map(|&(_, value)| value).fold(0.0, f64::max);
    (others > 0.0 && highest > 2.0 * others).then(|| {
        values.iter().map(|&(_, value)| value).filter(|&value| value <= 2.0 * others).fold(0.0, f64::max)
    })
}

/// How a chart says which payments are published twice: `every 10th twice`.
pub(crate) fn duplicates(every: usize) -> String {
    match every {
        0 => "no duplicates".to_owned(),
        1 => "every payment twice".to_owned(),
        k => format!("every {k}th twice"),
    }
}

/// A chart's line of checks: all passed, or how many failed (and are left out).
pub(crate) fn checks(runs: usize, failed: usize) -> String {
    match failed {
        0 => format!("All {runs} runs passed their checks"),
        n => format!("{n} of {runs} runs FAILED their checks and are left out"),
    }
}

impl Results {
    /// The results of a finished run.
    pub(crate) fn collect(context: &Context<'_>, results: &[RunResult]) -> Self {
        let config = context.config;
        let contenders = report::medians(results);
        Self {
            made: Provenance::collect(context),
            config: Settings {
                messages: config.shape.messages,
                duplicates_every: config.shape.duplicates_every,
                accounts: config.shape.accounts,
                deliveries: crate::workload::Workload::new("x", config.shape).deliveries(),
                rounds: config.rounds,
                concurrency: context.concurrency,
                concurrency_from: match config.baseline_concurrency {
                    Some(_) => "--baseline-concurrency",
                    None => "sweep",
                },
                sweep: config.sweep.clone(),
                light: config.light,
                rss_check: config.rss_check,
            },
            ratios: report::ratios(&contenders),
            contenders,
            light: if config.light > 0 { report::light_medians(results) } else { Vec::new() },
            runs: results.len(),
            failed_runs: results.iter().filter(|r| !r.ok()).count(),
        }
    }

    /// The chart: a bar per backlog contender that has a median, its ratio to the
    /// baseline beside it. The raw broker's bar, tens of times the others, is cut
    /// at the axis's end ([`axis_end`]), so that the others stay readable.
    pub(crate) fn chart(&self) -> BarChart {
        const REFERENCE: usize = 0;
        const BASELINE: usize = 1;
        const IDEMQ: usize = 2;
        let series = vec![
            Series { name: "ceilings: no database, or no broker".into(), colour: "#8c959f" },
            Series { name: "hand-written loops, ack after COMMIT".into(), colour: "#bf8700" },
            Series { name: "idemq".into(), colour: "#0969da" },
        ];
        let bars: Vec<Bar> = self
            .contenders
            .iter()
            .filter_map(|row| {
                let series = match Kind::of(row.label) {
                    Kind::Ceiling => REFERENCE,
                    Kind::HandWritten => BASELINE,
                    Kind::Idemq => IDEMQ,
                };
                let label = match row.number {
                    "" => row.label.to_owned(),
                    number => format!("{number} {}", row.label),
                };
                Some(Bar { label, value: row.msg_per_s?, series })
            })
            .collect();
        let axis_max = axis_end(bars.iter().map(|bar| (bar.series == REFERENCE, bar.value)));
        let baseline = self
            .contenders
            .iter()
            .filter(|row| row.msg_per_s.is_some())
            .position(|row| row.label == "baseline");

        let settings = &self.config;
        let rounds = match settings.rounds {
            1 => "1 round".to_owned(),
            n => format!("median of {n} rounds"),
        };
        let checks = checks(self.runs, self.failed_runs);
        let notes = vec![
            format!(
                "×: median msg/s against 2 baseline, in the same invocation; 2 and 3 at concurrency {}. {checks} \
                 (ledger exact, queues drained).",
                settings.concurrency
            ),
            "Compare the ratios: the broker and PostgreSQL share the machine's cores, so absolute figures move \
             between runs."
                .to_owned(),
            self.made.made_by(),
        ];
        BarChart {
            title: "idemq on the payments workload: deliveries settled per second".into(),
            lines: vec![
                format!(
                    "{} payments over {} accounts, {}: {} deliveries per run, all queued first",
                    thousands(settings.messages as f64),
                    thousands(settings.accounts as f64),
                    duplicates(settings.duplicates_every),
                    thousands(settings.deliveries as f64),
                ),
                format!("{} · {rounds}", self.made.line()),
            ],
            series,
            bars,
            unit: "msg/s".into(),
            baseline,
            axis_max,
            axis_title: format!("msg/s: deliveries settled / seconds from the consumer's start ({rounds})"),
            notes,
        }
    }

    /// Writes the chart to `svg` and the JSON beside it; returns the JSON's path.
    pub(crate) fn write(&self, svg: &Path) -> std::io::Result<PathBuf> {
        write(svg, &self.chart().svg(), self)
    }
}

/// Writes a chart's `image` to `svg` and `results` as JSON beside it (`svg` with
/// `.json`); returns the JSON's path.
pub(crate) fn write(svg: &Path, image: &str, results: &impl Serialize) -> std::io::Result<PathBuf> {
    let json = svg.with_extension("json");
    std::fs::write(svg, image)?;
    let mut text = serde_json::to_string_pretty(results).map_err(std::io::Error::other)?;
    text.push('\n');
    std::fs::write(&json, text)?;
    Ok(json)
}

/// Makes the directory `svg` goes in, before the run rather than after it.
pub(crate) fn prepare(svg: &Path) -> std::io::Result<()> {
    match svg.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir),
        _ => Ok(()),
    }
}

/// What `git <args>` prints in the checkout the bench was built from; `None` if git
/// is missing, fails or the checkout is gone.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `time` as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let rest = secs % 86_400;
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, <https://howardhinnant.github.io/date_algorithms.html>).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153; // March = 0
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn dates_are_utc_calendar_dates() {
        assert_eq!(utc(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        let time = UNIX_EPOCH + Duration::from_secs(1_796_409_296); // date -u -d @1796409296
        assert_eq!(utc(time), "2026-12-04T18:34:56Z");
    }

    fn row(number: &'static str, label: &'static str, msg_per_s: Option<f64>) -> Medians {
        Medians {
            number,
            label,
            msg_per_s,
            rounds_msg_per_s: msg_per_s.into_iter().collect(),
            p50_ms: None,
            p99_ms: None,
            rss_mib: None,
            cpu_us: None,
            all_us: None,
            mq_us: None,
            pg_us: None,
        }
    }

    fn results(contenders: Vec<Medians>) -> Results {
        Results {
            made: Provenance::example(),
            config: Settings {
                messages: 10_000,
                duplicates_every: 10,
                accounts: 10,
                deliveries: 11_000,
                rounds: 1,
                concurrency: 16,
                concurrency_from: "sweep",
                sweep: vec![8, 16],
                light: 0,
                rss_check: None,
            },
            ratios: report::ratios(&contenders),
            contenders,
            light: Vec::new(),
            runs: 10,
            failed_runs: 0,
        }
    }

    #[test]
    fn the_chart_draws_the_medians_it_is_given_against_the_baseline() {
        let results = results(vec![
            row("1", "raw", Some(80_000.0)),
            row("2", "baseline", Some(2_000.0)),
            row("3", "idemq-per-message", None),
            row("5", "idemq-lanes", Some(5_000.0)),
            row("", "baseline dups-only", Some(4_000.0)),
        ]);
        let chart = results.chart();
        let labels: Vec<&str> = chart.bars.iter().map(|bar| bar.label.as_str()).collect();
        assert_eq!(labels, ["1 raw", "2 baseline", "5 idemq-lanes", "baseline dups-only"]);
        let values: Vec<f64> = chart.bars.iter().map(|bar| bar.value).collect();
        assert_eq!(values, [80_000.0, 2_000.0, 5_000.0, 4_000.0]);
        assert_eq!(chart.baseline, Some(1), "the index among the bars drawn");
        assert_eq!(chart.axis_max, Some(5_000.0), "raw is cut at the longest other bar");
        let svg = chart.svg();
        assert!(svg.contains(">5,000 msg/s  ×2.50<"), "{svg}");
        assert!(
            svg.contains(">2026-12-04 19:00 UTC · commit 0123456 · 2 cores · PostgreSQL 15.20 · 1 round<"),
            "{svg}"
        );
        assert!(svg.contains("cargo run --release -p idemq-bench -- --rounds 1"), "{svg}");
        let ratio = |numbers: &str| results.ratios.iter().find(|r| r.numbers == numbers).unwrap().value;
        assert_eq!(ratio("5/2"), Some(2.5));
        assert_eq!(ratio("3/2"), None);
    }

    #[test]
    fn the_axis_ends_before_a_ceiling_far_above_the_rest() {
        let (ceiling, other) = (true, false);
        // The raw broker, tens of times the others: cut; the broker's other
        // ceiling, within twice the highest other value, still drawn whole.
        let values = [(ceiling, 90_000.0), (ceiling, 16_500.0), (other, 11_000.0), (other, 2_000.0)];
        assert_eq!(axis_end(values), Some(16_500.0));
        assert_eq!(axis_end([(ceiling, 20_000.0), (other, 11_000.0)]), None, "within twice");
        assert_eq!(axis_end([(other, 90_000.0), (other, 2_000.0)]), None, "only ceilings are cut");
        assert_eq!(axis_end([(ceiling, 90_000.0)]), None, "nothing else to keep readable");
        assert_eq!(axis_end([(ceiling, f64::NAN), (other, 1.0)]), None);
    }

    #[test]
    fn the_files_are_written_side_by_side() {
        let dir = std::env::temp_dir().join(format!("idemq-bench-plot-{}", std::process::id()));
        let svg = dir.join("nested").join("run.svg");
        prepare(&svg).unwrap();
        let json = results(vec![row("2", "baseline", Some(2_000.5))]).write(&svg).unwrap();
        assert_eq!(json, dir.join("nested").join("run.json"));
        assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<?xml"));
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(written["contenders"][0]["label"], "baseline");
        assert_eq!(written["contenders"][0]["msg_per_s"], 2_000.5);
        assert_eq!(written["config"]["messages"], 10_000);
        assert_eq!(written["commit"], "0123456789abcdef");
        assert_eq!(written["machine"]["cores"], 2, "the provenance's fields at the top level");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
