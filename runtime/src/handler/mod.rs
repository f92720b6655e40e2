//! The contract between a handler fn and the runtime.
//!
//! Users never implement [`Handler`] by hand: `#[idempotent_handler]` does it for the
//! unit struct that replaces their fn. The runtime only ever sees `dyn` handlers
//! through [`Handler`], the way axum only sees `Handler` and never your fn's type.

pub(crate) mod batch;
pub(crate) mod context;
pub mod identity;
pub(crate) mod key;
pub(crate) mod prepare;
pub(crate) mod wire;

use std::fmt;

use diesel_async::AsyncPgConnection;
use serde::de::DeserializeOwned;

use crate::base::retry::RetryPolicy;
use crate::base::verdict::OnConflict;
use crate::handler::batch::Batch;
use crate::handler::context::{Context, HandlerOutput};
use crate::handler::key::{Key, KeyError, Metadata};

pub use crate::base::BoxFuture;

/// An idempotent message handler: decode target, dedup key and the effect.
///
/// Implemented by `#[idempotent_handler]`; see the crate docs for the attribute.
/// The runtime calls [`Handler::handle`] inside the transaction that also holds the
/// dedup row, on the same connection, and commits both or neither.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotent handler",
    note = "annotate the handler fn with #[idempotent_handler(key = \"...\")]"
)]
pub trait Handler: Send + Sync + 'static {
    /// The message type the body is decoded into (JSON).
    type Message: DeserializeOwned + Send + 'static;

    /// The stable name that scopes this handler's dedup keys.
    ///
    /// Renaming a handler makes every old message look new: keep it stable
    /// (the attribute's `name = "..."` exists for that).
    fn name(&self) -> &'static str;

    /// The key path as written in the attribute (e.g. `"order.id"`), for error messages.
    fn key_path(&self) -> &'static str;

    /// Extracts the dedup key from a decoded message and its delivery's metadata
    /// (`key = "@message_id"`, `"@header:…"`, `"@hash"`, a `key_fn` taking both).
    ///
    /// # Errors
    /// A missing (`None`), empty or otherwise unusable key; the message is dead-lettered.
    fn key(&self, message: &Self::Message, metadata: &Metadata<'_>) -> Result<Key, KeyError>;

    /// The lane path as written in the attribute (`lane = "account"`), if the handler
    /// has one.
    fn lane_path(&self) -> Option<&'static str> {
        None
    }

    /// The message's lane, if the handler has one: deliveries with the same lane
    /// value go to the same pipeline, in arrival order (see the crate docs, "Lanes").
    ///
    /// # Errors
    /// Like [`Handler::key`]: a lane value that is missing or unusable dead-letters
    /// the message (kind `key`).
    fn lane(&self, message: &Self::Message) -> Option<Result<Key, KeyError>> {
        let _ = message;
        None
    }

    /// The queue the handler names (`queue = "..."`): [`RuntimeBuilder::consume`](crate::RuntimeBuilder::consume)
    /// refuses another, and the test kit consumes it.
    fn queue(&self) -> Option<&'static str> {
        None
    }

    /// The handler's own retry policy (`retry(...)`); the runtime's otherwise.
    fn retry(&self) -> Option<RetryPolicy> {
        None
    }

    /// What to do with a known key arriving with another payload (`on_conflict =
    /// ...`); the runtime's setting otherwise.
    fn on_conflict(&self) -> Option<OnConflict> {
        None
    }

    /// The most deliveries of this handler in one transaction (`batch = N`; `1`:
    /// per-message), at most the runtime's batch size.
    fn batch_size(&self) -> Option<usize> {
        None
    }

    /// Whether the runtime keeps dedup rows for this handler (`dedup = false`: no;
    /// for handlers that are idempotent by themselves — still one transaction per
    /// batch, still acked only after COMMIT, but every delivery runs, duplicates
    /// included, and what it publishes gets random message ids).
    fn dedup(&self) -> bool {
        true
    }

    /// How long the provider of the handler's outbound calls keeps an idempotency
    /// key ([`Context::idempotency_key`]; `idempotency_key_lifetime = "24h"`):
    /// `build()` warns when the handler's retry horizon is longer.
    fn idempotency_key_lifetime(&self) -> Option<std::time::Duration> {
        None
    }

    /// The correlation key of the saga the handler is a transition of (`saga:
    /// &mut idemq::saga::Saga<S>` among its arguments): read from the message as the
    /// saga's `#[saga(key = ..)]` (or its `takes(M(key = ..))`) says, beside the dedup
    /// key. `None` for a handler of no saga. A missing or unusable one dead-letters
    /// the message (kind `key`), as a missing dedup key does.
    ///
    /// # Errors
    /// As [`Handler::key`].
    #[doc(hidden)]
    fn saga_key(&self, message: &Self::Message, metadata: &Metadata<'_>) -> Option<Result<Key, KeyError>> {
        let _ = (message, metadata);
        None
    }

    /// The saga's key path, as written (`"order_id"`), for error messages.
    #[doc(hidden)]
    fn saga_key_path(&self) -> Option<&'static str> {
        None
    }

    /// The saga the handler is a step of: its name and the messages it takes and
    /// sends, for the AsyncAPI document (the attribute writes it).
    #[doc(hidden)]
    fn saga(&self) -> Option<SagaShape> {
        None
    }

    /// The Rust type of the handler's result — what a request is answered with —
    /// for the AsyncAPI document; `None` for `()` (the attribute writes it).
    fn reply_type(&self) -> Option<&'static str> {
        None
    }

    /// How the message type is read from a delivery: its name on the wire (the
    /// AMQP `type`, [`MessageType`](crate::MessageType)) and its versions
    /// ([`Versioned`](crate::Versioned)). The attribute writes it from what the
    /// message type implements; not meant to be written by hand.
    #[doc(hidden)]
    fn wire(&self) -> crate::handler::wire::Wire<Self::Message> {
        crate::handler::wire::Wire::plain()
    }

    /// Applies the message's effect on `conn`, inside the runtime's transaction.
    /// Messages published through `ctx` go into the outbox in that transaction;
    /// the output is stored with the dedup row and is the reply to a request.
    fn handle<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        ctx: &'a mut Context,
        message: Self::Message,
    ) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>>;

    /// Whether the runtime calls [`Handler::handle_batch`] (once per transaction,
    /// with its new messages together) instead of [`Handler::handle`] (once per
    /// message). The attribute says `true` for a fn taking `&mut Batch<M>`.
    fn batched(&self) -> bool {
        false
    }

    /// Applies the effects of a transaction's new messages (arrival order) on
    /// `conn`, together, inside the runtime's transaction: called instead of
    /// [`Handler::handle`] when [`Handler::batched`] says so. Each message has its
    /// own [`Context`] in the batch; the outputs are one per message, in the batch's
    /// order (another number fails the batch).
    ///
    /// A failure is the whole batch's: the transaction is rolled back, and the
    /// runtime runs the batch again in halves until the failing message is alone,
    /// which alone is charged an attempt (see the crate docs, "Handlers").
    ///
    /// The default (for a handler without a batch form, which the runtime never
    /// calls this way) runs [`Handler::handle`] for each message in order, moving the
    /// messages out of the batch.
    fn handle_batch<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        batch: &'a mut Batch<Self::Message>,
    ) -> BoxFuture<'a, Result<Vec<HandlerOutput>, HandlerError>> {
        batch::one_by_one(self, conn, batch)
    }
}

