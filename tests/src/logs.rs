//! The process's log, captured for tests that check what idemq says.
//!
//! One subscriber per test process ([`crate::init_tracing`], which every fixture
//! calls): the test output, filtered by `RUST_LOG` (default `warn`), and a buffer
//! of everything `idemq` logs at `info` and above. The tests of a binary run side by
//! side, so a test reads only the lines that name its own queue ([`Captured::lines`]).

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// What idemq logged in this process, at `info` and above.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// The lines logged so far that name `queue` and hold `words`.
    pub fn lines(&self, queue: &str, words: &str) -> Vec<String> {
        let log = String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned();
        log.lines().filter(|line| line.contains(queue) && line.contains(words)).map(str::to_owned).collect()
    }
}

/// The process's capture, installing the process's subscriber if no test has yet.
pub fn captured() -> Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED
        .get_or_init(|| {
            let captured = Captured::default();
            let writer = captured.clone();
            let shown = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
            // Fails if the process set a subscriber of its own (otel.rs does): then
            // nothing is captured, and a test reading the capture says so by failing.
            let _ = tracing_subscriber::registry()
                .with(tracing_subscriber::fmt::layer().with_test_writer().with_filter(shown))
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(move || writer.clone())
                        .with_ansi(false)
                        .with_filter(EnvFilter::new("idemq=info")),
                )
                .try_init();
            captured
        })
        .clone()
}
