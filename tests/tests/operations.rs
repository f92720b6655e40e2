//! Running it: several observers at once, and the dedup retention sweep.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AnsiTransactionManager, SimpleAsyncConnection, TransactionManager};
use idemq::{observe::Observe, observe::Settled, store::Retention, RetryPolicy};
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};
use idemq_tests::{free_addr, http_get};

#[derive(Default)]
struct Counter {
    settled: AtomicUsize,
    batches: AtomicUsize,
}

impl Observe for Counter {
    fn settled(&self, _: &Settled) {
        self.settled.fetch_add(1, Ordering::Relaxed);
    }

    fn batch(&self, _: &idemq::observe::DecidedBatch<'_>) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }
}

/// Observers add up: every subscriber hears every delivery, beside the built-in
/// stats and the recording observer `Running` adds.
#[tokio::test(flavor = "multi_thread")]
async fn every_observer_hears_every_delivery() {
    let bed = Bed::new().await;
    for i in 0..5 {
        bed.publish(&payment(100 + i)).await;
    }
    let (a, b) = (Arc::new(Counter::default()), Arc::new(Counter::default()));
    let callback = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&callback);
    let runtime = bed
        .runtime()
        .observe(Arc::clone(&a))
        .observe(Arc::clone(&b))
        .observe(idemq::observe::on_settled(move |_| {
            seen.fetch_add(1, Ordering::Relaxed);
        }))
        .consume(&bed.queue, ledger_payment);
    let running = Running::start(runtime);
    running.wait_settled(5).await;
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert_eq!(a.settled.load(Ordering::Relaxed), 5);
    assert_eq!(b.settled.load(Ordering::Relaxed), 5);
    assert_eq!(callback.load(Ordering::Relaxed), 5, "the recording observer Running adds hears them too");
    assert!(a.batches.load(Ordering::Relaxed) >= 1);
    assert_eq!(stats.applied, 5, "the built-in stats are a subscriber too");
}

/// A retention no longer than the retry horizon plus the replay window is refused
/// when the runtime is built, saying which bounds.
#[test]
fn a_retention_shorter_than_the_retry_horizon_and_replay_window_is_refused() {
    let retry = RetryPolicy::new([Duration::from_secs(3600)]);
    let short =
        Retention::keep(Duration::from_secs(86_400 + 1800)).replay_window(Duration::from_secs(86_400));
    let err = idemq::Runtime::builder()
        .retry(retry.clone())
        .retention(short)
        .consume("q", ledger_payment)
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("too short") && err.contains("replay window"), "{err}");
    // Durations as they are written in the settings: `1d 30m`, never `1day 30m`.
    assert!(err.contains("a retention of 1d 30m is too short"), "{err}");
    assert!(err.contains("replayed for 1d (the replay window)"), "{err}");
    let long = Retention::keep(Duration::from_secs(3 * 86_400)).replay_window(Duration::from_secs(86_400));
    assert!(idemq::Runtime::builder()
        .retry(retry)
        .retention(long)
        .consume("q", ledger_payment)
        .build()
        .is_ok());
}

async fn count(bed: &Bed, sql: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    let mut conn = bed.db.connect().await;
    diesel::dsl::sql::<diesel::sql_types::BigInt>(sql).get_result(&mut conn).await.expect(sql)
}

/// The sweep deletes rows past the retention, in batches, and keeps the rest.
#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_deletes_what_is_past_the_retention_and_keeps_the_rest() {
    let bed = Bed::new().await;
    let mut conn = bed.db.connect().await;
    conn.batch_execute(
        "INSERT INTO idemq_dedup (handler, key, processed_at)
             SELECT 'h', 'old-' || i, now() - interval '40 days' FROM generate_series(1, 25) AS i;
         INSERT INTO idemq_dedup (handler, key) SELECT 'h', 'new-' || i FROM generate_series(1, 5) AS i;
         INSERT INTO idemq_copies (copy_id, copied_at) VALUES ('old-copy', now() - interval '40 days'), ('new-copy', now());",
    )
    .await
    .expect("seed the rows");
    let retention =
        Retention::keep(Duration::from_secs(30 * 86_400)).batch(10).check([&RetryPolicy::default()]).unwrap();
    let sweep = idemq::store::sweep(&mut conn, &retention).await.expect("sweep");
    assert_eq!((sweep.dedup_rows, sweep.copy_records, sweep.yielded), (25, 1, false), "{sweep:?}");
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_dedup").await, 5);
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_copies").await, 1);
}

