//! TLS to RabbitMQ and PostgreSQL against real TLS servers: a private RabbitMQ node
//! with a TLS listener that requires client certificates, private PostgreSQL servers
//! that accept TLS connections only, and certificates made at test time (a CA, a
//! server certificate for `localhost`, an expired one, one for another host, a
//! client's). Traffic goes through `NetworkProxy`, which keeps what each client
//! sent: the tests check that nothing crossed the wire in the clear.

use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::testing::{Cluster, NetworkProxy, PostgresServer, TestCertificates};
use idemq::{Dependency, Error};
use idemq_example_payments::demo::{self, DemoConfig};
use idemq_tests::{unique, with_timeout, TestDb};
use tokio::sync::OnceCell;

use crate::support::cluster::{lease, Lease};

/// What the tests share, made once per process: the certificates and a PostgreSQL
/// server with TLS.
struct Shared {
    certs: TestCertificates,
    postgres: PostgresServer,
}

/// What a test has: the shared servers and the RabbitMQ node with a TLS listener
/// (starting one takes ~10 s: it is kept between the tests that lease it, one at a
/// time, `crate::support::cluster`). The kits' watchdogs stop them when the process
/// ends.
struct Servers {
    shared: &'static Shared,
    broker: Lease,
}

impl Deref for Servers {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        self.shared
    }
}

async fn servers() -> Servers {
    static SHARED: OnceCell<Shared> = OnceCell::const_new();
    let shared = SHARED
        .get_or_init(|| async {
            idemq_tests::init_tracing();
            let certs = TestCertificates::generate().expect("make the test certificates");
            let postgres = PostgresServer::builder()
                .tls(&certs)
                .start()
                .await
                .expect("start a PostgreSQL server with TLS");
            Shared { certs, postgres }
        })
        .await;
    let broker = lease("one node with TLS, client certificates required", || {
        Cluster::builder().nodes(1).tls(&shared.certs).require_client_certificates()
    })
    .await;
    Servers { shared, broker }
}

impl Servers {
    fn tls_port(&self) -> u16 {
        self.broker.nodes()[0].tls_port()
    }

    /// An `amqps://` URL of the node (through `port`, the node's TLS port or a
    /// proxy's), with `params`.
    fn amqps(&self, host: &str, port: u16, params: &str) -> String {
        format!("amqps://guest:guest@{host}:{port}/%2f?{params}")
    }

    /// `cacertfile=` the CA, and the client certificate the node requires.
    fn verified(&self) -> String {
        format!("cacertfile={}&{}", self.certs.ca().display(), self.client_cert())
    }

    fn client_cert(&self) -> String {
        format!(
            "certfile={}&keyfile={}",
            self.certs.client().cert().display(),
            self.certs.client().key().display()
        )
    }

    /// A PostgreSQL URL of `database` on a server at `host:port`, with `params`.
    fn postgres(&self, host: &str, port: u16, database: &str, params: &str) -> String {
        format!("postgres://postgres@{host}:{port}/{database}?{params}")
    }

