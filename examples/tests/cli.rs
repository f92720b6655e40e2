//! The `payments` binary as a user runs it, each test in its own RabbitMQ vhost and
//! PostgreSQL database (both removed at the end).

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A vhost and a database name for one test; removed on drop.
struct Isolated {
    /// Made and removed through RabbitMQ's HTTP API (`rabbitmqctl` where it cannot
    /// be had): each `rabbitmqctl` boots an Erlang VM, half a second of CPU.
    vhost: idemq_tests::TestVhost,
    database: String,
}

impl Isolated {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let id = format!("{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let vhost = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime to create the vhost on")
            .block_on(idemq_tests::TestVhost::create());
        Self { vhost, database: format!("idemq_cli_{id}") }
    }

    /// The vhost's name.
    fn vhost(&self) -> &str {
        self.vhost.name()
    }

    fn payments(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
        command
            .args(args)
            .env("AMQP_URL", format!("amqp://guest:guest@127.0.0.1:5672/{}", self.vhost()))
            .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:5432/{}", self.database))
            .env_remove("RUST_LOG");
        command
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.database);
        let _ = Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c", &sql])
            .output();
    }
}

fn run_ok(command: &mut Command) -> Output {
    let output = command.output().expect("spawn");
    assert!(
        output.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the process did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `payments demo` creates its database, applies every payment once, skips the
/// duplicates, dead-letters the bad messages and finds the ledger right; and it can
/// run again on the same database and queue.
#[test]
fn demo_applies_each_payment_once_and_can_run_again() {
    let env = Isolated::new();
    for _ in 0..2 {
        let output = run_ok(&mut env.payments(&["demo", "--payments", "300"]));
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.contains("applied:             300"), "{stdout}");
        assert!(stdout.contains("duplicates skipped:  30"), "{stdout}");
        assert!(stdout.contains("dead-lettered:       6"), "{stdout}");
        assert!(stdout.contains("ledger check:        OK"), "{stdout}");
    }
}

/// `payments orders` runs the order saga end to end — duplicates, reservations that
/// overtake their order, timeouts through the relay — and every saga ends one way,
/// each command sent once; `status` counts them, finished and kept.
#[test]
fn orders_runs_the_order_saga_and_every_saga_ends_one_way() {
    let env = Isolated::new();
    let output = run_ok(&mut env.payments(&["orders", "--orders", "40", "--window", "2"]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("orders:     40 placed"), "{stdout}");
    assert!(stdout.contains("check:      OK"), "{stdout}");
    let shipped: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("shipped:")?.split_whitespace().next()?.parse().ok())
        .expect("a shipped line");
    let released: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("released:")?.split_whitespace().next()?.parse().ok())
        .expect("a released line");
    assert_eq!(shipped + released, 40, "{stdout}");
    assert!(released >= 10, "the orders never reserved are released by their timeout: {stdout}");
    let status = stdout_of(&run_ok(&mut env.payments(&["status"])));
    assert!(status.contains("saga order: none running; 40 finished (kept)"), "{status}");
}

fn stdout_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `payments migrate` applies the migrations and exits 0; `payments run` consumes
/// until SIGTERM and then exits 0.
#[test]
fn migrate_exits_zero_and_run_stops_cleanly_on_sigterm() {
    let env = Isolated::new();
    run_ok(&mut env.payments(&["migrate"]));
    let mut child =
        env.payments(&["run"]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn run");
    // Running means the queue is declared and consumed.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = run_ok(Command::new("rabbitmqctl").args([
            "list_queues",
            "-p",
            env.vhost(),
            "name",
            "consumers",
            "-q",
        ]));
        let text = String::from_utf8_lossy(&listed.stdout);
        if text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["payments", "1"]) {
            break;
        }
        assert!(Instant::now() < deadline, "payments run never consumed: {text}");
        assert!(child.try_wait().expect("wait").is_none(), "payments run exited early");
        std::thread::sleep(Duration::from_millis(200));
    }
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = wait_with_timeout(&mut child, Duration::from_secs(20));
    assert!(status.success(), "exit status {status:?}");
}

