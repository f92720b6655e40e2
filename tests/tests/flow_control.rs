//! Flow control: a handler whose dependency is down is paused by its kill switch
//! instead of spending its messages' retries and filling the dead-letter queue.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use idemq::observe::{KillSwitchEvent, Observe};
use idemq::{idempotent_handler, KillSwitch, Outcome, RetryPolicy};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};

/// When the ledger service of [`ledger_behind_a_service`] is back.
static SERVICE_BACK_AT: OnceLock<Instant> = OnceLock::new();

/// Records the payment, once "the ledger service" answers: until
/// [`SERVICE_BACK_AT`] every attempt fails transiently, as a handler calling a
/// service that is down does.
#[idempotent_handler(key = "payment_id")]
async fn ledger_behind_a_service(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), std::io::Error> {
    if SERVICE_BACK_AT.get().is_none_or(|back| Instant::now() < *back) {
        return Err(std::io::Error::other("the ledger service is down (connection refused)"));
    }
    record_payment(conn, &msg).await.map_err(std::io::Error::other)
}

/// Each kill switch change: open (with its pause) or closed.
#[derive(Default)]
struct Switches(Mutex<Vec<Option<Duration>>>);

impl Observe for Switches {
    fn kill_switch(&self, event: &KillSwitchEvent<'_>) {
        self.0.lock().unwrap().push(event.open_for);
    }
}

/// Three attempts within three seconds: without a kill switch, a 30 s outage
/// spends them all.
fn three_quick_attempts() -> RetryPolicy {
    RetryPolicy::new([1, 2].map(Duration::from_secs))
}

/// A dependency down for 30 s: with the kill switch, the handler trips, its queue
/// waits, one message is tried after each pause, and once the service is back
/// every message is applied exactly once — no dead letter. The same backlog
/// beside it without a switch (the control) is dead-lettered: the test tells
/// the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dependency_down_for_30_seconds_dead_letters_nothing_and_every_message_applies_once() {
    const MESSAGES: usize = 200;
    let (guarded, control) = (Bed::new().await, Bed::new().await);
    let payments: Vec<PaymentRequested> = (0..MESSAGES).map(|i| payment(1_000 + i as i64)).collect();
    for p in &payments {
        guarded.publish(p).await;
        control.publish(p).await;
    }
    SERVICE_BACK_AT.set(Instant::now() + Duration::from_secs(30)).expect("one outage per process");

    let switch = KillSwitch::default().window(Duration::from_secs(10)).pause(Duration::from_secs(2));
    let switches = Arc::new(Switches::default());
    let http = idemq_tests::free_addr();
    let guarded_run = Running::start(
        guarded
            .runtime()
            .consume_with(&guarded.queue, ledger_behind_a_service, three_quick_attempts())
            .kill_switch(switch)
            .http_addr(http)
            .observe(Arc::clone(&switches)),
    );
    let control_run = Running::start(control.runtime().consume_with(
        &control.queue,
        ledger_behind_a_service,
        three_quick_attempts(),
    ));

    // While it is open, the operator sees it: /readyz (still ready) and /metrics.
    idemq_tests::eventually("the kill switch opened", Duration::from_secs(30), || async {
        !switches.0.lock().unwrap().is_empty()
    })
    .await;
    let get = |path: &'static str| tokio::task::spawn_blocking(move || idemq_tests::http_get(http, path));
    let ready = get("/readyz").await.expect("get");
    assert!(ready.lines().next().is_some_and(|status| status.contains(" 200")), "still ready: {ready}");
    assert!(
        ready.contains(&format!(
            "handler ledger_behind_a_service ({}): paused by its kill switch",
            guarded.queue
        )),
        "{ready}"
    );
    let metrics = get("/metrics").await.expect("get");
    let open = format!(
        "idemq_kill_switch_open{{queue=\"{}\",handler=\"ledger_behind_a_service\"}} 1",
        guarded.queue
    );
    assert!(metrics.contains(&open), "{open} in {metrics}");

    let applied = |events: &[idemq::observe::Settled]| applied_at(events).len();
    idemq_tests::eventually("every guarded message applied", Duration::from_secs(90), || async {
        applied(&guarded_run.events()) >= MESSAGES
    })
    .await;
    let events = guarded_run.events();
    let failed = events.iter().filter(|e| matches!(e.outcome, Outcome::Retry { .. })).count();
    let dead: Vec<_> = events.iter().filter(|e| matches!(e.outcome, Outcome::DeadLettered { .. })).collect();
    let switches = switches.0.lock().unwrap().clone();
    let run = format!("{failed} failed attempts; switch changes {switches:?}");
    guarded_run.stop().await.expect("clean shutdown");

    assert!(dead.is_empty(), "no dead letter through the outage ({run}): {dead:?}");
    assert_eq!(guarded.broker.message_count(&guarded.dlq).await, 0);
    assert_eq!(applied(&events), MESSAGES, "{run}");
    assert_eq!(guarded.ledger_total().await, MESSAGES as i64, "every payment recorded");
    assert!(guarded.doubled().await.is_empty(), "none twice");
    // The switch stopped the attempts: the messages in flight when it tripped and
    // one try per pause, not three attempts for each of the 200.
    assert!(
        failed < MESSAGES / 2,
        "{failed} failed attempts (a control without the switch makes {}): the switch did not hold the queue",
        MESSAGES * 3
    );

    // It opened for 2 s, then each failed try doubled the pause (at most 16 s),
    // and it closed once the service was back.
    assert_eq!(switches.first(), Some(&Some(Duration::from_secs(2))), "{switches:?}");
    assert_eq!(switches.last(), Some(&None), "closed at the end: {switches:?}");
    let pauses: Vec<Duration> = switches.iter().flatten().copied().collect();
    assert!(pauses.windows(2).all(|p| p[1] == (p[0] * 2).min(Duration::from_secs(16))), "{switches:?}");

    // Without the switch, the same outage spends every message's attempts.
    idemq_tests::eventually("the control's messages dead-lettered", Duration::from_secs(30), || async {
        control.broker.message_count(&control.dlq).await > 0
    })
    .await;
    control_run.stop().await.expect("clean shutdown");
    for bed in [&guarded, &control] {
        for (wait_queue, _) in three_quick_attempts().wait_queues(&bed.queue) {
            bed.broker.delete_queue(&wait_queue).await;
        }
    }
}

