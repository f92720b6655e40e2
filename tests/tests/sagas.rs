//! Sagas against the real broker and database: every step once under duplicates,
//! redeliveries and two consumers racing on one saga; the policies for a saga that
//! does not exist or has finished; timeouts that fire once through the relay, or
//! never when the saga completed first; a thousand sagas under the chaos faults.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::saga::Saga;
use idemq::testing::fault::{FaultContext, FaultHook, FaultHookExt, FaultPoint};
use idemq::testing::{TestKit, TestMessage};
use idemq::{idempotent_handler, Context, FailureKind, HandlerError, Message, Outcome};
use idemq_tests::fixture::{Bed, Running};
use idemq_tests::{eventually, in_both_modes, Broker};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::FieldTable;
use serde::{Deserialize, Serialize};

/// One tick of a tally: the `n`-th of `of`. Every tick may start the tally.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "tally.tick", exchange = "tally", routing_key = "steps")]
struct Tick {
    tally: String,
    n: u32,
    of: u32,
    /// With the tally's first step, a timeout this many ms ahead (0: none).
    timeout_ms: u64,
}

/// Closes a tally early (completes it).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "tally.close", exchange = "tally", routing_key = "steps")]
struct Close {
    tally: String,
}

/// The tally's timeout, scheduled by its first step.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(type = "tally.timeout", exchange = "tally", routing_key = "steps")]
struct TallyTimeout {
    tally: String,
}

/// A tally: the ticks it counted, in the order it took them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "tally", key = "tally", takes(Tick, Close, TallyTimeout))]
struct Tally {
    count: u32,
    seen: Vec<u32>,
    timed_out: u32,
}

/// Counts a tick; completes the tally at its last.
#[idempotent_handler(key = "{tally}:{n}", saga(start))]
async fn tick(
    _conn: &mut AsyncPgConnection,
    msg: Tick,
    saga: &mut Saga<Tally>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    if saga.is_new() && msg.timeout_ms > 0 {
        saga.schedule(
            ctx,
            &TallyTimeout { tally: msg.tally.clone() },
            Duration::from_millis(msg.timeout_ms),
        )?;
    }
    saga.count += 1;
    saga.seen.push(msg.n);
    if saga.count == msg.of {
        saga.complete();
    }
    Ok(())
}

#[idempotent_handler(key = "tally", saga(missing = "dead_letter"))]
async fn close(
    _conn: &mut AsyncPgConnection,
    _msg: Close,
    saga: &mut Saga<Tally>,
) -> Result<(), HandlerError> {
    saga.complete();
    Ok(())
}

#[idempotent_handler(key = "tally", saga(missing = "dead_letter", finished = "dead_letter"))]
async fn timed_out(
    _conn: &mut AsyncPgConnection,
    _msg: TallyTimeout,
    saga: &mut Saga<Tally>,
) -> Result<(), HandlerError> {
    saga.timed_out += 1;
    saga.complete();
    Ok(())
}

/// A tick for a tally that must exist (`missing = "ignore"`), under another name.
#[idempotent_handler(key = "{tally}:{n}", name = "tick_if_any", saga(missing = "ignore"))]
async fn tick_if_any(
    _conn: &mut AsyncPgConnection,
    msg: Tick,
    saga: &mut Saga<Tally>,
) -> Result<(), HandlerError> {
    saga.count += 1;
    saga.seen.push(msg.n);
    Ok(())
}

/// A tick that waits for its tally (`missing = "retry"`, the default).
#[idempotent_handler(key = "{tally}:{n}", name = "tick_when_started")]
async fn tick_when_started(
    _conn: &mut AsyncPgConnection,
    msg: Tick,
    saga: &mut Saga<Tally>,
) -> Result<(), HandlerError> {
    saga.count += 1;
    saga.seen.push(msg.n);
    Ok(())
}

fn ticks(tally: &str, of: u32) -> Vec<Tick> {
    (0..of).map(|n| Tick { tally: tally.to_owned(), n, of, timeout_ms: 0 }).collect()
}

