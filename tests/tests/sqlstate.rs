//! PostgreSQL's errors are read by their SQLSTATE, never by their words: a server
//! whose `lc_messages` is German ("Verklemmung (Deadlock) entdeckt") is read as one
//! speaking English is, and a handler whose own error says "deadlock detected" is not
//! taken at its word.
//!
//! The real German messages need the server's German catalogue (Debian ships it with
//! the server) and a `de_DE.UTF-8` locale on its host (`localedef -i de_DE -f UTF-8
//! de_DE.UTF-8`); without them those tests say so and run in the server's own
//! language. The tests that raise errors with German text and a code of their own
//! (`RAISE … USING ERRCODE`) prove the same on any server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemq::{idempotent_handler, observe::DecidedBatch, observe::Observe, HandlerError, Outcome};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{ignores_an_error, next_attempt, payment, Bed, Running};
use idemq_tests::{in_both_modes, with_timeout, Mode};

/// Makes the bed's database speak German (`lc_messages` for the sessions opened from
/// now on: the runtime's). Returns whether the server can: without its German
/// catalogue or the locale, it says so and the test goes on in the server's language.
async fn speak_german(bed: &Bed) -> bool {
    let mut admin =
        AsyncPgConnection::establish(&idemq_tests::database_admin_url()).await.expect("connect as admin");
    let set = format!("ALTER DATABASE \"{}\" SET lc_messages = 'de_DE.UTF-8'", bed.db.name());
    if let Err(err) = admin.batch_execute(&set).await {
        eprintln!(
            "note: the PostgreSQL server cannot speak German ({err}): add the locale on its host \
             (localedef -i de_DE -f UTF-8 de_DE.UTF-8); running in its own language"
        );
        return false;
    }
    let said = bed.db.connect().await.batch_execute("SELECT 1/0").await.expect_err("a division by zero");
    if said.to_string().contains("division by zero") {
        eprintln!("note: the PostgreSQL server has no German messages installed; running in English");
        return false;
    }
    true
}

/// What the runtime told of each decided batch.
#[derive(Default)]
struct Batches(Mutex<Vec<(usize, bool)>>);

impl Observe for Batches {
    fn batch(&self, batch: &DecidedBatch<'_>) {
        self.0.lock().expect("batches lock").push((batch.deliveries, batch.contended));
    }
}

impl Batches {
    fn contended(&self) -> bool {
        self.0.lock().expect("batches lock").iter().any(|(_, contended)| *contended)
    }

    fn several(&self) -> bool {
        self.0.lock().expect("batches lock").iter().any(|(deliveries, _)| *deliveries > 1)
    }
}

