//! The engine of [idemq](https://docs.rs/idemq): exactly-once effects for RabbitMQ
//! consumers. Depend on the crate `idemq`, which re-exports this one at its root with
//! the command line (`idemq::cli`) and the test kits (`idemq::testing`) beside it,
//! and holds the documentation: the design, the guide, the features.
//!
//! ## Layers
//!
//! The source is in layers, and each imports only those below it (`tests/layers.rs`
//! fails on an import that points up or sideways, and on any import circle):
//!
//! ```text
//! lib (the public face) · app/ (otel, the log writer) · connect · outbox
//!   └─> engine/   the delivery state machine (delivery), stream consumers (stream),
//!   │             broker sessions, start-up, the relay, the runtime that supervises
//!   │             them, metrics
//!   └─> handler/ · store/ · broker/                siblings: none imports another
//!         handler/  the user's contract: Handler, HandlerError, Context, keys,
//!         │         preparing a delivery (decode, key, fingerprint), identity
//!         store/    PostgreSQL: idemq's statements (db), the schema and its check
//!         │         (migrate), retention
//!         broker/   lapin: broker addresses, topology, acks, dead letters and copies,
//!         │         the publisher
//!         └─> tls/  the rustls configuration both store and broker connect with;
//!         │         PostgreSQL's connections, made by idemq (the SQLSTATEs read
//!         │         off the wire)
//!               └─> base/  pure (no I/O): outcomes, verdicts, retry policy, backoff,
//!                          width, observers and their events, outgoing messages,
//!                          header names, redaction; with `error` and `config` beside it
//! ```
//!
//! Where a type lives decides who may use it: a value several layers need
//! (`OnConflict`, `ErrorClass`, `ConnectionEvent`, `Sweep`, `Outgoing`) lives in
//! `base`, the lowest that needs it. The public modules above are a face over the
//! layers (`idemq::observe` re-exports from `base`, `idemq::store` is the layer
//! itself), so the layout can change without moving a public path. Two choices
//! differ from the first sketch of this layout: `base` rather than `core` (a module
//! named `core` at the root shadows the `core` crate in paths), and the metrics
//! server lives in `engine` beside the runtime that starts and stops it
//! (`RuntimeBuilder::http_addr`), not in `app`.
//!
//! Above the engine, crates of their own: the command line (`idemq-cli`, `cli/`) and
//! the test kits (`idemq-testing`, `testing/`), with the facade `idemq` (`idemq/`) over
//! all three. What they need of the engine that is not public API goes through the
//! hidden `__private::sibling`; the fault hooks are the test kit's, and the engine
//! keeps only an inert point to run one at (`engine/hook.rs`).

#![warn(missing_docs)]
// docs.rs (`[package.metadata.docs.rs]`): each feature-gated item says its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]
// A library never ends the process: a binary decides (`idemq::cli` returns exit
// status 130 on a second signal, see `ShutdownSignals`).
#![deny(clippy::exit)]

// The layers, each importing only those below it (`tests/layers.rs` holds the
// rule): app → engine → {store, broker, handler} → tls → base; `error` and
// `config` are beside `base`. See "Layers" above.
mod app;
mod base;
mod broker;
mod config;
pub mod connect;
mod engine;
mod error;
mod handler;
pub mod outbox;
pub mod saga;
pub mod store;
mod tls;

// What a handler author needs, at the root; everything else in one module each.
pub use base::outcome::{FailureKind, Outcome};
pub use base::outgoing::{Message, PublishError};
pub use base::retry::RetryPolicy;
pub use base::verdict::OnConflict;
pub use broker::partitions::Partitions;
pub use broker::publisher::Publisher;
pub use broker::topology::{Exchange, Queue, Topology};
pub use engine::flow::{KillSwitch, KillSwitchParseError};
pub use engine::runtime::{shutdown_signal, shutdown_signals, Runtime, RuntimeBuilder, ShutdownSignals};
pub use error::{Dependency, Error};
pub use handler::batch::Batch;
pub use handler::context::{Context, HandlerOutput};
pub use handler::key::{Key, Metadata};
pub use handler::wire::{MessageType, Versioned};
pub use handler::{BoxFuture, ErrorClass, Handler, HandlerError, Permanent};
pub use idemq_macros::{idempotent_handler, Message};
pub use store::migrate::migrate;
pub use store::replication::ReplicationCheck;

