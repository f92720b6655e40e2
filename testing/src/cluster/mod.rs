//! A private RabbitMQ cluster on this host, for tests of what happens when a node
//! is lost: three (or more) nodes beside the machine's own broker, never joined to it.
//!
//! Each node has its own name (`idemq-kit-a@localhost`, …), AMQP port (5701, …),
//! distribution port (25701, …), configuration file (its own listener on 127.0.0.1,
//! `guest` allowed from loopback) and data directory under
//! `/tmp/idemq-kit-cluster`. The nodes run as the `rabbitmq` user when the tests
//! run as root (they share that user's Erlang cookie, so `rabbitmqctl -n` reaches
//! them); `b`, `c`, … join `a` with `rabbitmqctl join_cluster`.
//!
//! **One cluster per host at a time**: [`Cluster::start`] takes an exclusive lock
//! (`flock /tmp/idemq-kit-cluster.lock`), so a second test run waits for the first.
//! Whatever is found under the lock is left over from a run that was killed and is
//! removed first (nodes killed, data wiped), like stale test databases. **Teardown
//! even when a test fails**: the lock is held by a watchdog process that kills the
//! nodes, wipes their data and releases the lock as soon as the process that
//! started them is gone, so a cluster kept in a `static` (the cheap way to share it
//! between tests: starting one takes ~25 s here) is torn down however the test
//! binary ends. Dropping the [`Cluster`] tears it down at once.
//!
//! ```no_run
//! # async fn example() -> Result<(), idemq::testing::ClusterError> {
//! use idemq::testing::Cluster;
//! let cluster = Cluster::start().await?;
//! let urls = cluster.amqp_urls("/");          // "amqp://…:5701/%2f,amqp://…:5702/%2f,…"
//! // ... run consumers with AMQP_URL=urls ...
//! let leader = cluster.leader("/", "payments").await?.expect("a quorum queue");
//! cluster.kill(leader).await?;                // SIGKILL, like a machine lost
//! cluster.restart(leader).await?;             // back, rejoins with its data
//! # Ok(()) }
//! ```
//!
//! [`Cluster::builder`] starts other shapes: one node, or nodes with settings the
//! machine's broker must not get (`consumer_timeout` is a node setting on 3.10):
//!
//! ```no_run
//! # async fn example() -> Result<(), idemq::testing::ClusterError> {
//! let node = idemq::testing::Cluster::builder()
//!     .nodes(1)
//!     .conf("consumer_timeout = 5000")
//!     .rabbit_env("channel_tick_interval", "1000") // channels check it on their tick
//!     .start()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! This module holds the cluster's API (the types, what a test asks of the nodes);
//! `node` runs the processes: the watchdog and its lock, each node's files, its
//! launch and start-up wait, `rabbitmqctl`, finding and killing its processes.

mod node;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use node::{
    await_startup, ctl, io, kill_node, launch, node_pids, prepare_dir, remove_stale, start_watchdog, BASE,
    PREFIX,
};

/// What went wrong starting, stopping or asking the cluster.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A file or process operation failed (the I/O error is the source).
    #[error("{action}")]
    Io {
        /// What was being done.
        action: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A RabbitMQ command failed; its output says why.
    #[error("`{command}` failed: {output}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed.
        output: String,
    },
    /// A port a node needs is taken by something the kit did not start (another
    /// broker, a cluster started by hand).
    #[error(
        "port {port} on 127.0.0.1 (node {node}) is in use by something the kit did not start; stop it (`ss -ltnp 'sport = :{port}'` shows what)"
    )]
    PortInUse {
        /// The port.
        port: u16,
        /// The node that needs it.
        node: String,
    },
    /// A node did not start or stop in time.
    #[error("node {node} did not {what} within {timeout:?}")]
    Timeout {
        /// The node's name.
        node: String,
        /// `start` or `stop`.
        what: &'static str,
        /// How long was waited.
        timeout: Duration,
    },
}

