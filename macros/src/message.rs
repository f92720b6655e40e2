//! `#[derive(Message)]`: a message type declares where it is published and which
//! field is its dedup key, once.
//!
//! ```text
//! #[derive(Serialize, Deserialize, Message)]
//! #[message(exchange = "payments", routing_key = "payment.applied")]
//! struct PaymentApplied { #[message(key)] payment_id: String, .. }
//! ```
//!
//! `exchange` and `routing_key` (together) implement `idemq::Message` (the typed
//! publisher, `ctx.send(&msg)`, and `Topology::message::<T>()`); `#[message(key)]`
//! implements `idemq::key::KeyedMessage` (handlers of the type need no `key = "..."`).
//! The key's name in messages is its serde name (`#[serde(rename = "...")]`).

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr};

use crate::errors::Errors;

pub(crate) fn derive(input: TokenStream) -> TokenStream {
    match syn::parse2::<DeriveInput>(input)
        .and_then(|input| Model::validate(&input).map(|m| m.expand(&input)))
    {
        Ok(tokens) => tokens,
        Err(err) => err.to_compile_error(),
    }
}

/// What the attributes say.
struct Model {
    route: Option<(LitStr, LitStr)>,
    /// The key field: its member and its name on the wire.
    key: Option<(syn::Member, String, Span)>,
}

impl Model {
    fn validate(input: &DeriveInput) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let (mut exchange, mut routing_key) = (None, None);
        for attr in input.attrs.iter().filter(|attr| attr.path().is_ident("message")) {
            let parsed = attr.parse_nested_meta(|meta| {
                let slot = if meta.path.is_ident("exchange") {
                    &mut exchange
                } else if meta.path.is_ident("routing_key") {
                    &mut routing_key
                } else {
                    return Err(meta.error(
                        "unknown `message` option; the type takes `exchange = \"...\"` and `routing_key = \"...\"`, \
                         and its key field `#[message(key)]`",
                    ));
                };
                if slot.is_some() {
                    return Err(meta.error("duplicate option; give it once"));
                }
                *slot = Some(meta.value()?.parse::<LitStr>()?);
                Ok(())
            });
            errors.take(parsed);
        }
        let route = match (exchange, routing_key) {
            (Some(exchange), Some(routing_key)) => Some((exchange, routing_key)),
            (None, None) => None,
            (Some(lit), None) | (None, Some(lit)) => {
                errors.push(syn::Error::new(
                    lit.span(),
                    "give both `exchange = \"...\"` and `routing_key = \"...\"` (`exchange = \"\"` is the \
                     default exchange, whose routing key is a queue name)",
                ));
                None
            }
        };
        let mut key = None;
        match &input.data {
            Data::Struct(data) => {
                let fields: Vec<_> = match &data.fields {
                    Fields::Named(named) => named.named.iter().collect(),
                    Fields::Unnamed(unnamed) => unnamed.unnamed.iter().collect(),
                    Fields::Unit => Vec::new(),
                };
                for (index, field) in fields.into_iter().enumerate() {
                    for attr in field.attrs.iter().filter(|attr| attr.path().is_ident("message")) {
                        let parsed = attr.parse_nested_meta(|meta| {
                            if meta.path.is_ident("key") {
                                Ok(())
                            } else {
                                Err(meta.error("unknown `message` option on a field; mark the key field `#[message(key)]`"))
                            }
                        });
                        if errors.take(parsed).is_none() {
                            continue;
                        }
                        if key.is_some() {
                            errors.push(syn::Error::new(
                                attr.span(),
                                "a second `#[message(key)]`; mark one field (for a key of several, \
                                 use a template on the handler: `key = \"{a}:{b}\"`)",
                            ));
                            continue;
                        }
                        let member = match &field.ident {
                            Some(ident) => syn::Member::Named(ident.clone()),
                            None => syn::Member::Unnamed(syn::Index::from(index)),
                        };
                        let wire = serde_rename(field).unwrap_or_else(|| match &member {
                            syn::Member::Named(ident) => {
                                ident.to_string().trim_start_matches("r#").to_owned()
                            }
                            syn::Member::Unnamed(index) => index.index.to_string(),
                        });
                        key = Some((member, wire, field.ty.span()));
                    }
                }
            }
            Data::Enum(data) => {
                if data.variants.iter().any(|v| v.fields.iter().any(|f| has_message_attr(&f.attrs))) {
                    errors.push(syn::Error::new(
                        data.enum_token.span,
                        "`#[message(key)]` goes on a struct's field; for an enum, give the handler a `key_fn`",
                    ));
                }
            }
            Data::Union(data) => errors
                .push(syn::Error::new(data.union_token.span, "`#[derive(Message)]` does not support unions")),
        }
        if route.is_none() && key.is_none() {
            errors.push(syn::Error::new(
                Span::call_site(),
                "nothing to derive: add `#[message(exchange = \"...\", routing_key = \"...\")]` on the type, \
                 `#[message(key)]` on its key field, or both",
            ));
        }
        errors.finish(|| Self { route, key })
    }

    fn expand(&self, input: &DeriveInput) -> TokenStream {
        let ident = &input.ident;
        let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
        let route = self.route.as_ref().map(|(exchange, routing_key)| {
            quote! {
                impl #impl_generics ::idemq::Message for #ident #ty_generics #where_clause {
                    const EXCHANGE: &'static str = #exchange;
                    const ROUTING_KEY: &'static str = #routing_key;
                }
            }
        });
        let key = self.key.as_ref().map(|(member, wire, span)| {
            let to_key = quote_spanned! {*span=> ::idemq::key::KeyField::to_key(&self.#member) };
            quote! {
                impl #impl_generics ::idemq::key::KeyedMessage for #ident #ty_generics #where_clause {
                    const KEY_PATH: &'static str = #wire;

                    fn message_key(&self) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
                        #to_key
                    }
                }
            }
        });
        quote! { #route #key }
    }
}

fn has_message_attr(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| attr.path().is_ident("message"))
}

/// A field's `#[serde(rename = "...")]` (the plain form), if any.
fn serde_rename(field: &syn::Field) -> Option<String> {
    let mut renamed = None;
    for attr in field.attrs.iter().filter(|attr| attr.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename") {
                if let Ok(value) = meta.value() {
                    if let Ok(lit) = value.parse::<LitStr>() {
                        renamed = Some(lit.value());
                    }
                }
            } else if meta.input.peek(syn::Token![=]) {
                // Skip another option's value (`default = "path"`, …).
                let _ = meta.value()?.parse::<syn::Expr>();
            } else if meta.input.peek(syn::token::Paren) {
                let _ = meta.input.parse::<proc_macro2::Group>();
            }
            Ok(())
        });
    }
    renamed
}
