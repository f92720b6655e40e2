//! Turning a delivery's bytes into a typed message and its key, type-erased so the
//! runtime can hold handlers of different message types.

use std::any::Any;
use std::sync::Arc;

use diesel_async::AsyncPgConnection;

use crate::base::outcome::FailureKind;
use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::handler::batch::Batch;
use crate::handler::context::{Context, HandlerOutput};
use crate::handler::key::{Key, KeyError, Metadata};
use crate::handler::wire::VersionError;
use crate::handler::{BoxFuture, Handler, HandlerError};

pub(crate) mod fingerprint;
pub(crate) use fingerprint::Fingerprint;

/// The effect of one message, ready to run inside the transaction.
pub(crate) type Effect = Box<
    dyn for<'c> FnOnce(
            &'c mut AsyncPgConnection,
            &'c mut Context,
        ) -> BoxFuture<'c, Result<HandlerOutput, HandlerError>>
        + Send,
>;

/// A decoded message, erased, waiting for the other new messages of its transaction
/// (a batch handler's; see [`ErasedHandler::run_batch`]).
pub(crate) type Erased = Box<dyn Any + Send>;

/// What a batch handler's run gives back: one output per message (as many as the
/// handler returned: the engine checks the number) and the contexts, holding what
/// each message published.
pub(crate) type BatchRun = Result<(Vec<HandlerOutput>, Vec<Context>), HandlerError>;

/// What runs a decoded message.
pub(crate) enum Payload {
    /// A handler of one message: the message's effect, ready to run.
    Effect(Effect),
    /// A batch handler's message, run with the others of its transaction.
    Message(Erased),
}

/// A decoded message: its key, fingerprint and what runs it.
pub(crate) struct Prepared {
    pub(crate) key: Key,
    /// SHA-256 of the canonical form of what the message type reads of the body
    /// (see [`fingerprint`]): the same key with another payload is a conflict.
    pub(crate) fingerprint: fingerprint::Fingerprint,
    /// The message's lane value, if its handler has a lane.
    pub(crate) lane: Option<Key>,
    pub(crate) payload: Payload,
}

/// Why a message was refused before any transaction: always a dead letter.
#[derive(Debug)]
pub(crate) struct Rejection {
    pub(crate) kind: FailureKind,
    pub(crate) message: String,
}

/// Limits checked before decoding.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InputLimits {
    pub(crate) max_body_bytes: usize,
}

/// A handler without its message type.
pub(crate) trait ErasedHandler: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// The handler type's path (e.g. `billing::ledger::apply`), for messages.
    fn type_path(&self) -> &'static str;
    /// The lane path (`lane = "..."`), if the handler has one.
    fn lane_path(&self) -> Option<&'static str>;
    fn queue(&self) -> Option<&'static str>;
    fn retry(&self) -> Option<RetryPolicy>;
    fn on_conflict(&self) -> Option<OnConflict>;
    fn batch_size(&self) -> Option<usize>;
    fn dedup(&self) -> bool;
    fn idempotency_key_lifetime(&self) -> Option<std::time::Duration>;
    /// The Rust type its messages decode into.
    fn message_type(&self) -> &'static str;
    /// Where its key comes from (`Handler::key_path`).
    fn key_path(&self) -> &'static str;
    /// The name of its message type on the wire (`#[message(type = "...")]`): what
    /// routes a delivery to it on a queue several handlers consume.
    fn amqp_type(&self) -> Option<&'static str>;
    /// Its message type's version chain (newest first), if the type is versioned;
    /// an error names a gap in the chain.
    fn versions(&self) -> Option<Result<Vec<(u32, &'static str)>, String>>;
    /// Its message type's JSON Schema (feature `schemars`), for the AsyncAPI document.
    fn payload_schema(&self) -> Option<serde_json::Value>;
    /// Its result's Rust type (the reply to a request), if not `()`.
    fn reply_type(&self) -> Option<&'static str>;
    /// The saga it is a step of, for the AsyncAPI document.
    fn saga(&self) -> Option<crate::base::SagaShape>;
    /// Whether its messages run together, as a [`Batch`] ([`Payload::Message`]).
    fn batched(&self) -> bool;
    /// Runs the batch handler on `messages` (each a [`Payload::Message`] this handler
    /// prepared), each with its context.
    fn run_batch<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        messages: Vec<Erased>,
        contexts: Vec<Context>,
    ) -> BoxFuture<'a, BatchRun>;
    fn prepare(
        &self,
        body: &[u8],
        properties: &lapin::BasicProperties,
        limits: InputLimits,
    ) -> Result<Prepared, Rejection>;
}

