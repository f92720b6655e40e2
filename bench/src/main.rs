//! Run with: cargo run --release -p idemq-bench
//!
//! What idemq costs, and what group commit and lanes buy, measured side by side in
//! one invocation on the payments workload (`idemq-example-payments`: a ledger row
//! and a balance upsert per payment). `--help` lists the flags; BENCHMARKS.md says
//! what each line means and keeps a run's table.
//!
//! **Contenders** (numbered as in the summary):
//! 1. *raw*: lapin with manual acks and no database, the broker's ceiling.
//! 2. *baseline*: the hand-written per-message loop (dedup row + effect in one
//!    transaction, ack after COMMIT) at its best concurrency, picked by a short
//!    sweep unless `--baseline-concurrency` is given.
//! 3. *idemq-per-message*: idemq with `.batch_size(1)`, at the baseline's concurrency.
//! 4. *idemq-group*: idemq with the builder's defaults (group commit), a handler
//!    without a lane (the demo's dedup name and effect, `record_payment`; the demo's
//!    outbox event is left out, as the baseline has none).
//! 5. *idemq-lanes*: the same with the demo's lane, the account.
//! 6. *dups-only*: idemq-lanes (and the baseline) on the same backlog with every
//!    payment already applied before the run.
//! 7. and 8. *idemq-outbox*, *idemq-batch*: an event per payment through the outbox;
//!    the second with the demo's batch handler as it is.
//! 9. *broker-events*: the broker's ceiling for the demo's messaging, no database:
//!    consume, publish an event per delivery with pipelined confirms, ack once its
//!    events are confirmed (issue 39).
//! 10. *database*: the database's ceiling, no broker in the measured window: the
//!     backlog drained into memory first, then idemq-batch's rows (dedup, ledger,
//!     balance, outbox row and its removal) written by a batched loop, two
//!     transactions in flight.
//! 11. *expert*: the best hand-written loop for this workload with idemq's
//!     guarantees, batched and pipelined (dedup row in the transaction, ack after
//!     COMMIT, the event published after COMMIT from an outbox row).
//!
//! For a contender that publishes events (7, 8, 11) the clock stops once the last
//! event is published, not at the last ack.
//!
//! Each run also says where the machine's CPU went per delivery: the consumer's own,
//! the broker's (`beam.smp`) and PostgreSQL's (every `postgres` process).
//!
//! plus a *light load* (one message at a time, end-to-end latency) for the baseline
//! and idemq per-message, group commit and lanes, and `--rss-check N` (peak RSS at a
//! larger backlog against the rounds').
//!
//! **Curves** (off unless asked for): `--curve-backlog N1,N2,..` runs every backlog
//! contender of a round once more at each of these numbers of payments (the rounds'
//! duplicates, accounts and concurrency), `--curve-concurrency C1,C2,..` each
//! contender that takes a concurrency (baseline, idemq per-message) at each of these
//! on the rounds' backlog; both after the rounds, one run per point. Each curve is
//! drawn as a line chart of msg/s, a line per contender (`<plot>-backlog.svg`,
//! `<plot>-concurrency.svg` beside `--plot`'s chart, each with its JSON). The
//! baseline is measured again at each concurrency rather than taken from the sweep,
//! so that every point of a curve comes from the same stretch of the invocation
//! (`curves.rs`).
//!
//! **Method**, per run: the tables are truncated and a CHECKPOINT taken; a fresh,
//! uniquely named quorum queue (idemq's [`idemq::Topology`], the same kind for every
//! contender) gets the whole backlog, persistent, with pipelined confirms, before the
//! consumer starts; the contender runs in a child process (`bench --child …`, this
//! same binary), so its peak RSS and CPU time are its own, and reports one JSON line.
//! The clock runs from the consumer's start (connects included) until every
//! delivery is settled. Then the run's queues are deleted and the check runs:
//! ledger rows = dedup rows = distinct payments, every balance = the sum of its
//! payments, the contender's own applied/duplicate counts, nothing left in the
//! queue, its DLQ or its wait queues. A failed check is printed loudly and makes
//! the exit code nonzero. Rounds alternate the contenders; the summary reports
//! medians and their ratios, and the same medians are written as a bar chart (SVG)
//! with a JSON file beside it (`--plot`, default `bench/results/latest.svg`). The
//! machine is small and shared by the broker and the database: compare within one
//! invocation, never absolute numbers across them.
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/idemq_bench`, created
//! and migrated if missing), `RUST_LOG` (default `warn`).

mod check;
mod child;
mod config;
mod contenders;
mod curves;
mod metrics;
mod parent;
mod plan;
mod plot;
mod report;
mod results;
mod spawn;
mod urls;
mod workload;

use std::process::ExitCode;

use config::{Config, ParseError, USAGE};
use urls::Urls;

type BenchError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let urls = Urls::from_env();
    if args.first().map(String::as_str) == Some("--child") {
        return child::main(&args[1..], &urls).await;
    }
    let config = match Config::parse(&args) {
        Ok(config) => config,
        Err(ParseError::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(ParseError::Bad(err)) => {
            eprintln!("{err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match parent::run(&config, &urls).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench: a correctness check failed (see the rows marked FAILED)");
            ExitCode::FAILURE
        }
        Err(err) => {
            // Each cause once; driver errors may quote a URL, password and all.
            eprintln!("bench: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}
