//! Rate against backlog size and against concurrency (`--curve-backlog`,
//! `--curve-concurrency`): which runs make each curve, and its line chart (SVG) with
//! a JSON file, beside `--plot`'s chart.
//!
//! After the rounds (and the RSS check), each backlog contender of a round runs once
//! at each `--curve-backlog` size (the rounds' duplicates and accounts, the rounds'
//! concurrency for the contenders that take one), and each contender that takes a
//! concurrency runs once at each `--curve-concurrency` value on the rounds' backlog.
//! The baseline is run again at each concurrency, also where the sweep already
//! measured it: every point of a curve then comes from the same stretch of the
//! invocation, after the rounds, rather than some from its first minutes.
//!
//! A point is one run, not a median: the curves show a shape (where a contender
//! stops scaling, or slows down as the backlog grows), within this machine's noise
//! of about ±15% per run. A run that failed its checks is a gap in its line, named in
//! the chart's notes; its issues are in the JSON.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::{Config, Shape};
use crate::plan::{Curve, Load, Phase, Run, RunResult};
use crate::plot::{thousands, Line, LineChart, Series};
use crate::results::{self, axis_end, checks, duplicates, Context, Kind, Provenance};

/// How each contender's line is drawn, the same in every curve: its colour (the
/// ceilings in greys, the hand-written loops in the bar chart's yellow and an
/// orange, idemq's modes in blue, the bar chart's idemq, and other colours of
/// GitHub's palette) and its points' mark ([`Line::marker`]: lines of close colours
/// get different marks).
const STYLES: [(&str, &str, usize); 10] = [
    ("raw", "#8c959f", 0),
    ("broker-events", "#6e7781", 3),
    ("database", "#424a53", 2),
    ("baseline", "#bf8700", 1),
    ("expert", "#bc4c00", 3),
    ("idemq-per-message", "#8250df", 2),
    ("idemq-group", "#1a7f37", 3),
    ("idemq-lanes", "#0969da", 0),
    ("idemq-outbox", "#bf3989", 1),
    ("idemq-batch", "#cf222e", 2),
];
/// For contenders not in [`STYLES`], in turn, with a circle.
const MORE_COLOURS: [&str; 3] = ["#1b7c83", "#6639ba", "#953800"];

/// The runs of `curve`, in the order they run: point after point, at each one the
/// contenders in the order of a round (`round_runs`, the parent's list for a
/// concurrency and a shape), backlog runs only.
pub(crate) fn runs(
    config: &Config,
    curve: Curve,
    concurrency: usize,
    round_runs: impl Fn(usize, Shape) -> Vec<Run>,
) -> Vec<Run> {
    let backlog = |concurrency, shape| {
        round_runs(concurrency, shape).into_iter().filter(|run| run.load == Load::Backlog)
    };
    match curve {
        Curve::Backlog => config
            .curve_backlog
            .iter()
            .flat_map(|&messages| backlog(concurrency, Shape { messages, ..config.shape }))
            .collect(),
        Curve::Concurrency => config
            .curve_concurrency
            .iter()
            .flat_map(|&concurrency| backlog(concurrency, config.shape))
            .filter(|run| run.contender.takes_concurrency())
            .collect(),
    }
}

/// Where `curve`'s chart goes: beside `plot`, its name with `-backlog` or
/// `-concurrency` added (`latest.svg`: `latest-backlog.svg`).
pub(crate) fn path(plot: &Path, curve: Curve) -> PathBuf {
    let stem = plot.file_stem().unwrap_or_default().to_string_lossy();
    plot.with_file_name(format!("{stem}-{}.svg", curve.name()))
}

/// Printed before a curve's runs.
pub(crate) fn header(curve: Curve, config: &Config) {
    let list = |points: &[usize]| points.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let what = match curve {
        Curve::Backlog => {
            format!("backlog size, at {} payments: each backlog contender", list(&config.curve_backlog))
        }
        Curve::Concurrency => {
            format!("concurrency, at {}: each contender that takes one", list(&config.curve_concurrency))
        }
    };
    println!("\n== curve: rate against {what}, one run each (columns as in the rounds) ==");
}

