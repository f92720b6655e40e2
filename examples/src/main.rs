//! The `payments` binary: idemq's CLI for the payments handler, plus the demo.
//!
//! Run with: `cargo run -p idemq-example-payments -- demo`
//!
//! ```text
//! payments run       declare the topology and consume the queue and the stream until
//!                    SIGINT/SIGTERM
//! payments migrate   apply idemq's migrations and the demo's tables (--status: list them)
//! payments declare   show the topology and what exists (--apply: declare it)
//! payments status    queue depths, consumers, dead letters, retry wait queues, dedup rows,
//!                    outbox backlog
//! payments gc        delete dedup rows older than --keep
//! payments demo      migrate, publish a burst with duplicates and bad messages (and
//!                    payments to the stream), consume it, print a summary and check
//!                    the ledger and the events
//! payments orders    run the order saga over a burst of orders (--orders, --window
//!                    in seconds): shipped ones captured, the rest released by their
//!                    timeout; check each ended one way
//! payments saga show NAME KEY   print one saga's state
//! ```
//! `payments --help` and `payments <command> --help` say more; `payments --version`
//! prints the version. Environment: `AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/idemq_demo`), or `AMQP_URL_FILE` /
//! `DATABASE_URL_FILE` naming a file that holds the URL (a container secret),
//! `RUST_LOG` (default `info`; `error` for `demo`), `--log-format json`, and the
//! settings of `idemq::cli`.

use std::process::ExitCode;

use idemq::cli::clap::builder::RangedU64ValueParser;
use idemq::cli::clap::{Arg, ArgMatches, Command};
use idemq::cli::Cli;
use idemq::Runtime;
use idemq_example_payments::demo::{self, DemoConfig};
use idemq_example_payments::{
    apply_payment, apply_stream_payment, create_database, topology, DEFAULT_DATABASE_URL, MIGRATIONS, QUEUE,
    STREAM,
};

#[tokio::main]
async fn main() -> ExitCode {
    // The demo's database unless the environment names one. A problem with the
    // environment (a URL and its file both set, an unreadable file) is the CLI's to
    // report: it reads the same variables, after `--help` had its chance.
    let builder = match idemq::connect::env_url("DATABASE_URL", DEFAULT_DATABASE_URL) {
        Ok(database_url) => Runtime::builder().database_url(database_url),
        Err(_) => Runtime::builder(),
    };
    let builder =
        builder.topology(topology()).consume(QUEUE, apply_payment).consume(STREAM, apply_stream_payment);
    let cli = Cli::new("payments", builder)
        .version(env!("CARGO_PKG_VERSION"))
        .about("exactly-once payments from RabbitMQ into PostgreSQL, with idemq")
        .setup(|url| async move { create_database(&url).await.map_err(Into::into) })
        .migrations(&MIGRATIONS);
    let command = cli
        .command()
        .subcommand(
            Command::new("demo")
                .about("publish a burst with duplicates and bad messages, consume it, check the ledger and the events")
                .arg(number("payments", "distinct payments to publish (default 2000)"))
                .arg(number("concurrency", "transactions at once (default 16)")),
        )
        .subcommand(
            Command::new("orders")
                .about("run the order saga over a burst of orders: shipped ones captured, the rest released by their timeout")
                .arg(number("orders", "orders to place (default 200)"))
                .arg(number("window", "seconds an order waits to ship before its payment is released (default 5)")),
        );
    let matches = match command.try_get_matches() {
        Ok(matches) => matches,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    if let Some(orders) = matches.subcommand_matches("orders") {
        idemq::cli::init_tracing(&matches, "error");
        return run_orders(&matches, orders).await;
    }
    match matches.subcommand_matches("demo") {
        Some(demo) => {
            // The demo reports its dead letters in its summary: errors only. The CLI's
            // own subcommands set up their logs themselves (`info`; `run` logs each
            // dead letter).
            idemq::cli::init_tracing(&matches, "error");
            run_demo(&matches, demo).await
        }
        None => cli.run_matches(&matches).await,
    }
}

fn number(name: &'static str, help: &'static str) -> Arg {
    Arg::new(name).long(name).value_parser(RangedU64ValueParser::<usize>::new().range(1..)).help(help)
}

/// The broker's and the database's URLs: the CLI's settings, else the demo's defaults.
fn urls(matches: &ArgMatches) -> Result<(String, String), ExitCode> {
    let urls = idemq::cli::amqp_url(matches).and_then(|amqp| Ok((amqp, idemq::cli::database_url(matches)?)));
    match urls {
        Ok((amqp_url, database_url)) => Ok((
            amqp_url.unwrap_or_else(|| idemq::connect::DEFAULT_AMQP_URL.to_owned()),
            database_url.unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
        )),
        Err(err) => {
            eprintln!("payments: {}", err.report());
            Err(ExitCode::FAILURE)
        }
    }
}

async fn run_orders(matches: &ArgMatches, orders: &ArgMatches) -> ExitCode {
    let (amqp_url, database_url) = match urls(matches) {
        Ok(urls) => urls,
        Err(code) => return code,
    };
    let count = orders.get_one::<usize>("orders").copied().unwrap_or(200);
    let window =
        std::time::Duration::from_secs(orders.get_one::<usize>("window").copied().unwrap_or(5) as u64);
    match idemq_example_payments::orders_run::run(&amqp_url, &database_url, count, window).await {
        Ok(report) => {
            println!("{report}");
            if report.ok {
                ExitCode::SUCCESS
            } else {
                eprintln!("payments: an order saga did not end one way (see above)");
                ExitCode::FAILURE
            }
        }
        Err(err) => {
            eprintln!("payments: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}

async fn run_demo(matches: &ArgMatches, demo: &ArgMatches) -> ExitCode {
    let (amqp_url, database_url) = match urls(matches) {
        Ok(urls) => urls,
        Err(code) => return code,
    };
    let defaults = DemoConfig::default();
    let config = DemoConfig {
        payments: demo.get_one::<usize>("payments").copied().unwrap_or(defaults.payments),
        concurrency: demo.get_one::<usize>("concurrency").copied().unwrap_or(defaults.concurrency),
        ..defaults
    };
    let result = match demo::run(&amqp_url, &database_url, config).await {
        Ok(report) => {
            println!("{report}");
            if report.ledger_ok {
                Ok(())
            } else {
                Err("the ledger does not match the payments".into())
            }
        }
        Err(err) => Err(err),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // Each cause once; driver errors may quote a URL, password and all.
            eprintln!("payments: {}", idemq::connect::report(&*err));
            ExitCode::FAILURE
        }
    }
}
