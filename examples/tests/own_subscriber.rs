//! An application that sets up its own `tracing` subscriber before the CLI keeps it:
//! `Cli::run_from` neither panics nor replaces it, and idemq's events reach it. In a
//! test binary of its own, since a global subscriber is one per process.

use std::io::Write;
use std::sync::{Arc, Mutex};

use idemq::cli::Cli;
use idemq::Runtime;
use idemq_example_payments::{apply_payment, migrate, topology, QUEUE};

/// What the application's subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stages an application whose global subscriber (its own format: no timestamps, no
/// colours, level `debug` for idemq) exists before `Cli::run_from(["payments", "run",
/// …])`, with a broker that refuses connections and a startup timeout: `run` must
/// exit 1 as usual, and its start line and start-up waits must be in the
/// application's log.
#[tokio::test(flavor = "multi_thread")]
async fn an_application_that_installed_its_own_subscriber_keeps_it() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("idemq=debug"))
        .with_writer(move || writer.clone())
        .without_time()
        .with_ansi(false)
        .init();

    let database = format!("idemq_own_subscriber_{}", std::process::id());
    let database_url = format!("postgres://postgres@127.0.0.1:5432/{database}");
    let refusing =
        std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let builder = Runtime::builder().topology(topology()).consume(QUEUE, apply_payment);
    let code = Cli::new("payments", builder)
        .setup(|url| async move { migrate(&url).await.map_err(Into::into) })
        .run_from([
            "payments",
            "run",
            "--startup-timeout",
            "2s",
            "--log-format",
            "json",
            "--amqp-url",
            &format!("amqp://guest:guest@127.0.0.1:{refusing}/%2f"),
            "--database-url",
            &database_url,
        ])
        .await;
    let _ = std::process::Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c"])
        .arg(format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"))
        .output();

    assert_eq!(code, std::process::ExitCode::FAILURE);
    let log = String::from_utf8_lossy(&captured.0.lock().expect("lock")).into_owned();
    // The application's format, not the CLI's JSON: its subscriber stayed.
    let start = log.lines().find(|line| line.contains("starting")).unwrap_or_else(|| panic!("{log}"));
    assert!(start.starts_with(" INFO idemq::engine::runtime::run: starting"), "{start}");
    assert!(log.contains("RabbitMQ is unreachable at start-up"), "{log}");
    assert!(!log.contains("\"level\""), "the CLI's JSON subscriber replaced the application's: {log}");
}
