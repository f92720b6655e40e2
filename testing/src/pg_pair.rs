//! A private PostgreSQL primary and a streaming standby on this host:
//! [`PostgresPair`], for tests of a database failover — the primary lost, its
//! standby promoted — with synchronous or asynchronous replication.
//!
//! The primary is made with `initdb`, the standby is a `pg_basebackup -R` of it
//! (`standby.signal`, and a `primary_conninfo` that names it `standby1` with
//! `application_name`). Each has its own port on 127.0.0.1 and its own data directory
//! in `/tmp/idemq-kit-pgpair-<pid>-<n>/{primary,standby}` (their logs beside them).
//! Both run as `postgres` when the tests run as root, as
//! [`PostgresServer`](super::PostgresServer) does (the server refuses root).
//!
//! Teardown is the cluster kit's: dropping the pair SIGKILLs every process of both
//! servers and removes their files; a watchdog process does the same as soon as the
//! process that started them is gone, however it ends; and the directories of a run
//! whose process and watchdog were both killed are removed by the next start.
//!
//! The servers run with `fsync = off`: the kit stages the loss of a server's
//! processes (SIGKILL), not of the machine's power, and the page cache outlives the
//! processes. What replication promises is unchanged by it: a synchronous COMMIT
//! still waits until the standby has received and written the WAL.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::cluster::ClusterError;
use super::host::{self, io};
use super::postgres::{append, binaries, chown, run_as_postgres};
use super::proxy::NetworkProxy;

/// Every pair's directory is `<BASE>-<pid>-<n>`.
const BASE: &str = "/tmp/idemq-kit-pgpair";
/// The standby's `application_name`, which `synchronous_standby_names` names.
const STANDBY_NAME: &str = "standby1";
/// How long `initdb`, a start-up and a base backup may take.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the kit waits for the standby to stream, to promote or to replay, and
/// for a `psql` to answer.
const WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long killed processes may take to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a wait asks again.
const POLL: Duration = Duration::from_millis(100);

/// How the primary acknowledges a COMMIT, for [`PostgresPair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names = 'standby1'` and `synchronous_commit = on`: a
    /// COMMIT returns once the standby has written its WAL to disk, so a promoted
    /// standby has every COMMIT the primary acknowledged (it may not have *replayed*
    /// it yet while still a standby: see [`PostgresPair::wait_for_standby`]).
    Synchronous,
    /// No synchronous standby: a COMMIT returns once the primary has it; the standby
    /// follows when it can, and a promotion loses what it had not received.
    Asynchronous,
}

/// A private PostgreSQL primary and a standby streaming from it, for failover
/// tests: [`kill_primary`](Self::kill_primary) loses the primary as a crash would
/// (SIGKILL of all its processes), [`promote_standby`](Self::promote_standby) makes
/// the standby the primary, as a failover manager would.
///
/// Both accept every user over TCP without a password (`trust`, as the machine's
/// server) and without TLS. "Primary" and "standby" name the roles the servers
/// started with: after a promotion the standby is the primary, and
/// [`url`](Self::url) finds it.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use idemq::testing::{PostgresPair, Replication};
///
/// let pair = PostgresPair::start(Replication::Synchronous).await?;
/// pair.create_database("app").await?;
/// // postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/app?target_session_attrs=read-write
/// let database_url = pair.url("app");
/// // ... run consumers with DATABASE_URL=database_url ...
/// pair.kill_primary().await?; // every process of the primary SIGKILLed
/// pair.promote_standby().await?; // read-write now; database_url reaches it
/// # Ok(()) }
/// ```
///
/// The standby's replication connection can go through a [`NetworkProxy`], for a
/// link that fails while both servers live
/// ([`PostgresPairBuilder::replication_through_proxy`]):
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use idemq::testing::{PostgresPair, Replication};
///
/// let pair = PostgresPair::builder()
///     .replication(Replication::Asynchronous)
///     .replication_through_proxy()
///     .start()
///     .await?;
/// let link = pair.replication_proxy().expect("asked for");
/// link.black_hole(); // the standby hears nothing more from the primary
/// // ... commits on the primary now are not on the standby ...
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PostgresPair {
    dir: PathBuf,
    bin: PathBuf,
    replication: Replication,
    primary: Node,
    standby: Node,
    /// Between the standby and the primary, when asked for.
    proxy: Option<NetworkProxy>,
    watchdog: std::process::Child,
}

