//! The handler test kit: [`TestKit`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{Channel, Confirmation, Connection};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::message::{PublishedRow, Reply, TestMessage, PUBLISHED};
use crate::base::outcome::{Outcome, Settled};
use crate::base::outgoing::Outgoing;
use crate::broker::topology::{Queue, Topology};
use crate::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use crate::engine::fault::{FaultContext, FaultHook, FaultPoint};
use crate::engine::runtime::{Runtime, RuntimeBuilder};
use crate::error::{redact, Error};
use crate::handler::Handler;

/// How long a delivery may take to settle before the kit gives up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A handler running in a runtime of its own, on a queue and database of its own.
pub struct TestKit {
    queue: String,
    wait_queues: Vec<String>,
    database_url: String,
    admin_url: String,
    database: String,
    broker: Connection,
    publisher: lapin::Channel,
    settled: Arc<Mutex<Vec<Settled>>>,
    lose_next_ack: Arc<AtomicBool>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

impl std::fmt::Debug for TestKit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKit")
            .field("queue", &self.queue)
            .field("database", &self.database)
            .finish_non_exhaustive()
    }
}

impl TestKit {
    /// Creates the database (migrated) and the queue, and starts `handler` on them.
    ///
    /// # Errors
    /// The services are unreachable, or the runtime refuses the handler.
    pub async fn start<H: Handler>(handler: H) -> Result<Self, Error> {
        Self::start_with(handler, |builder| builder).await
    }

    /// [`TestKit::start`] with the builder tuned (`batch_size`, `retry`, …). For the
    /// application's own tables, use [`TestKit::prepare`].
    ///
    /// # Errors
    /// As [`TestKit::start`].
    pub async fn start_with<H: Handler>(
        handler: H,
        tune: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder,
    ) -> Result<Self, Error> {
        Self::prepare(handler, tune, |_| async { Ok(()) }).await
    }

    /// [`TestKit::start_with`], running `setup` (the application's tables) on the
    /// fresh database before the runtime starts.
    ///
    /// # Errors
    /// As [`TestKit::start`], and `setup`'s.
    pub async fn prepare<H, F, Fut>(
        handler: H,
        tune: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder,
        setup: F,
    ) -> Result<Self, Error>
    where
        H: Handler,
        F: FnOnce(String) -> Fut,
        Fut: std::future::Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>>,
    {
        static N: AtomicU64 = AtomicU64::new(0);
        let id =
            format!("{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), fastrand::u32(..));
        let amqp_url = crate::config::env_url("AMQP_URL", DEFAULT_AMQP_URL)?;
        let admin_url = crate::config::env_url("DATABASE_URL", DEFAULT_DATABASE_URL)?;
        let database = format!("idemq_kit_{id}");
        let database_url = with_database(&admin_url, &database)?;
        let mut admin = crate::store::db::connect(&admin_url).await?;
        diesel::sql_query(format!("CREATE DATABASE \"{database}\"")).execute(&mut admin).await.map_err(
            |err| Error::DatabaseConnect {
                url: redact(&admin_url),
                message: err.to_string(),
                cause: Some(Box::new(err)),
            },
        )?;
        crate::store::migrate::migrate(&database_url).await?;
        setup(database_url.clone()).await.map_err(|err| {
            Error::Config(format!("the test's setup failed: {}", crate::error::report(&*err)))
        })?;

        let queue = format!("idemq-kit-{id}");
        let topology = Topology::new().queue(Queue::new(queue.clone()));
        let (broker, publisher) = publisher_to(&amqp_url, &topology).await?;

        let settled: Arc<Mutex<Vec<Settled>>> = Arc::default();
        let sink = Arc::clone(&settled);
        let lose_next_ack = Arc::new(AtomicBool::new(false));
        let builder = Runtime::builder()
            .amqp_url(amqp_url)
            .database_url(database_url.clone())
            .topology(topology)
            .consume(queue.clone(), handler)
            .relay(false)
            .reconnect_max_backoff(Duration::from_millis(200))
            .shutdown_deadline(Duration::from_secs(5));
        let builder = tune(builder);
        let wait_queues: Vec<String> = builder
            .retry_policies()
            .iter()
            .flat_map(|policy| policy.wait_queues(&queue))
            .map(|(name, _)| name)
            .collect();
        let runtime = builder
            .observe(crate::base::observe::on_settled(move |s| {
                sink.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(s.clone());
            }))
            .fault_hook(lose_the_ack_when(Arc::clone(&lose_next_ack)))
            .build()?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(shutdown.clone()));
        Ok(Self {
            queue,
            wait_queues,
            database_url,
            admin_url,
            database,
            broker,
            publisher,
            settled,
            lose_next_ack,
            shutdown,
            task,
        })
    }

