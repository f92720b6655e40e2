//! RabbitMQ 4.x readiness (issue 34), shown on the 3.10 broker these tests run on.
//!
//! - 4.0 gives a quorum queue without `x-delivery-limit` a limit of 20: every quorum
//!   queue idemq consumes or browses declares its own (read back with `rabbitmqctl`);
//!   a dead-letter queue declared before idemq set one is kept, not refused.
//! - 4.3 refuses `basic.qos` with `global = true` and transient non-exclusive queues:
//!   a running runtime's channels and queues are read back, and the workspace's
//!   sources are searched for either.
//! - 4.2 treats a direct reply-to address published to with `mandatory` as a queue
//!   (never returned): a reply to a requester that is gone must not depend on a
//!   `basic.return`. Replies to vanished requesters — a deleted reply queue, a closed
//!   direct reply-to channel, idemq's own request client — all end the same way.
//!
//! Each test runs in a vhost of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError, Queue, Topology};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};
use idemq_tests::{eventually, TestVhost};
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::Value;

/// What `rabbitmqctl list_queues` says of one queue.
#[derive(Debug)]
struct Listed {
    name: String,
    kind: String,
    durable: bool,
    exclusive: bool,
    /// Its arguments: name → value (as JSON).
    arguments: Vec<(String, Value)>,
}

impl Listed {
    fn argument(&self, name: &str) -> Option<&Value> {
        self.arguments.iter().find(|(key, _)| key == name).map(|(_, value)| value)
    }
}

/// `rabbitmqctl -q <args> --formatter json`, parsed.
async fn rabbitmqctl_json(args: &[&str]) -> Vec<Value> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .arg("-q")
        .args(args)
        .args(["--formatter", "json"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|err| {
        panic!("rabbitmqctl {args:?} printed no JSON ({err}): {}", String::from_utf8_lossy(&out.stdout))
    })
}

/// Every queue of `vhost`, as the broker has it.
async fn queues(vhost: &TestVhost) -> Vec<Listed> {
    let items = ["name", "type", "durable", "exclusive", "arguments"];
    let listed = rabbitmqctl_json(&[&["list_queues", "-p", vhost.name()][..], &items[..]].concat()).await;
    listed
        .iter()
        .map(|queue| Listed {
            name: queue["name"].as_str().expect("a name").to_owned(),
            kind: queue["type"].as_str().unwrap_or_default().to_owned(),
            durable: queue["durable"] == Value::Bool(true),
            // `true`, or the owner's pid; `false` or "" when not exclusive.
            exclusive: match &queue["exclusive"] {
                Value::Bool(exclusive) => *exclusive,
                Value::String(owner) => !owner.is_empty() && owner != "false",
                _ => false,
            },
            // `[name, type, value]` each.
            arguments: queue["arguments"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|argument| {
                    let name = argument.get(0)?.as_str()?.to_owned();
                    Some((name, argument.get(2)?.clone()))
                })
                .collect(),
        })
        .collect()
}

fn find<'a>(listed: &'a [Listed], name: &str) -> &'a Listed {
    listed.iter().find(|queue| queue.name == name).unwrap_or_else(|| panic!("no queue {name} in {listed:#?}"))
}

/// Applies a payment from a stream (the offset keeps it once).
#[idempotent_handler(key = "payment_id", name = "stream_payment", dedup = false)]
async fn stream_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