/// Records the payment; no lane (its batches are formed from what has arrived).
#[idempotent_handler(key = "payment_id")]
async fn record_unlaned(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    record_payment(conn, &msg).await
}

/// When each of `events` that was applied was settled.
fn applied_at(events: &[idemq::observe::Settled]) -> Vec<Instant> {
    events.iter().filter(|e| e.outcome == Outcome::Applied).map(|e| e.settled_at).collect()
}

/// How many of `events` were applied within `window` of the first one applied.
fn applied_within(events: &[idemq::observe::Settled], window: Duration) -> usize {
    let applied = applied_at(events);
    let Some(first) = applied.iter().min().copied() else { return 0 };
    applied.iter().filter(|at| at.duration_since(first) <= window).count()
}

/// A rate limit holds within 10 % over a minute, under group commit (batches of
/// up to 64 formed from a backlog) and with lanes alike: a backlog far above the
/// limit, 20 per second for a minute is 1,200 (plus the bucket's first second).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rate_limit_holds_within_ten_percent_over_a_minute_with_batches_and_lanes() {
    const PER_SECOND: u32 = 20;
    const BACKLOG: usize = 1_600;
    let (batched, laned) = (Bed::new().await, Bed::new().await);
    for i in 0..BACKLOG {
        let p = payment(2_000 + i as i64);
        batched.publish(&p).await;
        laned.publish(&p).await;
    }
    let runs = [
        Running::start(
            batched
                .runtime()
                .batch_size(64)
                .consume(&batched.queue, record_unlaned)
                .rate_limit("record_unlaned", PER_SECOND),
        ),
        Running::start(
            laned
                .runtime()
                .batch_size(64)
                .consume(&laned.queue, ledger_payment)
                .rate_limit("apply_payment", PER_SECOND),
        ),
    ];
    let minute = Duration::from_secs(60);
    for run in &runs {
        idemq_tests::eventually("a minute of deliveries applied", Duration::from_secs(120), || async {
            let applied = applied_at(&run.events());
            let (Some(first), Some(last)) = (applied.iter().min(), applied.iter().max()) else {
                return false;
            };
            last.duration_since(*first) > minute
        })
        .await;
    }
    let expected = f64::from(PER_SECOND) * 60.0;
    for (run, shape) in runs.iter().zip(["batches", "lanes"]) {
        let applied = applied_within(&run.events(), minute);
        let ratio = applied as f64 / expected;
        eprintln!(
            "{shape}: {applied} applied in the first minute at {PER_SECOND}/s ({ratio:.3} of {expected})"
        );
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{shape}: {applied} applied in a minute at {PER_SECOND}/s: {ratio:.3} of {expected}"
        );
    }
    for run in runs {
        run.stop().await.expect("clean shutdown");
    }
    assert!(batched.doubled().await.is_empty() && laned.doubled().await.is_empty(), "none twice");
}

/// Handler calls running now, and the most seen at once.
static RUNNING: (std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize) =
    (std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0));

/// Records the payment, taking 20 ms, and counts how many calls overlap.
#[idempotent_handler(key = "payment_id")]
async fn counts_overlap(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), diesel::result::Error> {
    use std::sync::atomic::Ordering::SeqCst;
    let now = RUNNING.0.fetch_add(1, SeqCst) + 1;
    RUNNING.1.fetch_max(now, SeqCst);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let recorded = record_payment(conn, &msg).await;
    RUNNING.0.fetch_sub(1, SeqCst);
    recorded
}

/// `handler_concurrency(name, 1)` holds the handler to one transaction at a time
/// though the runtime's concurrency is 8 and a backlog waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handler_concurrency_holds_a_handler_to_its_transactions_at_once() {
    let bed = Bed::new().await;
    for i in 0..40 {
        bed.publish(&payment(3_000 + i)).await;
    }
    let builder = bed
        .runtime()
        .batch_size(1)
        .consume(&bed.queue, counts_overlap)
        .handler_concurrency("counts_overlap", 1);
    let events = Running::settle(builder, 40).await;
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(RUNNING.1.load(std::sync::atomic::Ordering::SeqCst), 1, "one call at a time");
    assert_eq!(bed.ledger_total().await, 40);
}
