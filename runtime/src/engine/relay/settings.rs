//! What a relay's loop needs besides its connections, and its checks.

use std::time::Duration;

use crate::error::Error;

/// How long a reply may wait in the outbox by default (see
/// [`RelayBuilder::reply_ttl`](super::RelayBuilder::reply_ttl)).
const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(3600);

/// What a relay's loop needs besides its connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) poll_interval: Duration,
    pub(crate) batch_size: usize,
    pub(crate) max_backoff: Duration,
    /// How long a reply row may wait before it is deleted unpublished.
    pub(crate) reply_ttl: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 512,
            max_backoff: Duration::from_secs(60),
            reply_ttl: DEFAULT_REPLY_TTL,
        }
    }
}

impl Settings {
    /// Refuses what the relay's loop cannot run with.
    pub(super) fn check(&self) -> Result<(), Error> {
        if self.batch_size == 0 {
            return Err(Error::Config(
                "the relay's batch_size must be at least 1, not 0: give `.batch_size(1)` or more (default 512)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Sets the reply TTL, at least [`MIN_REPLY_WINDOW`](crate::base::outgoing::MIN_REPLY_WINDOW).
    pub(crate) fn set_reply_ttl(&mut self, ttl: Duration) {
        self.reply_ttl = ttl.max(crate::base::outgoing::MIN_REPLY_WINDOW);
    }
}
