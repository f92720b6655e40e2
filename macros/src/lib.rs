//! Procedural macros for [idemq](https://docs.rs/idemq): `#[idempotent_handler]`,
//! `#[derive(Message)]` and `#[derive(Saga)]`. Use them through the `idemq` crate, which re-exports them;
//! this crate is an implementation detail.
//!
//! The pipeline is parse → model → validate → expand: `attr` (the options, key
//! forms and templates) and `handler` (the fn's shape) parse and validate into a
//! model, `expand` writes the code, `message` does the same for the derive. Every
//! check pushes into one collector (`errors`), so all errors come at once; on error
//! the user's fn is emitted unchanged next to them, so IDEs and later diagnostics
//! keep working. What only the compiler can check (the connection and context
//! types, the return and error types, the key field's type, the message's
//! `Deserialize`, a result's `Serialize`, a `key_fn`'s signature) is left to it,
//! through code spanned on the user's tokens and traits whose
//! `#[diagnostic::on_unimplemented]` says what to write instead.
//!
//! `usage/tests/ui` (the crate `idemq-macros-usage`) holds what the macros accept
//! (`pass/`) and a snapshot of every diagnostic they give (`fail/*.stderr`);
//! regenerate them with `TRYBUILD=overwrite cargo test -p idemq-macros-usage --test
//! ui` and review the diff.
//! `tests/expand` holds the generated code of the main forms (`IDEMQ_BLESS=1 cargo
//! test -p idemq-macros --lib` regenerates it).

mod attr;
mod errors;
mod expand;
mod handler;
mod message;
mod saga;
#[cfg(test)]
mod snapshots;

use proc_macro::TokenStream;

// Their examples need idemq, which this crate cannot have as a dev-dependency
// without building it a second time for the host (usage/Cargo.toml says why): they
// run as doctests of idemq-macros-usage, which includes the same files, and are
// left out of this crate's (rustdoc sets `doctest` while it collects them).
#[cfg_attr(not(doctest), doc = include_str!("../docs/derive_message.md"))]
#[proc_macro_derive(Message, attributes(message))]
pub fn derive_message(input: TokenStream) -> TokenStream {
    message::derive(input.into()).into()
}

#[cfg_attr(not(doctest), doc = include_str!("../docs/idempotent_handler.md"))]
#[proc_macro_attribute]
pub fn idempotent_handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent_handler(attr.into(), item.into()).into()
}

/// Declares a saga's state: its name, the message types it takes and how each
/// names the saga (its correlation key). See `idemq::saga`.
#[proc_macro_derive(Saga, attributes(saga))]
pub fn derive_saga(input: TokenStream) -> TokenStream {
    saga::derive(input.into()).into()
}
