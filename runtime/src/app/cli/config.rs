//! Where the CLI's settings come from: flags, then the environment, then the TOML
//! file (`--config`), then the code's builder; and the URLs, each given directly or
//! as a file holding it.

use std::path::PathBuf;
use std::time::Duration;

use clap::ArgMatches;

use crate::engine::runtime::RuntimeBuilder;
use crate::error::{redact, Error};
use crate::store::retention::Retention;

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
                "the config file {} is not valid: {}; its settings are amqp_url, amqp_url_file, \
                 database_url, database_url_file, concurrency, batch_size, prefetch, http_addr, retention, \
                 replay_window, startup_timeout and consumer_timeout (durations as \"30d\")",
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
        if let Some(timeout) = setting::<Duration>(sub, "consumer-timeout").or(self.consumer_timeout) {
            builder = builder.consumer_timeout(timeout);
        }
        Ok(builder)
    }
}
