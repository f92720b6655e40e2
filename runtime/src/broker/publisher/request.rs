//! The request client: a request over direct reply-to, and its reply.

use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::base::backoff::Backoff;
use crate::base::outgoing::{Message, Outgoing, PublishError, STATUS_HEADER};
use crate::base::BoxFuture;

use super::link::DIRECT_REPLY_TO;
use super::{prepare, Publisher, FIRST_BACKOFF, MAX_BACKOFF};

/// Why a request got no answer, or an answer that says it failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The request could not be published (unroutable, no exchange, unconfirmed…).
    #[error("the request could not be published")]
    Publish(#[from] PublishError),
    /// No reply came in time. The request may still be handled later: sending it
    /// again under the same key is answered with the stored reply.
    #[error(
        "no reply within {} (correlation id {correlation_id}): is a consumer running on the request's queue?",
        crate::base::duration::human(*after)
    )]
    Timeout {
        /// How long the request waited.
        after: Duration,
        /// The request's correlation id.
        correlation_id: String,
    },
    /// The handler failed for good, and said why in its error reply
    /// (`x-idemq-status: error`).
    #[error("the request failed ({kind}): {error}")]
    Failed {
        /// The failure's kind (`handler`, `conflict`, `timeout`…).
        kind: String,
        /// The handler's error, as its reply says it.
        error: String,
    },
    /// The reply does not decode as the type asked for.
    #[error("the reply does not decode as {expected}: {body}")]
    Decode {
        /// The type asked for.
        expected: &'static str,
        /// The reply's body (its first 200 bytes, lossily as UTF-8).
        body: String,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
}

/// What an idemq error reply holds.
#[derive(serde::Deserialize)]
struct ErrorReply {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    error: String,
}

