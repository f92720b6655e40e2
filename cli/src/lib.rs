//! The application's command line (feature `cli`): the binary's `main` hands its
//! handlers and topology to idemq — a [`RuntimeBuilder`] — and gets subcommands:
//!
//! ```text
//! <app> run      [--concurrency N] [--batch-size N] [--prefetch N] [--queue Q]... [--http-addr ADDR]
//!                [--retention 30d [--replay-window 7d]] [--startup-timeout 2m] [--consumer-timeout 30m]
//!                [--linger D] [--handler-timeout D] [--max-body-bytes N] [--on-conflict dead-letter|ignore]
//!                [--namespace NS] [--shutdown-deadline D] [--heartbeat D] [--reconnect-max-backoff D]
//!                [--database-retry-limit D] [--relay on|off] [--relay-poll-interval D]
//!                [--kill-switch 15%/10/1m/1m|off] [--rate-limit HANDLER=N]... [--handler-concurrency HANDLER=N]...
//!                [--console-actions]                                  consume until SIGINT/SIGTERM (the console under /console)
//! <app> migrate  [--status]                                           idemq's (and the app's) migrations
//! <app> declare  [--apply] [--missing]                                a line per queue (with its DLQ and wait queues), exchanges, bindings: what exists
//! <app> status   [--nonzero]                                          a line per queue: ready, consumers, dead letters, retries; streams' ends and lags
//! <app> gc       [--keep 30d] [--replay-window 7d]                    delete dedup rows past the retention, once
//! <app> dlq      list | show N | replay | purge  [--queue Q]          inspect and replay dead letters
//! <app> saga     show NAME KEY                                        one saga: running or finished, its times, timeouts and state
//! <app> console  [--addr 127.0.0.1:9465] [--console-actions]         the operations console alone ([`Console`])
//! <app> --version                                                     the name and version (see [`Cli::version`]), exit 0
//! ```
//!
//! Every subcommand but `run` works without consumers (`dlq` is described in its
//! module, `dlq.rs`: browsing returns what it does not act on; `saga` in
//! `saga.rs`). Settings come from flags, then
//! the environment (`AMQP_URL`, `DATABASE_URL`, `IDEMQ_CONCURRENCY`,
//! `IDEMQ_BATCH_SIZE`, `IDEMQ_PREFETCH`, `IDEMQ_HTTP_ADDR`, `IDEMQ_RETENTION`,
//! `IDEMQ_REPLAY_WINDOW`, `IDEMQ_STARTUP_TIMEOUT`, `IDEMQ_RELEASE_STREAMS_AFTER`, `IDEMQ_CONSUMER_TIMEOUT`,
//! `IDEMQ_LINGER`, `IDEMQ_HANDLER_TIMEOUT`, `IDEMQ_MAX_BODY_BYTES`, `IDEMQ_ON_CONFLICT`,
//! `IDEMQ_REPLICATION_CHECK`, `IDEMQ_NAMESPACE`, `IDEMQ_SHUTDOWN_DEADLINE`, `IDEMQ_HEARTBEAT`,
//! `IDEMQ_RECONNECT_MAX_BACKOFF`, `IDEMQ_DATABASE_RETRY_LIMIT`, `IDEMQ_RELAY` (`on` or
//! `off`), `IDEMQ_RELAY_POLL_INTERVAL`, `IDEMQ_KILL_SWITCH`, `IDEMQ_RATE_LIMIT`,
//! `IDEMQ_HANDLER_CONCURRENCY`), then a TOML file (`--config`, or
//! `IDEMQ_CONFIG`) with the same names in snake case (`amqp_url`, `database_url`,
//! `concurrency`, `batch_size`, `prefetch`, `http_addr`, `retention`, `replay_window`,
//! `startup_timeout`, `release_streams_after`, `consumer_timeout`, `linger`, `handler_timeout`,
//! `max_body_bytes`, `on_conflict`, `replication_check`, `namespace`, `shutdown_deadline`, `heartbeat`,
//! `reconnect_max_backoff`, `database_retry_limit`, `relay`, `relay_poll_interval`,
//! `kill_switch`, `rate_limit`, `handler_concurrency`),
//! then the code's builder (the guide's Configuration table, `docs/operating.md`, lists them all). They are checked before anything connects; errors name the setting
//! and say what to write. Passwords in URLs are redacted in every message.
//!
//! Each URL may instead come from a file holding it (a container secret, its
//! surrounding whitespace trimmed): `--amqp-url-file` / `AMQP_URL_FILE` and
//! `--database-url-file` / `DATABASE_URL_FILE`, or `amqp_url_file` /
//! `database_url_file` in the TOML file. A URL and its file given together — as flags
//! or variables, or both in the TOML file — is an error: keep one. Flags and the
//! environment still win over the TOML file.
//!
//! # Reading `status` and `declare`
//!
//! `status` prints one line per queue the code consumes or declares — its ready
//! messages and consumers, the dead letters in its dead-letter queue and the retries
//! waiting in its wait queues — and below it a line only where one is needed: a wait
//! queue holding retries, what is missing (with the command that declares it), what
//! could not be read. `status --nonzero` keeps only the queues with something to look
//! at (messages ready, dead letters, retries waiting, a stream behind, anything
//! missing or unreadable); the dedup rows, the outbox backlog and the sagas always
//! print. A missing exchange is named: publishing to it fails. The sagas get a line
//! per name — how many run, the oldest's age, how many finished are kept — or
//! `sagas: none`; `saga show NAME KEY` prints one.
//!
//! ```text
//! queue                       ready   consumers   dead letters   retrying
//! payments                        0           1              6          2  consumed by apply_payment; retries wait 1s, 5s, 30s, 2m, 10m
//!   payments.retry.600000ms       2  retries of payments after 10m
//! payments.applied               60           0              0          -  declared; no handler here consumes it
//! payments.stream            stream           -              0          -  a stream, consumed by apply_stream_payment
//!   end: offset 264; offsets 0–264 kept (265 messages)
//!   apply_stream_payment: applied up to offset 259, lag 5 (its offset last moved 2026-12-04 16:21:13 UTC); owned by the PostgreSQL session of pid 18138 from 10.0.0.7:34326, connected since 2026-12-04 16:21:09 UTC
//! exchanges: payments.events (exist)
//! dead letters: `payments dlq list` shows them, `payments dlq replay` sends them back
//! dedup rows: 60
//! outbox backlog:        0
//! saga order: 2 running, the oldest for 1h 5m; 1 finished (kept)
//! sagas: `payments saga show NAME KEY` shows one
//! ```
//!
//! A **stream** keeps what is read, so the broker's count of its messages says
//! nothing of its consumers (a stream read to its end still holds all of it), and
//! RabbitMQ counts no consumers on it: its line shows `stream` and `-`. Below it,
//! its end (its last offset, read from the broker by consuming from `last`), then
//! each handler consuming it: the offset it applied up to (`idemq_stream_offsets`),
//! its **lag** (the messages after that offset), and the process that **owns** it
//! now — the PostgreSQL session holding the stream's owner lock, by pid, client
//! address (find the process with `ss -tp` on that host) and `application_name` if
//! its `DATABASE_URL` sets one (`?application_name=payments-7`) — or none, when no process
//! runs it or each waits for the broker. A handler consuming partitions says how many
//! processes share them. A lag that does not shrink while an owner is shown is a
//! stuck handler (a message failing transiently holds the stream: see its logs).
//!
//! `declare` prints one line per queue: what it is declared as and whether it
//! exists, its dead-letter queue and retry wait queues folded in while they exist
//! (each missing one gets a line); then each exchange, checked, and each binding
//! (AMQP cannot check a binding without making it). `declare --missing` prints only
//! what is missing; `--apply` declares it, as `run` would.
//!
//! `dlq show N` prints how often the letter was dead-lettered and replayed, from
//! idemq's headers (`x-idemq-replay`, `x-idemq-attempts`). The dead-letter queue's
//! `x-delivery-count` is not the letter's: every `dlq` command that reads a letter
//! returns it to the queue, and the broker counts each return. It is printed apart,
//! as `browsed before: N times`.
//!
//! Logs go to stderr, set up by the CLI itself: `RUST_LOG` (default `info`),
//! `--log-format human|json` (`IDEMQ_LOG_FORMAT`; `text` is `human`), colours only on a
//! terminal. `run` logs what it consumes and from where at start, and when it has
//! stopped. An application that installs its own `tracing` subscriber first keeps it
//! (see [`init_tracing`]).
//!
//! `run` started while the database or the broker is unreachable waits for it (see
//! [`RuntimeBuilder::startup_timeout`]): the database before the set-up and the
//! migrations, then both as `Runtime::run` does; SIGTERM meanwhile exits 0, and
//! `--startup-timeout` bounds the whole wait (exit 1 naming what was unreachable).
//!
//! ```no_run
//! # use idemq::{Queue, Runtime, Topology};
//! # async fn example(handler: impl idemq::Handler) -> std::process::ExitCode {
//! let builder = Runtime::builder().topology(Topology::new().queue(Queue::new("payments"))).consume("payments", handler);
//! idemq::cli::Cli::new("payments", builder).run().await
//! # }
//! ```