/// `payments migrate` against a server that is not there, given passwords that hold
/// `@` raw, percent-encoded, in the query and in a libpq `key=value` string, fails
/// without printing the password or any piece of it (debug logging on).
#[test]
fn a_failed_migrate_never_prints_the_database_password() {
    for url in [
        "postgres://postgres:s3cr@t-pw@127.0.0.1:1/x",
        "postgres://postgres:s3cr%40t-pw@127.0.0.1:1/x",
        "postgres://postgres@127.0.0.1:1/x?sslmode=disable&password=s3cr@t-pw",
        "host=127.0.0.1 port=1 user=postgres password='s3cr@t-pw' dbname=x",
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_payments"))
            .arg("migrate")
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "debug")
            .output()
            .expect("spawn payments migrate");
        let shown =
            format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(!output.status.success(), "migrate succeeded against port 1: {shown}");
        assert!(shown.contains("payments: "), "no error printed for {url}: {shown}");
        for fragment in ["s3cr", "t-pw", "%40t"] {
            assert!(!shown.contains(fragment), "'{fragment}' of the password printed for {url}:\n{shown}");
        }
    }
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A run that must fail: exit 1 and its stderr.
fn run_fails(command: &mut Command) -> String {
    let output = command.output().expect("spawn");
    assert_eq!(output.status.code(), Some(1), "{command:?}: {}", stdout(&output));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `payments --help` lists every subcommand and exits 0; a subcommand's `--help`
/// lists its flags.
#[test]
fn help_lists_every_subcommand_and_exits_zero() {
    let env = Isolated::new();
    let help = stdout(&run_ok(&mut env.payments(&["--help"])));
    for subcommand in ["run", "migrate", "declare", "status", "gc", "demo", "orders", "saga"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(subcommand)), "{subcommand} missing: {help}");
    }
    let run = stdout(&run_ok(&mut env.payments(&["run", "--help"])));
    assert!(
        run.contains("--concurrency") && run.contains("--queue") && run.contains("--batch-size"),
        "{run}"
    );
}

/// `payments asyncapi` as built from this package alone (`cargo test -p
/// idemq-example-payments`: no other package's features), touching neither the
/// broker nor the database: each payload with its fields, types and `required`.
#[test]
fn asyncapi_gives_each_payload_its_fields_types_and_required() {
    let output = run_ok(
        Command::new(env!("CARGO_BIN_EXE_payments"))
            .arg("asyncapi")
            .env("AMQP_URL", "amqp://nobody:wrong@127.0.0.1:1/%2f")
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none"),
    );
    let document: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    for name in ["PaymentRequested", "PaymentApplied"] {
        let payload = &document["components"]["messages"][name]["payload"];
        assert_eq!(payload["properties"]["amount_cents"]["type"], "integer", "{name}: {payload:#}");
        assert_eq!(
            payload["required"],
            serde_json::json!(["payment_id", "account", "amount_cents"]),
            "{name}: {payload:#}"
        );
    }
}

/// `payments --version` prints the name and the example's version and exits 0.
#[test]
fn version_prints_the_name_and_version_and_exits_zero() {
    let output = run_ok(Command::new(env!("CARGO_BIN_EXE_payments")).arg("--version"));
    assert_eq!(stdout(&output), format!("payments {}\n", env!("CARGO_PKG_VERSION")));
}