use crate::base::SagaShape;

pub use crate::base::verdict::ErrorClass;

/// The error a handler returns: any error, classified [transient](ErrorClass::Transient)
/// by default.
///
/// Any `std::error::Error + Send + Sync + 'static` converts into it, so `?` just works.
/// Mark an error permanent with [`HandlerError::permanent`] or [`Permanent`]:
///
/// ```
/// use idemq::{HandlerError, Permanent};
///
/// fn check(amount: i64) -> Result<(), HandlerError> {
///     if amount < 0 {
///         return Err(Permanent("negative amount").into());
///     }
///     Ok(())
/// }
/// ```
///
/// Like `anyhow::Error`, it deliberately does not implement `std::error::Error`
/// (that is what lets every error convert into it).
pub struct HandlerError {
    class: ErrorClass,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl HandlerError {
    /// A transient error: the delivery is retried.
    pub fn transient(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self { class: ErrorClass::Transient, source: error.into() }
    }

    /// A permanent error: the message is dead-lettered without further attempts.
    pub fn permanent(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self { class: ErrorClass::Permanent, source: error.into() }
    }

    /// How the runtime treats this error.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The underlying error.
    pub fn source(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }
}

impl<E> From<E> for HandlerError
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(error: E) -> Self {
        Self::transient(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError").field("class", &self.class).field("source", &self.source).finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)?;
        let mut cause = self.source.source();
        while let Some(err) = cause {
            write!(f, ": {err}")?;
            cause = err.source();
        }
        Ok(())
    }
}

/// Wraps an error (or a message) to mark it [permanent](ErrorClass::Permanent).
///
/// `return Err(Permanent(err).into())` or `.map_err(Permanent)?`.
#[derive(Debug)]
pub struct Permanent<E>(pub E);

impl<E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>> From<Permanent<E>> for HandlerError {
    fn from(Permanent(error): Permanent<E>) -> Self {
        Self::permanent(error)
    }
}