/// Every quorum queue a runtime declares — the consumed queue, its dead-letter
/// queue, a stream's dead-letter queue — carries an explicit `x-delivery-limit`, so
/// that RabbitMQ 4.0's default of 20 never applies: the queue's 5 above idemq's own
/// limit, a dead-letter queue's out of reach (2³¹−1, not 4.x's `-1`, which 3.x takes
/// as "drop at the first return"). The retry wait queues carry none and need none:
/// nothing consumes them. Every queue is durable.
#[tokio::test(flavor = "multi_thread")]
async fn every_quorum_queue_idemq_consumes_has_an_explicit_delivery_limit() {
    let bed = Bed::isolated().await;
    let stream = idemq_tests::unique("stream");
    let topology = Topology::new().queue(Queue::stream(stream.clone()));
    let running = Running::start(
        bed.runtime().topology(topology).consume(&bed.queue, ledger_payment).consume(&stream, stream_payment),
    );
    eventually("the queue and the stream consumed", Duration::from_secs(30), || async {
        bed.broker.consumer_count(&bed.queue).await >= 1
            && bed.broker.queue_exists(&format!("{stream}.dlq")).await
    })
    .await;
    running.stop().await.expect("clean shutdown");
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    let listed = queues(vhost).await;

    let queue = find(&listed, &bed.queue);
    assert_eq!(queue.kind, "quorum");
    let expected = Queue::DEFAULT_DELIVERY_LIMIT + Queue::BROKER_LIMIT_MARGIN;
    assert_eq!(queue.argument("x-delivery-limit"), Some(&Value::from(expected)), "{queue:?}");
    for dlq in [bed.dlq.clone(), format!("{stream}.dlq")] {
        let dlq = find(&listed, &dlq);
        assert_eq!(dlq.kind, "quorum");
        assert_eq!(dlq.argument("x-delivery-limit"), Some(&Value::from(i32::MAX)), "{dlq:?}");
    }
    assert_eq!(find(&listed, &stream).kind, "stream");
    let waits: Vec<&Listed> = listed
        .iter()
        .filter(|q| q.name.starts_with(&bed.queue) && q.name != bed.queue && q.name != bed.dlq)
        .collect();
    assert!(!waits.is_empty(), "the retry policy's wait queues: {listed:#?}");
    for wait in waits {
        assert_eq!(wait.kind, "quorum", "{wait:?}");
        assert!(wait.argument("x-message-ttl").is_some(), "a wait queue: {wait:?}");
        assert_eq!(wait.argument("x-delivery-limit"), None, "never consumed, so no limit: {wait:?}");
    }
    for queue in &listed {
        assert!(queue.durable && !queue.exclusive, "{queue:?}");
    }
}

/// A dead-letter queue declared by an idemq that set no delivery limit on them exists
/// without one, and RabbitMQ cannot add an argument to a queue (406). `run` keeps it
/// as it is (with a warning) and consumes; a bare `Topology::declare` refuses it with
/// a `QueueMismatch` saying what it is.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_queue_declared_without_a_limit_is_kept_as_it_is() {
    let bed = Bed::isolated().await;
    bed.broker.delete_queue(&bed.dlq).await;
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    channel.queue_declare(bed.dlq.as_str().into(), durable, quorum).await.expect("the old DLQ");

    let topology = Topology::new().queue(Queue::new(bed.queue.clone()));
    let refused = topology.declare(&channel).await.expect_err("an old DLQ is a mismatch here");
    let said = refused.to_string();
    assert!(
        matches!(&refused, idemq::Error::QueueMismatch { queue, .. } if *queue == bed.dlq)
            && said.contains("x-delivery-limit")
            && said.contains("set no delivery limit"),
        "{said}"
    );

    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    let paid = payment(100);
    bed.publish(&paid).await;
    running.wait_settled(1).await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.ledger_rows(&paid.payment_id).await, 1);
    let listed = queues(bed.vhost.as_ref().expect("an isolated bed")).await;
    assert_eq!(find(&listed, &bed.dlq).argument("x-delivery-limit"), None, "kept as it was");
}

