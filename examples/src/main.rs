//! The `payments` binary.
//!
//! Run with: `cargo run --release -p idemq-example-payments -- demo`
//!
//! ```text
//! payments migrate   apply idemq's migrations and the demo's tables, then exit
//! payments run       declare the topology and consume until SIGINT/SIGTERM
//! payments demo      migrate, publish a burst with duplicates and bad messages,
//!                    consume it, print a summary and check the ledger
//! ```
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/idemq_demo`),
//! `RUST_LOG` (default `warn`; `error` for `demo`).

use std::process::ExitCode;

use idemq::Runtime;
use idemq_example_payments::demo::{self, DemoConfig};
use idemq_example_payments::{apply_payment, migrate, topology, DEFAULT_DATABASE_URL, QUEUE};

const USAGE: &str = "usage: payments <migrate|run|demo> [--concurrency N] [--payments N]";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The demo reports its dead letters in its summary; `run` logs each one.
    let default_filter = if args.first().map(String::as_str) == Some("demo") { "error" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .init();
    let amqp_url = std::env::var("AMQP_URL").unwrap_or_else(|_| idemq::DEFAULT_AMQP_URL.into());
    let database_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let mut config = DemoConfig::default();
    if let Err(err) = parse_flags(&args[args.len().min(1)..], &mut config) {
        eprintln!("{err}\n{USAGE}");
        return ExitCode::from(2);
    }
    let result = match args.first().map(String::as_str) {
        Some("migrate") => migrate(&database_url).await.map_err(Into::into).map(|()| {
            println!("migrations applied to {}", idemq::redact(&database_url));
        }),
        Some("run") => run(&amqp_url, &database_url, config.concurrency).await,
        Some("demo") => match demo::run(&amqp_url, &database_url, config).await {
            Ok(report) => {
                println!("{report}");
                if report.ledger_ok {
                    Ok(())
                } else {
                    Err("the ledger does not match the payments".into())
                }
            }
            Err(err) => Err(err),
        },
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // Driver errors may quote a URL, password and all.
            eprintln!("payments: {}", idemq::redact(&err.to_string()));
            ExitCode::FAILURE
        }
    }
}

async fn run(
    amqp_url: &str,
    database_url: &str,
    concurrency: usize,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    migrate(database_url).await?;
    Runtime::builder()
        .amqp_url(amqp_url)
        .database_url(database_url)
        .topology(topology())
        .consume(QUEUE, apply_payment)
        .concurrency(concurrency)
        .build()?
        .run(idemq::shutdown_signal())
        .await?;
    Ok(())
}

fn parse_flags(flags: &[String], config: &mut DemoConfig) -> Result<(), String> {
    let mut flags = flags.iter();
    while let Some(flag) = flags.next() {
        let value = flags.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number: usize = value.parse().map_err(|_| format!("{flag} takes a number, not '{value}'"))?;
        match flag.as_str() {
            "--concurrency" if number > 0 => config.concurrency = number,
            "--payments" if number > 0 => config.payments = number,
            _ => return Err(format!("unknown flag or bad value: {flag} {value}")),
        }
    }
    Ok(())
}