/// The stored tallies: key → (state, version, finished).
async fn tallies(conn: &mut AsyncPgConnection) -> BTreeMap<String, (Tally, i64, bool)> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        key: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        state: String,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        version: i64,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        finished: bool,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT key, state::text AS state, version, finished_at IS NOT NULL AS finished FROM idemq_saga \
         WHERE saga = 'tally'",
    )
    .load(conn)
    .await
    .expect("read the sagas");
    rows.into_iter()
        .map(|row| (row.key, (serde_json::from_str(&row.state).expect("a Tally"), row.version, row.finished)))
        .collect()
}

/// The bed's queue bound to the exchange the saga's messages (and timeouts) go to.
async fn route_to_bed(bed: &Bed) {
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    channel
        .exchange_declare(
            "tally".into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the exchange");
    channel
        .queue_bind(
            bed.queue.as_str().into(),
            "tally".into(),
            "steps".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the queue");
}

/// The saga steps observers were told of: handler, step, timeouts scheduled and
/// cancelled, whether a timeout fired.
#[derive(Default)]
struct Steps(std::sync::Mutex<Vec<Told>>);

/// One step as [`Steps`] keeps it.
type Told = (&'static str, &'static str, u32, u32, bool);

impl idemq::observe::Observe for Steps {
    fn saga_step(&self, step: &idemq::observe::SagaStep<'_>) {
        let told = (
            step.handler,
            step.kind.name(),
            step.timeouts_scheduled,
            step.timeouts_cancelled,
            step.timeout_fired,
        );
        self.0.lock().expect("steps").push(told);
    }
}

/// Publishes `message` to the bed's queue as `Publisher::send` would (its type set).
async fn send<M: Message>(broker: &Broker, queue: &str, message: &M) {
    let message = TestMessage::of(message);
    broker.publish_bytes(queue, message.body(), message.properties().clone()).await;
}

/// Ticks of one tally published twice each, taken by two runtimes at once, each
/// with 8 transactions at a time: every tick counted once, none lost to a
/// concurrent step (each read what the one before it wrote, under the row lock),
/// and the tally started once although any tick may start it.
#[tokio::test(flavor = "multi_thread")]
async fn two_consumers_racing_on_one_sagas_messages_lose_no_update() {
    const TICKS: u32 = 150;
    let bed = Bed::new().await;
    for message in ticks("race", TICKS) {
        send(&bed.broker, &bed.queue, &message).await;
        send(&bed.broker, &bed.queue, &message).await;
    }
    let runtimes = [
        Running::start(bed.runtime().consume(&bed.queue, tick)),
        Running::start(bed.runtime().consume(&bed.queue, tick)),
    ];
    let mut conn = bed.db.connect().await;
    eventually("every tick settled", Duration::from_secs(60), || async {
        runtimes.iter().map(|r| r.events().len()).sum::<usize>() >= 2 * TICKS as usize
    })
    .await;
    for running in runtimes {
        running.stop().await.expect("clean shutdown");
    }
    let stored = tallies(&mut conn).await;
    let (tally, version, finished) = &stored["race"];
    let mut seen = tally.seen.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..TICKS).collect::<Vec<_>>(), "each tick once");
    assert_eq!((tally.count, *version, *finished), (TICKS, i64::from(TICKS), true));
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}

/// A saga step's transaction commits and its ack is lost: the redelivery finds the
/// dedup row and runs no step — the saga took one step, scheduled one timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_between_commit_and_ack_runs_the_step_once() {
    let kit = TestKit::builder()
        .handler(tick)
        .handler(close)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    let first = Tick { tally: "crash".into(), n: 0, of: 2, timeout_ms: 60_000 };
    assert_eq!(kit.crash_after_commit(TestMessage::of(&first)).await, [Outcome::Applied, Outcome::Duplicate]);
    let stored = tallies(&mut kit.connect().await).await;
    let (tally, version, _) = &stored["crash"];
    assert_eq!((tally.count, *version), (1, 1));
    assert_eq!(kit.scheduled().await.len(), 1, "one timeout");
    kit.finish().await;
}

