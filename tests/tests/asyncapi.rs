//! The generated AsyncAPI 3.0 document is valid against the AsyncAPI 3.0.0 JSON
//! schema (vendored in `tests/data/`, from the npm package `@asyncapi/specs` 6.11.1)
//! and says what the code declares.

use idemq::Runtime;
use idemq_example_payments::{apply_payment, apply_stream_payment, topology, QUEUE, STREAM};
use serde_json::Value;

fn schema() -> Value {
    let text = include_str!("../data/asyncapi-3.0.0.json");
    serde_json::from_str(text).expect("the vendored schema is JSON")
}

/// The demo's runtime, as `payments run` registers it.
fn demo() -> idemq::RuntimeBuilder {
    Runtime::builder()
        .topology(topology())
        .consume(QUEUE, apply_payment)
        .consume(STREAM, apply_stream_payment)
}

fn errors(document: &Value) -> Vec<String> {
    let validator = jsonschema::draft7::new(&schema()).expect("the AsyncAPI schema compiles");
    validator.iter_errors(document).map(|error| format!("{error} at {}", error.instance_path())).collect()
}

#[test]
fn the_demos_document_is_valid_asyncapi_3() {
    let document = demo().asyncapi("payments", "0.1.0");
    assert_eq!(errors(&document), Vec::<String>::new(), "{document:#}");
}

#[test]
fn the_document_names_the_queues_handlers_keys_and_what_is_published() {
    let document = demo().asyncapi("payments", "0.1.0");
    let receive = &document["operations"]["apply_payment.payments"];
    assert_eq!(receive["action"], "receive");
    assert_eq!(receive["channel"]["$ref"], "#/channels/queue.payments");
    assert_eq!(receive["x-idemq-key"], "payment_id");
    assert_eq!(receive["x-idemq-dedup"], true);
    let stream = &document["channels"]["queue.payments.stream"];
    assert_eq!(stream["x-idemq-queue-type"], "stream");
    assert_eq!(stream["x-idemq-dead-letter-queue"], "payments.stream.dlq");
    assert_eq!(document["operations"]["apply_stream_payment.payments.stream"]["x-idemq-dedup"], false);
    let send = &document["operations"]["send.PaymentApplied"];
    assert_eq!(send["action"], "send");
    assert_eq!(send["channel"]["$ref"], "#/channels/exchange.payments.events");
    assert_eq!(
        document["channels"]["exchange.payments.events"]["bindings"]["amqp"]["exchange"]["type"],
        "fanout"
    );
    let message = &document["components"]["messages"]["PaymentRequested"];
    assert_eq!(message["x-idemq-rust-type"], "idemq_example_payments::PaymentRequested");
    let bound = &document["channels"]["queue.payments.applied"]["x-idemq-bindings"][0];
    assert_eq!(
        (bound["exchange"].as_str(), bound["routingKey"].as_str()),
        (Some("payments.events"), Some(""))
    );
}

#[test]
fn a_topology_alone_gives_a_valid_document() {
    let document = topology().asyncapi("payments", "0.1.0");
    assert_eq!(errors(&document), Vec::<String>::new(), "{document:#}");
    assert!(document["operations"]["send.PaymentApplied"].is_object());
}

#[test]
fn an_invalid_document_is_caught() {
    // The check itself: a receive operation without its channel is refused.
    let mut document = demo().asyncapi("payments", "0.1.0");
    document["operations"]["apply_payment.payments"].as_object_mut().unwrap().remove("channel");
    assert!(!errors(&document).is_empty(), "the schema check must catch a broken document");
}

/// `payments asyncapi` prints the document (JSON, or YAML with `--yaml`) without
/// touching the broker or the database.
#[test]
fn the_cli_prints_the_document_as_json_or_yaml() {
    let app = env!("CARGO_BIN_EXE_payments-app");
    let run = |args: &[&str]| {
        let output = std::process::Command::new(app)
            .args(args)
            .env("AMQP_URL", "amqp://nobody:wrong@127.0.0.1:1/%2f")
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .output()
            .expect("run the app");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).expect("UTF-8")
    };
    let json: Value = serde_json::from_str(&run(&["asyncapi"])).expect("JSON");
    assert_eq!(errors(&json), Vec::<String>::new());
    assert_eq!(
        json,
        demo().asyncapi("payments", env!("CARGO_PKG_VERSION")),
        "the app registers what demo() does"
    );
    let yaml = run(&["asyncapi", "--yaml"]);
    assert!(yaml.starts_with("asyncapi: \"3.0.0\"\n"), "{yaml}");
    assert!(yaml.contains("\n  queue.payments.stream:\n"), "{yaml}");
}
