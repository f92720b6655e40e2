//! The point where a test's fault hook runs, inert unless one is set: the hooks stage
//! the failures that nothing outside the runtime can reach, such as losing the ack
//! after COMMIT. They are the test kit's (`idemq::testing::fault`, `FaultHookExt::
//! fault_hook` in the crate `idemq-testing`), which sets one through
//! `__private::sibling`; the engine has no way to install one of its own, and none
//! is set in a production build.

use std::sync::Arc;

use crate::base::outcome::Outcome;
use crate::handler::BoxFuture;

/// Where in a delivery's life the hook runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultPoint {
    /// The transaction committed (or found a duplicate); the ack is not yet sent.
    AfterCommit,
    /// A copy (retry or dead letter) was confirmed and recorded; the original is not
    /// yet acked.
    AfterCopy,
    /// A copy (retry or dead letter) is about to be published on the
    /// [`publisher`](FaultContext::publisher) channel.
    BeforeCopy,
}

/// What the hook sees.
#[derive(Debug)]
#[non_exhaustive]
pub struct FaultContext {
    /// The point reached.
    pub point: FaultPoint,
    /// The consumer's channel: close it to lose the ack.
    pub channel: lapin::Channel,
    /// The channel copies are published on: close it to lose the copies.
    pub publisher: lapin::Channel,
    /// The delivery's key.
    pub key: Option<String>,
    /// The outcome decided so far.
    pub outcome: Outcome,
}

/// A hook run at every [`FaultPoint`]; it may close the channel, sleep or abort.
pub type FaultHook = Arc<dyn Fn(FaultContext) -> BoxFuture<'static, ()> + Send + Sync>;
