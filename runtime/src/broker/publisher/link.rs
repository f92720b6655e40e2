//! The publisher's broker link: one connection, one channel in confirm mode that
//! publishes and consumes RabbitMQ's direct reply-to, and the replies awaited on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::base::outgoing::PublishError;
use crate::broker::brokers::Brokers;
use crate::broker::exchanges::KnownExchanges;
use crate::error::{redact, Error};

/// RabbitMQ's direct reply-to pseudo-queue: consumed (without acks) on the channel
/// that publishes the requests, it receives their replies with no queue declared.
pub(super) const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// How long closing a connection may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A message ready to publish.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) exchange: String,
    pub(super) routing_key: String,
    pub(super) body: Vec<u8>,
    pub(super) properties: BasicProperties,
    /// Its `message_id`: the one given, or a random one, the same on every re-send.
    pub(super) id: String,
}

/// Why a round left messages unconfirmed: the link is done for (closed by the
/// caller, then replaced).
#[derive(Debug)]
pub(super) enum Fault {
    /// The channel or connection failed under the publishes.
    Lost(lapin::Error),
    /// The broker nacked: it could not take them (on this channel).
    Nacked,
    /// No confirm before the deadline.
    Silent,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lost(source) => {
                write!(f, "the connection to RabbitMQ failed: {}", redact(&source.to_string()))
            }
            Self::Nacked => f.write_str("the broker nacked it (it could not take it)"),
            Self::Silent => f.write_str("the broker did not answer"),
        }
    }
}

/// What one round of publishing on a link came to.
#[derive(Debug, Default)]
pub(super) struct Round {
    /// Messages left unconfirmed, to publish again on a new link.
    pub(super) retry: Vec<usize>,
    /// The first message the broker refused for good.
    pub(super) refused: Option<PublishError>,
    /// Why messages were left unconfirmed.
    pub(super) fault: Option<Fault>,
}

/// Requests waiting for their replies, by correlation id; `None` once the link's
/// reply consumer ended (its waiters learn it by their sender being dropped).
type Waiting = Mutex<Option<HashMap<String, oneshot::Sender<Delivery>>>>;

/// One connection and its channel.
pub(super) struct Link {
    pub(super) connection: Connection,
    /// The broker address it is connected to.
    pub(super) node: usize,
    channel: Channel,
    exchanges: tokio::sync::Mutex<KnownExchanges>,
    waiting: Arc<Waiting>,
    /// Set once a fault was seen on it: it is replaced, never used again.
    broken: AtomicBool,
    /// Stops the reply consumer when the link goes.
    _replies: DropGuard,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("node", &self.node).field("broken", &self.broken).finish_non_exhaustive()
    }
}