mod commands;
mod common;
mod config;
mod console;
mod declare;
mod dlq;
mod logging;
mod saga;
mod status;

use idemq_core::__private::sibling;
use idemq_core::__private::sibling::BuilderPlan as _;
use std::ffi::OsString;
use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::PossibleValue;
use clap::{value_parser, Arg, ArgAction, ArgMatches, Command};

pub use clap;
pub use commands::Setup;
pub use console::Console;
pub use logging::init_tracing;

use crate::commands::Interrupted;
use crate::common::CliResult;
use crate::config::{
    parse_consumer_timeout, parse_duration, parse_on_conflict, parse_switch, setting, Settings,
};
use idemq_core::BoxFuture;
use idemq_core::RuntimeBuilder;
use idemq_core::{connect::redact, Error};

/// How long the last log lines may take to reach stderr at exit (a stderr nobody
/// reads must not hold the exit).
const EXIT_LOG_FLUSH: Duration = Duration::from_secs(2);

/// The CLI of an idemq application. See the module docs.
#[must_use = "a CLI does nothing until `.run()`"]
pub struct Cli {
    name: &'static str,
    about: Option<&'static str>,
    version: &'static str,
    builder: RuntimeBuilder,
    app: commands::App,
}

impl std::fmt::Debug for Cli {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cli")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("builder", &self.builder)
            .finish_non_exhaustive()
    }
}

