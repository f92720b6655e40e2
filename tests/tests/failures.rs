//! Failure paths: handler errors roll back and retry, attempts are bounded, and bad
//! input is dead-lettered with its reason while the consumer keeps going.

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use std::collections::HashMap;
use std::time::Duration;

use idemq::{headers, idempotent_handler, FailureKind, HandlerError, Outcome, Permanent, RetryPolicy};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ledger_payment, next_attempt, payment, test_retry_policy, Bed, Running};
use idemq_tests::in_both_modes;
use idemq_tests::{header_i64, header_str};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;

/// Writes its effect, then fails on the first two attempts of each key.
#[idempotent_handler(key = "payment_id")]
async fn fails_twice(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let attempt = next_attempt(&msg.payment_id);
    record_payment(conn, &msg).await?;
    if attempt <= 2 {
        return Err(HandlerError::transient("the first two attempts fail after writing"));
    }
    Ok(())
}

in_both_modes! {
/// A handler error rolls back the effect and the dedup row together; the message
/// comes back through the wait queues and is applied exactly once, on attempt 3.
async fn transient_errors_roll_back_and_attempt_three_applies_once() {
    let bed = Bed::new().await;
    let p = payment(700);
    bed.publish(&p).await;

    let events = Running::settle_message(bed.runtime().consume(&bed.queue, fails_twice), &p.payment_id).await;

    assert!(
        matches!(events[0].outcome, Outcome::Retry { delay, .. } if delay == Duration::from_millis(10)),
        "{events:?}"
    );
    assert!(
        matches!(events[1].outcome, Outcome::Retry { delay, .. } if delay == Duration::from_millis(20)),
        "{events:?}"
    );
    // Had a failed attempt left its dedup row, the next would be a Duplicate and the
    // handler would not have run again.
    assert_eq!(events[2].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(idemq_tests::fixture::attempts_of(&p.payment_id), 3);
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "the failed attempts' ledger rows were rolled back");
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
    for (wait_queue, _) in test_retry_policy().wait_queues(&bed.queue) {
        assert_eq!(bed.broker.message_count(&wait_queue).await, 0, "{wait_queue} is empty");
    }
}
}

#[idempotent_handler(key = "payment_id")]
async fn always_fails(_conn: &mut AsyncPgConnection, _msg: PaymentRequested) -> Result<(), std::io::Error> {
    Err(std::io::Error::other("the ledger service is down"))
}

in_both_modes! {
/// A handler that always fails transiently ends in the DLQ after its last attempt,
/// with every explaining header, and leaves no effect and no dedup row.
async fn always_failing_handler_is_dead_lettered_after_its_last_attempt() {
    let bed = Bed::new().await;
    let p = payment(5);
    bed.publish(&p).await;

    let three_attempts = RetryPolicy::new([10, 20].map(Duration::from_millis));
    let builder = bed.runtime().consume_with(&bed.queue, always_fails, three_attempts);
    let events = Running::settle_message(builder, &p.payment_id).await;

    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2, 3], "{events:?}");
    assert!(matches!(events[0].outcome, Outcome::Retry { .. }));
    assert!(matches!(events[1].outcome, Outcome::Retry { .. }));
    assert!(
        matches!(&events[2].outcome, Outcome::DeadLettered { kind: FailureKind::AttemptsExhausted, .. }),
        "{events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1);
    let props = &dead[0].delivery.properties;
    assert_eq!(header_str(props, headers::ERROR_KIND).as_deref(), Some("attempts-exhausted"));
    assert_eq!(header_i64(props, headers::ATTEMPTS), Some(3));
    assert_eq!(header_str(props, headers::HANDLER).as_deref(), Some("always_fails"));
    assert_eq!(header_str(props, headers::ORIGINAL_ROUTING_KEY).as_deref(), Some(bed.queue.as_str()));
    assert_eq!(header_str(props, headers::ORIGINAL_EXCHANGE).as_deref(), Some(""));
    assert!(header_str(props, headers::FIRST_FAILURE).is_some());
    assert!(header_str(props, headers::LAST_FAILURE).is_some());
    assert!(header_str(props, headers::ERROR).unwrap().contains("the ledger service is down"));
    // The DLQ (a quorum queue) sets its own count, 0 here; any earlier count is stripped.
    assert_eq!(header_i64(props, headers::DELIVERY_COUNT).unwrap_or(0), 0, "the broker's count is stripped");
    assert_eq!(dead[0].delivery.data, serde_json::to_vec(&p).unwrap(), "the body is the original");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 0);
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 0);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

