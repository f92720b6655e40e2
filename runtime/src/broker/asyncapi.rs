//! The application's contract as an AsyncAPI 3.0 document, generated from what the
//! code declares: a channel per queue and per exchange (with their AMQP bindings),
//! a `receive` operation per handler and a `send` operation per message type named
//! with [`Topology::message`](crate::Topology::message), the messages in
//! `components`. What idemq adds is in `x-idemq-*` extensions: a handler's key and
//! dedup, a queue's type and dead-letter queue, a queue's bindings, a saga step's
//! saga (`x-idemq-saga`), and each saga with the messages it takes and sends and its
//! steps (`x-idemq-sagas` at the top).
//!
//! Payloads are described by their Rust type (`x-idemq-rust-type`) and by their JSON
//! Schema (draft 7, inlined) where the type derives `schemars::JsonSchema` and the
//! feature `schemars` is on; otherwise as JSON objects. A message type's name on the
//! wire is its AMQP message binding's `messageType`; its version, `x-idemq-version`.

use serde_json::{json, Map, Value};

use crate::base::SagaShape;

use super::topology::{Queue, QueueType, Topology};

impl Topology {
    /// The topology as an AsyncAPI 3.0 document (JSON): its queues and exchanges as
    /// channels, a `send` operation per [message type](Self::message). A runtime's
    /// document ([`RuntimeBuilder::asyncapi`](crate::RuntimeBuilder::asyncapi)) adds
    /// its handlers.
    pub fn asyncapi(&self, title: &str, version: &str) -> Value {
        document(self, &[], title, version)
    }
}

/// A handler as the document shows it: the queue it consumes and what it reads.
pub(crate) struct Receiver<'a> {
    pub(crate) queue: &'a str,
    pub(crate) handler: &'a str,
    pub(crate) key: &'a str,
    pub(crate) dedup: bool,
    pub(crate) message: Shown,
    /// The Rust type of its result, the reply to a request (`None`: `()`).
    pub(crate) reply: Option<&'static str>,
    /// The saga it is a step of.
    pub(crate) saga: Option<SagaShape>,
}

/// A message type as the document shows it.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    /// Its payload's JSON Schema.
    pub(crate) schema: Option<Value>,
    pub(crate) rust_type: &'static str,
    /// Its name on the wire (AMQP `type`).
    pub(crate) wire_type: Option<&'static str>,
    /// Its newest version.
    pub(crate) version: Option<u32>,
}

/// The AMQP channel bindings' version (AsyncAPI's AMQP bindings).
const BINDING_VERSION: &str = "0.3.0";

/// The document for `topology` and `receivers`.
pub(crate) fn document(topology: &Topology, receivers: &[Receiver<'_>], title: &str, version: &str) -> Value {
    let mut doc = Document::default();
    for exchange in topology.exchanges() {
        doc.exchange(exchange.name(), exchange.kind());
    }
    for queue in topology.queues() {
        doc.queue(queue);
    }
    for receiver in receivers {
        let channel = match topology.find_queue(receiver.queue) {
            Some(queue) => doc.queue(queue),
            None => doc.queue(&Queue::new(receiver.queue)),
        };
        let message = doc.message(receiver.message.clone(), &channel);
        let id = id(&format!("{}.{}", receiver.handler, receiver.queue));
        let mut operation = json!({
            "action": "receive",
            "channel": { "$ref": format!("#/channels/{channel}") },
            "messages": [{ "$ref": format!("#/channels/{channel}/messages/{message}") }],
            "summary": format!("handler `{}`", receiver.handler),
            "x-idemq-handler": receiver.handler,
            "x-idemq-key": receiver.key,
            "x-idemq-dedup": receiver.dedup,
        });
        if let Some(reply) = receiver.reply {
            operation["reply"] = doc.reply(&id, reply);
        }
        if let Some(saga) = receiver.saga {
            operation["x-idemq-saga"] = json!(saga.name);
            doc.saga(saga, &id);
        }
        doc.operations.insert(id, operation);
    }
    for kind in topology.message_types() {
        let channel = match kind.exchange {
            // The default exchange routes to the queue of that name.
            "" => doc.queue(&Queue::new(kind.routing_key)),
            exchange => doc.exchange(exchange, "topic"),
        };
        let shown = Shown {
            rust_type: kind.rust_type,
            wire_type: kind.wire_type,
            version: kind.version,
            schema: (kind.schema)(),
        };
        let message = doc.message(shown, &channel);
        let routing_key = kind.routing_key;
        doc.operations.insert(
            id(&format!("send.{}", short(kind.rust_type))),
            json!({
                "action": "send",
                "channel": { "$ref": format!("#/channels/{channel}") },
                "messages": [{ "$ref": format!("#/channels/{channel}/messages/{message}") }],
                "x-idemq-routing-key": routing_key,
            }),
        );
    }
    let mut document = json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Generated by idemq from the application's topology and handlers.",
        },
        "defaultContentType": "application/json",
        "channels": doc.channels,
        "operations": doc.operations,
        "components": { "messages": doc.messages },
    });
    if !doc.sagas.is_empty() {
        document["x-idemq-sagas"] = Value::Object(doc.sagas);
    }
    document
}