impl Cli {
    /// The CLI of the binary `name`, running `builder`'s handlers and topology.
    /// `<name> --version` prints idemq's version until [`Cli::version`] gives the
    /// application's.
    pub fn new(name: &'static str, builder: RuntimeBuilder) -> Self {
        Self { name, about: None, version: env!("CARGO_PKG_VERSION"), builder, app: commands::App::default() }
    }

    /// The version `--version` prints after the name (exit 0): the application's,
    /// usually `.version(env!("CARGO_PKG_VERSION"))` in its `main`. Default: idemq's.
    pub fn version(mut self, version: &'static str) -> Self {
        self.version = version;
        self
    }

    /// The line `--help` starts with.
    pub fn about(mut self, about: &'static str) -> Self {
        self.about = Some(about);
        self
    }

    /// The application's own set-up (creating its database, say), run by `migrate`
    /// and at the start of `run` — in both, **before** idemq's migrations, so it may
    /// create the database they run in. It must be idempotent: it runs on every
    /// start. Its tables are better given as migrations ([`Cli::migrations`]), which
    /// `migrate --status` lists.
    pub fn setup<F, Fut>(mut self, setup: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send + 'static,
    {
        self.app.setup = Some(Box::new(move |url| Box::pin(setup(url))));
        self
    }

    /// The application's own diesel migrations
    /// (`diesel_migrations::embed_migrations!("migrations")`): `migrate` and `run`
    /// apply them **after** idemq's (after the set-up, under the same lock, without
    /// DDL when none is pending), and `migrate --status` lists them beside idemq's.
    /// Their versions share `__diesel_schema_migrations` with idemq's
    /// (`2026-11-30-000001` and on): give yours other dates or numbers.
    pub fn migrations(mut self, migrations: &'static diesel_migrations::EmbeddedMigrations) -> Self {
        self.app.migrations = Some(commands::Migrations(migrations));
        self
    }

    /// The subcommands, for an application that adds its own
    /// (`cli.command().subcommand(..)`, then [`Cli::run_matches`]).
    pub fn command(&self) -> Command {
        let command = global_args(
            Command::new(self.name)
                .version(self.version)
                .propagate_version(true)
                .subcommand_required(true)
                .arg_required_else_help(true),
        )
        .subcommand(run_command())
        .subcommand(
            Command::new("migrate").about("apply idemq's migrations and the application's, then exit").arg(
                Arg::new("status")
                    .long("status")
                    .action(ArgAction::SetTrue)
                    .help("list idemq's migrations, applied or pending; change nothing"),
            ),
        )
        .subcommand(declare_command())
        .subcommand(status_command())
        .subcommand(dlq_command())
        .subcommand(saga_command())
        .subcommand(console_command())
        .subcommand(gc_command())
        .subcommand(
            Command::new("asyncapi")
                .about(
                    "print the application's contract as an AsyncAPI 3.0 document (JSON; --yaml for YAML): \
                     its queues, exchanges, handlers and message types",
                )
                .arg(Arg::new("yaml").long("yaml").action(ArgAction::SetTrue).help("print YAML, not JSON")),
        );
        match self.about {
            Some(about) => command.about(about),
            None => command,
        }
    }

    /// Parses the process's arguments and runs the subcommand, logging to stderr as
    /// [`Cli::run_matches`] says. `--help` and `--version` exit 0, a usage error 2, a
    /// failure 1 (its message on stderr).
    pub async fn run(self) -> ExitCode {
        self.run_from(std::env::args_os()).await
    }

    /// [`Cli::run`] with these arguments (the first is the binary's name).
    pub async fn run_from<I, T>(self, args: I) -> ExitCode
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        match self.command().try_get_matches_from(args) {
            Ok(matches) => self.run_matches(&matches).await,
            Err(err) => {
                let _ = err.print();
                ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2))
            }
        }
    }

    /// Runs the subcommand `matches` holds (from [`Cli::command`], maybe extended).
    ///
    /// Logs go to stderr through the subscriber [`init_tracing`] installs with the
    /// default level `info` (`RUST_LOG` and `--log-format` decide), unless one was
    /// installed before: the application's own stays. With `--log-format json` (and
    /// the CLI's subscriber), a failure's message is a JSON line (level `ERROR`) too.
    ///
    /// The future is boxed so that the CLI and the runtime are compiled once, in
    /// idemq, not again in each application (see [`Runtime::run`](idemq_core::Runtime::run)).
    pub fn run_matches(self, matches: &ArgMatches) -> BoxFuture<'_, ExitCode> {
        Box::pin(self.run_matched(matches))
    }

    async fn run_matched(self, matches: &ArgMatches) -> ExitCode {
        let json_logs = logging::install(matches, logging::DEFAULT_LEVEL);
        let name = self.name;
        let code = match self.dispatch(matches).await {
            Ok(()) => ExitCode::SUCCESS,
            // The second signal: out now, as a shell's interrupted job.
            Err(err) if err.is::<Interrupted>() => ExitCode::from(130),
            Err(err) => {
                // The error and each of its causes, once, redacted; a JSON line among
                // JSON logs, so that a collector parses every line — unless `RUST_LOG`
                // would drop it (`lapin=debug` alone): never lose the reason.
                let report = idemq_core::connect::report(&*err);
                if json_logs && tracing::enabled!(tracing::Level::ERROR) {
                    tracing::error!("{name}: {report}");
                } else {
                    // After the log lines before it; never a panic on a closed stderr.
                    sibling::StderrLines::flush_if_used(EXIT_LOG_FLUSH);
                    let _ = writeln!(std::io::stderr(), "{name}: {report}");
                }
                ExitCode::FAILURE
            }
        };
        // The last log lines, unless nobody reads them.
        sibling::StderrLines::flush_if_used(EXIT_LOG_FLUSH);
        code
    }

    async fn dispatch(self, matches: &ArgMatches) -> CliResult {
        let (subcommand, sub) = matches.subcommand().ok_or("no subcommand")?;
        let file = Settings::load(matches)?;
        let mut builder = self.builder;
        if let Some(url) = file.amqp_url(matches)? {
            builder = builder.amqp_url(url);
        }
        if let Some(url) = file.database_url(matches)? {
            builder = builder.database_url(url);
        }
        match subcommand {
            "run" => {
                let builder = file.run_settings(builder, sub)?;
                let console = console::Console::from_env(self.name)?;
                let console = if sub.get_flag("console-actions") { console.actions(true) } else { console };
                commands::run(console.mount(builder), &self.app).await
            }
            "console" => {
                let settings = console::Settings::from_env(sub.get_flag("console-actions"))?;
                let addr = *sub.get_one::<std::net::SocketAddr>("addr").expect("has a default");
                console::serve(status::Inventory::of(&builder), self.name, settings, addr).await
            }
            "migrate" if sub.get_flag("status") => {
                commands::migrate_status(builder.configured_database_url(), &self.app).await
            }
            "migrate" => {
                commands::migrate(builder.configured_database_url(), &self.app).await?;
                println!("migrations applied to {}", redact(builder.configured_database_url()));
                Ok(())
            }
            "declare" => declare::declare(&builder, sub.get_flag("apply"), sub.get_flag("missing")).await,
            "status" => status::status(&builder, self.name, sub.get_flag("nonzero")).await,
            "asyncapi" => {
                let document = builder.asyncapi(self.name, self.version);
                match sub.get_flag("yaml") {
                    true => print!("{}", yaml_serde::to_string(&document)?),
                    false => println!("{}", serde_json::to_string_pretty(&document)?),
                }
                Ok(())
            }
            "dlq" => dlq::run(&builder, sub).await,
            "saga" => saga::run(&builder, sub).await,
            "gc" => {
                let keep = setting::<Duration>(sub, "keep")
                    .or(file.retention)
                    .ok_or("gc needs a retention: give --keep 30d (or IDEMQ_RETENTION, or `retention` in the config)")?;
                let window = setting::<Duration>(sub, "replay-window").or(file.replay_window);
                commands::gc(&builder, keep, window).await
            }
            other => Err(format!("unknown subcommand `{other}`").into()),
        }
    }
}

