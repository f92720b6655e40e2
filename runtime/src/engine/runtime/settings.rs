//! Every [`RuntimeBuilder`](super::RuntimeBuilder) setting with its names outside the
//! code: the `run` flag, the environment variable and the TOML key the CLI reads it
//! from (flag → environment → TOML file → builder), or none where it only makes sense
//! in code (a handler, a policy, an observer).
//!
//! Two tests keep the three places true to each other: every public setter of
//! `builder.rs` is listed here (add a setting, and the test fails until it is), and
//! the *Configuration* table of `docs/operating.md` has a row for each, with these names (add a
//! row). The CLI's own tests check that each flag, variable and key listed is read.

/// One builder setting and its names outside the code.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The builder's method: `heartbeat` for `.heartbeat(d)`.
    pub method: &'static str,
    /// `run`'s flag, `--heartbeat` (also a global flag for the URLs).
    pub flag: Option<&'static str>,
    /// The environment variable, `IDEMQ_HEARTBEAT`.
    pub env: Option<&'static str>,
    /// The TOML file's key, `heartbeat`.
    pub toml: Option<&'static str>,
    /// A valid value, as the flag or the variable takes it (the CLI's tests give it).
    pub example: &'static str,
}

/// A setting the CLI reads: its flag, variable and TOML key share one name.
const fn cli(method: &'static str, flag: &'static str, env: &'static str, example: &'static str) -> Setting {
    Setting { method, flag: Some(flag), env: Some(env), toml: Some(method), example }
}

/// A setting made in code only.
const fn code(method: &'static str) -> Setting {
    Setting { method, flag: None, env: None, toml: None, example: "" }
}

/// Every setting, in the Configuration table's order.
pub const SETTINGS: &[Setting] = &[
    cli("amqp_url", "--amqp-url", "AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
    cli("database_url", "--database-url", "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    code("topology"),
    code("consume"),
    code("consume_with"),
    code("consume_partitions"),
    cli("concurrency", "--concurrency", "IDEMQ_CONCURRENCY", "16"),
    cli("batch_size", "--batch-size", "IDEMQ_BATCH_SIZE", "256"),
    cli("prefetch", "--prefetch", "IDEMQ_PREFETCH", "100"),
    cli("linger", "--linger", "IDEMQ_LINGER", "5ms"),
    code("retry"),
    cli("kill_switch", "--kill-switch", "IDEMQ_KILL_SWITCH", "15%/10/1m/1m"),
    code("handler_kill_switch"),
    cli("rate_limit", "--rate-limit", "IDEMQ_RATE_LIMIT", "record_payment=40"),
    cli("handler_concurrency", "--handler-concurrency", "IDEMQ_HANDLER_CONCURRENCY", "record_payment=2"),
    cli("handler_timeout", "--handler-timeout", "IDEMQ_HANDLER_TIMEOUT", "60s"),
    cli("max_body_bytes", "--max-body-bytes", "IDEMQ_MAX_BODY_BYTES", "1048576"),
    cli("on_conflict", "--on-conflict", "IDEMQ_ON_CONFLICT", "ignore"),
    cli("replication_check", "--replication-check", "IDEMQ_REPLICATION_CHECK", "refuse"),
    cli("namespace", "--namespace", "IDEMQ_NAMESPACE", "billing"),
    cli("shutdown_deadline", "--shutdown-deadline", "IDEMQ_SHUTDOWN_DEADLINE", "10s"),
    cli("heartbeat", "--heartbeat", "IDEMQ_HEARTBEAT", "20s"),
    cli("reconnect_max_backoff", "--reconnect-max-backoff", "IDEMQ_RECONNECT_MAX_BACKOFF", "30s"),
    cli("database_retry_limit", "--database-retry-limit", "IDEMQ_DATABASE_RETRY_LIMIT", "25m"),
    cli("startup_timeout", "--startup-timeout", "IDEMQ_STARTUP_TIMEOUT", "2m"),
    cli("release_streams_after", "--release-streams-after", "IDEMQ_RELEASE_STREAMS_AFTER", "15s"),
    cli("consumer_timeout", "--consumer-timeout", "IDEMQ_CONSUMER_TIMEOUT", "30m"),
    cli("relay", "--relay", "IDEMQ_RELAY", "off"),
    cli("relay_poll_interval", "--relay-poll-interval", "IDEMQ_RELAY_POLL_INTERVAL", "1s"),
    code("reply_ttl"),
    cli("retention", "--retention", "IDEMQ_RETENTION", "30d"),
    code("observe"),
    cli("http_addr", "--http-addr", "IDEMQ_HTTP_ADDR", "127.0.0.1:9464"),
    // Read by `build` itself, so that an application's own `main` heeds it too.
    Setting {
        method: "allow_unpatched_amqp_parser",
        flag: None,
        env: Some("IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER"),
        toml: None,
        example: "1",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of `builder.rs`'s public methods (`    pub fn name(` or `name<`).
    fn public_setters() -> Vec<&'static str> {
        include_str!("builder.rs")
            .lines()
            .filter_map(|line| line.strip_prefix("    pub fn "))
            .map(|rest| rest.split(['(', '<']).next().unwrap_or_default())
            .collect()
    }

    #[test]
    fn every_public_setter_of_the_builder_is_listed() {
        let setters = public_setters();
        assert!(setters.len() > 20, "the builder's setters were not found: {setters:?}");
        for setter in setters {
            assert!(
                SETTINGS.iter().any(|s| s.method == setter),
                "RuntimeBuilder::{setter} is not in SETTINGS (runtime/src/engine/runtime/settings.rs): list it, \
                 with its flag, variable and TOML key if the CLI should read it, and give it a row in the \
                 guide's Configuration table (docs/operating.md)"
            );
        }
    }

    #[test]
    fn every_setting_has_a_row_in_the_guides_configuration_table() {
        let chapter = include_str!("../../../../docs/operating.md");
        let table = chapter
            .split("\n## Configuration\n")
            .nth(1)
            .expect("docs/operating.md has a Configuration section");
        let table = table.split("\n#").next().unwrap_or_default();
        for setting in SETTINGS {
            let start = format!("| `.{}(", setting.method);
            let Some(row) = table.lines().find(|line| line.starts_with(&start)) else {
                panic!(
                    "docs/operating.md's Configuration table has no row for `.{}(..)`: add one",
                    setting.method
                )
            };
            let cells: Vec<&str> = row.split(" | ").collect();
            let named = |name: Option<&str>, cell: usize| match name {
                Some(name) => cells.get(cell).is_some_and(|c| c.contains(&format!("`{name}`"))),
                None => cells.get(cell).is_some_and(|c| c.trim() == "—"),
            };
            assert!(named(setting.flag, 1), "the flag column of {row} should say {:?}", setting.flag);
            assert!(named(setting.env, 2), "the environment column of {row} should say {:?}", setting.env);
            assert!(named(setting.toml, 3), "the TOML column of {row} should say {:?}", setting.toml);
        }
    }
}
