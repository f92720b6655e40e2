//! The handler test kit: [`TestKit`], and [`TestKitBuilder`] for a kit over several
//! handlers of one queue.
//!
//! A kit is a runtime of its own on a database and a queue of its own. Each helper
//! publishes to the queue, waits until the runtime settled what it published
//! (`settle.rs`: and says what happened if that is not what the helper can go on
//! from), and returns the outcomes. What the kit made is removed by
//! [`TestKit::finish`], or on `Drop` when a test panics or `prepare` fails part-way
//! (`cleanup.rs`).

use idemq_core::__private::sibling;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Channel, Confirmation, Connection};

use super::cleanup::{Leftovers, RunningRuntime};
use super::message::{IntoTestMessage, PublishedRow, Reply, TestMessage, PUBLISHED, SCHEDULED, TAKE_DUE};
use super::settle::{Expect, HandlerWire, Settlements, Waiting};
use crate::fault::{FaultContext, FaultHook, FaultHookExt, FaultPoint};
use idemq_core::__private::sibling::BuilderPlan as _;
use idemq_core::connect::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use idemq_core::{connect::redact, Error};
use idemq_core::{observe::Settled, Outcome};
use idemq_core::{outbox::Outgoing, Message};
use idemq_core::{BoxFuture, Handler};
use idemq_core::{Queue, Topology};
use idemq_core::{Runtime, RuntimeBuilder};

/// How long [`TestKit::finish`] waits for the runtime to drain.
const FINISH_DEADLINE: Duration = Duration::from_secs(20);

/// What a test's `setup` may fail with.
type SetupError = Box<dyn std::error::Error + Send + Sync>;

/// A [`TestKitBuilder::tune`].
type Tune = Box<dyn FnOnce(RuntimeBuilder) -> RuntimeBuilder + Send>;

/// A [`TestKitBuilder::setup`], its future boxed.
type Setup = Box<dyn FnOnce(String) -> BoxFuture<'static, Result<(), SetupError>> + Send>;

/// Registers a handler on the kit's queue (the queue's name given).
type Consume = Box<dyn FnOnce(RuntimeBuilder, &str) -> RuntimeBuilder + Send>;

/// A handler (or several, on one queue) running in a runtime of its own, on a queue
/// and database of its own.
///
/// # Typed messages
/// Each helper takes a [`TestMessage`] or a reference to any `Serialize` value
/// ([`IntoTestMessage`]). A bare value is sent as JSON with no AMQP `type` and no
/// `x-idemq-version` header: a versioned handler reads it as version 1, and a queue
/// of several typed handlers cannot route it. [`TestMessage::of`] (or
/// [`TestKit::send`]) sends an [`idemq::Message`](idemq_core::Message) as
/// [`Publisher::send`](idemq_core::Publisher::send) does, type and version set:
///
/// ```no_run
/// # use idemq::testing::{TestKit, TestMessage};
/// # use idemq::Outcome;
/// #[derive(serde::Serialize, serde::Deserialize, idemq::Message)]
/// #[message(type = "payment.requested", version = 2, exchange = "payments", routing_key = "requested")]
/// struct PaymentRequested { payment_id: String, amount_cents: i64 }
/// # async fn example(handler: impl idemq::Handler) {
/// let kit = TestKit::start(handler).await.expect("the services are up");
/// let payment = PaymentRequested { payment_id: "p-1".into(), amount_cents: 250 };
/// // Keyed by `payment_id`: the second copy is a duplicate.
/// assert_eq!(
///     kit.deliver_twice(TestMessage::of(&payment)).await,
///     [Outcome::Applied, Outcome::Duplicate]
/// );
/// let other = PaymentRequested { payment_id: "p-2".into(), amount_cents: 100 };
/// assert_eq!(kit.send(&other).await, Outcome::Applied);
/// kit.finish().await;
/// # }
/// ```
///
/// # Failures
/// A helper waits at most 30 s for its deliveries to settle, and gives up at once
/// when one ended in a way it cannot go on from (the message of
/// [`crash_after_commit`](Self::crash_after_commit) not applied) or the kit's
/// runtime stopped. Its panic names what happened: every delivery settled since it
/// published (handler, outcome, a dead letter's `x-idemq-error`), the kit's handlers
/// with the type and versions each reads, and how to send a bare message typed when
/// that is what went wrong.
///
/// # Cleanup
/// [`finish`](Self::finish) stops the runtime and removes the queues and the
/// database. A kit dropped without it — the test panicked on a failing assertion,
/// or returned early — removes them on `Drop`, on a thread of its own (`Drop`
/// cannot await; the same on both `#[tokio::test]` flavors), blocking for the tens of
/// milliseconds it takes. A `prepare` that fails part-way removes what it made before
/// it returns the error.
pub struct TestKit {
    queue: String,
    database_url: String,
    handlers: Vec<HandlerWire>,
    broker: Connection,
    publisher: Channel,
    settlements: Settlements,
    lose_next_ack: Arc<AtomicBool>,
    /// Last: removed on `Drop` after the rest is dropped.
    leftovers: Leftovers,
}