/// The first node's AMQP port; node i listens on `FIRST_PORT + i` and distributes
/// on `20000 + FIRST_PORT + i`.
const FIRST_PORT: u16 = 5701;
/// The first node's TLS port (with [`ClusterBuilder::tls`]); node i listens on
/// `FIRST_TLS_PORT + i` (no distribution port is derived from it).
const FIRST_TLS_PORT: u16 = 5801;

/// One node of a [`Cluster`].
#[derive(Debug, Clone)]
pub struct ClusterNode {
    name: String,
    port: u16,
    tls_port: u16,
    dir: PathBuf,
}

impl ClusterNode {
    /// Its Erlang node name, e.g. `idemq-kit-a@localhost` (for `rabbitmqctl -n`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its AMQP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/<vhost>`.
    pub fn amqp_url(&self, vhost: &str) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/{}", self.port, encode_vhost(vhost))
    }

    /// Its TLS port on 127.0.0.1 (listening with [`ClusterBuilder::tls`] only).
    pub fn tls_port(&self) -> u16 {
        self.tls_port
    }

    /// `amqps://guest:guest@localhost:<tls port>/<vhost>` (by name: the kit's server
    /// certificate is for `localhost`). Add `?cacertfile=…` and the rest as the test
    /// needs.
    pub fn amqps_url(&self, vhost: &str) -> String {
        format!("amqps://guest:guest@localhost:{}/{}", self.tls_port, encode_vhost(vhost))
    }

    fn dist_port(&self) -> u16 {
        self.port + 20000
    }
}

/// A private RabbitMQ cluster on this host, beside the machine's broker: its own
/// node names, ports and data, one cluster per host at a time (a lock), torn down
/// when dropped or when the process that started it ends. Start one with
/// [`Cluster::start`] or [`Cluster::builder`].
#[derive(Debug)]
pub struct Cluster {
    nodes: Vec<ClusterNode>,
    /// Holds the host's lock while this process lives, then tears down.
    watchdog: std::process::Child,
}

impl Cluster {
    /// Starts a 3-node cluster.
    ///
    /// # Errors
    /// A node does not start (its log is under `/tmp/idemq-kit-cluster/<letter>/log`)
    /// or does not join.
    pub async fn start() -> Result<Self, ClusterError> {
        Self::builder().start().await
    }

    /// Starts an `n`-node cluster (1 ≤ n ≤ 26).
    ///
    /// # Errors
    /// As [`Cluster::start`].
    pub async fn start_nodes(n: usize) -> Result<Self, ClusterError> {
        Self::builder().nodes(n).start().await
    }

