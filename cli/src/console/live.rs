//! The handlers page's figures, read from the running process's own metrics (the
//! text `/metrics` serves): a sample every [`EVERY`], the last minute's kept, and
//! each figure the difference between the newest and the oldest — rates per minute,
//! and p50/p99 from the histogram's buckets as Prometheus's `histogram_quantile`
//! reads them (linear within a bucket).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a sample is taken.
pub(super) const EVERY: Duration = Duration::from_secs(5);

/// The window the figures cover.
pub(super) const WINDOW: Duration = Duration::from_secs(60);

/// One metric series: its name, its labels, its value.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Series {
    pub(super) name: String,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) value: f64,
}

impl Series {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// The series of a text exposition (Prometheus or OpenMetrics); lines it cannot
/// read are skipped.
pub(super) fn parse(text: &str) -> Vec<Series> {
    text.lines().filter(|line| !line.starts_with('#') && !line.trim().is_empty()).filter_map(series).collect()
}

fn series(line: &str) -> Option<Series> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(at) => line.split_at(at),
        None => return None,
    };
    let mut labels = BTreeMap::new();
    let rest = if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.trim_start_matches([',', ' ']);
            if let Some(after) = inner.strip_prefix('}') {
                break after;
            }
            let (label, after) = inner.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next()? {
                    (at, '"') => break at,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.insert(label.trim().to_owned(), value);
            inner = &after[end + 1..];
        }
    } else {
        rest
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        number => number.parse().ok()?,
    };
    Some(Series { name: name.to_owned(), labels, value })
}

/// A sample: when, and what.
struct Sample {
    at: Instant,
    series: Vec<Series>,
}

/// The last minute's samples.
#[derive(Default)]
pub(super) struct Samples(Mutex<VecDeque<Sample>>);

impl Samples {
    /// Keeps `text`'s series as a sample taken now, and drops what is older than the
    /// window needs.
    pub(super) fn take(&self, text: &str) {
        let now = Instant::now();
        let mut samples = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        samples.push_back(Sample { at: now, series: parse(text) });
        while samples.len() > 2 && samples.get(1).is_some_and(|second| now - second.at >= WINDOW) {
            samples.pop_front();
        }
    }

    /// Per minute, the counter `name` (summed over its labels) between the oldest
    /// sample and `text` (now); `None` before the oldest is [`EVERY`] old.
    pub(super) fn per_minute(&self, text: &str, name: &str) -> Option<f64> {
        let samples = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let oldest = samples.front().filter(|sample| sample.at.elapsed() >= EVERY)?;
        let sum = |set: &[Series]| set.iter().filter(|s| s.name == name).map(|s| s.value).sum::<f64>();
        let delta = sum(&parse(text)) - sum(&oldest.series);
        Some(delta.max(0.0) * 60.0 / oldest.at.elapsed().as_secs_f64())
    }

    /// The figures of each handler between the oldest sample and `text` (now).
    pub(super) fn figures(&self, text: &str) -> Vec<Figures> {
        let now = parse(text);
        let samples = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let oldest = samples.front().filter(|sample| sample.at.elapsed() >= EVERY);
        let since = oldest.map(|sample| sample.at.elapsed());
        let before: &[Series] = oldest.map_or(&[], |sample| &sample.series);
        figures(&now, before, since)
    }
}

/// One handler's figures over the window.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Figures {
    pub(super) handler: String,
    pub(super) queue: String,
    /// Per minute, by outcome (`applied`, `duplicate`, `retried`, `dead_lettered`…);
    /// empty until the first sample is [`EVERY`] old (a rate over a second or two
    /// would say little).
    pub(super) per_minute: BTreeMap<String, f64>,
    /// Over how long the rates were measured.
    pub(super) over: Option<Duration>,
    /// Handler time, p50 and p99 (over the window, else since start), in seconds.
    pub(super) p50: Option<f64>,
    pub(super) p99: Option<f64>,
    pub(super) in_flight: f64,
    /// Whether its kill switch holds its queue paused.
    pub(super) paused: bool,
    /// Times its kill switch opened since start.
    pub(super) trips: f64,
    /// A stream handler's lag: messages, and seconds behind (`idemq_stream_lag_*`).
    pub(super) stream_lag: Option<(f64, f64)>,
}

