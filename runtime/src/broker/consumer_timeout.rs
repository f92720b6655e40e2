//! RabbitMQ's `consumer_timeout`: how long a delivery may stay unacknowledged
//! before the broker closes its channel (30 min by default; on 3.10 a node setting
//! in `rabbitmq.conf`, checked on each channel's tick, once a minute by default).
//!
//! Two halves. Before anything connects, [`check`] refuses a configuration whose
//! own settings can hold a delivery that long (the rule is on
//! [`RuntimeBuilder::consumer_timeout`](crate::RuntimeBuilder::consumer_timeout)).
//! While running, a channel the broker closes for it is recognised
//! ([`is_delivery_timeout`]) and said so, with what to look at: the session ends
//! and the runtime reconnects like after any loss; what was in flight on the channel
//! returns to the queue, and a transaction that commits after the channel died is
//! found by its dedup row when the message comes back (a duplicate, acked).

use std::time::Duration;

use crate::error::Error;

/// RabbitMQ's default `consumer_timeout`.
pub(crate) const DEFAULT: Duration = Duration::from_secs(30 * 60);

/// What one attempt needs beyond its handler — the pool's checkout and connection
/// set-up, BEGIN and the dedup insert, the results, the checked COMMIT, the ack —
/// and a shutdown beyond its deadline (closing channels and connections).
pub(crate) const MARGIN: Duration = Duration::from_secs(60);

/// The settings that decide how long idemq may hold a delivery unacknowledged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holding {
    pub(crate) handler_timeout: Duration,
    pub(crate) database_retry_limit: Duration,
    pub(crate) shutdown_deadline: Duration,
}

impl Holding {
    /// The longest a delivery may be held while running: its last database retry
    /// may start just before `database_retry_limit` (counted from its receipt) and
    /// run a handler for `handler_timeout`; before it, it may wait one handler's
    /// time for its turn (a redelivered message runs alone, after the transactions
    /// running when it arrived; a lane's delivery after its pipeline's batch).
    pub(crate) fn running(&self) -> Duration {
        self.database_retry_limit
            .saturating_add(self.handler_timeout.saturating_mul(2))
            .saturating_add(MARGIN)
    }

    /// The longest a delivery may be held at shutdown: one taken just before it
    /// runs for the whole deadline while the connections stay open.
    pub(crate) fn shutting_down(&self) -> Duration {
        self.shutdown_deadline.saturating_add(MARGIN)
    }
}

/// Refuses `holding` if it can hold a delivery past `consumer_timeout`, naming the
/// settings and the fix.
///
/// # Errors
/// [`Error::Config`].
pub(crate) fn check(holding: Holding, consumer_timeout: Duration) -> Result<(), Error> {
    if consumer_timeout.is_zero() {
        return Err(Error::Config(
            "consumer_timeout must be longer than zero; for a broker whose consumer timeout is \
             turned off give Duration::MAX (`--consumer-timeout off`)"
                .into(),
        ));
    }
    let tell = "or, if the broker's consumer_timeout is longer (rabbitmq.conf: consumer_timeout = <ms>), \
                tell idemq with `.consumer_timeout(..)` (`--consumer-timeout`, IDEMQ_CONSUMER_TIMEOUT)";
    let running = holding.running();
    if running > consumer_timeout {
        let Holding { handler_timeout, database_retry_limit, .. } = holding;
        let spare = consumer_timeout.saturating_sub(MARGIN);
        let limit_room = spare.saturating_sub(handler_timeout.saturating_mul(2));
        let handler_room = spare.saturating_sub(database_retry_limit) / 2;
        let fix = if !limit_room.is_zero() {
            format!("lower database_retry_limit to {} or less (or handler_timeout)", show(limit_room))
        } else if !handler_room.is_zero() {
            format!("lower handler_timeout to {} or less (or database_retry_limit)", show(handler_room))
        } else {
            format!(
                "lower handler_timeout and database_retry_limit until the limit plus twice the timeout fit in {}",
                show(spare)
            )
        };
        return Err(Error::Config(format!(
            "handler_timeout ({}) and database_retry_limit ({}) can hold a delivery unacknowledged for up to {} \
             (database_retry_limit + 2 × handler_timeout + {}), longer than the broker's consumer_timeout ({}), \
             after which RabbitMQ closes the channel and redelivers everything on it. Fix: {fix}, {tell}",
            show(handler_timeout),
            show(database_retry_limit),
            show(running),
            show(MARGIN),
            show(consumer_timeout),
        )));
    }
    if holding.shutting_down() > consumer_timeout {
        return Err(Error::Config(format!(
            "shutdown_deadline ({}) can hold a delivery unacknowledged for up to {} (shutdown_deadline + {}), \
             longer than the broker's consumer_timeout ({}): a slow shutdown would end in the broker closing \
             the channel. Fix: lower shutdown_deadline to {} or less, {tell}",
            show(holding.shutdown_deadline),
            show(holding.shutting_down()),
            show(MARGIN),
            show(consumer_timeout),
            show(consumer_timeout.saturating_sub(MARGIN)),
        )));
    }
    Ok(())
}