/// The arguments every subcommand takes: the config file, the log format, the URLs.
fn global_args(command: Command) -> Command {
    command
            .arg(
                Arg::new("config")
                    .long("config")
                    .env("IDEMQ_CONFIG")
                    .global(true)
                    .value_name("FILE")
                    .value_parser(value_parser!(PathBuf))
                    .hide_env_values(true)
                    .help("a TOML file of settings (flags and the environment win over it)"),
            )
            .arg(log_format())
            .arg(
                Arg::new("amqp-url")
                    .long("amqp-url")
                    .env("AMQP_URL")
                    .global(true)
                    .value_name("URL")
                    .hide_env_values(true)
                    .help(
                        "the broker: amqp://user:pass@host:5672/vhost, or amqps://…:5671/vhost?cacertfile=PATH \
                         for TLS; several, comma-separated",
                    ),
            )
            .arg(
                Arg::new("amqp-url-file")
                    .long("amqp-url-file")
                    .env("AMQP_URL_FILE")
                    .global(true)
                    .value_name("FILE")
                    .value_parser(value_parser!(PathBuf))
                    .hide_env_values(true)
                    .help("a file holding the broker's URL (a container secret), instead of --amqp-url"),
            )
            .arg(
                Arg::new("database-url")
                    .long("database-url")
                    .env("DATABASE_URL")
                    .global(true)
                    .value_name("URL")
                    .hide_env_values(true)
                    .help(
                        "PostgreSQL: postgres://user:pass@host:5432/db, with libpq's sslmode=verify-full&sslrootcert=PATH \
                         for verified TLS",
                    ),
            )
            .arg(
                Arg::new("database-url-file")
                    .long("database-url-file")
                    .env("DATABASE_URL_FILE")
                    .global(true)
                    .value_name("FILE")
                    .value_parser(value_parser!(PathBuf))
                    .hide_env_values(true)
                    .help("a file holding PostgreSQL's URL (a container secret), instead of --database-url"),
            )
}

