//! The process's log, captured for tests that check what idemq says
//! (`#[path = "support/logs.rs"] mod logs;`).

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// What the test binary's subscriber wrote.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process's subscriber, writing what `filter` lets through (`idemq=info`) into
/// one buffer: installed by the first test to ask, with its filter, so every test of
/// the binary asks first, with the same filter (a `Bed` would otherwise install its
/// own subscriber).
pub(crate) fn captured(filter: &str) -> Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED
        .get_or_init(|| {
            let captured = Captured::default();
            let writer = captured.clone();
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .init();
            captured
        })
        .clone()
}

impl Captured {
    /// The lines logged so far that name `queue` and hold `words`.
    pub(crate) fn lines(&self, queue: &str, words: &str) -> Vec<String> {
        let log = String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned();
        log.lines().filter(|line| line.contains(queue) && line.contains(words)).map(str::to_owned).collect()
    }
}
