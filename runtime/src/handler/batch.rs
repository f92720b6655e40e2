//! [`Batch`]: the new messages of one transaction, handed to a batch handler
//! together, each with its own [`Context`].

use crate::handler::context::{Context, HandlerOutput};
use crate::handler::{BoxFuture, Handler, HandlerError};

/// The new (not duplicate) messages of one transaction, in arrival order, each with
/// its own [`Context`]: what a batch handler receives.
///
/// A handler taking `&mut Batch<M>` instead of one `M` is called once per
/// transaction with every message of it that is new, so it can write one multi-row
/// statement for all of them. Duplicates are answered before it runs, as for a
/// handler of one message; key, lane and the other options apply per message.
///
/// ```
/// use diesel_async::AsyncPgConnection;
/// use idemq::{idempotent_handler, Batch, HandlerError};
/// # #[derive(Clone, serde::Deserialize, serde::Serialize)] struct PaymentRequested { payment_id: String, amount_cents: i64 }
/// # async fn record_payments(_: &mut AsyncPgConnection, _: &[PaymentRequested]) -> Result<(), HandlerError> { Ok(()) }
///
/// #[idempotent_handler(key = "payment_id")]
/// async fn apply_payment(
///     conn: &mut AsyncPgConnection,
///     batch: &mut Batch<PaymentRequested>,
/// ) -> Result<(), HandlerError> {
///     record_payments(conn, batch.messages()).await?; // one INSERT … VALUES (..), (..)
///     for (msg, ctx) in batch.iter_mut() {
///         ctx.publish("", "payments.applied", msg)?; // the outbox, per message
///     }
///     Ok(())
/// }
/// # let _ = apply_payment;
/// ```
///
/// The handler may instead return `Result<Vec<R>, E>`: one result per message, in
/// the batch's order, stored with each message's dedup row and sent as the reply to
/// a request. A `Vec` of another length fails the batch.
#[derive(Debug)]
pub struct Batch<M> {
    messages: Vec<M>,
    contexts: Vec<Context>,
}

impl<M> Batch<M> {
    /// `messages`, each with its context (the same length, the same order).
    pub(crate) fn new(messages: Vec<M>, contexts: Vec<Context>) -> Self {
        debug_assert_eq!(messages.len(), contexts.len());
        Self { messages, contexts }
    }

    /// How many messages it holds (at least one when a handler gets it).
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether it holds no message (never, when a handler gets it).
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The messages, in arrival order.
    pub fn messages(&self) -> &[M] {
        &self.messages
    }

    /// Each message's context, in the order of [`Batch::messages`].
    pub fn contexts(&self) -> &[Context] {
        &self.contexts
    }

    /// Each message's context, to publish through the outbox per message.
    pub fn contexts_mut(&mut self) -> &mut [Context] {
        &mut self.contexts
    }

    /// Each message with its context.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&M, &Context)> {
        self.messages.iter().zip(&self.contexts)
    }

    /// Each message with its context, to publish through the outbox per message
    /// (`ctx.send(..)`, `ctx.publish(..)`: the message ids are each message's own).
    pub fn iter_mut(&mut self) -> impl ExactSizeIterator<Item = (&M, &mut Context)> {
        self.messages.iter().zip(&mut self.contexts)
    }

    /// The contexts, taken back by the runtime after the handler ran, or by a test
    /// to see what each message published ([`Context::published`]).
    pub fn into_contexts(self) -> Vec<Context> {
        self.contexts
    }
}

/// A batch of the messages, each with its context: for calling a batch handler fn
/// directly, e.g. in a unit test, with [`Context::standalone`] contexts.
///
/// ```
/// use idemq::{Batch, Context};
///
/// let batch: Batch<&str> = ["p-1", "p-2"]
///     .into_iter()
///     .map(|id| (id, Context::standalone("apply_payment", id)))
///     .collect();
/// assert_eq!(batch.messages(), ["p-1", "p-2"]);
/// ```
impl<M> FromIterator<(M, Context)> for Batch<M> {
    fn from_iter<I: IntoIterator<Item = (M, Context)>>(iter: I) -> Self {
        let (messages, contexts) = iter.into_iter().unzip();
        Self { messages, contexts }
    }
}

/// What [`Handler::handle_batch`] does for a handler that has no batch form: each
/// message through [`Handler::handle`], in order (the messages are moved out of the
/// batch; the contexts stay).
pub(crate) fn one_by_one<'a, H: Handler + ?Sized>(
    handler: &'a H,
    conn: &'a mut diesel_async::AsyncPgConnection,
    batch: &'a mut Batch<H::Message>,
) -> BoxFuture<'a, Result<Vec<HandlerOutput>, HandlerError>> {
    Box::pin(async move {
        let messages = std::mem::take(&mut batch.messages);
        let mut outputs = Vec::with_capacity(messages.len());
        for (message, ctx) in messages.into_iter().zip(&mut batch.contexts) {
            outputs.push(handler.handle(conn, ctx, message).await?);
        }
        Ok(outputs)
    })
}

/// What [`Handler::handle`] does for a batch handler (written by the attribute): a
/// batch of one, whose one result is the message's. Not public API (re-exported
/// for the attribute's code through `idemq::__private`).
#[doc(hidden)]
pub fn as_batch_of_one<'a, H: Handler + ?Sized>(
    handler: &'a H,
    conn: &'a mut diesel_async::AsyncPgConnection,
    ctx: &'a mut Context,
    message: H::Message,
) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>> {
    Box::pin(async move {
        // The batch owns its contexts: `ctx` is lent to it and put back after.
        let mut batch = Batch::new(vec![message], vec![std::mem::replace(ctx, Context::detached())]);
        let result = handler.handle_batch(conn, &mut batch).await;
        if let Some(lent) = batch.contexts.pop() {
            *ctx = lent;
        }
        let mut outputs = result?;
        let output = outputs.pop();
        match (output, outputs.is_empty()) {
            (Some(output), true) => Ok(output),
            (output, _) => Err(length_mismatch(usize::from(output.is_some()) + outputs.len(), 1)),
        }
    })
}

/// A batch handler returned `results` results for `messages` messages.
pub(crate) fn length_mismatch(results: usize, messages: usize) -> HandlerError {
    HandlerError::transient(format!(
        "the batch handler returned {results} results for a batch of {messages} messages; \
         return one result per message, in the batch's order (or `()` for none)"
    ))
}