/// `--log-format human|json` (`text` is `human`), for the subscriber `run_matches` installs.
fn log_format() -> Arg {
    Arg::new("log-format")
        .long("log-format")
        .env("IDEMQ_LOG_FORMAT")
        .global(true)
        .value_name("FORMAT")
        .value_parser([PossibleValue::new("human").alias("text"), PossibleValue::new("json")])
        .hide_env_values(true)
        .help("log lines on stderr for people (the default; `text` too) or JSON, one object per line")
}

/// A duration flag, also read from the environment variable `env`.
fn duration(name: &'static str, env: &'static str, help: &'static str) -> Arg {
    Arg::new(name)
        .long(name)
        .env(env)
        .hide_env_values(true)
        .value_name("DURATION")
        .value_parser(parse_duration)
        .help(help)
}

/// `run` and its settings.
fn run_command() -> Command {
    Command::new("run")
        .about("declare the topology and consume until SIGINT/SIGTERM")
        .arg(
            Arg::new("concurrency")
                .long("concurrency")
                .env("IDEMQ_CONCURRENCY")
                .hide_env_values(true)
                .value_name("N")
                .value_parser(value_parser!(usize))
                .help("transactions at once"),
        )
        .arg(
            Arg::new("batch-size")
                .long("batch-size")
                .env("IDEMQ_BATCH_SIZE")
                .hide_env_values(true)
                .value_name("N")
                .value_parser(value_parser!(usize))
                .help("deliveries per transaction (1: per-message); prefetch is concurrency × this"),
        )
        .arg(duration(
            "retention",
            "IDEMQ_RETENTION",
            "sweep dedup rows older than this in the background (e.g. 30d; default: never)",
        ))
        .arg(duration(
            "replay-window",
            "IDEMQ_REPLAY_WINDOW",
            "with --retention: how long a dead letter may still be replayed (default 7d)",
        ))
        .arg(duration(
            "startup-timeout",
            "IDEMQ_STARTUP_TIMEOUT",
            "give up (exit 1) if the broker or the database is still unreachable after this \
                         at start-up (e.g. 2m; default: wait for as long as it takes)",
        ))
        .arg(duration(
            "release-streams-after",
            "IDEMQ_RELEASE_STREAMS_AFTER",
            "give up owned streams once the broker has not answered for this long, so a process \
                         that reaches it takes them over (default 15s)",
        ))
        .arg(
            duration(
                "consumer-timeout",
                "IDEMQ_CONSUMER_TIMEOUT",
                "the broker's consumer_timeout, if not RabbitMQ's 30m (`off` if turned off): \
                             settings that can hold a delivery longer are refused",
            )
            .value_parser(parse_consumer_timeout),
        )
        .arg(
            Arg::new("prefetch")
                .long("prefetch")
                .env("IDEMQ_PREFETCH")
                .hide_env_values(true)
                .value_name("N")
                .value_parser(value_parser!(u16).range(1..))
                .help("unacked deliveries per consumer (default: concurrency × batch size)"),
        )
        .arg(
            Arg::new("http-addr")
                .long("http-addr")
                .env("IDEMQ_HTTP_ADDR")
                .hide_env_values(true)
                .value_name("ADDR")
                .value_parser(value_parser!(std::net::SocketAddr))
                .help(
                    "serve /metrics, /healthz, /readyz and the console (/console) here, e.g. 127.0.0.1:9464 \
                     (default: off)",
                ),
        )
        .arg(console_actions())
        .arg(duration(
            "linger",
            "IDEMQ_LINGER",
            "how long a batch that is not full waits for more (default 0s)",
        ))
        .arg(duration(
            "handler-timeout",
            "IDEMQ_HANDLER_TIMEOUT",
            "how long a handler may run before its attempt fails, transiently (default 60s)",
        ))
        .arg(
            Arg::new("max-body-bytes")
                .long("max-body-bytes")
                .env("IDEMQ_MAX_BODY_BYTES")
                .hide_env_values(true)
                .value_name("N")
                .value_parser(value_parser!(usize))
                .help("larger bodies are dead-lettered (kind too-large) before decoding (default 1048576)"),
        )
        .arg(
            Arg::new("on-conflict")
                .long("on-conflict")
                .env("IDEMQ_ON_CONFLICT")
                .hide_env_values(true)
                .value_name("WHAT")
                .value_parser(parse_on_conflict)
                .help("a known key with another payload: dead-letter (the default) or ignore (ack, log)"),
        )
        .arg(
            Arg::new("replication-check")
                .long("replication-check")
                .env("IDEMQ_REPLICATION_CHECK")
                .hide_env_values(true)
                .value_name("WHAT")
                .value_parser(idemq_core::ReplicationCheck::parse)
                .help(
                    "when the database could lose acknowledged COMMITs (asynchronous standbys, \
                     synchronous_commit = off): warn (the default), refuse to start, or off",
                ),
        )
        .arg(
            Arg::new("namespace")
                .long("namespace")
                .env("IDEMQ_NAMESPACE")
                .hide_env_values(true)
                .value_name("NS")
                .help("scope dedup rows as NS/<handler>, for services sharing a database (default: none)"),
        )
        .arg(duration(
            "shutdown-deadline",
            "IDEMQ_SHUTDOWN_DEADLINE",
            "how long in-flight deliveries get at shutdown (default 10s)",
        ))
        .arg(duration(
            "heartbeat",
            "IDEMQ_HEARTBEAT",
            "the AMQP heartbeat: a silent broker is found within about two (default 20s)",
        ))
        .arg(duration(
            "reconnect-max-backoff",
            "IDEMQ_RECONNECT_MAX_BACKOFF",
            "the longest wait between reconnect attempts (default 30s)",
        ))
        .arg(duration(
            "database-retry-limit",
            "IDEMQ_DATABASE_RETRY_LIMIT",
            "how long a delivery is held while the database is down (default 25m)",
        ))
        .arg(
            Arg::new("relay")
                .long("relay")
                .env("IDEMQ_RELAY")
                .hide_env_values(true)
                .value_name("on|off")
                .value_parser(parse_switch)
                .help("run the outbox relay in this process (default on; off: relays run elsewhere)"),
        )
        .arg(duration(
            "relay-poll-interval",
            "IDEMQ_RELAY_POLL_INTERVAL",
            "how often the relay looks for rows nobody woke it for (default 1s)",
        ))
        .arg(
            Arg::new("kill-switch")
                .long("kill-switch")
                .env("IDEMQ_KILL_SWITCH")
                .hide_env_values(true)
                .value_name("RATIO%/ATTEMPTS/WINDOW/PAUSE|off")
                .value_parser(config::parse_kill_switch)
                .help("pause a handler whose attempts keep failing, e.g. 15%/10/1m/1m (default: off)"),
        )
        .arg(
            Arg::new("rate-limit")
                .long("rate-limit")
                .env("IDEMQ_RATE_LIMIT")
                .hide_env_values(true)
                .action(ArgAction::Append)
                .value_delimiter(',')
                .value_name("HANDLER=N")
                .value_parser(config::parse_per_handler)
                .help("at most N of the handler's deliveries start per second (repeat, or separate with commas)"),
        )
        .arg(
            Arg::new("handler-concurrency")
                .long("handler-concurrency")
                .env("IDEMQ_HANDLER_CONCURRENCY")
                .hide_env_values(true)
                .action(ArgAction::Append)
                .value_delimiter(',')
                .value_name("HANDLER=N")
                .value_parser(config::parse_per_handler)
                .help("at most N of the handler's transactions at once (repeat, or separate with commas)"),
        )
        .arg(
            Arg::new("queue")
                .long("queue")
                .action(ArgAction::Append)
                .value_name("QUEUE")
                .help("consume only these queues (repeat the flag)"),
        )
}

