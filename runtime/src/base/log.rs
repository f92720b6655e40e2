//! idemq's events and spans, with the targets they had before the engine became a
//! crate of its own: `idemq::engine::delivery`, not `idemq_core::engine::delivery`.
//!
//! Operators filter on them (`RUST_LOG=idemq::engine::delivery=debug`, named in log
//! lines and the guide), so the split into crates must not move them. Each macro is
//! `tracing`'s own with `target:` set to [`target!`]: the caller's `module_path!()`
//! with its first segment, `idemq_core`, written `idemq`, computed at compile time
//! (no allocation, nothing at run time). Code of this crate writes
//! `crate::base::log::warn!(..)` where it would write `tracing::warn!(..)`; the test
//! below and `examples/tests/own_subscriber.rs` check the targets.

/// The crate's name, and what its events' targets begin with instead.
const CRATE: &str = "idemq_core";
const FACADE: &str = "idemq";

/// `path` (a `module_path!()` of this crate) with `idemq_core` written `idemq`: `N`
/// is its length less the difference, 5.
pub(crate) const fn target_of<const N: usize>(path: &str) -> [u8; N] {
    let path = path.as_bytes();
    let (krate, facade) = (CRATE.as_bytes(), FACADE.as_bytes());
    assert!(path.len() == N + krate.len() - facade.len(), "a module path of idemq_core");
    let mut i = 0;
    while i < krate.len() {
        assert!(path[i] == krate[i], "a module path of idemq_core");
        i += 1;
    }
    let mut target = [0u8; N];
    let mut i = 0;
    while i < facade.len() {
        target[i] = facade[i];
        i += 1;
    }
    let mut from = krate.len();
    while from < path.len() {
        target[from - krate.len() + facade.len()] = path[from];
        from += 1;
    }
    target
}

/// The target of an event written where this macro is: `idemq::<module path>`.
macro_rules! target {
    () => {{
        const PATH: &str = ::core::module_path!();
        const BYTES: [u8; PATH.len() - 5] = $crate::base::log::target_of::<{ PATH.len() - 5 }>(PATH);
        const TARGET: &str = match ::core::str::from_utf8(&BYTES) {
            Ok(target) => target,
            Err(_) => panic!("a module path is UTF-8"),
        };
        TARGET
    }};
}

// `tracing`'s event and span macros that idemq uses, each with the target `target!`
// gives.
macro_rules! debug {
    ($($arg:tt)*) => {
        ::tracing::debug!(target: $crate::base::log::target!(), $($arg)*)
    };
}
macro_rules! info {
    ($($arg:tt)*) => {
        ::tracing::info!(target: $crate::base::log::target!(), $($arg)*)
    };
}
// Named `warn` by its re-export below: a `warn` defined here would be ambiguous with
// the built-in attribute `#[warn]` where it is re-exported.
macro_rules! warn_event {
    ($($arg:tt)*) => {
        ::tracing::warn!(target: $crate::base::log::target!(), $($arg)*)
    };
}
macro_rules! error {
    ($($arg:tt)*) => {
        ::tracing::error!(target: $crate::base::log::target!(), $($arg)*)
    };
}
macro_rules! debug_span {
    ($($arg:tt)*) => {
        ::tracing::debug_span!(target: $crate::base::log::target!(), $($arg)*)
    };
}
macro_rules! info_span {
    ($($arg:tt)*) => {
        ::tracing::info_span!(target: $crate::base::log::target!(), $($arg)*)
    };
}

pub(crate) use {debug, debug_span, error, info, info_span, target, warn_event as warn};

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::subscriber::Subscriber;
    use tracing::{span, Event, Metadata};

    #[test]
    fn the_target_is_the_module_path_under_idemq() {
        assert_eq!(super::target!(), "idemq::base::log::tests");
        const BYTES: [u8; 16] = super::target_of::<16>("idemq_core::engine::x");
        assert_eq!(&BYTES, b"idemq::engine::x");
    }

    /// The targets of the events `f` sends.
    pub(crate) fn targets_of(f: impl FnOnce()) -> Vec<String> {
        let targets = Arc::new(Mutex::new(Vec::new()));
        tracing::subscriber::with_default(Targets(Arc::clone(&targets)), f);
        let targets = targets.lock().expect("not poisoned").clone();
        targets
    }

    /// Records the targets of the events it sees.
    struct Targets(Arc<Mutex<Vec<String>>>);

    impl Subscriber for Targets {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, event: &Event<'_>) {
            self.0.lock().expect("not poisoned").push(event.metadata().target().to_owned());
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }
}