/// A running runtime's channels (a queue's consumer, a stream's, the publishers and
/// the relay) never set a global prefetch (RabbitMQ 4.3 refuses `global = true`; on a
/// quorum queue 3.x closes the connection): every consumer's channel has a prefetch
/// of its own and the broker counts no global one.
#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_sets_its_prefetch_per_consumer_never_globally() {
    let bed = Bed::isolated().await;
    let stream = idemq_tests::unique("stream");
    let topology = Topology::new().queue(Queue::stream(stream.clone()));
    let running = Running::start(
        bed.runtime().topology(topology).consume(&bed.queue, ledger_payment).consume(&stream, stream_payment),
    );
    let vhost = bed.vhost.as_ref().expect("an isolated bed");
    let items = ["vhost", "consumer_count", "prefetch_count", "global_prefetch_count"];
    let channels = || async {
        rabbitmqctl_json(&[&["list_channels"][..], &items[..]].concat())
            .await
            .into_iter()
            .filter(|channel| channel["vhost"] == vhost.name())
            .collect::<Vec<Value>>()
    };
    eventually("a queue consumer and a stream consumer", Duration::from_secs(30), || async {
        channels().await.iter().filter(|channel| channel["consumer_count"].as_u64() > Some(0)).count() >= 2
    })
    .await;
    let listed = channels().await;
    running.stop().await.expect("clean shutdown");
    for channel in &listed {
        assert_eq!(channel["global_prefetch_count"], Value::from(0), "{listed:#?}");
        if channel["consumer_count"].as_u64() > Some(0) {
            assert!(channel["prefetch_count"].as_u64() > Some(0), "a prefetch per consumer: {listed:#?}");
        }
    }
}

/// The workspace's Rust sources, by path (relative to the workspace root).
fn sources() -> Vec<(String, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    let mut found = Vec::new();
    let mut dirs: Vec<std::path::PathBuf> =
        ["idemq", "runtime", "cli", "testing", "macros", "examples", "bench", "tests"]
            .iter()
            .map(|dir| root.join(dir))
            .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a source directory") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let text = std::fs::read_to_string(&path).expect("read a source file");
                let relative = path.strip_prefix(root).expect("under the root").display().to_string();
                found.push((relative, text));
            }
        }
    }
    found
}

/// Whether `text[at]` is on a comment line (a doc comment naming a call, say).
fn commented(text: &str, at: usize) -> bool {
    let line_start = text[..at].rfind('\n').map_or(0, |newline| newline + 1);
    text[line_start..at].trim_start().starts_with("//")
}

/// The text of the bracketed group that opens at `text[open]` (`(` or `{`).
fn group(text: &str, open: usize) -> &str {
    let (opening, closing) = match text.as_bytes()[open] {
        b'(' => (b'(', b')'),
        _ => (b'{', b'}'),
    };
    let mut depth = 0;
    for (at, byte) in text.bytes().enumerate().skip(open) {
        if byte == opening {
            depth += 1;
        } else if byte == closing {
            depth -= 1;
            if depth == 0 {
                return &text[open..=at];
            }
        }
    }
    &text[open..]
}