/// `declare [--apply] [--missing]`.
fn declare_command() -> Command {
    Command::new("declare")
        .about(
            "show the topology the code declares, one line per queue with its dead-letter and retry wait \
             queues, then the exchanges and bindings, and what exists (a dry run); --apply declares it",
        )
        .long_about(
            "Show the topology the code declares and what of it exists on the broker, checked with passive \
             declares (nothing is changed without --apply).\n\n\
             One line per queue: what it is declared as, and whether it exists; while its dead-letter queue \
             and retry wait queues exist too, they are folded into that line, and each missing one gets a line \
             of its own below it. Then each exchange (missing ones say so: publishing to a missing exchange \
             fails) and each binding (AMQP cannot check a binding without making it: a binding is declared \
             with its queue and exchange).",
        )
        .arg(Arg::new("apply").long("apply").action(ArgAction::SetTrue).help("declare what is missing"))
        .arg(
            Arg::new("missing")
                .long("missing")
                .action(ArgAction::SetTrue)
                .help("print only what is missing (the last line still says how much)"),
        )
}

/// `--console-actions`, for `run` and `console`.
fn console_actions() -> Arg {
    Arg::new("console-actions").long("console-actions").action(ArgAction::SetTrue).help(
        "let the console replay and purge dead letters (also IDEMQ_CONSOLE_ACTIONS=on); actions need the \
         console's token (IDEMQ_CONSOLE_TOKEN or IDEMQ_CONSOLE_TOKEN_FILE)",
    )
}

