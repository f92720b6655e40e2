//! Procedural macros for [idemq](https://docs.rs/idemq). Use them through the `idemq`
//! crate, which re-exports them; this crate is an implementation detail.
//!
//! The pipeline is parse ([`attr`], [`handler`]) → validate → expand ([`expand`]);
//! on error the user's fn is emitted unchanged next to the `compile_error!`s, so
//! IDEs and later diagnostics keep working. What only the compiler can check (the
//! connection type, the return and error types, the key field's type, the message's
//! `Deserialize`) is left to it, through code spanned on the user's tokens and local
//! traits whose `#[diagnostic::on_unimplemented]` says what to write instead.
//!
//! `tests/ui` holds what the macro accepts (`pass/`) and a snapshot of every
//! diagnostic it gives (`fail/*.stderr`); regenerate them with
//! `TRYBUILD=overwrite cargo test -p idemq-macros --test ui` and review the diff.

mod attr;
mod errors;
mod expand;
mod handler;
mod message;

use proc_macro::TokenStream;

/// Declares where a message type is published and which field is its key. See
/// `idemq::Message`.
#[proc_macro_derive(Message, attributes(message))]
pub fn derive_message(input: TokenStream) -> TokenStream {
    message::derive(input.into()).into()
}

/// Turns an async fn into an idempotent message handler. See `idemq::idempotent_handler`.
#[proc_macro_attribute]
pub fn idempotent_handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent_handler(attr.into(), item.into()).into()
}
