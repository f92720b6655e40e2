//! Self-tests of the integration-test support library.

use std::time::Duration;

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemq::testing::NetworkProxy;
use idemq_tests::{
    amqp_url, database_admin_url, eventually, header_i64, header_str, unique, with_timeout, Broker, TestDb,
    TestVhost,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

async fn database_exists(name: &str) -> bool {
    let mut admin =
        AsyncPgConnection::establish(&database_admin_url()).await.expect("connect to admin database");
    let names: Vec<String> =
        diesel::dsl::sql::<Text>(&format!("SELECT datname FROM pg_database WHERE datname = '{name}'"))
            .load(&mut admin)
            .await
            .expect("query pg_database");
    !names.is_empty()
}

#[tokio::test(flavor = "multi_thread")]
async fn test_db_is_created_and_dropped() {
    let db = TestDb::create().await;
    let name = db.name().to_owned();
    assert!(name.starts_with("idemq_t_"), "{name}");
    assert!(db.url().ends_with(&name), "{}", db.url());

    let mut conn = db.connect().await;
    let current: Vec<String> = diesel::dsl::sql::<Text>("SELECT current_database()")
        .load(&mut conn)
        .await
        .expect("query current_database()");
    assert_eq!(current, [name.as_str()]);
    assert!(database_exists(&name).await);

    // The open connection must not prevent the drop (WITH (FORCE)).
    drop(db);
    assert!(!database_exists(&name).await, "{name} still exists");
    drop(conn);
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_publish_get_and_count_round_trip() {
    with_timeout("broker round trip", Duration::from_secs(30), async {
        let broker = Broker::connect(&amqp_url()).await;
        let queue = unique("selftest_q");
        broker.declare_queue(&queue).await;
        assert_eq!(broker.message_count(&queue).await, 0);
        assert!(broker.get(&queue).await.is_none());

        broker.publish_json(&queue, &serde_json::json!({"n": 1})).await;
        let mut headers = FieldTable::default();
        headers.insert("s".into(), AMQPValue::LongString("text".into()));
        headers.insert("i".into(), AMQPValue::ShortInt(-7));
        broker.publish_bytes(&queue, b"raw", BasicProperties::default().with_headers(headers)).await;
        broker.publish_json(&queue, &serde_json::json!({"n": 3})).await;
        assert_eq!(broker.message_count(&queue).await, 3);

        let first = broker.get(&queue).await.expect("first message");
        let value: serde_json::Value = serde_json::from_slice(&first.delivery.data).unwrap();
        assert_eq!(value, serde_json::json!({"n": 1}));
        assert_eq!(*first.delivery.properties.delivery_mode(), Some(2));
        assert_eq!(broker.message_count(&queue).await, 2);

        let rest = broker.drain(&queue).await;
        assert_eq!(rest.len(), 2);
        let props = &rest[0].delivery.properties;
        assert_eq!(rest[0].delivery.data, b"raw");
        assert_eq!(header_str(props, "s").as_deref(), Some("text"));
        assert_eq!(header_i64(props, "i"), Some(-7));
        assert_eq!(header_i64(props, "missing"), None);
        assert_eq!(broker.message_count(&queue).await, 0);

        broker.delete_queue(&queue).await;
        // Deleting again (missing queue) is fine.
        broker.delete_queue(&queue).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn vhost_is_usable_and_connections_can_be_killed() {
    with_timeout("vhost self-test", Duration::from_secs(60), async {
        let vhost = TestVhost::create().await;
        assert!(vhost.amqp_url().ends_with(&format!("/{}", vhost.name())));
        let broker = Broker::connect(&vhost.amqp_url()).await;
        broker.declare_queue("q").await;
        broker.publish_json("q", &serde_json::json!(1)).await;
        assert_eq!(broker.message_count("q").await, 1);

        vhost.close_all_connections().await;
        eventually("connection closed by broker", Duration::from_secs(10), || async {
            !broker.connection().status().connected()
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
#[should_panic(expected = "unroutable")]
async fn publishing_to_a_missing_queue_panics() {
    let broker = Broker::connect(&amqp_url()).await;
    broker.publish_json(&unique("selftest_missing"), &serde_json::json!(null)).await;
}

/// An echo server on a free loopback port; counts the connections it accepted.
async fn echo_server() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the echo server");
    let address = listener.local_addr().expect("its address");
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    (address, accepted)
}

/// Writes `bytes` and reads as many back.
async fn round_trip(stream: &mut tokio::net::TcpStream, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(bytes).await?;
    let mut echoed = vec![0; bytes.len()];
    stream.read_exact(&mut echoed).await?;
    Ok(echoed)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_network_proxy_forwards_and_resets_every_connection_at_both_ends() {
    use tokio::io::AsyncReadExt;
    let (upstream, _) = echo_server().await;
    let proxy = NetworkProxy::start(upstream.to_string()).await.expect("start the proxy");
    let mut first = tokio::net::TcpStream::connect(proxy.address()).await.expect("connect");
    let mut second = tokio::net::TcpStream::connect(proxy.address()).await.expect("connect");
    assert_eq!(round_trip(&mut first, b"ping").await.expect("echoed"), b"ping");
    assert_eq!(round_trip(&mut second, b"pong").await.expect("echoed"), b"pong");
    assert_eq!(proxy.connections(), 2);

    proxy.reset_all();
    for stream in [&mut first, &mut second] {
        let read = with_timeout("the reset", Duration::from_secs(10), stream.read(&mut [0; 8])).await;
        let error = read.expect_err("a reset, not an orderly end");
        assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}");
    }
    eventually("the reset connections are gone", Duration::from_secs(10), || async {
        proxy.connections() == 0
    })
    .await;
    let mut after = tokio::net::TcpStream::connect(proxy.address()).await.expect("connect");
    assert_eq!(round_trip(&mut after, b"again").await.expect("echoed"), b"again", "new ones are forwarded");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_network_proxy_black_holes_open_and_new_connections_until_restored() {
    use tokio::io::AsyncWriteExt;
    let (upstream, accepted) = echo_server().await;
    let proxy =
        NetworkProxy::in_front_of(&format!("amqp://guest:guest@{upstream}/%2f")).await.expect("start");
    assert_eq!(
        proxy.url_for("amqp://guest:guest@127.0.0.1:5672/%2f"),
        format!("amqp://guest:guest@{}/%2f", proxy.address())
    );
    let mut open = tokio::net::TcpStream::connect(proxy.address()).await.expect("connect");
    assert_eq!(round_trip(&mut open, b"before").await.expect("echoed"), b"before");

    proxy.black_hole();
    let mut new = tokio::net::TcpStream::connect(proxy.address()).await.expect("accepted in a black hole");
    let held = tokio::time::timeout(Duration::from_millis(500), async {
        tokio::join!(round_trip(&mut open, b"held"), round_trip(&mut new, b"new"))
    })
    .await;
    assert!(held.is_err(), "nothing moves in a black hole");
    assert_eq!(
        std::sync::atomic::AtomicUsize::load(&accepted, std::sync::atomic::Ordering::SeqCst),
        1,
        "the new one is not connected upstream"
    );
    assert_eq!(proxy.connections(), 2, "both stay open");

    proxy.restore();
    let mut rest = [0; 4];
    let mut new_echo = [0; 3];
    with_timeout("what was held goes through", Duration::from_secs(10), async {
        use tokio::io::AsyncReadExt;
        open.read_exact(&mut rest).await.expect("the held bytes");
        new.read_exact(&mut new_echo).await.expect("the new connection's bytes");
    })
    .await;
    assert_eq!((&rest, &new_echo), (b"held", b"new"));
    new.shutdown().await.expect("close");
    eventually("an orderly close goes through", Duration::from_secs(10), || async {
        proxy.connections() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_network_proxy_delays_each_way_by_its_latency() {
    let (upstream, _) = echo_server().await;
    let proxy = NetworkProxy::start(upstream.to_string()).await.expect("start the proxy");
    let mut stream = tokio::net::TcpStream::connect(proxy.address()).await.expect("connect");
    proxy.set_latency(Duration::from_millis(200));
    let sent = std::time::Instant::now();
    assert_eq!(round_trip(&mut stream, b"slow").await.expect("echoed"), b"slow");
    // A lower bound only: a round trip cannot beat the latency both ways.
    assert!(sent.elapsed() >= Duration::from_millis(400), "{:?}", sent.elapsed());
}

/// A page of a form posting its `value` to itself, and of what was posted, echoed: served
/// on a free loopback port, a thread for each connection, until the process ends.
fn form_server() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the form server");
    let address = listener.local_addr().expect("its address");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve_form(stream));
        }
    });
    address
}

fn serve_form(mut stream: std::net::TcpStream) -> std::io::Result<()> {
    use std::io::{BufRead, Read, Write};
    // Chromium opens connections ahead of need, and may never send on them.
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = std::io::BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut length = 0;
    let mut header = String::new();
    while reader.read_line(&mut header)? > 0 && !header.trim().is_empty() {
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().expect("a length");
            }
        }
        header.clear();
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let (status, page) = match request.split_whitespace().take(2).collect::<Vec<_>>()[..] {
        ["GET", "/"] => (
            "200 OK",
            "<!doctype html><title>idemq form</title><form method=post action=/>\
             <input name=value><button id=send>Send</button></form>"
                .to_owned(),
        ),
        ["POST", "/"] => {
            let posted = body.strip_prefix(b"value=").map(form_decoded).unwrap_or_default();
            let posted = posted.replace('&', "&amp;").replace('<', "&lt;");
            ("200 OK", format!("<!doctype html><title>echo</title><p id=echo>{posted}</p>"))
        }
        _ => ("404 Not Found", String::new()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{page}",
        page.len()
    )
}

/// An `application/x-www-form-urlencoded` value, decoded.
fn form_decoded(encoded: &[u8]) -> String {
    let mut decoded = Vec::new();
    let mut bytes = encoded.iter();
    while let Some(&byte) = bytes.next() {
        decoded.push(match byte {
            b'+' => b' ',
            b'%' => {
                let hex = [*bytes.next().expect("two hex digits"), *bytes.next().expect("two hex digits")];
                u8::from_str_radix(std::str::from_utf8(&hex).expect("hex"), 16).expect("hex")
            }
            byte => byte,
        });
    }
    String::from_utf8(decoded).expect("UTF-8")
}

/// The WebDriver client against Debian's headless Chromium: what is typed into a form
/// comes back through a real submit and page load, WebDriver's errors come back as
/// errors, and the screenshot saved is a PNG.
#[test]
fn the_webdriver_client_fills_a_form_in_headless_chromium_and_saves_a_screenshot() {
    use idemq_tests::webdriver::{Browser, WebDriverError};
    let typed = "exactly once & 100% <sure>";
    let address = form_server();
    let browser = Browser::start().expect("start headless Chromium");
    browser.goto(&format!("http://{address}/")).expect("load the form");
    assert_eq!(browser.title().expect("title"), "idemq form");
    assert_eq!(browser.find_all("input, button").expect("the form's fields").len(), 2);
    assert!(browser.page_source().expect("source").contains("<form"));
    // `find` fails at once, `wait_for` after its timeout, with WebDriver's error.
    let missing = browser.wait_for("#missing", Duration::from_millis(300)).map(|_| ()).expect_err("none");
    assert!(
        matches!(&missing, WebDriverError::Command { error, message, .. }
            if error == "no such element" && message.contains("waited")),
        "{missing}"
    );

    let input = browser.find("input[name=value]").expect("the input");
    input.send_keys(typed).expect("type");
    assert_eq!(input.attribute("name").expect("its name").as_deref(), Some("value"));
    let value =
        browser.execute_script("return document.querySelector(arguments[0]).value", &["input".into()]);
    assert_eq!(value.expect("the input's value"), typed);
    browser.find("#send").expect("the button").click().expect("submit");
    let echo = browser.wait_for("#echo", Duration::from_secs(10)).expect("the answer page");
    assert_eq!(echo.text().expect("the echo"), typed);
    assert_eq!(browser.current_url().expect("url"), format!("http://{address}/"));

    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/test-screenshots"));
    std::fs::create_dir_all(dir).expect("the screenshots' directory");
    let path = dir.join("webdriver_form.png");
    let _ = std::fs::remove_file(&path);
    browser.screenshot(&path).expect("a screenshot");
    let png = std::fs::read(&path).expect("the screenshot file");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{} is not a PNG", path.display());
}