/// 20 retries 300 ms apart: a step that waits for its saga is tried for six seconds.
fn retried_every_300_ms(builder: idemq::RuntimeBuilder) -> idemq::RuntimeBuilder {
    builder.retry(idemq::RetryPolicy::new([Duration::from_millis(300); 20]))
}

/// `missing = "retry"` (the default): a step that overtook the message starting
/// its saga is retried until the saga exists, then runs once; `"dead_letter"`
/// dead-letters at once, the reason in its headers; `"ignore"` acks without a step.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_for_a_saga_that_does_not_exist_gets_the_steps_policy() {
    let kit = TestKit::builder()
        .handler(tick)
        .handler(close)
        .tune(retried_every_300_ms)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    // dead_letter: `close` of a tally nobody started.
    let outcome = kit.send(&Close { tally: "nobody".into() }).await;
    assert!(
        matches!(&outcome, Outcome::DeadLettered { kind: FailureKind::Handler, error } if error.contains("no saga `tally` with key `nobody`")),
        "{outcome:?}"
    );
    assert!(tallies(&mut kit.connect().await).await.is_empty(), "nothing started");
    kit.finish().await;

    let kit = TestKit::builder()
        .handler(tick_when_started)
        .tune(retried_every_300_ms)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    let early = Tick { tally: "late-start".into(), n: 1, of: 2, timeout_ms: 0 };
    assert!(matches!(kit.send(&early).await, Outcome::Retry { .. }), "no saga yet: retried");
    // The saga starts (written as its starting step would, by another service).
    let mut conn = kit.connect().await;
    diesel::sql_query(
        "INSERT INTO idemq_saga (saga, key, state) VALUES ('tally', 'late-start', '{\"count\":1,\"seen\":[0],\"timed_out\":0}')",
    )
    .execute(&mut conn)
    .await
    .expect("start the saga");
    eventually("the retried step ran", Duration::from_secs(20), || async {
        kit.settled().iter().any(|s| s.outcome == Outcome::Applied)
    })
    .await;
    let stored = tallies(&mut conn).await;
    assert_eq!(stored["late-start"].0.seen, vec![0, 1]);
    kit.finish().await;

    let kit = TestKit::start(tick_if_any).await.expect("PostgreSQL and RabbitMQ are up");
    let stray = Tick { tally: "stray".into(), n: 0, of: 1, timeout_ms: 0 };
    assert_eq!(kit.send(&stray).await, Outcome::Applied, "acked, no step");
    assert!(tallies(&mut kit.connect().await).await.is_empty(), "ignored: nothing written");
    kit.finish().await;
}

/// `finished = "dead_letter"`: a message for a saga that completed is refused with
/// the reason; the default, `"ignore"`, acks it without a step (see the order saga's
/// tests).
#[tokio::test(flavor = "multi_thread")]
async fn a_message_for_a_finished_saga_gets_the_steps_policy() {
    let kit = TestKit::builder()
        .handler(tick)
        .handler(timed_out)
        .start()
        .await
        .expect("PostgreSQL and RabbitMQ are up");
    assert_eq!(kit.send(&Tick { tally: "done".into(), n: 0, of: 1, timeout_ms: 0 }).await, Outcome::Applied);
    let outcome = kit.send(&TallyTimeout { tally: "done".into() }).await;
    assert!(
        matches!(&outcome, Outcome::DeadLettered { kind: FailureKind::Handler, error } if error.contains("has finished")),
        "{outcome:?}"
    );
    let stored = tallies(&mut kit.connect().await).await;
    assert_eq!((stored["done"].0.timed_out, stored["done"].2), (0, true));
    kit.finish().await;
}

