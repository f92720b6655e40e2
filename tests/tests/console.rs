//! The operations console in a real browser: headless Chromium, driven through its
//! WebDriver, over a running service with real dead letters. Screenshots of each
//! page go to `target/test-screenshots/console-*.png`.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::cli::Console;
use idemq::{idempotent_handler, HandlerError};
use idemq_example_payments::{record_payment, PaymentRequested};
use idemq_tests::fixture::{payment, Bed, Running};
use idemq_tests::webdriver::{Browser, WebDriverError};

/// Whether the ledger takes payments: until the test sets it, every payment is
/// refused for good, as a handler refuses what a bad deploy broke.
static LEDGER_FIXED: AtomicBool = AtomicBool::new(false);

#[idempotent_handler(key = "payment_id")]
async fn ledger_after_the_fix(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    if !LEDGER_FIXED.load(Ordering::SeqCst) {
        return Err(HandlerError::permanent(std::io::Error::other(
            "ledger refuses the payment: account rules v2 not deployed",
        )));
    }
    record_payment(conn, &msg).await?;
    Ok(())
}

const TOKEN: &str = "console-test-token";

fn screenshots() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/test-screenshots"))
}

/// `GET path` with `authorization` (if any): the status code.
fn status_of(addr: SocketAddr, path: &str, authorization: Option<&str>) -> u16 {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the console");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let auth = authorization.map(|value| format!("Authorization: {value}\r\n")).unwrap_or_default();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n").expect("send");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

/// Four payments refused by the ledger (one of them published twice), and two
/// messages that are not payments: seven dead letters in two groups. The operator logs
/// in (after a wrong token, refused), finds the groups, replays the ledger's group
/// once the ledger is fixed: each payment is applied exactly once (the second copy
/// is a duplicate); one letter of the other group is purged on its own, the other
/// stays; and the audit list says who did what.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_groups_dead_letters_replays_a_group_once_and_refuses_a_wrong_token() {
    let bed = Bed::new().await;
    let payments: Vec<PaymentRequested> = (0..4).map(|i| payment(100 + i)).collect();
    for p in &payments {
        bed.publish(p).await;
    }
    bed.publish(&payments[0]).await;
    let json = lapin::BasicProperties::default().with_content_type("application/json".into());
    bed.broker.publish_bytes(&bed.queue, br#"{"payment_id":"no-account"}"#, json.clone()).await;
    bed.broker.publish_bytes(&bed.queue, b"not json at all", json).await;

    let addr = idemq_tests::free_addr();
    let builder = bed.runtime().consume(&bed.queue, ledger_after_the_fix).http_addr(addr);
    let running = Running::start(Console::new("shop").token(TOKEN).actions(true).mount(builder));
    idemq_tests::eventually("seven dead letters", Duration::from_secs(60), || async {
        bed.broker.message_count(&bed.dlq).await == 7
    })
    .await;
    LEDGER_FIXED.store(true, Ordering::SeqCst);

    // Beyond the browser: scripts present the token too, and a wrong one is refused.
    let wrong = format!("Basic {}", base64_of("ana:not-the-token"));
    assert_eq!(status_of(addr, "/console", Some("Bearer nope")), 401, "a wrong bearer token");
    assert_eq!(status_of(addr, "/console/dead-letters", Some(&wrong)), 401, "a wrong basic password");
    assert_eq!(status_of(addr, "/console", Some(&format!("Bearer {TOKEN}"))), 200, "the token");
    assert_eq!(status_of(addr, "/metrics", None), 200, "the metrics beside it");

    let (queue, dlq) = (bed.queue.clone(), bed.dlq.clone());
    let pages = tokio::task::spawn_blocking(move || operate(addr, &queue, &dlq)).await.expect("the browser");
    pages.unwrap_or_else(|err| panic!("the browser: {err}"));

    idemq_tests::eventually("the replayed payments applied", Duration::from_secs(60), || async {
        bed.ledger_total().await == 4
    })
    .await;
    for p in &payments {
        assert_eq!(bed.ledger_rows(&p.payment_id).await, 1, "{} applied once", p.payment_id);
    }
    assert!(bed.doubled().await.is_empty());
    idemq_tests::eventually("one letter of the other group left", Duration::from_secs(30), || async {
        bed.broker.message_count(&bed.dlq).await == 1
    })
    .await;
    let completed =
        "SELECT count(*) FROM idemq_console_audit WHERE who = 'ana' AND result NOT LIKE 'started%'";
    assert_eq!(
        bed.db.count(completed).await,
        2,
        "the replay and the purge in the audit table, each completed"
    );
    running.stop().await.expect("stop");
}