    fn verify_full(&self) -> String {
        format!("sslmode=verify-full&sslrootcert={}", self.certs.ca().display())
    }
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// The AMQP 0-9-1 protocol header, the first bytes of a plaintext connection.
const AMQP_HEADER: &[u8] = b"AMQP\x00\x00\x09\x01";
/// PostgreSQL's SSLRequest: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
/// A TLS handshake record (content type 22, version 3.x).
const TLS_RECORD: [u8; 2] = [0x16, 0x03];
/// The PLAIN login of `guest`/`guest`, as it would cross in the clear.
const PLAIN_LOGIN: &[u8] = b"\x00guest\x00guest";

/// Checks what every client sent to the broker through `proxy`: a TLS handshake
/// from the first byte, and no AMQP header or login in the clear.
fn assert_amqp_encrypted(proxy: &NetworkProxy) {
    let sent = proxy.sent_by_clients();
    assert!(!sent.is_empty(), "no connection went through the proxy");
    for (i, bytes) in sent.iter().enumerate().filter(|(_, bytes)| !bytes.is_empty()) {
        assert!(
            bytes.starts_with(&TLS_RECORD),
            "connection {i} did not open with a TLS handshake: {:?}",
            &bytes[..bytes.len().min(16)]
        );
        assert!(!contains(bytes, AMQP_HEADER), "connection {i} sent the AMQP header in the clear");
        assert!(!contains(bytes, PLAIN_LOGIN), "connection {i} sent the login in the clear");
    }
}

/// Checks what every client sent to PostgreSQL through `proxy`: the SSLRequest,
/// then a TLS handshake, and none of `secrets` in the clear.
fn assert_postgres_encrypted(proxy: &NetworkProxy, secrets: &[&[u8]]) {
    let sent = proxy.sent_by_clients();
    assert!(!sent.is_empty(), "no connection went through the proxy");
    for (i, bytes) in sent.iter().enumerate().filter(|(_, bytes)| !bytes.is_empty()) {
        assert!(
            bytes.starts_with(&SSL_REQUEST),
            "connection {i} did not ask for TLS first: {:?}",
            &bytes[..bytes.len().min(16)]
        );
        if bytes.len() > SSL_REQUEST.len() {
            assert!(
                bytes[SSL_REQUEST.len()..].starts_with(&TLS_RECORD),
                "connection {i} did not go on with a TLS handshake"
            );
        }
        for secret in secrets {
            assert!(
                !contains(bytes, secret),
                "connection {i} sent {:?} in the clear",
                String::from_utf8_lossy(secret)
            );
        }
    }
}

/// The error connecting to PostgreSQL at `url` must fail with.
async fn database_refusal(url: &str, why: &str) -> Error {
    match idemq::connect::database(url).await {
        Ok(_) => panic!("connected, but must not: {why}"),
        Err(err) => err,
    }
}

/// The error of a TLS refusal, with its parts.
fn tls_refusal(err: &Error) -> (Dependency, &str, &str) {
    match err {
        Error::Tls { dependency, host, reason, .. } => (*dependency, host.as_str(), reason.as_str()),
        other => panic!("expected a TLS refusal, got: {other}"),
    }
}

/// The payments demo — 2,000 payments' worth of its burst scaled down, duplicates and
/// bad messages included — with every connection (the runtime's, the relay's, the
/// demo's publisher) over TLS to both services through recording proxies: each
/// payment applied once, each duplicate skipped, the ledger and events right, and
/// nothing in the clear on the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_are_applied_exactly_once_over_tls_to_both_and_nothing_crosses_in_the_clear() {
    let servers = servers().await;
    let amqp_proxy = NetworkProxy::start(format!("127.0.0.1:{}", servers.tls_port())).await.expect("proxy");
    let pg_proxy =
        NetworkProxy::start(format!("127.0.0.1:{}", servers.postgres.port())).await.expect("proxy");
    // `localhost`: the certificates name it (the proxies listen on 127.0.0.1).
    let amqp_url = servers.amqps("localhost", amqp_proxy.address().port(), &servers.verified());
    let database = unique("idemq_tls");
    let database_url =
        servers.postgres("localhost", pg_proxy.address().port(), &database, &servers.verify_full());

    let config =
        DemoConfig { payments: 200, duplicate_every: 10, accounts: 5, concurrency: 8, stream_payments: 20 };
    let report = with_timeout(
        "the demo over TLS",
        Duration::from_secs(120),
        demo::run(&amqp_url, &database_url, config),
    )
    .await
    .expect("the demo runs over TLS");
    assert!(report.ledger_ok, "{:?}", report.mismatches);
    assert_eq!(report.stats.applied, 220, "200 from the queue, 20 from the stream: {:?}", report.stats);
    assert_eq!(report.stream, (20, 20), "the stream's payments, over TLS too");
    assert_eq!(report.stats.duplicates, 20, "{:?}", report.stats);
    assert_eq!(report.events.payments, 200, "{:?}", report.events);

