//! URLs from files (`AMQP_URL_FILE`, `DATABASE_URL_FILE`: container secrets), with
//! the payments app run as a child process, as an operator runs it.

use std::time::Duration;

use idemq_tests::app::{declare_topology, publish_payments, wait_applied, App, SecretFile};
use idemq_tests::{Broker, TestDb, TestVhost};

const APP: &str = env!("CARGO_BIN_EXE_payments-app");

/// `payments run` given only `AMQP_URL_FILE` and `DATABASE_URL_FILE` (each file
/// ending in a newline, as editors and `echo` leave it) sets up the database,
/// consumes, applies every payment once (duplicates included) and exits 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn run_reads_both_urls_from_files() {
    let db = TestDb::create().await;
    let vhost = TestVhost::create().await;
    let broker = Broker::connect(&vhost.amqp_url()).await;
    declare_topology(&broker).await;
    let payments = publish_payments(&broker, 20).await;
    let amqp_file = SecretFile::new("amqp_url", &format!("{}\n", vhost.amqp_url()));
    let database_file = SecretFile::new("database_url", &format!("{}\n", db.url()));

    let mut app = App::spawn(
        APP,
        &["run"],
        &[("AMQP_URL_FILE", amqp_file.path()), ("DATABASE_URL_FILE", database_file.path())],
    );
    wait_applied(&mut app, &db, payments.len()).await;
    let (status, stderr) = app.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "run exited {status}; its stderr:\n{stderr}");
    let doubled =
        "SELECT count(*) FROM (SELECT payment_id FROM ledger GROUP BY payment_id HAVING count(*) > 1) d";
    assert_eq!(db.count(doubled).await, 0, "a payment applied twice");
}

/// Runs the app with `args` and `env` and expects it to refuse at once (exit 1),
/// saying `expected`, and never printing `secret`.
async fn refused(args: &[&str], env: &[(&str, &str)], expected: &str, secret: &str) {
    let (status, stderr) = App::spawn(APP, args, env).exit(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(1), "{args:?} with {env:?} must fail; its stderr:\n{stderr}");
    assert!(stderr.contains(expected), "expected {expected:?} in:\n{stderr}");
    assert!(!stderr.contains(secret), "the password is printed:\n{stderr}");
}

/// A URL and its file given together — as two variables, as a flag and a variable,
/// or as two keys of the config file — is refused before anything connects, naming
/// the two and saying to keep one; so is a file that is missing or empty, named.
/// No message quotes a password.
#[tokio::test(flavor = "multi_thread")]
async fn a_url_and_its_file_both_set_are_refused_naming_both() {
    let secret = "s3cr3t-pw";
    let url = format!("amqp://guest:{secret}@127.0.0.1:5672/%2f");
    let file = SecretFile::new("amqp_url", &format!("{url}\n"));
    refused(
        &["status"],
        &[("AMQP_URL", &url), ("AMQP_URL_FILE", file.path())],
        "both AMQP_URL and AMQP_URL_FILE are set: keep one",
        secret,
    )
    .await;
    refused(
        &["run", "--database-url", &format!("postgres://app:{secret}@127.0.0.1/db")],
        &[("DATABASE_URL_FILE", file.path())],
        "both --database-url and DATABASE_URL_FILE are set: keep one",
        secret,
    )
    .await;
    let config = SecretFile::new(
        "config",
        &format!(
            "database_url = \"postgres://app:{secret}@127.0.0.1/db\"\ndatabase_url_file = \"{}\"\n",
            file.path()
        ),
    );
    refused(
        &["--config", config.path(), "migrate"],
        &[],
        "in the config file: both database_url and database_url_file are set: keep one",
        secret,
    )
    .await;
    let missing = std::env::temp_dir().join(idemq_tests::unique("no_such_secret"));
    let missing = missing.to_str().expect("a UTF-8 path");
    refused(
        &["status"],
        &[("AMQP_URL_FILE", missing)],
        &format!("AMQP_URL_FILE: cannot read the file {missing}"),
        secret,
    )
    .await;
    let empty = SecretFile::new("empty", "\n");
    refused(
        &["migrate"],
        &[("DATABASE_URL_FILE", empty.path())],
        &format!("DATABASE_URL_FILE: the file {} is empty", empty.path()),
        secret,
    )
    .await;
}