/// How to start a [`PostgresPair`] (from [`PostgresPair::builder`]).
#[derive(Debug, Clone)]
#[must_use = "a builder starts nothing until `.start()`"]
pub struct PostgresPairBuilder {
    replication: Replication,
    through_proxy: bool,
}

/// One server of the pair.
#[derive(Debug)]
struct Node {
    /// `primary` or `standby`: its directory's name under the pair's.
    role: &'static str,
    port: u16,
    /// SIGKILLed by [`PostgresPair::kill_primary`]: its processes are gone, and its
    /// pid may be another process's now.
    killed: AtomicBool,
}

impl PostgresPairBuilder {
    /// Synchronous (the default) or asynchronous replication.
    pub fn replication(mut self, replication: Replication) -> Self {
        self.replication = replication;
        self
    }

    /// The standby reaches the primary through a [`NetworkProxy`] the pair starts
    /// (and holds: [`PostgresPair::replication_proxy`]) instead of directly: its base
    /// backup and its replication connection both cross it, so a test can
    /// black-hole or reset the link while both servers live. Clients still reach the
    /// primary directly.
    ///
    /// The proxy runs on the tokio runtime that starts the pair: keep the pair in
    /// that runtime (a `#[tokio::test]`'s own, not a `static` shared between tests).
    pub fn replication_through_proxy(mut self) -> Self {
        self.through_proxy = true;
        self
    }

    /// Starts the primary, then the standby from a base backup of it; returns once
    /// the primary sees the standby streaming (and, with synchronous replication, as
    /// its synchronous standby).
    ///
    /// # Errors
    /// No PostgreSQL binaries under `/usr/lib/postgresql`; `initdb`, `pg_ctl`,
    /// `pg_basebackup` or `psql` failed (their output, and a server's log, say why);
    /// the standby did not stream within a minute.
    ///
    /// # Cancel safety
    /// Cancel safe: a pair dropped half-made is torn down like any.
    pub async fn start(self) -> Result<PostgresPair, ClusterError> {
        PostgresPair::start_with(self).await
    }
}

impl PostgresPair {
    /// Starts a primary and a standby streaming from it with `replication`, as
    /// [`PostgresPairBuilder::start`] does.
    ///
    /// # Errors
    /// As [`PostgresPairBuilder::start`].
    pub async fn start(replication: Replication) -> Result<Self, ClusterError> {
        Self::builder().replication(replication).start().await
    }

    /// A pair of another shape: the replication, a proxy on the replication link.
    pub fn builder() -> PostgresPairBuilder {
        PostgresPairBuilder { replication: Replication::Synchronous, through_proxy: false }
    }

