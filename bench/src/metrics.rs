//! What a child measures: settled deliveries and their latency ([`Recorder`]), CPU
//! time (this process's and the whole machine's) and peak RSS.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// Sub-buckets per power of two in [`Histogram`]: values are kept within 1/64 (1.6%).
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Enough buckets for any `u64`.
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// A latency histogram in microseconds, log-linear (exact below 64 µs, then 64
/// buckets per power of two). Fixed size (~30 KiB) whatever the number of samples,
/// so a longer backlog does not grow the consumer's memory; lock-free, so the
/// observer that feeds it does not serialize deliveries.
pub(crate) struct Histogram {
    buckets: Box<[AtomicU64]>,
}

impl Histogram {
    pub(crate) fn new() -> Self {
        Self { buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect() }
    }

    fn index(micros: u64) -> usize {
        if micros < SUB as u64 {
            return micros as usize;
        }
        let top = 63 - micros.leading_zeros(); // >= SUB_BITS
        let shift = top - SUB_BITS;
        (shift as usize + 1) * SUB + ((micros >> shift) as usize - SUB)
    }

    /// The smallest value that falls in bucket `index` (`index` may be one past the
    /// last bucket: 2^64).
    fn lower_bound(index: usize) -> u128 {
        if index < SUB {
            return index as u128;
        }
        let shift = index / SUB - 1;
        ((SUB + index % SUB) as u128) << shift
    }

    pub(crate) fn record(&self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.buckets[Self::index(micros)].fetch_add(1, Ordering::Relaxed);
    }

    /// The `q` quantile (0..=1), as the middle of its bucket; `None` without samples.
    fn quantile(&self, counts: &[u64], total: u64, q: f64) -> Option<f64> {
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total.max(1));
        let mut seen = 0;
        for (index, &count) in counts.iter().enumerate() {
            seen += count;
            if count > 0 && seen >= rank {
                let (low, high) = (Self::lower_bound(index), Self::lower_bound(index + 1));
                return Some((low + high) as f64 / 2.0);
            }
        }
        None
    }

    pub(crate) fn percentiles(&self) -> Percentiles {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let samples = counts.iter().sum();
        let us = |q| self.quantile(&counts, samples, q);
        Percentiles { samples, p50_us: us(0.50), p99_us: us(0.99) }
    }
}

/// Latency percentiles of one run, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct Percentiles {
    pub(crate) samples: u64,
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
}

/// How a delivery ended, as far as the benchmark is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Its effect committed (and it was acked).
    Applied,
    /// Its dedup row was there: acked without the effect.
    Duplicate,
    /// Acked by the raw consumer, which has no database.
    Acked,
    /// Settled otherwise for good: dead-lettered, or acked as already copied.
    Failed,
}

/// The counters and latency a contender feeds, one call per delivery.
pub(crate) struct Recorder {
    epoch: Instant,
    applied: AtomicU64,
    duplicates: AtomicU64,
    acked: AtomicU64,
    failed: AtomicU64,
    /// Deliveries that will come again (requeued, sent for a retry, cut off).
    returned: AtomicU64,
    /// When the latest delivery settled, in nanoseconds since `epoch` (+1; 0: none).
    last_settled: AtomicU64,
    latency: Histogram,
    settled_one: Notify,
}

/// A copy of a [`Recorder`]'s counters.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct Counts {
    pub(crate) applied: u64,
    pub(crate) duplicates: u64,
    pub(crate) acked: u64,
    pub(crate) failed: u64,
    pub(crate) returned: u64,
}

impl Counts {
    /// Deliveries settled for good, whichever way.
    pub(crate) fn settled(&self) -> u64 {
        self.applied + self.duplicates + self.acked + self.failed
    }
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            applied: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            last_settled: AtomicU64::new(0),
            latency: Histogram::new(),
            settled_one: Notify::new(),
        }
    }

    /// One delivery, received at `received`, ended as `how` at `settled`.
    pub(crate) fn settle(&self, how: Settle, received: Instant, settled: Instant) {
        self.latency.record(settled.saturating_duration_since(received));
        let since_epoch = u64::try_from(settled.saturating_duration_since(self.epoch).as_nanos());
        self.last_settled.fetch_max(since_epoch.unwrap_or(u64::MAX - 1) + 1, Ordering::Relaxed);
        let counter = match how {
            Settle::Applied => &self.applied,
            Settle::Duplicate => &self.duplicates,
            Settle::Acked => &self.acked,
            Settle::Failed => &self.failed,
        };
        counter.fetch_add(1, Ordering::Release);
        self.settled_one.notify_one();
    }

    /// One delivery that goes back to the broker and will come again.
    pub(crate) fn returned(&self) {
        self.returned.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn counts(&self) -> Counts {
        let get = |c: &AtomicU64| c.load(Ordering::Acquire);
        Counts {
            applied: get(&self.applied),
            duplicates: get(&self.duplicates),
            acked: get(&self.acked),
            failed: get(&self.failed),
            returned: get(&self.returned),
        }
    }

    /// In-process latency (received → settled) of every settled delivery.
    pub(crate) fn latency(&self) -> Percentiles {
        self.latency.percentiles()
    }

    /// Waits until `target` deliveries are settled, then returns when the latest one
    /// settled; `None` after `timeout`.
    pub(crate) async fn settled_at(&self, target: u64, timeout: Duration) -> Option<Instant> {
        let wait = async {
            // A `notify_one` without a waiter leaves a permit: no wake-up is lost
            // between the check and the wait.
            while self.counts().settled() < target {
                self.settled_one.notified().await;
            }
        };
        tokio::time::timeout(timeout, wait).await.ok()?;
        match self.last_settled.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(self.epoch + Duration::from_nanos(nanos - 1)),
        }
    }
}

