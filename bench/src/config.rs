//! The command line: the parent's flags, and the spec a child is started with.

use std::path::PathBuf;

use crate::contenders::Contender;

pub(crate) const USAGE: &str = "\
usage: bench [flags]
  --messages N              distinct payments per backlog run (default 20000)
  --duplicates-every K      every K-th payment is published twice, back to back (default 10; 0: none)
  --accounts A              accounts the payments spread over (default 10, as in the demo)
  --rounds R                rounds; each runs every contender once, in turn (default 3)
  --baseline-concurrency C  the baseline's (and idemq per-message mode's) concurrency; without it,
                            a sweep picks the baseline's best
  --sweep C1,C2,..          the concurrencies that sweep tries, one run each (default 8,16,32,64)
  --light N                 light-load messages per contender and round, one at a time (default 300; 0: skip)
  --rss-check N             after the rounds, one backlog run per contender of the rounds (--only's) with
                            N payments, its peak RSS compared with the rounds' (e.g. 100000)
  --rss-tolerance PCT       how much larger that peak RSS may be and still count as the same (default 25)
  --curve-backlog N1,N2,..  after the rounds, one backlog run of every backlog contender of a round at each
                            of these numbers of payments (e.g. 5000,20000,80000): msg/s against backlog size
                            as a line chart beside --plot's (latest.svg: latest-backlog.svg), with JSON (default off)
  --curve-concurrency C1,.. after the rounds, one backlog run of each contender that takes a concurrency
                            (baseline, idemq per-message) at each of these (e.g. 4,16,64) on the rounds' backlog:
                            msg/s against concurrency, beside --plot's (latest-concurrency.svg) (default off)
  --only NAME,..            only these rows of a round (e.g. idemq-batch,expert,database; a dups-only
                            row by its label, \"idemq-lanes dups-only\"); the summary shows the others empty
  --plot PATH               at the end, the medians' msg/s as a bar chart (SVG) at PATH, and the medians,
                            ratios and configuration as JSON beside it (PATH with .json); default
                            bench/results/latest.svg in this checkout; none: neither (and no curves)
environment: AMQP_URL, DATABASE_URL (default postgres://postgres@127.0.0.1:5432/idemq_bench), RUST_LOG";

/// What a run's messages look like (see [`crate::workload::Workload`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) messages: usize,
    pub(crate) duplicates_every: usize,
    pub(crate) accounts: usize,
}

/// The parent's flags.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) shape: Shape,
    pub(crate) rounds: usize,
    pub(crate) baseline_concurrency: Option<usize>,
    pub(crate) sweep: Vec<usize>,
    pub(crate) light: usize,
    pub(crate) rss_check: Option<usize>,
    pub(crate) rss_tolerance_pct: usize,
    /// Where the chart goes (the JSON beside it); `None`: `--plot none`.
    pub(crate) plot: Option<PathBuf>,
    /// `--curve-backlog`: the payments of each point, ascending; empty: no curve.
    pub(crate) curve_backlog: Vec<usize>,
    /// `--curve-concurrency`: the concurrency of each point, ascending; empty: no curve.
    pub(crate) curve_concurrency: Vec<usize>,
    /// `--only`: the labels of the round's rows to run; empty: all.
    pub(crate) only: Vec<String>,
}

/// `--plot`'s default: `bench/results/latest.svg` of the checkout the bench was built
/// from, wherever it is started (ignored by git: `bench/.gitignore`).
fn default_plot() -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "results", "latest.svg"].iter().collect()
}

impl Default for Config {
    fn default() -> Self {
        Self {
            shape: Shape { messages: 20_000, duplicates_every: 10, accounts: 10 },
            rounds: 3,
            baseline_concurrency: None,
            sweep: vec![8, 16, 32, 64],
            light: 300,
            rss_check: None,
            rss_tolerance_pct: 25,
            plot: Some(default_plot()),
            curve_backlog: Vec::new(),
            curve_concurrency: Vec::new(),
            only: Vec::new(),
        }
    }
}

/// Why the command line was refused; `Help` is `--help`.
#[derive(Debug)]
pub(crate) enum ParseError {
    Help,
    Bad(String),
}

fn concurrency(flag: &str, n: usize) -> Result<usize, ParseError> {
    if n == 0 || n > usize::from(u16::MAX) {
        return Err(ParseError::Bad(format!("{flag} must be 1..=65535, not {n}")));
    }
    Ok(n)
}

fn number(flag: &str, value: &str) -> Result<usize, ParseError> {
    value.parse().map_err(|_| ParseError::Bad(format!("{flag} takes a number, not '{value}'")))
}

fn positive(flag: &str, value: &str) -> Result<usize, ParseError> {
    match number(flag, value)? {
        0 => Err(ParseError::Bad(format!("{flag} must be at least 1"))),
        n => Ok(n),
    }
}

fn concurrency_value(flag: &str, value: &str) -> Result<usize, ParseError> {
    concurrency(flag, positive(flag, value)?)
}