/// Every `basic_qos` call in the workspace (runtime, CLI, test kit, bench, examples,
/// tests) asks for a per-consumer prefetch, `global = false` (lapin's default): RabbitMQ
/// 4.3 refuses global QoS. Every queue declared anywhere is passive, durable or
/// exclusive: 4.3 refuses transient non-exclusive queues. (A source search: the
/// tests above read back what a running runtime did; this covers the CLI, bench and
/// examples too.)
#[test]
fn no_source_asks_for_global_qos_or_a_transient_shared_queue() {
    let this = file!().rsplit('/').next().expect("a file name");
    let mut qos_calls = 0;
    let mut wrong = Vec::new();
    for (path, text) in sources() {
        if path.ends_with(this) {
            continue;
        }
        for (at, _) in text.match_indices("basic_qos(").filter(|(at, _)| !commented(&text, *at)) {
            let call = group(&text, at + "basic_qos".len());
            qos_calls += 1;
            if !(call.contains("BasicQosOptions::default()") || call.contains("global: false")) {
                wrong.push(format!("{path}: basic_qos{call}"));
            }
        }
        if text.match_indices("global: true").any(|(at, _)| !commented(&text, at)) {
            wrong.push(format!("{path}: global: true"));
        }
        for (at, _) in text.match_indices("QueueDeclareOptions").filter(|(at, _)| !commented(&text, *at)) {
            let rest = &text[at + "QueueDeclareOptions".len()..];
            let options = if rest.starts_with(" {") {
                group(&text, at + "QueueDeclareOptions ".len())
            } else if rest.starts_with("::default()") && !text[..at].ends_with("..") {
                // `QueueDeclareOptions::default()` on its own is transient and shared,
                // unless made passive.
                let call = &rest["::default()".len()..];
                if call.starts_with(".passive()") {
                    continue;
                }
                "default()"
            } else {
                // `use`, a type, `::durable()`, the tail of a literal.
                continue;
            };
            let fine =
                ["passive: true", "durable: true", "exclusive: true"].iter().any(|f| options.contains(f));
            if !fine {
                wrong.push(format!("{path}: QueueDeclareOptions {options}"));
            }
        }
    }
    assert!(qos_calls >= 5, "found only {qos_calls} basic_qos calls: is the search still looking?");
    assert!(wrong.is_empty(), "RabbitMQ 4.3 refuses these:\n{}", wrong.join("\n"));
}

#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq)]
struct Receipt {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id", name = "quote")]
async fn quote(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<Receipt, HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(Receipt { payment_id: msg.payment_id })
}

/// Counts the replies the relay deleted unpublished.
#[derive(Default)]
struct ExpiredReplies(AtomicUsize);

impl idemq::observe::Observe for ExpiredReplies {
    fn relay(&self, pass: &idemq::observe::RelayPass) {
        self.0.fetch_add(pass.expired, Ordering::SeqCst);
    }
}

/// Publishes `paid` as a request to the bed's queue on `channel`, its reply to
/// `reply_to` with `correlation_id`.
async fn request_on(
    channel: &lapin::Channel,
    bed: &Bed,
    paid: &PaymentRequested,
    reply_to: &str,
    correlation_id: &str,
) {
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_reply_to(reply_to.into())
        .with_correlation_id(correlation_id.into());
    let body = serde_json::to_vec(paid).expect("serialize");
    channel
        .basic_publish("".into(), bed.queue.as_str().into(), BasicPublishOptions::default(), &body, props)
        .await
        .expect("publish the request");
}

/// A direct reply-to requester: a connection consuming `amq.rabbitmq.reply-to`.
async fn direct_requester(bed: &Bed) -> (lapin::Connection, lapin::Channel, lapin::Consumer) {
    let connection = lapin::Connection::connect(&bed.amqp_url, lapin::ConnectionProperties::default())
        .await
        .expect("the requester connects");
    let channel = connection.create_channel().await.expect("a channel");
    let replies = channel
        .basic_consume(
            "amq.rabbitmq.reply-to".into(),
            "requester".into(),
            BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() },
            FieldTable::default(),
        )
        .await
        .expect("consume direct reply-to");
    (connection, channel, replies)
}

