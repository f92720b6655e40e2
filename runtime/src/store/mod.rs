//! PostgreSQL: idemq's tables and statements (dedup rows, start marks, copy
//! records, the outbox), the pool, the schema check, migrations, retention.

pub(crate) mod db;
pub(crate) mod migrate;
pub(crate) mod retention;
pub mod schema;
