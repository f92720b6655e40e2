//! Several broker addresses in `AMQP_URL`: the runtime connects to one that answers
//! and, when it loses that one, to the next — here two proxies in front of the one
//! broker stand for two nodes, and dropping a proxy is losing its node.

use std::time::Duration;

use idemq::observe::ConnectionEvent;
use idemq::testing::NetworkProxy;
use idemq_tests::fixture::{ledger_payment, payment, publish_stream, slow_payment, Bed, Running};
use idemq_tests::{eventually, Broker};

/// The bed's vhost's URL through `proxy`.
fn through(proxy: &NetworkProxy, bed: &Bed) -> String {
    proxy.url_for(&bed.amqp_url)
}

/// A dead first address: the runtime connects to the second.
#[tokio::test(flavor = "multi_thread")]
async fn a_list_of_addresses_connects_to_one_that_answers() {
    let bed = Bed::isolated().await;
    let p = payment(100);
    bed.publish(&p).await;
    let list = format!("amqp://guest:guest@127.0.0.1:1/x, {}", bed.amqp_url);
    let events = Running::settle(bed.runtime().amqp_url(list).consume(&bed.queue, ledger_payment), 1).await;
    assert_eq!(events[0].outcome, idemq::Outcome::Applied);
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}

/// The node the runtime is connected to goes away mid-stream: it reconnects to the
/// other address by itself, consumes what is published after (which only that
/// address can deliver), and every payment is applied exactly once.
///
/// The loss is waited for, not assumed: the whole first wave may be applied before
/// the reset lands (CI's run: the test read the events before the loss was told).
#[tokio::test(flavor = "multi_thread")]
async fn losing_the_connected_node_fails_over_to_the_next_address() {
    let bed = Bed::isolated().await;
    let mut payments = publish_stream(&bed, 300).await;
    let proxy = || async { NetworkProxy::in_front_of(&bed.amqp_url).await.expect("start a proxy") };
    let (a, b) = (proxy().await, proxy().await);
    let list = format!("{},{}", through(&a, &bed), through(&b, &bed));
    let running = Running::start(
        bed.runtime()
            .amqp_url(list)
            .reconnect_max_backoff(Duration::from_millis(500))
            .consume(&bed.queue, slow_payment),
    );
    eventually("a third applied", Duration::from_secs(60), || async { bed.ledger_total().await >= 100 })
        .await;
    // Node A is gone: its connections cut, and nothing listens there any more.
    a.reset_all();
    drop(a);
    eventually("reconnected after the loss", Duration::from_secs(60), || async {
        let events = running.connection_events();
        events.iter().any(|e| matches!(e, ConnectionEvent::Lost { .. }))
            && events.iter().filter(|e| matches!(e, ConnectionEvent::Connected { .. })).count() >= 2
    })
    .await;
    // A second wave, after the loss: only node B's address can deliver it.
    for i in 0..50 {
        let late = payment(10_000 + i);
        bed.publish(&late).await;
        payments.push(late);
    }
    eventually("every payment applied", Duration::from_secs(60), || async {
        bed.ledger_total().await >= payments.len() as i64
    })
    .await;
    let vhost = bed.vhost.as_ref().expect("isolated");
    vhost.await_drained(&bed.queue, Duration::from_secs(60)).await;
    let connections = running.connection_events();
    running.stop().await.expect("clean shutdown");
    assert!(
        connections.iter().any(|e| matches!(e, ConnectionEvent::Lost { .. }))
            && connections.iter().filter(|e| matches!(e, ConnectionEvent::Connected { .. })).count() >= 2,
        "{connections:?}"
    );
    assert_eq!(bed.doubled().await, Vec::<String>::new(), "no payment applied twice");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    let broker = Broker::connect(&bed.amqp_url).await;
    assert_eq!(broker.message_count(&bed.dlq).await, 0, "nothing dead-lettered");
    drop(b);
}

/// No address answers until the startup timeout: the error says so with every
/// password hidden.
#[tokio::test(flavor = "multi_thread")]
async fn when_no_address_answers_no_password_is_shown() {
    let bed = Bed::new().await;
    let list = "amqp://u1:s3cret-one@127.0.0.1:1/%2f,amqp://u2:s3cret%2Ctwo@127.0.0.1:2/%2f";
    let runtime = bed
        .runtime()
        .amqp_url(list)
        .startup_timeout(Duration::from_millis(500))
        .consume(&bed.queue, ledger_payment)
        .build()
        .expect("build");
    let err = runtime.run(tokio_util::sync::CancellationToken::new()).await.expect_err("nothing answers");
    let (shown, debug) = (err.to_string(), format!("{err:?}"));
    for secret in ["s3cret-one", "s3cret", "two"] {
        assert!(!shown.contains(secret) && !debug.contains(secret), "{secret} shown: {shown} / {debug}");
    }
    assert!(shown.contains("cannot connect to RabbitMQ"), "{shown}");
}