// The crates whose types appear in idemq's signatures, at the versions idemq is
// built with: a handler's connection (`diesel_async::AsyncPgConnection`, queried with
// `diesel`), the broker connection of [`connect::broker`] (`lapin`), and the token
// [`Runtime::run`] stops on.
pub use diesel;
pub use diesel_async;
pub use lapin;
pub use tokio_util::sync::CancellationToken;

#[cfg(feature = "otel")]
pub use app::otel;
pub use base::headers;

/// Watching the runtime: the [`observe::Observe`] trait every report goes through,
/// its events, and the built-in counters ([`observe::Stats`]).
///
/// Add any number of observers with [`RuntimeBuilder::observe`]; for a single
/// callback, [`on_settled`](observe::on_settled) and
/// [`on_connection`](observe::on_connection) wrap a closure.
pub mod observe {
    pub use crate::base::observe::Sweep;
    pub use crate::base::observe::{
        on_connection, on_settled, Commit, ConnectionEvent, DecidedBatch, InfrastructureRetry,
        KillSwitchEvent, Observe, RelayPass, SagaStep, SagaStepKind, StreamEvent, StreamLag, StreamState,
    };
    pub use crate::base::outcome::{Settled, Stats, StatsSnapshot};
}

/// Publishing outside handlers: the [`Publisher`]'s settings and the errors of its
/// requests ([`Publisher`] and [`PublishError`] are at the crate root).
pub mod publisher {
    pub use crate::broker::publisher::{PublisherBuilder, RequestError};
}

/// Message keys: how a handler's dedup key is taken from a message ([`Key`]
/// and [`Metadata`] are at the crate root). The attribute
/// `#[idempotent_handler(key = "...")]` writes these impls; they are public for
/// handlers written by hand and for key types of your own ([`key::KeyField`]).
pub mod key {
    pub use crate::handler::key::{
        FromMessage, FromMessageAndMetadata, KeyError, KeyField, KeyFn, KeyedMessage, TemplatePart,
        MAX_STORED_KEY_BYTES,
    };
}

/// Re-exports for code generated by `#[idempotent_handler]`. Not public API.
///
/// The checks only the compiler can make, for code the macro writes: each trait is
/// used on the user's own tokens (so its error underlines them) and says what to
/// write; its impl is `do_not_recommend`, so rustc shows that message rather than
/// the impl's unmet bound.
#[doc(hidden)]
#[allow(missing_docs, unreachable_pub)]
pub mod __private {

    /// What the workspace's other crates (`idemq-cli`, `idemq-testing`) need of the
    /// engine that is no public API: for them only, it changes without notice. Kept
    /// to what they use; a thing that deserves to be public is made so instead.
    pub mod sibling {
        use std::time::Duration;

        use crate::base::retry::RetryPolicy;
        use crate::engine::startup::Startup;
        use crate::error::Error;
        use crate::handler::wire::Wire;
        use crate::handler::BoxFuture;

        pub use crate::app::stderr::StderrLines;
        pub use crate::base::amqp_value::{header, string, text};
        pub use crate::base::duration::human;
        pub use crate::base::random_id;
        pub use crate::config::{parse_switch, resolve};
        pub use crate::engine::hook::{FaultContext, FaultHook, FaultPoint};
        pub use crate::engine::runtime::plan::QueuePlan;

        /// Where a stream ends (`status`).
        pub mod stream_end {
            pub use crate::broker::stream_end::{read_offset, BURST_GAP};
        }
        pub use crate::engine::runtime::settings::SETTINGS;
        pub use crate::handler::identity;

