//! The delivery state machine and what runs it: the consumer (`delivery`), broker
//! sessions, start-up, the outbox relay, stream consumers (`stream`) and the runtime
//! that supervises them.

pub(crate) mod delivery;
pub(crate) mod flow;
pub(crate) mod hook;
#[cfg(feature = "metrics")]
pub(crate) mod metrics;
#[cfg(feature = "metrics")]
pub(crate) mod pages;
pub(crate) mod relay;
pub(crate) mod runtime;
pub(crate) mod session;
pub(crate) mod startup;
pub(crate) mod stream;
