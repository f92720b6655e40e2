//! A private PostgreSQL server on this host, beside the machine's own:
//! [`PostgresServer`], for tests that need a server configured otherwise (TLS on,
//! client certificates required, a certificate that does not verify) or one they
//! may restart and stop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::process::Command;

use super::certs::{CertifiedKey, TestCertificates};
use super::cluster::ClusterError;
use super::host::{self, io, is_root};

/// Every server's directory is `<BASE>-<pid>-<n>`.
const BASE: &str = "/tmp/idemq-kit-pg";
/// How long `initdb` and start-up may take.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A private PostgreSQL server: its own data directory under `/tmp`, a free port on
/// 127.0.0.1, `trust` authentication for every user over TCP (as the machine's), and
/// — with [`PostgresServerBuilder::tls`] — `ssl = on` and **only** `hostssl` lines in
/// its `pg_hba.conf`: a client that does not encrypt is refused, so a test that
/// works proves TLS was used.
///
/// Stopped (immediately) and removed when dropped, or by a watchdog process when the
/// process that started it ends however it ends.
///
/// ```no_run
/// # async fn example() -> Result<(), idemq::testing::ClusterError> {
/// use idemq::testing::{PostgresServer, TestCertificates};
/// let certs = TestCertificates::generate()?;
/// let server = PostgresServer::builder().tls(&certs).start().await?;
/// let url = format!(
///     "{}?sslmode=verify-full&sslrootcert={}",
///     server.url("postgres"),
///     certs.ca().display()
/// );
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PostgresServer {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    watchdog: std::process::Child,
}

/// How to start a [`PostgresServer`] (from [`PostgresServer::builder`]).
#[derive(Debug, Clone, Default)]
#[must_use = "a builder starts nothing until `.start()`"]
pub struct PostgresServerBuilder {
    tls: Option<Tls>,
}

#[derive(Debug, Clone)]
struct Tls {
    ca: PathBuf,
    identity: CertifiedKey,
    client_certificates: bool,
}

impl PostgresServerBuilder {
    /// TLS on, with `certs`' CA and its `localhost` server certificate; only TLS
    /// connections are accepted.
    pub fn tls(mut self, certs: &TestCertificates) -> Self {
        self.tls = Some(Tls {
            ca: certs.ca().to_owned(),
            identity: certs.server().clone(),
            client_certificates: false,
        });
        self
    }

    /// The certificate the server shows (after [`tls`](Self::tls)), e.g.
    /// [`TestCertificates::expired`].
    pub fn server_identity(mut self, identity: &CertifiedKey) -> Self {
        if let Some(tls) = &mut self.tls {
            tls.identity = identity.clone();
        }
        self
    }

    /// Every connection must show a client certificate signed by the CA whose common
    /// name is its user (`clientcert=verify-full`), after [`tls`](Self::tls).
    pub fn require_client_certificates(mut self) -> Self {
        if let Some(tls) = &mut self.tls {
            tls.client_certificates = true;
        }
        self
    }

    /// Runs `initdb` and starts the server; returns once it accepts connections.
    ///
    /// # Errors
    /// No PostgreSQL binaries under `/usr/lib/postgresql`, or `initdb`/`pg_ctl`
    /// failed (their output says why).
    pub async fn start(self) -> Result<PostgresServer, ClusterError> {
        PostgresServer::start_with(self).await
    }
}

impl PostgresServer {
    /// A server of another shape: TLS, client certificates.
    pub fn builder() -> PostgresServerBuilder {
        PostgresServerBuilder::default()
    }

