//! Start-up: an outage is waited out (a broker or database that refuses or never
//! answers), what waiting cannot mend is refused at once with the fix (missing
//! schema, a refused login, a missing vhost or database), and how the runtime shares
//! its slots (an idle queue starves nobody).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use diesel_async::SimpleAsyncConnection;
use idemq::{
    idempotent_handler, observe::ConnectionEvent, Dependency, Error, HandlerError, Outcome, Queue, Runtime,
    Topology,
};
use idemq_example_payments::PaymentRequested;
use idemq_tests::fixture::{ledger_payment, payment, test_retry_policy, Bed, Running};
use idemq_tests::{eventually, free_addr, http_get, unique, with_timeout, TestDb};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Without idemq's tables every delivery would fail until someone ran the
/// migrations: the runtime refuses to start and says so, instead of looping.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_without_idemqs_tables_is_refused_at_start_up_with_the_fix() {
    let db = TestDb::create().await;
    let queue = unique("q");
    let runtime = Runtime::builder()
        .database_url(db.url())
        .topology(Topology::new().queue(Queue::new(queue.clone())))
        .consume(&queue, ledger_payment)
        .build()
        .expect("build");
    let result =
        with_timeout("start-up", Duration::from_secs(20), runtime.run(CancellationToken::new())).await;
    let Err(err @ Error::Schema { .. }) = result else { panic!("expected a schema error, got {result:?}") };
    let message = err.to_string();
    assert!(message.contains("idemq_dedup") && message.contains("migrate"), "{message}");
}

/// idemq's table dropped under a running runtime: its insert is refused, which no
/// retry can fix. The runtime stops with the fix instead of retrying every delivery
/// for the database retry limit, and the delivery is returned, not lost.
#[tokio::test(flavor = "multi_thread")]
async fn losing_idemqs_table_while_running_stops_the_runtime_and_returns_the_delivery() {
    let bed = Bed::new().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    bed.publish(&payment(1)).await;
    running.wait_settled(1).await;
    bed.db.connect().await.batch_execute("DROP TABLE idemq_dedup").await.expect("drop the table");
    let p = payment(2);
    bed.publish(&p).await;
    let result =
        with_timeout("the runtime stops", Duration::from_secs(30), running.handle).await.expect("task");
    let Err(err @ Error::Schema { .. }) = result else { panic!("expected a schema error, got {result:?}") };
    assert!(err.to_string().contains("migrate"), "{err}");
    let events = running.events.lock().unwrap().clone();
    assert!(matches!(events[1].outcome, Outcome::Requeued { .. }), "{events:?}");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 1, "the delivery was returned to the queue");
}

/// The idle queue's handler; nothing is ever published there.
#[idempotent_handler(key = "payment_id")]
async fn never_called(_conn: &mut AsyncPgConnection, _msg: PaymentRequested) -> Result<(), HandlerError> {
    Err(HandlerError::permanent("nothing is published to the idle queue"))
}

