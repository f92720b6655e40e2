//! A message's identity is its own: a recorded copy (retry copy or dead letter) can
//! only ever settle the message it was made from, and the DLQ tools group only true
//! copies. Each test stages one way idemq's first releases lost a message — acked,
//! never applied, in neither the queue nor the DLQ — and checks it is applied.

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::cli::Cli;
use idemq::{
    headers, idempotent_handler, Context, HandlerError, Outcome, Permanent, Queue, RetryPolicy, Topology,
};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ledger_payment, payment, Bed, Running};
use idemq_tests::{eventually, header_i64, in_both_modes, redeliver_once, unique, Broker};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A message whose body says little: two messages may well share it.
#[derive(Debug, Deserialize)]
struct Numbered {
    #[allow(dead_code)]
    n: i64,
}

/// Message ids whose first attempt fails; message ids whose handler ran to `Ok`.
static FAIL_FIRST: Mutex<Vec<String>> = Mutex::new(Vec::new());
static APPLIED: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Keys (payment ids or message ids) whose handler fails until the test "fixes" it.
static BROKEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn applied(message_id: &str) -> usize {
    APPLIED.lock().unwrap().iter().filter(|id| *id == message_id).count()
}

fn is_broken(key: &str) -> bool {
    BROKEN.lock().unwrap().iter().any(|broken| broken == key)
}

fn fix(key: &str) {
    BROKEN.lock().unwrap().retain(|broken| broken != key);
}

#[idempotent_handler(key = "@message_id", name = "by_message_id")]
async fn by_message_id(
    _conn: &mut AsyncPgConnection,
    _msg: Numbered,
    ctx: &Context,
) -> Result<(), std::io::Error> {
    let id = ctx.message_id().unwrap_or_default().to_owned();
    if ctx.attempt() == 1 && FAIL_FIRST.lock().unwrap().contains(&id) {
        return Err(std::io::Error::other("the first attempt fails"));
    }
    APPLIED.lock().unwrap().push(id);
    Ok(())
}

#[idempotent_handler(key = "@message_id", name = "refuses_while_broken")]
async fn refuses_while_broken(
    _conn: &mut AsyncPgConnection,
    _msg: Numbered,
    ctx: &Context,
) -> Result<(), HandlerError> {
    let id = ctx.message_id().unwrap_or_default().to_owned();
    if is_broken(&id) {
        return Err(Permanent(format!("{id}: the account service refuses it")).into());
    }
    APPLIED.lock().unwrap().push(id);
    Ok(())
}

/// The payments effect, failing (transient) while its payment is broken.
#[idempotent_handler(key = "payment_id", name = "apply_payment")]
async fn pays_once_fixed(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if is_broken(&msg.payment_id) {
        return Err(HandlerError::transient("the ledger service is down"));
    }
    record_payment(conn, &msg).await.map_err(HandlerError::transient)
}

fn with_id(id: &str) -> BasicProperties {
    BasicProperties::default().with_content_type("application/json".into()).with_message_id(id.into())
}

/// Runs `<app> dlq <args>` in-process against the bed's broker and database, as an
/// operator would, and checks it succeeded.
async fn dlq(bed: &Bed, builder: idemq::RuntimeBuilder, args: &[&str]) {
    let db = bed.db.url();
    let mut argv = vec!["idemq-test", "--amqp-url", &bed.amqp_url, "--database-url", &db, "dlq"];
    argv.extend_from_slice(args);
    let code = Cli::new("idemq-test", builder).run_from(argv).await;
    assert_eq!(code, ExitCode::SUCCESS, "dlq {args:?} failed (its error is on stderr)");
}

async fn wait_for_count(broker: &Broker, queue: &str, count: u32) {
    eventually(&format!("{count} messages in {queue}"), Duration::from_secs(20), || async {
        broker.message_count(queue).await == count
    })
    .await;
}

