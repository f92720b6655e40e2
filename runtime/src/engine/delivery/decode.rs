//! Decoding, before anything touches the database: each delivery's body to its
//! message and key ([`Consumer::prepare`]: too large, not JSON, the wrong shape, no
//! key or an unknown content type is a [`Rejection`], and a panicking `Deserialize`
//! impl or key is one too). A rejected delivery is dead-lettered — unless it runs
//! alone: a redelivered message's copy may already be confirmed, which `alone`
//! checks first.

use std::panic::AssertUnwindSafe;

use lapin::message::Delivery;

use super::faults::panic_message;
use super::tx::Ran;
use super::{Consumer, Decision, Delivered};
use crate::base::outcome::{FailureKind, Outcome};
use crate::handler::prepare::{Prepared, Rejection};

/// A run's deliveries, decoded.
pub(super) struct Decoded {
    /// (Index in the batch, message and key), in arrival order.
    pub(super) runnable: Vec<(usize, Prepared)>,
    /// The rejection of a message run alone (decided after its copy check).
    pub(super) rejected: Option<Rejection>,
}

impl Consumer {
    /// Decodes `part` (indices into `items`; a delivery decoded at intake, for its
    /// lane, is taken from `prepared`). Rejections are decided in `ran` as dead
    /// letters, but for a delivery that runs `alone`.
    pub(super) fn decode(
        &self,
        items: &[Delivered],
        part: &[usize],
        prepared: &mut [Option<Result<Prepared, Rejection>>],
        alone: bool,
        ran: &mut Ran,
    ) -> Decoded {
        let mut decoded = Decoded { runnable: Vec::with_capacity(part.len()), rejected: None };
        for &index in part {
            match prepared[index].take().unwrap_or_else(|| self.prepare(&items[index].delivery)) {
                Ok(prepared) => decoded.runnable.push((index, prepared)),
                // A redelivered message's copy may exist: check that first.
                Err(rejection) if alone => decoded.rejected = Some(rejection),
                Err(rejection) => {
                    let outcome = Outcome::DeadLettered { kind: rejection.kind, error: rejection.message };
                    ran.decided.push((index, Decision::new(outcome)));
                }
            }
        }
        decoded
    }

    /// Decodes the body; a panicking `Deserialize` impl or key is a decode failure.
    pub(crate) fn prepare(&self, delivery: &Delivery) -> Result<Prepared, Rejection> {
        let prepare = || self.handler.prepare(&delivery.data, &delivery.properties, self.shared.limits);
        std::panic::catch_unwind(AssertUnwindSafe(prepare)).unwrap_or_else(|panic| {
            Err(Rejection {
                kind: FailureKind::Decode,
                message: format!(
                    "decoding the message or reading its key panicked: {}",
                    panic_message(&*panic)
                ),
            })
        })
    }
}