/// What a curve's JSON file holds.
#[derive(Debug, Serialize)]
pub(crate) struct CurveResults {
    #[serde(flatten)]
    pub(crate) made: Provenance,
    /// `backlog` or `concurrency`: what `x` is.
    pub(crate) curve: Curve,
    pub(crate) config: CurveSettings,
    /// In the order of a round.
    pub(crate) contenders: Vec<CurveRow>,
    /// The curve's runs, and those that failed their checks.
    pub(crate) runs: usize,
    pub(crate) failed_runs: usize,
}

/// What the curve's runs had in common.
#[derive(Debug, Serialize)]
pub(crate) struct CurveSettings {
    /// Distinct payments per run; `None` on the backlog curve, where it is `x`.
    pub(crate) messages: Option<usize>,
    pub(crate) duplicates_every: usize,
    pub(crate) accounts: usize,
    /// The concurrency of the contenders that take one; `None` on the concurrency
    /// curve, where it is `x`.
    pub(crate) concurrency: Option<usize>,
    /// The points asked for, ascending.
    pub(crate) xs: Vec<usize>,
}

/// A contender's line.
#[derive(Debug, Serialize)]
pub(crate) struct CurveRow {
    pub(crate) label: String,
    pub(crate) points: Vec<Point>,
}

/// A contender's run at one `x`.
#[derive(Debug, Serialize)]
pub(crate) struct Point {
    pub(crate) x: usize,
    /// `None`: the run failed its checks.
    pub(crate) msg_per_s: Option<f64>,
    /// In-process latency, received → settled.
    pub(crate) p99_ms: Option<f64>,
    pub(crate) rss_mib: Option<f64>,
    /// The checks it failed.
    pub(crate) issues: Vec<String>,
}