#[derive(Default)]
struct Document {
    channels: Map<String, Value>,
    operations: Map<String, Value>,
    messages: Map<String, Value>,
    /// Each saga: the messages it takes and sends, and its steps' operations.
    sagas: Map<String, Value>,
}

impl Document {
    /// Adds `operation` to the steps of `saga`, the saga if new.
    fn saga(&mut self, saga: SagaShape, operation: &str) {
        let entry = self
            .sagas
            .entry(saga.name)
            .or_insert_with(|| json!({ "takes": saga.takes, "sends": saga.sends, "steps": [] }));
        if let Some(steps) = entry["steps"].as_array_mut() {
            steps.push(json!({ "$ref": format!("#/operations/{operation}") }));
        }
    }

    /// The channel of `queue`, added if new; its id.
    fn queue(&mut self, queue: &Queue) -> String {
        let channel = id(&format!("queue.{}", queue.name()));
        if !self.channels.contains_key(&channel) {
            let kind = match queue.queue_type {
                QueueType::Quorum => "quorum",
                QueueType::Classic => "classic",
                QueueType::Stream => "stream",
            };
            let bindings: Vec<Value> = queue
                .bindings()
                .map(|(exchange, routing_key)| json!({ "exchange": exchange, "routingKey": routing_key }))
                .collect();
            self.channels.insert(
                channel.clone(),
                json!({
                    "address": queue.name(),
                    "messages": {},
                    "bindings": { "amqp": {
                        "is": "queue",
                        "queue": { "name": queue.name(), "durable": true, "exclusive": false, "autoDelete": false },
                        "bindingVersion": BINDING_VERSION,
                    }},
                    "x-idemq-queue-type": kind,
                    "x-idemq-dead-letter-queue": queue.dead_letter_name(),
                    "x-idemq-bindings": bindings,
                }),
            );
        }
        channel
    }

    /// The channel of the exchange `name`, added if new; its id.
    fn exchange(&mut self, name: &str, kind: &str) -> String {
        let channel = id(&format!("exchange.{name}"));
        self.channels.entry(channel.clone()).or_insert_with(|| {
            json!({
                "address": name,
                "messages": {},
                "bindings": { "amqp": {
                    "is": "routingKey",
                    "exchange": { "name": name, "type": kind, "durable": true, "autoDelete": false },
                    "bindingVersion": BINDING_VERSION,
                }},
            })
        });
        channel
    }

    /// The reply of the operation `operation` to a request, of the Rust type
    /// `rust_type`: to the request's `reply_to` (direct reply-to or a queue), on a
    /// channel of its own whose address is that property (unknown in advance).
    fn reply(&mut self, operation: &str, rust_type: &'static str) -> Value {
        let channel = id(&format!("reply.{operation}"));
        self.channels.insert(
            channel.clone(),
            json!({
                "address": null,
                "messages": {},
                "description": "The requester's `reply_to` queue (RabbitMQ's direct reply-to, or a queue of its \
                                own), on the default exchange; the reply carries the request's `correlation_id` \
                                and `x-idemq-status: ok | error`.",
            }),
        );
        let shown = Shown { rust_type, wire_type: None, version: None, schema: None };
        let message = self.message(shown, &channel);
        json!({
            "address": { "location": "$message.header#/reply_to" },
            "channel": { "$ref": format!("#/channels/{channel}") },
            "messages": [{ "$ref": format!("#/channels/{channel}/messages/{message}") }],
        })
    }

    /// The message `shown`, in `components` and on `channel`; its id.
    fn message(&mut self, shown: Shown, channel: &str) -> String {
        let rust_type = shown.rust_type;
        let message = id(short(rust_type));
        self.messages.entry(message.clone()).or_insert_with(|| {
            let mut described = json!({
                "name": short(rust_type),
                "contentType": "application/json",
                "payload": shown.schema.clone().unwrap_or_else(|| json!({ "type": "object" })),
                "x-idemq-rust-type": rust_type,
            });
            if let Some(wire_type) = shown.wire_type {
                described["bindings"] =
                    json!({ "amqp": { "messageType": wire_type, "bindingVersion": BINDING_VERSION } });
            }
            if let Some(version) = shown.version {
                described["x-idemq-version"] = json!(version);
            }
            described
        });
        if let Some(Value::Object(messages)) =
            self.channels.get_mut(channel).and_then(|c| c.get_mut("messages"))
        {
            messages.insert(message.clone(), json!({ "$ref": format!("#/components/messages/{message}") }));
        }
        message
    }
}

/// A type's last path segment (`my_app::PaymentRequested` → `PaymentRequested`).
fn short(rust_type: &str) -> &str {
    let outer = rust_type.split('<').next().unwrap_or(rust_type);
    outer.rsplit("::").next().unwrap_or(outer)
}

/// An id AsyncAPI accepts as a map key (`[A-Za-z0-9_.-]`): anything else is `_`.
fn id(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_keep_what_asyncapi_accepts() {
        assert_eq!(id("queue.payments.stream"), "queue.payments.stream");
        assert_eq!(id("exchange.a b/c"), "exchange.a_b_c");
        assert_eq!(short("my_app::events::PaymentRequested"), "PaymentRequested");
        assert_eq!(short("alloc::vec::Vec<u8>"), "Vec");
    }
}