in_both_modes! {
/// Case 1. Message m1 (`@message_id` key) fails once, so its retry copy is
/// recorded. Message m2 — another `message_id`, the same body — is redelivered
/// (its first consumer died holding it). The copy of m1 must not settle m2: m2's
/// handler runs and it is applied.
async fn another_message_with_the_same_body_is_not_settled_by_a_recorded_copy() {
    let bed = Bed::new().await;
    let (m1, m2) = (unique("m1"), unique("m2"));
    FAIL_FIRST.lock().unwrap().push(m1.clone());
    let body = br#"{"n":1}"#;
    bed.broker.publish_bytes(&bed.queue, body, with_id(&m1)).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_message_id), 2).await;
    assert!(events.iter().any(|e| matches!(e.outcome, Outcome::Retry { .. })), "{events:?}");
    assert!(events.iter().any(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(applied(&m1), 1);

    bed.broker.publish_bytes(&bed.queue, body, with_id(&m2)).await;
    redeliver_once(&bed.broker, &bed.queue).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, by_message_id), 1).await;
    assert!(events[0].redelivered, "{events:?}");
    assert_eq!(events[0].outcome, Outcome::Applied, "m2 is its own message: {events:?}");
    assert_eq!(applied(&m2), 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
}

in_both_modes! {
/// Case 2. A payment fails until it is dead-lettered; the operator fixes the cause
/// and runs `dlq replay`; the consumer holding the replayed message dies before
/// settling it. The redelivery starts again at attempt 1 — whose copy id the first
/// retry copy recorded — and must be applied, not acked as already copied: the
/// replay is a new lineage generation (`x-idemq-replay: 1`).
async fn a_replayed_dead_letter_redelivered_before_it_settles_is_applied() {
    let bed = Bed::new().await;
    let p = payment(21);
    BROKEN.lock().unwrap().push(p.payment_id.clone());
    bed.publish(&p).await;
    let two_attempts = || RetryPolicy::new([Duration::from_millis(10)]);
    let events =
        Running::settle(bed.runtime().consume_with(&bed.queue, pays_once_fixed, two_attempts()), 2).await;
    // In either order: the first attempt's event is recorded once its retry copy is
    // confirmed and the delivery acked, and by then the copy may be settled.
    assert!(events.iter().any(|e| matches!(e.outcome, Outcome::DeadLettered { .. })), "{events:?}");

    fix(&p.payment_id);
    dlq(&bed, bed.runtime().consume_with(&bed.queue, pays_once_fixed, two_attempts()), &["replay"]).await;
    wait_for_count(&bed.broker, &bed.queue, 1).await;
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
    redeliver_once(&bed.broker, &bed.queue).await;

    let events =
        Running::settle(bed.runtime().consume_with(&bed.queue, pays_once_fixed, two_attempts()), 1).await;
    assert!(events[0].redelivered, "{events:?}");
    assert_eq!(events[0].outcome, Outcome::Applied, "the replay is applied: {events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
}

/// Case 3. Two dead letters with different `message_id`s and one body are two
/// messages: `dlq purge --limit 1` removes one, `dlq replay` sends the other back
/// (it was once grouped with the first as its copy and acked out of the DLQ), and
/// it is applied.
#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_of_two_messages_with_one_body_are_replayed_and_purged_apart() {
    let bed = Bed::new().await;
    let ids: Vec<String> = (0..3).map(|i| unique(&format!("m{i}"))).collect();
    BROKEN.lock().unwrap().extend(ids.iter().cloned());
    for id in &ids {
        bed.broker.publish_bytes(&bed.queue, br#"{"n":3}"#, with_id(id)).await;
    }
    let builder = || bed.runtime().consume(&bed.queue, refuses_while_broken);
    let events = Running::settle(builder(), 3).await;
    assert!(events.iter().all(|e| matches!(e.outcome, Outcome::DeadLettered { .. })), "{events:?}");
    wait_for_count(&bed.broker, &bed.dlq, 3).await;

    dlq(&bed, builder(), &["purge", "--dry-run"]).await;
    wait_for_count(&bed.broker, &bed.dlq, 3).await;
    dlq(&bed, builder(), &["purge", "--limit", "1", "--yes"]).await;
    wait_for_count(&bed.broker, &bed.dlq, 2).await;

    for id in &ids {
        fix(id);
    }
    dlq(&bed, builder(), &["replay", "--dry-run"]).await;
    wait_for_count(&bed.broker, &bed.dlq, 2).await;
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0, "a dry run publishes nothing");
    dlq(&bed, builder(), &["replay"]).await;
    wait_for_count(&bed.broker, &bed.queue, 2).await;
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
    let events = Running::settle(builder(), 2).await;
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied), "{events:?}");
    assert_eq!(ids.iter().map(|id| applied(id)).sum::<usize>(), 2, "the two left are applied once each");
}