impl CurveResults {
    /// `curve`'s points among `results` (the invocation's runs).
    pub(crate) fn collect(context: &Context<'_>, curve: Curve, results: &[RunResult]) -> Self {
        let config = context.config;
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.phase == Phase::Curve(curve)).collect();
        let mut contenders: Vec<CurveRow> = Vec::new();
        for result in &runs {
            let label = result.run.label();
            let index = match contenders.iter().position(|row| row.label == label) {
                Some(index) => index,
                None => {
                    contenders.push(CurveRow { label, points: Vec::new() });
                    contenders.len() - 1
                }
            };
            let report = result.passed();
            contenders[index].points.push(Point {
                x: curve.x(&result.run),
                msg_per_s: report.map(|report| report.rate()),
                p99_ms: report.and_then(|report| report.latency.p99_us).map(|us| us / 1000.0),
                rss_mib: report.and_then(|report| report.peak_rss_kib).map(|kib| kib as f64 / 1024.0),
                issues: result.issues.clone(),
            });
        }
        let (messages, concurrency, xs) = match curve {
            Curve::Backlog => (None, Some(context.concurrency), config.curve_backlog.clone()),
            Curve::Concurrency => (Some(config.shape.messages), None, config.curve_concurrency.clone()),
        };
        Self {
            made: Provenance::collect(context),
            curve,
            config: CurveSettings {
                messages,
                duplicates_every: config.shape.duplicates_every,
                accounts: config.shape.accounts,
                concurrency,
                xs,
            },
            contenders,
            runs: runs.len(),
            failed_runs: runs.iter().filter(|r| !r.ok()).count(),
        }
    }

    /// The line chart: a line per contender, a point per run that passed its checks.
    /// The raw broker's points, tens of times the others', are past the axis's end
    /// ([`axis_end`]) and written in the notes.
    pub(crate) fn chart(&self) -> LineChart {
        let xs = &self.config.xs;
        let mut more_colours = MORE_COLOURS.iter().cycle();
        let series: Vec<Line> = self
            .contenders
            .iter()
            .map(|row| {
                let known = STYLES.iter().find(|(label, ..)| *label == row.label);
                let (colour, marker) = known.map_or_else(
                    || (*more_colours.next().unwrap_or(&"#59636e"), 0),
                    |&(_, colour, marker)| (colour, marker),
                );
                let value = |x: &usize| row.points.iter().find(|p| p.x == *x).and_then(|p| p.msg_per_s);
                let values = xs.iter().map(value).collect();
                Line { series: Series { name: row.label.clone(), colour }, marker, values }
            })
            .collect();
        let axis_max = axis_end(self.contenders.iter().flat_map(|row| {
            let ceiling = Kind::of(&row.label) == Kind::Ceiling;
            row.points.iter().filter_map(move |point| Some((ceiling, point.msg_per_s?)))
        }));
        let failed: Vec<String> = self
            .contenders
            .iter()
            .flat_map(|row| {
                let failed = row.points.iter().filter(|point| !point.issues.is_empty());
                failed.map(|point| format!("{} at {}", row.label, thousands(point.x as f64)))
            })
            .collect();

        let settings = &self.config;
        let (title, what, axis_title) = match self.curve {
            Curve::Backlog => (
                "Rate against backlog size: deliveries settled per second",
                format!(
                    "Payments over {} accounts, {}; one run per contender and size, the whole backlog queued \
                     before the consumer starts{}",
                    thousands(settings.accounts as f64),
                    duplicates(settings.duplicates_every),
                    settings
                        .concurrency
                        .map(|c| format!("; baseline and per-message at concurrency {c}"))
                        .unwrap_or_default()
                ),
                "payments in the backlog",
            ),
            Curve::Concurrency => (
                "Rate against concurrency: deliveries settled per second",
                format!(
                    "{} payments over {} accounts, {}; one run per contender and concurrency, the whole backlog \
                     queued before the consumer starts",
                    thousands(settings.messages.unwrap_or_default() as f64),
                    thousands(settings.accounts as f64),
                    duplicates(settings.duplicates_every),
                ),
                "concurrency: deliveries in flight at once, each in a transaction of its own",
            ),
        };
        let mut notes = vec![format!(
            "One run per point, not a median: msg/s = deliveries settled / seconds from the consumer's start. \
             {} (ledger exact, queues drained).",
            checks(self.runs, self.failed_runs)
        )];
        if !failed.is_empty() {
            notes.push(format!(
                "Not drawn, their checks FAILED (the JSON beside this chart has why): {}.",
                failed.join("; ")
            ));
        }
        notes.push(self.made.made_by());
        LineChart {
            title: title.to_owned(),
            lines: vec![what, self.made.line()],
            xs: xs.iter().map(|&x| x as f64).collect(),
            series,
            unit: "msg/s".into(),
            axis_max,
            axis_title: axis_title.to_owned(),
            notes,
        }
    }

    /// Writes the chart to `svg` and the JSON beside it; returns the JSON's path.
    pub(crate) fn write(&self, svg: &Path) -> std::io::Result<PathBuf> {
        results::write(svg, &self.chart().svg(), self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contenders::Contender;

    /// A round of three: two backlog runs and a duplicates-only one.
    fn round(concurrency: usize, shape: Shape) -> Vec<Run> {
        vec![
            Run::new(Contender::Raw, Load::Backlog, concurrency, shape),
            Run::new(Contender::Baseline, Load::Backlog, concurrency, shape),
            Run::new(Contender::Baseline, Load::DuplicatesOnly, concurrency, shape),
        ]
    }

    #[test]
    fn each_point_runs_the_backlog_contenders_of_a_round() {
        let mut config =
            Config { curve_backlog: vec![300, 1_000], curve_concurrency: vec![2, 8], ..Config::default() };
        let backlog = runs(&config, Curve::Backlog, 16, round);
        let seen: Vec<(&str, usize, Option<usize>)> =
            backlog.iter().map(|run| (run.contender.name(), run.shape.messages, run.concurrency)).collect();
        assert_eq!(
            seen,
            [
                ("raw", 300, None),
                ("baseline", 300, Some(16)),
                ("raw", 1_000, None),
                ("baseline", 1_000, Some(16))
            ]
        );
        assert!(backlog.iter().all(|run| run.load == Load::Backlog && run.shape.accounts == 10));
        assert_eq!(
            backlog.iter().map(|run| Curve::Backlog.x(run)).collect::<Vec<_>>(),
            [300, 300, 1_000, 1_000]
        );

        let concurrency = runs(&config, Curve::Concurrency, 16, round);
        let seen: Vec<(&str, usize, Option<usize>)> = concurrency
            .iter()
            .map(|run| (run.contender.name(), run.shape.messages, run.concurrency))
            .collect();
        assert_eq!(seen, [("baseline", 20_000, Some(2)), ("baseline", 20_000, Some(8))]);

        config.curve_backlog.clear();
        assert!(runs(&config, Curve::Backlog, 16, round).is_empty(), "off unless asked for");
    }

    #[test]
    fn the_charts_go_beside_the_plot() {
        let plot = Path::new("bench/results/latest.svg");
        assert_eq!(path(plot, Curve::Backlog), Path::new("bench/results/latest-backlog.svg"));
        assert_eq!(path(plot, Curve::Concurrency), Path::new("bench/results/latest-concurrency.svg"));
        assert_eq!(path(Path::new("run.svg"), Curve::Backlog), Path::new("run-backlog.svg"));
    }

    fn point(x: usize, msg_per_s: Option<f64>) -> Point {
        let issues = if msg_per_s.is_none() { vec!["ledger: 3 rows missing".into()] } else { Vec::new() };
        Point { x, msg_per_s, p99_ms: None, rss_mib: None, issues }
    }

    fn row(label: &str, values: [Option<f64>; 3]) -> CurveRow {
        let xs = [5_000, 20_000, 80_000];
        CurveRow {
            label: label.into(),
            points: xs.into_iter().zip(values).map(|(x, v)| point(x, v)).collect(),
        }
    }

    fn backlog_curve(contenders: Vec<CurveRow>) -> CurveResults {
        CurveResults {
            made: Provenance::example(),
            curve: Curve::Backlog,
            config: CurveSettings {
                messages: None,
                duplicates_every: 10,
                accounts: 10,
                concurrency: Some(64),
                xs: vec![5_000, 20_000, 80_000],
            },
            runs: contenders.len() * 3,
            failed_runs: contenders
                .iter()
                .flat_map(|row| &row.points)
                .filter(|p| p.msg_per_s.is_none())
                .count(),
            contenders,
        }
    }

    #[test]
    fn the_chart_draws_each_contender_with_failed_runs_as_gaps() {
        let curve = backlog_curve(vec![
            row("raw", [Some(80_000.0), Some(90_000.0), Some(85_000.0)]),
            row("baseline", [Some(2_000.0), Some(2_100.0), None]),
            row("idemq-batch", [Some(9_000.0), Some(11_000.0), Some(12_000.0)]),
            row("a-new-one", [None, None, None]),
        ]);
        let chart = curve.chart();
        let names: Vec<&str> = chart.series.iter().map(|line| line.series.name.as_str()).collect();
        assert_eq!(names, ["raw", "baseline", "idemq-batch", "a-new-one"]);
        assert_eq!(chart.series[1].values, [Some(2_000.0), Some(2_100.0), None]);
        assert_eq!(chart.series[1].series.colour, "#bf8700", "the bar chart's baseline colour");
        assert_eq!(chart.series[3].series.colour, MORE_COLOURS[0]);
        assert_eq!(chart.xs, [5_000.0, 20_000.0, 80_000.0]);
        assert_eq!(chart.axis_max, Some(12_000.0), "raw is past the axis");
        let notes = chart.notes.join("\n");
        assert!(notes.contains("4 of 12 runs FAILED"), "{notes}");
        assert!(notes.contains("baseline at 80,000; a-new-one at 5,000; a-new-one at 20,000"), "{notes}");
        assert!(notes.contains("Made by: cargo run --release -p idemq-bench -- --rounds 1"), "{notes}");
        assert!(chart.lines[0].contains("every 10th twice") && chart.lines[0].contains("concurrency 64"));
        let svg = chart.svg();
        assert!(svg.contains("raw 80,000 at 5,000, 90,000 at 20,000, 85,000 at 80,000"), "{svg}");
        assert!(svg.contains("(logarithmic scale)"));
    }

    #[test]
    fn the_files_are_written_side_by_side() {
        let dir = std::env::temp_dir().join(format!("idemq-bench-curves-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = path(&dir.join("run.svg"), Curve::Backlog);
        let curve = backlog_curve(vec![row("baseline", [Some(2_000.5), None, Some(1_900.0)])]);
        let json = curve.write(&svg).unwrap();
        assert_eq!(json, dir.join("run-backlog.json"));
        assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<?xml"));
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(written["curve"], "backlog");
        assert_eq!(written["commit"], "0123456789abcdef");
        assert_eq!(written["config"]["xs"], serde_json::json!([5_000, 20_000, 80_000]));
        let points = &written["contenders"][0]["points"];
        assert_eq!(points[0]["msg_per_s"], 2_000.5);
        assert_eq!(points[1]["msg_per_s"], serde_json::Value::Null);
        assert_eq!(points[1]["issues"][0], "ledger: 3 rows missing");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