/// The public sweep is the one way besides the runtime to delete dedup rows, and a 1 s
/// retention beside a retry policy whose copy comes back an hour later would delete the
/// row that copy needs (it would apply twice). The check refuses that retention with
/// the very error `build` gives and deletes nothing (`sweep` takes only what the check
/// let through: an unchecked `Retention` does not compile, see `CheckedRetention`); a
/// retention longer than the floor sweeps the old rows and keeps the young.
#[tokio::test(flavor = "multi_thread")]
async fn the_public_sweep_refuses_a_retention_build_refuses_and_deletes_nothing() {
    let bed = Bed::new().await;
    let mut conn = bed.db.connect().await;
    conn.batch_execute(
        "INSERT INTO idemq_dedup (handler, key, processed_at)
             SELECT 'h', 'old-' || i, now() - interval '3 days' FROM generate_series(1, 4) AS i;
         INSERT INTO idemq_dedup (handler, key, processed_at) VALUES ('h', 'a-minute-old', now() - interval '1 minute');",
    )
    .await
    .expect("seed the rows");
    let retry = RetryPolicy::new([Duration::from_secs(3600)]);
    let short = Retention::keep(Duration::from_secs(1));

    let refused = short.check([&retry]).expect_err("a 1 s retention is refused");
    let built = idemq::Runtime::builder()
        .retry(retry.clone())
        .retention(short)
        .consume("q", ledger_payment)
        .build()
        .expect_err("build refuses it too");
    assert!(matches!(refused, idemq::Error::Config(_)), "{refused:?}");
    assert_eq!(refused.to_string(), built.to_string(), "the same error as build's");
    assert!(refused.to_string().contains("too short"), "{refused}");
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_dedup").await, 5, "nothing deleted");

    let floor_passed = Retention::keep(Duration::from_secs(2 * 86_400))
        .replay_window(Duration::from_secs(86_400))
        .check([&retry])
        .expect("longer than an hour of retries and a day of replays");
    let sweep = idemq::store::sweep(&mut conn, &floor_passed).await.expect("sweep");
    assert_eq!((sweep.dedup_rows, sweep.yielded), (4, false), "{sweep:?}");
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_dedup").await, 1, "the young row is kept");
}

/// One sweeper at a time: while another holds the lock, a sweep deletes nothing and
/// says it yielded. The lock is transaction-scoped, so it never stays behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_sweep_yields_to_one_already_running() {
    let bed = Bed::new().await;
    let mut holder = bed.db.connect().await;
    let mut conn = bed.db.connect().await;
    conn.batch_execute("INSERT INTO idemq_dedup (handler, key, processed_at) VALUES ('h', 'old', now() - interval '40 days')")
        .await
        .expect("seed");
    AnsiTransactionManager::begin_transaction(&mut holder).await.expect("begin");
    holder
        .batch_execute(&format!("SELECT pg_advisory_xact_lock({})", idemq::store::GC_LOCK))
        .await
        .expect("lock");
    let retention =
        Retention::keep(Duration::from_secs(30 * 86_400)).check([&RetryPolicy::default()]).unwrap();
    let sweep = idemq::store::sweep(&mut conn, &retention).await.expect("sweep");
    assert!(sweep.yielded && sweep.dedup_rows == 0, "{sweep:?}");
    AnsiTransactionManager::commit_transaction(&mut holder).await.expect("end the holder's transaction");
    let sweep = idemq::store::sweep(&mut conn, &retention).await.expect("sweep");
    assert_eq!((sweep.dedup_rows, sweep.yielded), (1, false), "{sweep:?}");
}

#[derive(Default)]
struct Swept(AtomicUsize);

impl Observe for Swept {
    fn swept(&self, sweep: &idemq::observe::Sweep) {
        self.0.fetch_add(usize::try_from(sweep.dedup_rows).unwrap_or(0), Ordering::Relaxed);
    }
}