/// The error the handler of [`bumps_the_hot_row`] met, as the driver gave it.
static HOT_ROW_ERROR: Mutex<Option<String>> = Mutex::new(None);
/// Told when that handler met it.
static HOT_ROW_REFUSED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// The payments handler; the payment of 13 cents first bumps a row another session
/// holds locked.
#[idempotent_handler(key = "payment_id")]
async fn bumps_the_hot_row(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if msg.amount_cents == 13 {
        if let Err(err) = diesel::sql_query("UPDATE hot SET n = n + 1 WHERE id = 1").execute(conn).await {
            *HOT_ROW_ERROR.lock().expect("error lock") = Some(err.to_string());
            HOT_ROW_REFUSED.notify_one();
            return Err(err.into());
        }
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// A batch's handler waits for a row lock another session holds, past the batch's
/// 200 ms `lock_timeout`: the server answers 55P03, in German. That is contention —
/// the batch reports it (its consumer narrows) and runs the delivery again alone,
/// which waits for the lock and applies it — and nobody is charged an attempt.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_timeout_in_a_batch_is_contention_in_any_language() {
    Mode::GroupCommit.enter();
    let bed = Bed::new().await;
    let german = speak_german(&bed).await;
    bed.db
        .connect()
        .await
        .batch_execute("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL); INSERT INTO hot VALUES (1, 0)")
        .await
        .expect("create the hot row");
    let payments: Vec<_> = (1..=20).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let mut holder = bed.db.connect().await;
    holder.batch_execute("BEGIN; SELECT n FROM hot WHERE id = 1 FOR UPDATE").await.expect("lock the hot row");
    let batches = Arc::new(Batches::default());
    let builder = bed
        .runtime()
        .concurrency(1)
        .linger(Duration::from_millis(300))
        .observe(Arc::clone(&batches))
        .consume(&bed.queue, bumps_the_hot_row);
    let running = Running::start(builder);
    with_timeout("the batch's lock wait to time out", Duration::from_secs(30), HOT_ROW_REFUSED.notified())
        .await;
    holder.batch_execute("COMMIT").await.expect("release the hot row");
    running.wait_settled(payments.len()).await;
    let events = running.events();
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");

    let said = HOT_ROW_ERROR.lock().expect("error lock").clone().unwrap_or_default();
    if german {
        assert!(!said.contains("lock timeout"), "the server spoke German: {said}");
    }
    assert!(batches.several(), "the backlog ran in batches");
    assert!(batches.contended(), "the lock timeout ({said}) is contention");
    assert!(events.iter().all(|e| e.outcome == Outcome::Applied && e.attempt == 1), "{events:?}");
    assert_eq!(stats.retried, 0, "nobody was charged an attempt: {stats:?}");
    let thirteen = events.iter().find(|e| e.key.as_deref() == Some(payments[12].payment_id.as_str()));
    assert_eq!(thirteen.map(|e| e.batch), Some(1), "it ran again alone: {events:?}");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
    assert_eq!(bed.db.count("SELECT n::bigint FROM hot WHERE id = 1").await, 1);
}

/// What a German server says when this transaction is a deadlock's victim: its
/// words, and the code that means it.
const LOSE_A_DEADLOCK: &str = "DO $$ BEGIN \
     RAISE EXCEPTION 'Verklemmung (Deadlock) entdeckt' USING ERRCODE = 'deadlock_detected'; END $$";

/// Loses a deadlock on its first run and says so in its own words, the driver's
/// error dropped.
#[idempotent_handler(key = "payment_id")]
async fn loses_a_deadlock_once(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    if next_attempt(&msg.payment_id) == 1 && diesel::sql_query(LOSE_A_DEADLOCK).execute(conn).await.is_err() {
        return Err(HandlerError::transient("the ledger was busy, please try later"));
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

in_both_modes! {
/// A handler rolled back for a deadlock — the server's 40P01, its message German, the
/// handler's error its own words — runs again in-process like a COMMIT refused for
/// contention: the first delivery applies it, no attempt charged, no copy made.
async fn a_handler_that_loses_a_deadlock_runs_again_in_process_whatever_it_returns() {
    let bed = Bed::new().await;
    let p = payment(20);
    bed.publish(&p).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, loses_a_deadlock_once));
    let events = running.wait_for_end(&p.payment_id).await;
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((&events[0].outcome, events[0].attempt), (&Outcome::Applied, 1), "{events:?}");
    assert_eq!((stats.retried, stats.infrastructure_retries), (0, 0), "{stats:?}");
    assert_eq!(idemq_tests::fixture::attempts_of(&p.payment_id), 2, "run twice, in-process");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}
}

/// The amount of the payment [`says_deadlock_once`] fails.
const SAYS_DEADLOCK: i64 = 5;

/// Fails the first run of the payment of [`SAYS_DEADLOCK`] cents with an error that
/// says "deadlock detected" — its own words; the server said nothing.
#[idempotent_handler(key = "payment_id")]
async fn says_deadlock_once(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if msg.amount_cents == SAYS_DEADLOCK && next_attempt(&msg.payment_id) == 1 {
        return Err(HandlerError::transient("deadlock detected (so the handler says)"));
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// A handler's own error that reads like a deadlock is an ordinary failure: run alone,
/// its attempt is charged (a retry copy, then applied by attempt 2).
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_error_that_only_says_deadlock_is_charged_an_attempt() {
    Mode::PerMessage.enter();
    let bed = Bed::new().await;
    let p = payment(SAYS_DEADLOCK);
    bed.publish(&p).await;
    let events =
        Running::settle_message(bed.runtime().consume(&bed.queue, says_deadlock_once), &p.payment_id).await;
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");
    match &events[0].outcome {
        Outcome::Retry { error, .. } => assert!(error.contains("so the handler says"), "{error}"),
        other => panic!("the first attempt is charged, not {other:?}"),
    }
    assert_eq!(events[1].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}

/// In a batch, the same failure splits the batch (the payment runs again alone, and
/// applies: nobody is charged) but is no contention: the consumer is not narrowed
/// for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_error_that_only_says_deadlock_is_no_contention_in_a_batch() {
    Mode::GroupCommit.enter();
    let bed = Bed::new().await;
    let payments: Vec<_> = (1..=10).map(payment).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    let batches = Arc::new(Batches::default());
    let builder = bed
        .runtime()
        .concurrency(1)
        .linger(Duration::from_millis(300))
        .observe(Arc::clone(&batches))
        .consume(&bed.queue, says_deadlock_once);
    let running = Running::start(builder);
    running.wait_settled(payments.len()).await;
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert!(batches.several(), "the backlog ran in batches");
    assert!(stats.batch_splits >= 1, "the failure split its batch: {stats:?}");
    assert_eq!(stats.retried, 0, "{stats:?}");
    assert!(!batches.contended(), "a handler's words are not the server's");
    assert_eq!(bed.ledger_total().await, payments.len() as i64);
}

/// Ends idemq's transaction itself and begins its own, on the first attempt.
#[idempotent_handler(key = "payment_id")]
async fn ends_the_transaction(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    if next_attempt(&msg.payment_id) == 1 {
        conn.batch_execute("ROLLBACK; BEGIN").await?;
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// Discards idemq's prepared COMMIT check, on the first attempt.
#[idempotent_handler(key = "payment_id")]
async fn deallocates(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    if next_attempt(&msg.payment_id) == 1 {
        conn.batch_execute("DEALLOCATE idemq_check").await?;
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

/// Runs `handler` on one payment against a German-speaking database: its first
/// attempt must fail with an error saying `phrase`, its second apply it, once.
async fn in_german_first_attempt_fails_then_applies<H: idemq::Handler>(handler: H, phrase: &str) {
    let bed = Bed::new().await;
    speak_german(&bed).await;
    let p = payment(40);
    bed.publish(&p).await;
    let events = Running::settle_message(bed.runtime().consume(&bed.queue, handler), &p.payment_id).await;
    assert_eq!(events.iter().map(|e| e.attempt).collect::<Vec<_>>(), [1, 2], "{events:?}");
    match &events[0].outcome {
        Outcome::Retry { error, .. } => assert!(error.contains(phrase), "{error}"),
        other => panic!("the first attempt must fail (\"{phrase}\"), not end {other:?}"),
    }
    assert_eq!(events[1].outcome, Outcome::Applied, "{events:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "the first attempt's writes were rolled back");
    assert_eq!(bed.dedup_rows(&p.payment_id).await, 1);
}

in_both_modes! {
/// The checked COMMIT reads an aborted transaction by its 25P02, whose German message
/// ("aktuelle Transaktion wurde abgebrochen") shares no word with the English.
async fn an_ignored_error_is_found_at_commit_in_german() {
    in_german_first_attempt_fails_then_applies(ignores_an_error, "its error was ignored").await;
}
}

in_both_modes! {
/// A handler's own COMMIT or ROLLBACK is found by the check's 22P02 and idemq's own
/// literal it quotes, in German too.
async fn a_transaction_the_handler_ended_is_found_at_commit_in_german() {
    in_german_first_attempt_fails_then_applies(ends_the_transaction, "ended idemq's transaction").await;
}
}

in_both_modes! {
/// The missing prepared check is found by its 26000: in German the statement's name
/// is quoted »idemq_check«, not "idemq_check". Taken for an ordinary refusal, its
/// connection would go back to the pool without the check and fail every COMMIT after.
async fn a_discarded_check_is_found_at_commit_in_german() {
    in_german_first_attempt_fails_then_applies(deallocates, "discarded idemq's prepared statements").await;
}
}

/// The first two COMMITs of a ledger row lose a deadlock, in German (a deferred
/// trigger raises 40P01); a sequence counts them, since it is not rolled back.
const DEADLOCKS_AT_COMMIT: &str = "
    CREATE SEQUENCE commit_deadlocks;
    CREATE FUNCTION lose_twice() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF nextval('commit_deadlocks') <= 2 THEN
            RAISE EXCEPTION 'Verklemmung (Deadlock) entdeckt' USING ERRCODE = 'deadlock_detected';
        END IF;
        RETURN NULL;
    END $$;
    CREATE CONSTRAINT TRIGGER lose_twice AFTER INSERT ON ledger
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION lose_twice();";

/// The payments handler.
#[idempotent_handler(key = "payment_id")]
async fn applies(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

in_both_modes! {
/// A COMMIT refused for a deadlock whose message is not English is contention all the
/// same: run again in-process, no attempt charged.
async fn a_commit_that_loses_a_deadlock_in_german_runs_again_in_process() {
    let bed = Bed::new().await;
    bed.db.connect().await.batch_execute(DEADLOCKS_AT_COMMIT).await.expect("create the trigger");
    let p = payment(50);
    bed.publish(&p).await;
    let running = Running::start(bed.runtime().consume(&bed.queue, applies));
    let events = running.wait_for_end(&p.payment_id).await;
    let stats = running.stats.snapshot();
    running.stop().await.expect("clean shutdown");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((&events[0].outcome, events[0].attempt), (&Outcome::Applied, 1), "{events:?}");
    assert_eq!((stats.retried, stats.infrastructure_retries), (0, 0), "{stats:?}");
    assert_eq!(bed.ledger_rows(&p.payment_id).await, 1);
}
}
