//! Which exchanges exist, asked of the broker before publishing to them.
//!
//! A publish to a missing exchange is not refused on its own: the broker closes the
//! channel (404 NOT_FOUND), and with it every publish in flight on that channel. So
//! the relay and the [`Publisher`](crate::Publisher) ask first, passively, on a
//! probe channel of their own (which the 404 closes instead), once per exchange and
//! connection.

use std::collections::HashSet;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ExchangeKind};

/// The exchanges seen to exist on one connection, and its probe channel.
#[derive(Debug, Default)]
pub(crate) struct KnownExchanges {
    /// For passive checks (a failed one closes it; the next check opens another).
    probe: Option<Channel>,
    known: HashSet<String>,
}

impl KnownExchanges {
    /// Whether `exchange` exists on `connection` (the default exchange always does).
    ///
    /// # Errors
    /// The connection failed (a 404 is `Ok(false)`, not an error).
    pub(crate) async fn exists(
        &mut self,
        connection: &Connection,
        exchange: &str,
    ) -> Result<bool, lapin::Error> {
        if exchange.is_empty() || self.known.contains(exchange) {
            return Ok(true);
        }
        let probe = match &self.probe {
            Some(probe) if probe.status().connected() => probe.clone(),
            _ => {
                let probe = connection.create_channel().await?;
                self.probe = Some(probe.clone());
                probe
            }
        };
        let passive = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
        match probe
            .exchange_declare(exchange.into(), ExchangeKind::Direct, passive, FieldTable::default())
            .await
        {
            Ok(()) => {
                self.known.insert(exchange.to_owned());
                Ok(true)
            }
            Err(_) if connection.status().connected() => {
                // 404: the probe channel is closed; the next check opens another.
                self.probe = None;
                Ok(false)
            }
            Err(source) => Err(source),
        }
    }
}
