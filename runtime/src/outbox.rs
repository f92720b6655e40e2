//! The transactional outbox: messages published exactly when their transaction commits.
//!
//! A handler publishes through its [`Context`](crate::Context): `ctx.publish(exchange, routing_key,
//! &msg)` only *buffers* the message. After the handler returned `Ok`, the runtime
//! writes the buffered messages of the whole batch into `idemq_outbox` in one
//! statement, in the transaction that holds the dedup rows, and COMMITs. Rolled back,
//! nothing is published; committed, the [relay](crate::outbox::Relay) publishes each row with
//! publisher confirms and `mandatory`, and deletes it once the broker confirmed it.
//!
//! Message ids are deterministic: the `n`-th message a handler publishes for key `k`
//! gets `message_id(handler scope, k, n)` (32 hex digits of a SHA-256). A retried
//! attempt publishes under the same ids (only one attempt ever commits), and a relay
//! re-send after a crash carries the id of its row: a downstream consumer keyed on
//! the message id applies it once. Outside a handler, [`enqueue`] writes a row in the
//! caller's transaction with the id the caller gave or a random one (128 bits of the
//! operating system's randomness), stored with the row — stable across re-sends, which
//! is all the downstream dedup needs.
//!
//! Replies expire; events never do. A reply whose requester is gone (an auto-delete or
//! exclusive `reply_to` queue goes away with its client) is returned as unroutable on
//! every try, so the relay deletes a reply row unpublished once it is older than the
//! reply TTL ([`RelayBuilder::reply_ttl`](crate::outbox::RelayBuilder::reply_ttl), default
//! 1 h) or its request's own AMQP `expiration` has passed since the request was
//! consumed, whichever comes first.

use diesel_async::AsyncPgConnection;
use serde::Serialize;

use crate::base::outgoing::Message;
use crate::base::BoxFuture;

pub use crate::base::outgoing::{Outgoing, When, MAX_HEADER_BYTES, STATUS_HEADER};
// Its old path: `PublishError` is at the crate root, shared by the three sinks.
#[doc(hidden)]
pub use crate::base::outgoing::PublishError;
pub use crate::engine::relay::{Relay, RelayBuilder};

/// Writes `outgoing` into the outbox in the caller's open transaction (any
/// diesel-async transaction: it is published once that commits, never if it rolls
/// back). Returns the message id: the one given with [`Outgoing::message_id`], or a
/// random one stored with the row.
///
/// Inside a handler, use [`Context::publish`](crate::Context::publish) instead (deterministic ids, one
/// statement per batch). The relay of a running [`Runtime`](crate::Runtime) picks
/// the row up within its poll interval, or at once if something notifies it.
///
/// ```no_run
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), Box<dyn std::error::Error>> {
/// use diesel_async::AsyncConnection;
/// use idemq::{outbox::enqueue, outbox::Outgoing};
///
/// conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
///     // ... the application's own writes ...
///     enqueue(conn, Outgoing::json("orders", "order.placed", &serde_json::json!({"id": 7}))?.message_id("order-7"))
///         .await?;
///     Ok(())
/// })
/// .await
/// .map_err(|err| err.to_string())?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`PublishError::Database`].
pub fn enqueue(
    conn: &mut AsyncPgConnection,
    outgoing: Outgoing,
) -> BoxFuture<'_, Result<String, PublishError>> {
    Box::pin(async move {
        let mut ids = Outbox::new(conn).publish_all([outgoing]).await?;
        Ok(ids.pop().unwrap_or_default())
    })
}

/// Cancels a scheduled message ([`Outgoing::deliver`]) in the caller's open
/// transaction, by the id [`enqueue`] or [`Context::schedule`](crate::Context::schedule)
/// returned: `true` if it was still waiting (it is never published, once this
/// transaction commits), `false` if it was already published or never written. In a
/// handler, pass the handler's connection: the cancel commits with its effects and
/// its dedup row, or not at all. A message the relay is publishing at this moment
/// is locked: the cancel waits for that pass, and answers `false`.
///
/// # Errors
/// [`PublishError::Database`].
pub fn cancel<'a>(
    conn: &'a mut AsyncPgConnection,
    message_id: &'a str,
) -> BoxFuture<'a, Result<bool, PublishError>> {
    Box::pin(async move {
        crate::store::db::cancel_outbox(conn, message_id).await.map_err(PublishError::Database)
    })
}

