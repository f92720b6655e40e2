//! A service stops on SIGTERM whatever became of its stderr: closed (`… 2>&1 |
//! head -3`), full (a reader that stopped reading), or gone with its reader (a log
//! shipper that died). Each runs the payments app as an operator runs it, with its
//! stderr a pipe the test controls.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemq_tests::app::{declare_topology, publish_payments};
use idemq_tests::{eventually, Broker, TestDb, TestVhost};

const APP: &str = env!("CARGO_BIN_EXE_payments-app");

/// The app's database and vhost (both removed when dropped), with payments waiting,
/// and the app started on them with `RUST_LOG` at `level` and its stderr piped to
/// `stderr`.
async fn start(level: &str, stderr: Stdio) -> (TestDb, TestVhost, Child, usize) {
    let db = TestDb::create().await;
    let vhost = TestVhost::create().await;
    let broker = Broker::connect(&vhost.amqp_url()).await;
    declare_topology(&broker).await;
    let payments = publish_payments(&broker, 20).await;
    let child = Command::new(APP)
        .arg("run")
        .env_remove("AMQP_URL_FILE")
        .env_remove("DATABASE_URL_FILE")
        .env_remove("IDEMQ_CONFIG")
        .env("AMQP_URL", vhost.amqp_url())
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", level)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("spawn the app");
    (db, vhost, child, payments.len())
}

/// Waits until every payment is applied (the service works, whatever its stderr).
async fn applied(db: &TestDb, n: usize) {
    let created = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename = 'ledger'";
    eventually("the app's tables created", Duration::from_secs(60), || async {
        db.count(created).await == 1
    })
    .await;
    eventually(&format!("{n} payments applied"), Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger").await == n as i64
    })
    .await;
}

/// Sends SIGTERM and expects a clean exit (0) within 30 s.
fn terminated(mut child: Child) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait on the app") {
            assert!(status.success(), "the app exited {status} after SIGTERM");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the app ignored SIGTERM for 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stages `… 2>&1 | head -3`: three lines read, then the pipe's reader closes it.
/// Every later write fails; SIGTERM must still drain and exit 0.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_service_after_its_stderr_was_closed() {
    let (db, _vhost, mut child, n) = start("info", Stdio::piped()).await;
    let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
    for _ in 0..3 {
        lines.next().expect("a log line").expect("read a log line");
    }
    drop(lines);
    applied(&db, n).await;
    terminated(child);
}

/// Stages a reader that stopped reading: the pipe fills (trace logging) and stays
/// full. The service must go on applying payments, and stop on SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_service_whose_stderr_is_full() {
    let (db, _vhost, child, n) = start("trace", Stdio::piped()).await;
    // Held, never read: the pipe's 64 KiB fill within the first trace lines.
    applied(&db, n).await;
    terminated(child);
}

/// Stages a log shipper that died: stderr is a pipe to another process, SIGKILLed
/// while the service runs.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_service_whose_log_reader_was_killed() {
    let mut shipper = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the log reader");
    let pipe = shipper.stdin.take().expect("the reader's stdin");
    let (db, _vhost, child, n) = start("debug", Stdio::from(pipe)).await;
    shipper.kill().expect("kill the log reader");
    let _ = shipper.wait();
    applied(&db, n).await;
    terminated(child);
}
