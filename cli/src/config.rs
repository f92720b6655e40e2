//! Where the CLI's settings come from: flags, then the environment, then the TOML
//! file (`--config`), then the code's builder; and the URLs, each given directly or
//! as a file holding it.

use idemq_core::__private::sibling;
use idemq_core::__private::sibling::BuilderPlan as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::ArgMatches;

use idemq_core::store::Retention;
use idemq_core::KillSwitch;
use idemq_core::OnConflict;
use idemq_core::ReplicationCheck;
use idemq_core::RuntimeBuilder;
use idemq_core::{connect::redact, Error};

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
        return sibling::resolve(
            (&given_as(id, env), value),
            (&given_as(&file_id, &format!("{env}_FILE")), file.as_deref()),
        );
    }
    sibling::resolve((key, in_file), (file_key, file_in_file.as_deref())).map_err(|err| match err {
        Error::Config(message) => Error::Config(format!("in the config file: {message}")),
        Error::ConfigIo { message, source } => {
            Error::ConfigIo { message: format!("in the config file: {message}"), source }
        }
        other => other,
    })
}

/// A setting given as a flag or in the environment (not a default).
pub(super) fn setting<T: Clone + Send + Sync + 'static>(matches: &ArgMatches, id: &str) -> Option<T> {
    matches.try_get_one::<T>(id).ok().flatten().cloned()
}

/// A per-handler setting: the flag's values (or its variable's), else the file's.
fn per_handler_setting(sub: &ArgMatches, id: &str, file: Option<&Vec<(String, u32)>>) -> Vec<(String, u32)> {
    match sub.try_get_many::<(String, u32)>(id).ok().flatten() {
        Some(given) => given.cloned().collect(),
        None => file.cloned().unwrap_or_default(),
    }
}

/// A duration as people write it (`30d`, `12h`, `90m`).
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|err| format!("`{text}` is not a duration ({err}); write e.g. 30d, 12h, 90m"))
}

/// A duration, or `off` for a broker whose consumer timeout is turned off.
pub(super) fn parse_consumer_timeout(text: &str) -> Result<Duration, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(Duration::MAX);
    }
    parse_duration(text).map_err(|err| format!("{err}, or `off`"))
}

/// `dead-letter` or `ignore`: [`OnConflict`].
pub(super) fn parse_on_conflict(text: &str) -> Result<OnConflict, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "dead-letter" | "dead_letter" | "deadletter" => Ok(OnConflict::DeadLetter),
        "ignore" => Ok(OnConflict::Ignore),
        _ => Err(format!("`{text}` is not a conflict policy: write dead-letter or ignore")),
    }
}

/// `on` or `off` (also `true`/`false`, `yes`/`no`, `1`/`0`): the words of every
/// switch, the builder's environment variables' too.
pub(super) use sibling::parse_switch;

/// `off`, or a kill switch as `RATIO%/ATTEMPTS/WINDOW/PAUSE` (`15%/10/1m/1m`).
pub(super) fn parse_kill_switch(text: &str) -> Result<Option<KillSwitch>, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|err: idemq_core::KillSwitchParseError| err.to_string())
}

