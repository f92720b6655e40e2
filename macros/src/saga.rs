//! `#[derive(Saga)]`: a saga's state declares its name, the messages it takes and
//! how each names the saga (its correlation key), once.
//!
//! ```text
//! #[derive(Default, Serialize, Deserialize, Saga)]
//! #[saga(name = "order", key = "order_id", takes(OrderPlaced, PaymentReserved, PaymentExpired(key = "order.id")),
//!        sends(CapturePayment))]
//! struct Order { .. }
//! ```
//!
//! It implements `idemq::saga::SagaState` (name, `keep_finished`, the names of what
//! it takes) and `idemq::saga::Takes<M>` for each message type `M` it takes, whose
//! `correlate` reads the key with the same forms and the same generated code as
//! `#[idempotent_handler(key = ..)]` (a wrong field underlines the key string).

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{DeriveInput, LitStr};

use crate::attr::{parse_duration, KeySpec};
use crate::errors::Errors;
use crate::expand::{key_expr, MESSAGE};

pub(crate) fn derive(input: TokenStream) -> TokenStream {
    match syn::parse2::<DeriveInput>(input)
        .and_then(|input| Model::validate(&input).map(|m| m.expand(&input)))
    {
        Ok(tokens) => tokens,
        Err(err) => err.to_compile_error(),
    }
}

/// One message type the saga takes, and its own key if it has one.
struct Taken {
    ty: syn::Type,
    key: Option<KeySpec>,
}

/// What the attribute says.
struct Model {
    name: String,
    key: Option<KeySpec>,
    takes: Vec<Taken>,
    /// `sends(A, B)`: what its steps send, for the AsyncAPI document.
    sends: Vec<syn::Type>,
    keep_finished_ms: Option<u64>,
}

const FORM: &str = "#[saga(name = \"order\", key = \"order_id\", takes(OrderPlaced, PaymentReserved))]";