/// `declare` is a dry run that says what is missing; `declare --apply` declares it,
/// and `status` then shows the queues and the outbox backlog.
#[test]
fn declare_shows_what_is_missing_and_apply_declares_it() {
    let env = Isolated::new();
    let dry = stdout(&run_ok(&mut env.payments(&["declare"])));
    assert!(dry.lines().any(|l| l.contains("queue payments.applied") && l.contains("missing")), "{dry}");
    assert!(dry.contains("payments.retry.1000ms"), "the wait queues are listed: {dry}");
    let listed =
        stdout(&run_ok(Command::new("rabbitmqctl").args(["list_queues", "-p", env.vhost(), "name", "-q"])));
    assert!(!listed.lines().any(|l| l.trim() == "payments"), "a dry run declared: {listed}");
    run_ok(&mut env.payments(&["declare", "--apply"]));
    let again = stdout(&run_ok(&mut env.payments(&["declare"])));
    assert!(!again.contains("missing"), "{again}");
    assert!(
        again.lines().any(|l| l.starts_with("binding payments.applied")
            && l.contains("to exchange payments.events with routing key ''")),
        "the bindings are listed: {again}"
    );
    run_ok(&mut env.payments(&["migrate"]));
    let status = stdout(&run_ok(&mut env.payments(&["status"])));
    // One line per queue, its dead letters a column.
    assert!(
        status.lines().any(|l| l.starts_with("payments ") && l.contains("consumed by apply_payment")),
        "{status}"
    );
    assert!(status.contains("outbox backlog:        0"), "{status}");
}

/// `status` counts the dedup rows exactly (rows the planner has never counted are
/// not an estimate of 0), sums the retries waiting on the queue's line and lists the
/// wait queue holding them, and prints what it cannot read as `unknown (why)` —
/// never a number — then exits 1, the rest printed.
#[test]
fn status_counts_exactly_lists_the_wait_queues_and_says_what_it_cannot_read() {
    let env = Isolated::new();
    run_ok(&mut env.payments(&["declare", "--apply"]));
    // No database yet (the demo's set-up makes it).
    let output = env.payments(&["status"]).output().expect("spawn");
    let shown = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{shown}");
    assert!(shown.contains("dedup rows: unknown (") && !shown.contains("dedup rows: 0"), "{shown}");
    assert!(shown.lines().any(|l| l.starts_with("payments ")), "the queues are still shown: {shown}");

    run_ok(&mut env.payments(&["migrate"]));
    psql(
        &env.database,
        "INSERT INTO idemq_dedup (handler, key, processed_at) \
         SELECT 'h', 'k' || i, now() FROM generate_series(1, 32689) AS i",
    );
    publish(env.vhost(), "payments.retry.600000ms", 2);
    let status = stdout(&run_ok(&mut env.payments(&["status"])));
    assert!(status.lines().any(|l| l == "dedup rows: 32689"), "{status}");
    // The queue's line sums its retries and names its wait queues' delays; a wait
    // queue holding some has a line of its own below it.
    let row = status.lines().find(|l| l.starts_with("payments ")).expect("listed");
    assert_eq!(row.split_whitespace().nth(4), Some("2"), "{status}");
    assert!(row.ends_with("retries wait 1s, 5s, 30s, 2m, 10m"), "{status}");
    let waiting =
        status.lines().find(|l| l.trim_start().starts_with("payments.retry.600000ms")).expect("listed");
    assert_eq!(waiting.split_whitespace().nth(1), Some("2"), "{status}");
    assert!(waiting.ends_with("retries of payments after 10m"), "{status}");
}

/// Runs `sql` in `database`.
fn psql(database: &str, sql: &str) {
    run_ok(Command::new("psql").args(["-h", "127.0.0.1", "-U", "postgres", "-d", database, "-c", sql]));
}

/// Publishes `n` persistent messages to `queue` of `vhost`, confirmed.
fn publish(vhost: &str, queue: &str, n: usize) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::{BasicProperties, Connection, ConnectionProperties};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let url = format!("amqp://guest:guest@127.0.0.1:5672/{vhost}");
        let connection = Connection::connect(&url, ConnectionProperties::default()).await.expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        channel.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
        for _ in 0..n {
            let properties = BasicProperties::default().with_delivery_mode(2);
            let confirm = channel
                .basic_publish("".into(), queue.into(), BasicPublishOptions::default(), b"{}", properties)
                .await
                .expect("publish");
            confirm.await.expect("confirmed");
        }
        let _ = connection.close(200, "published".into()).await;
    });
}

