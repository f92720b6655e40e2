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

/// The flagship example shows its contract whole: each of its messages' payloads
/// has its fields, their types and which are required (its types derive
/// `JsonSchema`, and the example enables idemq's feature `schemars`), not
/// `{"type": "object"}`.
#[test]
fn the_demos_payloads_have_their_fields_types_and_required() {
    let document = demo().asyncapi("payments", "0.1.0");
    let messages = &document["components"]["messages"];
    for name in ["PaymentRequested", "PaymentApplied"] {
        let payload = &messages[name]["payload"];
        let property = |field: &str| payload["properties"][field]["type"].as_str();
        assert_eq!(payload["type"], "object", "{name}: {payload:#}");
        assert_eq!(property("payment_id"), Some("string"), "{name}: {payload:#}");
        assert_eq!(property("account"), Some("string"), "{name}: {payload:#}");
        assert_eq!(property("amount_cents"), Some("integer"), "{name}: {payload:#}");
        assert_eq!(
            payload["required"],
            serde_json::json!(["payment_id", "account", "amount_cents"]),
            "{name}: {payload:#}"
        );
        assert!(payload["properties"]["payment_id"]["description"].is_string(), "documented: {payload:#}");
    }
    assert_eq!(errors(&document), Vec::<String>::new(), "{document:#}");
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
    assert!(yaml.starts_with("asyncapi: 3.0.0\n"), "{yaml}");
    assert!(yaml.contains("\n  queue.payments.stream:\n"), "{yaml}");
    let read_back: Value = yaml_serde::from_str(&yaml).expect("the YAML parses");
    assert_eq!(read_back, json, "the YAML is the JSON document, key for key");
}

/// Two message types on one queue: each is named on the wire by its AMQP message
/// binding's `messageType`, a versioned one carries its newest version, one that
/// derives `JsonSchema` has its payload's schema (nested types inlined), and the
/// document stays valid.
#[test]
fn message_types_and_versions_are_in_the_document() {
    use diesel_async::AsyncPgConnection;
    use idemq::{idempotent_handler, HandlerError, Message, Queue, Topology};
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Message, schemars::JsonSchema)]
    #[message(type = "order.placed", version = 1, exchange = "orders", routing_key = "order.placed")]
    struct OrderPlaced {
        order_id: String,
        lines: Vec<Line>,
        note: Option<String>,
    }
    #[derive(Serialize, Deserialize, schemars::JsonSchema)]
    struct Line {
        sku: String,
        quantity: u32,
    }
    #[derive(Serialize, Deserialize, Message)]
    #[message(type = "order.cancelled")]
    struct OrderCancelled {
        order_id: String,
    }
    /// What a request to place an order is answered with.
    #[derive(Serialize)]
    struct Receipt {
        order_id: String,
    }
    #[idempotent_handler(key = "order_id")]
    async fn placed(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<Receipt, HandlerError> {
        let _ = conn;
        Ok(Receipt { order_id: msg.order_id })
    }
    #[idempotent_handler(key = "order_id")]
    async fn cancelled(conn: &mut AsyncPgConnection, msg: OrderCancelled) -> Result<(), HandlerError> {
        let _ = (conn, msg);
        Ok(())
    }
    let document = Runtime::builder()
        .topology(Topology::new().queue(Queue::new("orders")).message::<OrderPlaced>())
        .consume("orders", placed)
        .consume("orders", cancelled)
        .asyncapi("orders", "1.0.0");
    assert_eq!(errors(&document), Vec::<String>::new(), "{document:#}");
    let messages = &document["components"]["messages"];
    assert_eq!(messages["OrderPlaced"]["bindings"]["amqp"]["messageType"], "order.placed");
    assert_eq!(messages["OrderPlaced"]["x-idemq-version"], 1);
    assert_eq!(messages["OrderCancelled"]["bindings"]["amqp"]["messageType"], "order.cancelled");
    assert_eq!(messages["OrderCancelled"].get("x-idemq-version"), None);
    let payload = &messages["OrderPlaced"]["payload"];
    assert_eq!(payload["properties"]["order_id"]["type"], "string", "{payload:#}");
    assert_eq!(
        payload["properties"]["lines"]["items"]["properties"]["quantity"]["type"], "integer",
        "{payload:#}"
    );
    assert_eq!(payload["required"], serde_json::json!(["order_id", "lines"]), "{payload:#}");
    assert!(!payload.to_string().contains("$ref"), "inlined: {payload:#}");
    assert_eq!(messages["OrderCancelled"]["payload"], serde_json::json!({ "type": "object" }));
    // A handler with a result answers requests: its operation says with what, and where.
    let reply = &document["operations"]["placed.orders"]["reply"];
    assert_eq!(reply["address"]["location"], "$message.header#/reply_to", "{reply:#}");
    assert_eq!(reply["messages"][0]["$ref"], "#/channels/reply.placed.orders/messages/Receipt");
    assert!(messages.get("Receipt").is_some());
    assert_eq!(document["operations"]["cancelled.orders"].get("reply"), None, "`()` answers nothing");
    let queue = &document["channels"]["queue.orders"]["messages"];
    assert!(queue.get("OrderPlaced").is_some() && queue.get("OrderCancelled").is_some(), "{queue:#}");
}

/// A saga's steps: each receive operation names its saga (`x-idemq-saga`), and the
/// document lists each saga with the messages it takes and sends and its steps
/// (`x-idemq-sagas`); still valid AsyncAPI 3.
#[test]
fn a_sagas_steps_and_the_messages_it_takes_and_sends_are_in_the_document() {
    use idemq_example_payments::{orders, orders_run};
    let document =
        orders::consume(Runtime::builder().topology(orders_run::topology())).asyncapi("orders", "0.1.0");
    assert_eq!(errors(&document), Vec::<String>::new(), "{document:#}");
    let step = &document["operations"]["order_placed.orders"];
    assert_eq!(step["x-idemq-saga"], "order", "{document:#}");
    let saga = &document["x-idemq-sagas"]["order"];
    assert_eq!(
        saga["takes"],
        serde_json::json!(["OrderPlaced", "PaymentReserved", "OrderShipped", "PaymentExpired"])
    );
    assert_eq!(saga["sends"], serde_json::json!(["CapturePayment", "ReleasePayment", "PaymentExpired"]));
    let steps: Vec<&str> =
        saga["steps"].as_array().expect("steps").iter().filter_map(|s| s["$ref"].as_str()).collect();
    assert_eq!(
        steps,
        [
            "#/operations/order_placed.orders",
            "#/operations/payment_reserved.orders",
            "#/operations/order_shipped.orders",
            "#/operations/payment_expired.orders"
        ]
    );
    assert!(document["operations"]["send.CapturePayment"].is_object(), "what it sends is in the topology");
}
