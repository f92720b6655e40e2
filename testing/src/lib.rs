//! Test kits for idemq (the crate `idemq-testing`, re-exported as `idemq::testing`
//! by the features `testing` and `test-cluster` of `idemq`).
//!
//! [`TestKit`] (feature `testing`, for dev-dependencies only: it holds the
//! [`fault`] hooks) runs a handler — or several handlers of one queue
//! ([`TestKit::builder`]) — in the real runtime against a real PostgreSQL and
//! RabbitMQ, each test in a throwaway database and queue of its own, and delivers a
//! message once, twice, concurrently, or with the ack lost after COMMIT; a
//! [`TestMessage`] with the properties and headers a real publisher sets — an
//! [`idemq::Message`](idemq_core::Message) typed and versioned as `Publisher::send` sends
//! it ([`TestMessage::of`]) — several at once (a batch), or a request, whose
//! [`Reply`] it reads back from the outbox with everything else the handler
//! published ([`TestKit::published`]: the kit runs no relay).
//!
//! ```no_run
//! # use idemq::testing::{TestKit, TestMessage};
//! # #[derive(serde::Serialize, idemq::Message)]
//! # #[message(type = "payment.requested", exchange = "payments", routing_key = "requested")]
//! # struct Payment { payment_id: String }
//! # async fn example(handler: impl idemq::Handler) {
//! let kit = TestKit::start(handler).await.expect("the services are up");
//! let payment = Payment { payment_id: "p-1".into() };
//! let outcomes = kit.deliver_concurrently(TestMessage::of(&payment), 4).await;
//! assert_eq!(outcomes.iter().filter(|o| **o == idemq::Outcome::Applied).count(), 1);
//! // ... and check the effect with `kit.connect().await`.
//! kit.finish().await;
//! # }
//! ```
//!
//! Every helper takes a [`TestMessage`] or a `&value` of any `Serialize` type (bare
//! JSON: no type, no version), see [`IntoTestMessage`]. A helper that cannot go on —
//! its delivery did not settle within 30 s, ended in a way it cannot go on from, or
//! the kit's runtime stopped — panics at once with what happened: each delivery
//! settled since it published, with its handler, outcome and `x-idemq-error`.
//!
//! What a kit made (its database, its queues) is removed by [`TestKit::finish`],
//! and also when the test panics before it (on `Drop`) or `prepare` fails part-way.
//!
//! `AMQP_URL` and `DATABASE_URL` say where the services are (the database named
//! there is only used to create and drop the test's own).
//!
//! [`NetworkProxy`] (feature `testing`) is a loopback TCP proxy to put between the
//! runtime and RabbitMQ or PostgreSQL, for what happens when the network fails: it
//! resets every connection at once, black-holes the traffic (a half-open peer) or
//! adds latency.
//!
//! [`TestCertificates`] (feature `testing`) makes a CA and certificates at test
//! time — a server's, an expired one, one for another host, a client's — and
//! [`PostgresServer`] starts a private PostgreSQL server, with TLS on if asked (only
//! TLS accepted; client certificates required if asked), that a test may restart or
//! stop without touching the machine's; [`ClusterBuilder::tls`] gives
//! private RabbitMQ nodes a TLS listener. Together they test what crosses the wire.
//!
//! [`PostgresPair`] (feature `testing`) starts a private PostgreSQL primary and a
//! standby streaming from it, with synchronous or asynchronous [`Replication`], and
//! kills the primary and promotes the standby, for what a database failover costs.
//!
//! [`Cluster`] (feature `test-cluster`, which `testing` includes; no fault hooks,
//! so a benchmark may use it) starts a private RabbitMQ cluster on this host, for
//! what happens when a broker node is lost.
//!
//! [`fault`] (feature `testing`) holds the runtime's test-only fault hooks: a
//! [`FaultHook`](fault::FaultHook) given to
//! [`RuntimeBuilder::fault_hook`](fault::FaultHookExt::fault_hook) runs at
//! points nothing outside the runtime can reach (after COMMIT and before the ack,
//! after a copy and before the original's ack) and may close the channel there.

#[cfg(feature = "testing")]
mod certs;
#[cfg(feature = "testing")]
mod cleanup;
mod cluster;
#[cfg(feature = "testing")]
pub mod fault;
mod host;
#[cfg(feature = "testing")]
mod kit;
#[cfg(feature = "testing")]
mod message;
#[cfg(feature = "testing")]
mod pg_pair;
#[cfg(feature = "testing")]
mod postgres;
#[cfg(feature = "testing")]
mod proxy;
#[cfg(feature = "testing")]
mod settle;

#[cfg(feature = "testing")]
pub use certs::{CertifiedKey, TestCertificates};
pub use cluster::{Cluster, ClusterBuilder, ClusterError, ClusterNode};
#[cfg(feature = "testing")]
pub use kit::{TestKit, TestKitBuilder};
#[cfg(feature = "testing")]
pub use message::{HeaderValue, IntoTestMessage, Reply, TestMessage};
#[cfg(feature = "testing")]
pub use pg_pair::{PostgresPair, PostgresPairBuilder, Replication};
#[cfg(feature = "testing")]
pub use postgres::{PostgresServer, PostgresServerBuilder};
#[cfg(feature = "testing")]
pub use proxy::NetworkProxy;