/// With one slot (`concurrency(1)`) and an idle queue consumed beside a busy one,
/// the idle consumer must not hold the slot while it waits for a delivery.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_queue_does_not_starve_a_busy_one() {
    let bed = Bed::new().await;
    let idle = unique("idle");
    let topology = Topology::new().queue(Queue::new(idle.clone()));
    let payments: Vec<_> = (0..20).map(|i| payment(100 + i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    // The idle queue's consumer starts first.
    let builder = bed
        .runtime()
        .topology(topology)
        .concurrency(1)
        .consume(&idle, never_called)
        .consume(&bed.queue, ledger_payment);
    let events = Running::settle(builder, payments.len()).await;
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    let wait_queues = test_retry_policy().wait_queues(&idle).into_iter().map(|(name, _)| name);
    for queue in [idle.clone(), format!("{idle}.dlq")].into_iter().chain(wait_queues) {
        bed.broker.delete_queue(&queue).await;
    }
}

/// A local address standing for a service in an outage. Shut, it refuses (nothing
/// listens on its port) or, as a black hole, accepts connections and never answers
/// (a network that swallows packets); opened, it forwards each new connection to
/// the real service. Stops when dropped.
struct Gate {
    port: u16,
    /// `Some(upstream)` once open.
    upstream: watch::Sender<Option<String>>,
    /// Whether a task listens on the port already (a black hole).
    listening: bool,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl Gate {
    /// A port nothing listens on: connections are refused.
    fn refusing() -> Gate {
        let port = free_addr().port();
        Gate {
            port,
            upstream: watch::channel(None).0,
            listening: false,
            accepted: Arc::default(),
            stop: CancellationToken::new(),
        }
    }

    /// A port that accepts connections and never answers them.
    async fn black_hole() -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the gate");
        let port = listener.local_addr().expect("gate address").port();
        let gate = Gate {
            port,
            upstream: watch::channel(None).0,
            listening: true,
            accepted: Arc::default(),
            stop: CancellationToken::new(),
        };
        tokio::spawn(serve(
            listener,
            gate.upstream.subscribe(),
            Arc::clone(&gate.accepted),
            gate.stop.clone(),
        ));
        gate
    }

    /// `host:port` of the gate.
    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// From now on, connections are forwarded to `upstream` (`host:port`); the
    /// black hole's swallowed ones are closed.
    async fn open(&mut self, upstream: &str) {
        self.upstream.send_replace(Some(upstream.to_owned()));
        if !self.listening {
            let listener = TcpListener::bind(("127.0.0.1", self.port)).await.expect("bind the gate's port");
            tokio::spawn(serve(
                listener,
                self.upstream.subscribe(),
                Arc::clone(&self.accepted),
                self.stop.clone(),
            ));
            self.listening = true;
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Accepts on `listener` until `stop`: holds each connection silently while
/// `upstream` is `None`, forwards it once it is set.
async fn serve(
    listener: TcpListener,
    mut upstream: watch::Receiver<Option<String>>,
    accepted: Arc<AtomicUsize>,
    stop: CancellationToken,
) {
    let mut swallowed = Vec::new();
    loop {
        let client = tokio::select! {
            () = stop.cancelled() => return,
            Ok(()) = upstream.changed() => {
                swallowed.clear();
                continue;
            }
            client = listener.accept() => match client {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let Some(to) = upstream.borrow().clone() else {
            swallowed.push(client);
            continue;
        };
        let stop = stop.clone();
        tokio::spawn(async move {
            let Ok(mut server) = TcpStream::connect(&to).await else { return };
            let mut client = client;
            tokio::select! {
                () = stop.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
            }
        });
    }
}

/// `url` with its `host:port` replaced by `address`.
fn via(url: &str, address: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let userinfo = authority.rsplit_once('@').map_or(String::new(), |(userinfo, _)| format!("{userinfo}@"));
    format!("{scheme}://{userinfo}{address}/{path}")
}

/// The `host:port` of `url`.
fn address_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    authority.rsplit_once('@').map_or(authority, |(_, address)| address).to_owned()
}

/// Whether `event` is a start-up wait for `dependency`.
fn waits_for(event: &ConnectionEvent, dependency: Dependency) -> bool {
    matches!(event, ConnectionEvent::Unreachable { dependency: d, .. } if *d == dependency)
}

/// The HTTP status line of `GET path` on `addr`.
async fn status_of(addr: std::net::SocketAddr, path: &'static str) -> String {
    let answer = tokio::task::spawn_blocking(move || http_get(addr, path)).await.expect("get");
    answer.lines().next().unwrap_or_default().to_owned()
}

/// Stages a consumer restarted while the network swallows every packet to the
/// broker (a black hole: connections accepted, never answered). The runtime must
/// not exit: it tries again with backoff, `/healthz` answers 200 and `/readyz` 503
/// naming the broker meanwhile; once the broker is reachable it connects and
/// applies the payment that waited, exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_unreachable_at_start_up_is_waited_for_then_consumed() {
    let bed = Bed::new().await;
    let p = payment(100);
    bed.publish(&p).await;
    let mut gate = Gate::black_hole().await;
    let addr = free_addr();
    let running = Running::start(
        bed.runtime()
            .amqp_url(via(&bed.amqp_url, &gate.address()))
            .reconnect_max_backoff(Duration::from_millis(500))
            .http_addr(addr)
            .consume(&bed.queue, ledger_payment),
    );
    eventually("a start-up wait for the broker", Duration::from_secs(30), || async {
        running.connection_events().iter().any(|e| waits_for(e, Dependency::Broker))
    })
    .await;
    assert!(!running.handle.is_finished(), "the runtime exited instead of waiting");
    assert!(status_of(addr, "/healthz").await.contains(" 200"), "/healthz while waiting");
    let ready = tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.expect("get");
    assert!(ready.contains(" 503") && ready.contains("RabbitMQ"), "/readyz while waiting: {ready}");

    gate.open(&address_of(&bed.amqp_url)).await;
    running.wait_settled(1).await;
    eventually("/readyz 200", Duration::from_secs(20), || async {
        status_of(addr, "/readyz").await.contains(" 200")
    })
    .await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}

/// Stages a consumer started while PostgreSQL refuses connections (the server is
/// down). The runtime must wait for it (the start-up check at the top of `run`),
/// then connect to the broker and apply the payment that waited, exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_unreachable_at_start_up_is_waited_for_then_consumed() {
    let bed = Bed::new().await;
    let p = payment(200);
    bed.publish(&p).await;
    let mut gate = Gate::refusing();
    let running = Running::start(
        bed.runtime()
            .database_url(via(&bed.db.url(), &gate.address()))
            .reconnect_max_backoff(Duration::from_millis(500))
            .consume(&bed.queue, ledger_payment),
    );
    eventually("start-up waits for the database", Duration::from_secs(30), || async {
        running.connection_events().iter().filter(|e| waits_for(e, Dependency::Database)).count() >= 2
    })
    .await;
    assert!(!running.handle.is_finished(), "the runtime exited instead of waiting");
    assert!(
        !running.connection_events().iter().any(|e| matches!(e, ConnectionEvent::Connected { .. })),
        "consuming before the database answered"
    );

    gate.open(&address_of(&bed.db.url())).await;
    running.wait_settled(1).await;
    let events = running.events();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}

/// Stages a broker, then a database, that stay unreachable (refused) past
/// `startup_timeout`: `run` must give up with `Error::StartupTimeout` naming what
/// was unreachable and quoting the last attempt, passwords hidden.
#[tokio::test(flavor = "multi_thread")]
async fn the_startup_timeout_ends_the_wait_naming_what_was_unreachable() {
    let bed = Bed::new().await;
    let gate = Gate::refusing();
    let broker = format!("amqp://guest:s3cret@{}/%2f", gate.address());
    let database = via(&bed.db.url(), &gate.address());
    for (dependency, builder) in [
        (Dependency::Broker, bed.runtime().amqp_url(broker)),
        (Dependency::Database, bed.runtime().database_url(database)),
    ] {
        let runtime = builder
            .startup_timeout(Duration::from_secs(1))
            .reconnect_max_backoff(Duration::from_millis(200))
            .consume(&bed.queue, ledger_payment)
            .build()
            .expect("build");
        let result = with_timeout(
            "the startup timeout",
            Duration::from_secs(30),
            runtime.run(CancellationToken::new()),
        )
        .await;
        let Err(err @ Error::StartupTimeout { dependency: d, .. }) = result else {
            panic!("expected a startup timeout for {dependency}, got {result:?}")
        };
        assert_eq!(d, dependency);
        let shown = err.to_string();
        assert!(shown.contains(&dependency.to_string()) && shown.contains("startup timeout"), "{shown}");
        assert!(shown.to_lowercase().contains("refused") && !shown.contains("s3cret"), "{shown}");
    }
}

/// Stages what no wait mends — a wrong broker password, a vhost that does not
/// exist, a database that does not exist, a URL that cannot be read — with no
/// startup timeout: each must still fail at once (a wait would never end), with
/// words that say what to fix.
#[tokio::test(flavor = "multi_thread")]
async fn what_waiting_cannot_mend_still_fails_at_once() {
    let bed = Bed::new().await;
    let (server, _) =
        bed.db.url().rsplit_once('/').map(|(a, b)| (a.to_owned(), b.to_owned())).expect("a path");
    let missing_db = format!("{server}/{}", unique("idemq_missing"));
    let cases = [
        (
            "a wrong password",
            bed.runtime().amqp_url("amqp://guest:wrong@127.0.0.1:5672/%2f"),
            "ACCESS_REFUSED",
        ),
        (
            "a missing vhost",
            bed.runtime().amqp_url(format!("amqp://guest:guest@127.0.0.1:5672/{}", unique("nv"))),
            "not found",
        ),
        ("a missing database", bed.runtime().database_url(missing_db), "does not exist"),
    ];
    for (what, builder, words) in cases {
        let runtime = builder.consume(&bed.queue, ledger_payment).build().expect("build");
        let result = with_timeout(what, Duration::from_secs(30), runtime.run(CancellationToken::new())).await;
        let err = result.expect_err(what).to_string();
        assert!(err.contains(words), "{what}: {err}");
    }
    let unreadable =
        bed.runtime().amqp_url("amqp:guest:guest@127.0.0.1:5672").consume(&bed.queue, ledger_payment).build();
    let Err(err @ Error::Config(_)) = unreadable else {
        panic!("an unreadable URL was accepted: {unreadable:?}")
    };
    assert!(err.to_string().contains("amqp://user:password@host"), "{err}");
}

/// Stages a shutdown (the token cancelled, as SIGTERM does) while start-up waits
/// for a broker behind a black hole, in the middle of an attempt that would take
/// 10 s to give up (the runtime's and its outbox relay's): `run` must return `Ok`
/// promptly, not finish the attempt first.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_during_the_start_up_wait_returns_ok_promptly() {
    let bed = Bed::new().await;
    let gate = Gate::black_hole().await;
    let runtime = bed
        .runtime()
        .amqp_url(via(&bed.amqp_url, &gate.address()))
        .consume(&bed.queue, ledger_payment)
        .build()
        .expect("build");
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(shutdown.clone()));
    // Both the runtime and its relay are trying to connect.
    eventually("attempts under way", Duration::from_secs(30), || async {
        gate.accepted.load(Ordering::Relaxed) >= 2
    })
    .await;
    shutdown.cancel();
    let result = with_timeout("run returns promptly after the shutdown", Duration::from_secs(3), run)
        .await
        .expect("task");
    assert!(result.is_ok(), "{result:?}");
}

/// Stages a runtime consuming a queue and a stream whose broker stays unreachable
/// (a black hole) past a 1 s `startup_timeout`, with a 60 s shutdown deadline and
/// nothing in flight: `run` must fail with `Error::StartupTimeout` at once, not after
/// the shutdown deadline (the stream consumer kept trying, and the drain waited for
/// it), and every task must stop with it: no new connection attempt reaches the
/// broker's address after `run` returned.
#[tokio::test(flavor = "multi_thread")]
async fn the_startup_timeout_stops_everything_at_once_with_nothing_in_flight() {
    let bed = Bed::new().await;
    let gate = Gate::black_hole().await;
    let stream = unique("stream");
    let topology = Topology::new().queue(Queue::stream(&stream));
    let runtime = bed
        .runtime()
        .amqp_url(via(&bed.amqp_url, &gate.address()))
        .topology(topology)
        .startup_timeout(Duration::from_secs(1))
        .shutdown_deadline(Duration::from_secs(60))
        .reconnect_max_backoff(Duration::from_millis(200))
        .consume(&bed.queue, ledger_payment)
        .consume(&stream, ledger_payment)
        .build()
        .expect("build");
    let result = with_timeout(
        "run gives up well before the 60 s shutdown deadline",
        Duration::from_secs(20),
        runtime.run(CancellationToken::new()),
    )
    .await;
    assert!(
        matches!(result, Err(Error::StartupTimeout { dependency: Dependency::Broker, .. })),
        "{result:?}"
    );
    assert!(gate.accepted.load(Ordering::Relaxed) >= 1, "the broker was tried");
    // An attempt begun just before `run` returned may still land: lapin opens its
    // socket on a thread of its own that an aborted task does not stop (CI saw one
    // accepted 0.2 s after). It is no new attempt; count from after it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let attempts = gate.accepted.load(Ordering::Relaxed);
    // Two seconds is several of the 200 ms reconnect waits: a task still trying
    // would be seen.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(gate.accepted.load(Ordering::Relaxed), attempts, "a task kept trying after run returned");
}