/// A runtime with a retention sweeps in the background from its start.
#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_with_a_retention_sweeps_in_the_background() {
    let bed = Bed::new().await;
    let mut conn = bed.db.connect().await;
    conn.batch_execute("INSERT INTO idemq_dedup (handler, key, processed_at) VALUES ('h', 'old', now() - interval '400 days')")
        .await
        .expect("seed");
    let swept = Arc::new(Swept::default());
    let retention = Retention::keep(Duration::from_secs(60 * 86_400));
    let running = Running::start(
        bed.runtime().retention(retention).observe(Arc::clone(&swept)).consume(&bed.queue, ledger_payment),
    );
    idemq_tests::eventually("the old row swept", Duration::from_secs(20), || async {
        swept.0.load(Ordering::Relaxed) == 1
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(count(&bed, "SELECT count(*) FROM idemq_dedup").await, 0);
}

/// With an HTTP address, the runtime serves Prometheus metrics — every series at zero
/// from the start, labelled with the queue and its handler — and health: `/healthz` always, `/readyz` once connected.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_and_health_are_served_on_the_http_address() {
    let bed = Bed::new().await;
    let addr = free_addr();
    let running = Running::start(bed.runtime().http_addr(addr).consume(&bed.queue, ledger_payment));
    let queue = bed.queue.clone();
    let zero = format!("idemq_deliveries_total{{queue=\"{queue}\",handler=\"apply_payment\",outcome=\"applied\",kind=\"\"}} 0");
    idemq_tests::eventually("the idle metrics", Duration::from_secs(20), || {
        let zero = zero.clone();
        async move {
            tokio::task::spawn_blocking(move || http_get(addr, "/metrics"))
                .await
                .expect("get")
                .contains(&zero)
        }
    })
    .await;
    let idle = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.expect("get");
    for series in [
        "idemq_reconnects_total 0",
        "idemq_outbox_backlog",
        "idemq_outbox_replies_expired_total 0",
        "idemq_dedup_rows_deleted_total 0",
    ] {
        assert!(idle.contains(series), "{series} missing:\n{idle}");
    }
    assert!(idle.contains("kind=\"poison\""), "every kind at zero:\n{idle}");
    idemq_tests::eventually("ready", Duration::from_secs(20), || async move {
        tokio::task::spawn_blocking(move || http_get(addr, "/readyz"))
            .await
            .expect("get")
            .lines()
            .next()
            .is_some_and(|status| status.contains(" 200"))
    })
    .await;
    assert!(tokio::task::spawn_blocking(move || http_get(addr, "/healthz"))
        .await
        .expect("get")
        .lines()
        .next()
        .is_some_and(|status| status.contains(" 200")));
    let payment = payment(100);
    bed.publish(&payment).await;
    bed.publish(&payment).await;
    running.wait_settled(2).await;
    let busy = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.expect("get");
    running.stop().await.expect("clean shutdown");
    for series in [
        format!("idemq_deliveries_total{{queue=\"{queue}\",handler=\"apply_payment\",outcome=\"applied\",kind=\"\"}} 1"),
        format!("idemq_deliveries_total{{queue=\"{queue}\",handler=\"apply_payment\",outcome=\"duplicate\",kind=\"\"}} 1"),
        format!("idemq_delivery_duration_seconds_count{{queue=\"{queue}\",handler=\"apply_payment\"}} 2"),
        format!("idemq_handler_duration_seconds_count{{queue=\"{queue}\",handler=\"apply_payment\"}} 1"),
        format!("idemq_commit_duration_seconds_count{{queue=\"{queue}\",handler=\"apply_payment\"}} 1"),
        format!("idemq_in_flight{{queue=\"{queue}\",handler=\"apply_payment\"}} 0"),
        format!("idemq_contended_batches_total{{queue=\"{queue}\",handler=\"apply_payment\"}} 0"),
        format!("idemq_batch_width{{queue=\"{queue}\",handler=\"apply_payment\"}} "),
    ] {
        assert!(busy.contains(&series), "{series} missing:\n{busy}");
    }
}

