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
//!
//! `type = "payment.requested"` implements `idemq::MessageType` (the type's name on
//! the wire: the AMQP `type` that routes it among a queue's handlers);
//! `version = 2, previous = PaymentV1` implements `idemq::Versioned`, whose step is
//! the user's `impl From<PaymentV1> for Payment` (`previous` absent: the oldest
//! version kept). With a route, `send` sets both on what it publishes.

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
    /// `type = "..."`.
    wire_type: Option<LitStr>,
    /// `version = N` and its `previous = Type`.
    version: Option<(syn::LitInt, Option<syn::Path>)>,
    /// The key field: its member and its name on the wire.
    key: Option<(syn::Member, String, Span)>,
}

impl Model {
    fn validate(input: &DeriveInput) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let (mut exchange, mut routing_key, mut wire_type) = (None, None, None);
        let (mut version, mut previous): (Option<syn::LitInt>, Option<syn::Path>) = (None, None);
        // An option given, even one refused: "nothing to derive" would only add noise.
        let mut given = false;
        for attr in input.attrs.iter().filter(|attr| attr.path().is_ident("message")) {
            let parsed = attr.parse_nested_meta(|meta| {
                given = true;
                let slot = if meta.path.is_ident("exchange") {
                    &mut exchange
                } else if meta.path.is_ident("routing_key") {
                    &mut routing_key
                } else if meta.path.is_ident("type") {
                    &mut wire_type
                } else if meta.path.is_ident("version") {
                    if version.is_some() {
                        return Err(meta.error("duplicate option; give it once"));
                    }
                    let lit = meta.value()?.parse::<syn::LitInt>()?;
                    match lit.base10_parse::<u32>() {
                        Ok(0) | Err(_) => {
                            return Err(syn::Error::new(lit.span(), "a version is a whole number from 1"))
                        }
                        Ok(_) => version = Some(lit),
                    }
                    return Ok(());
                } else if meta.path.is_ident("previous") {
                    if previous.is_some() {
                        return Err(meta.error("duplicate option; give it once"));
                    }
                    previous = Some(meta.value()?.parse::<syn::Path>()?);
                    return Ok(());
                } else {
                    return Err(meta.error(
                        "unknown `message` option; the type takes `exchange = \"...\"` and `routing_key = \"...\"`, \
                         `type = \"...\"`, `version = N` and `previous = OlderType`, and its key field \
                         `#[message(key)]`",
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
        if let Some(lit) = &wire_type {
            let name = lit.value();
            if name.is_empty() || name.len() > 255 {
                errors.push(syn::Error::new(
                    lit.span(),
                    "a message type's name is 1 to 255 bytes (an AMQP short string)",
                ));
            }
        }
        let version = match (version, previous) {
            (Some(version), Some(previous)) if version.base10_parse::<u32>().ok() == Some(1) => {
                errors.push(syn::Error::new_spanned(
                    previous,
                    "version 1 is the first: it has no previous (drop `previous`, or raise the version)",
                ));
                Some((version, None))
            }
            (Some(version), previous) => Some((version, previous)),
            (None, Some(previous)) => {
                errors.push(syn::Error::new_spanned(
                    previous,
                    "`previous` needs this type's own `version = N` (the previous one is N - 1)",
                ));
                None
            }
            (None, None) => None,
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
        if !given && key.is_none() {
            errors.push(syn::Error::new(
                Span::call_site(),
                "nothing to derive: add `#[message(exchange = \"...\", routing_key = \"...\")]` on the type, \
                 `#[message(key)]` on its key field, `#[message(type = \"...\")]` or `#[message(version = N)]`",
            ));
        }
        errors.finish(|| Self { route, wire_type, version, key })
    }

    fn expand(&self, input: &DeriveInput) -> TokenStream {
        let ident = &input.ident;
        let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
        let type_const = self.wire_type.as_ref().map(|name| {
            quote! { const TYPE: ::core::option::Option<&'static str> = ::core::option::Option::Some(#name); }
        });
        let version_const = self.version.as_ref().map(|(version, _)| {
            quote! { const VERSION: ::core::option::Option<u32> = ::core::option::Option::Some(#version); }
        });
        let route = self.route.as_ref().map(|(exchange, routing_key)| {
            quote! {
                impl #impl_generics ::idemq::Message for #ident #ty_generics #where_clause {
                    const EXCHANGE: &'static str = #exchange;
                    const ROUTING_KEY: &'static str = #routing_key;
                    #type_const
                    #version_const

                    #[allow(clippy::needless_borrow)] // the borrow is the probe: it picks the impl
                    fn payload_schema() -> ::core::option::Option<::idemq::__private::serde_json::Value> {
                        #[allow(unused_imports)]
                        use ::idemq::__private::{__IdemqNoSchemaProbe as _, __IdemqSchemaProbe as _};
                        (&::idemq::__private::__IdemqProbe::<Self>::new()).__idemq_schema().map(|schema| schema())
                    }
                }
            }
        });
        let wire_type = self.wire_type.as_ref().map(|name| {
            quote! {
                impl #impl_generics ::idemq::MessageType for #ident #ty_generics #where_clause {
                    const TYPE: &'static str = #name;
                }
            }
        });
        let versioned = self.version.as_ref().map(|(version, previous)| {
            let (previous_ty, upcast) = match previous {
                Some(previous) => {
                    // Spanned on `previous = ...`: a missing `From` impl is underlined there.
                    let upcast = quote_spanned! {previous.span()=>
                        <Self as ::core::convert::From<#previous>>::from(previous)
                    };
                    (quote! { #previous }, upcast)
                }
                None => (quote! { Self }, quote! { previous }),
            };
            quote! {
                impl #impl_generics ::idemq::Versioned for #ident #ty_generics #where_clause {
                    const VERSION: u32 = #version;
                    type Previous = #previous_ty;

                    fn upcast(previous: #previous_ty) -> Self {
                        #upcast
                    }
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
        quote! { #route #wire_type #versioned #key }
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