impl std::fmt::Debug for TestKit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKit")
            .field("queue", &self.queue)
            .field("database_url", &redact(&self.database_url))
            .finish_non_exhaustive()
    }
}

/// A kit over one handler or several, on one queue: made by [`TestKit::builder`],
/// started with [`start`](Self::start).
///
/// Several handlers of one queue are the runtime's
/// `.consume(queue, a).consume(queue, b)`: each delivery goes to the handler of its
/// AMQP `type` ([`TestMessage::of`] sets it as `send` does), each handler keeps its
/// own dedup scope.
///
/// ```no_run
/// # use idemq::testing::{TestKit, TestMessage};
/// # use idemq::Outcome;
/// # #[derive(serde::Serialize, serde::Deserialize, idemq::Message)]
/// # #[message(type = "payment.requested", exchange = "payments", routing_key = "requested")]
/// # struct PaymentRequested { payment_id: String }
/// # #[derive(serde::Serialize, serde::Deserialize, idemq::Message)]
/// # #[message(type = "payment.refunded", exchange = "payments", routing_key = "refunded")]
/// # struct PaymentRefunded { payment_id: String }
/// # async fn my_migrations(url: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> { Ok(()) }
/// # async fn example(take_payment: impl idemq::Handler, take_refund: impl idemq::Handler) {
/// let kit = TestKit::builder()
///     .handler(take_payment)
///     .handler(take_refund)
///     .tune(|builder| builder.batch_size(1))
///     .setup(|url| async move { my_migrations(&url).await })
///     .start()
///     .await
///     .expect("the services are up");
/// let id = "p-1".to_owned();
/// assert_eq!(kit.send(&PaymentRequested { payment_id: id.clone() }).await, Outcome::Applied);
/// assert_eq!(kit.send(&PaymentRefunded { payment_id: id }).await, Outcome::Applied);
/// // Each went to the handler of its type: see `kit.settled()[n].handler`.
/// kit.finish().await;
/// # }
/// ```
#[must_use = "a test kit builder does nothing until `.start().await`"]
pub struct TestKitBuilder {
    consumers: Vec<Consumer>,
    tunes: Vec<Tune>,
    setups: Vec<Setup>,
    services: Services,
}

impl std::fmt::Debug for TestKitBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let handlers: Vec<&str> = self.consumers.iter().map(|c| c.wire.name()).collect();
        f.debug_struct("TestKitBuilder").field("handlers", &handlers).finish_non_exhaustive()
    }
}

impl TestKitBuilder {
    /// Adds `handler` on the kit's queue (`.consume(queue, handler)`).
    pub fn handler<H: Handler>(mut self, handler: H) -> Self {
        self.consumers.push(Consumer::of(handler));
        self
    }

    /// Tunes the runtime's builder (`batch_size`, `retry`, `linger`, …); several are
    /// applied in order.
    pub fn tune(mut self, tune: impl FnOnce(RuntimeBuilder) -> RuntimeBuilder + Send + 'static) -> Self {
        self.tunes.push(Box::new(tune));
        self
    }