/// `.prefetch(n)` (the CLI's `--prefetch`) is each consumer's prefetch, instead of
/// `concurrency × batch_size`.
#[tokio::test(flavor = "multi_thread")]
async fn prefetch_sets_each_consumers_prefetch() {
    let bed = Bed::isolated().await;
    let vhost = bed.vhost.as_ref().expect("isolated").name().to_owned();
    let running = Running::start(bed.runtime().prefetch(7).consume(&bed.queue, ledger_payment));
    let listed = || {
        let output = std::process::Command::new("rabbitmqctl")
            .args(["list_consumers", "-p", &vhost, "queue_name", "prefetch_count", "-q"])
            .output()
            .expect("rabbitmqctl");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let queue = bed.queue.clone();
    idemq_tests::eventually("the consumer with prefetch 7", Duration::from_secs(20), || {
        let text = listed();
        let queue = queue.clone();
        async move { text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == [queue.as_str(), "7"]) }
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert!(idemq::Runtime::builder().prefetch(0).consume("q", ledger_payment).build().is_err());
}

/// `<app> --version` prints the application's name and the version it gave, and
/// exits 0; without `Cli::version` it is idemq's.
#[tokio::test]
async fn version_prints_the_apps_name_and_version_and_exits_zero() {
    use idemq::cli::{clap::error::ErrorKind, Cli};
    use std::process::ExitCode;

    let cli = Cli::new("payments", idemq::Runtime::builder()).version("3.1.4");
    let shown = cli.command().try_get_matches_from(["payments", "--version"]).expect_err("--version");
    assert_eq!(shown.kind(), ErrorKind::DisplayVersion);
    assert_eq!(shown.to_string(), "payments 3.1.4\n");
    assert_eq!(cli.run_from(["payments", "--version"]).await, ExitCode::SUCCESS);

    let default = Cli::new("app", idemq::Runtime::builder()).command().render_version();
    assert_eq!(default, format!("app {}\n", env!("CARGO_PKG_VERSION")), "idemq's own version");
}

// ---------------------------------------------------------------------------
// The CLI's `status`, `declare` and `dlq show`, run as an operator runs them: the
// payments app (its queue `payments`, the events queue `payments.applied` bound to
// the exchange `payments.events`, the stream `payments.stream`), in a vhost and a
// database of the test's own.
// ---------------------------------------------------------------------------

const APP: &str = env!("CARGO_BIN_EXE_payments-app");

/// Where the app connects: a vhost and a database of the test's own.
struct Place {
    db: idemq_tests::TestDb,
    vhost: idemq_tests::TestVhost,
    broker: idemq_tests::Broker,
}

impl Place {
    async fn new() -> Place {
        let db = idemq_tests::TestDb::create().await;
        let vhost = idemq_tests::TestVhost::create().await;
        let broker = idemq_tests::Broker::connect(&vhost.amqp_url()).await;
        Place { db, vhost, broker }
    }

    fn env(&self) -> [(&'static str, String); 2] {
        [("AMQP_URL", self.vhost.amqp_url()), ("DATABASE_URL", self.db.url())]
    }

    /// Runs `payments-app args` to its end (at most 60 s): its exit code and stdout.
    async fn cli(&self, args: &[&str]) -> (Option<i32>, String) {
        let mut command = tokio::process::Command::new(APP);
        command.args(args).envs(self.env()).env("RUST_LOG", "warn").env_remove("IDEMQ_CONFIG");
        command.kill_on_drop(true);
        let output = idemq_tests::with_timeout(
            &format!("payments-app {args:?}"),
            Duration::from_secs(60),
            command.output(),
        )
        .await
        .expect("spawn payments-app");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.code() != Some(2) && output.status.code() != Some(101),
            "{args:?}: {stdout}{stderr}"
        );
        (output.status.code(), stdout)
    }

    /// [`Place::cli`] that must exit 0: its stdout.
    async fn cli_ok(&self, args: &[&str]) -> String {
        let (code, stdout) = self.cli(args).await;
        assert_eq!(code, Some(0), "{args:?}:\n{stdout}");
        stdout
    }

    /// `payments-app run`, in the background.
    fn run(&self) -> idemq_tests::app::App {
        let env = self.env();
        let env: Vec<(&str, &str)> = env.iter().map(|(name, value)| (*name, value.as_str())).collect();
        idemq_tests::app::App::spawn(APP, &["run"], &env)
    }

    /// Publishes `payments` to the stream, confirmed.
    async fn publish_to_stream(&self, payments: &[idemq_example_payments::PaymentRequested]) {
        let props = lapin::BasicProperties::default().with_content_type("application/json".into());
        for payment in payments {
            let body = serde_json::to_vec(payment).expect("serialize");
            self.broker.publish_bytes(idemq_example_payments::STREAM, &body, props.clone()).await;
        }
    }

    /// The stored offset of the app's stream handler, once its table and row exist.
    async fn stream_offset(&self) -> Option<i64> {
        let there = "SELECT count(*) FROM pg_tables WHERE tablename = 'idemq_stream_offsets'";
        if self.db.count(there).await == 0 {
            return None;
        }
        let offset = "SELECT coalesce(max(last_offset), -2) FROM idemq_stream_offsets WHERE stream = 'payments.stream'";
        Some(self.db.count(offset).await)
    }
}

/// The line of `output` that starts with `start` (its indent trimmed), or a panic
/// showing all of it.
fn line<'a>(output: &'a str, start: &str) -> &'a str {
    let found = output.lines().map(str::trim_start).find(|l| l.starts_with(start));
    found.unwrap_or_else(|| panic!("no line {start:?}:\n{output}"))
}

