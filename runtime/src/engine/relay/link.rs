//! The relay's broker link: its connection, its publishing channel in confirm mode,
//! and the exchanges it has seen exist.

use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
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
            Ok(Self { connection, node, channel, exchanges: KnownExchanges::default() })
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
        tracing::debug!("outbox relay: publishes were nacked; publishing on a fresh channel");
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
