//! Log lines to stderr that never hold the process up: [`StderrLines`].
//!
//! A service's stderr is a pipe to something: a terminal, a log shipper, `head`.
//! Written to in line, from the runtime's tasks, it can stop the service:
//! - a **closed** pipe (`… 2>&1 | head -3`, a log shipper that died) fails every
//!   write with `EPIPE`; `tracing-subscriber` then reports the failure with
//!   `eprintln!`, which panics on the same closed pipe — in whatever task logged,
//!   the one that handles SIGTERM included (seen: a service that ignored SIGTERM for
//!   ever);
//! - a **full** pipe (a reader that stopped reading) blocks every write, and with it
//!   a tokio worker thread per task that logs, until none is left.
//!
//! So the log subscribers of `idemq::cli` and `idemq::otel` write through
//! [`StderrLines`]: each event's line goes to a bounded queue, and a thread of its own
//! writes the queue to stderr. A full queue drops the line (counted, and said on
//! stderr once it drains), a failed write is forgotten, and nothing that logs ever
//! waits. [`StderrLines::flush`] gives the last lines a bounded time at exit.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Lines the queue holds before new ones are dropped.
const CAPACITY: usize = 8 * 1024;

/// The process's one queue to stderr (made by the first [`StderrLines::get`]).
static LINES: OnceLock<StderrLines> = OnceLock::new();

/// A `tracing-subscriber` writer (its `MakeWriter` makes a `Line` per event) whose
/// lines a thread of its own writes to stderr: see the module docs (`app/stderr.rs`).
#[derive(Debug, Clone)]
pub struct StderrLines {
    sender: SyncSender<Vec<u8>>,
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    queued: AtomicU64,
    /// Written, or found unwritable and forgotten.
    done: AtomicU64,
    dropped: AtomicU64,
}

impl StderrLines {
    /// The process's queue to stderr, its writer thread started on first use.
    pub fn get() -> Self {
        LINES.get_or_init(Self::spawn).clone()
    }

    fn spawn() -> Self {
        let (sender, receiver) = sync_channel::<Vec<u8>>(CAPACITY);
        let counts = Arc::new(Counts::default());
        let written = Arc::clone(&counts);
        let spawned = std::thread::Builder::new().name("idemq-stderr".into()).spawn(move || {
            for line in receiver {
                let mut stderr = std::io::stderr();
                // Closed or failing: the line is forgotten, and so are the next ones
                // (each write fails at once), never a panic.
                if stderr.write_all(&line).is_ok() {
                    let dropped = written.dropped.swap(0, Ordering::Relaxed);
                    if dropped > 0 {
                        let _ = writeln!(
                            stderr,
                            "idemq: {dropped} log lines dropped: stderr was not read fast enough"
                        );
                    }
                }
                written.done.fetch_add(1, Ordering::Release);
            }
        });
        if let Err(err) = spawned {
            // No thread, no log: the runtime must not fail for it.
            let _ = writeln!(std::io::stderr(), "idemq: cannot start the log thread ({err}); logs are lost");
        }
        Self { sender, counts }
    }

    /// Waits, at most `bound`, until every line queued so far is written (or found
    /// unwritable): for the last lines before the process exits. A stderr nobody
    /// reads does not hold the exit past `bound`.
    pub fn flush(&self, bound: Duration) {
        let queued = self.counts.queued.load(Ordering::Acquire);
        let deadline = Instant::now() + bound;
        while self.counts.done.load(Ordering::Acquire) < queued && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Flushes the process's queue, if it has one (see [`Self::flush`]).
    pub fn flush_if_used(bound: Duration) {
        if let Some(lines) = LINES.get() {
            lines.flush(bound);
        }
    }

    fn send(&self, line: Vec<u8>) {
        match self.sender.try_send(line) {
            Ok(()) => {
                self.counts.queued.fetch_add(1, Ordering::Release);
            }
            Err(TrySendError::Full(_)) => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// One event's line, sent to the queue when the subscriber drops it.
#[derive(Debug)]
pub struct Line {
    lines: StderrLines,
    buffer: Vec<u8>,
}

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if !self.buffer.is_empty() {
            self.lines.send(std::mem::take(&mut self.buffer));
        }
    }
}

impl StderrLines {
    /// The writer of one event's line (a subscriber's `MakeWriter::make_writer`: the
    /// CLI's is in `idemq-cli`, which has `tracing-subscriber` whether or not `otel` is
    /// on).
    pub fn line(&self) -> Line {
        Line { lines: self.clone(), buffer: Vec::with_capacity(256) }
    }
}

#[cfg(feature = "otel")]
impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for StderrLines {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        self.line()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_lines_without_waiting() {
        let (sender, _receiver) = sync_channel::<Vec<u8>>(1);
        let lines = StderrLines { sender, counts: Arc::default() };
        for _ in 0..3 {
            let mut line = lines.line();
            line.write_all(b"a line\n").expect("buffered");
        }
        assert_eq!(lines.counts.queued.load(Ordering::Relaxed), 1);
        assert_eq!(lines.counts.dropped.load(Ordering::Relaxed), 2);
        // Nothing reads: the flush gives up at its bound.
        let started = Instant::now();
        lines.flush(Duration::from_millis(50));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
