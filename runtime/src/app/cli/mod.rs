//! The application's command line (feature `cli`): the binary's `main` hands its
//! handlers and topology to idemq — a [`RuntimeBuilder`] — and gets subcommands:
//!
//! ```text
//! <app> run      [--concurrency N] [--batch-size N] [--prefetch N] [--queue Q]... [--http-addr ADDR]
//!                [--retention 30d [--replay-window 7d]] [--startup-timeout 2m] [--consumer-timeout 30m]
//!                                                                     consume until SIGINT/SIGTERM
//! <app> migrate  [--status]                                           idemq's (and the app's) migrations
//! <app> declare  [--apply]                                            the topology: what exists, what would be declared
//! <app> status                                                        queue depths, consumers, DLQs, dedup rows, outbox backlog
//! <app> gc       [--keep 30d] [--replay-window 7d]                    delete dedup rows past the retention, once
//! <app> dlq      list | show N | replay | purge  [--queue Q]          inspect and replay dead letters
//! ```
//!
//! Every subcommand but `run` works without consumers (`dlq` is described in
//! `cli_dlq.rs`: browsing returns what it does not act on). Settings come from flags, then
//! the environment (`AMQP_URL`, `DATABASE_URL`, `IDEMQ_CONCURRENCY`,
//! `IDEMQ_BATCH_SIZE`, `IDEMQ_PREFETCH`, `IDEMQ_HTTP_ADDR`, `IDEMQ_RETENTION`,
//! `IDEMQ_REPLAY_WINDOW`, `IDEMQ_STARTUP_TIMEOUT`, `IDEMQ_CONSUMER_TIMEOUT`), then a
//! TOML file (`--config`, or `IDEMQ_CONFIG`) with the same names in snake case
//! (`amqp_url`, `database_url`, `concurrency`, `batch_size`, `prefetch`, `http_addr`,
//! `retention`, `replay_window`, `startup_timeout`, `consumer_timeout`), then the
//! code's builder. They are checked before anything connects; errors name the setting
//! and say what to write. Passwords in URLs are redacted in every message.
//!
//! Each URL may instead come from a file holding it (a container secret, its
//! surrounding whitespace trimmed): `--amqp-url-file` / `AMQP_URL_FILE` and
//! `--database-url-file` / `DATABASE_URL_FILE`, or `amqp_url_file` /
//! `database_url_file` in the TOML file. A URL and its file given together — as flags
//! or variables, or both in the TOML file — is an error: keep one. Flags and the
//! environment still win over the TOML file.
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

mod dlq;

use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Duration;

use clap::{value_parser, Arg, ArgAction, ArgMatches, Command};
use diesel_async::AsyncPgConnection;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Connection;

pub use clap;

use crate::engine::runtime::RuntimeBuilder;
use crate::error::{redact, Error};
use crate::store::retention::Retention;

/// An application step `migrate` and `run` take after idemq's own migrations (the
/// app's tables), given the database URL.
pub type Setup = Box<
    dyn Fn(
            String,
        )
            -> Pin<Box<dyn Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send>>
        + Send
        + Sync,
>;

/// The CLI of an idemq application. See the module docs.
#[must_use = "a CLI does nothing until `.run()`"]
pub struct Cli {
    name: &'static str,
    about: Option<&'static str>,
    builder: RuntimeBuilder,
    setup: Option<Setup>,
}

impl std::fmt::Debug for Cli {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cli")
            .field("name", &self.name)
            .field("builder", &self.builder)
            .finish_non_exhaustive()
    }
}

impl Cli {
    /// The CLI of the binary `name`, running `builder`'s handlers and topology.
    pub fn new(name: &'static str, builder: RuntimeBuilder) -> Self {
        Self { name, about: None, builder, setup: None }
    }

    /// The line `--help` starts with.
    pub fn about(mut self, about: &'static str) -> Self {
        self.about = Some(about);
        self
    }

