//! The crate root's old names, kept for one release (0.2) beside their new homes:
//! each type, function and constant here is `#[deprecated]` naming its
//! replacement, so code using it still builds, with a warning that says what to
//! write. A re-export cannot carry a deprecation, so the traits and the `schema`
//! module are re-exported as they were, hidden from the docs. CHANGELOG.md lists
//! every rename. Delete this file in the release after.

#![allow(missing_docs)]

use std::sync::Arc;

use diesel_async::AsyncPgConnection;

use crate::{Queue, RuntimeBuilder};

pub use crate::key::{FromMessage, FromMessageAndMetadata, KeyField, KeyFn, KeyedMessage};
pub use crate::observe::Observe;
pub use crate::store::schema;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::Commit`")]
pub type Commit<'a> = crate::observe::Commit<'a>;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::ConnectionEvent`")]
pub type ConnectionEvent = crate::observe::ConnectionEvent;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::InfrastructureRetry`")]
pub type InfrastructureRetry<'a> = crate::observe::InfrastructureRetry<'a>;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::RelayPass`")]
pub type RelayPass = crate::observe::RelayPass;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::Settled`")]
pub type Settled = crate::observe::Settled;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::Stats`")]
pub type Stats = crate::observe::Stats;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::StatsSnapshot`")]
pub type StatsSnapshot = crate::observe::StatsSnapshot;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::observe::Sweep`")]
pub type Sweep = crate::observe::Sweep;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::CheckedRetention`")]
pub type CheckedRetention = crate::store::CheckedRetention;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::Retention`")]
pub type Retention = crate::store::Retention;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::key::KeyError`")]
pub type KeyError = crate::key::KeyError;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::key::TemplatePart`")]
pub type TemplatePart<'a> = crate::key::TemplatePart<'a>;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::outbox::Outgoing`")]
pub type Outgoing = crate::outbox::Outgoing;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::outbox::Relay`")]
pub type Relay = crate::outbox::Relay;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::outbox::RelayBuilder`")]
pub type RelayBuilder = crate::outbox::RelayBuilder;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::headers::MAX_ERROR_HEADER_BYTES`")]
pub const MAX_ERROR_HEADER_BYTES: usize = crate::headers::MAX_ERROR_HEADER_BYTES;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::key::MAX_STORED_KEY_BYTES`")]
pub const MAX_STORED_KEY_BYTES: usize = crate::key::MAX_STORED_KEY_BYTES;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::Queue::BROKER_LIMIT_MARGIN`")]
pub const BROKER_LIMIT_MARGIN: u32 = Queue::BROKER_LIMIT_MARGIN;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::Queue::DEFAULT_DELIVERY_LIMIT`")]
pub const DEFAULT_DELIVERY_LIMIT: u32 = Queue::DEFAULT_DELIVERY_LIMIT;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::connect::DEFAULT_AMQP_URL`")]
pub const DEFAULT_AMQP_URL: &str = crate::connect::DEFAULT_AMQP_URL;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::connect::DEFAULT_DATABASE_URL`")]
pub const DEFAULT_DATABASE_URL: &str = crate::connect::DEFAULT_DATABASE_URL;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::RuntimeBuilder::DEFAULT_BATCH_SIZE`")]
pub const DEFAULT_BATCH_SIZE: usize = RuntimeBuilder::DEFAULT_BATCH_SIZE;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::RuntimeBuilder::DEFAULT_CONCURRENCY`")]
pub const DEFAULT_CONCURRENCY: usize = RuntimeBuilder::DEFAULT_CONCURRENCY;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::MIGRATIONS`")]
pub const MIGRATIONS: diesel_migrations::EmbeddedMigrations = crate::store::MIGRATIONS;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::MIGRATION_LOCK`")]
pub const MIGRATION_LOCK: i64 = crate::store::MIGRATION_LOCK;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::GC_LOCK`")]
pub const GC_LOCK: i64 = crate::store::GC_LOCK;

#[deprecated(since = "0.2.0", note = "use `.observe(idemq::observe::on_settled(..))`")]
pub type Observer = Arc<dyn Fn(&crate::observe::Settled) + Send + Sync>;

#[deprecated(since = "0.2.0", note = "use `.observe(idemq::observe::on_connection(..))`")]
pub type ConnectionObserver = Arc<dyn Fn(&crate::observe::ConnectionEvent) + Send + Sync>;

#[deprecated(since = "0.2.0", note = "moved: use `idemq::connect::redact`")]
pub fn redact(text: &str) -> String {
    crate::connect::redact(text)
}

#[deprecated(since = "0.2.0", note = "moved: use `idemq::connect::env_url`")]
pub fn env_url(name: &str, default: &str) -> Result<String, crate::Error> {
    crate::connect::env_url(name, default)
}

#[deprecated(since = "0.2.0", note = "moved: use `idemq::outbox::enqueue`")]
pub async fn enqueue(
    conn: &mut AsyncPgConnection,
    outgoing: crate::outbox::Outgoing,
) -> Result<String, crate::PublishError> {
    crate::outbox::enqueue(conn, outgoing).await
}

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::forget`")]
pub async fn forget(conn: &mut AsyncPgConnection, handler: &str, key: &str) -> diesel::QueryResult<bool> {
    crate::store::forget(conn, handler, key).await
}

#[deprecated(since = "0.2.0", note = "moved: use `idemq::store::sweep`")]
pub async fn sweep(
    conn: &mut AsyncPgConnection,
    retention: &crate::store::CheckedRetention,
) -> diesel::QueryResult<crate::observe::Sweep> {
    crate::store::sweep(conn, retention).await
}
