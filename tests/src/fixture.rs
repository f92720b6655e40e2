//! A ready test bed for the core path: a fresh database migrated for the payments
//! demo, a unique quorum queue with its DLQ, and runtimes that record every settled
//! delivery.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use diesel_async::RunQueryDsl;
use idemq::idempotent_handler;
use idemq::{
    observe::ConnectionEvent, observe::Settled, observe::Stats, Outcome, Queue, RetryPolicy, RuntimeBuilder,
    Topology,
};
use idemq_example_payments::{ledger, record_payment, PaymentRequested};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{amqp_url, unique, with_timeout, Broker, TestDb, TestVhost};

use idemq::store::schema::idemq_dedup;

/// How a test's runtimes run their transactions. The correctness suites run each
/// of their tests in both modes ([`in_both_modes!`](crate::in_both_modes)): the
/// guarantees must not depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The runtime's default: group commit (batches of deliveries per transaction).
    GroupCommit,
    /// `batch_size(1)`: one transaction per delivery.
    PerMessage,
}

thread_local! {
    static MODE: std::cell::Cell<Mode> = const { std::cell::Cell::new(Mode::GroupCommit) };
}

impl Mode {
    /// Makes this the mode of the runtimes this test thread builds (the test body's
    /// thread: `#[tokio::test]` runs the body on it).
    pub fn enter(self) {
        MODE.with(|mode| mode.set(self));
    }

    /// The current test's mode.
    pub fn current() -> Mode {
        MODE.with(std::cell::Cell::get)
    }

    /// The `batch_size` of this mode (`None`: the runtime's default).
    pub fn batch_size(self) -> Option<usize> {
        match self {
            Mode::GroupCommit => None,
            Mode::PerMessage => Some(1),
        }
    }
}

