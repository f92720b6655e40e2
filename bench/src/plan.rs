//! What is measured: runs (a contender on a kind of load) and their results.

use crate::child::ChildReport;
use crate::config::Shape;
use crate::contenders::Contender;
use crate::workload::Workload;

/// The kind of load a run puts on its contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Load {
    /// The whole backlog published before the consumer starts: first deliveries
    /// and their duplicates.
    Backlog,
    /// The same backlog, every payment already applied before the run.
    DuplicatesOnly,
    /// One message at a time: published, settled, the next.
    Light,
}

/// Where in the program a run happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The baseline's concurrency sweep.
    Sweep,
    /// One of the alternating rounds (1-based).
    Round(usize),
    /// The larger backlog of `--rss-check`.
    RssCheck,
    /// A point of `--curve-backlog` or `--curve-concurrency` ([`crate::curves`]).
    Curve(Curve),
}

/// What a curve's runs vary (`--curve-backlog`, `--curve-concurrency`); in JSON, its
/// [`Curve::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Curve {
    /// The backlog's size: distinct payments, each backlog contender of a round.
    Backlog,
    /// The concurrency of each backlog contender that takes one.
    Concurrency,
}

impl Curve {
    pub(crate) const ALL: [Self; 2] = [Self::Backlog, Self::Concurrency];

    /// The name in its files' names (`latest-backlog.svg`) and its JSON.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Backlog => "backlog",
            Self::Concurrency => "concurrency",
        }
    }

    /// Where `run` lies along the curve: its payments, or its concurrency.
    pub(crate) fn x(self, run: &Run) -> usize {
        match self {
            Self::Backlog => run.shape.messages,
            Self::Concurrency => run.concurrency.unwrap_or(idemq::RuntimeBuilder::DEFAULT_CONCURRENCY),
        }
    }
}

/// One measured run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) contender: Contender,
    pub(crate) load: Load,
    /// Set for contenders that take one; the others run with their defaults.
    pub(crate) concurrency: Option<usize>,
    pub(crate) shape: Shape,
}

impl Run {
    pub(crate) fn new(contender: Contender, load: Load, concurrency: usize, shape: Shape) -> Self {
        let concurrency = contender.takes_concurrency().then_some(concurrency);
        Self { contender, load, concurrency, shape }
    }

    /// The contender and load, as the tables name them.
    pub(crate) fn label(&self) -> String {
        let load = match self.load {
            Load::Backlog => "",
            Load::DuplicatesOnly => " dups-only",
            Load::Light => " light",
        };
        format!("{}{load}", self.contender.name())
    }

    /// What the contender must count: (applied, duplicates), or `None` for the raw
    /// consumer, which only acks.
    pub(crate) fn expected_counts(&self, workload: &Workload) -> Option<(u64, u64)> {
        if !self.contender.uses_database() {
            return None;
        }
        Some(match self.load {
            Load::Backlog | Load::Light => (workload.distinct(), workload.duplicates()),
            Load::DuplicatesOnly => (0, workload.deliveries()),
        })
    }
}

/// A run and what came of it.
#[derive(Debug)]
pub(crate) struct RunResult {
    pub(crate) phase: Phase,
    pub(crate) run: Run,
    /// The child's report; `None` when the child failed (see `issues`).
    pub(crate) report: Option<ChildReport>,
    /// Failed checks: any makes the bench's exit code nonzero.
    pub(crate) issues: Vec<String>,
    /// Worth knowing, not a failure (in-process retries after database faults).
    pub(crate) notes: Vec<String>,
}

impl RunResult {
    pub(crate) fn ok(&self) -> bool {
        self.issues.is_empty()
    }

    /// The report of a run whose checks all passed.
    pub(crate) fn passed(&self) -> Option<&ChildReport> {
        self.report.as_ref().filter(|_| self.ok())
    }
}

/// Light load: the first messages of each run, not counted in its latency.
const LIGHT_WARMUP: usize = 20;

/// The warm-up messages of a light-load run of `messages`.
pub(crate) fn light_warmup(messages: usize) -> usize {
    LIGHT_WARMUP.min(messages / 2)
}