/// Through the relay: a tally's timeout fires once when due and completes it; the
/// timeout of a tally closed before it was due is cancelled with the close and never
/// published, nor run.
#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_fires_once_and_one_cancelled_by_completion_never_fires() {
    let bed = Bed::isolated().await;
    route_to_bed(&bed).await;
    let fires = Tick { tally: "fires".into(), n: 0, of: 2, timeout_ms: 1_000 };
    let cancelled = Tick { tally: "cancelled".into(), n: 0, of: 2, timeout_ms: 3_000 };
    send(&bed.broker, &bed.queue, &fires).await;
    send(&bed.broker, &bed.queue, &cancelled).await;
    let steps = Arc::new(Steps::default());
    let addr = idemq_tests::free_addr();
    let running = Running::start(
        bed.runtime()
            .http_addr(addr)
            .observe(Arc::clone(&steps))
            .consume(&bed.queue, tick)
            .consume(&bed.queue, close)
            .consume(&bed.queue, timed_out),
    );
    let mut conn = bed.db.connect().await;
    // Closed once it exists (`close` dead-letters a message for a tally not started).
    eventually("the tally to close started", Duration::from_secs(30), || async {
        tallies(&mut bed.db.connect().await).await.contains_key("cancelled")
    })
    .await;
    send(&bed.broker, &bed.queue, &Close { tally: "cancelled".into() }).await;
    eventually("the timeout fired", Duration::from_secs(30), || async {
        tallies(&mut bed.db.connect().await)
            .await
            .get("fires")
            .is_some_and(|(t, _, finished)| t.timed_out == 1 && *finished)
    })
    .await;
    // Past the cancelled timeout's due time, with a margin of the relay's poll.
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    let stored = tallies(&mut conn).await;
    assert_eq!(stored["fires"].0.timed_out, 1, "once");
    assert_eq!(
        (stored["cancelled"].0.timed_out, stored["cancelled"].2),
        (0, true),
        "closed, never timed out"
    );
    let outbox: i64 = bed.db.count("SELECT count(*) FROM idemq_outbox").await;
    assert_eq!(outbox, 0, "the cancelled timeout is gone, not waiting");
    let timeouts_run = running.events().iter().filter(|s| s.handler == "timed_out").count();
    assert_eq!(timeouts_run, 1, "one timeout delivered: {:?}", running.events());
    // What the observers and the metrics were told, after each step's COMMIT: each
    // tally started (scheduling its timeout); one completed by its fired timeout, the
    // other by its close, which cancelled its timeout.
    let mut told = steps.0.lock().expect("steps").clone();
    told.sort();
    assert_eq!(
        told,
        vec![
            ("close", "completed", 0, 1, false),
            ("tick", "started", 1, 0, false),
            ("tick", "started", 1, 0, false),
            ("timed_out", "completed", 0, 0, true),
        ]
    );
    let metrics =
        tokio::task::spawn_blocking(move || idemq_tests::http_get(addr, "/metrics")).await.expect("GET");
    for line in [
        r#"idemq_saga_steps_total{saga="tally",handler="tick",step="started"} 2"#,
        r#"idemq_saga_steps_total{saga="tally",handler="timed_out",step="completed"} 1"#,
        r#"idemq_saga_timeouts_total{saga="tally",event="scheduled"} 2"#,
        r#"idemq_saga_timeouts_total{saga="tally",event="fired"} 1"#,
        r#"idemq_saga_timeouts_total{saga="tally",event="cancelled"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    running.stop().await.expect("clean shutdown");
}