    assert_amqp_encrypted(&amqp_proxy);
    assert!(amqp_proxy.sent_by_clients().len() >= 3, "the consumer, the relay and the publisher connect");
    assert_postgres_encrypted(&pg_proxy, &[b"INSERT INTO", b"idemq_dedup", b"demo-"]);
}

/// A broker certificate that does not verify — signed by a CA the client does not
/// trust, expired, or for another host name — is refused before anything of AMQP is
/// sent, with an error that names the host and the reason.
#[tokio::test]
async fn a_broker_certificate_that_does_not_verify_is_refused_with_the_host_and_the_reason() {
    let servers = servers().await;
    let certs = &servers.certs;
    let client = servers.client_cert();
    let cases = [
        (
            "localhost",
            format!("cacertfile={}&{client}", certs.other_ca().display()),
            "localhost",
            "unknown issuer",
        ),
        (
            "localhost",
            format!("cacertfile={}&{client}&server_name_indication=expired.localhost", certs.ca().display()),
            "expired.localhost",
            "has expired",
        ),
        ("127.0.0.1", servers.verified(), "127.0.0.1", "not valid for the host name 127.0.0.1"),
    ];
    for (host, params, named, reason) in cases {
        let proxy = NetworkProxy::start(format!("127.0.0.1:{}", servers.tls_port())).await.expect("proxy");
        let url = servers.amqps(host, proxy.address().port(), &params);
        let err = idemq::connect::broker(&url, "test").await.expect_err(&params);
        let (dependency, refused_host, said) = tls_refusal(&err);
        assert_eq!(dependency, Dependency::Broker);
        assert_eq!(refused_host, named, "{err}");
        assert!(said.contains(reason), "{reason:?} not in: {err}");
        assert!(!err.to_string().contains("guest:guest"), "the password is redacted: {err}");
        assert_amqp_encrypted(&proxy);
    }
}

/// In an `AMQP_URL` list each address has its own TLS settings: one whose
/// certificate does not verify is passed over for the next; when none connects, the
/// refusal is the error.
#[tokio::test]
async fn every_address_of_a_list_is_verified_on_its_own() {
    let servers = servers().await;
    let port = servers.tls_port();
    let wrong_host = servers.amqps("127.0.0.1", port, &servers.verified());
    let right = servers.amqps("localhost", port, &servers.verified());
    let connection = idemq::connect::broker(&format!("{wrong_host},{right}"), "test")
        .await
        .expect("the second address verifies");
    let _ = connection.close(200, "done".into()).await;
    let untrusted = servers.amqps(
        "localhost",
        port,
        &format!("cacertfile={}&{}", servers.certs.other_ca().display(), servers.client_cert()),
    );
    let err = idemq::connect::broker(&format!("{wrong_host},{untrusted}"), "test")
        .await
        .expect_err("no address verifies");
    assert!(
        tls_refusal(&err).2.contains("not valid for the host name 127.0.0.1"),
        "the first refusal: {err}"
    );
}

/// The runtime does not wait out a certificate that does not verify as it waits
/// out an outage: `run` fails at once with the reason, and a binary exits non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_given_an_untrusted_broker_fails_at_start_up_and_its_process_exits_non_zero() {
    let servers = servers().await;
    let db = TestDb::create().await;
    idemq::migrate(&db.url()).await.expect("migrate");
    let url = servers.amqps(
        "localhost",
        servers.tls_port(),
        &format!("cacertfile={}&{}", servers.certs.other_ca().display(), servers.client_cert()),
    );
    let queue = unique("q");
    let runtime = idemq::Runtime::builder()
        .amqp_url(url.clone())
        .database_url(db.url())
        .topology(idemq::Topology::new().queue(idemq::Queue::new(queue.clone())))
        .consume(queue.clone(), idemq_tests::fixture::ledger_payment)
        .build()
        .expect("the settings are valid");
    let result = with_timeout(
        "run() to give up on the certificate",
        Duration::from_secs(30),
        runtime.run(tokio_util::sync::CancellationToken::new()),
    )
    .await;
    let err = result.expect_err("an untrusted broker");
    assert!(tls_refusal(&err).2.contains("unknown issuer"), "{err}");

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_consumer"))
        .env("AMQP_URL", &url)
        .env("DATABASE_URL", db.url())
        .env("QUEUE", &queue)
        .output();
    let output = with_timeout("the consumer to exit", Duration::from_secs(30), output)
        .await
        .expect("run the consumer");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("over TLS") && stderr.contains("unknown issuer") && stderr.contains("localhost"),
        "{stderr}"
    );
    assert!(!stderr.contains("guest:guest"), "{stderr}");
}