/// Dead-letters one message (`refuses_while_broken`, its id broken) and takes its
/// dead letter out of the DLQ: its id and the letter, for a test to put back.
async fn one_dead_letter(bed: &Bed, body: &[u8]) -> (String, lapin::message::Delivery) {
    let id = unique("m");
    BROKEN.lock().unwrap().push(id.clone());
    bed.broker.publish_bytes(&bed.queue, body, with_id(&id)).await;
    Running::settle(bed.runtime().consume(&bed.queue, refuses_while_broken), 1).await;
    let letter = bed.broker.drain(&bed.dlq).await.pop().expect("the dead letter").delivery;
    (id, letter)
}

/// True copies are still one: the same dead letter twice in the DLQ (its original
/// dead-lettered again after a lost ack, before the copy was recorded) is replayed
/// once, the other copy removed.
#[tokio::test(flavor = "multi_thread")]
async fn true_copies_of_one_dead_letter_are_replayed_once() {
    let bed = Bed::new().await;
    let (id, letter) = one_dead_letter(&bed, br#"{"n":4}"#).await;
    let builder = || bed.runtime().consume(&bed.queue, refuses_while_broken);
    for _ in 0..2 {
        bed.broker.publish_bytes(&bed.dlq, &letter.data, letter.properties.clone()).await;
    }
    wait_for_count(&bed.broker, &bed.dlq, 2).await;
    fix(&id);
    dlq(&bed, builder(), &["replay"]).await;
    wait_for_count(&bed.broker, &bed.queue, 1).await;
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0, "the copy went with it");
}

/// Each replay adds one to `x-idemq-replay`; a letter replayed `--max-replays`
/// times (default 5) stays in the DLQ instead of going round for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_letter_replayed_max_replays_times_stays_in_the_dlq() {
    let bed = Bed::new().await;
    let (_, letter) = one_dead_letter(&bed, br#"{"n":5}"#).await;
    let builder = || bed.runtime().consume(&bed.queue, refuses_while_broken);
    let mut table = letter.properties.headers().clone().unwrap_or_default();
    table.insert(headers::REPLAY.into(), AMQPValue::LongLongInt(5));
    bed.broker.publish_bytes(&bed.dlq, &letter.data, letter.properties.clone().with_headers(table)).await;
    wait_for_count(&bed.broker, &bed.dlq, 1).await;

    dlq(&bed, builder(), &["replay"]).await;
    wait_for_count(&bed.broker, &bed.dlq, 1).await;
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0, "replayed 5 times: left in the DLQ");

    dlq(&bed, builder(), &["replay", "--max-replays", "6"]).await;
    wait_for_count(&bed.broker, &bed.queue, 1).await;
    let replayed = bed.broker.drain(&bed.queue).await.pop().expect("the replay").delivery;
    assert_eq!(header_i64(&replayed.properties, headers::REPLAY), Some(6));
    assert_eq!(header_i64(&replayed.properties, headers::ATTEMPTS), None, "a replay starts afresh");
}