/// `migrate --status` lists idemq's migrations and the application's own (given
/// with `Cli::migrations`), pending then applied.
#[test]
fn migrate_status_lists_pending_then_applied_migrations() {
    let env = Isolated::new();
    // The database exists (created by the demo's set-up), idemq's migrations not yet.
    run_ok(Command::new("psql").args([
        "-h",
        "127.0.0.1",
        "-U",
        "postgres",
        "-d",
        "postgres",
        "-c",
        &format!("CREATE DATABASE \"{}\"", env.database),
    ]));
    let before = stdout(&run_ok(&mut env.payments(&["migrate", "--status"])));
    assert!(before.contains("idemq        pending  2026-12-02-000001_idemq_outbox_and_results"), "{before}");
    assert!(before.contains("application  pending  2026-12-05-000001_payments_ledger"), "{before}");
    run_ok(&mut env.payments(&["migrate"]));
    let after = stdout(&run_ok(&mut env.payments(&["migrate", "--status"])));
    assert!(after.contains("0 pending") && !after.contains("pending  "), "{after}");
    assert!(after.contains("application  applied  2026-12-05-000001_payments_ledger"), "{after}");
}

/// `gc` refuses a retention shorter than the retry horizon plus the replay window,
/// saying why, and sweeps with a long one; settings come from a config file too,
/// and an unknown setting in it is refused, naming the valid ones.
#[test]
fn gc_refuses_a_short_retention_and_reads_its_settings_from_a_config_file() {
    let env = Isolated::new();
    run_ok(&mut env.payments(&["migrate"]));
    let refused = run_fails(&mut env.payments(&["gc", "--keep", "1d"]));
    assert!(refused.contains("too short") && refused.contains("replay window"), "{refused}");
    // `run` sweeps in the background with the same check, before it connects.
    let refused = run_fails(&mut env.payments(&["run", "--retention", "1d"]));
    assert!(refused.contains("too short"), "{refused}");
    let swept = stdout(&run_ok(&mut env.payments(&["gc", "--keep", "30d"])));
    assert!(swept.contains("deleted 0 dedup rows"), "{swept}");
    let dir = std::env::temp_dir().join(format!("idemq-cli-{}", env.database));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let good = dir.join("good.toml");
    std::fs::write(&good, "retention = \"40d\"\n").expect("write");
    let swept = stdout(&run_ok(&mut env.payments(&["--config", good.to_str().expect("utf-8"), "gc"])));
    assert!(swept.contains("older than 40d"), "{swept}");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "retension = \"40d\"\n").expect("write");
    let refused = run_fails(&mut env.payments(&["--config", bad.to_str().expect("utf-8"), "gc"]));
    assert!(refused.contains("retension") && refused.contains("retention"), "{refused}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `run --queue` with a queue no handler consumes is refused before anything
/// connects, naming the consumed queues.
#[test]
fn run_with_an_unknown_queue_is_refused() {
    let env = Isolated::new();
    let refused = run_fails(&mut env.payments(&["run", "--queue", "refunds"]));
    assert!(refused.contains("--queue refunds") && refused.contains("payments"), "{refused}");
}

/// Dead letters after a demo: `dlq list` shows each with its reason and body,
/// `dlq show` one whole, `dlq replay --kind key --limit 1` sends one back to its
/// queue, `dlq purge --kind decode` removes those (refused without a terminal
/// unless `--yes`; `--dry-run` only says); browsing removes nothing; each letter
/// shows its queue.
#[test]
fn dlq_lists_shows_replays_and_purges_dead_letters() {
    let env = Isolated::new();
    run_ok(&mut env.payments(&["demo", "--payments", "20"]));
    let listed = stdout(&run_ok(&mut env.payments(&["dlq", "list"])));
    let count = |text: &str| text.lines().filter(|l| l.starts_with('#')).count();
    assert_eq!(count(&listed), 6, "{listed}");
    assert!(
        listed.contains("conflict")
            && listed.contains("decode")
            && listed.contains("body:  this is not json")
            && listed.contains("queue=payments "),
        "{listed}"
    );
    let again = stdout(&run_ok(&mut env.payments(&["dlq", "list"])));
    assert_eq!(count(&again), 6, "browsing must not remove: {again}");
    let shown = stdout(&run_ok(&mut env.payments(&["dlq", "show", "1"])));
    assert!(shown.contains("x-idemq-error-kind:") && shown.contains("body:"), "{shown}");
    let replayed = stdout(&run_ok(&mut env.payments(&["dlq", "replay", "--kind", "key", "--limit", "1"])));
    assert!(replayed.contains("replayed 1 dead letters to 'payments'"), "{replayed}");
    // Without a terminal to ask on, purge refuses unless told --yes; --dry-run only says.
    let refused = env.payments(&["dlq", "purge", "--kind", "decode"]).output().expect("run payments");
    let refusal = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && refusal.contains("--yes"), "{refusal}");
    let dry = stdout(&run_ok(&mut env.payments(&["dlq", "purge", "--kind", "decode", "--dry-run"])));
    assert!(dry.contains("would purge 2 dead letters"), "{dry}");
    let purged = stdout(&run_ok(&mut env.payments(&["dlq", "purge", "--kind", "decode", "--yes"])));
    assert!(purged.contains("purged 2 dead letters"), "{purged}");
    let left = stdout(&run_ok(&mut env.payments(&["dlq", "list"])));
    assert_eq!(count(&left), 3, "{left}");
    assert!(!left.contains("decode"), "{left}");
    // The replayed one waits in `payments` (no consumer runs).
    let queues = || {
        let listed = ["list_queues", "-p", env.vhost(), "name", "messages", "-q"];
        stdout(&run_ok(Command::new("rabbitmqctl").args(listed)))
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut listed = queues();
    while !listed.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["payments", "1"]) {
        assert!(Instant::now() < deadline, "the replayed message is not in payments: {listed}");
        std::thread::sleep(Duration::from_millis(500));
        listed = queues();
    }
}