/// A handler's value, `NAME=N` (`record_payment=40`), as `--rate-limit` and
/// `--handler-concurrency` take it (repeat the flag, or separate with commas).
pub(super) fn parse_per_handler(text: &str) -> Result<(String, u32), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}` names no handler: write HANDLER=N, e.g. record_payment=40"))?;
    let value = value.trim().parse().map_err(|_| {
        format!("`{text}`: `{value}` is not a whole number; write HANDLER=N, e.g. record_payment=40")
    })?;
    Ok((name.trim().to_owned(), value))
}

/// A per-handler setting in the TOML file: a table (`{ record_payment = 40 }`) or a
/// string as the flag takes it (`"record_payment=40,refund=5"`).
fn per_handler<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<(String, u32)>>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum PerHandler {
        Table(std::collections::BTreeMap<String, u32>),
        Text(String),
    }
    match <Option<PerHandler> as serde::Deserialize>::deserialize(deserializer)? {
        None => Ok(None),
        Some(PerHandler::Table(table)) => Ok(Some(table.into_iter().collect())),
        Some(PerHandler::Text(text)) => text
            .split(',')
            .map(parse_per_handler)
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

fn kill_switch<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<KillSwitch>>, D::Error> {
    let text: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    text.map(|text| parse_kill_switch(&text).map_err(serde::de::Error::custom)).transpose()
}

/// The TOML file's settings.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Settings {
    amqp_url: Option<String>,
    amqp_url_file: Option<PathBuf>,
    database_url: Option<String>,
    database_url_file: Option<PathBuf>,
    concurrency: Option<usize>,
    batch_size: Option<usize>,
    prefetch: Option<u16>,
    http_addr: Option<std::net::SocketAddr>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) retention: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    pub(super) replay_window: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    startup_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    release_streams_after: Option<Duration>,
    #[serde(default, deserialize_with = "consumer_timeout")]
    consumer_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    linger: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    handler_timeout: Option<Duration>,
    max_body_bytes: Option<usize>,
    #[serde(default, deserialize_with = "on_conflict")]
    on_conflict: Option<OnConflict>,
    #[serde(default, deserialize_with = "replication_check")]
    replication_check: Option<ReplicationCheck>,
    namespace: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    shutdown_deadline: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    heartbeat: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    reconnect_max_backoff: Option<Duration>,
    #[serde(default, deserialize_with = "duration")]
    database_retry_limit: Option<Duration>,
    #[serde(default, deserialize_with = "switch")]
    relay: Option<bool>,
    #[serde(default, deserialize_with = "duration")]
    relay_poll_interval: Option<Duration>,
    #[serde(default, deserialize_with = "kill_switch")]
    kill_switch: Option<Option<KillSwitch>>,
    #[serde(default, deserialize_with = "per_handler")]
    rate_limit: Option<Vec<(String, u32)>>,
    #[serde(default, deserialize_with = "per_handler")]
    handler_concurrency: Option<Vec<(String, u32)>>,
}

/// Every key of the TOML file, for the error that names them.
const KEYS: &str = "amqp_url, amqp_url_file, database_url, database_url_file, concurrency, batch_size, prefetch, \
                    http_addr, retention, replay_window, startup_timeout, release_streams_after, consumer_timeout, linger, handler_timeout, \
                    max_body_bytes, on_conflict, replication_check, namespace, shutdown_deadline, heartbeat, reconnect_max_backoff, \
                    database_retry_limit, relay, relay_poll_interval, kill_switch, rate_limit, handler_concurrency";

fn replication_check<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<ReplicationCheck>, D::Error> {
    let text: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    text.map(|text| ReplicationCheck::parse(&text).map_err(serde::de::Error::custom)).transpose()
}

fn on_conflict<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<OnConflict>, D::Error> {
    let text: Option<String> = serde::Deserialize::deserialize(deserializer)?;
    text.map(|text| parse_on_conflict(&text).map_err(serde::de::Error::custom)).transpose()
}

/// `relay = false`, or as the flag takes it: `relay = "off"`.
fn switch<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<bool>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Switch {
        Bool(bool),
        Text(String),
    }
    match <Option<Switch> as serde::Deserialize>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Switch::Bool(on)) => Ok(Some(on)),
        Some(Switch::Text(text)) => parse_switch(&text).map(Some).map_err(serde::de::Error::custom),
    }
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
    pub(super) fn load(matches: &ArgMatches) -> Result<Self, Error> {
        let Some(path) = matches.get_one::<PathBuf>("config") else { return Ok(Self::default()) };
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigIo {
            message: format!("cannot read the config file {}", path.display()),
            source,
        })?;
        // A TOML error quotes the line it stopped at, which may hold a URL and its
        // password: it is shown redacted, in the message, never as a source.
        toml::from_str(&text).map_err(|err| {
            Error::Config(format!(
                "the config file {} is not valid: {}; its settings are {KEYS} (durations as \"30d\")",
                path.display(),
                redact(&err.to_string())
            ))
        })
    }

    /// See [`amqp_url`](super::amqp_url).
    pub(super) fn amqp_url(&self, matches: &ArgMatches) -> Result<Option<String>, Error> {
        url_setting(
            matches,
            "amqp-url",
            "AMQP_URL",
            ("amqp_url", self.amqp_url.clone()),
            ("amqp_url_file", self.amqp_url_file.clone()),
        )
    }

    /// See [`database_url`](super::database_url).
    pub(super) fn database_url(&self, matches: &ArgMatches) -> Result<Option<String>, Error> {
        url_setting(
            matches,
            "database-url",
            "DATABASE_URL",
            ("database_url", self.database_url.clone()),
            ("database_url_file", self.database_url_file.clone()),
        )
    }

    /// `run`'s settings applied to `builder`: each flag (or its variable), else the
    /// TOML file's, else the builder's own. Checked later, by `build`.
    pub(super) fn run_settings(
        &self,
        mut builder: RuntimeBuilder,
        sub: &ArgMatches,
    ) -> Result<RuntimeBuilder, Error> {
        if let Some(n) = setting::<usize>(sub, "concurrency").or(self.concurrency) {
            builder = builder.concurrency(n);
        }
        if let Some(n) = setting::<usize>(sub, "batch-size").or(self.batch_size) {
            builder = builder.batch_size(n);
        }
        if let Some(n) = setting::<u16>(sub, "prefetch").or(self.prefetch) {
            builder = builder.prefetch(n);
        }
        if let Some(addr) = setting::<std::net::SocketAddr>(sub, "http-addr").or(self.http_addr) {
            builder = builder.http_addr(addr);
        }
        if let Some(queues) = sub.get_many::<String>("queue") {
            builder = builder.only_queues(&queues.cloned().collect::<Vec<_>>())?;
        }
        if let Some(keep) = setting::<Duration>(sub, "retention").or(self.retention) {
            let mut retention = Retention::keep(keep);
            if let Some(window) = setting::<Duration>(sub, "replay-window").or(self.replay_window) {
                retention = retention.replay_window(window);
            }
            builder = builder.retention(retention);
        }
        if let Some(timeout) = setting::<Duration>(sub, "startup-timeout").or(self.startup_timeout) {
            builder = builder.startup_timeout(timeout);
        }
        if let Some(bound) = setting::<Duration>(sub, "release-streams-after").or(self.release_streams_after)
        {
            builder = builder.release_streams_after(bound);
        }
        if let Some(timeout) = setting::<Duration>(sub, "consumer-timeout").or(self.consumer_timeout) {
            builder = builder.consumer_timeout(timeout);
        }
        if let Some(linger) = setting::<Duration>(sub, "linger").or(self.linger) {
            builder = builder.linger(linger);
        }
        if let Some(timeout) = setting::<Duration>(sub, "handler-timeout").or(self.handler_timeout) {
            builder = builder.handler_timeout(timeout);
        }
        if let Some(bytes) = setting::<usize>(sub, "max-body-bytes").or(self.max_body_bytes) {
            builder = builder.max_body_bytes(bytes);
        }
        if let Some(on_conflict) = setting::<OnConflict>(sub, "on-conflict").or(self.on_conflict) {
            builder = builder.on_conflict(on_conflict);
        }
        let check = setting::<ReplicationCheck>(sub, "replication-check").or(self.replication_check);
        if let Some(check) = check {
            builder = builder.replication_check(check);
        }
        if let Some(namespace) = setting::<String>(sub, "namespace").or_else(|| self.namespace.clone()) {
            builder = builder.namespace(namespace);
        }
        if let Some(deadline) = setting::<Duration>(sub, "shutdown-deadline").or(self.shutdown_deadline) {
            builder = builder.shutdown_deadline(deadline);
        }
        if let Some(interval) = setting::<Duration>(sub, "heartbeat").or(self.heartbeat) {
            builder = builder.heartbeat(interval);
        }
        if let Some(max) = setting::<Duration>(sub, "reconnect-max-backoff").or(self.reconnect_max_backoff) {
            builder = builder.reconnect_max_backoff(max);
        }
        if let Some(limit) = setting::<Duration>(sub, "database-retry-limit").or(self.database_retry_limit) {
            builder = builder.database_retry_limit(limit);
        }
        // The relay's switch first: its poll interval is refused by `build` with it off.
        if let Some(on) = setting::<bool>(sub, "relay").or(self.relay) {
            builder = builder.relay(on);
        }
        if let Some(interval) = setting::<Duration>(sub, "relay-poll-interval").or(self.relay_poll_interval) {
            builder = builder.relay_poll_interval(interval);
        }
        if let Some(switch) = setting::<Option<KillSwitch>>(sub, "kill-switch").or(self.kill_switch) {
            builder = builder.kill_switch(switch);
        }
        for (name, per_second) in per_handler_setting(sub, "rate-limit", self.rate_limit.as_ref()) {
            builder = builder.rate_limit(&name, per_second);
        }
        for (name, n) in per_handler_setting(sub, "handler-concurrency", self.handler_concurrency.as_ref()) {
            builder = builder.handler_concurrency(&name, usize::try_from(n).unwrap_or(usize::MAX));
        }
        Ok(builder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::__private::sibling::SETTINGS;
    use idemq_core::key::KeyError;
    use idemq_core::{BoxFuture, Context, Handler, HandlerError, HandlerOutput, Key, Metadata, Runtime};

    /// A handler that does nothing (the builder's checks read only its options).
    struct Noop;

    impl Handler for Noop {
        type Message = serde_json::Value;

        fn name(&self) -> &'static str {
            "noop"
        }

        fn key_path(&self) -> &'static str {
            "id"
        }

        fn key(&self, _: &Self::Message, metadata: &Metadata<'_>) -> Result<Key, KeyError> {
            Ok(metadata.hash_key())
        }

        fn handle<'a>(
            &'a self,
            _: &'a mut diesel_async::AsyncPgConnection,
            _: &'a mut Context,
            _: Self::Message,
        ) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>> {
            Box::pin(async { Ok(HandlerOutput::none()) })
        }
    }

    /// The application's command as `Cli::command` makes it, with `run`.
    fn command() -> clap::Command {
        super::super::global_args(clap::Command::new("app")).subcommand(super::super::run_command())
    }

    #[test]
    fn every_listed_flag_reads_its_variable_and_takes_its_example() {
        let command = command();
        let run = command.find_subcommand("run").expect("run").clone();
        for setting in SETTINGS {
            let Some(flag) = setting.flag else { continue };
            let long = flag.trim_start_matches("--");
            let arg = run
                .get_arguments()
                .chain(command.get_arguments())
                .find(|arg| arg.get_long() == Some(long))
                .unwrap_or_else(|| panic!("`run` has no flag {flag} for .{}(..)", setting.method));
            let env = arg.get_env().and_then(|env| env.to_str());
            assert_eq!(env, setting.env, "{flag} reads another variable");
            let parsed = command.clone().try_get_matches_from(["app", "run", flag, setting.example]);
            assert!(parsed.is_ok(), "{flag} {}: {parsed:?}", setting.example);
        }
    }

    #[test]
    fn every_listed_toml_key_is_read() {
        for setting in SETTINGS {
            let Some(key) = setting.toml else { continue };
            let example = setting.example;
            let read = toml::from_str::<Settings>(&format!("{key} = {example}"))
                .or_else(|_| toml::from_str::<Settings>(&format!("{key} = \"{example}\"")));
            assert!(read.is_ok(), "`{key}` in the config file: {read:?}");
        }
    }

    #[test]
    fn on_conflict_and_the_relay_switch_read_what_people_write() {
        assert_eq!(parse_on_conflict("dead-letter"), Ok(OnConflict::DeadLetter));
        assert_eq!(parse_on_conflict("Ignore"), Ok(OnConflict::Ignore));
        assert!(parse_on_conflict("drop").unwrap_err().contains("dead-letter or ignore"));
        assert_eq!(parse_switch("off"), Ok(false));
        assert_eq!(parse_switch("ON"), Ok(true));
        assert!(parse_switch("maybe").is_err());
        let file: Settings = toml::from_str("relay = false").expect("a TOML boolean");
        assert_eq!(file.relay, Some(false));
        let file: Settings = toml::from_str("relay = \"off\"").expect("as the flag takes it");
        assert_eq!(file.relay, Some(false));
    }

    /// The settings reach the builder: each pair below is refused by `build`, which
    /// only a builder that got both can do.
    #[test]
    fn flags_and_the_file_reach_the_builder() {
        let builder = || {
            Runtime::builder()
                .amqp_url("amqp://guest:guest@127.0.0.1:5672/%2f")
                .database_url("postgres://postgres@127.0.0.1:5432/idemq")
                .consume("payments", Noop)
        };
        let run = |args: &[&str]| {
            let matches = command().try_get_matches_from(args).expect("parses");
            matches.subcommand_matches("run").cloned().expect("run")
        };
        let refused = |builder: RuntimeBuilder| match builder.build() {
            Err(Error::Config(message)) => message,
            other => panic!("expected a configuration error, got {other:?}"),
        };
        // The relay off in the file, a poll interval from the flag.
        let file: Settings = toml::from_str("relay = \"off\"").expect("valid");
        let sub = run(&["app", "run", "--relay-poll-interval", "50ms"]);
        let message = refused(file.run_settings(builder(), &sub).expect("applied"));
        assert!(message.contains("relay_poll_interval is set but the relay is off"), "{message}");
        // A namespace that cannot scope rows, from the flag.
        let sub = run(&["app", "run", "--namespace", "a/b"]);
        let message = refused(Settings::default().run_settings(builder(), &sub).expect("applied"));
        assert!(message.contains("namespace \"a/b\""), "{message}");
        // Holding settings that outlast the broker's consumer_timeout, from the file.
        let file: Settings = toml::from_str(
            "database_retry_limit = \"29m\"\nhandler_timeout = \"90s\"\nshutdown_deadline = \"40m\"",
        )
        .expect("valid");
        let message = refused(file.run_settings(builder(), &run(&["app", "run"])).expect("applied"));
        assert!(message.contains("database_retry_limit (29m)"), "{message}");
        // A rate limit for a handler that is not there, from the flag.
        let sub = run(&["app", "run", "--rate-limit", "nobody=5"]);
        let message = refused(Settings::default().run_settings(builder(), &sub).expect("applied"));
        assert!(message.contains("rate_limit names \"nobody\""), "{message}");
        // A handler concurrency above the runtime's, from the file.
        let file: Settings = toml::from_str("handler_concurrency = { noop = 99 }").expect("valid");
        let message = refused(file.run_settings(builder(), &run(&["app", "run"])).expect("applied"));
        assert!(message.contains("handler_concurrency for \"noop\" must be 1..=16"), "{message}");
    }

    #[test]
    fn flow_control_settings_read_what_people_write() {
        assert_eq!(parse_kill_switch("off"), Ok(None));
        assert_eq!(parse_kill_switch("15%/10/1m/1m"), Ok(Some(KillSwitch::default())));
        assert!(parse_kill_switch("15/10").unwrap_err().contains("RATIO%/ATTEMPTS/WINDOW/PAUSE"));
        assert_eq!(parse_per_handler("record_payment=40"), Ok(("record_payment".to_owned(), 40)));
        assert!(parse_per_handler("record_payment").unwrap_err().contains("HANDLER=N"));
        assert!(parse_per_handler("record_payment=fast").unwrap_err().contains("not a whole number"));
        let file: Settings = toml::from_str("rate_limit = \"a=1,b=2\"").expect("as the flag takes it");
        assert_eq!(file.rate_limit, Some(vec![("a".to_owned(), 1), ("b".to_owned(), 2)]));
        let file: Settings = toml::from_str("kill_switch = \"off\"").expect("off");
        assert_eq!(file.kill_switch, Some(None));
        let matches = command()
            .try_get_matches_from(["app", "run", "--rate-limit", "a=1,b=2", "--rate-limit", "c=3"])
            .expect("parses");
        let sub = matches.subcommand_matches("run").expect("run");
        assert_eq!(per_handler_setting(sub, "rate-limit", None).len(), 3);
    }
}