/// Issue 37, friction 3: `status` showed a stream read to its end as `60 ready, 0
/// consumers`, which says nothing (a stream keeps what is read). Stages a stream of
/// 60 payments consumed by the app, then 5 more published while it is stopped: the
/// stream's line must show no ready count, the stream's end, and for its handler the
/// stored offset, the lag in messages (0, then 5) and the owner (the app's PostgreSQL
/// session, then none).
#[tokio::test(flavor = "multi_thread")]
async fn status_shows_a_streams_end_and_each_handlers_offset_lag_and_owner_not_a_ready_count() {
    let place = Place::new().await;
    idemq_tests::app::declare_topology(&place.broker).await;
    let first: Vec<_> = (0..60).map(|i| payment(1 + i)).collect();
    place.publish_to_stream(&first).await;
    let mut app = place.run();
    idemq_tests::eventually("the stream consumed to its end", Duration::from_secs(60), || {
        app.assert_running();
        async { place.stream_offset().await == Some(59) }
    })
    .await;

    let running = place.cli_ok(&["status"]).await;
    let stream = line(&running, "payments.stream ");
    assert_eq!(stream.split_whitespace().nth(1), Some("stream"), "no ready count for a stream:\n{running}");
    assert!(line(&running, "end:").contains("end: offset 59; offsets 0–59 kept (60 messages)"), "{running}");
    let handler = line(&running, "apply_stream_payment:");
    assert!(handler.contains("applied up to offset 59, lag 0;"), "{running}");
    assert!(handler.contains("owned by the PostgreSQL session of pid "), "the app owns it:\n{running}");
    let nonzero = place.cli_ok(&["status", "--nonzero"]).await;
    assert!(!nonzero.contains("payments.stream"), "a stream read to its end is fine:\n{nonzero}");

    let (status, stderr) = app.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "run exited {status}: {stderr}");
    let more: Vec<_> = (0..5).map(|i| payment(100 + i)).collect();
    place.publish_to_stream(&more).await;
    let stopped = place.cli_ok(&["status", "--nonzero"]).await;
    assert!(line(&stopped, "end:").contains("end: offset 64"), "{stopped}");
    let handler = line(&stopped, "apply_stream_payment:");
    assert!(handler.contains("applied up to offset 59, lag 5 (its offset last moved "), "{stopped}");
    assert!(handler.contains("owned by no process now"), "{stopped}");
}

