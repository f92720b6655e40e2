//! The payments application run as an operator runs it: the `payments` binary of
//! `examples/` (built in this package as `payments-app`, so a test finds it at
//! `env!("CARGO_BIN_EXE_payments-app")`) as a child process, its stderr kept.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The variables the child must not inherit from the test's environment: each
/// test says where the app connects, in the form it tests.
const INHERITED_SETTINGS: [&str; 5] =
    ["AMQP_URL", "AMQP_URL_FILE", "DATABASE_URL", "DATABASE_URL_FILE", "IDEMQ_CONFIG"];

/// A running `payments-app`; killed on drop.
pub struct App {
    child: Child,
    stderr: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl App {
    /// Starts `binary` with `args` and `env` (and none of [`INHERITED_SETTINGS`]
    /// but those `env` gives; `RUST_LOG=warn`).
    pub fn spawn(binary: &str, args: &[&str], env: &[(&str, &str)]) -> App {
        let mut command = Command::new(binary);
        for name in INHERITED_SETTINGS {
            command.env_remove(name);
        }
        command.env("RUST_LOG", "warn").args(args).stdout(Stdio::null()).stderr(Stdio::piped());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap_or_else(|e| panic!("spawn {binary}: {e}"));
        // Drained as it comes, so a chatty child never blocks on a full pipe.
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("piped stderr");
        let sink = Arc::clone(&stderr);
        let reader = std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buffer) {
                sink.lock().expect("stderr lock").push_str(&String::from_utf8_lossy(&buffer[..n]));
            }
        });
        App { child, stderr, reader: Some(reader) }
    }

    /// What it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("stderr lock").clone()
    }

    /// Panics, with its stderr, if it has exited (for waits on its work: a crashed
    /// app fails the test at once, saying why).
    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("wait on the app") {
            self.join_reader();
            panic!("the app exited ({status}) while it should run; its stderr:\n{}", self.stderr());
        }
    }

    /// Waits (at most `timeout`) for it to exit on its own; returns its status and
    /// its whole stderr.
    pub async fn exit(mut self, timeout: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait on the app") {
                self.join_reader();
                return (status, self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "the app did not exit within {timeout:?}; its stderr:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM and waits (at most `timeout`) for it to exit; returns its status
    /// and its whole stderr.
    pub async fn terminate(self, timeout: Duration) -> (ExitStatus, String) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        self.exit(timeout).await
    }

    fn join_reader(&mut self) {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file in the system's temporary folder holding `content`, deleted on drop (a
/// container secret, for the `*_FILE` settings).
pub struct SecretFile {
    path: std::path::PathBuf,
}

impl SecretFile {
    /// Writes `content` to a new file named after `name`.
    pub fn new(name: &str, content: &str) -> SecretFile {
        let path = std::env::temp_dir().join(crate::unique(name));
        std::fs::write(&path, content).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        SecretFile { path }
    }

    /// Its path, as a string for the environment.
    pub fn path(&self) -> &str {
        self.path.to_str().expect("a UTF-8 temporary path")
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Declares the app's topology (its queue, dead-letter queue, events exchange and
/// events queue) where `broker` is connected, so payments can be published before the
/// app runs.
pub async fn declare_topology(broker: &crate::Broker) {
    let channel = broker.connection().create_channel().await.expect("open a channel");
    idemq_example_payments::topology().declare(&channel).await.expect("declare the payments topology");
    let _ = channel.close(200, "declared".into()).await;
}

/// Publishes `n` distinct payments to the app's queue, every fifth one twice (a
/// duplicate); returns them.
pub async fn publish_payments(
    broker: &crate::Broker,
    n: usize,
) -> Vec<idemq_example_payments::PaymentRequested> {
    let payments: Vec<_> = (0..n).map(|i| crate::fixture::payment(1 + i as i64)).collect();
    let props = lapin::BasicProperties::default().with_content_type("application/json".into());
    for (i, payment) in payments.iter().enumerate() {
        let body = serde_json::to_vec(payment).expect("serialize");
        let copies = if i % 5 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            broker.publish_bytes(idemq_example_payments::QUEUE, &body, props.clone()).await;
        }
    }
    payments
}

/// Waits (at most 60 s) until `app` has applied `n` payments to `db`'s ledger; fails at
/// once, with its stderr, if it exits meanwhile.
pub async fn wait_applied(app: &mut App, db: &crate::TestDb, n: usize) {
    // The app creates the ledger at start-up, unless it was migrated before.
    let created = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'ledger'";
    crate::eventually("the app's tables created", Duration::from_secs(60), || {
        app.assert_running();
        async { db.count(created).await == 1 }
    })
    .await;
    crate::eventually(&format!("{n} payments applied"), Duration::from_secs(60), || {
        app.assert_running();
        async { db.count("SELECT count(*) FROM ledger").await == n as i64 }
    })
    .await;
}