/// Two queues may share one dead-letter queue: each letter goes back to the queue
/// it was consumed from (`x-idemq-queue`), not all to the first.
#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_of_a_shared_dlq_go_back_to_their_own_queues() {
    let bed = Bed::new().await;
    let (a, b, shared) = (unique("qa"), unique("qb"), unique("shared-dlq"));
    let topology = Topology::new()
        .queue(Queue::new(a.clone()).dead_letter_queue(shared.clone()))
        .queue(Queue::new(b.clone()).dead_letter_queue(shared.clone()));
    let channel = bed.broker.connection().create_channel().await.expect("channel");
    topology.declare(&channel).await.expect("declare");
    for (queue, n) in [(&a, 1), (&b, 2), (&b, 3)] {
        let mut table = FieldTable::default();
        table.insert(headers::QUEUE.into(), AMQPValue::LongString(LongString::from(queue.as_str())));
        table.insert(headers::COPY_ID.into(), AMQPValue::LongString(format!("v2.{n:032}:1").into()));
        let body = format!(r#"{{"n":{n}}}"#);
        bed.broker.publish_bytes(&shared, body.as_bytes(), with_id(&unique("m")).with_headers(table)).await;
    }
    wait_for_count(&bed.broker, &shared, 3).await;
    let builder = bed.runtime().topology(topology).consume(&a, refuses_while_broken);
    dlq(&bed, builder, &["replay"]).await;
    wait_for_count(&bed.broker, &a, 1).await;
    wait_for_count(&bed.broker, &b, 2).await;
    assert_eq!(bed.broker.message_count(&shared).await, 0);
    for queue in [a, b, shared] {
        bed.broker.delete_queue(&queue).await;
    }
}

/// The copy id of idemq's first releases: `sha256(scope, 0, body)[..16]:<attempt>`.
fn old_copy_id(scope: &str, body: &[u8], attempt: u32) -> String {
    let digest = Sha256::new().chain_update(scope.as_bytes()).chain_update([0]).chain_update(body).finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{hex}:{attempt}")
}

/// An upgrade with copies in flight: the old code recorded a retry copy under its
/// old id, the copy is in the wait queue and its original's ack was lost. After the
/// upgrade the redelivered original is applied (the old record is never looked up:
/// it could belong to another message) and the old copy, back from the wait queue,
/// is a duplicate — applied once. An old dead letter (no `x-idemq-queue`) replays to
/// the DLQ's one queue, and two old letters sharing an old lineage but not their
/// `message_id` are two.
#[tokio::test(flavor = "multi_thread")]
async fn copies_made_by_the_old_code_are_settled_once_after_an_upgrade() {
    let bed = Bed::new().await;
    let p = payment(31);
    let body = serde_json::to_vec(&p).unwrap();
    let old_id = old_copy_id("apply_payment", &body, 1);
    let mut conn = bed.db.connect().await;
    diesel::sql_query("INSERT INTO idemq_copies (copy_id) VALUES ($1)")
        .bind::<diesel::sql_types::Text, _>(&old_id)
        .execute(&mut conn)
        .await
        .expect("record the old copy");
    bed.publish(&p).await;
    redeliver_once(&bed.broker, &bed.queue).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    running.wait_settled(1).await;
    let mut table = FieldTable::default();
    for (name, value) in [
        (headers::COPY_ID, old_id.as_str()),
        (headers::RETRY_OF, bed.queue.as_str()),
        (headers::HANDLER, "apply_payment"),
    ] {
        table.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    table.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(1));
    let json = BasicProperties::default().with_content_type("application/json".into());
    let wait_queue = format!("{}.retry.10ms", bed.queue);
    bed.broker.publish_bytes(&wait_queue, &body, json.clone().with_headers(table)).await;
    running.wait_settled(2).await;
    let events = running.events();
    running.stop().await.expect("stop");
    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert!(events[0].redelivered, "{events:?}");
    assert_eq!((events[1].attempt, &events[1].outcome), (2, &Outcome::Duplicate), "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);

    // Old dead letters: one lineage by the old hash, two message ids.
    let mut old_letter = FieldTable::default();
    let shared_old_id = old_copy_id("by_message_id", br#"{"n":6}"#, 1);
    old_letter.insert(headers::COPY_ID.into(), AMQPValue::LongString(shared_old_id.as_str().into()));
    old_letter.insert(headers::ERROR_KIND.into(), AMQPValue::LongString("handler".into()));
    for id in [unique("old1"), unique("old2")] {
        let props = with_id(&id).with_headers(old_letter.clone());
        bed.broker.publish_bytes(&bed.dlq, br#"{"n":6}"#, props).await;
    }
    wait_for_count(&bed.broker, &bed.dlq, 2).await;
    dlq(&bed, bed.runtime().consume(&bed.queue, ledger_payment), &["replay"]).await;
    wait_for_count(&bed.broker, &bed.queue, 2).await;
    let replayed = bed.broker.drain(&bed.queue).await;
    assert!(
        replayed.iter().all(|m| header_i64(&m.delivery.properties, headers::REPLAY) == Some(1)),
        "each replay is generation 1"
    );
    let ids: HashSet<_> = replayed.iter().map(|m| m.delivery.properties.message_id().clone()).collect();
    assert_eq!(ids.len(), 2, "two messages, both replayed");
}

/// A loopback forwarder to the machine's broker that rewrites, inside each AMQP frame
/// a client sends, every `~~bad-` to the bytes `ff fe bad-` and every `^^bad-` to
/// `fe ff bad-` (same lengths): a publisher sending short strings that are not
/// UTF-8, which lapin cannot send itself. Stops with the test's runtime.
async fn not_utf8_forwarder() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect("127.0.0.1:5672").await.expect("the broker");
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
            tokio::spawn(async move {
                let mut protocol = [0_u8; 8];
                client_read.read_exact(&mut protocol).await?;
                server_write.write_all(&protocol).await?;
                loop {
                    let mut header = [0_u8; 7];
                    client_read.read_exact(&mut header).await?;
                    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
                    let mut payload = vec![0_u8; size + 1];
                    client_read.read_exact(&mut payload).await?;
                    for (from, to) in [(b"~~bad-", b"\xff\xfebad-"), (b"^^bad-", b"\xfe\xffbad-")] {
                        while let Some(at) = payload.windows(from.len()).position(|w| w == from) {
                            payload[at..at + to.len()].copy_from_slice(to);
                        }
                    }
                    server_write.write_all(&header).await?;
                    server_write.write_all(&payload).await?;
                }
                #[allow(unreachable_code)]
                Ok::<(), std::io::Error>(())
            });
        }
    });
    format!("amqp://guest:guest@{address}/%2f")
}

