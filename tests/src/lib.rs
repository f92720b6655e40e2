//! Shared support code for the idemq integration tests.
//!
//! The tests run against a real PostgreSQL server and a real RabbitMQ broker
//! (see `.ci/services`). Every test gets its own isolated resources:
//!
//! * [`TestDb`] — a freshly created PostgreSQL database, dropped on `Drop`;
//! * [`TestVhost`] — a freshly created RabbitMQ virtual host, deleted on `Drop`;
//! * [`unique`] — names that are unique across processes and parallel tests.
//!
//! [`Broker`] is a small publishing / inspection client on top of `lapin`,
//! and [`eventually`] / [`with_timeout`] bound every wait so that a broken
//! test fails instead of hanging.
//!
//! [`webdriver::Browser`] drives a headless Chromium, for tests of pages in a browser.
//!
//! Server locations come from the environment: `DATABASE_URL` (the admin
//! database on which test databases are created) and `AMQP_URL`.

pub mod app;
pub mod fixture;
pub mod logs;
mod management;
pub mod webdriver;

pub use fixture::Mode;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};

/// Default AMQP URL when `AMQP_URL` is not set (default vhost `/`).
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default admin database URL when `DATABASE_URL` is not set.
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Prefix of every test database name: `idemq_t_<pid>_<n>_<rand>`.
const TEST_DB_PREFIX: &str = "idemq_t";
/// Prefix of every test vhost name.
const TEST_VHOST_PREFIX: &str = "idemq_v";
/// Poll interval of [`eventually`].
const POLL_INTERVAL: Duration = Duration::from_millis(50);

// ---------------------------------------------------------------------------
// Environment and names
// ---------------------------------------------------------------------------

/// The AMQP URL of the broker: `$AMQP_URL` (or the file `$AMQP_URL_FILE` names), or
/// `amqp://guest:guest@127.0.0.1:5672/%2f` (the default vhost).
pub fn amqp_url() -> String {
    env_or("AMQP_URL", DEFAULT_AMQP_URL)
}

/// The URL of the PostgreSQL *admin* database on which test databases are
/// created and dropped: `$DATABASE_URL` (or the file `$DATABASE_URL_FILE` names), or
/// `postgres://postgres@127.0.0.1:5432/postgres`.
pub fn database_admin_url() -> String {
    env_or("DATABASE_URL", DEFAULT_DATABASE_URL)
}

/// `idemq::connect::env_url`, with a blank value taken as unset. Panics on a problem with the
/// environment (a URL and its file both set, an unreadable file).
fn env_or(var: &str, default: &str) -> String {
    match idemq::connect::env_url(var, default) {
        Ok(v) if !v.trim().is_empty() => v,
        Ok(_) => default.to_owned(),
        Err(err) => panic!("{err}"),
    }
}

/// A name that is unique across processes and across parallel tests of one
/// process: `<prefix>_<pid>_<counter>_<6 random hex chars>`.
///
/// The result only contains the characters of `prefix` plus `[0-9a-f_]`, so
/// with a `[a-z0-9_]` prefix it is a valid unquoted PostgreSQL identifier, an
/// AMQP queue name and a vhost name that needs no URL encoding.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}_{n}_{}", std::process::id(), &random[..6])
}

/// Replaces the path (the database / vhost part) of a URL of the form
/// `scheme://authority[/path][?query]`, keeping the query string.
///
/// `segment` must not need percent-encoding.
fn replace_url_path(url: &str, segment: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        // A libpq key/value connection string: a later `dbname` wins.
        return format!("{url} dbname={segment}");
    };
    let after_scheme = scheme_end + 3;
    let rest = &url[after_scheme..];
    let authority_end = rest.find(['/', '?']).map_or(url.len(), |i| after_scheme + i);
    let query = url[authority_end..].find('?').map_or("", |i| &url[authority_end + i..]);
    format!("{}/{segment}{query}", &url[..authority_end])
}

// ---------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------

