//! The pure layer: decisions, values and policies, no I/O. Everything above may use
//! it; it uses nothing of idemq's but [`crate::error`] and [`crate::config`].

pub(crate) mod amqp_value;
pub(crate) mod backoff;
pub(crate) mod observe;
pub(crate) mod outcome;
pub(crate) mod redact;
pub(crate) mod retry;
pub(crate) mod verdict;
pub(crate) mod width;
