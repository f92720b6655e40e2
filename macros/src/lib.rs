//! Procedural macros for [idemq](https://docs.rs/idemq): `#[idempotent_handler]` and
//! `#[derive(Message)]`. Use them through the `idemq` crate, which re-exports them;
//! this crate is an implementation detail.
//!
//! The pipeline is parse → model → validate → expand: `attr` (the options, key
//! forms and templates) and `handler` (the fn's shape) parse and validate into a
//! model, `expand` writes the code, `message` does the same for the derive. Every
//! check pushes into one collector (`errors`), so all errors come at once; on error
//! the user's fn is emitted unchanged next to them, so IDEs and later diagnostics
//! keep working. What only the compiler can check (the connection and context
//! types, the return and error types, the key field's type, the message's
//! `Deserialize`, a result's `Serialize`, a `key_fn`'s signature) is left to it,
//! through code spanned on the user's tokens and traits whose
//! `#[diagnostic::on_unimplemented]` says what to write instead.
//!
//! `usage/tests/ui` (the crate `idemq-macros-usage`) holds what the macros accept
//! (`pass/`) and a snapshot of every diagnostic they give (`fail/*.stderr`);
//! regenerate them with `TRYBUILD=overwrite cargo test -p idemq-macros-usage --test
//! ui` and review the diff.
//! `tests/expand` holds the generated code of the main forms (`IDEMQ_BLESS=1 cargo
//! test -p idemq-macros --lib` regenerates it).

mod attr;
mod errors;
mod expand;
mod handler;
mod message;
#[cfg(test)]
mod snapshots;

use proc_macro::TokenStream;

/// Declares, once, where a message type is published and which field is its key.
///
/// ```
/// use idemq::{Message, Topology};
/// use serde::{Deserialize, Serialize};
///
/// // Published: `ctx.send(&event)` in a handler, `Topology::message::<PaymentApplied>()`
/// // declares the exchange (a topic exchange; nothing for the default exchange `""`).
/// #[derive(Serialize, Message)]
/// #[message(exchange = "payments", routing_key = "payment.applied")]
/// struct PaymentApplied {
///     payment_id: String,
/// }
///
/// // Consumed: a handler of it needs no `key = "..."`. The key's name in messages
/// // is its serde name.
/// #[derive(Deserialize, Message)]
/// struct Refund {
///     #[message(key)]
///     #[serde(rename = "refundId")]
///     refund_id: String,
/// }
///
/// let _ = Topology::new().message::<PaymentApplied>();
/// assert_eq!(<Refund as idemq::key::KeyedMessage>::KEY_PATH, "refundId");
/// ```
///
/// `exchange` and `routing_key` go together and implement `idemq::Message`;
/// `#[message(key)]` (one field) implements `idemq::key::KeyedMessage`. Registration in
/// the topology is explicit: nothing is declared behind your back.
#[proc_macro_derive(Message, attributes(message))]
pub fn derive_message(input: TokenStream) -> TokenStream {
    message::derive(input.into()).into()
}