/// An `amqps://` URL pointed at a plaintext port fails, saying why; it never falls
/// back to plaintext, and the login never leaves in the clear.
#[tokio::test]
async fn an_amqps_url_never_falls_back_to_plaintext() {
    let proxy = NetworkProxy::start("127.0.0.1:5672").await.expect("proxy"); // the machine's plain broker
    let url = format!("amqps://guest:guest@127.0.0.1:{}/%2f?verify=verify_none", proxy.address().port());
    let err = idemq::connect::broker(&url, "test").await.expect_err("the port speaks plain AMQP");
    let shown = err.to_string();
    assert!(shown.contains("TLS handshake") && shown.contains("5671"), "{shown}");
    assert!(!shown.contains("guest:guest"), "{shown}");
    assert_amqp_encrypted(&proxy);
}

/// The broker requires client certificates: with one signed by its CA the
/// connection works (declares, publishes); without one it is refused, in words.
#[tokio::test]
async fn broker_client_certificates_are_accepted_when_given_and_refused_when_missing() {
    let servers = servers().await;
    let with = servers.amqps("localhost", servers.tls_port(), &servers.verified());
    let connection =
        idemq::connect::broker(&with, "test").await.expect("a client certificate the broker trusts");
    let channel = connection.create_channel().await.expect("a channel over TLS");
    let queue = unique("q");
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions { exclusive: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("declare over TLS");
    let _ = connection.close(200, "done".into()).await;

    let without = servers.amqps(
        "localhost",
        servers.tls_port(),
        &format!("cacertfile={}", servers.certs.ca().display()),
    );
    let err =
        idemq::connect::broker(&without, "test").await.expect_err("the broker requires a client certificate");
    // The broker's alert (an `Error::Tls`) or, when the reset that follows it
    // overtakes it, the connection closed right after the handshake: both say what
    // to give.
    let shown = err.to_string();
    assert!(shown.contains("client certificate") && shown.contains("certfile= and keyfile="), "{shown}");
}

/// `verify=verify_none` connects (even to a server whose certificate has expired)
/// and says loudly, once, that the broker was not verified.
#[tokio::test]
async fn verify_none_connects_and_is_warned_about() {
    let servers = servers().await;
    let logs = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&logs);
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || Sink(Arc::clone(&sink)))
        .finish();
    // This test's runtime runs everything on this thread: the subscriber sees it.
    let _guard = tracing::subscriber::set_default(subscriber);
    let url = servers.amqps(
        "localhost",
        servers.tls_port(),
        &format!("verify=verify_none&server_name_indication=expired.localhost&{}", servers.client_cert()),
    );
    let connection = idemq::connect::broker(&url, "test").await.expect("verify_none connects");
    let _ = connection.close(200, "done".into()).await;
    let logs = String::from_utf8(logs.lock().expect("logs").clone()).expect("UTF-8 logs");
    assert!(logs.contains("WARN") && logs.contains("verify=verify_none"), "{logs}");
    assert!(!logs.contains("guest:guest"), "{logs}");
}