impl Model {
    fn validate(input: &DeriveInput) -> syn::Result<Self> {
        let mut errors = Errors::default();
        if !input.generics.params.is_empty() {
            errors.push(syn::Error::new_spanned(
                &input.generics,
                "a saga's state cannot be generic: it is stored under one name, as one type",
            ));
        }
        let (mut name, mut key, mut keep) = (None::<LitStr>, None::<KeySpec>, None);
        let mut takes = Vec::new();
        let mut sends = Vec::new();
        let mut takes_given = false;
        let attrs: Vec<_> = input.attrs.iter().filter(|attr| attr.path().is_ident("saga")).collect();
        for attr in &attrs {
            let parsed = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("name") {
                    let lit: LitStr = meta.value()?.parse()?;
                    if lit.value().trim().is_empty() {
                        return Err(meta.error("`name` must not be empty: it names the saga's rows"));
                    }
                    name = Some(lit);
                } else if meta.path.is_ident("key") {
                    let lit: LitStr = meta.value()?.parse()?;
                    key = Some(KeySpec::parse(lit)?);
                } else if meta.path.is_ident("keep_finished") {
                    let lit: LitStr = meta.value()?.parse()?;
                    let ms = match lit.value().trim() {
                        "0" | "0s" => Some(0),
                        text => parse_duration(text),
                    };
                    match ms {
                        Some(ms) => keep = Some(ms),
                        None => {
                            return Err(syn::Error::new(
                                lit.span(),
                                "`keep_finished` is how long a finished saga is kept: e.g. \"7d\" \
                                 (units ms, s, m, h, d; \"0\" deletes it when it completes)",
                            ))
                        }
                    }
                } else if meta.path.is_ident("takes") {
                    takes_given = true;
                    meta.parse_nested_meta(|taken| {
                        let path = taken.path.clone();
                        let mut own_key = None;
                        if taken.input.peek(syn::token::Paren) {
                            taken.parse_nested_meta(|inner| {
                                if inner.path.is_ident("key") {
                                    let lit: LitStr = inner.value()?.parse()?;
                                    own_key = Some(KeySpec::parse(lit)?);
                                    Ok(())
                                } else {
                                    Err(inner
                                        .error("a message the saga takes has one option: `key = \"...\"`"))
                                }
                            })?;
                        }
                        let ty = syn::Type::Path(syn::TypePath { qself: None, path });
                        takes.push(Taken { ty, key: own_key });
                        Ok(())
                    })?;
                } else if meta.path.is_ident("sends") {
                    meta.parse_nested_meta(|sent| {
                        sends.push(syn::Type::Path(syn::TypePath { qself: None, path: sent.path.clone() }));
                        Ok(())
                    })?;
                } else {
                    return Err(meta.error(format!(
                        "unknown saga option; the options are `name`, `key`, `takes(...)`, `sends(...)` and \
                         `keep_finished`: {FORM}"
                    )));
                }
                Ok(())
            });
            errors.take(parsed);
        }
        if attrs.is_empty() {
            errors.push(syn::Error::new(
                input.ident.span(),
                format!("a saga says what it takes and how they name it: add {FORM}"),
            ));
        } else if !takes_given || takes.is_empty() {
            errors.push(syn::Error::new(
                input.ident.span(),
                format!("a saga takes at least one message type: add `takes(..)`, e.g. {FORM}"),
            ));
        } else if key.is_none() {
            for taken in takes.iter().filter(|taken| taken.key.is_none()) {
                errors.push(syn::Error::new(
                    taken.ty.span(),
                    format!(
                        "the saga has no key for `{}`: give the saga's correlation key, read from each \
                         message it takes — `key = \"order_id\"` beside `takes` (a field, a template, \
                         \"@header:…\"), or this message's own `takes({}(key = \"...\"))`",
                        type_name(&taken.ty),
                        type_name(&taken.ty)
                    ),
                ));
            }
        }
        let name = name.map_or_else(|| snake_case(&input.ident.to_string()), |lit| lit.value());
        errors.finish(|| Self { name, key, takes, sends, keep_finished_ms: keep })
    }

    fn expand(&self, input: &DeriveInput) -> TokenStream {
        let ident = &input.ident;
        let name = &self.name;
        let names: Vec<String> = self.takes.iter().map(|taken| type_name(&taken.ty)).collect();
        let sent: Vec<String> = self.sends.iter().map(type_name).collect();
        // Each sent type named in code, so a misspelt one is an error on it.
        let sent_types = self.sends.iter().map(|ty| quote_spanned! {ty.span()=> let _: ::core::option::Option<#ty> = ::core::option::Option::None; });
        let keep = self.keep_finished_ms.map(|ms| {
            quote! { const KEEP_FINISHED: ::core::time::Duration = ::core::time::Duration::from_millis(#ms); }
        });
        let message = syn::Ident::new(MESSAGE, Span::mixed_site());
        let takes = self.takes.iter().map(|taken| {
            let ty = &taken.ty;
            let spec = taken.key.as_ref().or(self.key.as_ref()).expect("validated: every message has a key");
            let key_path = spec.describe();
            let key = key_expr(spec);
            let impl_span = ty.span();
            quote_spanned! {impl_span=>
                impl ::idemq::saga::Takes<#ty> for #ident {
                    const KEY_PATH: &'static str = #key_path;

                    fn correlate(
                        __idemq_message: &#ty,
                        __idemq_metadata: &::idemq::Metadata<'_>,
                    ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
                        let _ = __idemq_metadata;
                        let #message = __idemq_message;
                        #key
                    }
                }
            }
        });
        quote! {
            impl ::idemq::saga::SagaState for #ident {
                const NAME: &'static str = #name;
                #keep
                const TAKES: &'static [&'static str] = &[#(#names),*];
                const SENDS: &'static [&'static str] = &[#(#sent),*];
            }

            const _: () = {
                #[allow(dead_code)]
                fn __idemq_sends() {
                    #(#sent_types)*
                }
            };

            #(#takes)*
        }
    }
}

/// A type as written, without spaces (`orders::OrderPlaced`).
fn type_name(ty: &syn::Type) -> String {
    quote!(#ty).to_string().split_whitespace().collect()
}

/// `OrderSaga` → `order_saga`.
fn snake_case(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}