/// Turns an async fn into an idempotent message handler: a unit struct of the fn's
/// name implementing `idemq::Handler`, registered with `.consume(queue, handler)` (or
/// `.handler(handler)` when it names its `queue`). The fn stays callable as
/// `name::call(..)`, and its doc comments go on the struct.
///
/// # The fn
///
/// `async fn(conn: &mut AsyncPgConnection, msg: M) -> Result<R, E>`, where `M:
/// Deserialize` is the message (by value, or `&M`), `R` is `()` or a `Serialize`
/// result (stored with the dedup row and sent as the reply to a request) and `E` any
/// error (transient, retried) or `idemq::HandlerError`. An optional context, `ctx:
/// &mut idemq::Context` (or `&Context`), before or after the message, publishes
/// through the transactional outbox and reads the delivery's metadata.
///
/// ```
/// use diesel_async::AsyncPgConnection;
/// use idemq::{idempotent_handler, Context, HandlerError};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Deserialize)]
/// struct PaymentRequested { payment_id: String, amount_cents: i64 }
///
/// #[derive(Serialize)]
/// struct Receipt { payment_id: String }
///
/// /// Applies a payment; replies to requests with a receipt.
/// #[idempotent_handler(key = "payment_id")]
/// async fn apply_payment(
///     conn: &mut AsyncPgConnection,
///     msg: &PaymentRequested,
///     ctx: &mut Context,
/// ) -> Result<Receipt, HandlerError> {
///     let _ = (conn, msg.amount_cents); // write the effect with `conn`
///     ctx.publish("", "payments.applied", &msg.payment_id)?;
///     Ok(Receipt { payment_id: msg.payment_id.clone() })
/// }
/// # let _ = apply_payment;
/// ```
///
/// # Batch handlers
///
/// Take `batch: &mut idemq::Batch<M>` instead of the message (and no context: each
/// message in the batch has its own) and the handler is called once per transaction
/// with its new messages together, in arrival order, to write one multi-row
/// statement for all of them. It returns `Result<(), E>`, or `Result<Vec<R>, E>`
/// with one result per message, in the batch's order. The key and the options apply
/// per message, as for a handler of one message.
///
/// ```
/// use diesel_async::AsyncPgConnection;
/// use idemq::{idempotent_handler, Batch, HandlerError};
/// # #[derive(serde::Deserialize, serde::Serialize)] struct PaymentRequested { payment_id: String, amount_cents: i64 }
///
/// #[idempotent_handler(key = "payment_id")]
/// async fn apply_payments(
///     conn: &mut AsyncPgConnection,
///     batch: &mut Batch<PaymentRequested>,
/// ) -> Result<(), HandlerError> {
///     let _ = (conn, batch.messages()); // one INSERT … VALUES (..), (..) for all of them
///     for (msg, ctx) in batch.iter_mut() {
///         ctx.publish("", "payments.applied", msg)?;
///     }
///     Ok(())
/// }
/// # let _ = apply_payments;
/// ```
///
/// # The key
///
/// | form | the key is |
/// |---|---|
/// | `key = "payment_id"`, `key = "order.id"` | a field (string, integer, `uuid::Uuid`, `Option` of one: `None` is a missing key); Rust field names |
/// | `key = "{tenant}:{order.id}"` | a template: literal text, and each `{value}` as `<length>#<value>`, so values never run together (`{{`/`}}` are braces) |
/// | `key = "@message_id"` | the AMQP `message_id` (a delivery without one: a missing key) |
/// | `key = "@header:x-idempotency-key"` | a header, string or integer |
/// | `key = "@hash"` | the payload's fingerprint, for producers that send no id |
/// | `key_fn = path::to::f` | `f(&M) -> K` or `f(&M, &idemq::Metadata) -> K`, `K` a key type |
/// | none | the message type's `#[derive(Message)]` with `#[message(key)]` |
///
/// A template's values may be any of the forms above (`"{@header:x-tenant}/{id}"`).
/// A wrong field is a compile error on the key string; a template's syntax error
/// names its column.
///
/// ```
/// # use diesel_async::AsyncPgConnection;
/// # use idemq::{idempotent_handler, HandlerError, Metadata};
/// # #[derive(serde::Deserialize)] struct Order { id: u64 }
/// # #[derive(serde::Deserialize)] struct OrderPlaced { tenant: String, order: Order }
/// #[idempotent_handler(key = "{tenant}:{order.id}")]
/// async fn place(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
///     # let _ = (conn, msg.tenant);
///     Ok(())
/// }
///
/// fn region_and_order(msg: &OrderPlaced, metadata: &Metadata<'_>) -> Option<String> {
///     Some(format!("{}/{}", metadata.header("x-region")?, msg.order.id))
/// }
///
/// #[idempotent_handler(key_fn = region_and_order)]
/// async fn route(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
///     # let _ = (conn, msg.tenant);
///     Ok(())
/// }
/// # let _ = (place, route);
/// ```
///
/// # Options
///
/// | option | |
/// |---|---|
/// | `name = "..."` | the dedup scope (default: the fn's name); keep it stable |
/// | `lane = "field.path"` | one lane value's deliveries go to one pipeline, in order |
/// | `queue = "..."` | the queue it consumes, for `RuntimeBuilder::handler` |
/// | `retry(delays = ["1s", "30s", "5m"])`, `retry(none)` | its own retry schedule (units `ms`, `s`, `m`, `h`) |
/// | `on_conflict = "ignore"` / `"dead_letter"` | a known key with another payload: ack as a duplicate, or dead-letter (the default) |
/// | `batch = N` | at most N of its deliveries per transaction (`1`: one at a time) |
/// | `dedup = false` | no dedup rows: idempotent by itself; still one transaction, still acked after COMMIT; its outbox messages get random ids |
/// | `idempotency_key_lifetime = "24h"` | how long the provider of its outbound calls keeps an idempotency key (`ctx.idempotency_key()`); `build()` warns if its retries last longer |
///
/// ```
/// # use diesel_async::AsyncPgConnection;
/// # use idemq::{idempotent_handler, HandlerError};
/// # #[derive(serde::Deserialize)] struct Refund { refund_id: String }
/// #[idempotent_handler(key = "refund_id", queue = "refunds", retry(delays = ["1s", "1m"]), batch = 8)]
/// async fn refund(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
///     # let _ = (conn, msg.refund_id);
///     Ok(())
/// }
/// # let _ = refund;
/// ```
#[proc_macro_attribute]
pub fn idempotent_handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent_handler(attr.into(), item.into()).into()
}