/// Defines a test twice, as `name::group_commit` and `name::per_message`, each with
/// its runtimes in that [`Mode`]. The body is an async block's body.
#[macro_export]
macro_rules! in_both_modes {
    ($(#[doc = $doc:expr])* async fn $name:ident() $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread")]
            async fn group_commit() {
                $crate::Mode::GroupCommit.enter();
                $body
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn per_message() {
                $crate::Mode::PerMessage.enter();
                $body
            }
        }
    };
}

/// One test's database, queue and broker client. Deletes its queues on drop.
pub struct Bed {
    /// The test's own database, migrated (idemq + payments tables).
    pub db: TestDb,
    /// A publishing / inspection client.
    pub broker: Broker,
    /// The test's queue (quorum).
    pub queue: String,
    /// Its dead-letter queue.
    pub dlq: String,
    /// The broker URL the bed uses (its own vhost's, for isolated beds).
    pub amqp_url: String,
    /// The bed's own vhost, for tests whose faults are scoped by vhost.
    pub vhost: Option<TestVhost>,
    topology: Topology,
    /// Whether dropping the bed deletes its queues on the machine's broker (not
    /// for vhosts, whose deletion does it, nor for a cluster's).
    delete_queues: bool,
}

/// The retry schedule of every test runtime: millisecond delays, 5 attempts. Tests
/// that want fewer attempts use a prefix of it, so its wait queues are all cleaned up.
pub fn test_retry_policy() -> RetryPolicy {
    RetryPolicy::new(TEST_RETRY_MS.map(Duration::from_millis))
}

/// The delays of [`test_retry_policy`], in milliseconds.
const TEST_RETRY_MS: [u64; 4] = [10, 20, 40, 80];

impl Bed {
    /// A bed with a default quorum queue.
    pub async fn new() -> Bed {
        Self::with_queue(|q| q).await
    }

    /// A bed whose queue is shaped by `shape` (e.g. a lower delivery limit).
    pub async fn with_queue(shape: impl FnOnce(Queue) -> Queue) -> Bed {
        Self::build(shape, None).await
    }

    /// A bed in a vhost of its own, for faults scoped by vhost (closing all its
    /// connections) that must not touch other tests.
    pub async fn isolated() -> Bed {
        Self::build(|q| q, Some(TestVhost::create().await)).await
    }

    /// A bed on a private cluster: `amqp_urls` (every node's URL for a vhost the
    /// test created there, see `idemq::testing::Cluster`).
    pub async fn on_cluster(amqp_urls: String, shape: impl FnOnce(Queue) -> Queue) -> Bed {
        Self::build_at(shape, None, Some(amqp_urls)).await
    }

    /// A bed whose database is on `server`, a private PostgreSQL, for tests that
    /// restart or stop the server (the machine's is shared by every test running);
    /// in a vhost of its own if `isolated`. The bed must be dropped before `server`.
    pub async fn on_postgres(server: &idemq::testing::PostgresServer, isolated: bool) -> Bed {
        crate::init_tracing();
        let db = TestDb::create_on(&server.url("postgres")).await;
        let vhost = if isolated { Some(TestVhost::create().await) } else { None };
        Self::build_with(|q| q, db, vhost, None).await
    }

    async fn build(shape: impl FnOnce(Queue) -> Queue, vhost: Option<TestVhost>) -> Bed {
        Self::build_at(shape, vhost, None).await
    }

    async fn build_at(
        shape: impl FnOnce(Queue) -> Queue,
        vhost: Option<TestVhost>,
        urls: Option<String>,
    ) -> Bed {
        crate::init_tracing();
        Self::build_with(shape, TestDb::create().await, vhost, urls).await
    }

    async fn build_with(
        shape: impl FnOnce(Queue) -> Queue,
        db: TestDb,
        vhost: Option<TestVhost>,
        urls: Option<String>,
    ) -> Bed {
        idemq_example_payments::migrate(&db.url()).await.expect("migrate the test database");
        let queue = unique("q");
        let declared = shape(Queue::new(queue.clone()));
        let dlq = declared.dead_letter_name().to_owned();
        let topology = Topology::new().queue(declared);
        let delete_queues = vhost.is_none() && urls.is_none();
        let amqp_url = urls.unwrap_or_else(|| vhost.as_ref().map_or_else(amqp_url, TestVhost::amqp_url));
        let broker = Broker::connect(&amqp_url).await;
        let bed = Bed { db, broker, queue, dlq, amqp_url, vhost, topology, delete_queues };
        bed.declare().await;
        bed
    }

    /// Declares (again) the bed's queue and its DLQ.
    pub async fn declare(&self) {
        let channel = self.broker.connection().create_channel().await.expect("open a channel");
        self.topology.declare(&channel).await.expect("declare the test topology");
        let _ = channel.close(200, "declared".into()).await;
    }

    /// A runtime builder for this bed's database and queue (concurrency 8, the
    /// [`test_retry_policy`], the test's [`Mode`]).
    pub fn runtime(&self) -> RuntimeBuilder {
        let builder = idemq::Runtime::builder()
            .amqp_url(self.amqp_url.clone())
            .database_url(self.db.url())
            .topology(self.topology.clone())
            .concurrency(8)
            .retry(test_retry_policy())
            .shutdown_deadline(Duration::from_secs(5));
        match Mode::current().batch_size() {
            Some(size) => builder.batch_size(size),
            None => builder,
        }
    }

    /// Publishes a payment as JSON (`serde_json::to_vec` of it, byte for byte).
    pub async fn publish(&self, payment: &PaymentRequested) {
        let body = serde_json::to_vec(payment).expect("serialize");
        let props = lapin::BasicProperties::default().with_content_type("application/json".into());
        self.broker.publish_bytes(&self.queue, &body, props).await;
    }

    /// Ledger rows for `payment_id`.
    pub async fn ledger_rows(&self, payment_id: &str) -> i64 {
        let mut conn = self.db.connect().await;
        ledger::table
            .filter(ledger::payment_id.eq(payment_id))
            .count()
            .get_result(&mut conn)
            .await
            .expect("count ledger")
    }

    /// Payment ids with more than one ledger row (must stay empty).
    pub async fn doubled(&self) -> Vec<String> {
        let mut conn = self.db.connect().await;
        ledger::table
            .group_by(ledger::payment_id)
            .having(diesel::dsl::count_star().gt(1))
            .select(ledger::payment_id)
            .load(&mut conn)
            .await
            .expect("find doubles")
    }

    /// All ledger rows.
    pub async fn ledger_total(&self) -> i64 {
        let mut conn = self.db.connect().await;
        ledger::table.count().get_result(&mut conn).await.expect("count ledger")
    }

    /// Dedup rows for `key` (any handler).
    pub async fn dedup_rows(&self, key: &str) -> i64 {
        let mut conn = self.db.connect().await;
        idemq_dedup::table
            .filter(idemq_dedup::key.eq(key))
            .count()
            .get_result(&mut conn)
            .await
            .expect("count dedup")
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if !self.delete_queues {
            return; // deleting the vhost deletes its queues
        }
        let mut queues = vec![self.queue.clone(), self.dlq.clone()];
        queues.extend(test_retry_policy().wait_queues(&self.queue).into_iter().map(|(name, _)| name));
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let broker = Broker::connect(&amqp_url()).await;
                for queue in &queues {
                    broker.delete_queue(queue).await;
                }
            });
        })
        .join();
    }
}