/// Each handler's figures from the series `now` and, `since` ago, `before`.
pub(super) fn figures(now: &[Series], before: &[Series], since: Option<Duration>) -> Vec<Figures> {
    let consumers: std::collections::BTreeSet<(&str, &str, u64)> = now
        .iter()
        .filter(|s| s.name == "idemq_in_flight")
        .filter_map(|s| Some((s.label("handler")?, s.label("queue")?, s.value.to_bits())))
        .collect();
    consumers
        .into_iter()
        .map(|(handler, queue, in_flight)| {
            let of = |s: &&Series| s.label("handler") == Some(handler) && s.label("queue") == Some(queue);
            let value = |set: &[Series], name: &str, outcome: Option<&str>| -> f64 {
                set.iter()
                    .filter(|s| s.name == name && of(s))
                    .filter(|s| outcome.is_none_or(|outcome| s.label("outcome") == Some(outcome)))
                    .map(|s| s.value)
                    .sum()
            };
            let mut per_minute = BTreeMap::new();
            if let Some(since) = since {
                let outcomes: std::collections::BTreeSet<&str> = now
                    .iter()
                    .filter(|s| s.name == "idemq_deliveries_total" && of(s))
                    .filter_map(|s| s.label("outcome"))
                    .collect();
                for outcome in outcomes {
                    let delta = value(now, "idemq_deliveries_total", Some(outcome))
                        - value(before, "idemq_deliveries_total", Some(outcome));
                    per_minute.insert(outcome.to_owned(), delta.max(0.0) * 60.0 / since.as_secs_f64());
                }
            }
            let buckets = |set: &[Series]| -> Vec<(f64, f64)> {
                let mut buckets: Vec<(f64, f64)> = set
                    .iter()
                    .filter(|s| s.name == "idemq_handler_duration_seconds_bucket" && of(s))
                    .filter_map(|s| Some((s.label("le")?.replace("+Inf", "inf").parse().ok()?, s.value)))
                    .collect();
                buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                buckets
            };
            let (mut window, earlier) = (buckets(now), buckets(before));
            if earlier.len() == window.len() {
                let delta: Vec<(f64, f64)> =
                    window.iter().zip(&earlier).map(|(now, then)| (now.0, now.1 - then.1)).collect();
                // A quiet minute has no handler time of its own: the figures since start.
                if delta.last().is_some_and(|last| last.1 > 0.0) {
                    window = delta;
                }
            }
            Figures {
                handler: handler.to_owned(),
                queue: queue.to_owned(),
                per_minute,
                over: since,
                p50: quantile(0.5, &window),
                p99: quantile(0.99, &window),
                in_flight: f64::from_bits(in_flight),
                paused: value(now, "idemq_kill_switch_open", None) > 0.0,
                trips: value(now, "idemq_kill_switch_trips_total", None),
                stream_lag: stream_lag(now, handler, queue),
            }
        })
        .collect()
}

/// `handler`'s lag on `stream`, if it is a stream it reads.
fn stream_lag(now: &[Series], handler: &str, stream: &str) -> Option<(f64, f64)> {
    let value = |name: &str| {
        now.iter()
            .find(|s| {
                s.name == name && s.label("handler") == Some(handler) && s.label("stream") == Some(stream)
            })
            .map(|s| s.value)
    };
    Some((value("idemq_stream_lag_messages")?, value("idemq_stream_lag_seconds").unwrap_or(0.0)))
}

/// The `q` quantile of cumulative `buckets` (upper bound, count), sorted by bound;
/// `None` without observations. Linear within the bucket it falls in; in the last
/// (`+Inf`) bucket, the bound below it.
pub(super) fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower);
            }
            let within = count - below;
            let share = if within > 0.0 { (rank - below) / within } else { 0.0 };
            return Some(lower + (bound - lower) * share);
        }
        (lower, below) = (bound, count);
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP idemq_in_flight Deliveries received and not yet settled.
# TYPE idemq_in_flight gauge
idemq_in_flight{queue="payments",handler="apply_payment"} 3
idemq_deliveries_total{queue="payments",handler="apply_payment",outcome="applied",kind=""} 120
idemq_deliveries_total{queue="payments",handler="apply_payment",outcome="dead_lettered",kind="permanent"} 2
idemq_deliveries_total{queue="payments",handler="apply_payment",outcome="dead_lettered",kind="bad_input"} 1
idemq_kill_switch_open{queue="payments",handler="apply_payment"} 1
idemq_handler_duration_seconds_bucket{le="0.001",queue="payments",handler="apply_payment"} 0
idemq_handler_duration_seconds_bucket{le="0.01",queue="payments",handler="apply_payment"} 100
idemq_handler_duration_seconds_bucket{le="0.1",queue="payments",handler="apply_payment"} 120
idemq_handler_duration_seconds_bucket{le="+Inf",queue="payments",handler="apply_payment"} 120
# EOF
"#;

    #[test]
    fn the_exposition_is_read_with_labels_escapes_and_infinities() {
        let series = parse(TEXT);
        assert_eq!(series.len(), 9);
        assert_eq!(series[0].label("handler"), Some("apply_payment"));
        assert_eq!(series.last().map(|s| s.label("le")), Some(Some("+Inf")));
        let escaped = parse("x{a=\"say \\\"hi\\\", ok\",b=\"2\"} 1.5\n");
        assert_eq!(escaped[0].label("a"), Some("say \"hi\", ok"));
        assert_eq!(escaped[0].value, 1.5);
    }

    #[test]
    fn rates_are_per_minute_over_the_window_summed_across_kinds() {
        let now = parse(TEXT);
        let before = parse(
            &TEXT.replace("} 120\n", "} 60\n").replace("kind=\"permanent\"} 2", "kind=\"permanent\"} 0"),
        );
        let figures = figures(&now, &before, Some(Duration::from_secs(30)));
        assert_eq!(figures.len(), 1);
        let f = &figures[0];
        assert_eq!(f.per_minute.get("applied"), Some(&120.0));
        assert_eq!(f.per_minute.get("dead_lettered"), Some(&4.0));
        assert!(f.paused);
        assert_eq!(f.in_flight, 3.0);
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket_as_histogram_quantile_does() {
        let buckets = [(0.001, 0.0), (0.01, 100.0), (0.1, 120.0), (f64::INFINITY, 120.0)];
        let p50 = quantile(0.5, &buckets).unwrap();
        assert!((p50 - (0.001 + 0.009 * 0.6)).abs() < 1e-9, "{p50}");
        let p99 = quantile(0.99, &buckets).unwrap();
        assert!((p99 - (0.01 + 0.09 * (118.8 - 100.0) / 20.0)).abs() < 1e-9, "{p99}");
        assert_eq!(quantile(0.5, &[(1.0, 0.0), (f64::INFINITY, 0.0)]), None);
        assert_eq!(quantile(0.99, &[(1.0, 1.0), (f64::INFINITY, 10.0)]), Some(1.0));
    }
}