    /// The application's own set-up (creating its database, its tables), run by
    /// `migrate` and before `run`, before idemq's migrations.
    pub fn setup<F, Fut>(mut self, setup: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send + 'static,
    {
        self.setup = Some(Box::new(move |url| Box::pin(setup(url))));
        self
    }

    /// The subcommands, for an application that adds its own
    /// (`cli.command().subcommand(..)`, then [`Cli::run_matches`]).
    pub fn command(&self) -> Command {
        let duration = |name: &'static str, env: &'static str, help: &'static str| {
            Arg::new(name)
                .long(name)
                .env(env)
                .hide_env_values(true)
                .value_name("DURATION")
                .value_parser(parse_duration)
                .help(help)
        };
        let mut command = Command::new(self.name)
            .subcommand_required(true)
            .arg_required_else_help(true)
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
            .arg(
                Arg::new("log-format")
                    .long("log-format")
                    .env("IDEMQ_LOG_FORMAT")
                    .global(true)
                    .value_parser(["human", "json"])
                    .hide_env_values(true)
                    .help("log lines for people (the default) or JSON, one object per line"),
            )
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
            .subcommand(
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
                            .help("serve /metrics, /healthz and /readyz here, e.g. 127.0.0.1:9464 (default: off)"),
                    )
                    .arg(
                        Arg::new("queue")
                            .long("queue")
                            .action(ArgAction::Append)
                            .value_name("QUEUE")
                            .help("consume only these queues (repeat the flag)"),
                    ),
            )
            .subcommand(
                Command::new("migrate").about("apply idemq's migrations and the application's, then exit").arg(
                    Arg::new("status")
                        .long("status")
                        .action(ArgAction::SetTrue)
                        .help("list idemq's migrations, applied or pending; change nothing"),
                ),
            )
            .subcommand(
                Command::new("declare")
                    .about("show the topology the code declares and what exists (a dry run); --apply declares it")
                    .arg(Arg::new("apply").long("apply").action(ArgAction::SetTrue).help("declare what is missing")),
            )
            .subcommand(
                Command::new("status")
                    .about("queue depths, consumers, dead letters, dedup rows and the outbox backlog"),
            )
            .subcommand(dlq_command())
            .subcommand(
                Command::new("gc")
                    .about("delete dedup rows, copy records and start marks older than the retention, once")
                    .arg(duration("keep", "IDEMQ_RETENTION", "the retention (e.g. 30d)"))
                    .arg(duration(
                        "replay-window",
                        "IDEMQ_REPLAY_WINDOW",
                        "how long a dead letter may still be replayed (default 7d)",
                    )),
            );
        if let Some(about) = self.about {
            command = command.about(about);
        }
        command
    }

    /// Parses the process's arguments and runs the subcommand. `--help` and
    /// `--version` exit 0, a usage error 2, a failure 1 (its message on stderr).
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
    pub async fn run_matches(self, matches: &ArgMatches) -> ExitCode {
        let name = self.name;
        match self.dispatch(matches).await {
            Ok(()) => ExitCode::SUCCESS,
            // The second signal: out now, as a shell's interrupted job.
            Err(err) if err.is::<Interrupted>() => ExitCode::from(130),
            Err(err) => {
                eprintln!("{name}: {}", redact(&err.to_string()));
                ExitCode::FAILURE
            }
        }
    }

    async fn dispatch(self, matches: &ArgMatches) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
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
                if let Some(n) = setting::<usize>(sub, "concurrency").or(file.concurrency) {
                    builder = builder.concurrency(n);
                }
                if let Some(n) = setting::<usize>(sub, "batch-size").or(file.batch_size) {
                    builder = builder.batch_size(n);
                }
                if let Some(n) = setting::<u16>(sub, "prefetch").or(file.prefetch) {
                    builder = builder.prefetch(n);
                }
                if let Some(addr) = setting::<std::net::SocketAddr>(sub, "http-addr").or(file.http_addr) {
                    builder = builder.http_addr(addr);
                }
                if let Some(queues) = sub.get_many::<String>("queue") {
                    builder = builder.only_queues(&queues.cloned().collect::<Vec<_>>())?;
                }
                if let Some(keep) = setting::<Duration>(sub, "retention").or(file.retention) {
                    let mut retention = Retention::keep(keep);
                    if let Some(window) = setting::<Duration>(sub, "replay-window").or(file.replay_window) {
                        retention = retention.replay_window(window);
                    }
                    builder = builder.retention(retention);
                }
                if let Some(timeout) = setting::<Duration>(sub, "startup-timeout").or(file.startup_timeout) {
                    builder = builder.startup_timeout(timeout);
                }
                if let Some(timeout) = setting::<Duration>(sub, "consumer-timeout").or(file.consumer_timeout)
                {
                    builder = builder.consumer_timeout(timeout);
                }
                // Checked before anything connects.
                let url = builder.configured_database_url().to_owned();
                let mut startup = builder.startup();
                let mut runtime = builder.build()?;
                let signals = crate::shutdown_signals();
                // The set-up and the migrations need the server: wait for it as `run`
                // would (any answer will do: the set-up may create the database).
                if !startup.database_server(&url, &signals.graceful).await? {
                    return Ok(());
                }
                runtime.startup_spent(startup.elapsed());
                migrate(&url, self.setup.as_ref()).await?;
                tokio::select! {
                    result = runtime.run(signals.graceful.clone()) => Ok(result?),
                    () = signals.immediate.cancelled() => Err(Box::new(Interrupted)),
                }
            }
            "migrate" if sub.get_flag("status") => migrate_status(builder.configured_database_url()).await,
            "migrate" => {
                migrate(builder.configured_database_url(), self.setup.as_ref()).await?;
                println!("migrations applied to {}", redact(builder.configured_database_url()));
                Ok(())
            }
            "declare" => declare(&builder, sub.get_flag("apply")).await,
            "status" => status(&builder).await,
            "dlq" => crate::app::cli::dlq::run(&builder, sub).await,
            "gc" => {
                let keep = setting::<Duration>(sub, "keep")
                    .or(file.retention)
                    .ok_or("gc needs a retention: give --keep 30d (or IDEMQ_RETENTION, or `retention` in the config)")?;
                let mut retention = Retention::keep(keep);
                if let Some(window) = setting::<Duration>(sub, "replay-window").or(file.replay_window) {
                    retention = retention.replay_window(window);
                }
                let retention = retention.check(&builder.retry_policies())?;
                let mut conn = connect_db(builder.configured_database_url()).await?;
                let sweep = crate::store::retention::sweep(&mut conn, &retention).await?;
                if sweep.yielded {
                    println!("another sweep is running (it holds idemq::GC_LOCK); deleted so far:");
                }
                println!(
                    "deleted {} dedup rows, {} copy records, {} start marks older than {:.1} days",
                    sweep.dedup_rows,
                    sweep.copy_records,
                    sweep.start_marks,
                    keep.as_secs_f64() / 86_400.0
                );
                Ok(())
            }
            other => Err(format!("unknown subcommand `{other}`").into()),
        }
    }
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

