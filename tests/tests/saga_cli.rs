//! The CLI's view of sagas, run as an operator runs it: `payments status` counts the
//! sagas by name, `payments saga show NAME KEY` prints one. Each test has a database
//! (migrated, its `idemq_saga` rows written with SQL) and a vhost of its own.

use std::time::Duration;

use diesel_async::SimpleAsyncConnection;

const APP: &str = env!("CARGO_BIN_EXE_payments-app");

/// Where the app connects: a migrated database and a vhost of the test's own.
struct Place {
    db: idemq_tests::TestDb,
    vhost: idemq_tests::TestVhost,
}

/// What a command left: its exit code, stdout and stderr.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Place {
    /// A fresh database with idemq's migrations applied, holding `sql`'s rows.
    async fn with(sql: &str) -> Place {
        let db = idemq_tests::TestDb::create().await;
        idemq::migrate(&db.url()).await.expect("idemq's migrations");
        db.connect().await.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        Place { db, vhost: idemq_tests::TestVhost::create().await }
    }

    /// Runs `payments-app args` to its end (at most 60 s).
    async fn cli(&self, args: &[&str]) -> Ran {
        let mut command = tokio::process::Command::new(APP);
        command
            .args(args)
            .env("AMQP_URL", self.vhost.amqp_url())
            .env("DATABASE_URL", self.db.url())
            .env("RUST_LOG", "warn")
            .env_remove("IDEMQ_CONFIG")
            .kill_on_drop(true);
        let output = idemq_tests::with_timeout(
            &format!("payments-app {args:?}"),
            Duration::from_secs(60),
            command.output(),
        )
        .await
        .expect("spawn payments-app");
        let ran = Ran {
            code: output.status.code(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        };
        assert!(ran.code != Some(2) && ran.code != Some(101), "{args:?}: {}{}", ran.stdout, ran.stderr);
        ran
    }

    /// [`Place::cli`] that must exit 0: its stdout.
    async fn cli_ok(&self, args: &[&str]) -> String {
        let ran = self.cli(args).await;
        assert_eq!(ran.code, Some(0), "{args:?}:\n{}{}", ran.stdout, ran.stderr);
        ran.stdout
    }
}

/// The line of `output` that starts with `start`, or a panic showing all of it.
fn line<'a>(output: &'a str, start: &str) -> &'a str {
    let found = output.lines().find(|l| l.starts_with(start));
    found.unwrap_or_else(|| panic!("no line {start:?}:\n{output}"))
}

/// Two `order` sagas running (one for two hours, one for five minutes) and one
/// finished, and a `refund` saga finished only: `status` gives each name a line with
/// its running count, the oldest running one's age and its finished count, and says
/// how to show one.
#[tokio::test(flavor = "multi_thread")]
async fn status_counts_running_and_finished_sagas_by_name_with_the_oldest_running_age() {
    let place = Place::with(
        "INSERT INTO idemq_saga (saga, key, state, started_at) VALUES
             ('order', 'o-1', '{}', now() - interval '2 hours'),
             ('order', 'o-2', '{}', now() - interval '5 minutes');
         INSERT INTO idemq_saga (saga, key, state, started_at, finished_at, expires_at) VALUES
             ('order', 'o-3', '{}', now() - interval '3 days', now() - interval '1 day', now() + interval '6 days'),
             ('refund', 'r-1', '{}', now() - interval '1 hour', now(), now() + interval '7 days');",
    )
    .await;
    let status = place.cli_ok(&["status"]).await;
    let order = line(&status, "saga order: ");
    // Whole seconds since the insert: 2h and the seconds the command took; not the
    // finished one's 3 days.
    assert!(order.starts_with("saga order: 2 running, the oldest for 2h"), "{status}");
    assert!(order.ends_with("; 1 finished (kept)"), "{status}");
    assert_eq!(line(&status, "saga refund: "), "saga refund: none running; 1 finished (kept)", "{status}");
    assert_eq!(line(&status, "sagas: "), "sagas: `payments saga show NAME KEY` shows one", "{status}");
    let nonzero = place.cli_ok(&["status", "--nonzero"]).await;
    assert!(nonzero.contains("saga order: 2 running"), "the sagas always print:\n{nonzero}");
}