#[idempotent_handler(key = "payment_id")]
async fn refuses(_conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    Err(Permanent(format!("account {} is closed", msg.account)).into())
}

in_both_modes! {
/// A permanent error goes to the DLQ at once, without retries.
async fn permanent_error_is_dead_lettered_without_retry() {
    let bed = Bed::new().await;
    let p = payment(5);
    bed.publish(&p).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, refuses), 1).await;
    assert!(
        matches!(&events[0].outcome, Outcome::DeadLettered { kind: FailureKind::Handler, .. }),
        "{events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header_str(&dead[0].delivery.properties, headers::ERROR_KIND).as_deref(), Some("handler"));
    assert_eq!(header_i64(&dead[0].delivery.properties, headers::ATTEMPTS), Some(1));
}
}

in_both_modes! {
/// A redelivered message whose handler already started `delivery_limit` times
/// without an outcome (recorded before each start, so it survives the crashes it
/// caused) is dead-lettered as `poison` without running the handler again.
async fn a_message_whose_handler_started_limit_times_is_dead_lettered_as_poison() {
    let bed = Bed::with_queue(|q| q.delivery_limit(3)).await;
    let p = payment(5);
    bed.publish(&p).await;
    // Two earlier starts that never ended (the consumer died in them) ...
    let mut conn = bed.db.connect().await;
    diesel::sql_query("INSERT INTO idemq_started (handler, key, starts) VALUES ('apply_payment', $1, 2)")
        .bind::<diesel::sql_types::Text, _>(&p.payment_id)
        .execute(&mut conn)
        .await
        .expect("stage the earlier starts");
    // ... and the broker's redelivery after the last one.
    idemq_tests::redeliver_once(&bed.broker, &bed.queue).await;

    let events = Running::settle(bed.runtime().consume(&bed.queue, ledger_payment), 1).await;
    assert!(events[0].redelivered, "{events:?}");
    assert!(
        matches!(&events[0].outcome, Outcome::DeadLettered { kind: FailureKind::Poison, .. }),
        "{events:?}"
    );
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 0, "the handler did not run");
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 0);
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(header_str(&dead[0].delivery.properties, headers::ERROR_KIND).as_deref(), Some("poison"));
}
}

in_both_modes! {
/// A publisher may set `x-delivery-count` itself (it survives publishing): on a
/// first delivery it is not the broker's word, and the message is applied.
async fn a_first_delivery_with_a_client_set_delivery_count_is_applied_not_poison() {
    let bed = Bed::with_queue(|q| q.delivery_limit(3)).await;
    let p = payment(5);
    let mut table = FieldTable::default();
    table.insert(headers::DELIVERY_COUNT.into(), AMQPValue::LongLongInt(50));
    let props = BasicProperties::default().with_headers(table).with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, &serde_json::to_vec(&p).unwrap(), props).await;
    let events = Running::settle(bed.runtime().consume(&bed.queue, ledger_payment), 1).await;
    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(events[0].delivery_count, 0, "the client's count is not reported as the broker's");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.dlq).await, 0);
}
}