/// Installs the `tracing` subscriber the parsed `--log-format` asks for (human by
/// default, JSON lines with `json`), filtered by `RUST_LOG` or else `default_filter`.
/// Call it once, after parsing ([`Cli::command`]) and before [`Cli::run_matches`].
///
/// The default filter silences lapin's warning for each message the broker returns
/// (`lapin::returned_messages`): it prints the whole message, body included — payloads
/// in the logs — and idemq reports every unroutable publish itself. `RUST_LOG` decides
/// alone when set.
pub fn init_tracing(matches: &ArgMatches, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("{default_filter},lapin::returned_messages=error"))
    });
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if matches.get_one::<String>("log-format").map(String::as_str) == Some("json") {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// The broker URL the parsed arguments give: `--amqp-url` (`AMQP_URL`) or
/// `--amqp-url-file` (`AMQP_URL_FILE`), else the config file's `amqp_url` or
/// `amqp_url_file`; `None` leaves the builder's own. For an application's own
/// subcommands, which should connect where `run` does.
///
/// # Errors
/// [`Error::Config`] when a URL and its file are both given at one level, a file
/// cannot be read or is empty, or the config file is not valid.
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

/// A URL from the flags and the environment (`--amqp-url` / `AMQP_URL`, or its file
/// form `--amqp-url-file` / `AMQP_URL_FILE`: one level, where a flag wins over its
/// variable, and a URL with a file is an error), else from the config file.
fn url_setting(
    matches: &ArgMatches,
    id: &str,
    env: &str,
    (key, in_file): (&str, Option<String>),
    (file_key, file_in_file): (&str, Option<PathBuf>),
) -> Result<Option<String>, Error> {
    let file_id = format!("{id}-file");
    let given_as = |id: &str, env: &str| match matches.value_source(id) {
        Some(clap::parser::ValueSource::EnvVariable) => env.to_owned(),
        _ => format!("--{id}"),
    };
    let value = setting::<String>(matches, id);
    let file = setting::<PathBuf>(matches, &file_id);
    if value.is_some() || file.is_some() {
        return crate::config::resolve(
            (&given_as(id, env), value),
            (&given_as(&file_id, &format!("{env}_FILE")), file.as_deref()),
        );
    }
    crate::config::resolve((key, in_file), (file_key, file_in_file.as_deref())).map_err(|err| match err {
        Error::Config(message) => Error::Config(format!("in the config file: {message}")),
        other => other,
    })
}

/// `run` was interrupted by a second signal.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by a second signal; unacked deliveries will be redelivered")]
struct Interrupted;

/// A setting given as a flag or in the environment (not a default).
fn setting<T: Clone + Send + Sync + 'static>(matches: &ArgMatches, id: &str) -> Option<T> {
    matches.try_get_one::<T>(id).ok().flatten().cloned()
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|err| format!("`{text}` is not a duration ({err}); write e.g. 30d, 12h, 90m"))
}