/// A fresh, empty PostgreSQL database that is dropped (`WITH (FORCE)`, so
/// open connections do not prevent it) when the value is dropped.
///
/// The first [`TestDb::create`] of a process also drops databases left over
/// by earlier test processes that no longer run (for example after a crash
/// or a `SIGKILL`).
#[derive(Debug)]
pub struct TestDb {
    name: String,
    admin_url: String,
    url: String,
}

impl TestDb {
    /// Creates a new database named `idemq_t_<pid>_<n>_<rand>` on the server
    /// of [`database_admin_url`]. Panics if the server cannot be reached.
    pub async fn create() -> TestDb {
        static STALE_CLEANUP: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

        let admin_url = database_admin_url();
        let mut admin = connect_pg(&admin_url).await;
        STALE_CLEANUP.get_or_init(|| drop_stale_databases(&mut admin)).await;
        Self::create_with(admin, admin_url).await
    }

    /// Creates a new database on the server whose maintenance database `admin_url`
    /// names (a private server: [`idemq::testing::PostgresServer`]).
    pub async fn create_on(admin_url: &str) -> TestDb {
        Self::create_with(connect_pg(admin_url).await, admin_url.to_owned()).await
    }

    async fn create_with(mut admin: AsyncPgConnection, admin_url: String) -> TestDb {
        let name = unique(TEST_DB_PREFIX);
        // template0 never has connected sessions, so parallel creates cannot
        // fail with "source database is being accessed by other users".
        diesel::sql_query(format!("CREATE DATABASE {} TEMPLATE template0", quote_ident(&name)))
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));

        let url = replace_url_path(&admin_url, &name);
        TestDb { name, admin_url, url }
    }

    /// The connection URL of this database.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The name of this database.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Opens a new connection to this database. Panics on failure.
    pub async fn connect(&self) -> AsyncPgConnection {
        connect_pg(&self.url).await
    }

    /// Ends every session of this database but the one asking
    /// (`pg_terminate_backend`): what a database fault does to a consumer's
    /// connections, scoped to this test. Returns how many it ended.
    pub async fn kill_sessions(&self) -> i64 {
        self.count(&format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{}' \
             AND pid <> pg_backend_pid()",
            self.name
        ))
        .await
    }

    /// Runs `sql`, a query of one `bigint` (e.g. `SELECT count(*) FROM …`), on a new
    /// connection and returns its value. Panics on failure.
    pub async fn count(&self, sql: &str) -> i64 {
        let mut conn = self.connect().await;
        diesel::dsl::sql::<diesel::sql_types::BigInt>(sql)
            .get_result(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop cannot be async and may run inside (or outside) a tokio
        // runtime, so the DROP DATABASE runs on a dedicated thread with its
        // own runtime.
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        let joined = std::thread::Builder::new()
            .name(format!("drop-{name}"))
            .spawn(move || -> Result<(), String> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime.block_on(async {
                    let mut admin =
                        AsyncPgConnection::establish(&admin_url).await.map_err(|e| e.to_string())?;
                    drop_database(&mut admin, &name).await.map(drop).map_err(|e| e.to_string())
                })
            })
            .map(std::thread::JoinHandle::join);
        // Never panic here: a panic during unwinding would abort the process.
        match joined {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("warning: could not drop test database {}: {e}", self.name),
            Ok(Err(_)) => eprintln!("warning: dropping test database {} panicked", self.name),
            Err(e) => eprintln!("warning: could not spawn thread to drop {}: {e}", self.name),
        }
    }
}

/// A connection to `url`. The server's connection slots are shared by every test
/// running beside this one: while they are all taken ("too many clients"), it waits
/// for one, up to a minute.
async fn connect_pg(url: &str) -> AsyncPgConnection {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match AsyncPgConnection::establish(url).await {
            Ok(conn) => return conn,
            Err(e) if e.to_string().contains("too many clients") && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                panic!("{}", idemq::connect::redact(&format!("cannot connect to PostgreSQL at {url}: {e}")))
            }
        }
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

async fn drop_database(admin: &mut AsyncPgConnection, name: &str) -> diesel::QueryResult<usize> {
    diesel::sql_query(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name)))
        .execute(admin)
        .await
}