/// A bad message: name, body, content-type, expected kind, a phrase the error must hold.
type BadInput = (&'static str, Vec<u8>, Option<&'static str>, FailureKind, &'static str);

/// A random, incompressible string of `len` printable characters.
fn random_text(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~!*";
    let mut out = String::with_capacity(len);
    while out.len() < len {
        for byte in uuid::Uuid::new_v4().as_bytes() {
            out.push(ALPHABET[usize::from(*byte) % ALPHABET.len()] as char);
        }
    }
    out.truncate(len);
    out
}

in_both_modes! {
/// Every kind of bad input ends in the DLQ with a clear error and its kind, byte for
/// byte, and the consumer keeps consuming: a good message after them is applied.
async fn bad_input_is_dead_lettered_with_its_reason_and_the_consumer_lives_on() {
    let bed = Bed::new().await;
    let json = "application/json";
    let deep = format!(
        r#"{{"payment_id":"deep","account":"a","amount_cents":1,"extra":{}1{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let cases: Vec<BadInput> = vec![
        ("not-json", b"payment 42, please".to_vec(), Some(json), FailureKind::Decode, "not JSON"),
        ("empty-body", Vec::new(), Some(json), FailureKind::Decode, "truncated or empty"),
        ("invalid-utf8", b"\xff\xfe\xfd".to_vec(), Some(json), FailureKind::Decode, "not JSON"),
        ("array", b"[1, 2, 3]".to_vec(), Some(json), FailureKind::Decode, "not a valid"),
        ("string", br#""payment""#.to_vec(), Some(json), FailureKind::Decode, "not a valid"),
        (
            "missing-key",
            br#"{"account":"a","amount_cents":1}"#.to_vec(),
            Some(json),
            FailureKind::Key,
            "missing",
        ),
        (
            "null-key",
            br#"{"payment_id":null,"account":"a","amount_cents":1}"#.to_vec(),
            None,
            FailureKind::Key,
            "missing",
        ),
        (
            "empty-key",
            br#"{"payment_id":"","account":"a","amount_cents":1}"#.to_vec(),
            None,
            FailureKind::Key,
            "empty",
        ),
        (
            "nul-key",
            br#"{"payment_id":"a\u0000b","account":"a","amount_cents":1}"#.to_vec(),
            None,
            FailureKind::Key,
            "NUL",
        ),
        (
            "wrong-type",
            br#"{"payment_id":"w","account":"a","amount_cents":"ten"}"#.to_vec(),
            None,
            FailureKind::Decode,
            "invalid type",
        ),
        ("truncated", br#"{"payment_id":"t","account":"#.to_vec(), None, FailureKind::Decode, "truncated"),
        ("too-deep", deep.into_bytes(), None, FailureKind::Decode, "nests deeper than 128"),
        (
            "too-large",
            format!(r#"{{"payment_id":"big","account":"{}","amount_cents":1}}"#, "x".repeat(5000))
                .into_bytes(),
            None,
            FailureKind::TooLarge,
            "over the limit",
        ),
        (
            "content-type",
            br#"{"payment_id":"ct","account":"a","amount_cents":1}"#.to_vec(),
            Some("text/plain"),
            FailureKind::ContentType,
            "text/plain",
        ),
    ];
    for (name, body, content_type, _, _) in &cases {
        let mut table = FieldTable::default();
        table.insert("x-test-case".into(), AMQPValue::LongString(LongString::from(*name)));
        let mut props = BasicProperties::default().with_headers(table);
        if let Some(ct) = content_type {
            props = props.with_content_type((*ct).into());
        }
        bed.broker.publish_bytes(&bed.queue, body, props).await;
    }
    // A 3 KB random key indexes fine (it is stored hashed) and is applied.
    let long =
        PaymentRequested { payment_id: random_text(3_000), account: "acct-long".into(), amount_cents: 3 };
    bed.publish(&long).await;
    let good = payment(42);
    bed.publish(&good).await;

    let events = Running::settle(
        bed.runtime().consume(&bed.queue, ledger_payment).max_body_bytes(4_096),
        cases.len() + 2,
    )
    .await;

    assert_eq!(bed.ledger_rows(&good.payment_id).await, 1, "the consumer lived on: {events:?}");
    assert_eq!(bed.ledger_rows(&long.payment_id).await, 1, "the long key was applied");
    assert_eq!(bed.dedup_rows(&long.payment_id).await, 0, "the long key is stored as its hash");
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), cases.len(), "one dead letter per bad message");
    let by_case: HashMap<String, _> = dead
        .iter()
        .map(|m| {
            (header_str(&m.delivery.properties, "x-test-case").expect("the original headers are kept"), m)
        })
        .collect();
    for (name, body, _, kind, says) in &cases {
        let letter = by_case.get(*name).unwrap_or_else(|| panic!("{name} was not dead-lettered"));
        let props = &letter.delivery.properties;
        assert_eq!(header_str(props, headers::ERROR_KIND).as_deref(), Some(kind.as_str()), "{name}");
        let error = header_str(props, headers::ERROR).unwrap_or_default();
        assert!(error.contains(says), "{name}: x-idemq-error {error:?} should mention {says:?}");
        assert!(error.len() <= idemq::headers::MAX_ERROR_HEADER_BYTES, "{name}");
        assert_eq!(&letter.delivery.data, body, "{name}: the body is byte-for-byte the original");
    }
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// The same key with a different payload is not a duplicate but a client bug: it is
/// dead-lettered as a `conflict` naming both fingerprints; the first payload stands.
async fn same_key_with_another_payload_is_dead_lettered_as_conflict() {
    let bed = Bed::new().await;
    let first = payment(100);
    let reused = PaymentRequested { amount_cents: 999_999, ..first.clone() };
    bed.publish(&first).await;
    bed.publish(&first).await;
    bed.publish(&reused).await;
    // One at a time, so the first payload is the one applied.
    let events = Running::settle(bed.runtime().consume(&bed.queue, ledger_payment).concurrency(1), 3).await;

    assert_eq!(events[0].outcome, Outcome::Applied);
    assert_eq!(events[1].outcome, Outcome::Duplicate, "the identical copy is a plain duplicate");
    assert!(
        matches!(&events[2].outcome, Outcome::DeadLettered { kind: FailureKind::Conflict, .. }),
        "{events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1);
    let error = header_str(&dead[0].delivery.properties, headers::ERROR).unwrap();
    assert!(error.contains("different payload") && error.matches("sha256").count() == 2, "{error}");
    assert_eq!(dead[0].delivery.data, serde_json::to_vec(&reused).unwrap());
    assert_eq!(bed.ledger_rows(&first.payment_id).await, 1);
}
}

in_both_modes! {
/// A publisher that sends a payment again after re-serializing it (other key order,
/// other spacing, an escaped character, a field the message type does not read) sends
/// the same payment: it is acked as a duplicate, not dead-lettered as a conflict. The
/// same key with another amount, however spelled, is still a `conflict`.
async fn a_reserialized_copy_is_a_duplicate_and_another_amount_is_still_a_conflict() {
    let bed = Bed::new().await;
    let first = payment(100);
    // `payment_id` starts with "pay": spell its "p" as \u0070.
    let reserialized = |amount: i64| {
        format!(
            "{{\n  \"amount_cents\" : {amount},\n  \"account\": \"{}\",\n  \"retried_by\": \"outbox-relay\",\n  \"payment_id\": \"\\u0070{}\"\n}}",
            first.account,
            &first.payment_id[1..]
        )
        .into_bytes()
    };
    let props = || BasicProperties::default().with_content_type("application/json".into());
    bed.publish(&first).await;
    bed.broker.publish_bytes(&bed.queue, &reserialized(100), props()).await;
    let other_amount = reserialized(101);
    bed.broker.publish_bytes(&bed.queue, &other_amount, props()).await;
    // One at a time, so the first copy is the one applied.
    let events = Running::settle(bed.runtime().consume(&bed.queue, ledger_payment).concurrency(1), 3).await;

    assert_eq!(events[0].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(events[1].outcome, Outcome::Duplicate, "the re-serialized copy is a duplicate: {events:?}");
    assert!(
        matches!(&events[2].outcome, Outcome::DeadLettered { kind: FailureKind::Conflict, .. }),
        "another amount under the same key is a conflict: {events:?}"
    );
    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 1, "only the other amount is dead-lettered");
    assert_eq!(dead[0].delivery.data, other_amount);
    assert_eq!(bed.ledger_rows(&first.payment_id).await, 1);
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

in_both_modes! {
/// A confirm is not proof of routing: with the DLQ gone, the broker returns the
/// dead letter *and* confirms it. idemq treats that as a failure and requeues the
/// original instead of acking it; once the DLQ exists again the message lands there.
async fn an_unroutable_dead_letter_requeues_the_original_instead_of_acking() {
    let bed = Bed::new().await;
    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment));
    // After start-up, which declares the DLQ before it consumes: a fixed sleep raced a
    // slow start-up, whose declaration then recreated the queue deleted below.
    idemq_tests::eventually("the runtime consumes", Duration::from_secs(30), || async {
        bed.broker.consumer_count(&bed.queue).await == 1
    })
    .await;
    bed.broker.delete_queue(&bed.dlq).await;
    let props = BasicProperties::default().with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, b"not json", props).await;
    running.wait_settled(1).await;
    let first = running.events()[0].clone();
    assert!(
        matches!(&first.outcome, Outcome::Requeued { error } if error.contains("unroutable")),
        "{first:?}"
    );
    bed.declare().await;
    idemq_tests::eventually("the message reaches the recreated DLQ", Duration::from_secs(20), || async {
        bed.broker.message_count(&bed.dlq).await == 1
    })
    .await;
    running.stop().await.expect("clean shutdown");
    assert_eq!(bed.broker.message_count(&bed.queue).await, 0);
}
}

/// On its first attempt, takes the account's row lock and then hangs.
#[idempotent_handler(key = "payment_id")]
async fn hangs_first(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let attempt = next_attempt(&msg.payment_id);
    record_payment(conn, &msg).await?;
    if attempt == 1 {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    Ok(())
}

in_both_modes! {
/// A hanging handler times out into a transient failure, and its connection is
/// dropped rather than returned to the pool: the open transaction ends server-side
/// and releases its row lock, so the retry (which needs the same row) applies.
async fn a_hanging_handler_times_out_and_its_transaction_is_ended() {
    let bed = Bed::new().await;
    let p = payment(321);
    bed.publish(&p).await;
    let builder = bed.runtime().consume(&bed.queue, hangs_first).handler_timeout(Duration::from_millis(300));
    let events = Running::settle_message(builder, &p.payment_id).await;
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");
    assert!(
        matches!(&events[0].outcome, Outcome::Retry { error, .. } if error.contains("did not finish within")),
        "{events:?}"
    );
    assert_eq!(events[1].outcome, Outcome::Applied, "the retry was not blocked by a leftover lock");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
    let mut conn = bed.db.connect().await;
    let idle_in_tx: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state LIKE 'idle in transaction%'",
        bed.db.name()
    ))
    .get_result(&mut conn)
    .await
    .expect("pg_stat_activity");
    assert_eq!(idle_in_tx, 0, "no transaction was left open");
}
}

/// Publishes `body` with one header of `header_bytes` bytes.
async fn publish_with_big_header(bed: &Bed, body: &[u8], header_bytes: usize) {
    let mut table = FieldTable::default();
    table.insert("x-big".into(), AMQPValue::LongString(LongString::from("h".repeat(header_bytes))));
    let props = BasicProperties::default().with_headers(table).with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, body, props).await;
}

in_both_modes! {
/// A dead letter's header frame must stay under `frame_max` (a larger one is a
/// connection error returning every in-flight delivery): an original with ~120 KB of
/// headers is dead-lettered with them intact; one with ~130 KB (the copy would be
/// over 128 KiB with idemq's headers) loses its largest
/// header in the copy, named in `x-idemq-trimmed`; the consumer's connection survives.
async fn dead_letters_of_messages_with_huge_headers_stay_under_frame_max() {
    let bed = Bed::new().await;
    publish_with_big_header(&bed, b"not json 1", 120_000).await;
    publish_with_big_header(&bed, b"not json 2", 130_000).await;
    let good = payment(77);
    bed.publish(&good).await;

    let running = Running::start(bed.runtime().consume(&bed.queue, ledger_payment).concurrency(1));
    running.wait_settled(3).await;
    let events = running.events();
    running.stop().await.expect("the connection survived");
    assert!(events.iter().all(|e| e.settled_with_broker), "{events:?}");
    assert_eq!(bed.ledger_rows(&good.payment_id).await, 1);

    let dead = bed.broker.drain(&bed.dlq).await;
    assert_eq!(dead.len(), 2);
    // Told apart by body: in one batch the two dead letters are published at once, and
    // reach the DLQ in either order.
    let letter = |body: &[u8]| {
        dead.iter().map(|d| &d.delivery).find(|d| d.data == body).unwrap_or_else(|| {
            let bodies: Vec<_> = dead.iter().map(|d| String::from_utf8_lossy(&d.delivery.data)).collect();
            panic!("no dead letter with body {:?}: {bodies:?}", String::from_utf8_lossy(body))
        })
    };
    let kept = letter(b"not json 1");
    assert_eq!(header_str(&kept.properties, "x-big").map(|h| h.len()), Some(120_000));
    assert_eq!(header_str(&kept.properties, headers::ERROR_KIND).as_deref(), Some("decode"));
    let trimmed = letter(b"not json 2");
    assert_eq!(header_str(&trimmed.properties, "x-big").map(|h| h.len()), None);
    assert_eq!(header_str(&trimmed.properties, headers::TRIMMED).as_deref(), Some("x-big"));
    assert_eq!(header_str(&trimmed.properties, headers::ERROR_KIND).as_deref(), Some("decode"));
}
}
