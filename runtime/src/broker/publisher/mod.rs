//! The producer side: [`Publisher`] publishes to RabbitMQ and sends requests (its
//! docs have the life of a publish).

mod link;
mod request;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::base::backoff::Backoff;
use crate::base::outgoing::{Message, Outgoing, PublishError};
use crate::base::BoxFuture;
use crate::broker::brokers::{self, Brokers};
use crate::error::Error;

use link::{Link, Prepared};
pub use request::RequestError;

/// How long a publish may take by default, reconnecting included.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The shortest wait between two connection attempts; it doubles up to the longest.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Publishes messages to RabbitMQ, confirmed and routed, and sends requests: the
/// producer side of idemq, outside handlers (a web request, a job, a script).
///
/// The same calls as a handler's [`Context`](crate::Context) — [`send`](Self::send)
/// a [`Message`] type, [`publish`](Self::publish) to an exchange and routing key,
/// [`publish_outgoing`](Self::publish_outgoing) — and as the transactional outbox
/// ([`Outbox`](crate::outbox::Outbox)): one API, three sinks. Use the outbox where
/// the message must go out exactly when a database transaction commits (the
/// application's own writes and the message, both or neither); the publisher
/// publishes now.
///
/// Cheap to clone (the clones share one connection, which publishes concurrent
/// calls pipelined); thread-safe. The connection is made at
/// [`connect`](PublisherBuilder::connect) and made again, to the next address of
/// the list, whenever it is lost.
///
/// # What a publish comes to
///
/// ```text
///  publish ──> link? ──no──> connect (next address; backoff between rounds) ─┐
///               │yes                                                         │
///               v                                                            │
///   exchange exists? (passive, once per connection) ──no──> NoExchange       │
///               │yes                                                         │
///               v                                                            │
///   basic_publish, mandatory, pipelined ──> confirm ──ack──> Ok(message id)  │
///               │                              ├─returned──> Unroutable      │
///               │                              └─nack / lost / silent ───────┘
///               └──────── past the timeout ──> Unconfirmed (it may have it)
/// ```
///
/// A message is published `mandatory` with publisher confirms: `Ok` means the broker
/// has it in a queue; a message no queue takes is returned, and is an error. A
/// message left unconfirmed — the connection lost, the broker nacking or silent — is
/// published again on a fresh connection under **the same message id**, until the
/// publisher's timeout: at least once, and a consumer keyed on the message id
/// (`@message_id`) applies it once. Past the timeout the error says the broker may or
/// may not have it.
///
/// [`request`](Self::request) sends a [`Message`] as [`send`](Self::send) publishes
/// it (its type and version) and waits for the reply;
/// [`request_with`](Self::request_with) sends one built with [`Outgoing`] (its own
/// message id, headers). Requests go over RabbitMQ's direct reply-to: the
/// publisher's channel consumes `amq.rabbitmq.reply-to` and each request names it
/// as its `reply_to`, with a correlation id its reply comes back with. A request whose connection is lost
/// before its reply came is published again, same message id and correlation id, on
/// the next connection: the handler sees a duplicate and answers it with its stored
/// reply, byte for byte the first. The reply to the first copy, addressed to the
/// channel that is gone, is never published: the relay asks the broker whether a
/// direct reply-to requester is still there (no `basic.return` says so, on any
/// RabbitMQ version) and keeps a reply to one that is gone until it expires.
/// No reply queue is declared: nothing here depends on RabbitMQ 4.3 refusing
/// transient non-exclusive queues.
///
/// ```no_run
/// # #[derive(serde::Serialize, idemq::Message)]
/// # #[message(exchange = "payments", routing_key = "payment.requested")]
/// # struct PaymentRequested { payment_id: String }
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = idemq::Publisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
/// let id = publisher.send(&PaymentRequested { payment_id: "p-1".into() }).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Publisher {
    shared: Arc<Shared>,
}

struct Shared {
    brokers: Brokers,
    role: String,
    timeout: Duration,
    /// The link in use; replaced once broken.
    current: Mutex<Option<Arc<Link>>>,
    /// One connection attempt at a time.
    connecting: tokio::sync::Mutex<()>,
    closed: AtomicBool,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("brokers", &self.shared.brokers)
            .field("name", &self.shared.role)
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

/// Settings of a [`Publisher`]; [`connect`](Self::connect) makes it.
#[derive(Debug, Clone)]
#[must_use]
pub struct PublisherBuilder {
    amqp_url: Option<String>,
    name: String,
    timeout: Duration,
}

impl PublisherBuilder {
    /// The broker: one `amqp://`/`amqps://` URL or several, comma-separated, as
    /// `AMQP_URL` (default: `AMQP_URL` or `AMQP_URL_FILE` from the environment, else
    /// the local broker).
    pub fn amqp_url(mut self, urls: impl Into<String>) -> Self {
        self.amqp_url = Some(urls.into());
        self
    }

