//! A queue several handlers consume, one per message type: what takes the
//! deliveries whose type none of them takes. It is a handler only in form: every
//! delivery it prepares is refused as `unroutable-type`, so the delivery state
//! machine dead-letters it like any other bad input (confirmed copy, then ack),
//! with the type in `x-idemq-message-type`.

use diesel_async::AsyncPgConnection;

use crate::base::outcome::FailureKind;
use crate::handler::context::Context;
use crate::handler::prepare::{BatchRun, Erased, ErasedHandler, InputLimits, Prepared, Rejection};
use crate::handler::BoxFuture;

/// The name its dead letters carry in `x-idemq-handler` (it is not a dedup scope:
/// nothing it prepares reaches a transaction).
pub(super) const UNROUTABLE: &str = "idemq:unroutable";

/// The taker of a routed queue's deliveries of no handler's type.
pub(super) struct Unroutable {
    pub(super) queue: String,
    /// The types the queue's handlers take, for the message.
    pub(super) types: Vec<&'static str>,
}

impl ErasedHandler for Unroutable {
    fn name(&self) -> &'static str {
        UNROUTABLE
    }

    fn type_path(&self) -> &'static str {
        UNROUTABLE
    }

    fn lane_path(&self) -> Option<&'static str> {
        None
    }

    fn queue(&self) -> Option<&'static str> {
        None
    }

    fn retry(&self) -> Option<crate::base::retry::RetryPolicy> {
        None
    }

    fn on_conflict(&self) -> Option<crate::base::verdict::OnConflict> {
        None
    }

    fn batch_size(&self) -> Option<usize> {
        None
    }

    fn dedup(&self) -> bool {
        false
    }

    fn idempotency_key_lifetime(&self) -> Option<std::time::Duration> {
        None
    }

    fn message_type(&self) -> &'static str {
        UNROUTABLE
    }

    fn key_path(&self) -> &'static str {
        ""
    }

    fn amqp_type(&self) -> Option<&'static str> {
        None
    }

    fn versions(&self) -> Option<Result<Vec<(u32, &'static str)>, String>> {
        None
    }

    fn payload_schema(&self) -> Option<serde_json::Value> {
        None
    }

    fn reply_type(&self) -> Option<&'static str> {
        None
    }

    fn saga(&self) -> Option<crate::base::SagaShape> {
        None
    }

    fn batched(&self) -> bool {
        false
    }

    fn run_batch<'a>(
        &'a self,
        _conn: &'a mut AsyncPgConnection,
        _messages: Vec<Erased>,
        _contexts: Vec<Context>,
    ) -> BoxFuture<'a, BatchRun> {
        // Never called: nothing it prepares is runnable.
        Box::pin(async {
            Err(crate::handler::HandlerError::permanent("idemq bug: an unroutable message was run"))
        })
    }

    fn prepare(
        &self,
        _body: &[u8],
        properties: &lapin::BasicProperties,
        _limits: InputLimits,
    ) -> Result<Prepared, Rejection> {
        // The delivery's routing key is not at hand here: the router sent the
        // delivery here because neither its `type` nor the key it was first
        // published with named a handler's type (a copy carries that key in a header).
        let said = match properties.kind() {
            Some(kind) if !kind.as_str().is_empty() => format!("message type '{kind}'"),
            _ => {
                match crate::base::amqp_value::header(properties, crate::base::headers::ORIGINAL_ROUTING_KEY)
                    .and_then(crate::base::amqp_value::string)
                {
                    Some(key) => format!("no AMQP `type` and the routing key '{key}'"),
                    None => "no message type (no AMQP `type`, and a routing key that names none)".to_owned(),
                }
            }
        };
        Err(Rejection {
            kind: FailureKind::UnroutableType,
            message: format!(
                "no handler of queue '{}' takes {said}; its handlers take {}: publish the message with one of \
                 those as its AMQP `type` (`#[message(type = \"...\")]` and `send` set it), or register a handler \
                 for its type",
                self.queue,
                self.types.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", "),
            ),
        })
    }
}