/// Drops `idemq_t_<pid>_...` databases whose creating process is gone.
/// Failures only produce warnings: a concurrent process may race us.
async fn drop_stale_databases(admin: &mut AsyncPgConnection) {
    let names: Vec<String> =
        match diesel::dsl::sql::<Text>("SELECT datname FROM pg_database WHERE datname LIKE 'idemq\\_t\\_%'")
            .load(admin)
            .await
        {
            Ok(names) => names,
            Err(e) => {
                eprintln!("warning: cannot list stale test databases: {e}");
                return;
            }
        };
    for name in names.into_iter().filter(|name| left_by_dead_process(name, TEST_DB_PREFIX)) {
        if let Err(e) = drop_database(admin, &name).await {
            eprintln!("warning: cannot drop stale test database {name}: {e}");
        }
    }
}

/// Whether `name` is `<prefix>_<pid>_...` of a process that no longer runs.
fn left_by_dead_process(name: &str, prefix: &str) -> bool {
    let pid = name
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('_'))
        .and_then(|rest| rest.split('_').next())
        .and_then(|pid| pid.parse::<u32>().ok());
    pid.is_some_and(|pid| {
        pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })
}

// ---------------------------------------------------------------------------
// RabbitMQ virtual hosts
// ---------------------------------------------------------------------------

/// A fresh RabbitMQ virtual host (with full permissions for `guest`) that is
/// deleted, together with everything in it, when the value is dropped.
///
/// Created and deleted through RabbitMQ's HTTP API (the management plugin, enabled
/// if it is not: see `management.rs`), or with `rabbitmqctl` where that cannot be
/// had; its faults and live counts use `rabbitmqctl`, which must be on `PATH` and
/// allowed to talk to the local node.
#[derive(Debug)]
pub struct TestVhost {
    name: String,
    api: Option<&'static management::Api>,
}

impl TestVhost {
    /// Creates the vhost and grants `guest` configure/write/read on it.
    /// Panics (with `rabbitmqctl`'s stderr) on failure.
    pub async fn create() -> TestVhost {
        static STALE_CLEANUP: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        STALE_CLEANUP.get_or_init(delete_stale_vhosts).await;
        let name = unique(TEST_VHOST_PREFIX);
        let api = management::api().await;
        match api {
            Some(api) => api.expect("PUT", format!("/api/vhosts/{name}"), None).await,
            None => rabbitmqctl(&["add_vhost", &name]).await,
        }
        // From here on, Drop deletes the vhost even if the next step panics.
        let vhost = TestVhost { name, api };
        match api {
            Some(api) => {
                let everything = r#"{"configure":".*","write":".*","read":".*"}"#;
                api.expect("PUT", format!("/api/permissions/{}/guest", vhost.name), Some(everything)).await;
            }
            None => rabbitmqctl(&["set_permissions", "-p", &vhost.name, "guest", ".*", ".*", ".*"]).await,
        }
        vhost
    }

    /// The vhost name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// [`amqp_url`] with its vhost replaced by this one.
    pub fn amqp_url(&self) -> String {
        // Names are `[a-z0-9_]` only, so no percent-encoding is needed.
        replace_url_path(&amqp_url(), &self.name)
    }

