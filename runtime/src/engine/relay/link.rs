//! The relay's broker link: its connection, its publishing channel in confirm mode,
//! the exchanges it has seen exist, and whether a direct reply-to requester is there.

use std::time::Duration;

use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::broker::brokers::Brokers;
use crate::broker::exchanges::KnownExchanges;

use super::error::RelayError;

/// How long connecting and opening the publishing channel may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long closing a channel or connection may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The relay's broker connection and what it learned on it.
pub(super) struct Link {
    pub(super) connection: Connection,
    /// The broker address it is connected to.
    pub(super) node: usize,
    pub(super) channel: Channel,
    /// Exchanges known to exist on this connection.
    exchanges: KnownExchanges,
    /// For [`Link::requester_present`]'s passive declares (a 404 closes it; the next
    /// check opens another).
    requesters: Option<Channel>,
}

/// A channel on `connection` in confirm mode, for publishing.
async fn confirm_channel(connection: &Connection) -> Result<Channel, RelayError> {
    let channel = connection.create_channel().await.map_err(RelayError::broker("open a channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(RelayError::broker("select confirms"))?;
    Ok(channel)
}

impl Link {
    /// Connects to the next of `brokers` and opens the publishing channel, in at most
    /// [`CONNECT_TIMEOUT`].
    pub(super) async fn connect(brokers: &Brokers) -> Result<Self, RelayError> {
        let connect = async {
            let (connection, node) = brokers.connect("relay").await.map_err(RelayError::Connect)?;
            let channel = confirm_channel(&connection).await?;
            Ok(Self { connection, node, channel, exchanges: KnownExchanges::default(), requesters: None })
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .unwrap_or(Err(RelayError::ConnectTimeout(CONNECT_TIMEOUT)))
    }

    /// Replaces the publishing channel with a fresh one in confirm mode; the old one
    /// is closed (bounded). `Err`: the connection failed.
    pub(super) async fn reopen_channel(&mut self) -> Result<(), RelayError> {
        let channel = confirm_channel(&self.connection).await?;
        let old = std::mem::replace(&mut self.channel, channel);
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, old.close(200, "nacked: reopening".into())).await;
        crate::base::log::debug!("outbox relay: publishes were nacked; publishing on a fresh channel");
        Ok(())
    }

    /// Whether `exchange` exists (the default exchange always does), checked passively
    /// on a probe channel once per connection. `Err`: the connection failed.
    pub(super) async fn exchange_exists(&mut self, exchange: &str) -> Result<bool, RelayError> {
        self.exchanges
            .exists(&self.connection, exchange)
            .await
            .map_err(RelayError::broker("check that an exchange exists"))
    }

    /// Whether the requester behind a direct reply-to address
    /// (`amq.rabbitmq.reply-to.…`) is still there: a passive declare of the address,
    /// on a probe channel of its own, which RabbitMQ answers (3.x and 4.x alike) with
    /// one consumer while the requester's channel lives, and 404 once it is gone.
    ///
    /// The broker's routing cannot say it: a reply published to a requester that is
    /// gone is confirmed and dropped without `mandatory`; with it, 3.x returns every
    /// such reply (312, there or not) and 4.2 and later none (the address counts as a
    /// queue). An answer other than 404 (the broker refusing the check itself) says
    /// nothing: `Ok(true)`, the reply is published as before. `Err`: the connection
    /// failed.
    pub(super) async fn requester_present(&mut self, reply_to: &str) -> Result<bool, RelayError> {
        let probe = match &self.requesters {
            Some(probe) if probe.status().connected() => probe.clone(),
            _ => {
                let probe = self
                    .connection
                    .create_channel()
                    .await
                    .map_err(RelayError::broker("open a channel to check a requester"))?;
                self.requesters = Some(probe.clone());
                probe
            }
        };
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        match probe.queue_declare(reply_to.into(), passive, FieldTable::default()).await {
            Ok(_) => Ok(true),
            Err(source) if !self.connection.status().connected() => {
                Err(RelayError::Broker { action: "check a requester", source })
            }
            Err(source) => {
                // The refusal closed the probe channel.
                self.requesters = None;
                Ok(!is_not_found(&source))
            }
        }
    }

    /// Closes the connection (bounded), after a fault: nothing is left to flush.
    pub(super) async fn drop_connection(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.connection.close(200, "reconnecting".into())).await;
    }

    /// Closes the channel, then the connection (each bounded), at shutdown.
    pub(super) async fn close(self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.channel.close(200, "shutdown".into())).await;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.connection.close(200, "shutdown".into())).await;
    }
}

/// Whether the broker answered 404 NOT_FOUND.
fn is_not_found(error: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
}
