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

    fn batch(&self, _: &idemq::observe::Batch<'_>) {
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