/// `sysconf(_SC_CLK_TCK)`, the unit of `/proc`'s CPU times: 100 on every mainstream Linux.
const TICKS_PER_SECOND: f64 = 100.0;

fn ticks(ticks: u64) -> Duration {
    Duration::from_secs_f64(ticks as f64 / TICKS_PER_SECOND)
}

/// CPU time (user + system) this process has used so far, from `/proc/self/stat`;
/// `None` where that file does not exist. Resolution: one clock tick (10 ms).
pub(crate) fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the parenthesised command name: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some(ticks(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?))
}

/// CPU time the whole machine has been busy so far, summed over its cores, from the
/// first line of `/proc/stat`: user, nice, system, irq, softirq and steal (not idle,
/// not iowait). It includes the broker, PostgreSQL and the bench's parent process.
pub(crate) fn machine_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let fields: Vec<u64> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let busy = [0, 1, 2, 5, 6, 7].iter().map(|&i| fields.get(i).copied().unwrap_or(0)).sum();
    Some(ticks(busy))
}

/// CPU time used so far by the broker (`beam.smp`) and by PostgreSQL (every
/// `postgres` process: the server's and each connection's backend), summed over
/// their processes from `/proc/<pid>/stat`. A process that exits inside a window
/// takes its time with it: the measured window ends before the consumer's
/// connections close, so its own backends are counted.
pub(crate) fn services_cpu() -> (Option<Duration>, Option<Duration>) {
    let Ok(entries) = std::fs::read_dir("/proc") else { return (None, None) };
    let (mut broker, mut postgres) = (None::<u64>, None::<u64>);
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let Some((head, rest)) = stat.rsplit_once(')') else { continue };
        let comm = head.split_once('(').map_or("", |(_, comm)| comm);
        let slot = match comm {
            "beam.smp" => &mut broker,
            "postgres" => &mut postgres,
            _ => continue,
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let used = fields.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + fields.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        *slot = Some(slot.unwrap_or(0) + used);
    }
    (broker.map(ticks), postgres.map(ticks))
}

/// CPU time used since `start` (taken by [`process_cpu`] or [`machine_cpu`]).
pub(crate) fn since(now: Option<Duration>, start: Option<Duration>) -> Option<Duration> {
    Some(now?.saturating_sub(start?))
}

/// This process's peak resident set size so far (`VmHWM` in `/proc/self/status`), in KiB.
pub(crate) fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|line| line.strip_prefix("VmHWM:"))?;
    line.trim().strip_suffix("kB")?.trim().parse().ok()
}

/// The median of `values` (the mean of the middle two for an even count).
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut sorted: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_falls_in_a_bucket_whose_bounds_hold_it() {
        for micros in (0..5_000).chain([65_535, 1 << 20, (1 << 40) + 12_345, u64::MAX / 3]) {
            let index = Histogram::index(micros);
            assert!(index < BUCKETS, "{micros}");
            assert!(Histogram::lower_bound(index) <= u128::from(micros), "{micros}");
            assert!(u128::from(micros) < Histogram::lower_bound(index + 1), "{micros}");
        }
        assert_eq!(Histogram::index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn percentiles_are_within_a_bucket_of_the_exact_ones() {
        let histogram = Histogram::new();
        for micros in 1..=1_000 {
            histogram.record(Duration::from_micros(micros));
        }
        let p = histogram.percentiles();
        assert_eq!(p.samples, 1_000);
        let (p50, p99) = (p.p50_us.unwrap(), p.p99_us.unwrap());
        assert!((p50 - 500.0).abs() <= 500.0 / 64.0, "{p50}");
        assert!((p99 - 990.0).abs() <= 990.0 / 64.0, "{p99}");
        assert!(Histogram::new().percentiles().p50_us.is_none());
    }

    #[test]
    fn median_of_odd_even_and_no_values() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median([]), None);
    }
}