/// Rows due in the outbox (postponed ones included), waiting for the relay: its
/// backlog. A scheduled message not yet due is not counted.
///
/// # Errors
/// The database's.
pub fn backlog(conn: &mut AsyncPgConnection) -> BoxFuture<'_, diesel::QueryResult<i64>> {
    Box::pin(crate::store::db::outbox_backlog(conn))
}

/// The outbox as a sink, in the caller's open transaction: the calls of the
/// [`Publisher`](crate::Publisher) and of a handler's [`Context`](crate::Context),
/// whose messages go out once the transaction commits (by the relay, confirmed and
/// routed), never if it rolls back.
///
/// For code outside handlers that writes to the database and must publish exactly
/// when its writes commit (a web request placing an order, say): both or neither,
/// where publishing with the [`Publisher`](crate::Publisher) after the COMMIT could
/// lose the message to a crash in between, and before it could publish what then
/// rolls back.
///
/// ```no_run
/// # #[derive(serde::Serialize, idemq::Message)]
/// # #[message(exchange = "orders", routing_key = "order.placed")]
/// # struct OrderPlaced { order_id: i64 }
/// # async fn example(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use diesel_async::AsyncConnection;
/// use idemq::outbox::Outbox;
///
/// conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(async |conn| {
///     // ... the application's own writes ...
///     Outbox::new(conn).send(&OrderPlaced { order_id: 7 }).await?;
///     Ok(())
/// })
/// .await?;
/// # Ok(())
/// # }
/// ```
pub struct Outbox<'c> {
    conn: &'c mut AsyncPgConnection,
}

impl std::fmt::Debug for Outbox<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}

impl<'c> Outbox<'c> {
    /// The outbox, written through `conn` (in its open transaction, if it has one).
    pub fn new(conn: &'c mut AsyncPgConnection) -> Self {
        Self { conn }
    }

    /// Writes `message` as JSON, to go where its type says ([`Message`]); returns
    /// its message id (random, stored with the row).
    ///
    /// # Errors
    /// As [`enqueue`].
    pub async fn send<M: Message>(&mut self, message: &M) -> Result<String, PublishError> {
        self.publish(M::EXCHANGE, message.routing_key(), message).await
    }

    /// Writes `message` as JSON, to go to `exchange` with `routing_key`.
    ///
    /// # Errors
    /// As [`enqueue`].
    pub async fn publish<T: Serialize + ?Sized>(
        &mut self,
        exchange: &str,
        routing_key: &str,
        message: &T,
    ) -> Result<String, PublishError> {
        self.publish_outgoing(Outgoing::json(exchange, routing_key, message)?).await
    }

    /// Writes a message built with [`Outgoing`] ([`enqueue`]).
    ///
    /// # Errors
    /// As [`enqueue`].
    pub fn publish_outgoing(&mut self, outgoing: Outgoing) -> BoxFuture<'_, Result<String, PublishError>> {
        enqueue(self.conn, outgoing)
    }

    /// Writes every message in one statement; returns their ids, in order (each
    /// given with [`Outgoing::message_id`], or random).
    ///
    /// # Errors
    /// As [`enqueue`].
    pub fn publish_all(
        &mut self,
        messages: impl IntoIterator<Item = Outgoing>,
    ) -> BoxFuture<'_, Result<Vec<String>, PublishError>> {
        let rows = messages
            .into_iter()
            .map(|outgoing| {
                outgoing.validate()?;
                let id = outgoing.message_id.clone().unwrap_or_else(crate::base::random_id);
                Ok(Outgoing { message_id: Some(id), ..outgoing })
            })
            .collect();
        insert_rows(self.conn, rows)
    }
}

/// [`Outbox::publish_all`] past its one generic step, boxed: compiled once, in
/// idemq, not in each crate that publishes.
fn insert_rows(
    conn: &mut AsyncPgConnection,
    rows: Result<Vec<Outgoing>, PublishError>,
) -> BoxFuture<'_, Result<Vec<String>, PublishError>> {
    Box::pin(async move {
        let rows = rows?;
        crate::store::db::insert_outbox(conn, &rows).await.map_err(PublishError::Database)?;
        Ok(rows.into_iter().filter_map(|row| row.message_id).collect())
    })
}