/// A comma-separated list, each item read by `item`.
fn list(
    flag: &str,
    value: &str,
    item: fn(&str, &str) -> Result<usize, ParseError>,
) -> Result<Vec<usize>, ParseError> {
    value.split(',').map(|each| item(flag, each.trim())).collect()
}

/// A curve's points: a list, ascending, each once.
fn points(
    flag: &str,
    value: &str,
    item: fn(&str, &str) -> Result<usize, ParseError>,
) -> Result<Vec<usize>, ParseError> {
    let mut points = list(flag, value, item)?;
    points.sort_unstable();
    points.dedup();
    Ok(points)
}

/// `--only`'s labels, each a contender's name, or one followed by ` dups-only`.
fn only(value: &str) -> Result<Vec<String>, ParseError> {
    value
        .split(',')
        .map(|label| {
            let label = label.trim();
            let name = label.strip_suffix(" dups-only").unwrap_or(label);
            match Contender::from_name(name) {
                Some(_) => Ok(label.to_owned()),
                None => Err(ParseError::Bad(format!("--only: no contender '{name}'"))),
            }
        })
        .collect()
}

impl Config {
    /// Whether a round runs the row labelled `label` (see `--only`).
    pub(crate) fn runs(&self, label: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|only| only == label)
    }

    pub(crate) fn parse(args: &[String]) -> Result<Self, ParseError> {
        let mut config = Self::default();
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(ParseError::Help);
            }
            let value = args.next().ok_or_else(|| ParseError::Bad(format!("{flag} needs a value")))?;
            match flag.as_str() {
                "--messages" => config.shape.messages = positive(flag, value)?,
                "--duplicates-every" => config.shape.duplicates_every = number(flag, value)?,
                "--accounts" => config.shape.accounts = positive(flag, value)?,
                "--rounds" => config.rounds = positive(flag, value)?,
                "--baseline-concurrency" => {
                    config.baseline_concurrency = Some(concurrency_value(flag, value)?);
                }
                "--sweep" => config.sweep = list(flag, value, concurrency_value)?,
                "--light" => config.light = number(flag, value)?,
                "--rss-check" => config.rss_check = Some(positive(flag, value)?),
                "--rss-tolerance" => config.rss_tolerance_pct = number(flag, value)?,
                "--plot" if value == "none" => config.plot = None,
                "--plot" if value.is_empty() => return Err(ParseError::Bad("--plot needs a path".into())),
                "--plot" => config.plot = Some(PathBuf::from(value)),
                "--curve-backlog" => config.curve_backlog = points(flag, value, positive)?,
                "--curve-concurrency" => config.curve_concurrency = points(flag, value, concurrency_value)?,
                "--only" => config.only = only(value)?,
                _ => return Err(ParseError::Bad(format!("unknown flag: {flag}"))),
            }
        }
        let curves = !config.curve_backlog.is_empty() || !config.curve_concurrency.is_empty();
        if curves && config.plot.is_none() {
            return Err(ParseError::Bad(
                "--curve-backlog and --curve-concurrency draw beside --plot's chart: not with --plot none"
                    .into(),
            ));
        }
        Ok(config)
    }
}

/// What a child process runs: `bench --child <contender> --queue Q [--concurrency C]
/// --expect N [--light --run-id ID --messages N --accounts A --warmup W]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChildSpec {
    pub(crate) contender: Contender,
    pub(crate) queue: String,
    /// The contender's concurrency, where it takes one (baseline, idemq per-message).
    pub(crate) concurrency: Option<usize>,
    /// Deliveries to settle before the clock stops (backlog runs).
    pub(crate) expect: u64,
    /// Light load: the child publishes its own messages, one at a time.
    pub(crate) light: Option<LightSpec>,
}

/// A light-load run: the workload the child publishes itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LightSpec {
    pub(crate) run_id: String,
    pub(crate) messages: usize,
    pub(crate) accounts: usize,
    /// The first messages, not counted in the latency (connections warming up).
    pub(crate) warmup: usize,
}