    async fn start_with(options: PostgresPairBuilder) -> Result<Self, ClusterError> {
        static N: AtomicU64 = AtomicU64::new(0);
        remove_stale();
        let bin = binaries()?;
        let dir =
            PathBuf::from(format!("{BASE}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| io(&format!("create {}", dir.display()), source))?;
        let [primary_port, standby_port] = free_ports()?;
        let watchdog = watchdog(&dir)?;
        // From here on a failure drops the pair: its processes killed, its files removed.
        let mut pair = Self {
            dir,
            bin,
            replication: options.replication,
            primary: Node::new("primary", primary_port),
            standby: Node::new("standby", standby_port),
            proxy: None,
            watchdog,
        };
        chown(&pair.dir)?;

        let primary_data = pair.data(&pair.primary);
        pair.run(&[
            &pair.program("initdb"),
            "-D",
            &primary_data,
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ])
        .await?;
        pair.configure_primary()?;
        pair.start_node(&pair.primary).await?;

        let replication_port = if options.through_proxy {
            let proxy = NetworkProxy::start(format!("127.0.0.1:{primary_port}"))
                .await
                .map_err(|source| io("start the proxy on the replication link", source))?;
            let port = proxy.address().port();
            pair.proxy = Some(proxy);
            port
        } else {
            primary_port
        };
        // `-R` writes `standby.signal` and a `primary_conninfo` of this connection's
        // parameters, `application_name` included.
        let standby_data = pair.data(&pair.standby);
        pair.run(&[
            &pair.program("pg_basebackup"),
            "-R",
            "-D",
            &standby_data,
            "-d",
            &format!("host=127.0.0.1 port={replication_port} user=postgres application_name={STANDBY_NAME}"),
            "--checkpoint=fast",
            "--wal-method=stream",
            "--no-sync",
        ])
        .await?;
        // The copied configuration is the primary's: a later line wins.
        append(
            &pair.dir.join("standby/postgresql.conf"),
            &format!("\n# idemq test kit: the standby\nport = {standby_port}\n"),
        )?;
        pair.start_node(&pair.standby).await?;

        if pair.replication == Replication::Synchronous {
            // On both servers, as a failover manager's shared configuration would
            // have it: the standby's is what `promote_standby` must clear.
            for node in [&pair.primary, &pair.standby] {
                pair.psql(
                    node,
                    &[
                        &format!("ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"),
                        "ALTER SYSTEM SET synchronous_commit = 'on'",
                        "SELECT pg_reload_conf()",
                    ],
                )
                .await?;
            }
        }
        pair.await_streaming().await?;
        tracing::info!(
            primary = primary_port,
            standby = standby_port,
            replication = ?pair.replication,
            through_proxy = pair.proxy.is_some(),
            "private PostgreSQL primary and standby up"
        );
        Ok(pair)
    }

    /// The replication it was started with.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The proxy between the standby and the primary, with
    /// [`PostgresPairBuilder::replication_through_proxy`].
    pub fn replication_proxy(&self) -> Option<&NetworkProxy> {
        self.proxy.as_ref()
    }

    /// The port of the server started as the primary, on 127.0.0.1.
    pub fn primary_port(&self) -> u16 {
        self.primary.port
    }

    /// The port of the server started as the standby, on 127.0.0.1.
    pub fn standby_port(&self) -> u16 {
        self.standby.port
    }

    /// libpq's multi-host URL of `database` on both servers, which connects to
    /// whichever is read-write:
    /// `postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/<database>?target_session_attrs=read-write`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// `postgres://postgres@127.0.0.1:<primary>/<database>`.
    pub fn primary_url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.primary.port)
    }