/// Without sagas `status` says so in one line; on a schema from before sagas (the
/// table dropped) it prints the rest, says the sagas are unknown and why, and exits 1
/// as for any figure it cannot read.
#[tokio::test(flavor = "multi_thread")]
async fn status_says_none_without_sagas_and_unknown_with_the_fix_when_the_table_is_missing() {
    let place = Place::with("").await;
    let status = place.cli_ok(&["status"]).await;
    assert_eq!(line(&status, "sagas"), "sagas: none", "{status}");
    assert!(!status.contains("saga show"), "no hint without sagas:\n{status}");

    place.db.connect().await.batch_execute("DROP TABLE idemq_saga").await.expect("drop idemq_saga");
    let ran = place.cli(&["status"]).await;
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    assert_eq!(line(&ran.stdout, "dedup rows:"), "dedup rows: 0", "the rest prints:\n{}", ran.stdout);
    assert_eq!(
        line(&ran.stdout, "sagas"),
        "sagas: unknown (idemq_saga is not there: run `migrate`)",
        "{}",
        ran.stdout
    );
    assert!(ran.stderr.contains("1 of the figures above could not be read"), "{}", ran.stderr);
}

/// A running saga with a pending timeout, and a finished one: `saga show` prints
/// each one's name and key, whether it runs or until when it is kept, its version,
/// its four times (UTC), its timeouts' message ids and its state as pretty JSON.
#[tokio::test(flavor = "multi_thread")]
async fn saga_show_prints_a_sagas_times_timeouts_and_state_as_pretty_json() {
    let place = Place::with(
        r#"INSERT INTO idemq_saga (saga, key, state, version, timeouts, started_at, updated_at) VALUES
             ('order', 'o-1', '{"status": "Reserved", "amount_cents": 1250, "payment_id": "p-9"}', 2,
              '{timeout-o-1}', '2026-12-01 10:00:00+00', '2026-12-01 10:05:00.25+00');
         INSERT INTO idemq_saga (saga, key, state, version, started_at, updated_at, finished_at, expires_at)
             VALUES ('order', 'o-2', '{"status": "Shipped"}', 3, '2026-12-01 11:00:00+00',
              '2026-12-02 09:00:00+00', '2026-12-02 09:00:00+00', '2026-12-09 09:00:00+00');"#,
    )
    .await;
    let shown = place.cli_ok(&["saga", "show", "order", "o-1"]).await;
    let (facts, state) = shown.split_once("state:\n").unwrap_or_else(|| panic!("no state:\n{shown}"));
    assert_eq!(
        facts,
        "saga order, key o-1: running\n\
         version:  2 (steps taken)\n\
         started:  2026-12-01T10:00:00.000Z\n\
         updated:  2026-12-01T10:05:00.250Z\n\
         finished: not yet\n\
         expires:  not while it runs\n\
         timeouts: 1 pending (message ids): timeout-o-1\n",
        "{shown}"
    );
    let parsed: serde_json::Value = serde_json::from_str(state).unwrap_or_else(|e| panic!("{e}:\n{shown}"));
    assert_eq!(parsed, serde_json::json!({"status": "Reserved", "amount_cents": 1250, "payment_id": "p-9"}));
    assert!(state.contains("\n    \"payment_id\": \"p-9\""), "pretty, a field a line:\n{shown}");

    let finished = place.cli_ok(&["saga", "show", "order", "o-2"]).await;
    assert_eq!(
        line(&finished, "saga order"),
        "saga order, key o-2: finished, kept until 2026-12-09T09:00:00.000Z",
        "{finished}"
    );
    assert_eq!(line(&finished, "finished:"), "finished: 2026-12-02T09:00:00.000Z", "{finished}");
    assert_eq!(line(&finished, "timeouts:"), "timeouts: none pending", "{finished}");
    assert!(finished.contains("\"status\": \"Shipped\""), "{finished}");
}

/// A saga that is not there — another key, another name, or the table itself
/// missing — is an error: nothing on stdout, a message on stderr saying what is
/// missing, and exit 1.
#[tokio::test(flavor = "multi_thread")]
async fn saga_show_of_a_saga_that_is_not_there_says_so_and_exits_1() {
    let place = Place::with("INSERT INTO idemq_saga (saga, key, state) VALUES ('order', 'o-1', '{}')").await;
    for (name, key) in [("order", "o-404"), ("refund", "o-1")] {
        let ran = place.cli(&["saga", "show", name, key]).await;
        assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
        assert_eq!(ran.stdout, "", "{}", ran.stderr);
        assert!(
            ran.stderr.contains(&format!("payments: no saga '{name}' with key '{key}': none started")),
            "{}",
            ran.stderr
        );
    }

    place.db.connect().await.batch_execute("DROP TABLE idemq_saga").await.expect("drop idemq_saga");
    let ran = place.cli(&["saga", "show", "order", "o-1"]).await;
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    assert!(ran.stderr.contains("payments: idemq_saga is not there: run `migrate`"), "{}", ran.stderr);
}