/// A loopback port nothing listens on: connecting there is refused.
fn refusing_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Stages `payments run` started while the broker refuses connections, bounded by
/// `IDEMQ_STARTUP_TIMEOUT` (the setting's contract name): it must give up with exit 1
/// and a message naming RabbitMQ and the startup timeout, not at the first refusal.
#[test]
fn run_gives_up_after_idemq_startup_timeout_naming_the_unreachable_broker() {
    let env = Isolated::new();
    let stderr = run_fails(
        env.payments(&["run"])
            .env("AMQP_URL", format!("amqp://guest:guest@127.0.0.1:{}/{}", refusing_port(), env.vhost()))
            .env("IDEMQ_STARTUP_TIMEOUT", "2s"),
    );
    assert!(stderr.contains("cannot connect to RabbitMQ") && stderr.contains("startup timeout"), "{stderr}");
    assert!(stderr.contains("RabbitMQ is unreachable at start-up"), "each attempt is logged: {stderr}");
}

/// Stages `payments run` started while PostgreSQL refuses connections, with no
/// startup timeout: it must wait (logging each attempt), not exit, and SIGTERM then
/// ends it with exit 0.
#[test]
fn run_waits_for_an_unreachable_database_and_sigterm_exits_zero() {
    let env = Isolated::new();
    let mut child = env
        .payments(&["run"])
        .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{}/{}", refusing_port(), env.database))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn run");
    let (logged, _reader) = stderr_lines(&mut child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut waits = 0;
    while waits < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = logged.recv_timeout(left).expect("the start-up wait is logged");
        waits += usize::from(line.contains("PostgreSQL is unreachable at start-up"));
    }
    assert!(child.try_wait().expect("wait").is_none(), "payments run exited instead of waiting");
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = wait_with_timeout(&mut child, Duration::from_secs(20));
    assert!(status.success(), "exit status {status:?}");
}

/// Stages a broker whose consumer_timeout is shorter than idemq's settings allow
/// for (told by `IDEMQ_CONSUMER_TIMEOUT`, the setting's contract name): `run` must
/// refuse before connecting, exit 1, naming the settings and the fix.
#[test]
fn run_refuses_settings_that_outlast_idemq_consumer_timeout() {
    let stderr = run_fails(
        Command::new(env!("CARGO_BIN_EXE_payments")).arg("run").env("IDEMQ_CONSUMER_TIMEOUT", "10m"),
    );
    for words in ["database_retry_limit (25m)", "consumer_timeout (10m)", "Fix: "] {
        assert!(stderr.contains(words), "{words}: {stderr}");
    }
}