    /// Runs `setup` (the application's tables: migrations) on the fresh database,
    /// given its URL, before the runtime starts; several run in order.
    pub fn setup<F, Fut>(mut self, setup: F) -> Self
    where
        F: FnOnce(String) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), SetupError>> + Send + 'static,
    {
        self.setups.push(Box::new(move |url: String| -> BoxFuture<'static, Result<(), SetupError>> {
            Box::pin(setup(url))
        }));
        self
    }

    /// The broker (default: `AMQP_URL`, else `amqp://guest:guest@127.0.0.1:5672/%2f`).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.services.amqp_url = Some(url.into());
        self
    }

    /// The PostgreSQL server, by a database the kit only uses to create and drop the
    /// test's own (default: `DATABASE_URL`, else `postgres://postgres@127.0.0.1:5432/postgres`).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.services.database_url = Some(url.into());
        self
    }

    /// Creates the database (migrated, then `setup`) and the queue, and starts the
    /// handlers on them. What it made is removed again if a later step fails.
    ///
    /// # Errors
    /// No handler was added ([`Error::Config`]), the services are unreachable, a
    /// `setup` failed, or the runtime refuses the handlers.
    pub async fn start(self) -> Result<TestKit, Error> {
        let Self { consumers, tunes, setups, services } = self;
        if consumers.is_empty() {
            return Err(Error::Config("the test kit has no handler: add one with `.handler(h)`".into()));
        }
        let tune = move |builder| tunes.into_iter().fold(builder, |builder, tune| tune(builder));
        let setup = move |url: String| async move {
            for setup in setups {
                setup(url.clone()).await?;
            }
            Ok::<(), SetupError>(())
        };
        launch(consumers, tune, setup, services).await
    }
}

/// A handler, with how to register it on the kit's queue.
struct Consumer {
    wire: HandlerWire,
    consume: Consume,
}

impl Consumer {
    fn of<H: Handler>(handler: H) -> Self {
        let wire = HandlerWire::of(&handler);
        Self {
            wire,
            consume: Box::new(move |builder: RuntimeBuilder, queue: &str| builder.consume(queue, handler)),
        }
    }
}

/// Where the services are, if the test says.
#[derive(Debug, Default)]
struct Services {
    amqp_url: Option<String>,
    database_url: Option<String>,
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
    /// fresh database before the runtime starts. If a step fails after the database
    /// was created (`setup`, the broker, the runtime), the database and queues are
    /// removed before the error is returned.
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
        Fut: Future<Output = Result<(), SetupError>>,
    {
        launch(vec![Consumer::of(handler)], tune, setup, Services::default()).await
    }

    /// A kit over several handlers of one queue, with its services, tuning and setup
    /// named one by one: see [`TestKitBuilder`].
    pub fn builder() -> TestKitBuilder {
        TestKitBuilder {
            consumers: Vec::new(),
            tunes: Vec::new(),
            setups: Vec::new(),
            services: Services::default(),
        }
    }

    /// The test database's URL (to check the handler's effects).
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// The test queue's name (where the helpers publish).
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Every queue the kit declared and removes: the test queue, its dead-letter
    /// queue and the retry wait queues.
    pub fn queues(&self) -> &[String] {
        self.leftovers.queue_names()
    }

    /// A connection to the test database.
    ///
    /// # Panics
    /// If it cannot connect (the kit just did).
    pub async fn connect(&self) -> AsyncPgConnection {
        idemq_core::connect::database(&self.database_url).await.expect("connect to the test database")
    }

    /// Every delivery settled so far, in order.
    pub fn settled(&self) -> Vec<Settled> {
        self.settlements.all()
    }

    /// Publishes `message` once and waits until it is settled. A `&value` is sent
    /// as bare JSON; [`TestMessage::of`]`(&value)` as `Publisher::send` sends it
    /// (see [`IntoTestMessage`]).
    ///
    /// # Panics
    /// If it is not settled within 30 s, or the kit's runtime stopped, saying what
    /// settled and how.
    pub async fn deliver(&self, message: impl IntoTestMessage) -> Outcome {
        self.deliver_as("deliver", vec![message.into_test_message()]).await.remove(0)
    }