/// A duration, or `off` for a broker whose consumer timeout is turned off.
fn parse_consumer_timeout(text: &str) -> Result<Duration, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(Duration::MAX);
    }
    parse_duration(text).map_err(|err| format!("{err}, or `off`"))
}

/// The TOML file's settings.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    amqp_url: Option<String>,
    amqp_url_file: Option<PathBuf>,
    database_url: Option<String>,
    database_url_file: Option<PathBuf>,
    concurrency: Option<usize>,
    batch_size: Option<usize>,
    prefetch: Option<u16>,
    http_addr: Option<std::net::SocketAddr>,
    #[serde(default, deserialize_with = "duration")]
    retention: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    replay_window: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    startup_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "consumer_timeout")]
    consumer_timeout: Option<Duration>,
}

fn duration<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    let text: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    text.map(|text| parse_duration(&text).map_err(serde::de::Error::custom)).transpose()
}

fn consumer_timeout<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    let text: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    text.map(|text| parse_consumer_timeout(&text).map_err(serde::de::Error::custom)).transpose()
}

impl Settings {
    fn load(matches: &ArgMatches) -> Result<Self, Error> {
        let Some(path) = matches.get_one::<PathBuf>("config") else { return Ok(Self::default()) };
        let text = std::fs::read_to_string(path)
            .map_err(|err| Error::Config(format!("cannot read the config file {}: {err}", path.display())))?;
        toml::from_str(&text).map_err(|err| {
            Error::Config(format!(
                "the config file {} is not valid: {}; its settings are amqp_url, amqp_url_file, \
                 database_url, database_url_file, concurrency, batch_size, prefetch, http_addr, retention, \
                 replay_window, startup_timeout and consumer_timeout (durations as \"30d\")",
                path.display(),
                redact(&err.to_string())
            ))
        })
    }

    /// See [`amqp_url`].
    fn amqp_url(&self, matches: &ArgMatches) -> Result<Option<String>, Error> {
        url_setting(
            matches,
            "amqp-url",
            "AMQP_URL",
            ("amqp_url", self.amqp_url.clone()),
            ("amqp_url_file", self.amqp_url_file.clone()),
        )
    }

