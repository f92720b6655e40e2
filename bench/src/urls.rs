//! Where the broker and the database are: what every process of the bench connects to.

/// The bench's own database (created if missing, tables truncated between runs).
pub(crate) const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_bench";

/// Where the broker and the database are.
#[derive(Debug, Clone)]
pub(crate) struct Urls {
    pub(crate) amqp: String,
    pub(crate) database: String,
}

impl Urls {
    /// `AMQP_URL` and `DATABASE_URL`, with local defaults.
    pub(crate) fn from_env() -> Self {
        let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
        Self {
            amqp: env("AMQP_URL", idemq::connect::DEFAULT_AMQP_URL),
            database: env("DATABASE_URL", DEFAULT_DATABASE_URL),
        }
    }
}