        /// idemq's statements the CLI's `status` and `migrations` run.
        pub mod db {
            #[cfg(feature = "metrics")]
            pub use crate::store::db::outbox_lag;
            pub use crate::store::db::{
                applied_migrations, count_members, count_rows, count_sagas, limit_statements, lock_holder,
                owner_lock, share_group, show_saga, stored_offsets, LockHolder, SagaCount, SagaShown,
                StoredOffset, NO_OFFSET,
            };

            /// The replication state in words (the console): what the server is,
            /// its standbys and `synchronous_commit`; and the replication check's
            /// concerns, each with its fix.
            pub async fn replication(
                conn: &mut crate::__private::AsyncPgConnection,
            ) -> diesel::QueryResult<(String, Vec<String>)> {
                let state = crate::store::replication::read(conn).await?;
                let role = if state.in_recovery { "a standby (in recovery)" } else { "a primary" };
                let synchronous = match state.synchronous {
                    Some(n) => format!("{n} synchronous"),
                    None => "synchronous ones unknown (the role lacks pg_read_all_stats)".to_owned(),
                };
                let names = match state.standby_names.trim() {
                    "" => "synchronous_standby_names empty".to_owned(),
                    names => format!("synchronous_standby_names '{names}'"),
                };
                let words = format!(
                    "{role}; {} standby(s) streaming, {synchronous}; {names}; synchronous_commit {}",
                    state.standbys, state.synchronous_commit
                );
                Ok((words, state.concerns()))
            }
        }

        /// Pages served beside the metrics: the CLI's console.
        #[cfg(feature = "metrics")]
        pub mod pages {
            pub use crate::engine::pages::{Live, Mount, PageRequest, PageResponse, Pages, MAX_BODY, PREFIX};

            /// Mounts `mount` on a builder: served once its `http_addr` is set.
            pub fn with_pages(builder: crate::RuntimeBuilder, mount: Mount) -> crate::RuntimeBuilder {
                builder.with_pages(mount)
            }

            /// Serves `mount`'s pages alone on `addr` (no runtime, no metrics) until
            /// the returned guard is dropped.
            pub fn serve_pages(
                addr: std::net::SocketAddr,
                mount: Mount,
            ) -> Result<impl Drop + Send, crate::error::Error> {
                crate::engine::metrics::serve_pages(addr, mount)
            }
        }

        /// The test kit's fault hook on a builder (`FaultHookExt::fault_hook`).
        pub fn with_fault_hook(builder: crate::RuntimeBuilder, hook: FaultHook) -> crate::RuntimeBuilder {
            builder.with_fault_hook(hook)
        }

        /// What the CLI reads of a builder's plan (`declare`, `status`, `run --queue`).
        pub trait BuilderPlan: Sized {
            fn configured_amqp_url(&self) -> &str;
            fn configured_database_url(&self) -> &str;
            fn startup(&self) -> Startup;
            fn only_queues(self, queues: &[String]) -> Result<Self, Error>;
            fn retry_policies(&self) -> Vec<RetryPolicy>;
            fn queue_plans(&self) -> Vec<QueuePlan>;
            fn bindings(&self) -> Vec<(&str, &str, &str)>;
            fn exchange_names(&self) -> Vec<String>;
            fn exchanges(&self) -> Vec<(String, String)>;
            fn declare_all<'a>(
                &'a self,
                connection: &'a lapin::Connection,
            ) -> BoxFuture<'a, Result<(), Error>>;
            fn consumed_queues(&self) -> Vec<(String, String)>;
            fn handler_settings(&self) -> Vec<(String, String, Vec<String>)>;
        }