    /// Messages of `queue` in this vhost that are not yet settled: ready plus
    /// delivered-but-unacked; while any are ready, only the ready (enough to say
    /// that it has not settled); `u64::MAX` if the queue does not exist.
    ///
    /// Read fresh, not from `rabbitmqctl list_queues`: its counts of a quorum queue are
    /// as of the queue's last metrics tick (seen up to ~5 s old, both ways: 10 ready
    /// after all were acked, 0 unacked with 10 held), so a drain wait could pass while
    /// redeliveries were still in flight. The ready count comes from a passive declare,
    /// the unacked count from `list_channels` (each channel answers live) — every
    /// channel of the vhost, so it includes the unacked of its other queues: waiting
    /// for 0 waits for the whole vhost to settle.
    ///
    /// `rabbitmqctl` boots an Erlang VM for each call (half a second of CPU), and drain
    /// waits poll this: while messages are ready it is not asked at all.
    pub async fn unsettled(&self, queue: &str) -> u64 {
        let broker = Broker::connect(&self.amqp_url()).await;
        let passive = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
        let declared =
            broker.fresh_channel().await.queue_declare(queue.into(), passive, FieldTable::default()).await;
        let _ = broker.connection.close(200, "counted".into()).await;
        let ready = match declared {
            Ok(declared) => u64::from(declared.message_count()),
            Err(e) if is_not_found(&e) => return u64::MAX,
            // An exclusive queue of another connection cannot be declared: the listed
            // count (ready and unacked, as of the last tick) is all there is.
            Err(_) => {
                let listed = self.ctl("list_queues", &["name", "messages"]).await;
                return listed
                    .lines()
                    .filter_map(|line| line.split_once('\t'))
                    .find(|(name, _)| *name == queue)
                    .and_then(|(_, messages)| messages.trim().parse::<u64>().ok())
                    .unwrap_or(u64::MAX);
            }
        };
        if ready > 0 {
            return ready;
        }
        self.ctl("list_channels", &["messages_unacknowledged"])
            .await
            .lines()
            .filter_map(|line| line.trim().parse::<u64>().ok())
            .sum()
    }