/// The builder's other settings reach `run` from the environment (by their contract
/// names) and from the config file: pairs `build` refuses are refused before anything
/// connects, naming the settings.
#[test]
fn run_reads_every_setting_from_the_environment_and_the_config_file() {
    let payments = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
        command.arg("run").env_remove("IDEMQ_CONFIG");
        command
    };
    let refused = run_fails(payments().env("IDEMQ_RELAY", "off").env("IDEMQ_RELAY_POLL_INTERVAL", "250ms"));
    assert!(refused.contains("relay_poll_interval is set but the relay is off"), "{refused}");
    let refused = run_fails(payments().env("IDEMQ_NAMESPACE", "a/b"));
    assert!(refused.contains("namespace \"a/b\""), "{refused}");
    let refused = run_fails(
        payments()
            .env("IDEMQ_DATABASE_RETRY_LIMIT", "20m")
            .env("IDEMQ_HANDLER_TIMEOUT", "5m")
            .env("IDEMQ_CONSUMER_TIMEOUT", "30m"),
    );
    assert!(
        refused.contains("database_retry_limit (20m)") && refused.contains("handler_timeout (5m)"),
        "{refused}"
    );
    let output = payments().env("IDEMQ_ON_CONFLICT", "drop").output().expect("spawn");
    let refused = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "a usage error: {refused}");
    assert!(refused.contains("dead-letter or ignore"), "{refused}");

    let file = std::env::temp_dir().join(format!("idemq-cli-settings-{}.toml", std::process::id()));
    std::fs::write(&file, "shutdown_deadline = \"40m\"\nheartbeat = \"5s\"\nlinger = \"2ms\"\n")
        .expect("write");
    let refused = run_fails(payments().env("IDEMQ_CONFIG", &file));
    assert!(refused.contains("shutdown_deadline (40m)"), "{refused}");
    let _ = std::fs::remove_file(file);
}

/// `run --log-format json` that fails (the broker refuses connections, a startup
/// timeout): its stderr is still one JSON object a line, the failure the last, at
/// ERROR, naming what was unreachable; exit 1.
#[test]
fn a_failed_run_with_log_format_json_reports_its_failure_as_a_json_line() {
    let env = Isolated::new();
    let stderr = run_fails(
        env.payments(&["run", "--log-format", "json", "--startup-timeout", "1s"])
            .env("AMQP_URL", format!("amqp://guest:guest@127.0.0.1:{}/{}", refusing_port(), env.vhost())),
    );
    let objects: Vec<serde_json::Value> = stderr
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}")))
        .collect();
    let last = objects.last().expect("lines");
    assert_eq!(last["level"], "ERROR", "{last}");
    let message = last["fields"]["message"].as_str().expect("a message");
    assert!(message.starts_with("payments: cannot connect to RabbitMQ"), "{message}");
}

/// Stages `payments run` with a wrong broker password: it must exit 1 with idemq's
/// one message (what failed, the URL redacted, what to check), without lapin's own
/// ERROR lines about the same refused login — unless `RUST_LOG` asks for them.
#[test]
fn a_refused_login_prints_idemqs_message_without_lapins_error_lines() {
    let env = Isolated::new();
    run_ok(&mut env.payments(&["migrate"]));
    let wrong = format!("amqp://guest:wrong-pw@127.0.0.1:5672/{}", env.vhost());
    let stderr = run_fails(env.payments(&["run"]).env("AMQP_URL", &wrong));
    assert!(
        stderr.contains("payments: cannot connect to RabbitMQ") && stderr.contains("ACCESS_REFUSED"),
        "{stderr}"
    );
    assert!(!stderr.contains("lapin"), "lapin's own lines: {stderr}");
    assert!(!stderr.contains("wrong-pw"), "{stderr}");
    let asked = run_fails(env.payments(&["run"]).env("AMQP_URL", &wrong).env("RUST_LOG", "lapin=error"));
    assert!(asked.contains("ERROR lapin::"), "RUST_LOG decides alone: {asked}");
}

