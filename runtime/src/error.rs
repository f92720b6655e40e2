//! The runtime's errors: start-up, connection and configuration failures.
//!
//! Per-message failures are not errors of the runtime: they end in a retry or a
//! dead letter (see [`FailureKind`](crate::FailureKind)) and never stop it.

/// What stopped the runtime or kept it from starting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Could not connect to RabbitMQ.
    #[error("cannot connect to RabbitMQ at {url}: {source}; is the broker running, and are AMQP_URL's credentials and vhost right?")]
    AmqpConnect {
        /// The URL, password redacted.
        url: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// A RabbitMQ operation failed.
    #[error("RabbitMQ refused or failed to {action}: {source}")]
    Amqp {
        /// What the runtime was doing.
        action: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
    /// A queue exists with other arguments than the topology declares (406 PRECONDITION_FAILED).
    #[error(
        "queue '{queue}' already exists with different arguments: {detail}. \
         idemq declares it with [{declared}]. \
         Fix: declare it as it exists (e.g. `.classic()` for a classic queue), \
         or move its messages and delete it (`rabbitmqctl delete_queue {queue}`) so it can be redeclared"
    )]
    QueueMismatch {
        /// The queue's name.
        queue: String,
        /// The broker's words on which argument differs (it names the first only).
        detail: String,
        /// The arguments idemq declared, `name=value, ...`.
        declared: String,
    },
    /// An exchange exists with another type or other arguments (406 PRECONDITION_FAILED).
    #[error(
        "exchange '{exchange}' already exists with a different type or arguments: {detail}. \
         Fix: declare it as it exists, or delete it (`rabbitmqctl delete_exchange {exchange}`)"
    )]
    ExchangeMismatch {
        /// The exchange's name.
        exchange: String,
        /// The broker's words on what differs.
        detail: String,
    },
    /// Could not reach PostgreSQL or build the pool.
    #[error(
        "cannot connect to PostgreSQL at {url}: {message}; is the server running and DATABASE_URL right?"
    )]
    DatabaseConnect {
        /// The URL, password redacted.
        url: String,
        /// What failed.
        message: String,
    },
    /// idemq's tables are missing or out of date, or this user may not use them:
    /// found at start-up, or when one of idemq's own statements is refused.
    #[error("the database is not ready for idemq: {problem}. Fix: {fix}")]
    Schema {
        /// What is wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// Connecting to the broker and declaring the topology did not finish in time.
    #[error("connecting to RabbitMQ and declaring the topology took longer than {after:?}; is the broker at AMQP_URL healthy (not still starting, not under an alarm)?")]
    StartTimeout {
        /// How long the runtime waited.
        after: std::time::Duration,
    },
    /// The embedded migrations failed.
    #[error("running idemq's migrations failed: {0}")]
    Migration(String),
    /// The builder was given an unusable setting.
    #[error("invalid idemq configuration: {0}")]
    Config(String),
}

/// Hides the password of a `scheme://user:password@host/...` URL.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_hides_only_the_password() {
        assert_eq!(super::redact("amqp://guest:secret@h:5672/%2f"), "amqp://guest:***@h:5672/%2f");
        assert_eq!(super::redact("postgres://postgres@h/db"), "postgres://postgres@h/db");
    }
}