/// `console [--addr ADDR] [--console-actions]`.
fn console_command() -> Command {
    Command::new("console")
        .about(
            "serve the operations console alone (no consumer runs): handlers, dead letters grouped by cause \
             (replay, purge), queues and streams, the outbox and the database, the audit list",
        )
        .long_about(
            "Serve the operations console without running a consumer; `run --http-addr` serves the same \
             pages, with live figures, under /console beside /metrics.\n\n\
             Read without credentials only on a loopback address; elsewhere every request needs the token \
             (IDEMQ_CONSOLE_TOKEN, or IDEMQ_CONSOLE_TOKEN_FILE naming a file holding it): the login form, \
             basic auth (the token as password) or `Authorization: Bearer`. Without a token configured, a \
             console beyond loopback serves nothing. Replay and purge need --console-actions and the token.",
        )
        .arg(
            Arg::new("addr")
                .long("addr")
                .value_name("ADDR")
                .default_value("127.0.0.1:9465")
                .value_parser(value_parser!(std::net::SocketAddr))
                .help("where to serve it"),
        )
        .arg(console_actions())
}

/// `status [--nonzero]`.
fn status_command() -> Command {
    Command::new("status")
        .about(
            "one line per queue: ready messages, consumers, dead letters, retries waiting; each stream's end \
             and each handler's offset, lag and owner; dedup rows and the outbox backlog, counted exactly; \
             sagas running and finished by name; what cannot be read is `unknown (why)` and exits 1",
        )
        .long_about(
            "One line per consumed or declared queue: its ready messages and consumers, the dead letters in its \
             dead-letter queue and the retries waiting in its wait queues (each wait queue holding some gets a \
             line below). Missing queues and exchanges are named, with the fix. Then the dedup rows and the \
             outbox backlog, counted exactly, and for each saga name how many run (and how long the oldest \
             has), and how many finished are kept.\n\n\
             A stream keeps what is read, so it has no \"ready\" count: its line shows where it ends (its last \
             offset, read from the broker), and below it each handler consuming it: the offset it applied up \
             to, its lag (the messages after that offset), and the process owning it now — the PostgreSQL \
             session (pid, client address) holding the stream's owner lock — or none; for partitions, how many \
             processes share them.\n\n\
             What cannot be read is printed as `unknown (why)`, never as a number, and the command exits 1 \
             after printing the rest.",
        )
        .arg(Arg::new("nonzero").long("nonzero").action(ArgAction::SetTrue).help(
            "print only the queues with something to look at: messages ready, dead letters, retries waiting, a \
             stream behind, or anything missing or unreadable (the dedup rows, outbox backlog and sagas always \
             print)",
        ))
}