/// A log writer into a shared buffer.
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// libpq's modes against a server with a valid certificate for `localhost`:
/// `verify-full` refuses an untrusted CA and another host name with the reason;
/// `verify-ca` accepts the other host name (it checks the chain only); `disable` is
/// refused by the server, which accepts TLS only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_certificates_are_verified_as_libpq_would() {
    let servers = servers().await;
    let certs = &servers.certs;
    let port = servers.postgres.port();
    let untrusted = servers.postgres(
        "localhost",
        port,
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={}", certs.other_ca().display()),
    );
    let err = database_refusal(&untrusted, "an untrusted CA").await;
    let (dependency, host, said) = tls_refusal(&err);
    assert_eq!((dependency, host), (Dependency::Database, "localhost"));
    assert!(said.contains("unknown issuer"), "{err}");
    assert!(err.to_string().contains("sslrootcert="), "the fix names the parameter: {err}");

    let by_address = servers.postgres("127.0.0.1", port, "postgres", &servers.verify_full());
    let err = database_refusal(&by_address, "the certificate is for localhost").await;
    let said = tls_refusal(&err).2;
    assert!(said.contains("not valid for the host name 127.0.0.1 (it is for localhost)"), "{err}");
    let chain_only = by_address.replace("verify-full", "verify-ca");
    idemq::connect::database(&chain_only).await.expect("verify-ca checks the chain, not the name");

    let plain = servers.postgres("localhost", port, "postgres", "sslmode=disable");
    let err = database_refusal(&plain, "the server accepts TLS only").await;
    assert!(err.to_string().contains("no encryption"), "{err}");
}

/// A PostgreSQL server whose certificate has expired is refused by `verify-full`
/// (and `verify-ca`) with the reason; `require` without a root certificate does not
/// verify, as in libpq, and connects encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_postgresql_certificate_is_refused_with_the_reason() {
    let servers = servers().await;
    let certs = &servers.certs;
    let expired =
        PostgresServer::builder().tls(certs).server_identity(certs.expired()).start().await.expect("start");
    let proxy = NetworkProxy::start(format!("127.0.0.1:{}", expired.port())).await.expect("proxy");
    let port = proxy.address().port();
    for mode in ["verify-full", "verify-ca"] {
        let url = servers.postgres(
            "localhost",
            port,
            "postgres",
            &format!("sslmode={mode}&sslrootcert={}", certs.ca().display()),
        );
        let err = database_refusal(&url, mode).await;
        assert!(tls_refusal(&err).2.contains("has expired"), "{mode}: {err}");
    }
    let required = servers.postgres("localhost", port, "postgres", "sslmode=require");
    idemq::connect::database(&required).await.expect("require does not verify without a root certificate");
    assert_postgres_encrypted(&proxy, &[b"SELECT"]);
}

/// `sslmode=require` against a server without TLS fails; it never falls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_never_falls_back_to_plaintext() {
    let plain = PostgresServer::builder().start().await.expect("start a server without TLS");
    let url = format!("{}?sslmode=require", plain.url("postgres"));
    let err = database_refusal(&url, "the server has no TLS").await;
    assert!(err.to_string().contains("TLS"), "{err}");
    idemq::connect::database(&format!("{}?sslmode=prefer", plain.url("postgres")))
        .await
        .expect("prefer connects in plaintext to a server without TLS, as libpq");
}

/// A server that requires client certificates (`clientcert=verify-full`) accepts
/// one signed by its CA whose common name is the user, and refuses a client
/// without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_client_certificates_are_accepted_when_given_and_refused_when_missing() {
    let servers = servers().await;
    let certs = &servers.certs;
    let server =
        PostgresServer::builder().tls(certs).require_client_certificates().start().await.expect("start");
    let without = servers.postgres("localhost", server.port(), "postgres", &servers.verify_full());
    let err = database_refusal(&without, "the server requires a client certificate").await;
    assert!(err.to_string().contains("certificate"), "{err}");
    let with = format!(
        "{without}&sslcert={}&sslkey={}",
        certs.client().cert().display(),
        certs.client().key().display()
    );
    let mut conn = idemq::connect::database(&with).await.expect("a client certificate the server trusts");
    use diesel_async::RunQueryDsl;
    diesel::sql_query("SELECT 1").execute(&mut conn).await.expect("a statement over TLS");
}