    /// The test database's URL (to check the handler's effects).
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// A connection to the test database.
    ///
    /// # Panics
    /// If it cannot connect (the kit just did).
    pub async fn connect(&self) -> AsyncPgConnection {
        crate::store::db::connect(&self.database_url).await.expect("connect to the test database")
    }

    /// Every delivery settled so far, in order.
    pub fn settled(&self) -> Vec<Settled> {
        self.settled.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Publishes `message` (JSON) once and waits until it is settled.
    ///
    /// # Panics
    /// If it is not settled within 30 s.
    pub async fn deliver<M: Serialize + ?Sized>(&self, message: &M) -> Outcome {
        self.deliver_concurrently(message, 1).await.remove(0)
    }

    /// Publishes `message` and, once settled, the same message again.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_twice<M: Serialize + ?Sized>(&self, message: &M) -> [Outcome; 2] {
        [self.deliver(message).await, self.deliver(message).await]
    }

    /// Publishes `copies` copies of `message` at once (they race on the dedup row)
    /// and waits until all are settled.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_concurrently<M: Serialize + ?Sized>(
        &self,
        message: &M,
        copies: usize,
    ) -> Vec<Outcome> {
        let message = TestMessage::json(message);
        self.deliver_batch(std::iter::repeat_n(message, copies)).await
    }

    /// Publishes `message` — a body with the properties and headers a real
    /// publisher sets (`message_id`, headers, `reply_to`, …) — and waits until it is
    /// settled.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_message(&self, message: TestMessage) -> Outcome {
        self.deliver_batch([message]).await.remove(0)
    }

    /// Publishes `messages` back to back (confirmed together) and waits until all
    /// are settled; their outcomes in the order they settled. What arrives together
    /// runs in one transaction, and a batch handler gets it in one call — with a
    /// linger (`TestKit::start_with(h, |b| b.linger(Duration::from_millis(100)))`)
    /// the runtime waits that long for the rest of a batch, so all of them are
    /// there; without one, the first may start alone.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_batch(&self, messages: impl IntoIterator<Item = TestMessage>) -> Vec<Outcome> {
        let before = self.settled().len();
        let mut confirms = Vec::new();
        for message in messages {
            confirms.push(self.publish(&message).await);
        }
        let count = confirms.len();
        for confirm in confirms {
            let confirm = confirm.await.expect("a confirm");
            assert!(
                matches!(confirm, Confirmation::Ack(None)),
                "the test queue refused the message: {confirm:?}"
            );
        }
        self.wait_for(before + count).await;
        self.settled()[before..before + count].iter().map(|s| s.outcome.clone()).collect()
    }

    /// Delivers `request` as a request (JSON, with a `reply_to` and a fresh
    /// `correlation_id`) and returns how it settled and its reply. The kit runs no
    /// outbox relay: the reply is read from the outbox, where the handler's
    /// transaction put it (see [`TestKit::published`]).
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn request<M: Serialize + ?Sized>(&self, request: &M) -> Reply {
        self.request_message(TestMessage::json(request)).await
    }

    /// [`TestKit::request`] with a message of the test's own; `reply_to` and
    /// `correlation_id` are set where it has none.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn request_message(&self, mut request: TestMessage) -> Reply {
        if request.properties().reply_to().is_none() {
            request = request.reply_to(&format!("{}.replies", self.queue));
        }
        if request.correlation().is_none() {
            request = request.correlation_id(&format!("kit-{:016x}", fastrand::u64(..)));
        }
        debug_assert!(request.is_request());
        let correlation = request.correlation().unwrap_or_default().to_owned();
        let outcome = self.deliver_message(request).await;
        let message = self
            .published()
            .await
            .into_iter()
            .rev()
            .find(|m| m.correlation_id.as_deref() == Some(&correlation));
        Reply { outcome, message }
    }

    /// What the handlers published so far (events and replies), oldest first: the
    /// rows of the outbox, which the kit's runtime does not relay (it runs with
    /// `.relay(false)`), so every message a committed transaction published is there
    /// — and nothing a rolled-back one did.
    ///
    /// # Panics
    /// If the test database cannot be read.
    pub async fn published(&self) -> Vec<Outgoing> {
        let mut conn = self.connect().await;
        let rows: Vec<PublishedRow> =
            diesel::sql_query(PUBLISHED).load(&mut conn).await.expect("read the test database's outbox");
        rows.into_iter().map(Outgoing::from).collect()
    }

    /// Publishes `message`; its transaction commits, then the ack is lost (the
    /// channel closes, as if the consumer crashed between COMMIT and ack); the broker
    /// redelivers it. Returns both outcomes: the first applied (its ack not sent),
    /// the redelivery — which must find the dedup row.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn crash_after_commit<M: Serialize + ?Sized>(&self, message: &M) -> [Outcome; 2] {
        let before = self.settled().len();
        self.lose_next_ack.store(true, Ordering::SeqCst);
        let confirm = self.publish(&TestMessage::json(message)).await.await.expect("a confirm");
        assert!(
            matches!(confirm, Confirmation::Ack(None)),
            "the test queue refused the message: {confirm:?}"
        );
        self.wait_for(before + 2).await;
        let settled = self.settled();
        [settled[before].outcome.clone(), settled[before + 1].outcome.clone()]
    }

    /// Publishes `message` (mandatory) to the test queue; its confirm, to await.
    async fn publish(&self, message: &TestMessage) -> lapin::PublisherConfirm {
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        self.publisher
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                options,
                &message.body,
                message.properties.clone(),
            )
            .await
            .expect("publish to the test queue")
    }

    async fn wait_for(&self, settled: usize) {
        let waited = tokio::time::timeout(SETTLE_TIMEOUT, async {
            while self.settled().len() < settled {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "only {} of {settled} deliveries settled within {SETTLE_TIMEOUT:?}",
            self.settled().len()
        );
    }

    /// Stops the runtime and removes the queue (with its dead-letter queue) and the
    /// database. Without it they are left behind.
    pub async fn finish(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
        let channel = self.broker.create_channel().await;
        if let Ok(channel) = channel {
            let dlq = Queue::new(self.queue.clone()).dead_letter_name().to_owned();
            for queue in [self.queue.as_str(), dlq.as_str()] {
                let _ = channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await;
            }
            for name in &self.wait_queues {
                let _ = channel.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
        let _ = self.broker.close(200, "test done".into()).await;
        if let Ok(mut admin) = crate::store::db::connect(&self.admin_url).await {
            let _ = diesel::sql_query(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.database))
                .execute(&mut admin)
                .await;
        }
    }
}

/// A connection to the broker at `amqp_url` and a channel on it (publisher confirms
/// on), `topology` declared: what the kit publishes the test's messages with.
async fn publisher_to(amqp_url: &str, topology: &Topology) -> Result<(Connection, Channel), Error> {
    let broker = crate::broker::brokers::Brokers::parse(amqp_url)?.connect("test kit").await?.0;
    let amqp = |source| Error::Amqp { action: "set up the test's queue".into(), source };
    let publisher = broker.create_channel().await.map_err(amqp)?;
    topology.declare(&publisher).await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await.map_err(amqp)?;
    Ok((broker, publisher))
}

/// The hook of [`TestKit::crash_after_commit`]: after the COMMIT of an applied delivery,
/// while `lose` is set (once), it closes the channel, and the ack is lost with it.
fn lose_the_ack_when(lose: Arc<AtomicBool>) -> FaultHook {
    Arc::new(move |ctx: FaultContext| {
        let lose = Arc::clone(&lose);
        Box::pin(async move {
            if ctx.point == FaultPoint::AfterCommit
                && ctx.outcome == Outcome::Applied
                && lose.swap(false, Ordering::SeqCst)
            {
                // COMMIT landed; the ack is lost with the channel.
                let _ = ctx.channel.close(200, "idemq test kit: ack lost after COMMIT".into()).await;
            }
        })
    })
}

/// `url` with its database name replaced by `database`.
fn with_database(url: &str, database: &str) -> Result<String, Error> {
    // Not `url::Url`: libpq's multi-host form (`postgres://u@h1:5432,h2:5432/db`) is
    // not a URL it parses. The path is what follows the authority, up to the query.
    let refuse = || {
        Error::Config(format!("the test kit needs DATABASE_URL as a URL (postgres://…), not {}", redact(url)))
    };
    let scheme_end = url.find("://").ok_or_else(refuse)? + 3;
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, after) = rest.split_at(authority_end);
    let query = after.find('?').map_or("", |at| &after[at..]);
    Ok(format!("{}{authority}/{database}{query}", &url[..scheme_end]))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kit_names_its_database_in_single_and_multi_host_urls() {
        let with = |url| super::with_database(url, "kit_1").unwrap();
        assert_eq!(
            with("postgres://postgres@127.0.0.1:5432/postgres"),
            "postgres://postgres@127.0.0.1:5432/kit_1"
        );
        assert_eq!(with("postgres://u:p@h"), "postgres://u:p@h/kit_1");
        assert_eq!(
            with("postgres://u@h1:5442,h2:5443/db?target_session_attrs=read-write"),
            "postgres://u@h1:5442,h2:5443/kit_1?target_session_attrs=read-write"
        );
        assert_eq!(with("postgresql://u@h?sslmode=require"), "postgresql://u@h/kit_1?sslmode=require");
        assert!(super::with_database("not a url", "x").is_err());
    }
}