/// Starts `payments run` with `args` and `vars` and stderr piped (not a terminal), waits until it
/// logs that it consumes, sends SIGTERM and returns every line it logged, once it
/// exited 0.
fn run_until_consuming_then_sigterm(env: &Isolated, args: &[&str], vars: &[(&str, &str)]) -> Vec<String> {
    run_ok(&mut env.payments(&["migrate"]));
    let mut child = env
        .payments(&[&["run"], args].concat())
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn run");
    let (logged, reader) = stderr_lines(&mut child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while !seen.iter().any(|line: &String| line.contains("consuming")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match logged.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("payments run never logged that it consumes: {seen:#?}");
            }
        }
    }
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = wait_with_timeout(&mut child, Duration::from_secs(20));
    assert!(status.success(), "exit status {status:?}: {seen:#?}");
    reader.join().expect("reader");
    seen.extend(logged.try_iter());
    seen
}

/// `payments run` with stderr redirected, no `RUST_LOG`: the CLI sets up logging
/// itself and logs, at info, what it consumes and from where (the broker's password
/// redacted) at start and that it stopped after SIGTERM — with no colour escape
/// codes, stderr being no terminal.
#[test]
fn run_logs_its_start_and_stop_without_colour_codes_when_stderr_is_no_terminal() {
    let env = Isolated::new();
    let lines = run_until_consuming_then_sigterm(&env, &[], &[]);
    let text = lines.join("\n");
    let start = lines.iter().find(|line| line.contains("INFO") && line.contains("starting")).expect(&text);
    assert!(start.contains("consumers=payments (apply_payment)"), "{start}");
    assert!(start.contains(&format!("broker=amqp://guest:***@127.0.0.1:5672/{}", env.vhost())), "{start}");
    assert!(!text.contains("guest:guest"), "the broker's password is logged: {text}");
    assert!(lines.iter().any(|line| line.contains("INFO") && line.contains("shutting down")), "{text}");
    assert!(lines.iter().any(|line| line.contains("INFO") && line.contains("stopped")), "{text}");
    assert!(!text.contains("\u{1b}["), "colour codes in a redirected log: {text:?}");
}

/// `--log-format json`, or `IDEMQ_LOG_FORMAT=json`: every line `run` logs is one JSON
/// object, with the level, the message and its fields.
#[test]
fn run_with_log_format_json_logs_one_json_object_per_line() {
    let env = Isolated::new();
    let by_flag = run_until_consuming_then_sigterm(&env, &["--log-format", "json"], &[]);
    let by_variable = run_until_consuming_then_sigterm(&env, &[], &[("IDEMQ_LOG_FORMAT", "json")]);
    for lines in [by_flag, by_variable] {
        let objects: Vec<serde_json::Value> = lines
            .iter()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}")))
            .collect();
        let start = objects
            .iter()
            .find(|object| object["fields"]["message"] == "starting")
            .unwrap_or_else(|| panic!("no start line: {lines:#?}"));
        assert_eq!(start["level"], "INFO", "{start}");
        assert_eq!(
            start["fields"]["consumers"], "payments (apply_payment), payments.stream (apply_stream_payment)",
            "{start}"
        );
        assert!(objects.iter().any(|object| object["fields"]["message"]
            .as_str()
            .is_some_and(|message| message.starts_with("stopped"))));
    }
}

/// The lines a child writes to its piped stderr, as they come (read on a thread of
/// their own, which ends when the child closes it).
fn stderr_lines(
    child: &mut std::process::Child,
) -> (std::sync::mpsc::Receiver<String>, std::thread::JoinHandle<()>) {
    use std::io::BufRead;
    let stderr = child.stderr.take().expect("piped");
    let (lines, logged) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    (logged, reader)
}