    /// Waits until `queue` has settled ([`TestVhost::unsettled`] is 0), up to
    /// `timeout`. On timeout it panics with what was left: the last count, and the
    /// vhost's queues (ready, unacked, consumers), channels (unacked, prefetch,
    /// consumers) and connections as the broker lists them, so a failure says whether
    /// messages sat ready with no one consuming or were held unacked, and by whom.
    pub async fn await_drained(&self, queue: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = self.unsettled(queue).await;
        while last != 0 {
            if tokio::time::Instant::now() >= deadline {
                let queues = self
                    .ctl(
                        "list_queues",
                        &["name", "type", "messages_ready", "messages_unacknowledged", "consumers"],
                    )
                    .await;
                let channels = self
                    .ctl(
                        "list_channels",
                        &["name", "consumer_count", "messages_unacknowledged", "prefetch_count"],
                    )
                    .await;
                let connections = self.ctl("list_connections", &["name", "state", "client_properties"]).await;
                panic!(
                    "{queue} did not settle within {timeout:?}: {last} unsettled at the end\n\
                     queues (name, type, ready, unacked, consumers):\n{queues}\n\
                     channels (name, consumers, unacked, prefetch):\n{channels}\n\
                     connections:\n{connections}"
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
            last = self.unsettled(queue).await;
        }
    }

    /// `rabbitmqctl -q <command> -p <vhost> --no-table-headers <items>`'s output.
    async fn ctl(&self, command: &str, items: &[&str]) -> String {
        let out = tokio::process::Command::new("rabbitmqctl")
            .args(["-q", command, "-p", &self.name, "--no-table-headers"])
            .args(items)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run rabbitmqctl {command}: {e}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Forcibly closes every client connection to this vhost (simulates a
    /// broker-side connection loss).
    pub async fn close_all_connections(&self) {
        rabbitmqctl(&["close_all_connections", "-p", &self.name, "test"]).await;
    }

    /// Forcibly closes this vhost's client connections whose name contains `name`
    /// (idemq names its connections `idemq <role> (pid N)`); returns how many.
    pub async fn close_connections_named(&self, name: &str) -> usize {
        let out = tokio::process::Command::new("rabbitmqctl")
            .args(["-q", "list_connections", "--no-table-headers", "pid", "vhost", "client_properties"])
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .expect("run rabbitmqctl list_connections");
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut closed = 0;
        for line in listed.lines() {
            let mut fields = line.split('\t');
            let (Some(pid), Some(vhost), Some(properties)) = (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            // The name is the client property `connection_name`.
            if vhost == self.name && properties.contains(name) {
                rabbitmqctl(&["close_connection", pid, "test"]).await;
                closed += 1;
            }
        }
        closed
    }
}

impl Drop for TestVhost {
    fn drop(&mut self) {
        if let Some(api) = self.api {
            match api.request("DELETE", &format!("/api/vhosts/{}", self.name), None) {
                Ok(status) if (200..300).contains(&status) => return,
                other => eprintln!(
                    "warning: deleting vhost {} through the HTTP API: {other:?}; trying rabbitmqctl",
                    self.name
                ),
            }
        }
        match std::process::Command::new("rabbitmqctl")
            .args(["-q", "delete_vhost", &self.name])
            .stdin(std::process::Stdio::null())
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "warning: rabbitmqctl delete_vhost {} failed ({}): {}",
                self.name,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("warning: cannot run rabbitmqctl delete_vhost: {e}"),
        }
    }
}

/// Runs `rabbitmqctl -q <args>`, panicking with its output on failure.
/// Deletes `idemq_v_<pid>_...` vhosts whose creating process is gone (a killed
/// test run). Failures are ignored: another process may race us.
async fn delete_stale_vhosts() {
    let Ok(out) = tokio::process::Command::new("rabbitmqctl")
        .args(["-q", "list_vhosts", "name"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
    else {
        return;
    };
    for name in String::from_utf8_lossy(&out.stdout).lines().map(str::trim) {
        if left_by_dead_process(name, TEST_VHOST_PREFIX) {
            let _ = tokio::process::Command::new("rabbitmqctl")
                .args(["-q", "delete_vhost", name])
                .stdin(std::process::Stdio::null())
                .output()
                .await;
        }
    }
}

async fn rabbitmqctl(args: &[&str]) {
    let out = tokio::process::Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run rabbitmqctl {args:?}: {e}"));
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed ({}):\nstderr: {}\nstdout: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim(),
        String::from_utf8_lossy(&out.stdout).trim()
    );
}

// ---------------------------------------------------------------------------
// Broker client
// ---------------------------------------------------------------------------

/// A test-side AMQP client: one connection plus a publisher-confirm channel.
///
/// Publishing waits for the broker's confirm; inspection helpers use a fresh
/// channel per call, so a channel error (for example a missing queue) never
/// breaks the publishing channel.
#[derive(Debug)]
pub struct Broker {
    connection: Connection,
    channel: Channel,
}

impl Broker {
    /// Connects to `url` and opens a channel in confirm mode. Panics on
    /// failure.
    ///
    /// `url` may be a comma-separated list (a cluster's nodes): the first that
    /// answers is used.
    pub async fn connect(url: &str) -> Broker {
        let mut failures = Vec::new();
        let mut connected = None;
        for url in url.split(',').map(str::trim) {
            let properties = ConnectionProperties::default().with_connection_name("idemq-tests".into());
            match Connection::connect(url, properties).await {
                Ok(connection) => {
                    connected = Some(connection);
                    break;
                }
                Err(e) => failures.push(format!("{url}: {e}")),
            }
        }
        let connection = connected.unwrap_or_else(|| {
            panic!(
                "{}",
                idemq::connect::redact(&format!("cannot connect to RabbitMQ: {}", failures.join("; ")))
            )
        });
        let channel = connection.create_channel().await.expect("cannot open AMQP channel");
        channel.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select failed");
        Broker { connection, channel }
    }

    /// The underlying connection (e.g. to open more channels).
    pub fn connection(&self) -> &lapin::Connection {
        &self.connection
    }

    /// Declares a durable, non-exclusive queue named `queue` (idempotent).
    pub async fn declare_queue(&self, queue: &str) {
        let channel = self.fresh_channel().await;
        channel
            .queue_declare(queue.into(), QueueDeclareOptions::durable(), FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("cannot declare queue {queue}: {e}"));
        close_channel(&channel).await;
    }

    /// Publishes `value` as JSON (`content_type: application/json`) to
    /// `queue`; see [`Broker::publish_bytes`].
    pub async fn publish_json(&self, queue: &str, value: &serde_json::Value) {
        let body = serde_json::to_vec(value).expect("serialize JSON body");
        let props = BasicProperties::default().with_content_type("application/json".into());
        self.publish_bytes(queue, &body, props).await;
    }

    /// Publishes `body` to `queue` through the default exchange, mandatory
    /// and persistent (`delivery_mode` is forced to 2), and waits for the
    /// publisher confirm. Panics if the message was returned as unroutable
    /// (no such queue) or nacked.
    pub async fn publish_bytes(&self, queue: &str, body: &[u8], props: BasicProperties) {
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                body,
                props.with_delivery_mode(2),
            )
            .await
            .unwrap_or_else(|e| panic!("basic.publish to {queue} failed: {e}"))
            .await
            .unwrap_or_else(|e| panic!("publisher confirm for {queue} failed: {e}"));
        match confirm {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(returned)) => panic!(
                "message to queue {queue} was returned as unroutable: {} {}",
                returned.reply_code, returned.reply_text
            ),
            Confirmation::Nack(_) => panic!("message to queue {queue} was nacked by the broker"),
            Confirmation::NotRequested => {
                panic!("publisher confirms are not enabled on the broker channel")
            }
        }
    }

    /// The number of ready messages in `queue` (passive declare). Panics if
    /// the queue does not exist.
    pub async fn message_count(&self, queue: &str) -> u32 {
        self.inspect(queue).await.message_count()
    }

    /// The number of consumers subscribed to `queue` (passive declare). Panics
    /// if the queue does not exist. It drops to 0 once the broker has processed a
    /// consumer's channel or connection close, and with it returned that
    /// consumer's unacked deliveries to the queue.
    pub async fn consumer_count(&self, queue: &str) -> u32 {
        self.inspect(queue).await.consumer_count()
    }

    /// A passive declare of `queue`, on a throwaway channel (a failed passive
    /// declare closes its channel).
    /// Whether `queue` exists (a passive declare on a channel of its own).
    pub async fn queue_exists(&self, queue: &str) -> bool {
        let channel = self.fresh_channel().await;
        let options = QueueDeclareOptions::default().passive();
        let exists = channel.queue_declare(queue.into(), options, FieldTable::default()).await.is_ok();
        close_channel(&channel).await;
        exists
    }

    async fn inspect(&self, queue: &str) -> lapin::Queue {
        let channel = self.fresh_channel().await;
        let declared = channel
            .queue_declare(queue.into(), QueueDeclareOptions::default().passive(), FieldTable::default())
            .await
            .unwrap_or_else(|e| panic!("passive declare of queue {queue} failed: {e}"));
        close_channel(&channel).await;
        declared
    }

    /// Takes one message off `queue` (and acks it), or `None` if the queue
    /// is empty.
    pub async fn get(&self, queue: &str) -> Option<BasicGetMessage> {
        let channel = self.fresh_channel().await;
        let message = get_one(&channel, queue).await;
        close_channel(&channel).await;
        message
    }

    /// Takes (and acks) every message currently in `queue`, in order.
    pub async fn drain(&self, queue: &str) -> Vec<BasicGetMessage> {
        let channel = self.fresh_channel().await;
        let mut messages = Vec::new();
        while let Some(message) = get_one(&channel, queue).await {
            messages.push(message);
        }
        close_channel(&channel).await;
        messages
    }

    /// Deletes `queue`; a queue that does not exist is not an error.
    pub async fn delete_queue(&self, queue: &str) {
        let channel = self.fresh_channel().await;
        match channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await {
            Ok(_) => close_channel(&channel).await,
            Err(e) if is_not_found(&e) => {}
            Err(e) => panic!("cannot delete queue {queue}: {e}"),
        }
    }

    async fn fresh_channel(&self) -> Channel {
        self.connection.create_channel().await.expect("cannot open AMQP channel")
    }
}

/// Takes the message at the head of `queue` without acking it and closes the
/// channel, so the broker requeues it as *redelivered* — what a consumer that died
/// holding it leaves behind. Panics if the queue is empty.
pub async fn redeliver_once(broker: &Broker, queue: &str) {
    let channel = broker.fresh_channel().await;
    assert!(basic_get(&channel, queue).await.is_some(), "queue {queue} is empty: nothing to redeliver");
    close_channel(&channel).await;
}

/// One `basic.get` with manual ack (not acked here).
async fn basic_get(channel: &Channel, queue: &str) -> Option<BasicGetMessage> {
    channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap_or_else(|e| panic!("basic.get on queue {queue} failed: {e}"))
}

async fn get_one(channel: &Channel, queue: &str) -> Option<BasicGetMessage> {
    let message = basic_get(channel, queue).await?;
    message
        .delivery
        .acker
        .ack(BasicAckOptions::default())
        .await
        .unwrap_or_else(|e| panic!("cannot ack message from {queue}: {e}"));
    Some(message)
}

async fn close_channel(channel: &Channel) {
    // Best effort: the channel may already be closed by a broker error.
    let _ = channel.close(200, "OK".into()).await;
}

fn is_not_found(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::ProtocolError(e) if matches!(e.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
    )
}

// ---------------------------------------------------------------------------
// Headers
// ---------------------------------------------------------------------------

fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(name)
}

/// Reads header `name` as a string (an AMQP long or short string). `None`
/// if absent, of another type, or (for long strings) not UTF-8.
pub fn header_str(props: &lapin::BasicProperties, name: &str) -> Option<String> {
    match header(props, name)? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// Reads header `name` as an integer, accepting every AMQP integer type
/// (and timestamps). `None` if absent, not an integer, or out of `i64`
/// range.
pub fn header_i64(props: &lapin::BasicProperties, name: &str) -> Option<i64> {
    match *header(props, name)? {
        AMQPValue::ShortShortInt(v) => Some(v.into()),
        AMQPValue::ShortShortUInt(v) => Some(v.into()),
        AMQPValue::ShortInt(v) => Some(v.into()),
        AMQPValue::ShortUInt(v) => Some(v.into()),
        AMQPValue::LongInt(v) => Some(v.into()),
        AMQPValue::LongUInt(v) => Some(v.into()),
        AMQPValue::LongLongInt(v) => Some(v),
        AMQPValue::Timestamp(v) => i64::try_from(v).ok(),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------

/// Polls `f` every 50 ms until it returns `true`. Panics with `what` if that
/// does not happen within `timeout` (a hanging `f` counts against the
/// timeout too).
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let poll = async {
        loop {
            if f().await {
                return;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    };
    if tokio::time::timeout(timeout, poll).await.is_err() {
        panic!("timed out after {timeout:?} waiting for: {what}");
    }
}

/// Awaits `fut`, panicking with `what` if it takes longer than `d`.
pub async fn with_timeout<T>(what: &str, d: Duration, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(d, fut).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {d:?}: {what}"),
    }
}

// ---------------------------------------------------------------------------
// HTTP (the runtime's metrics and health endpoints)
// ---------------------------------------------------------------------------

/// `GET path` on `addr` (HTTP/1.0, the whole answer; empty if nothing listens).
/// Blocking: call it from `spawn_blocking`.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    // Not listening yet (the runtime is starting): nothing.
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else { return String::new() };
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("send");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

/// A free local port (bound, then let go).
pub fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr")
}

// ---------------------------------------------------------------------------
// Tracing
// ---------------------------------------------------------------------------

/// Installs the process's `tracing` subscriber: the test output, filtered by
/// `RUST_LOG` (default `warn`), and the capture of idemq's log ([`logs`]). Safe to
/// call any number of times.
pub fn init_tracing() {
    logs::captured();
}

#[cfg(test)]
mod tests {
    use super::replace_url_path;

    #[test]
    fn replaces_url_paths() {
        assert_eq!(
            replace_url_path("postgres://postgres@127.0.0.1:5432/postgres", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            replace_url_path("postgres://h:1/db?sslmode=disable", "x"),
            "postgres://h:1/x?sslmode=disable"
        );
        assert_eq!(replace_url_path("postgres://h", "x"), "postgres://h/x");
        assert_eq!(
            replace_url_path("amqp://guest:guest@127.0.0.1:5672/%2f", "v"),
            "amqp://guest:guest@127.0.0.1:5672/v"
        );
        assert_eq!(replace_url_path("host=h user=u", "x"), "host=h user=u dbname=x");
    }
}