    /// Publishes `message` as [`Publisher::send`](idemq_core::Publisher::send) does —
    /// JSON, its AMQP `type` and `x-idemq-version` header set, a fresh `message_id` —
    /// to the kit's queue, and waits until it is settled:
    /// `kit.deliver(TestMessage::of(message))`.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn send<M: Message>(&self, message: &M) -> Outcome {
        self.deliver_as("send", vec![TestMessage::of(message)]).await.remove(0)
    }

    /// Publishes `message` and, once settled, the same message again (the same
    /// properties: a [`TestMessage::of`] keeps its `message_id`).
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_twice(&self, message: impl IntoTestMessage) -> [Outcome; 2] {
        let message = message.into_test_message();
        let first = self.deliver_as("deliver_twice", vec![message.clone()]).await.remove(0);
        [first, self.deliver_as("deliver_twice", vec![message]).await.remove(0)]
    }

    /// Publishes `copies` copies of `message` at once (they race on the dedup row)
    /// and waits until all are settled.
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_concurrently(&self, message: impl IntoTestMessage, copies: usize) -> Vec<Outcome> {
        let message = message.into_test_message();
        self.deliver_as("deliver_concurrently", vec![message; copies]).await
    }

    /// Publishes `message` — a body with the properties and headers a real
    /// publisher sets (`message_id`, headers, `reply_to`, …) — and waits until it is
    /// settled: [`TestKit::deliver`] of a [`TestMessage`].
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn deliver_message(&self, message: TestMessage) -> Outcome {
        self.deliver_as("deliver_message", vec![message]).await.remove(0)
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
    pub async fn deliver_batch<I>(&self, messages: I) -> Vec<Outcome>
    where
        I: IntoIterator,
        I::Item: IntoTestMessage,
    {
        let messages = messages.into_iter().map(IntoTestMessage::into_test_message).collect();
        self.deliver_as("deliver_batch", messages).await
    }

    /// Delivers `request` as a request (with a `reply_to` and a fresh
    /// `correlation_id`) and returns how it settled and its reply. The kit runs no
    /// outbox relay: the reply is read from the outbox, where the handler's
    /// transaction put it (see [`TestKit::published`]).
    ///
    /// # Panics
    /// As [`TestKit::deliver`].
    pub async fn request(&self, request: impl IntoTestMessage) -> Reply {
        self.request_message(request.into_test_message()).await
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
        let outcome = self.deliver_as("request", vec![request]).await.remove(0);
        let message = self
            .published()
            .await
            .into_iter()
            .rev()
            .find(|m| sibling::correlation_id(m) == Some(correlation.as_str()));
        Reply { outcome, message }
    }

    /// What the handlers published so far (events and replies), oldest first: the
    /// rows of the outbox, which the kit's runtime does not relay (it runs with
    /// `.relay(false)`), so every message a committed transaction published is there
    /// — and nothing a rolled-back one did. A scheduled message is here once it is
    /// due: until then it is in [`TestKit::scheduled`].
    ///
    /// # Panics
    /// If the test database cannot be read.
    pub async fn published(&self) -> Vec<Outgoing> {
        self.outbox(PUBLISHED).await
    }

    /// The scheduled messages (`Context::schedule`) not yet due, soonest first; a
    /// cancelled one (`outbox::cancel`) is gone.
    ///
    /// # Panics
    /// If the test database cannot be read.
    pub async fn scheduled(&self) -> Vec<Outgoing> {
        self.outbox(SCHEDULED).await
    }

    /// Moves time forward `by` for the scheduled messages, without waiting: each one
    /// not yet due comes `by` sooner, and those it makes due are in
    /// [`TestKit::published`] — a 15-minute timeout is tested in milliseconds.
    ///
    /// # Panics
    /// If the test database cannot be written.
    pub async fn advance(&self, by: std::time::Duration) {
        let mut conn = self.connect().await;
        let millis = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        diesel::sql_query(
            "UPDATE idemq_outbox SET due_at = due_at - $1 * interval '1 millisecond', \
                    available_at = available_at - $1 * interval '1 millisecond' \
              WHERE due_at > now()",
        )
        .bind::<diesel::sql_types::BigInt, _>(millis)
        .execute(&mut conn)
        .await
        .expect("move the scheduled messages' due times");
    }

    /// Delivers the scheduled messages that are due — after [`TestKit::advance`] —
    /// as the relay would publish them (each once, with its message id, its outbox
    /// row removed), to the kit's queue, and waits until they are settled: their
    /// outcomes, in the order they settled. A saga's timeout is tested this way,
    /// without waiting for it: `kit.advance(PAYMENT_WINDOW).await;
    /// kit.deliver_due().await`. Their exchange and routing key are not used: the
    /// kit publishes to its own queue.
    ///
    /// # Panics
    /// If the test database cannot be written; as [`TestKit::deliver`].
    pub async fn deliver_due(&self) -> Vec<Outcome> {
        let mut conn = self.connect().await;
        let rows: Vec<PublishedRow> =
            diesel::sql_query(TAKE_DUE).load(&mut conn).await.expect("take the due scheduled messages");
        if rows.is_empty() {
            return Vec::new();
        }
        let messages = rows.into_iter().map(|row| TestMessage::relayed(&Outgoing::from(row))).collect();
        self.deliver_as("deliver_due", messages).await
    }

    async fn outbox(&self, query: &str) -> Vec<Outgoing> {
        let mut conn = self.connect().await;
        let rows: Vec<PublishedRow> =
            diesel::sql_query(query).load(&mut conn).await.expect("read the test database's outbox");
        rows.into_iter().map(Outgoing::from).collect()
    }

    /// Publishes `message`; its transaction commits, then the ack is lost (the
    /// channel closes, as if the consumer crashed between COMMIT and ack); the broker
    /// redelivers it. Returns both outcomes: the first applied (its ack not sent),
    /// the redelivery — which must find the dedup row.
    ///
    /// # Panics
    /// At once if the first delivery is not applied (a message the handler applied
    /// before, or one it dead-letters: there is no COMMIT whose ack to lose), naming
    /// its outcome; otherwise as [`TestKit::deliver`].
    pub async fn crash_after_commit(&self, message: impl IntoTestMessage) -> [Outcome; 2] {
        let message = message.into_test_message();
        let before = self.settlements.len();
        self.lose_next_ack.store(true, Ordering::SeqCst);
        let confirm = self.publish(&message).await;
        confirmed(confirm.await);
        let waiting = self.waiting("crash_after_commit", before, 2, Expect::FirstApplied, &[message]);
        let settled = self.settlements.wait(&waiting).await.unwrap_or_else(|report| {
            // No ack was lost: the next delivery must not lose its own.
            self.lose_next_ack.store(false, Ordering::SeqCst);
            panic!("{report}")
        });
        [settled[0].outcome.clone(), settled[1].outcome.clone()]
    }

    /// Publishes `messages` (confirmed together) and waits until as many deliveries
    /// settled; their outcomes, in the order they settled.
    async fn deliver_as(&self, helper: &'static str, messages: Vec<TestMessage>) -> Vec<Outcome> {
        let before = self.settlements.len();
        let mut confirms = Vec::with_capacity(messages.len());
        for message in &messages {
            confirms.push(self.publish(message).await);
        }
        for confirm in confirms {
            confirmed(confirm.await);
        }
        let waiting = self.waiting(helper, before, messages.len(), Expect::Settled, &messages);
        let settled = self.settlements.wait(&waiting).await.unwrap_or_else(|report| panic!("{report}"));
        settled.into_iter().map(|s| s.outcome).collect()
    }

    fn waiting<'a>(
        &'a self,
        helper: &'static str,
        before: usize,
        count: usize,
        expect: Expect,
        sent: &[TestMessage],
    ) -> Waiting<'a> {
        Waiting {
            helper,
            before,
            count,
            expect,
            sent_bare: sent.iter().any(TestMessage::is_bare),
            queue: &self.queue,
            handlers: &self.handlers,
        }
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

    /// Stops the runtime (waiting up to 20 s for it to drain) and removes the queue
    /// (with its dead-letter and wait queues) and the database. Without it, they are
    /// removed when the kit is dropped, without waiting for the runtime to drain.
    ///
    /// # Cancel safety
    /// Not cancel safe: cancelled, it leaves what it had not removed yet.
    pub async fn finish(self) {
        let Self { broker, leftovers, .. } = self;
        leftovers.remove(Some(&broker), FINISH_DEADLINE).await;
        let _ = broker.close(200, "test done".into()).await;
    }
}