/// The demo's payment effect under the demo's dedup name and lane, without its
/// outbox event: tests never publish into the demo's shared `payments.applied`.
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
pub async fn ledger_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// The payments handler, a little slow (3 ms inside its transaction), so that
/// faults find work in flight. Same name as `apply_payment`: same dedup rows.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
pub async fn slow_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await?;
    tokio::time::sleep(Duration::from_millis(3)).await;
    Ok(())
}

/// The payments handler at 25 ms a payment inside its transaction, so that a stream
/// is still flowing when a fault lands and other transactions are open while one
/// commits. Same name as `apply_payment`: same dedup rows.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
pub async fn slower_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await?;
    tokio::time::sleep(Duration::from_millis(25)).await;
    Ok(())
}

/// The "ignore the unique violation" idiom: the payment is written, then a failing
/// statement's error is dropped with `let _ =` (on the first attempt only) — the
/// transaction is aborted, and idemq must not ack it.
#[idempotent_handler(key = "payment_id")]
pub async fn ignores_an_error(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    let first = next_attempt(&msg.payment_id) == 1;
    record_payment(conn, &msg).await?;
    if first {
        let _ = diesel::sql_query("INSERT INTO no_such_table VALUES (1)").execute(conn).await;
    }
    Ok(())
}

fn attempts() -> &'static Mutex<HashMap<String, u32>> {
    static ATTEMPTS: OnceLock<Mutex<HashMap<String, u32>>> = OnceLock::new();
    ATTEMPTS.get_or_init(Mutex::default)
}

/// Counts a handler attempt for `key` (keys are unique per test, so tests running in
/// parallel never share a count); returns its number, 1 for the first.
pub fn next_attempt(key: &str) -> u32 {
    let mut attempts = attempts().lock().expect("attempts lock");
    let n = attempts.entry(key.to_owned()).or_default();
    *n += 1;
    *n
}

/// How many attempts [`next_attempt`] counted for `key`.
pub fn attempts_of(key: &str) -> u32 {
    attempts().lock().expect("attempts lock").get(key).copied().unwrap_or(0)
}

/// Publishes a stream of `n` distinct payments, every fifth one twice; returns them.
pub async fn publish_stream(bed: &Bed, n: usize) -> Vec<PaymentRequested> {
    let payments: Vec<_> = (0..n).map(|i| payment(1 + i as i64)).collect();
    for (i, p) in payments.iter().enumerate() {
        bed.publish(p).await;
        if i % 5 == 0 {
            bed.publish(p).await;
        }
    }
    payments
}

/// How many deliveries [`publish_stream`] makes for `n` payments.
pub fn stream_deliveries(n: usize) -> usize {
    n + n.div_ceil(5)
}

/// A payment with a unique id.
pub fn payment(amount_cents: i64) -> PaymentRequested {
    PaymentRequested { payment_id: unique("pay"), account: unique("acct"), amount_cents }
}

/// A runtime running in the background, recording what it settles.
pub struct Running {
    /// Cancel to shut down.
    pub shutdown: CancellationToken,
    /// The run's result.
    pub handle: JoinHandle<Result<(), idemq::Error>>,
    /// Every settled delivery, in order.
    pub events: Arc<Mutex<Vec<Settled>>>,
    /// Every connection event, in order.
    pub connection_events: Arc<Mutex<Vec<ConnectionEvent>>>,
    /// Its counters.
    pub stats: Arc<Stats>,
}

impl Running {
    /// Builds and starts `builder` with an observer recording events.
    pub fn start(builder: RuntimeBuilder) -> Running {
        let events: Arc<Mutex<Vec<Settled>>> = Arc::default();
        let connection_events: Arc<Mutex<Vec<ConnectionEvent>>> = Arc::default();
        let sink = Arc::clone(&events);
        let connection_sink = Arc::clone(&connection_events);
        let runtime = builder
            .observe(idemq::observe::on_settled(move |settled| {
                sink.lock().expect("events lock").push(settled.clone());
            }))
            .observe(idemq::observe::on_connection(move |event| {
                connection_sink.lock().expect("events lock").push(event.clone());
            }))
            .build()
            .expect("build the runtime");
        let stats = runtime.stats();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(runtime.run(shutdown.clone()));
        Running { shutdown, handle, events, connection_events, stats }
    }

    /// Runs `builder` until `n` deliveries are settled, shuts it down cleanly and
    /// returns what it settled.
    pub async fn settle(builder: RuntimeBuilder, n: usize) -> Vec<Settled> {
        let running = Running::start(builder);
        running.wait_settled(n).await;
        let events = running.events();
        running.stop().await.expect("clean shutdown");
        events
    }

