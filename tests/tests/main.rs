//! idemq's integration tests, one module per topic, in one binary (as
//! tokio-postgres keeps its own): linked once, and its tests run side by side
//! across topics, since most of their time is spent waiting on the broker and the
//! database. Each test has its own database, queues or vhost (`idemq_tests`), so
//! none sees another's messages or rows.
//!
//! Two files are binaries of their own, because they take the whole process or the
//! whole server: `broker_faults.rs` (stops the broker's app, raises a memory alarm)
//! runs while no other test does; `otel.rs` installs the process's OpenTelemetry
//! subscriber. Cargo runs test binaries one after another. (`database_faults`
//! restarts and stops a PostgreSQL server of its own, so it runs here.)

mod support;

mod app_workspace;
mod asyncapi;
mod batch_handlers;
mod batches;
mod brokers;
mod chaos;
mod cluster;
mod connect;
mod console;
mod consumer_timeout;
mod copies;
mod crash;
mod database_faults;
mod dedup;
mod failures;
mod flow_control;
mod handler_options;
mod handlers;
mod identity;
mod keys;
mod logs;
mod message_types;
mod migrate;
mod network_faults;
mod operations;
mod outbox;
mod pg_failover;
mod pg_pair;
mod pipeline;
mod privileges;
mod publisher;
mod rabbitmq4;
mod saga_cli;
mod sagas;
mod scheduled;
mod secrets;
mod signals;
mod sqlstate;
mod startup;
mod streams;
mod support_selftest;
mod test_kit;
mod tls;
mod topology;
mod traces;