/// `handler`, erased for the runtime's registrations. The erased type is `Arc<H>`,
/// not `H`: [`ErasedHandler::prepare`] takes `&self` (the engine calls it through a
/// shared `Arc<dyn ErasedHandler>`) yet returns a `'static` effect that owns the
/// handler, which it gets by cloning that inner `Arc`. So the one place an `Arc`
/// wraps an `Arc` is here.
pub(crate) fn erase<H: Handler>(handler: H) -> Arc<dyn ErasedHandler> {
    Arc::new(Arc::new(handler))
}

impl<H: Handler> ErasedHandler for Arc<H> {
    fn name(&self) -> &'static str {
        H::name(self)
    }

    fn type_path(&self) -> &'static str {
        std::any::type_name::<H>()
    }

    fn lane_path(&self) -> Option<&'static str> {
        H::lane_path(self)
    }

    fn queue(&self) -> Option<&'static str> {
        H::queue(self)
    }

    fn retry(&self) -> Option<RetryPolicy> {
        H::retry(self)
    }

    fn on_conflict(&self) -> Option<OnConflict> {
        H::on_conflict(self)
    }

    fn batch_size(&self) -> Option<usize> {
        H::batch_size(self)
    }

    fn dedup(&self) -> bool {
        H::dedup(self)
    }

    fn idempotency_key_lifetime(&self) -> Option<std::time::Duration> {
        H::idempotency_key_lifetime(self)
    }

    fn message_type(&self) -> &'static str {
        std::any::type_name::<H::Message>()
    }

    fn key_path(&self) -> &'static str {
        H::key_path(self)
    }

    fn amqp_type(&self) -> Option<&'static str> {
        H::wire(self).type_name
    }

    fn versions(&self) -> Option<Result<Vec<(u32, &'static str)>, String>> {
        H::wire(self).versions.map(|versions| versions.chain())
    }

    fn payload_schema(&self) -> Option<serde_json::Value> {
        H::wire(self).schema.map(|schema| schema())
    }

    fn reply_type(&self) -> Option<&'static str> {
        H::reply_type(self)
    }

    fn saga(&self) -> Option<crate::base::SagaShape> {
        H::saga(self)
    }

    fn batched(&self) -> bool {
        H::batched(self)
    }

    fn run_batch<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        messages: Vec<Erased>,
        contexts: Vec<Context>,
    ) -> BoxFuture<'a, BatchRun> {
        Box::pin(async move {
            let messages = messages
                .into_iter()
                .map(|message| message.downcast::<H::Message>().map(|message| *message))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| {
                    HandlerError::permanent(format!(
                        "idemq bug: a message given to the batch handler {} is not a {}",
                        std::any::type_name::<H>(),
                        std::any::type_name::<H::Message>()
                    ))
                })?;
            let mut batch = Batch::new(messages, contexts);
            let outputs = H::handle_batch(self, conn, &mut batch).await?;
            Ok((outputs, batch.into_contexts()))
        })
    }

    fn prepare(
        &self,
        body: &[u8],
        properties: &lapin::BasicProperties,
        limits: InputLimits,
    ) -> Result<Prepared, Rejection> {
        let content_type = properties.content_type().as_ref().map(|ct| ct.as_str());
        if body.len() > limits.max_body_bytes {
            return Err(Rejection {
                kind: FailureKind::TooLarge,
                message: format!(
                    "the body is {} bytes, over the limit of {} bytes; raise RuntimeBuilder::max_body_bytes or send smaller messages",
                    body.len(),
                    limits.max_body_bytes
                ),
            });
        }
        if let Some(content_type) = content_type {
            if !is_json(content_type) {
                return Err(Rejection {
                    kind: FailureKind::ContentType,
                    message: format!(
                        "content-type '{content_type}' is not JSON; idemq decodes application/json (or no content-type)"
                    ),
                });
            }
        }
        if let Some(depth) = nesting_over(body, MAX_NESTING) {
            return Err(Rejection {
                kind: FailureKind::Decode,
                message: format!("the body nests deeper than {MAX_NESTING} levels (reached {depth}); refused before decoding"),
            });
        }
        let (message, fingerprint) = match H::wire(self).versions {
            None => fingerprint::decode::<H::Message>(body)
                .map_err(|err| decode_rejection::<H>(self, body, &err))?,
            Some(versions) => {
                versions.decode(properties, body).map(|(m, f, _)| (m, f)).map_err(|err| match err {
                    VersionError::Header(_) | VersionError::Unknown { .. } => {
                        Rejection { kind: FailureKind::UnknownVersion, message: err.to_string() }
                    }
                    // The newest version's own errors read as any message's (a missing key is `key`).
                    VersionError::Decode { ref source, newest: true, .. } => {
                        decode_rejection::<H>(self, body, source)
                    }
                    VersionError::Decode { .. } | VersionError::Serialize(_) => {
                        Rejection { kind: FailureKind::Decode, message: err.to_string() }
                    }
                })?
            }
        };
        let metadata = Metadata::new(properties, fingerprint.as_slice());
        let key = self.key(&message, &metadata).map_err(|err| key_rejection(self.key_path(), &err))?;
        let lane = match self.lane(&message) {
            None => None,
            Some(Ok(lane)) => Some(lane),
            Some(Err(err)) => {
                let path = H::lane_path(self).unwrap_or("?");
                return Err(Rejection { kind: FailureKind::Key, message: format!("lane `{path}`: {err}") });
            }
        };
        let saga_key = match self.saga_key(&message, &metadata) {
            None => None,
            Some(Ok(saga_key)) => Some(saga_key.as_str().to_owned()),
            Some(Err(err)) => {
                let path = H::saga_key_path(self).unwrap_or("?");
                return Err(Rejection {
                    kind: FailureKind::Key,
                    message: format!("saga key `{path}`: {err}"),
                });
            }
        };
        let payload = if H::batched(self) {
            Payload::Message(Box::new(message))
        } else {
            let handler = Arc::clone(self);
            let effect: Effect = Box::new(move |conn, ctx| {
                if let Some(saga_key) = saga_key {
                    ctx.set_saga_key(saga_key);
                }
                Box::pin(async move { handler.handle(conn, ctx, message).await })
            });
            Payload::Effect(effect)
        };
        Ok(Prepared { key, fingerprint, lane, payload })
    }
}