/// A `message_id` that is not UTF-8 (a pika publisher may send any bytes) used to
/// fail lapin's frame parser: the connection closed, the message came first again
/// on every reconnect, and the queue's delivery limit finally dead-lettered it and
/// the good messages beside it. With the patched parser (vendor/README.md) it reads
/// one-to-one (U+FDD0 and the hex of its bytes): `ff fe bad-01` and `fe ff bad-01`
/// — one string under a lossy reading — are two messages, both applied; the first
/// again is a duplicate; the good message beside them is applied; the connection
/// never drops.
#[tokio::test(flavor = "multi_thread")]
async fn message_ids_that_are_not_utf8_are_keyed_one_to_one_and_break_no_connection() {
    let bed = Bed::new().await;
    let publisher = Broker::connect(&not_utf8_forwarder().await).await;
    let good = unique("good");
    for id in ["~~bad-01", "^^bad-01", "~~bad-01", good.as_str()] {
        publisher.publish_bytes(&bed.queue, br#"{"n":7}"#, with_id(id)).await;
    }
    let running = Running::start(bed.runtime().consume(&bed.queue, by_message_id));
    running.wait_settled(4).await;
    let (events, connections) = (running.events(), running.connection_events());
    running.stop().await.expect("stop");
    let applied_ids: Vec<_> = events.iter().filter(|e| e.outcome == Outcome::Applied).collect();
    assert_eq!(applied_ids.len(), 3, "{events:?}");
    assert_eq!(events.iter().filter(|e| e.outcome == Outcome::Duplicate).count(), 1, "{events:?}");
    let keys: HashSet<_> = events.iter().filter_map(|e| e.key.clone()).collect();
    assert!(
        keys.contains("\u{FDD0}fffe6261642d3031") && keys.contains("\u{FDD0}feff6261642d3031"),
        "{keys:?}"
    );
    assert_eq!(applied(&good), 1);
    assert!(
        !connections.iter().any(|event| matches!(event, idemq::observe::ConnectionEvent::Lost { .. })),
        "the connection never dropped: {connections:?}"
    );
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