impl Publisher {
    /// Sends `request` where its type says, and waits at most `timeout` for its
    /// reply, decoded as `Resp`.
    ///
    /// The request is published as [`send`](Self::send) publishes it — JSON, with its
    /// name on the wire (the AMQP `type`) and its version (the
    /// [`x-idemq-version`](crate::headers::VERSION) header) if its type declares them,
    /// so a handler of a versioned type reads it as that version — `mandatory` and
    /// confirmed, with a fresh message id and correlation id, and `reply_to`
    /// RabbitMQ's direct reply-to (`amq.rabbitmq.reply-to`, no reply queue needed).
    /// Should the connection go before the reply comes, it is published again on the
    /// next one with the same ids: an idempotent handler answers it as a duplicate,
    /// with its stored reply.
    ///
    /// To give the request its own message id (the key of a handler keyed on
    /// `@message_id`), a correlation id or headers, build it with [`Outgoing::of`]
    /// and send it with [`request_with`](Self::request_with).
    ///
    /// ```no_run
    /// # #[derive(serde::Serialize, idemq::Message)]
    /// # #[message(exchange = "", routing_key = "payments")]
    /// # struct ApplyPayment { payment_id: String }
    /// # #[derive(serde::Deserialize)]
    /// # struct Receipt { balance_cents: i64 }
    /// # async fn example(publisher: idemq::Publisher) -> Result<(), idemq::publisher::RequestError> {
    /// use std::time::Duration;
    ///
    /// let receipt: Receipt = publisher.request(&ApplyPayment { payment_id: "p-1".into() }, Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`RequestError::Failed`] for an error reply, [`RequestError::Timeout`],
    /// [`RequestError::Decode`], and [`RequestError::Publish`] with the errors of
    /// [`publish_all`](Self::publish_all).
    pub async fn request<Req: Message, Resp: DeserializeOwned>(
        &self,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp, RequestError> {
        self.request_with(Outgoing::of(request)?, timeout).await
    }

    /// [`request`](Self::request) with a request built with [`Outgoing`]: whatever
    /// it sets is sent — its message id, a correlation id (else a fresh one),
    /// headers — and the reply is decoded as `Resp`. [`Outgoing::of`] makes a
    /// [`Message`] into one as `send` and `request` publish it (its type and
    /// version); a message id given there is the request's on every copy, so a
    /// handler keyed on `@message_id` applies the same request sent twice once, and
    /// answers the second with the first's reply.
    ///
    /// ```no_run
    /// # #[derive(serde::Serialize, idemq::Message)]
    /// # #[message(exchange = "", routing_key = "payments")]
    /// # struct ApplyPayment { payment_id: String }
    /// # #[derive(serde::Deserialize)]
    /// # struct Receipt { balance_cents: i64 }
    /// # async fn example(publisher: idemq::Publisher) -> Result<(), idemq::publisher::RequestError> {
    /// use std::time::Duration;
    /// use idemq::outbox::Outgoing;
    ///
    /// let request = Outgoing::of(&ApplyPayment { payment_id: "p-1".into() })?
    ///     .message_id("order-7/payment")
    ///     .header("x-tenant", "acme");
    /// let receipt: Receipt = publisher.request_with(request, Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`request`](Self::request).
    pub async fn request_with<Resp: DeserializeOwned>(
        &self,
        request: Outgoing,
        timeout: Duration,
    ) -> Result<Resp, RequestError> {
        let body = self.request_outgoing(request, timeout).await?;
        serde_json::from_slice(&body).map_err(|source| RequestError::Decode {
            expected: std::any::type_name::<Resp>(),
            body: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            source,
        })
    }

    /// [`request_with`](Self::request_with), returning the reply's body as it came
    /// (not decoded: a body that is not JSON, or read later).
    ///
    /// # Errors
    /// As [`request`](Self::request), but for [`RequestError::Decode`].
    pub fn request_outgoing(
        &self,
        outgoing: Outgoing,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<u8>, RequestError>> {
        Box::pin(self.request_now(outgoing, timeout))
    }

    async fn request_now(&self, outgoing: Outgoing, timeout: Duration) -> Result<Vec<u8>, RequestError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let correlation_id = outgoing.correlation_id.clone().unwrap_or_else(crate::base::random_id);
        let mut message = prepare(outgoing.correlation_id(correlation_id.clone()))?;
        message.properties = message.properties.with_reply_to(DIRECT_REPLY_TO.into());
        let message = [message];
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        loop {
            let reason = match self.link(deadline).await? {
                Ok(link) => {
                    // Awaited before it is published: a reply can beat the confirm.
                    let mut expected = link.expect_reply(&correlation_id);
                    let round = link.publish(&message, &[0], deadline).await;
                    if let Some(refused) = round.refused {
                        return Err(refused.into());
                    }
                    let reason = match round.fault {
                        Some(fault) => fault.to_string(),
                        None => match tokio::time::timeout_at(deadline, &mut expected.receiver).await {
                            Ok(Ok(reply)) => return answer(&reply.properties, reply.data),
                            Ok(Err(_)) => "the connection was lost before the reply came".to_owned(),
                            Err(_) => {
                                return Err(RequestError::Timeout {
                                    after: started.elapsed(),
                                    correlation_id,
                                })
                            }
                        },
                    };
                    self.discard(&link, &reason).await;
                    reason
                }
                Err(reason) => reason,
            };
            self.wait(&mut backoff, deadline, started, reason).await?;
        }
    }
}

/// The reply's body, or its error.
fn answer(properties: &lapin::BasicProperties, body: Vec<u8>) -> Result<Vec<u8>, RequestError> {
    let status =
        crate::base::amqp_value::header(properties, STATUS_HEADER).and_then(crate::base::amqp_value::string);
    if status.as_deref() != Some("error") {
        return Ok(body);
    }
    let reply: ErrorReply = serde_json::from_slice(&body).unwrap_or_else(|_| ErrorReply {
        kind: "unknown".into(),
        error: String::from_utf8_lossy(&body).into_owned(),
    });
    Err(RequestError::Failed { kind: reply.kind, error: reply.error })
}