    /// A cluster of another shape: node count, extra node configuration.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder { nodes: 3, conf: Vec::new(), rabbit: Vec::new(), tls: None }
    }

    async fn start_with(options: ClusterBuilder) -> Result<Self, ClusterError> {
        let n = options.nodes.clamp(1, 26);
        let nodes: Vec<ClusterNode> = (0..n)
            .map(|i| {
                let letter = char::from(b'a' + u8::try_from(i).unwrap_or(0));
                ClusterNode {
                    name: format!("{PREFIX}{letter}@localhost"),
                    port: FIRST_PORT + u16::try_from(i).unwrap_or(0),
                    tls_port: FIRST_TLS_PORT + u16::try_from(i).unwrap_or(0),
                    dir: Path::new(BASE).join(letter.to_string()),
                }
            })
            .collect();
        let watchdog = tokio::task::spawn_blocking(start_watchdog)
            .await
            .map_err(|err| io("wait for the cluster lock", std::io::Error::other(err)))??;
        // From here on, an error drops the cluster: its nodes go, and the lock with
        // the watchdog (a start that fails may be tried again in this process).
        let cluster = Self { nodes, watchdog };
        remove_stale().await?;
        for node in &cluster.nodes {
            let tls_port = options.tls.as_ref().map(|_| node.tls_port);
            for port in [Some(node.port), Some(node.dist_port()), tls_port].into_iter().flatten() {
                await_port_free(port, &node.name).await?;
            }
        }
        for node in &cluster.nodes {
            prepare_dir(node, &options)?;
            launch(node).await?;
        }
        for node in &cluster.nodes {
            await_startup(node).await?;
        }
        let first = cluster.nodes[0].name.clone();
        for node in &cluster.nodes[1..] {
            ctl(&node.name, &["stop_app"]).await?;
            ctl(&node.name, &["join_cluster", &first]).await?;
            ctl(&node.name, &["start_app"]).await?;
            await_startup(node).await?;
        }
        tracing::info!(nodes = cluster.nodes.len(), "private RabbitMQ cluster up");
        Ok(cluster)
    }

    /// The nodes, in order.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// Every node's URL for `vhost`, comma-separated (an `AMQP_URL` list), in order.
    pub fn amqp_urls(&self, vhost: &str) -> String {
        self.amqp_urls_from(0, vhost)
    }

    /// [`Cluster::amqp_urls`] starting at node `first` (then round the ring): give
    /// each process a different first node to spread connections.
    pub fn amqp_urls_from(&self, first: usize, vhost: &str) -> String {
        (0..self.nodes.len())
            .map(|i| self.nodes[(first + i) % self.nodes.len()].amqp_url(vhost))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Runs `rabbitmqctl args…` against the first node that is up; its stdout.
    ///
    /// # Errors
    /// [`ClusterError::Command`] when every node refuses.
    pub async fn ctl(&self, args: &[&str]) -> Result<String, ClusterError> {
        let mut last = None;
        for node in &self.nodes {
            if node_pids(&node.name).is_empty() {
                continue;
            }
            match ctl(&node.name, args).await {
                Ok(out) => return Ok(out),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| ClusterError::Command {
            command: format!("rabbitmqctl {}", args.join(" ")),
            output: "no node of the cluster is running".into(),
        }))
    }

    /// Creates `vhost` with every permission for `guest`.
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn add_vhost(&self, vhost: &str) -> Result<(), ClusterError> {
        self.ctl(&["add_vhost", vhost]).await?;
        self.ctl(&["set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"]).await?;
        Ok(())
    }

    /// Deletes `vhost` and everything in it.
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn delete_vhost(&self, vhost: &str) -> Result<(), ClusterError> {
        self.ctl(&["delete_vhost", vhost]).await.map(drop)
    }

    /// The index of the node that leads quorum queue `queue` in `vhost` (`None` if
    /// the queue has no leader now, or is not there).
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn leader(&self, vhost: &str, queue: &str) -> Result<Option<usize>, ClusterError> {
        let leader = self.queue_info(vhost, queue, "leader").await?;
        Ok(leader.and_then(|leader| self.nodes.iter().position(|node| node.name == leader)))
    }

    /// The members (replicas) of quorum queue `queue` in `vhost`, as node indexes.
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn members(&self, vhost: &str, queue: &str) -> Result<Vec<usize>, ClusterError> {
        let members = self.queue_info(vhost, queue, "members").await?.unwrap_or_default();
        Ok((0..self.nodes.len()).filter(|&i| members.contains(&self.nodes[i].name)).collect())
    }

    /// Messages of `queue` in `vhost` not yet settled: ready plus delivered and
    /// unacked (`None` if the queue is not there or does not answer).
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn unsettled(&self, vhost: &str, queue: &str) -> Result<Option<u64>, ClusterError> {
        Ok(self.queue_info(vhost, queue, "messages").await?.and_then(|messages| messages.parse().ok()))
    }

    /// One `rabbitmqctl list_queues` column of `queue` in `vhost`.
    async fn queue_info(&self, vhost: &str, queue: &str, item: &str) -> Result<Option<String>, ClusterError> {
        let out = self.ctl(&["-q", "list_queues", "-p", vhost, "--no-table-headers", "name", item]).await?;
        Ok(out
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .find(|(name, _)| *name == queue)
            .map(|(_, value)| value.trim().to_owned()))
    }

    /// How many client connections to `vhost` node `index` holds.
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn connections_on(&self, index: usize, vhost: &str) -> Result<usize, ClusterError> {
        Ok(self.connections(vhost).await?.iter().filter(|(node, _)| *node == index).count())
    }

    /// Every client connection to `vhost`: the node it is on and its name (the
    /// `connection_name` client property, empty without one; idemq's are
    /// `idemq <role> (pid <pid>)`).
    ///
    /// # Errors
    /// As [`Cluster::ctl`].
    pub async fn connections(&self, vhost: &str) -> Result<Vec<(usize, String)>, ClusterError> {
        let out = self
            .ctl(&["-q", "list_connections", "--no-table-headers", "port", "vhost", "client_properties"])
            .await?;
        Ok(out
            .lines()
            .filter_map(|line| {
                let mut columns = line.splitn(3, '\t');
                let (port, in_vhost, properties) =
                    (columns.next()?, columns.next()?, columns.next().unwrap_or(""));
                let node = self.nodes.iter().position(|node| node.port.to_string() == port.trim())?;
                let name = properties
                    .split_once("{\"connection_name\",\"")
                    .and_then(|(_, rest)| rest.split_once('"'))
                    .map_or_else(String::new, |(name, _)| name.to_owned());
                (in_vhost.trim() == vhost).then_some((node, name))
            })
            .collect())
    }

    /// Whether node `index`'s process is running.
    pub fn is_running(&self, index: usize) -> bool {
        !node_pids(&self.nodes[index].name).is_empty()
    }

    /// SIGKILLs node `index` (a machine lost: no goodbye to clients or peers) and
    /// waits until its process is gone.
    ///
    /// # Errors
    /// [`ClusterError::Timeout`] if it does not die within 10 s.
    pub async fn kill(&self, index: usize) -> Result<(), ClusterError> {
        let node = &self.nodes[index];
        kill_node(&node.name);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !node_pids(&node.name).is_empty() {
            if Instant::now() > deadline {
                return Err(ClusterError::Timeout {
                    node: node.name.clone(),
                    what: "stop",
                    timeout: Duration::from_secs(10),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!(node = %node.name, "node killed");
        Ok(())
    }

    /// Starts node `index` again (it rejoins the cluster with its data) and waits
    /// until it is up. Nothing happens if it is running.
    ///
    /// # Errors
    /// As [`Cluster::start`].
    pub async fn restart(&self, index: usize) -> Result<(), ClusterError> {
        let node = &self.nodes[index];
        if node_pids(&node.name).is_empty() {
            launch(node).await?;
        }
        await_startup(node).await?;
        tracing::info!(node = %node.name, "node back");
        Ok(())
    }

    /// Restarts every node that is not running (after a test that failed midway).
    ///
    /// # Errors
    /// As [`Cluster::restart`].
    pub async fn heal(&self) -> Result<(), ClusterError> {
        for index in 0..self.nodes.len() {
            if !self.is_running(index) {
                self.restart(index).await?;
            }
        }
        Ok(())
    }
}

/// How to start a [`Cluster`] (from [`Cluster::builder`]): how many nodes, and what
/// every node's configuration adds to the kit's own (its listener, `guest` from
/// loopback).
#[derive(Debug, Clone)]
#[must_use = "a builder starts nothing until `.start()`"]
pub struct ClusterBuilder {
    nodes: usize,
    conf: Vec<String>,
    rabbit: Vec<(String, String)>,
    tls: Option<Tls>,
}

/// A TLS listener's settings (Erlang terms for `advanced.config`).
#[derive(Debug, Clone)]
struct Tls {
    ca: String,
    identity: (String, String),
    /// SNI name → (certificate, key) shown instead.
    sni: Vec<(String, (String, String))>,
    require_client_certificates: bool,
}

impl ClusterBuilder {
    /// `n` nodes, 1 ≤ n ≤ 26 (default 3): `1` is a single private node, for node
    /// settings the machine's broker must not get.
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = n;
        self
    }

    /// A line of every node's `rabbitmq.conf`, after the kit's own, e.g.
    /// `consumer_timeout = 5000`.
    pub fn conf(mut self, line: impl Into<String>) -> Self {
        self.conf.push(line.into());
        self
    }

    /// A setting of the `rabbit` application that `rabbitmq.conf` has no key for,
    /// written to every node's `advanced.config` as `{key, value}` (`value` an
    /// Erlang term), e.g. `("channel_tick_interval", "1000")`: a channel checks its
    /// deliveries against `consumer_timeout` on each tick, every 60 s by default.
    pub fn rabbit_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.rabbit.push((key.into(), value.into()));
        self
    }

    /// A TLS listener on every node ([`ClusterNode::tls_port`], beside the plain one)
    /// with `certs`' CA and its `localhost` server certificate; a client that asks
    /// for `expired.localhost` (`server_name_indication=`) is shown
    /// [`TestCertificates::expired`](super::TestCertificates::expired) instead. Client certificates are verified when
    /// given (`verify_peer`) and optional unless
    /// [`require_client_certificates`](Self::require_client_certificates).
    #[cfg(feature = "testing")]
    pub fn tls(mut self, certs: &super::TestCertificates) -> Self {
        let pair =
            |key: &super::CertifiedKey| (key.cert().display().to_string(), key.key().display().to_string());
        self.tls = Some(Tls {
            ca: certs.ca().display().to_string(),
            identity: pair(certs.server()),
            sni: vec![("expired.localhost".to_owned(), pair(certs.expired()))],
            require_client_certificates: false,
        });
        self
    }

    /// With [`tls`](Self::tls): a client without a certificate signed by the CA is
    /// refused in the handshake (`fail_if_no_peer_cert`).
    #[cfg(feature = "testing")]
    pub fn require_client_certificates(mut self) -> Self {
        if let Some(tls) = &mut self.tls {
            tls.require_client_certificates = true;
        }
        self
    }

    /// Starts the nodes and joins them into one cluster.
    ///
    /// # Errors
    /// As [`Cluster::start`].
    pub async fn start(self) -> Result<Cluster, ClusterError> {
        Cluster::start_with(self).await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &self.nodes {
            kill_node(&node.name);
        }
        let _ = std::fs::remove_dir_all(BASE);
        // The watchdog's process group (`flock` and its shell): the lock is free.
        let _ = std::process::Command::new("kill")
            .args(["-9", "--", &format!("-{}", self.watchdog.id())])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.watchdog.wait();
    }
}

/// Waits until `port` can be bound on 127.0.0.1. A node killed by the cluster
/// before this one (a test's earlier shape, a stale run) may still hold its ports
/// for a moment after its pid is gone from view: SIGKILL tears a VM of dozens of
/// threads down one thread at a time, and its sockets close with the last one.
/// Anything still listening after [`PORT_WAIT`] was not started by the kit.
async fn await_port_free(port: u16, node: &str) -> Result<(), ClusterError> {
    let deadline = Instant::now() + PORT_WAIT;
    while std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
        if Instant::now() >= deadline {
            return Err(ClusterError::PortInUse { port, node: node.to_owned() });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// How long a port a node needs may stay taken before it is reported in use.
const PORT_WAIT: Duration = Duration::from_secs(15);

/// A vhost in a URL path: `/` is `%2f`.
fn encode_vhost(vhost: &str) -> String {
    url::form_urlencoded::byte_serialize(vhost.as_bytes()).collect::<String>().replace('+', "%20")
}
