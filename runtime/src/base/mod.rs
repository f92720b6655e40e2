//! The pure layer: decisions, values and policies, no I/O. Everything above may use
//! it; it uses nothing of idemq's but [`crate::error`] and [`crate::config`].

pub(crate) mod amqp_value;
pub(crate) mod backoff;
pub(crate) mod duration;
pub mod headers;
pub(crate) mod log;
pub(crate) mod observe;
pub(crate) mod outcome;
pub(crate) mod outgoing;
pub(crate) mod pace;
pub(crate) mod redact;
pub(crate) mod retry;
pub(crate) mod trace;
pub(crate) mod verdict;
pub(crate) mod width;

use std::future::Future;
use std::pin::Pin;

/// A boxed, `Send` future borrowing for `'a`, as returned by
/// [`Handler::handle`](crate::handler::Handler::handle).
///
/// Public because it is part of [`Handler`](crate::handler::Handler)'s signature: a handler written by hand
/// returns one (`Box::pin(async move { … })`). It is the same type as `futures`'
/// `BoxFuture`, so either name works in an impl.
///
/// idemq's own entry points that do I/O (`Runtime::run`, the publisher, `migrate`,
/// `connect`…) return one too, rather than being `async fn`s: a future's code is
/// compiled in the crate that awaits it, and a release build shares none between
/// crates, so each application compiled idemq's runtime again, whole. Boxed, it
/// is compiled once, in idemq (`docs/performance.md`, *Build time*).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Lower-case hexadecimal of `bytes` (keys, fingerprints, lineages).
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// 32 hex digits of the operating system's randomness: an id no other process makes
/// (a message id the caller did not give).
///
/// # Panics
/// If the operating system has no randomness to give (as `uuid`'s v4 would).
pub fn random_id() -> String {
    let mut bytes = [0_u8; 16];
    getrandom::fill(&mut bytes).expect("the operating system's random number generator");
    hex(&bytes)
}

/// A saga as the AsyncAPI document shows it (see `idemq::saga`).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SagaShape {
    /// Its name.
    pub name: &'static str,
    /// The message types it takes, as its `#[saga(takes(..))]` names them.
    pub takes: &'static [&'static str],
    /// The message types it sends, as its `#[saga(sends(..))]` names them.
    pub sends: &'static [&'static str],
}