/// `gc --keep`.
fn gc_command() -> Command {
    Command::new("gc")
        .about("delete dedup rows, copy records and start marks older than the retention, once")
        .arg(duration("keep", "IDEMQ_RETENTION", "the retention (e.g. 30d)"))
        .arg(duration(
            "replay-window",
            "IDEMQ_REPLAY_WINDOW",
            "how long a dead letter may still be replayed (default 7d)",
        ))
}

/// `saga show NAME KEY`.
fn saga_command() -> Command {
    Command::new("saga").about("inspect sagas (`idemq_saga`)").subcommand_required(true).subcommand(
        Command::new("show")
            .about(
                "one saga: running or finished, its version (steps taken), when it started, was updated, \
                 finished and will be deleted, the timeouts it waits for, and its state as JSON; exits 1 \
                 if there is none",
            )
            .arg(
                Arg::new("name")
                    .required(true)
                    .value_name("NAME")
                    .help("the saga's name (#[saga(name = \"...\")])"),
            )
            .arg(Arg::new("key").required(true).value_name("KEY").help("its correlation key")),
    )
}

/// `--dry-run` of `dlq replay` and `dlq purge`.
fn dry_run() -> Arg {
    Arg::new("dry-run").long("dry-run").action(ArgAction::SetTrue).help("say what would be done; do nothing")
}

/// `dlq list | show | replay | purge`.
fn dlq_command() -> Command {
    let filters = |command: Command| {
        command
            .arg(
                Arg::new("kind")
                    .long("kind")
                    .value_name("KIND")
                    .help("only dead letters of this kind (decode, key, handler, conflict, poison, …)"),
            )
            .arg(
                Arg::new("handler")
                    .long("handler")
                    .value_name("NAME")
                    .help("only dead letters of this handler"),
            )
            .arg(
                Arg::new("limit")
                    .long("limit")
                    .value_name("N")
                    .value_parser(value_parser!(usize))
                    .help("at most N"),
            )
    };
    Command::new("dlq")
        .about("inspect dead letters, replay them to their queue, or purge them")
        .subcommand_required(true)
        .arg(
            Arg::new("queue")
                .long("queue")
                .global(true)
                .value_name("QUEUE")
                .help("the consumed queue whose dead-letter queue to use (default: each)"),
        )
        .subcommand(filters(
            Command::new("list").about("headers, reason and a body preview of each dead letter"),
        ))
        .subcommand(
            Command::new("show").about("one dead letter, every header and the whole body").arg(
                Arg::new("index")
                    .required(true)
                    .value_parser(value_parser!(usize))
                    .help("its number in `dlq list`"),
            ),
        )
        .subcommand(
            filters(Command::new("replay").about(
                "publish dead letters to their queue again (fresh attempts), then remove them from the DLQ",
            ))
            .arg(dry_run())
            .arg(
                Arg::new("max-replays")
                    .long("max-replays")
                    .value_name("N")
                    .value_parser(value_parser!(u32))
                    .default_value("5")
                    .help("leave a dead letter replayed N times already in the DLQ"),
            ),
        )
        .subcommand(
            filters(Command::new("purge").about("remove dead letters for good")).arg(dry_run()).arg(
                Arg::new("yes")
                    .long("yes")
                    .action(ArgAction::SetTrue)
                    .help("do not ask (needed without a terminal)"),
            ),
        )
}

/// The broker URL the parsed arguments give: `--amqp-url` (`AMQP_URL`) or
/// `--amqp-url-file` (`AMQP_URL_FILE`), else the config file's `amqp_url` or
/// `amqp_url_file`; `None` leaves the builder's own. For an application's own
/// subcommands, which should connect where `run` does.
///
/// # Errors
/// [`Error::Config`] when a URL and its file are both given at one level, a file is
/// empty, or the config file is not valid; [`Error::ConfigIo`] when a file cannot be
/// read.
pub fn amqp_url(matches: &ArgMatches) -> Result<Option<String>, Error> {
    Settings::load(matches)?.amqp_url(matches)
}

/// The database URL the parsed arguments give: `--database-url` (`DATABASE_URL`) or
/// `--database-url-file` (`DATABASE_URL_FILE`), else the config file's
/// `database_url` or `database_url_file`; `None` leaves the builder's own. See
/// [`amqp_url`].
///
/// # Errors
/// As [`amqp_url`].
pub fn database_url(matches: &ArgMatches) -> Result<Option<String>, Error> {
    Settings::load(matches)?.database_url(matches)
}
