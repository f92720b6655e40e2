//! Why a session ended on its own, typed: [`Loss`]. The runtime logs it, waits on
//! it at start-up and reports it as [`ConnectionEvent::Lost`]'s `reason`, all in the
//! words of [`Loss::report`].
//!
//! [`ConnectionEvent::Lost`]: crate::base::observe::ConnectionEvent::Lost

use crate::broker::consumer_timeout;
use crate::error::Error;

/// Why a session ended, short of shutdown: the runtime reconnects (or, at start-up,
/// waits for the broker). The client's error, where there is one, is the `source`,
/// not repeated in the message: print it with [`Loss::report`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum Loss {
    /// Connecting, declaring the topology or starting the consumers failed, or took
    /// longer than the session's start may ([`Error::StartTimeout`]).
    #[error(transparent)]
    Start(Error),
    /// The broker closed a channel (or the connection) for a delivery left
    /// unacknowledged past its `consumer_timeout`; `queue` is the consumer's, when
    /// its stream said so first.
    #[error("{}{}", queue_prefix(queue.as_deref()), consumer_timeout::DESCRIBED)]
    ConsumerTimeout {
        queue: Option<String>,
        #[source]
        source: lapin::Error,
    },
    /// A consumer's stream ended with an error: its channel or connection failed.
    #[error("queue '{queue}': the consumer's channel failed")]
    Consumer {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    /// A consumer's stream ended without an error.
    #[error("queue '{queue}': the broker cancelled the consumer (queue deleted?) or the channel closed")]
    Cancelled { queue: String },
    /// A consumer waiting for a slot found its channel closed.
    #[error("queue '{queue}': the channel closed")]
    ChannelClosed { queue: String },
    /// The channel copies are published on closed (by the broker, or after a nacked
    /// copy: see `settle_copy`).
    #[error("the publishing channel closed")]
    PublishingChannelClosed,
    /// The consuming connection failed.
    #[error("the consuming connection failed")]
    ConsumingConnection(#[source] lapin::Error),
    /// The publishing connection failed.
    #[error("the publishing connection failed")]
    PublishingConnection(#[source] lapin::Error),
    /// A consumer's intake task panicked.
    #[error("a consumer task failed")]
    ConsumerTask(#[source] tokio::task::JoinError),
    /// A consumer's intake ended on the session's stop.
    #[error("stopped")]
    Stopped,
}

impl Loss {
    /// A consumer's stream of `queue` ended with `err`: a delivery timeout said as
    /// such, else the channel's failure.
    pub(super) fn of_consumer(queue: &str, err: lapin::Error) -> Self {
        let queue = queue.to_owned();
        if consumer_timeout::is_delivery_timeout(&err) {
            Self::ConsumerTimeout { queue: Some(queue), source: err }
        } else {
            Self::Consumer { queue, source: err }
        }
    }

    /// The consuming connection reported `err` (a channel the broker closes is
    /// reported there too, maybe before its consumer hears of it).
    pub(super) fn of_consuming_connection(err: lapin::Error) -> Self {
        if consumer_timeout::is_delivery_timeout(&err) {
            Self::ConsumerTimeout { queue: None, source: err }
        } else {
            Self::ConsumingConnection(err)
        }
    }

    /// The loss and its causes, each once, redacted: the `reason` the runtime logs
    /// and reports.
    pub(crate) fn report(&self) -> String {
        crate::error::report(self)
    }
}

fn queue_prefix(queue: Option<&str>) -> String {
    queue.map(|queue| format!("queue '{queue}': ")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed_by_broker(code: lapin::protocol::AMQPSoftError, text: &str) -> lapin::Error {
        lapin::Error::from(lapin::ErrorKind::ProtocolError(lapin::protocol::AMQPError::new(
            lapin::protocol::AMQPErrorKind::Soft(code),
            text.into(),
        )))
    }

    #[test]
    fn a_delivery_timeout_is_said_as_such_with_the_brokers_words_once() {
        use lapin::protocol::AMQPSoftError;
        let said = "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out";
        let loss = Loss::of_consumer("payments", closed_by_broker(AMQPSoftError::PRECONDITIONFAILED, said));
        assert!(matches!(loss, Loss::ConsumerTimeout { .. }), "{loss:?}");
        let reason = loss.report();
        assert!(reason.starts_with("queue 'payments': the broker's consumer_timeout expired"), "{reason}");
        assert_eq!(reason.matches("timed out").count(), 1, "{reason}");

        let other =
            Loss::of_consumer("payments", closed_by_broker(AMQPSoftError::NOTFOUND, "NOT_FOUND - no queue"));
        assert!(matches!(other, Loss::Consumer { .. }), "{other:?}");
        assert!(other.report().ends_with("NOT_FOUND - no queue"), "{}", other.report());
    }
}