/// A commit's ack lost on every 100th commit (8 times each), and the broker closing every
/// connection once, while two runtimes take the ticks of a thousand tallies (three
/// each, in shuffled order, every one published twice): every tally ends finished
/// with its three ticks, each counted once; nothing is dead-lettered or left.
async fn chaos_a_thousand_sagas() {
    const SAGAS: usize = 1_000;
    const OF: u32 = 3;
    let bed = Bed::isolated().await;
    let mut all: Vec<Tick> = (0..SAGAS).flat_map(|i| ticks(&format!("t{i}"), OF)).collect();
    // Shuffled (a fixed permutation): a tally's ticks arrive in any order.
    let mut order: Vec<(u64, Tick)> = all
        .drain(..)
        .enumerate()
        .map(|(i, t)| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40, t))
        .collect();
    order.sort_by_key(|(rank, _)| *rank);
    let all: Vec<Tick> = order.into_iter().map(|(_, t)| t).collect();
    let hook = || -> FaultHook {
        let commits = Arc::new(AtomicU64::new(0));
        Arc::new(move |ctx: FaultContext| {
            let commits = Arc::clone(&commits);
            Box::pin(async move {
                // Every 100th commit, at most 8 times: with group commit each lost ack
                // returns the whole prefetch window, whose redeliveries run alone —
                // a fault on every few dozen commits would keep returning it until the
                // broker's delivery limit dead-letters messages (seen at every 40th).
                if ctx.point != FaultPoint::AfterCommit || ctx.outcome != Outcome::Applied {
                    return;
                }
                let n = commits.fetch_add(1, Ordering::SeqCst);
                if n % 100 == 99 && n < 800 {
                    let _ = ctx.channel.close(200, "fault: ack lost after commit".into()).await;
                }
            })
        })
    };
    let start = || {
        Running::start(
            bed.runtime()
                .consume(&bed.queue, tick)
                .reconnect_max_backoff(Duration::from_millis(500))
                .fault_hook(hook()),
        )
    };
    let runtimes = [start(), start()];
    for message in &all {
        send(&bed.broker, &bed.queue, message).await;
        send(&bed.broker, &bed.queue, message).await;
    }
    let vhost = bed.vhost.as_ref().expect("isolated");
    let finished = "SELECT count(*) FROM idemq_saga WHERE finished_at IS NOT NULL";
    eventually("a third finished", Duration::from_secs(120), || async {
        bed.db.count(finished).await >= (SAGAS / 3) as i64
    })
    .await;
    vhost.close_all_connections().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while bed.db.count(finished).await < SAGAS as i64 {
        if tokio::time::Instant::now() > deadline {
            let stored = tallies(&mut bed.db.connect().await).await;
            let open: Vec<_> = stored.iter().filter(|(_, (_, _, done))| !done).take(5).collect();
            let mut outcomes = BTreeMap::<String, usize>::new();
            for running in &runtimes {
                for event in running.events() {
                    if event.outcome != Outcome::Applied && event.outcome != Outcome::Duplicate {
                        *outcomes
                            .entry(format!("{:?}", event.outcome).chars().take(160).collect())
                            .or_default() += 1;
                    }
                }
            }
            let broker = Broker::connect(&bed.amqp_url).await;
            let letter = broker.get(&bed.dlq).await.map(|m| format!("{:?}", m.delivery.properties.headers()));
            panic!(
                "not every saga finished: {} of {SAGAS} stored; open ones {open:?}; queue {} dlq {}; other outcomes {outcomes:#?}; a dead letter's headers: {letter:?}",
                stored.len(),
                broker.message_count(&bed.queue).await,
                broker.message_count(&bed.dlq).await
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for _ in 0..2 {
        vhost.await_drained(&bed.queue, Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let counts: Vec<u32> =
        runtimes.iter().flat_map(|r| r.events().into_iter().map(|e| e.delivery_count)).collect();
    eprintln!(
        "chaos sagas: {} settlements, max delivery count {}, over 10: {}",
        counts.len(),
        counts.iter().max().unwrap_or(&0),
        counts.iter().filter(|&&c| c > 10).count()
    );
    let mut lost_acks = 0;
    for running in runtimes {
        lost_acks += running.stats.snapshot().unsettled;
        running.stop().await.expect("clean shutdown");
    }
    let stored = tallies(&mut bed.db.connect().await).await;
    assert_eq!(stored.len(), SAGAS);
    for (key, (tally, version, finished)) in &stored {
        let mut seen = tally.seen.clone();
        seen.sort_unstable();
        assert_eq!(
            (seen, tally.count, *version, *finished),
            ((0..OF).collect(), OF, i64::from(OF), true),
            "{key}"
        );
    }
    assert!(lost_acks >= 2, "acks were lost after commit: {lost_acks}");
    let broker = Broker::connect(&bed.amqp_url).await;
    assert_eq!(broker.message_count(&bed.queue).await, 0, "nothing left");
    assert_eq!(broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
}

in_both_modes! {
    /// See [`chaos_a_thousand_sagas`].
    async fn chaos_a_thousand_sagas_under_lost_acks_and_closed_connections_each_end_in_one_state() {
        chaos_a_thousand_sagas().await;
    }
}