    /// A copy of the events so far.
    pub fn events(&self) -> Vec<Settled> {
        self.events.lock().expect("events lock").clone()
    }

    /// A copy of the connection events so far.
    pub fn connection_events(&self) -> Vec<ConnectionEvent> {
        self.connection_events.lock().expect("events lock").clone()
    }

    /// Waits until `n` deliveries are settled (at most 30 s).
    pub async fn wait_settled(&self, n: usize) {
        crate::eventually(&format!("{n} deliveries settled"), Duration::from_secs(30), || async {
            self.events.lock().expect("events lock").len() >= n
        })
        .await;
    }

    /// Waits (at most 30 s) until the events so far satisfy `done`; returns them.
    pub async fn wait_until(&self, what: &str, done: impl Fn(&[Settled]) -> bool) -> Vec<Settled> {
        crate::eventually(what, Duration::from_secs(30), || async { done(&self.events()) }).await;
        self.events()
    }

    /// Waits (at most 30 s) until the message keyed `key` has come to its end (applied,
    /// a duplicate, already copied or dead-lettered) and each attempt before it was
    /// reported; returns its events in attempt order.
    ///
    /// Wait on this rather than on a number of events read in arrival order: an attempt
    /// that retries is reported once its copy is confirmed and the original acked, and by
    /// then the copy may have come back and been settled, and reported, first (seen under
    /// load: "the first attempt must fail, not end Applied" while attempt 1 had failed).
    pub async fn wait_for_end(&self, key: &str) -> Vec<Settled> {
        let what = format!("the message keyed {key} came to its end");
        attempts_in_order(&self.wait_until(&what, |events| ended(&attempts_in_order(events, key))).await, key)
    }

    /// Runs `builder` until the message keyed `key` has come to its end, shuts it down
    /// cleanly and returns that message's events in attempt order (see
    /// [`Running::wait_for_end`]).
    pub async fn settle_message(builder: RuntimeBuilder, key: &str) -> Vec<Settled> {
        let running = Running::start(builder);
        let events = running.wait_for_end(key).await;
        running.stop().await.expect("clean shutdown");
        events
    }

    /// Shuts down and returns the run's result.
    pub async fn stop(self) -> Result<(), idemq::Error> {
        self.shutdown.cancel();
        with_timeout("runtime shutdown", Duration::from_secs(20), self.handle).await.expect("runtime task")
    }
}

/// The events of the message keyed `key`, in attempt order (in arrival order within an
/// attempt: a requeued delivery comes back with the same attempt number).
pub fn attempts_in_order(events: &[Settled], key: &str) -> Vec<Settled> {
    let mut of_key: Vec<Settled> =
        events.iter().filter(|event| event.key.as_deref() == Some(key)).cloned().collect();
    of_key.sort_by_key(|event| event.attempt);
    of_key
}

/// Whether `events` (one message's, in attempt order) hold its end, and every attempt
/// before the end.
fn ended(events: &[Settled]) -> bool {
    let last = events.iter().find(|event| {
        matches!(
            event.outcome,
            Outcome::Applied
                | Outcome::Duplicate
                | Outcome::AlreadyCopied { .. }
                | Outcome::DeadLettered { .. }
        )
    });
    last.is_some_and(|last| (1..last.attempt).all(|attempt| events.iter().any(|e| e.attempt == attempt)))
}

/// A consumer child process (the `consumer` binary of this crate) on a bed's queue
/// and database; killed on drop.
pub struct ConsumerProcess {
    child: std::process::Child,
}

impl ConsumerProcess {
    /// Starts `binary` (pass `env!("CARGO_BIN_EXE_consumer")`) with extra `env`.
    pub fn spawn(binary: &str, bed: &Bed, env: &[(&str, &str)]) -> ConsumerProcess {
        let retry_ms = TEST_RETRY_MS.map(|ms| ms.to_string()).join(",");
        let mut command = std::process::Command::new(binary);
        command
            .env("AMQP_URL", &bed.amqp_url)
            .env("DATABASE_URL", bed.db.url())
            .env("QUEUE", &bed.queue)
            // The test schedule, whose wait queues the bed deletes.
            .env("RETRY_MS", retry_ms)
            .env("BATCH_SIZE", Mode::current().batch_size().map(|size| size.to_string()).unwrap_or_default())
            .stdout(std::process::Stdio::null());
        for (name, value) in env {
            command.env(name, value);
        }
        ConsumerProcess { child: command.spawn().expect("spawn the consumer process") }
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("wait on the consumer")
    }

    /// Sends SIGTERM and waits (at most `timeout`) for it to exit.
    pub async fn terminate(mut self, timeout: Duration) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the consumer did not exit within {timeout:?} of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ConsumerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