impl Link {
    /// Connects to the next of `brokers` that answers, selects confirms and starts
    /// consuming direct reply-to.
    ///
    /// # Errors
    /// [`Error::AmqpConnect`], [`Error::Tls`], or [`Error::Amqp`] for a channel the
    /// new connection could not open.
    pub(super) async fn connect(brokers: &Brokers, role: &str) -> Result<Self, Error> {
        let (connection, node) = brokers.connect(role).await?;
        let amqp = |action: &str| {
            let action = action.to_owned();
            move |source| Error::Amqp { action, source }
        };
        let channel = connection.create_channel().await.map_err(amqp("open the publisher's channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp("select publisher confirms"))?;
        let consumer = channel
            .basic_consume(
                DIRECT_REPLY_TO.into(),
                "idemq-replies".into(),
                BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() },
                FieldTable::default(),
            )
            .await
            .map_err(amqp("consume direct reply-to (amq.rabbitmq.reply-to)"))?;
        let waiting: Arc<Waiting> = Arc::new(Mutex::new(Some(HashMap::new())));
        let stop = CancellationToken::new();
        tokio::spawn(route_replies(consumer, Arc::clone(&waiting), stop.clone()));
        Ok(Self {
            connection,
            node,
            channel,
            exchanges: tokio::sync::Mutex::new(KnownExchanges::default()),
            waiting,
            broken: AtomicBool::new(false),
            _replies: stop.drop_guard(),
        })
    }

    /// Whether it can still be used.
    pub(super) fn usable(&self) -> bool {
        !self.broken.load(Ordering::Relaxed) && self.channel.status().connected()
    }

    /// Marks it done for. `true` for the first caller, who closes it.
    pub(super) fn break_off(&self) -> bool {
        !self.broken.swap(true, Ordering::Relaxed)
    }

    /// Closes the connection (bounded).
    pub(super) async fn close(&self, reason: &str) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.connection.close(200, reason.into())).await;
    }

    /// Registers a request's correlation id before it is published: its reply, or
    /// the sender dropped when the link goes (then: publish it again elsewhere).
    pub(super) fn expect_reply(&self, correlation_id: &str) -> Expected {
        let (sender, receiver) = oneshot::channel();
        if let Some(waiting) = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut()
        {
            waiting.insert(correlation_id.to_owned(), sender);
        }
        Expected { receiver, waiting: Arc::clone(&self.waiting), correlation_id: correlation_id.to_owned() }
    }

    /// Publishes `messages[pending]` pipelined (`mandatory`), awaits their confirms
    /// until `deadline`, and says what came of each.
    ///
    /// Exchanges are checked first (passively, once per connection): a publish to a
    /// missing one would close the channel under every publish in flight on it.
    pub(super) async fn publish(&self, messages: &[Prepared], pending: &[usize], deadline: Instant) -> Round {
        let mut round = Round::default();
        {
            let mut exchanges = self.exchanges.lock().await;
            for &index in pending {
                let exchange = &messages[index].exchange;
                match tokio::time::timeout_at(deadline, exchanges.exists(&self.connection, exchange)).await {
                    Ok(Ok(true)) => {}
                    Ok(Ok(false)) => {
                        round.refused = Some(PublishError::NoExchange { exchange: exchange.clone() });
                        return round;
                    }
                    Ok(Err(source)) => return Round::unconfirmed(pending, Fault::Lost(source)),
                    Err(_) => return Round::unconfirmed(pending, Fault::Silent),
                }
            }
        }
        // Every publish handed to lapin at once: one wake-up of its I/O loop writes
        // them all (awaited one by one, each would cost one).
        let publishes = pending.iter().map(|&index| {
            let message = &messages[index];
            self.channel.basic_publish(
                message.exchange.as_str().into(),
                message.routing_key.as_str().into(),
                BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                &message.body,
                message.properties.clone(),
            )
        });
        let published = futures_util::future::join_all(publishes).await;
        let mut confirms = Vec::with_capacity(published.len());
        for (&index, published) in pending.iter().zip(published) {
            match published {
                Ok(confirm) => confirms.push((index, confirm)),
                Err(source) => round.left(index, Fault::Lost(source)),
            }
        }
        for (index, confirm) in confirms {
            match tokio::time::timeout_at(deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => {}
                Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => {
                    let message = &messages[index];
                    round.refused.get_or_insert(PublishError::Unroutable {
                        exchange: message.exchange.clone(),
                        routing_key: message.routing_key.clone(),
                    });
                }
                Ok(Ok(Confirmation::Nack(None))) => round.left(index, Fault::Nacked),
                Ok(Err(source)) => round.left(index, Fault::Lost(source)),
                Err(_) => round.left(index, Fault::Silent),
            }
        }
        round
    }
}

impl Round {
    fn unconfirmed(pending: &[usize], fault: Fault) -> Self {
        Self { retry: pending.to_vec(), refused: None, fault: Some(fault) }
    }

    fn left(&mut self, index: usize, fault: Fault) {
        self.retry.push(index);
        self.fault.get_or_insert(fault);
    }
}

/// A reply awaited; dropped, it is no longer awaited.
pub(super) struct Expected {
    pub(super) receiver: oneshot::Receiver<Delivery>,
    waiting: Arc<Waiting>,
    correlation_id: String,
}

impl Drop for Expected {
    fn drop(&mut self) {
        if let Some(waiting) = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut()
        {
            waiting.remove(&self.correlation_id);
        }
    }
}

/// Hands each reply to the request waiting for its correlation id, until the
/// channel goes or the link is dropped; then every waiter learns it.
async fn route_replies(mut consumer: lapin::Consumer, waiting: Arc<Waiting>, stop: CancellationToken) {
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            delivery = consumer.next() => delivery,
        };
        let Some(Ok(delivery)) = delivery else { break };
        let correlation_id = delivery.properties.correlation_id().as_ref().map(|id| id.as_str().to_owned());
        let sender = correlation_id.as_deref().and_then(|id| {
            waiting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_mut()
                .and_then(|w| w.remove(id))
        });
        match sender {
            Some(sender) => {
                let _ = sender.send(delivery);
            }
            // Its requester stopped waiting (timed out), or answered twice.
            None => crate::base::log::debug!(?correlation_id, "publisher: a reply nobody waits for; dropped"),
        }
    }
    // Dropping the senders tells each waiter its reply will not come on this link.
    waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
}