/// Issue 37, friction 5: `dlq show` printed the DLQ's `x-delivery-count` among the
/// letter's headers, and each browse adds one to it (4 for a letter dead-lettered
/// once). Stages a letter dead-lettered once and shown three times: the headers must
/// not carry the broker's count as the letter's, a labelled line must say what it
/// counts, and the history comes from idemq's headers — then, replayed and
/// dead-lettered again, twice and replayed once.
#[tokio::test(flavor = "multi_thread")]
async fn dlq_show_says_how_often_a_letter_was_dead_lettered_and_labels_the_browse_count() {
    let place = Place::new().await;
    idemq_tests::app::declare_topology(&place.broker).await;
    let props = lapin::BasicProperties::default().with_message_id("not-json-1".into());
    place.broker.publish_bytes(idemq_example_payments::QUEUE, b"this is not json", props).await;
    let dead_letter_once = |times: u32| {
        let place = &place;
        async move {
            let mut app = place.run();
            idemq_tests::eventually("the letter dead-lettered", Duration::from_secs(60), || {
                app.assert_running();
                async { place.broker.message_count("payments.dlq").await == 1 }
            })
            .await;
            let (status, stderr) = app.terminate(Duration::from_secs(20)).await;
            assert!(status.success(), "run #{times} exited {status}: {stderr}");
        }
    };
    dead_letter_once(1).await;

    for _ in 0..2 {
        place.cli_ok(&["dlq", "show", "1"]).await;
    }
    let shown = place.cli_ok(&["dlq", "show", "1"]).await;
    assert!(
        !shown.lines().any(|l| l.trim_start().starts_with("x-delivery-count:")),
        "the browse count shown as the letter's header:\n{shown}"
    );
    assert!(line(&shown, "dead-lettered:").contains("dead-lettered: 1 time, never replayed"), "{shown}");
    let browsed = line(&shown, "browsed before:");
    assert!(browsed.starts_with("browsed before: 2 times (the DLQ's x-delivery-count"), "{shown}");
    assert!(browsed.contains("says nothing of how often the message failed"), "{shown}");

    let replayed = place.cli_ok(&["dlq", "replay"]).await;
    assert!(replayed.contains("replayed 1 dead letters to 'payments'"), "{replayed}");
    dead_letter_once(2).await;
    let shown = place.cli_ok(&["dlq", "show", "1"]).await;
    assert!(
        line(&shown, "dead-lettered:").contains("dead-lettered: 2 times, replayed 1 time (x-idemq-replay)"),
        "{shown}"
    );
    assert!(!shown.contains("browsed before:"), "a replayed letter is browsed for the first time:\n{shown}");
}

/// Issue 37, friction 7: `status` and `declare` printed a line for every queue,
/// dead-letter queue and wait queue (~70 for 11 queues, nearly all zero), and never
/// checked the exchanges. Stages the app's topology declared, then its exchange
/// deleted, two retries waiting and a dead letter: each must fold a queue's
/// dead-letter and wait queues into its line, `declare --missing` and `status
/// --nonzero` must keep only what is not fine, and the missing exchange must be named.
#[tokio::test(flavor = "multi_thread")]
async fn status_and_declare_print_a_line_per_queue_name_a_missing_exchange_and_filter_what_is_fine() {
    let place = Place::new().await;
    let dry = place.cli_ok(&["declare", "--missing"]).await;
    assert!(line(&dry, "queue payments ").contains("missing: would be declared"), "{dry}");
    assert!(line(&dry, "wait payments.retry.1000ms").contains("missing: would be declared"), "{dry}");
    assert!(line(&dry, "exchange payments.events").contains("missing: would be declared"), "{dry}");
    place.cli_ok(&["declare", "--apply"]).await;
    place.cli_ok(&["migrate"]).await;

    let declared = place.cli_ok(&["declare"]).await;
    let queues: Vec<&str> = declared.lines().filter(|l| l.starts_with("queue ")).collect();
    assert_eq!(queues.len(), 3, "one line per queue:\n{declared}");
    assert!(
        line(&declared, "queue payments ").ends_with(
            "exists; its dead-letter queue and 5 retry wait queues (1s, 5s, 30s, 2m, 10m) exist too"
        ),
        "{declared}"
    );
    assert!(line(&declared, "exchange payments.events").ends_with("exists"), "{declared}");
    assert!(declared.lines().last().is_some_and(|l| l.starts_with("all exist: 3 queues")), "{declared}");
    assert_eq!(place.cli_ok(&["declare", "--missing"]).await.lines().count(), 1, "only the summary");

    let channel = place.broker.connection().create_channel().await.expect("a channel");
    channel
        .exchange_delete("payments.events".into(), lapin::options::ExchangeDeleteOptions::default())
        .await
        .expect("delete the exchange");
    let _ = channel.close(200, "deleted".into()).await;
    for _ in 0..2 {
        place.broker.publish_json("payments.retry.600000ms", &serde_json::json!({})).await;
    }
    place.broker.publish_json("payments.dlq", &serde_json::json!({})).await;

    let missing = place.cli_ok(&["declare", "--missing"]).await;
    assert_eq!(missing.lines().count(), 3, "the exchange, its binding, the summary:\n{missing}");
    assert!(line(&missing, "exchange payments.events").contains("missing: would be declared"), "{missing}");
    assert!(line(&missing, "1 missing;").contains("`declare --apply` declares them"), "{missing}");

    let status = place.cli_ok(&["status"]).await;
    let row = line(&status, "payments ");
    assert_eq!(
        row.split_whitespace().take(5).collect::<Vec<_>>(),
        ["payments", "0", "0", "1", "2"],
        "{status}"
    );
    assert!(row.ends_with("consumed by apply_payment; retries wait 1s, 5s, 30s, 2m, 10m"), "{status}");
    let waiting = line(&status, "payments.retry.600000ms");
    assert_eq!(waiting.split_whitespace().nth(1), Some("2"), "{status}");
    assert!(!status.contains("payments.retry.1000ms"), "an empty wait queue gets no line:\n{status}");
    assert!(!status.contains("payments.dlq"), "the dead letters are a column:\n{status}");
    assert!(
        line(&status, "exchange payments.events")
            .starts_with("exchange payments.events missing: publishing to it fails"),
        "{status}"
    );
    assert!(status.lines().count() <= 12, "{status}");

    let nonzero = place.cli_ok(&["status", "--nonzero"]).await;
    assert!(line(&nonzero, "payments ").contains("consumed by apply_payment"), "{nonzero}");
    for fine in ["payments.applied", "payments.stream", "exchanges:"] {
        assert!(!nonzero.contains(fine), "{fine} is fine, yet shown:\n{nonzero}");
    }
    for kept in
        ["payments.retry.600000ms", "exchange payments.events missing", "dedup rows: 0", "outbox backlog:"]
    {
        assert!(nonzero.contains(kept), "{kept} missing:\n{nonzero}");
    }
}