    /// See [`database_url`].
    fn database_url(&self, matches: &ArgMatches) -> Result<Option<String>, Error> {
        url_setting(
            matches,
            "database-url",
            "DATABASE_URL",
            ("database_url", self.database_url.clone()),
            ("database_url_file", self.database_url_file.clone()),
        )
    }
}

async fn connect_db(url: &str) -> Result<AsyncPgConnection, Error> {
    crate::store::db::connect(url).await
}

/// A connection to the first broker address of the list that answers.
pub(crate) async fn connect_broker(urls: &str) -> Result<Connection, Error> {
    Ok(crate::broker::brokers::Brokers::parse(urls)?.connect("cli").await?.0)
}

/// The application's setup first (it may create the database), then idemq's
/// migrations (a no-op if the setup ran them).
async fn migrate(url: &str, setup: Option<&Setup>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if let Some(setup) = setup {
        setup(url.to_owned()).await?;
    }
    crate::store::migrate::migrate(url).await?;
    Ok(())
}

async fn migrate_status(url: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = connect_db(url).await?;
    let applied = crate::store::db::applied_migrations(&mut conn).await?;
    let embedded = diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&crate::MIGRATIONS)
        .map_err(|err| err.to_string())?;
    let mut pending = 0;
    for migration in &embedded {
        let done = applied.contains(&migration.name().version().to_string());
        pending += usize::from(!done);
        println!("{}  {}", if done { "applied" } else { "pending" }, migration.name());
    }
    println!("{pending} pending; `migrate` applies them");
    Ok(())
}

/// Lists what the topology declares and whether it exists; with `apply`, declares it.
async fn declare(
    builder: &RuntimeBuilder,
    apply: bool,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    let plan = builder.declarations();
    let mut missing = 0;
    for (name, what) in &plan {
        let exists = queue_exists(&connection, name).await?;
        missing += usize::from(!exists);
        let state = match (exists, apply) {
            (true, _) => "exists",
            (false, false) => "missing: would be declared",
            (false, true) => "missing: declaring",
        };
        println!("queue {name:<40} {what:<48} {state}");
    }
    for exchange in builder.exchange_names() {
        println!("exchange {exchange:<37} (declared with the topology)");
    }
    if apply {
        builder.declare_all(&connection).await?;
        println!("declared ({missing} were missing)");
    } else if missing > 0 {
        println!("{missing} missing; `declare --apply` declares them (`run` does too)");
    }
    let _ = connection.close(200, "declared".into()).await;
    Ok(())
}

/// Whether `queue` exists (a passive declare on a throwaway channel: a 404 closes it).
async fn queue_exists(connection: &Connection, queue: &str) -> Result<bool, Error> {
    Ok(passive(connection, queue).await?.is_some())
}

async fn passive(connection: &Connection, queue: &str) -> Result<Option<lapin::Queue>, Error> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| Error::Amqp { action: "open a channel".into(), source })?;
    let options = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    match channel.queue_declare(queue.into(), options, FieldTable::default()).await {
        Ok(declared) => {
            let _ = channel.close(200, "inspected".into()).await;
            Ok(Some(declared))
        }
        Err(_) if connection.status().connected() => Ok(None),
        Err(source) => Err(Error::Amqp { action: format!("inspect queue '{queue}'"), source }),
    }
}

async fn status(builder: &RuntimeBuilder) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    println!("{:<40} {:>10} {:>10}", "queue", "ready", "consumers");
    for (queue, dead_letters) in builder.consumed_queues() {
        for name in [queue, dead_letters] {
            match passive(&connection, &name).await? {
                Some(q) => println!("{name:<40} {:>10} {:>10}", q.message_count(), q.consumer_count()),
                None => println!("{name:<40} {:>10} {:>10}", "missing", "-"),
            }
        }
    }
    let _ = connection.close(200, "inspected".into()).await;
    let mut conn = connect_db(builder.configured_database_url()).await?;
    let (dedup_rows, outbox) = crate::store::db::table_sizes(&mut conn).await?;
    println!("dedup rows (estimate): {dedup_rows}");
    println!("outbox backlog:        {outbox}");
    Ok(())
}
