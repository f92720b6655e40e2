//! Nothing here but the macros' documentation: the tests are the crate.
//! `tests/pass.rs` compiles and runs what `#[idempotent_handler]` and
//! `#[derive(Message)]` accept (`tests/ui/pass`); `tests/ui.rs` checks the diagnostic
//! of everything they refuse (`tests/ui/fail/*.stderr`, through trybuild); and the
//! examples of their docs (`macros/docs/*.md`, which idemq-macros shows on the
//! macros) run here as doctests, where idemq is at hand.

/// `#[derive(Message)]`'s documentation, whose examples run as doctests here.
#[cfg(doctest)]
#[doc = include_str!("../../docs/derive_message.md")]
pub struct DeriveMessageDocs;

/// `#[idempotent_handler]`'s documentation, whose examples run as doctests here.
#[cfg(doctest)]
#[doc = include_str!("../../docs/idempotent_handler.md")]
pub struct IdempotentHandlerDocs;