        impl BuilderPlan for crate::RuntimeBuilder {
            fn configured_amqp_url(&self) -> &str {
                self.configured_amqp_url()
            }
            fn configured_database_url(&self) -> &str {
                self.configured_database_url()
            }
            fn startup(&self) -> Startup {
                self.startup()
            }
            fn only_queues(self, queues: &[String]) -> Result<Self, Error> {
                self.only_queues(queues)
            }
            fn retry_policies(&self) -> Vec<RetryPolicy> {
                self.retry_policies()
            }
            fn queue_plans(&self) -> Vec<QueuePlan> {
                self.queue_plans()
            }
            fn bindings(&self) -> Vec<(&str, &str, &str)> {
                self.bindings()
            }
            fn exchange_names(&self) -> Vec<String> {
                self.exchange_names()
            }
            fn exchanges(&self) -> Vec<(String, String)> {
                self.exchanges()
            }
            fn declare_all<'a>(
                &'a self,
                connection: &'a lapin::Connection,
            ) -> BoxFuture<'a, Result<(), Error>> {
                Box::pin(self.declare_all(connection))
            }
            fn consumed_queues(&self) -> Vec<(String, String)> {
                self.consumed_queues()
            }
            fn handler_settings(&self) -> Vec<(String, String, Vec<String>)> {
                self.handler_settings()
            }
        }

        /// What the CLI reads of a queue (`declare`, `status`).
        pub trait QueueText {
            fn describe(&self) -> String;
            fn is_stream(&self) -> bool;
        }

        impl QueueText for crate::Queue {
            fn describe(&self) -> String {
                self.describe()
            }
            fn is_stream(&self) -> bool {
                self.is_stream()
            }
        }

        /// An outgoing message's `correlation_id` (the test kit finds a request's reply).
        pub fn correlation_id(message: &crate::outbox::Outgoing) -> Option<&str> {
            message.correlation_id.as_deref()
        }

        /// Whether `Publisher::send` would publish it (the test kit's `TestMessage::of`).
        pub fn validate(message: &crate::outbox::Outgoing) -> Result<(), crate::PublishError> {
            message.validate()
        }

        /// Its AMQP properties as published with `message_id` (the test kit's `TestMessage::of`).
        pub fn properties(message: &crate::outbox::Outgoing, message_id: &str) -> lapin::BasicProperties {
            message.properties(message_id)
        }

        /// An outbox row's columns, as the test kit reads them back (`TestKit::published`).
        pub struct OutboxColumns {
            pub message_id: String,
            pub exchange: String,
            pub routing_key: String,
            pub body: Vec<u8>,
            pub content_type: Option<String>,
            pub correlation_id: Option<String>,
            pub headers: std::collections::BTreeMap<String, String>,
            pub message_type: Option<String>,
            pub mandatory: bool,
        }

        impl From<OutboxColumns> for crate::outbox::Outgoing {
            fn from(row: OutboxColumns) -> Self {
                Self {
                    exchange: row.exchange,
                    routing_key: row.routing_key,
                    body: row.body,
                    message_id: Some(row.message_id),
                    content_type: row.content_type,
                    correlation_id: row.correlation_id,
                    message_type: row.message_type,
                    headers: row.headers,
                    mandatory: row.mandatory,
                    reply: None,
                    due: None,
                }
            }
        }

        /// A handler's message type on the wire: its name, and the oldest and newest
        /// versions it reads (the test kit's hints).
        pub fn wire_of<M>(wire: &Wire<M>) -> (Option<&'static str>, Option<(u32, u32)>) {
            let chain = wire.versions.as_ref().and_then(|versions| versions.chain().ok());
            (wire.type_name, chain.and_then(|chain| Some((chain.last()?.0, chain.first()?.0))))
        }

        /// A delivery of `handler` settled as `outcome` on queue `q`, just now (the test
        /// kit's unit tests: `Settled` is `non_exhaustive`).
        pub fn settled(handler: &'static str, outcome: crate::Outcome) -> crate::observe::Settled {
            let now = std::time::Instant::now();
            crate::observe::Settled {
                queue: "q".into(),
                handler,
                key: None,
                outcome,
                settled_with_broker: true,
                delivery_count: 0,
                redelivered: false,
                attempt: 1,
                session: 1,
                batch: 1,
                received_at: now,
                began_at: None,
                settled_at: now,
                handler_time: None,
            }
        }

        /// The start-up time the CLI spent before `run` (`Runtime::run` gets the rest).
        pub fn startup_spent(runtime: &mut crate::Runtime, spent: Duration) {
            runtime.startup_spent(spent);
        }
    }
    pub use diesel_async::AsyncPgConnection;
    pub use serde::Serialize;
    pub use serde_json;

    /// What a handler's message type declares on the wire (see `handler::wire`).
    pub use crate::handler::wire::{
        NamedProbe as __IdemqNamedProbe, NoSchemaProbe as __IdemqNoSchemaProbe, Probe as __IdemqProbe,
        SchemaFn, SchemaProbe as __IdemqSchemaProbe, UnnamedProbe as __IdemqUnnamedProbe,
        UnversionedProbe as __IdemqUnversionedProbe, VersionedProbe as __IdemqVersionedProbe, Versions, Wire,
    };

    #[diagnostic::on_unimplemented(
        message = "a handler's first argument is the transaction's connection, not `{Self}`",
        label = "write `&mut AsyncPgConnection` here",
        note = "the handler runs inside idemq's dedup transaction: \
                take `conn: &mut diesel_async::AsyncPgConnection`"
    )]
    pub trait __IdemqConnection<'c> {
        fn __idemq_connection(conn: &'c mut crate::__private::AsyncPgConnection) -> Self;
    }
    #[diagnostic::do_not_recommend]
    impl<'c> __IdemqConnection<'c> for &'c mut crate::__private::AsyncPgConnection {
        fn __idemq_connection(conn: &'c mut crate::__private::AsyncPgConnection) -> Self {
            conn
        }
    }

    #[diagnostic::on_unimplemented(
        message = "a handler's context argument is `&mut idemq::Context` (or `&idemq::Context`), not `{Self}`",
        label = "write `&mut idemq::Context` here",
        note = "after the connection, the message is one argument (by value or `&T`) and the \
                context the other"
    )]
    pub trait __IdemqContext<'c> {
        fn __idemq_context(ctx: &'c mut crate::Context) -> Self;
    }
    #[diagnostic::do_not_recommend]
    impl<'c> __IdemqContext<'c> for &'c mut crate::Context {
        fn __idemq_context(ctx: &'c mut crate::Context) -> Self {
            ctx
        }
    }
    #[diagnostic::do_not_recommend]
    impl<'c> __IdemqContext<'c> for &'c crate::Context {
        fn __idemq_context(ctx: &'c mut crate::Context) -> Self {
            ctx
        }
    }

    #[diagnostic::on_unimplemented(
        message = "a handler returns `Result<R, E>`, not `{Self}`",
        label = "write `Result<(), E>` here",
        note = "`E` is your error type (any `std::error::Error + Send + Sync + 'static`, \
                retried) or `idemq::HandlerError`; `R` is `()` or a result to store and reply with"
    )]
    pub trait __IdemqResult<R, E> {
        fn __idemq_result(self) -> ::core::result::Result<R, E>;
    }
    #[diagnostic::do_not_recommend]
    impl<R, E> __IdemqResult<R, E> for ::core::result::Result<R, E> {
        fn __idemq_result(self) -> ::core::result::Result<R, E> {
            self
        }
    }

    /// A batch handler's `handle` (a batch of one).
    pub use crate::handler::batch::as_batch_of_one as __idemq_batch_of_one;

    #[diagnostic::on_unimplemented(
        message = "a saga started by a message begins from its state's default, but `{Self}` has none",
        label = "`saga(start)` needs `Default` on this state",
        note = "derive it (`#[derive(Default, ..)]`) or implement it: a new saga's state is `Default::default()`"
    )]
    pub trait __IdemqSagaStart: Sized {
        fn __idemq_new() -> Self;
    }
    #[diagnostic::do_not_recommend]
    impl<S: Default> __IdemqSagaStart for S {
        fn __idemq_new() -> Self {
            S::default()
        }
    }

    pub use crate::base::SagaShape;

    /// A starting step's new state.
    pub fn __idemq_saga_start<S: __IdemqSagaStart>() -> S {
        S::__idemq_new()
    }

    #[diagnostic::on_unimplemented(
        message = "a batch handler's message argument is `&mut idemq::Batch<M>`, not `{Self}`",
        label = "write `&mut idemq::Batch<YourMessage>` here",
        note = "a handler takes one message (`msg: YourMessage`), or the new messages of a \
                transaction together (`batch: &mut idemq::Batch<YourMessage>`)"
    )]
    pub trait __IdemqBatch<'c, M> {
        fn __idemq_batch(batch: &'c mut crate::Batch<M>) -> Self;
    }
    #[diagnostic::do_not_recommend]
    impl<'c, M> __IdemqBatch<'c, M> for &'c mut crate::Batch<M> {
        fn __idemq_batch(batch: &'c mut crate::Batch<M>) -> Self {
            batch
        }
    }

    #[diagnostic::on_unimplemented(
        message = "a batch handler's result `{Self}` must be `()` or `Vec<R>` with `R: serde::Serialize`",
        label = "write `()` or `Vec<YourResult>` here",
        note = "a batch handler returns `Result<(), E>`, or `Result<Vec<R>, E>` with one result per \
                message in the batch's order (stored with each message's dedup row and sent again \
                as the reply to a duplicated request)"
    )]
    pub trait __IdemqBatchOutput {
        fn __idemq_batch_output(
            self,
            messages: usize,
        ) -> ::core::result::Result<::std::vec::Vec<crate::HandlerOutput>, crate::HandlerError>;
    }
    #[diagnostic::do_not_recommend]
    impl __IdemqBatchOutput for () {
        fn __idemq_batch_output(
            self,
            messages: usize,
        ) -> ::core::result::Result<::std::vec::Vec<crate::HandlerOutput>, crate::HandlerError> {
            ::core::result::Result::Ok(::std::vec![crate::HandlerOutput::none(); messages])
        }
    }
    #[diagnostic::do_not_recommend]
    impl<R: crate::__private::Serialize> __IdemqBatchOutput for ::std::vec::Vec<R> {
        fn __idemq_batch_output(
            self,
            _messages: usize,
        ) -> ::core::result::Result<::std::vec::Vec<crate::HandlerOutput>, crate::HandlerError> {
            // The number is checked by the runtime, for handlers written by hand too.
            self.iter().map(crate::HandlerOutput::json).collect()
        }
    }

    #[diagnostic::on_unimplemented(
        message = "a handler's result `{Self}` must implement `serde::Serialize`",
        label = "`{Self}` is not `Serialize`",
        note = "idemq stores what a handler returns with its dedup row and sends it again as the \
                reply to a duplicated request: derive `serde::Serialize` on it, or return `()`"
    )]
    pub trait __IdemqOutput {
        fn __idemq_output(&self) -> ::core::result::Result<crate::HandlerOutput, crate::HandlerError>;
    }
    #[diagnostic::do_not_recommend]
    impl<T: crate::__private::Serialize> __IdemqOutput for T {
        fn __idemq_output(&self) -> ::core::result::Result<crate::HandlerOutput, crate::HandlerError> {
            crate::HandlerOutput::json(self)
        }
    }

    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be a handler's error type",
        label = "`{Self}` is not an error",
        note = "the error must implement `std::error::Error + Send + Sync + 'static`, \
                or be `idemq::HandlerError`",
        note = "for a plain message, return `Result<(), idemq::HandlerError>` \
                and `Err(HandlerError::transient(msg))` (or `Permanent(msg).into()`)"
    )]
    pub trait __IdemqError {
        fn __idemq_error(self) -> crate::HandlerError;
    }
    #[diagnostic::do_not_recommend]
    impl<E: ::core::convert::Into<crate::HandlerError>> __IdemqError for E {
        fn __idemq_error(self) -> crate::HandlerError {
            ::core::convert::Into::into(self)
        }
    }
}