/// `console` serves the console without a consumer: the code's handlers and their
/// settings, read-only, to loopback. Listening beyond loopback without a token, it
/// serves nothing, saying how to set one; with the token, it serves the pages to a
/// request that presents it.
#[tokio::test(flavor = "multi_thread")]
async fn the_console_command_serves_the_pages_alone_and_nothing_beyond_loopback_without_a_token() {
    let place = Place::new().await;
    let env = place.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    let addr = idemq_tests::free_addr();
    let local = idemq_tests::app::App::spawn(APP, &["console", "--addr", &addr.to_string()], &env);
    let page = wait_for_page(addr, "/console").await;
    assert!(page.starts_with("HTTP/1.0 200"), "{page}");
    assert!(page.contains("apply_payment") && page.contains("runs without a consumer"), "{page}");
    assert!(page.contains("lane by account"), "the handler's settings: {page}");
    drop(local);

    let everywhere = std::net::SocketAddr::from(([0, 0, 0, 0], idemq_tests::free_addr().port()));
    let open = idemq_tests::app::App::spawn(APP, &["console", "--addr", &everywhere.to_string()], &env);
    let reached = std::net::SocketAddr::from(([127, 0, 0, 1], everywhere.port()));
    let page = wait_for_page(reached, "/console/dead-letters").await;
    assert!(page.starts_with("HTTP/1.0 403") && page.contains("IDEMQ_CONSOLE_TOKEN"), "{page}");
    drop(open);

    let mut env = env.clone();
    env.push(("IDEMQ_CONSOLE_TOKEN", "t0ken"));
    let everywhere = std::net::SocketAddr::from(([0, 0, 0, 0], idemq_tests::free_addr().port()));
    let guarded = idemq_tests::app::App::spawn(APP, &["console", "--addr", &everywhere.to_string()], &env);
    let reached = std::net::SocketAddr::from(([127, 0, 0, 1], everywhere.port()));
    let page = wait_for_page(reached, "/console").await;
    assert!(page.starts_with("HTTP/1.0 401") && page.contains("name=\"token\""), "the login form: {page}");
    drop(guarded);
}

/// `GET path` once the console answers (30 s at most): the whole answer.
async fn wait_for_page(addr: std::net::SocketAddr, path: &str) -> String {
    let mut answer = String::new();
    idemq_tests::eventually(&format!("the console on {addr}"), Duration::from_secs(30), || {
        answer = idemq_tests::http_get(addr, path);
        let answered = !answer.is_empty();
        async move { answered }
    })
    .await;
    answer
}