/// A duration as people write it (`25m`, `1h 30m`, `90s`), `Duration::MAX` as
/// "unlimited".
fn show(duration: Duration) -> String {
    if duration >= Duration::from_secs(u64::from(u32::MAX)) {
        return "unlimited".to_owned();
    }
    crate::base::duration::human(Duration::from_secs(duration.as_secs())).to_string()
}

/// Whether the broker closed a channel because a delivery on it was not
/// acknowledged within its `consumer_timeout`: 406 PRECONDITION_FAILED "delivery
/// acknowledgement on channel N timed out". The code alone is shared with other
/// refusals, so the broker's words are read (RabbitMQ has sent these since 3.8).
pub(crate) fn is_delivery_timeout(err: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match err.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
                && amqp.get_message().as_str().contains("delivery acknowledgement")
        }
        _ => false,
    }
}

/// How a channel closed for a delivery timeout is described (the reason of the
/// lost session, in the log and in `ConnectionEvent::Lost`): this, then the
/// broker's words.
pub(crate) const DESCRIBED: &str =
    "the broker's consumer_timeout expired (a delivery was not acknowledged in time)";

/// What a delivery timeout means and where to look, for the log line.
pub(crate) const EXPLAINED: &str = "the broker closed the channel: a delivery stayed unacknowledged past the \
     broker's consumer_timeout. The runtime reconnects; deliveries in flight return to the queue, and an effect \
     that commits late is acked as a duplicate when its message comes back. What held it that long: a handler \
     (handler_timeout; slow handlers in large batches run one after another: lower batch_size), a database \
     outage (database_retry_limit) or a slow shutdown (shutdown_deadline); keep them within the broker's \
     consumer_timeout (RuntimeBuilder::consumer_timeout / IDEMQ_CONSUMER_TIMEOUT tells idemq its value), or \
     raise it on the broker";

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(handler_timeout: u64, database_retry_limit: u64, shutdown_deadline: u64) -> Holding {
        Holding {
            handler_timeout: Duration::from_secs(handler_timeout),
            database_retry_limit: Duration::from_secs(database_retry_limit),
            shutdown_deadline: Duration::from_secs(shutdown_deadline),
        }
    }

    #[test]
    fn the_defaults_fit_rabbitmqs_default() {
        // 60 s, 25 min, 10 s: 25 min + 2 min + 1 min = 28 min.
        assert!(check(holding(60, 25 * 60, 10), DEFAULT).is_ok());
        assert_eq!(holding(60, 25 * 60, 10).running(), Duration::from_secs(28 * 60));
    }

    #[test]
    fn a_retry_limit_past_the_timeout_is_refused_naming_the_settings_and_the_fix() {
        let err = check(holding(60, 29 * 60, 10), DEFAULT).expect_err("29 min + 3 min > 30 min").to_string();
        for words in
            ["database_retry_limit (29m)", "handler_timeout (1m)", "consumer_timeout (30m)", "27m or less"]
        {
            assert!(err.contains(words), "{words}: {err}");
        }
        let err = check(holding(20 * 60, 60, 10), DEFAULT).expect_err("2 × 20 min").to_string();
        assert!(err.contains("lower handler_timeout to 14m or less"), "{err}");
    }

    #[test]
    fn a_shutdown_deadline_past_the_timeout_is_refused() {
        let err = check(holding(1, 1, 30 * 60), DEFAULT).expect_err("30 min + 1 min").to_string();
        assert!(err.contains("shutdown_deadline (30m)") && err.contains("29m or less"), "{err}");
    }

    #[test]
    fn the_limit_is_whatever_the_broker_is_set_to() {
        assert!(check(holding(60, 25 * 60, 10), Duration::from_secs(20 * 60)).is_err());
        assert!(check(holding(60, 25 * 60, 10), Duration::from_secs(3600)).is_ok());
        assert!(check(holding(u64::MAX, u64::MAX, u64::MAX), Duration::MAX).is_ok(), "no overflow");
        assert!(check(holding(60, 60, 10), Duration::ZERO).is_err());
    }

    #[test]
    fn the_brokers_delivery_timeout_is_told_from_other_preconditions() {
        use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
        let closed = |message: &str| {
            lapin::Error::from(lapin::ErrorKind::ProtocolError(AMQPError::new(
                AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
                message.into(),
            )))
        };
        assert!(is_delivery_timeout(&closed(
            "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value used: 5000 ms. \
             This timeout value can be configured, see consumers doc guide to learn more"
        )));
        assert!(!is_delivery_timeout(&closed("PRECONDITION_FAILED - unknown delivery tag 7")));
    }
}