/// Asserts the broker took a message onto the test queue.
fn confirmed(confirm: Result<Confirmation, lapin::Error>) {
    let confirm = confirm.expect("a confirm");
    assert!(matches!(confirm, Confirmation::Ack(None)), "the test queue refused the message: {confirm:?}");
}

/// Makes a kit: the database (migrated, then `setup`), the queue, the runtime with
/// `consumers` on it. What it made is removed again if a later step fails (on
/// `Drop` if one panics).
async fn launch<T, F, Fut>(
    consumers: Vec<Consumer>,
    tune: T,
    setup: F,
    services: Services,
) -> Result<TestKit, Error>
where
    T: FnOnce(RuntimeBuilder) -> RuntimeBuilder,
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<(), SetupError>>,
{
    static N: AtomicU64 = AtomicU64::new(0);
    let id = format!("{}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), fastrand::u32(..));
    let amqp_url = match services.amqp_url {
        Some(url) => url,
        None => idemq_core::connect::env_url("AMQP_URL", DEFAULT_AMQP_URL)?,
    };
    let admin_url = match services.database_url {
        Some(url) => url,
        None => idemq_core::connect::env_url("DATABASE_URL", DEFAULT_DATABASE_URL)?,
    };
    let database = format!("idemq_kit_{id}");
    let database_url = with_database(&admin_url, &database)?;
    let queue = format!("idemq-kit-{id}");
    let mut leftovers = Leftovers::new(admin_url.clone(), amqp_url.clone());
    let handlers: Vec<HandlerWire> = consumers.iter().map(|c| c.wire.clone()).collect();
    let settlements = Settlements::default();
    let lose_next_ack = Arc::new(AtomicBool::new(false));

    let made = async {
        let mut admin = idemq_core::connect::database(&admin_url).await?;
        diesel::sql_query(format!("CREATE DATABASE \"{database}\"")).execute(&mut admin).await.map_err(
            |err| Error::DatabaseConnect {
                url: redact(&admin_url),
                message: err.to_string(),
                cause: Some(Box::new(err)),
            },
        )?;
        leftovers.database(&database);
        drop(admin);
        idemq_core::migrate(&database_url).await?;
        setup(database_url.clone()).await.map_err(|err| {
            Error::Config(format!("the test's setup failed: {}", idemq_core::connect::report(&*err)))
        })?;

        let topology = Topology::new().queue(Queue::new(queue.clone()));
        let broker = idemq_core::connect::broker(&amqp_url, "test kit").await?;
        let dead_letters = Queue::new(queue.clone()).dead_letter_name().to_owned();
        leftovers.queues([queue.clone(), dead_letters]);
        let publisher = publisher_on(&broker, &topology).await?;

        let mut builder = Runtime::builder()
            .amqp_url(amqp_url.clone())
            .database_url(database_url.clone())
            .topology(topology)
            .relay(false)
            .reconnect_max_backoff(Duration::from_millis(200))
            .shutdown_deadline(Duration::from_secs(5));
        for consumer in consumers {
            builder = (consumer.consume)(builder, &queue);
        }
        let builder = tune(builder);
        leftovers.queues(
            builder
                .retry_policies()
                .iter()
                .flat_map(|policy| policy.wait_queues(&queue))
                .map(|(name, _)| name),
        );
        let sink = settlements.clone();
        let runtime = builder
            .observe(idemq_core::observe::on_settled(move |settled| sink.push(settled)))
            .fault_hook(lose_the_ack_when(Arc::clone(&lose_next_ack)))
            .build()?;
        let shutdown = tokio_util::sync::CancellationToken::new();
        let ended = settlements.clone();
        let run = runtime.run(shutdown.clone());
        let task = tokio::spawn(async move {
            let how = match run.await {
                Ok(()) => "it stopped".to_owned(),
                Err(err) => format!("it failed: {}", err.report()),
            };
            ended.runtime_ended(how);
        });
        leftovers.runtime(RunningRuntime { shutdown, task });
        Ok::<_, Error>((broker, publisher))
    }
    .await;

    match made {
        Ok((broker, publisher)) => Ok(TestKit {
            queue,
            database_url,
            handlers,
            broker,
            publisher,
            settlements,
            lose_next_ack,
            leftovers,
        }),
        Err(err) => {
            leftovers.remove(None, Duration::ZERO).await;
            Err(err)
        }
    }
}

/// A channel on `broker` (publisher confirms on), `topology` declared: what the kit
/// publishes the test's messages with.
async fn publisher_on(broker: &Connection, topology: &Topology) -> Result<Channel, Error> {
    let amqp = |source| Error::Amqp { action: "set up the test's queue".into(), source };
    let publisher = broker.create_channel().await.map_err(amqp)?;
    topology.declare(&publisher).await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await.map_err(amqp)?;
    Ok(publisher)
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