    async fn start_with(options: PostgresServerBuilder) -> Result<Self, ClusterError> {
        static N: AtomicU64 = AtomicU64::new(0);
        remove_stale();
        let bin = binaries()?;
        let dir =
            PathBuf::from(format!("{BASE}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| io(&format!("create {}", dir.display()), source))?;
        let port = free_port()?;
        let watchdog = watchdog(&dir, &bin)?;
        // From here on a failure drops the server: stopped, its files removed.
        let server = Self { dir, bin, port, watchdog };
        chown(&server.dir)?;
        server
            .run(&[
                &server.bin.join("initdb").display().to_string(),
                "-D",
                &server.data(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ])
            .await?;
        server.configure(&options)?;
        server.pg_ctl(&["start", "-w", "-t", &START_TIMEOUT.as_secs().to_string()]).await?;
        tracing::info!(port = server.port, tls = options.tls.is_some(), "private PostgreSQL server up");
        Ok(server)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@localhost:<port>/<database>` (by name: the server
    /// certificate is for `localhost`). Add `?sslmode=…` as the test needs.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@localhost:{}/{database}", self.port)
    }

    /// Restarts the server as an operator would (`pg_ctl restart`, fast shutdown:
    /// every session is ended, then it comes back on the same port with the same
    /// data), or starts it again after [`stop`](Self::stop); returns once it accepts
    /// connections.
    ///
    /// # Errors
    /// `pg_ctl` failed (its output and the server's log say why).
    ///
    /// # Cancel safety
    /// Not cancel safe: the server may be down, or up again.
    pub async fn restart(&self) -> Result<(), ClusterError> {
        self.pg_ctl(&["restart", "-m", "fast", "-w", "-t", &START_TIMEOUT.as_secs().to_string()]).await
    }

    /// Stops the server (`pg_ctl stop`, fast shutdown: every session is ended) and
    /// keeps its data: [`restart`](Self::restart) starts it again. Dropping the
    /// server, stopped or not, removes it.
    ///
    /// # Errors
    /// `pg_ctl` failed (its output and the server's log say why).
    ///
    /// # Cancel safety
    /// Not cancel safe: the server may be stopping.
    pub async fn stop(&self) -> Result<(), ClusterError> {
        self.pg_ctl(&["stop", "-m", "fast", "-w"]).await
    }

    /// `pg_ctl <args> -D <data> -l <log>`; a failure's output holds the server's log.
    async fn pg_ctl(&self, args: &[&str]) -> Result<(), ClusterError> {
        let pg_ctl = self.bin.join("pg_ctl").display().to_string();
        let (data, log) = (self.data(), self.log());
        let mut command = vec![pg_ctl.as_str()];
        command.extend_from_slice(args);
        // The log file, not our pipe: a server holding pg_ctl's stdout open would
        // keep the wait for its output from ever ending.
        command.extend_from_slice(&["-D", &data, "-l", &log]);
        self.run(&command).await.map_err(|err| with_log(err, &log))
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn log(&self) -> String {
        self.dir.join("log").display().to_string()
    }

    fn configure(&self, options: &PostgresServerBuilder) -> Result<(), ClusterError> {
        let data = self.dir.join("data");
        let mut conf = format!(
            "\n# idemq test kit\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nshared_buffers = 32MB\nmax_connections = 100\n",
            self.port,
            self.dir.display()
        );
        let mut hba = "local all all trust\n".to_owned();
        match &options.tls {
            None => hba.push_str("host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n"),
            Some(tls) => {
                copy(tls.identity.cert(), &data.join("server.crt"), 0o644)?;
                copy(tls.identity.key(), &data.join("server.key"), 0o600)?;
                copy(&tls.ca, &data.join("ca.crt"), 0o644)?;
                conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'ca.crt'\n");
                let client = if tls.client_certificates { " clientcert=verify-full" } else { "" };
                hba.push_str(&format!(
                    "hostssl all all 127.0.0.1/32 trust{client}\nhostssl all all ::1/128 trust{client}\n"
                ));
            }
        }
        append(&data.join("postgresql.conf"), &conf)?;
        std::fs::write(data.join("pg_hba.conf"), hba).map_err(|source| io("write pg_hba.conf", source))?;
        chown(&self.dir)
    }

    /// Runs a PostgreSQL program as `postgres` (when we are root).
    async fn run(&self, args: &[&str]) -> Result<(), ClusterError> {
        run_as_postgres(&self.dir, args).await
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let pg_ctl = self.bin.join("pg_ctl").display().to_string();
        let data = self.data();
        let _ = as_postgres(&[&pg_ctl, "stop", "-m", "immediate", "-w", "-D", &data])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::process::Command::new("kill")
            .args(["-9", "--", &format!("-{}", self.watchdog.id())])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.watchdog.wait();
    }
}

/// `err` with the server's log (at `log`) added to a failed command's output.
fn with_log(err: ClusterError, log: &str) -> ClusterError {
    match err {
        ClusterError::Command { command, output } => ClusterError::Command {
            command,
            output: format!("{output}\n{}", std::fs::read_to_string(log).unwrap_or_default()),
        },
        other => other,
    }
}

/// Runs `args` (a PostgreSQL program and its arguments) in `dir` as `postgres` (when
/// we are root), killed if the wait is dropped; its output is the error's.
pub(super) async fn run_as_postgres(dir: &Path, args: &[&str]) -> Result<(), ClusterError> {
    let output = Command::from(as_postgres(args))
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|source| io(&format!("run {}", args[0]), source))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(ClusterError::Command {
            command: args.join(" "),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }
}

/// `args` (a program and its arguments) as a command run as `postgres` when we are
/// root (the server refuses to run as root), as ourselves otherwise.
pub(super) fn as_postgres(args: &[&str]) -> std::process::Command {
    if is_root() {
        let mut command = std::process::Command::new("runuser");
        command.args(["-u", "postgres", "--"]).args(args);
        command
    } else {
        let mut command = std::process::Command::new(args[0]);
        command.args(&args[1..]);
        command
    }
}

/// A process of its own (it outlives ours) that waits for this process to end, then
/// stops the server and removes its files.
fn watchdog(dir: &Path, bin: &Path) -> Result<std::process::Child, ClusterError> {
    let stop = format!("{}/pg_ctl stop -m immediate -D {}/data", bin.display(), dir.display());
    let stop = if is_root() { format!("runuser -u postgres -- {stop}") } else { stop };
    host::watchdog(&format!("{stop} >/dev/null 2>&1; rm -rf {}", dir.display()), "a PostgreSQL server")
}

/// The newest PostgreSQL's binaries (`/usr/lib/postgresql/<version>/bin`).
pub(super) fn binaries() -> Result<PathBuf, ClusterError> {
    let versions = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|source| io("find PostgreSQL's binaries under /usr/lib/postgresql", source))?;
    versions
        .filter_map(Result::ok)
        .filter_map(|entry| {
            Some((entry.file_name().to_str()?.parse::<u32>().ok()?, entry.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").exists())
        .max_by_key(|(version, _)| *version)
        .map(|(_, bin)| bin)
        .ok_or_else(|| ClusterError::Command {
            command: "find initdb".into(),
            output: "no /usr/lib/postgresql/<version>/bin/initdb: install the PostgreSQL server package"
                .into(),
        })
}

fn free_port() -> Result<u16, ClusterError> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|source| io("find a free port", source))?;
    listener.local_addr().map(|addr| addr.port()).map_err(|source| io("find a free port", source))
}

fn copy(from: &Path, to: &Path, mode: u32) -> Result<(), ClusterError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(from, to)
        .map_err(|source| io(&format!("copy {} to {}", from.display(), to.display()), source))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))
        .map_err(|source| io(&format!("chmod {}", to.display()), source))
}

pub(super) fn append(path: &Path, text: &str) -> Result<(), ClusterError> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|source| io(&format!("append to {}", path.display()), source))
}

/// Gives `dir` to `postgres` (when we are root: the server refuses to run as root).
pub(super) fn chown(dir: &Path) -> Result<(), ClusterError> {
    if !is_root() {
        return Ok(());
    }
    let status = std::process::Command::new("chown")
        .arg("-R")
        .arg("postgres:postgres")
        .arg(dir)
        .status()
        .map_err(|source| io("chown the server's files", source))?;
    if status.success() {
        Ok(())
    } else {
        Err(ClusterError::Command {
            command: format!("chown -R postgres {}", dir.display()),
            output: status.to_string(),
        })
    }
}

/// Removes the directories of runs whose process is gone (their watchdog was killed
/// too, say) and stops what still runs there.
fn remove_stale() {
    for dir in host::stale_dirs(BASE) {
        if let Ok(pid) = std::fs::read_to_string(dir.join("data/postmaster.pid")) {
            if let Some(postmaster) = pid.lines().next() {
                let _ = std::process::Command::new("kill").args(["-9", postmaster.trim()]).status();
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