impl ChildSpec {
    /// The arguments that [`ChildSpec::parse`] reads back.
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--child".to_owned(), self.contender.name().to_owned()];
        args.extend(["--queue".to_owned(), self.queue.clone()]);
        if let Some(c) = self.concurrency {
            args.extend(["--concurrency".to_owned(), c.to_string()]);
        }
        args.extend(["--expect".to_owned(), self.expect.to_string()]);
        if let Some(light) = &self.light {
            args.push("--light".to_owned());
            args.extend(["--run-id".to_owned(), light.run_id.clone()]);
            args.extend(["--messages".to_owned(), light.messages.to_string()]);
            args.extend(["--accounts".to_owned(), light.accounts.to_string()]);
            args.extend(["--warmup".to_owned(), light.warmup.to_string()]);
        }
        args
    }

    /// Parses what follows `--child`.
    pub(crate) fn parse(args: &[String]) -> Result<Self, String> {
        let mut args = args.iter();
        let name = args.next().ok_or("--child needs a contender")?;
        let contender = Contender::from_name(name).ok_or_else(|| format!("unknown contender '{name}'"))?;
        let (mut queue, mut concurrency, mut expect) = (None, None, 0);
        let (mut light, mut run_id, mut messages, mut accounts, mut warmup) = (false, None, 0, 1, 0);
        while let Some(flag) = args.next() {
            if flag == "--light" {
                light = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let n = || value.parse::<usize>().map_err(|_| format!("{flag} takes a number, not '{value}'"));
            match flag.as_str() {
                "--queue" => queue = Some(value.clone()),
                "--concurrency" => concurrency = Some(n()?),
                "--expect" => expect = n()? as u64,
                "--run-id" => run_id = Some(value.clone()),
                "--messages" => messages = n()?,
                "--accounts" => accounts = n()?,
                "--warmup" => warmup = n()?,
                _ => return Err(format!("unknown child flag: {flag}")),
            }
        }
        let light = match (light, run_id) {
            (false, _) => None,
            (true, Some(run_id)) => Some(LightSpec { run_id, messages, accounts, warmup }),
            (true, None) => return Err("--light needs --run-id".into()),
        };
        Ok(Self { contender, queue: queue.ok_or("--child needs --queue")?, concurrency, expect, light })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|&a| a.to_owned()).collect()
    }

    #[test]
    fn a_child_spec_reads_back_what_it_writes() {
        let backlog = ChildSpec {
            contender: Contender::Baseline,
            queue: "q".into(),
            concurrency: Some(32),
            expect: 22_000,
            light: None,
        };
        let light = ChildSpec {
            contender: Contender::IdemqGroup,
            queue: "q2".into(),
            concurrency: None,
            expect: 300,
            light: Some(LightSpec { run_id: "abc".into(), messages: 300, accounts: 10, warmup: 20 }),
        };
        for spec in [backlog, light] {
            let args = spec.to_args();
            assert_eq!(args[0], "--child");
            assert_eq!(ChildSpec::parse(&args[1..]).unwrap(), spec);
        }
    }

    #[test]
    fn flags_set_what_they_name_and_bad_values_are_refused() {
        let config =
            Config::parse(&strings(&["--messages", "100", "--sweep", "4, 8", "--rss-check", "1000"]))
                .unwrap();
        assert_eq!(config.shape.messages, 100);
        assert_eq!(config.sweep, [4, 8]);
        assert_eq!(config.rss_check, Some(1000));
        assert!(matches!(Config::parse(&strings(&["--rounds", "0"])), Err(ParseError::Bad(_))));
        assert!(matches!(Config::parse(&strings(&["--sweep", "8,x"])), Err(ParseError::Bad(_))));
        assert!(matches!(Config::parse(&strings(&["--bogus", "1"])), Err(ParseError::Bad(_))));
        let only = Config::parse(&strings(&["--only", "expert, idemq-lanes dups-only"])).unwrap();
        assert!(only.runs("expert") && only.runs("idemq-lanes dups-only") && !only.runs("idemq-lanes"));
        assert!(Config::default().runs("raw"));
        assert!(matches!(Config::parse(&strings(&["--only", "expert,nobody"])), Err(ParseError::Bad(_))));
        assert!(matches!(Config::parse(&strings(&["--help"])), Err(ParseError::Help)));
    }

    #[test]
    fn the_plot_goes_to_the_bench_crate_unless_told_otherwise() {
        let default = Config::parse(&[]).unwrap().plot.unwrap();
        assert!(default.ends_with("bench/results/latest.svg"), "{default:?}");
        assert!(default.is_absolute());
        let config = Config::parse(&strings(&["--plot", "out/run.svg"])).unwrap();
        assert_eq!(config.plot, Some(PathBuf::from("out/run.svg")));
        assert_eq!(Config::parse(&strings(&["--plot", "none"])).unwrap().plot, None);
        assert!(matches!(Config::parse(&strings(&["--plot"])), Err(ParseError::Bad(_))));
    }

    #[test]
    fn curves_are_off_unless_asked_for_and_their_points_ascend() {
        let default = Config::parse(&[]).unwrap();
        assert!(default.curve_backlog.is_empty() && default.curve_concurrency.is_empty());
        let config = Config::parse(&strings(&[
            "--curve-backlog",
            "80000, 5000,20000,5000",
            "--curve-concurrency",
            "64,4,16",
        ]))
        .unwrap();
        assert_eq!(config.curve_backlog, [5_000, 20_000, 80_000]);
        assert_eq!(config.curve_concurrency, [4, 16, 64]);
        for bad in [
            ["--curve-backlog", "5000,0"],
            ["--curve-backlog", ""],
            ["--curve-concurrency", "4,x"],
            ["--curve-concurrency", "70000"],
        ] {
            assert!(matches!(Config::parse(&strings(&bad)), Err(ParseError::Bad(_))), "{bad:?}");
        }
        // Their charts go beside --plot's, in either order of the flags.
        for args in
            [["--plot", "none", "--curve-backlog", "100"], ["--curve-concurrency", "4", "--plot", "none"]]
        {
            assert!(matches!(Config::parse(&strings(&args)), Err(ParseError::Bad(_))), "{args:?}");
        }
    }
}