    /// `postgres://postgres@127.0.0.1:<standby>/<database>` (read-only until
    /// promoted).
    pub fn standby_url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.standby.port)
    }

    /// Creates `database` on the primary (`template0`, so that concurrent creations
    /// never find the template in use). The standby has it once it has replayed the
    /// creation ([`wait_for_standby`](Self::wait_for_standby)).
    ///
    /// # Errors
    /// The primary refused it (it exists, the primary is gone).
    ///
    /// # Cancel safety
    /// Not cancel safe: the database may be created or not.
    pub async fn create_database(&self, database: &str) -> Result<(), ClusterError> {
        let name = database.replace('"', "\"\"");
        self.psql(&self.primary, &[&format!("CREATE DATABASE \"{name}\" TEMPLATE template0")]).await?;
        Ok(())
    }

    /// Waits until the standby has replayed everything the primary had written when
    /// called: what was committed is then visible on the standby.
    ///
    /// # Errors
    /// [`ClusterError::Timeout`] after a minute (a replication link black-holed, the
    /// primary killed); a `psql` that failed.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn wait_for_standby(&self) -> Result<(), ClusterError> {
        let written = self.psql(&self.primary, &["SELECT pg_current_wal_lsn()"]).await?;
        let replayed = &format!("SELECT pg_last_wal_replay_lsn() >= '{written}'::pg_lsn");
        self.wait(&self.standby, "replay the primary's WAL", move || async move {
            Ok(self.psql(&self.standby, &[replayed]).await? == "t")
        })
        .await
    }

    /// Loses the primary as a crash would: SIGKILL to its postmaster and every
    /// process it started at once (no shutdown checkpoint, no goodbye to its clients:
    /// their connections are reset), and returns once they are all gone. Its data
    /// directory stays, as a crashed machine's disk would.
    ///
    /// # Errors
    /// The processes could not be listed or killed, or outlived the kill.
    ///
    /// # Cancel safety
    /// Cancel safe: the kill is sent before the first await; only the wait is lost.
    pub async fn kill_primary(&self) -> Result<(), ClusterError> {
        let Some(postmaster) = postmaster_pid(&self.dir.join(self.primary.role)) else {
            return Err(ClusterError::Command {
                command: "find the primary's postmaster".into(),
                output: "no postmaster.pid: the primary is not running".into(),
            });
        };
        self.primary.killed.store(true, Ordering::SeqCst);
        kill_all(postmaster)?;
        let deadline = Instant::now() + KILL_TIMEOUT;
        while !server_processes(postmaster).is_empty() {
            if Instant::now() > deadline {
                return Err(ClusterError::Timeout {
                    node: self.describe(&self.primary),
                    what: "die after SIGKILL",
                    timeout: KILL_TIMEOUT,
                });
            }
            tokio::time::sleep(POLL).await;
        }
        tracing::info!(port = self.primary.port, "private PostgreSQL primary killed");
        Ok(())
    }

    /// Promotes the standby (`pg_ctl promote`), waits until it is out of recovery
    /// (read-write), then clears its `synchronous_standby_names` (`ALTER SYSTEM
    /// RESET` and a reload), as a failover manager does: with it set, the promoted
    /// server's commits would wait for ever for a standby it does not have.
    ///
    /// Promoting while the primary still runs makes two primaries (a split brain),
    /// and [`url`](Self::url) still reaches the old one, listed first.
    ///
    /// # Errors
    /// `pg_ctl` or `psql` failed; [`ClusterError::Timeout`] if it stays in recovery
    /// for a minute.
    ///
    /// # Cancel safety
    /// Not cancel safe: the standby may be promoted with its
    /// `synchronous_standby_names` still set.
    pub async fn promote_standby(&self) -> Result<(), ClusterError> {
        let data = self.data(&self.standby);
        let timeout = WAIT_TIMEOUT.as_secs().to_string();
        self.run(&[&self.program("pg_ctl"), "promote", "-w", "-t", &timeout, "-D", &data]).await?;
        self.wait(&self.standby, "leave recovery", move || async move {
            Ok(self.psql(&self.standby, &["SELECT pg_is_in_recovery()"]).await? == "f")
        })
        .await?;
        self.psql(
            &self.standby,
            &["ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()"],
        )
        .await?;
        // The reload is asynchronous; a new session reads the file as it is then.
        self.wait(&self.standby, "clear synchronous_standby_names", move || async move {
            Ok(self.psql(&self.standby, &["SHOW synchronous_standby_names"]).await?.is_empty())
        })
        .await?;
        tracing::info!(port = self.standby.port, "private PostgreSQL standby promoted");
        Ok(())
    }

    /// Tears the pair down now, as dropping it does.
    pub fn stop(self) {}

    /// Appends the primary's settings to its configuration, and writes its
    /// `pg_hba.conf`: every user and replication over loopback TCP, `trust`.
    fn configure_primary(&self) -> Result<(), ClusterError> {
        let data = self.dir.join(self.primary.role);
        let conf = format!(
            "\n# idemq test kit: the primary\nlisten_addresses = '127.0.0.1'\nport = {}\n\
             unix_socket_directories = '{}'\nwal_level = replica\nmax_wal_senders = 10\n\
             wal_keep_size = 256MB\nhot_standby = on\nfsync = off\nshared_buffers = 32MB\n\
             max_connections = 100\n",
            self.primary.port,
            self.dir.display()
        );
        append(&data.join("postgresql.conf"), &conf)?;
        let hba = "local all all trust\n\
                   host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n\
                   host replication all 127.0.0.1/32 trust\nhost replication all ::1/128 trust\n";
        std::fs::write(data.join("pg_hba.conf"), hba).map_err(|source| io("write pg_hba.conf", source))?;
        chown(&data)
    }

    /// Starts `node` (`pg_ctl start -w`); its log is `<dir>/<role>.log`.
    async fn start_node(&self, node: &Node) -> Result<(), ClusterError> {
        let log = self.dir.join(format!("{}.log", node.role)).display().to_string();
        self.run(&[
            &self.program("pg_ctl"),
            "start",
            "-w",
            "-t",
            &START_TIMEOUT.as_secs().to_string(),
            "-D",
            &self.data(node),
            "-l",
            &log,
        ])
        .await
        .map_err(|err| match err {
            ClusterError::Command { command, output } => ClusterError::Command {
                command,
                output: format!("{output}\n{}", std::fs::read_to_string(&log).unwrap_or_default()),
            },
            other => other,
        })
    }

    /// Waits until the primary's `pg_stat_replication` shows the standby streaming,
    /// as its synchronous standby if so asked.
    async fn await_streaming(&self) -> Result<(), ClusterError> {
        let state = &format!(
            "SELECT state || ' ' || sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY_NAME}'"
        );
        let wanted = match self.replication {
            Replication::Synchronous => "streaming sync",
            Replication::Asynchronous => "streaming async",
        };
        self.wait(&self.standby, "stream from the primary", move || async move {
            Ok(self.psql(&self.primary, &[state]).await?.lines().any(|line| line == wanted))
        })
        .await
    }

    /// Polls `done` until it holds, for [`WAIT_TIMEOUT`]; a timeout says that `node`
    /// did not do `what`.
    async fn wait<F, Fut>(&self, node: &Node, what: &'static str, mut done: F) -> Result<(), ClusterError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, ClusterError>>,
    {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        loop {
            // A server may refuse a moment (starting up, promoting): ask again.
            let last = done().await;
            if matches!(last, Ok(true)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(match last {
                    Err(err) => err,
                    Ok(_) => ClusterError::Timeout { node: self.describe(node), what, timeout: WAIT_TIMEOUT },
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Runs `statements` on `node`'s `postgres` database, each in a transaction of
    /// its own (`ALTER SYSTEM` and `CREATE DATABASE` refuse a block), and returns
    /// what they printed, unaligned and without headers, trimmed.
    async fn psql(&self, node: &Node, statements: &[&str]) -> Result<String, ClusterError> {
        let port = node.port.to_string();
        let mut args = vec![
            "-X",
            "-A",
            "-t",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-p",
            port.as_str(),
            "-U",
        ];
        args.extend(["postgres", "-d", "postgres"]);
        for statement in statements {
            args.extend(["-c", *statement]);
        }
        let psql = self.program("psql");
        let command = || format!("psql -p {port} -c {}", statements.join(" -c "));
        let run = Command::new(&psql)
            .args(&args)
            .env("PGCONNECT_TIMEOUT", "5")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(WAIT_TIMEOUT, run)
            .await
            .map_err(|_| ClusterError::Command {
                command: command(),
                output: "no answer within a minute".into(),
            })?
            .map_err(|source| io("run psql", source))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
        } else {
            Err(ClusterError::Command {
                command: command(),
                output: String::from_utf8_lossy(&output.stderr).into(),
            })
        }
    }

    /// Runs a PostgreSQL program as `postgres` (when we are root).
    async fn run(&self, args: &[&str]) -> Result<(), ClusterError> {
        run_as_postgres(&self.dir, args).await
    }

    fn program(&self, name: &str) -> String {
        self.bin.join(name).display().to_string()
    }

    fn data(&self, node: &Node) -> String {
        self.dir.join(node.role).display().to_string()
    }

    /// `node`, for a timeout's message.
    fn describe(&self, node: &Node) -> String {
        format!("the {} (127.0.0.1:{})", node.role, node.port)
    }
}

impl Drop for PostgresPair {
    fn drop(&mut self) {
        let mut postmasters = Vec::new();
        for node in [&self.primary, &self.standby] {
            // A killed node's pid may be someone else's by now.
            if node.killed.load(Ordering::SeqCst) {
                continue;
            }
            if let Some(postmaster) = postmaster_pid(&self.dir.join(node.role)) {
                let _ = kill_all(postmaster);
                postmasters.push(postmaster);
            }
        }
        let deadline = Instant::now() + KILL_TIMEOUT;
        while postmasters.iter().any(|pid| !server_processes(*pid).is_empty()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::process::Command::new("kill")
            .args(["-9", "--", &format!("-{}", self.watchdog.id())])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.watchdog.wait();
    }
}

impl Node {
    fn new(role: &'static str, port: u16) -> Self {
        Self { role, port, killed: AtomicBool::new(false) }
    }
}

/// The pid in `data`'s `postmaster.pid`, if there is one.
fn postmaster_pid(data: &Path) -> Option<u32> {
    std::fs::read_to_string(data.join("postmaster.pid")).ok()?.lines().next()?.trim().parse().ok()
}

/// The live processes of the server whose postmaster is (or was) `postmaster`:
/// the postmaster, its children, and whatever is left of its session (`pg_ctl`
/// starts it as a session leader, so orphaned children keep its session id). Only
/// processes named `postgres` count: a pid read from a stale file may be another
/// program's by now.
fn server_processes(postmaster: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            // `pid (comm) state ppid pgrp session …`; comm may hold spaces and `)`.
            let Some((head, rest)) = stat.rsplit_once(')') else { return false };
            let comm = head.split_once('(').map_or("", |(_, comm)| comm);
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let related =
                |field: usize| fields.get(field).and_then(|v| v.parse::<u32>().ok()) == Some(postmaster);
            comm == "postgres"
                && fields.first() != Some(&"Z")
                && (pid == postmaster || related(1) || related(3))
        })
        .collect()
}

/// SIGKILLs every process of the server whose postmaster is `postmaster`, at once.
fn kill_all(postmaster: u32) -> Result<(), ClusterError> {
    let pids: Vec<String> = server_processes(postmaster).iter().map(u32::to_string).collect();
    if pids.is_empty() {
        return Ok(());
    }
    // Some may have ended meanwhile: `kill` then fails for them alone.
    std::process::Command::new("kill")
        .arg("-9")
        .args(&pids)
        .stderr(std::process::Stdio::null())
        .status()
        .map(drop)
        .map_err(|source| io("kill a PostgreSQL server's processes", source))
}

/// A process of its own (it outlives ours) that waits for this process to end, then
/// kills both servers' processes (as [`server_processes`] finds them) and removes
/// their files.
fn watchdog(dir: &Path) -> Result<std::process::Child, ClusterError> {
    let dir = dir.display();
    let cleanup = format!(
        "for node in primary standby; do \
           pm=$(head -n1 {dir}/$node/postmaster.pid 2>/dev/null) && [ -n \"$pm\" ] && \
           ps -eo pid=,ppid=,sid=,stat=,comm= | \
           awk -v pm=\"$pm\" '$5 == \"postgres\" && $4 !~ /^Z/ && ($1 == pm || $2 == pm || $3 == pm) {{ print $1 }}' | \
           xargs -r kill -9; \
         done; sleep 1; rm -rf {dir}"
    );
    host::watchdog(&cleanup, "a PostgreSQL primary and standby")
}

/// Removes the directories of runs whose process is gone (their watchdog was killed
/// too, say) and kills what still runs there.
fn remove_stale() {
    for dir in host::stale_dirs(BASE) {
        for role in ["primary", "standby"] {
            if let Some(postmaster) = postmaster_pid(&dir.join(role)) {
                let _ = kill_all(postmaster);
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Two distinct free ports (both bound at once, then let go).
fn free_ports() -> Result<[u16; 2], ClusterError> {
    let bind = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| Ok((listener.local_addr()?.port(), listener)))
            .map_err(|source| io("find a free port", source))
    };
    let ((first, _a), (second, _b)) = (bind()?, bind()?);
    Ok([first, second])
}