/// Stages three requesters that are gone before their request is answered — one whose
/// named reply queue was deleted (the reply is returned, 312), one whose direct
/// reply-to channel closed, and idemq's own request client that timed out and closed
/// (the broker would confirm and drop both replies; on RabbitMQ 4.2 even a `mandatory`
/// one) — and one direct reply-to requester that waits. The waiting one gets its
/// reply. Each reply to a vanished requester must end the same way: kept and retried
/// (never looping, never dropped unseen), never holding up an event written behind
/// it, then deleted unpublished once past the reply TTL, and counted once
/// (`idemq_outbox_replies_expired_total`). Every request is applied once.
#[tokio::test(flavor = "multi_thread")]
async fn replies_to_requesters_that_are_gone_end_by_expiry_and_hold_up_nothing() {
    use futures_util::StreamExt;
    let bed = Bed::isolated().await;
    let target = idemq_tests::unique("events");
    bed.broker.declare_queue(&target).await;
    let asked: Vec<PaymentRequested> = (0..4).map(|i| payment(100 + i)).collect();

    // A named reply queue, deleted before the reply is published.
    let deleted = idemq_tests::unique("replies");
    bed.broker.declare_queue(&deleted).await;
    let channel = bed.broker.connection().create_channel().await.expect("a channel");
    request_on(&channel, &bed, &asked[0], &deleted, "c-deleted").await;
    bed.broker.delete_queue(&deleted).await;
    // A direct reply-to requester that leaves.
    let (gone, gone_channel, _replies) = direct_requester(&bed).await;
    request_on(&gone_channel, &bed, &asked[1], "amq.rabbitmq.reply-to", "c-direct-gone").await;
    gone.close(200, "the requester leaves".into()).await.expect("close the requester");
    // idemq's request client, timed out (nothing consumes yet) and closed.
    let publisher = idemq::Publisher::connect(&bed.amqp_url).await.expect("a publisher");
    let request = idemq::outbox::Outgoing::json("", &bed.queue, &asked[2]).expect("outgoing");
    let timed_out = publisher.request_outgoing(request, Duration::from_millis(300)).await;
    assert!(matches!(timed_out, Err(idemq::publisher::RequestError::Timeout { .. })), "{timed_out:?}");
    publisher.close().await;
    // A direct reply-to requester that waits.
    let (_waiting, waiting_channel, mut replies) = direct_requester(&bed).await;
    request_on(&waiting_channel, &bed, &asked[3], "amq.rabbitmq.reply-to", "c-direct-waits").await;

    let expired = Arc::new(ExpiredReplies::default());
    let builder = bed
        .runtime()
        .reply_ttl(Duration::from_secs(6))
        .relay_poll_interval(Duration::from_millis(100))
        .observe(Arc::clone(&expired))
        .consume(&bed.queue, quote);
    let running = Running::start(builder);
    let reply =
        idemq_tests::with_timeout("the waiting requester's reply", Duration::from_secs(30), replies.next())
            .await
            .expect("a reply")
            .expect("a delivery");
    let receipt: Receipt = serde_json::from_slice(&reply.data).expect("a receipt");
    assert_eq!(receipt.payment_id, asked[3].payment_id);

    let rows = || async {
        use diesel::prelude::*;
        use diesel_async::RunQueryDsl;
        use idemq::store::schema::idemq_outbox::dsl::*;
        let mut conn = bed.db.connect().await;
        idemq_outbox
            .select((routing_key, attempts, last_error))
            .load::<(String, i32, Option<String>)>(&mut conn)
            .await
            .expect("read the outbox")
    };
    eventually("the three replies kept, each retried with its reason", Duration::from_secs(20), || async {
        let rows = rows().await;
        let kept = |reason: &str| {
            rows.iter()
                .filter(|(_, tries, error)| {
                    *tries >= 1 && error.as_deref().is_some_and(|e| e.contains(reason))
                })
                .count()
        };
        rows.len() == 3 && kept("unroutable") == 1 && kept("requester is gone") == 2
    })
    .await;
    let mut conn = bed.db.connect().await;
    idemq::outbox::enqueue(&mut conn, idemq::outbox::Outgoing::json("", &target, &1).expect("outgoing"))
        .await
        .expect("enqueue");
    eventually("the event behind the kept replies published", Duration::from_secs(20), || async {
        bed.broker.message_count(&target).await == 1
    })
    .await;
    eventually("the replies deleted once past the TTL", Duration::from_secs(30), || async {
        rows().await.is_empty()
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(expired.0.load(Ordering::SeqCst), 3, "each expired reply counted once");
    for paid in &asked {
        assert_eq!(bed.ledger_rows(&paid.payment_id).await, 1, "every request applied once");
    }
}
