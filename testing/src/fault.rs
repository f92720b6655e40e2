//! Test-only fault hooks (feature `testing`, at `idemq::testing::fault`): stage the
//! failures that nothing outside the runtime can reach, such as losing the ack after
//! COMMIT. Install one with [`FaultHookExt::fault_hook`].
//!
//! Never enable `testing` in production builds: take it as a dev-dependency, whose
//! features are not unified into the binaries you ship. The runtime itself only has
//! the point where a hook runs, inert unless this crate sets one.

pub use idemq_core::__private::sibling::{FaultContext, FaultHook, FaultPoint};

/// Installs a test-only fault hook on a [`RuntimeBuilder`](idemq_core::RuntimeBuilder):
/// `use idemq::testing::fault::FaultHookExt;`, then `.fault_hook(hook)`.
pub trait FaultHookExt: Sized {
    /// Runs `hook` at every [`FaultPoint`] of every delivery the runtime settles.
    #[must_use = "the builder with the hook is returned; build and run it"]
    fn fault_hook(self, hook: FaultHook) -> Self;
}

impl FaultHookExt for idemq_core::RuntimeBuilder {
    fn fault_hook(self, hook: FaultHook) -> Self {
        idemq_core::__private::sibling::with_fault_hook(self, hook)
    }
}