    /// Names the connection for the broker's operators: `idemq <name> (pid N)`
    /// (default `publisher`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How long one publish may take, reconnecting and publishing again included,
    /// before it fails with [`PublishError::Unconfirmed`] (default 30 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects (to the first address that answers) and returns the publisher.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero timeout or a URL that cannot be used;
    /// [`Error::AmqpConnect`], [`Error::Tls`] or [`Error::Amqp`] when no address
    /// could be connected to.
    pub fn connect(self) -> BoxFuture<'static, Result<Publisher, Error>> {
        Box::pin(self.connect_now())
    }

    async fn connect_now(self) -> Result<Publisher, Error> {
        if self.timeout.is_zero() {
            return Err(Error::Config(
                "the publisher's timeout is zero: give it time to be confirmed, e.g. 30s".into(),
            ));
        }
        let urls = match self.amqp_url {
            Some(urls) => urls,
            None => crate::config::env_url("AMQP_URL", crate::config::DEFAULT_AMQP_URL)?,
        };
        let brokers = Brokers::parse(&urls)?;
        let link = Link::connect(&brokers, &self.name).await?;
        Ok(Publisher {
            shared: Arc::new(Shared {
                brokers,
                role: self.name,
                timeout: self.timeout,
                current: Mutex::new(Some(Arc::new(link))),
                connecting: tokio::sync::Mutex::new(()),
                closed: AtomicBool::new(false),
            }),
        })
    }
}

impl Publisher {
    /// Settings: the broker URLs, the connection's name, the timeout.
    pub fn builder() -> PublisherBuilder {
        PublisherBuilder { amqp_url: None, name: "publisher".into(), timeout: DEFAULT_TIMEOUT }
    }

    /// Connects to `urls` (one URL or several, comma-separated) with the default
    /// settings.
    ///
    /// # Errors
    /// As [`PublisherBuilder::connect`].
    pub async fn connect(urls: &str) -> Result<Self, Error> {
        Self::builder().amqp_url(urls).connect().await
    }

    /// Publishes `message` as JSON where its type says ([`Message`]: `#[derive(idemq::Message)]`
    /// with `#[message(exchange = "...", routing_key = "...")]`), and returns its
    /// message id (random, 32 hex digits) once the broker confirmed it.
    ///
    /// # Errors
    /// See [`publish_all`](Self::publish_all).
    pub async fn send<M: Message>(&self, message: &M) -> Result<String, PublishError> {
        self.publish_outgoing(Outgoing::of(message)?).await
    }