fn base64_of(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// The operator's walk through the pages.
fn operate(addr: SocketAddr, queue: &str, dlq: &str) -> Result<(), WebDriverError> {
    let shots = screenshots();
    std::fs::create_dir_all(&shots).expect("the screenshots' directory");
    let browser = Browser::start()?;
    let url = |path: &str| format!("http://{addr}/console{path}");

    // A wrong token is refused; the right one lets the operator in.
    browser.goto(&url("/login"))?;
    browser.find("input[name=token]")?.send_keys("wrong-token")?;
    browser.find("main button")?.click()?;
    wait_for_text(&browser, "p.error", "Wrong token")?;
    browser.find("input[name=token]")?.send_keys(TOKEN)?;
    browser.find("input[name=name]")?.send_keys("ana")?;
    browser.find("main button")?.click()?;
    wait_for_text(&browser, "header", "ana")?;

    // Handlers: the one handler, its queue, running.
    let handlers = browser.find("main table")?.text()?;
    assert!(handlers.contains("ledger_after_the_fix") && handlers.contains(queue), "{handlers}");
    assert!(handlers.contains("running"), "{handlers}");
    browser.screenshot(shots.join("console-handlers.png"))?;

    // Dead letters, grouped by handler and error kind.
    browser.goto(&url("/dead-letters"))?;
    let rows: Vec<String> =
        browser.find_all("main table tbody tr")?.iter().map(|row| row.text()).collect::<Result<_, _>>()?;
    assert_eq!(rows.len(), 2, "two groups: {rows:?}");
    let cells = |row: &String| row.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let has =
        |row: &String, words: &[&str]| words.iter().all(|word| cells(row).iter().any(|cell| cell == word));
    assert!(
        rows.iter().any(|row| has(row, &[dlq, "ledger_after_the_fix", "handler", "5"])),
        "5 refused: {rows:?}"
    );
    assert!(rows.iter().any(|row| has(row, &[dlq, "decode", "2"])), "2 not payments: {rows:?}");
    browser.screenshot(shots.join("console-dead-letters.png"))?;

    // The group's letters, then its replay: a dry run, then the confirmation.
    let links = browser.find_all("main table a")?;
    let mut group = None;
    for link in &links {
        if link.attribute("href")?.is_some_and(|href| href.contains("kind=handler")) {
            group = Some(link);
        }
    }
    group.expect("a link to the ledger's group").click()?;
    // Each wait is for what only the next page says: until it loads, the page
    // before answers (and its elements go stale under the reader).
    wait_for_text(&browser, "main h2", "messages) in")?;
    let letters = browser.find("details")?.text()?;
    assert!(letters.contains("account rules v2"), "the error is shown: {letters}");
    browser.screenshot(shots.join("console-group.png"))?;
    browser.find("main form[action$='/replay'] button")?.click()?;
    wait_for_text(&browser, "main h1", "dry run")?;
    let dry_run = browser.find("main pre")?.text()?;
    assert!(dry_run.contains("would replay"), "{dry_run}");
    browser.screenshot(shots.join("console-replay-dry-run.png"))?;
    browser.find("main form button[type=submit]")?.click()?;
    wait_for_text(&browser, "main h1", "done")?;
    let done = browser.find("main pre")?.text()?;
    assert!(done.contains("replayed") && !done.contains("would"), "{done}");

    // One message of the other group purged on its own, after its confirmation.
    browser.goto(&url("/dead-letters"))?;
    let mut decode = None;
    for link in browser.find_all("main table a")? {
        if link.attribute("href")?.is_some_and(|href| href.contains("kind=decode")) {
            decode = Some(link);
        }
    }
    decode.expect("a link to the decode group").click()?;
    wait_for_text(&browser, "main h2", "decode")?;
    browser.find("details form[action$='/purge'] button")?.click()?;
    wait_for_text(&browser, "main h1", "dry run")?;
    let dry_run = browser.find("main pre")?.text()?;
    assert!(dry_run.contains("would purge 1 dead letters"), "{dry_run}");
    browser.find("main form button[type=submit]")?.click()?;
    wait_for_text(&browser, "main h1", "done")?;
    let done = browser.find("main pre")?.text()?;
    assert!(done.contains("purged 1 dead letters"), "{done}");

    // The audit list says who did what.
    browser.goto(&url("/audit"))?;
    let audit = browser.find("main table")?.text()?;
    assert!(audit.contains("ana") && audit.contains("replay") && audit.contains(dlq), "{audit}");
    assert!(audit.contains("purge") && audit.contains("letter="), "{audit}");
    browser.screenshot(shots.join("console-audit.png"))?;

    // Queues & streams, database & outbox: the status report and the figures.
    browser.goto(&url("/queues"))?;
    assert!(browser.find("main pre")?.text()?.contains(queue));
    browser.screenshot(shots.join("console-queues.png"))?;
    browser.goto(&url("/database"))?;
    let database = browser.find("main table")?.text()?.to_lowercase();
    assert!(database.contains("outbox backlog") && database.contains("dedup rows"), "{database}");
    browser.screenshot(shots.join("console-database.png"))?;
    Ok(())
}

/// Waits (10 s at most) until the element `css` says `text`.
fn wait_for_text(browser: &Browser, css: &str, text: &str) -> Result<(), WebDriverError> {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let said = browser.find(css).and_then(|element| element.text()).unwrap_or_default();
        if said.contains(text) {
            return Ok(());
        }
        assert!(std::time::Instant::now() < until, "{css} never said {text:?}; it says {said:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