/// A decode error, unless the real problem is the key: a body that is a JSON object
/// whose key path is absent or null is a missing key (kind `key`), not a decode error.
///
/// Only a plain field path is looked up, and an absent member counts only when
/// serde's error names it ("missing field `id`"): the path holds Rust field names,
/// and a field renamed with `#[serde(rename)]` is absent under its Rust name on the
/// wire even when it is there — its message's real decode error must not be
/// reported as a key error.
fn decode_rejection<H: Handler>(handler: &H, body: &[u8], err: &serde_json::Error) -> Rejection {
    let key_path = handler.key_path();
    let plain =
        !key_path.is_empty() && key_path.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
    if let (true, Ok(value)) = (plain, serde_json::from_slice::<serde_json::Value>(body)) {
        if value.is_object() {
            let leaf_name = key_path.rsplit('.').next().unwrap_or(key_path);
            let named = err.to_string().starts_with(&format!("missing field `{leaf_name}`"));
            match key_path.split('.').try_fold(&value, |v, seg| v.get(seg)) {
                Some(leaf) if leaf.is_null() => return key_rejection(key_path, &KeyError::Missing),
                None if named => return key_rejection(key_path, &KeyError::Missing),
                _ => {}
            }
        }
    }
    let message = match err.classify() {
        serde_json::error::Category::Syntax => format!("the body is not JSON: {err}"),
        serde_json::error::Category::Eof => format!("the body is truncated or empty JSON: {err}"),
        serde_json::error::Category::Io | serde_json::error::Category::Data => {
            format!("the body is not a valid {} message: {err}", std::any::type_name::<H::Message>())
        }
    };
    Rejection { kind: FailureKind::Decode, message }
}

fn key_rejection(key_path: &str, err: &KeyError) -> Rejection {
    Rejection { kind: FailureKind::Key, message: format!("key `{key_path}`: {err}") }
}

/// Deepest JSON nesting accepted, anywhere in the body (ignored fields included:
/// serde_json skips unknown fields without a depth limit).
pub(crate) const MAX_NESTING: usize = 128;

/// The depth reached if `body` nests arrays/objects deeper than `max`, in one pass
/// over the bytes (strings and escapes skipped). Malformed JSON is left to the decoder.
fn nesting_over(body: &[u8], max: usize) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0_usize, false, false);
    for &byte in body {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Some(depth);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// `application/json`, `text/json`, `application/*+json`, with or without parameters.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence.is_empty()
        || essence == "application/json"
        || essence == "text/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn nesting_is_measured_outside_strings() {
        let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
        assert_eq!(super::nesting_over(deep.as_bytes(), 128), Some(129));
        let ok = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert_eq!(super::nesting_over(ok.as_bytes(), 128), None);
        let quoted = format!(r#"{{"s": "{}\\" }}"#, "[".repeat(300));
        assert_eq!(super::nesting_over(quoted.as_bytes(), 128), None);
        let escaped_quote = format!(r#"{{"s": "\" {}" }}"#, "{".repeat(300));
        assert_eq!(super::nesting_over(escaped_quote.as_bytes(), 128), None);
    }

    #[test]
    fn json_content_types_are_recognised() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/cloudevents+json",
            "text/json",
            "",
        ] {
            assert!(super::is_json(ok), "{ok}");
        }
        for bad in ["text/plain", "application/xml", "application/octet-stream"] {
            assert!(!super::is_json(bad), "{bad}");
        }
    }
}