    /// Publishes `message` as JSON to `exchange` with `routing_key`, and returns its
    /// message id once the broker confirmed it.
    ///
    /// # Errors
    /// See [`publish_all`](Self::publish_all).
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &T,
    ) -> Result<String, PublishError> {
        self.publish_outgoing(Outgoing::json(exchange, routing_key, message)?).await
    }

    /// Publishes a message built with [`Outgoing`] (any body, properties, headers),
    /// and returns its message id — the one it was given, or a random one — once the
    /// broker confirmed it.
    ///
    /// # Errors
    /// See [`publish_all`](Self::publish_all).
    pub fn publish_outgoing(&self, outgoing: Outgoing) -> BoxFuture<'_, Result<String, PublishError>> {
        Box::pin(async move {
            let mut ids = self.publish_all([outgoing]).await?;
            Ok(ids.pop().unwrap_or_default())
        })
    }

    /// Publishes every message at once, pipelined (their confirms awaited together),
    /// and returns their message ids, in order, once the broker confirmed them all.
    ///
    /// # Errors
    /// - [`PublishError::Unroutable`]: no queue takes one of them (returned);
    /// - [`PublishError::NoExchange`]: one's exchange does not exist;
    /// - [`PublishError::Unconfirmed`]: not confirmed within the timeout;
    /// - [`PublishError::Connect`]: the broker refuses the connection for good;
    /// - [`PublishError::Closed`], and the checks of [`Outgoing`].
    ///
    /// On an error the others may have been published: publishing the batch again is
    /// safe for consumers keyed on the message ids if each was given one
    /// ([`Outgoing::message_id`]).
    pub fn publish_all(
        &self,
        messages: impl IntoIterator<Item = Outgoing>,
    ) -> BoxFuture<'_, Result<Vec<String>, PublishError>> {
        self.publish_prepared(messages.into_iter().map(prepare).collect())
    }

    /// [`publish_all`](Self::publish_all) past its one generic step: idemq's code,
    /// compiled once in idemq rather than in each crate that publishes.
    fn publish_prepared(
        &self,
        prepared: Result<Vec<Prepared>, PublishError>,
    ) -> BoxFuture<'_, Result<Vec<String>, PublishError>> {
        Box::pin(async move {
            let prepared = prepared?;
            self.deliver(&prepared).await?;
            Ok(prepared.into_iter().map(|message| message.id).collect())
        })
    }

    /// Closes the connection; every later call fails with [`PublishError::Closed`].
    pub fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.shared.closed.store(true, Ordering::Relaxed);
            let link = self.shared.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            if let Some(link) = link {
                link.break_off();
                link.close("closed").await;
            }
        })
    }

    /// Publishes `messages` until each is confirmed, one is refused, or the deadline.
    async fn deliver(&self, messages: &[Prepared]) -> Result<(), PublishError> {
        let started = Instant::now();
        let deadline = started + self.shared.timeout;
        let mut pending: Vec<usize> = (0..messages.len()).collect();
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        while !pending.is_empty() {
            let reason = match self.link(deadline).await? {
                Ok(link) => {
                    let round = link.publish(messages, &pending, deadline).await;
                    if let Some(refused) = round.refused {
                        return Err(refused);
                    }
                    pending = round.retry;
                    let Some(fault) = round.fault else { continue };
                    let reason = fault.to_string();
                    self.discard(&link, &reason).await;
                    reason
                }
                Err(reason) => reason,
            };
            self.wait(&mut backoff, deadline, started, reason).await?;
        }
        Ok(())
    }

    /// Waits before the next attempt, or fails if the deadline comes first.
    async fn wait(
        &self,
        backoff: &mut Backoff,
        deadline: Instant,
        started: Instant,
        reason: String,
    ) -> Result<(), PublishError> {
        let delay = backoff.next_delay();
        if Instant::now() + delay >= deadline {
            return Err(PublishError::Unconfirmed { after: started.elapsed(), reason });
        }
        crate::base::log::debug!(%reason, delay = %crate::base::duration::human(delay), "publisher: publishing again on a new connection");
        tokio::time::sleep(delay).await;
        Ok(())
    }

    /// The link in use, or a new one. `Ok(Err(reason))`: none could be made now
    /// (worth another try); `Err`: closed, or refused for good.
    async fn link(&self, deadline: Instant) -> Result<Result<Arc<Link>, String>, PublishError> {
        if let Some(link) = self.usable()? {
            return Ok(Ok(link));
        }
        let Ok(_one_at_a_time) = tokio::time::timeout_at(deadline, self.shared.connecting.lock()).await
        else {
            return Ok(Err("connecting to RabbitMQ took too long".into()));
        };
        if let Some(link) = self.usable()? {
            return Ok(Ok(link));
        }
        // A link that went without a fault seen here (closed by the broker while
        // idle): the next connection starts at the next address too.
        let stale = self.shared.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(stale) = stale.filter(|stale| stale.break_off()) {
            self.shared.brokers.lost(stale.node);
        }
        let connect = Link::connect(&self.shared.brokers, &self.shared.role);
        match tokio::time::timeout_at(deadline, connect).await {
            Ok(Ok(link)) => {
                let link = Arc::new(link);
                crate::base::log::info!(node = link.node, "publisher: connected to RabbitMQ again");
                *self.shared.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                    Some(Arc::clone(&link));
                Ok(Ok(link))
            }
            Ok(Err(err)) if !brokers::unreachable(&err) => Err(PublishError::Connect(Box::new(err))),
            Ok(Err(err)) => Ok(Err(err.report())),
            Err(_) => Ok(Err("connecting to RabbitMQ took too long".into())),
        }
    }

    /// The current link if it can still be used.
    fn usable(&self) -> Result<Option<Arc<Link>>, PublishError> {
        if self.shared.closed.load(Ordering::Relaxed) {
            return Err(PublishError::Closed);
        }
        let current = self.shared.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(current.as_ref().filter(|link| link.usable()).cloned())
    }

    /// Gives up on `link` after `fault`: the first to see it closes it, and the next
    /// connection starts at the next address.
    async fn discard(&self, link: &Arc<Link>, reason: &str) {
        if link.break_off() {
            crate::base::log::warn!(%reason, "publisher: what was not confirmed is published again on a new connection");
            self.shared.brokers.lost(link.node);
            link.close("reconnecting").await;
        }
    }
}

/// `outgoing` with its message id (given, or random) and the properties it is
/// published with (persistent).
fn prepare(outgoing: Outgoing) -> Result<Prepared, PublishError> {
    outgoing.validate()?;
    if outgoing.due.is_some() {
        return Err(PublishError::Scheduled);
    }
    let id = outgoing.message_id.clone().unwrap_or_else(crate::base::random_id);
    let properties = outgoing.properties(&id);
    Ok(Prepared {
        exchange: outgoing.exchange,
        routing_key: outgoing.routing_key,
        body: outgoing.body,
        properties,
        id,
    })
}
