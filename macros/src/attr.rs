//! Parsing and validating the attribute's options: `key = "..."`, `name = "..."`.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

/// One `ident = value` pair as written; validated later so every error is reported.
struct RawOption {
    name: Ident,
    value: Expr,
}

impl Parse for RawOption {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let lookahead = input.lookahead1();
        if !lookahead.peek(Ident) {
            return Err(lookahead.error());
        }
        let name: Ident = input.parse()?;
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(name.span(), format!("expected `{name} = \"...\"`")));
        }
        input.parse::<Token![=]>()?;
        let value = input.parse()?;
        Ok(Self { name, value })
    }
}

/// The validated options.
pub(crate) struct Options {
    /// The key path literal, e.g. `"order.id"` (its span underlines key errors).
    pub(crate) key: KeyPath,
    /// `name = "..."`, if given.
    pub(crate) name: Option<LitStr>,
}

/// A dotted field path into the message, e.g. `order.id`.
pub(crate) struct KeyPath {
    pub(crate) lit: LitStr,
    pub(crate) segments: Vec<syn::Member>,
}

impl Options {
    /// Parses the attribute's tokens, collecting every error.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let raw = Punctuated::<RawOption, Token![,]>::parse_terminated.parse2(tokens)?;
        let mut errors: Option<syn::Error> = None;
        let mut push = |err: syn::Error| match &mut errors {
            Some(all) => all.combine(err),
            None => errors = Some(err),
        };
        let mut key: Option<LitStr> = None;
        let mut name: Option<LitStr> = None;
        for option in raw {
            let slot = match option.name.to_string().as_str() {
                "key" => &mut key,
                "name" => &mut name,
                other => {
                    push(syn::Error::new(
                        option.name.span(),
                        format!(
                            "unknown option `{other}`; expected `key = \"field.path\"` or `name = \"handler_name\"`"
                        ),
                    ));
                    continue;
                }
            };
            if slot.is_some() {
                push(syn::Error::new(
                    option.name.span(),
                    format!("duplicate option `{}`; give it once", option.name),
                ));
                continue;
            }
            match option.value {
                Expr::Lit(ExprLit { lit: Lit::Str(lit), .. }) => *slot = Some(lit),
                other => push(syn::Error::new_spanned(
                    other,
                    format!("`{}` takes a string literal, e.g. `{} = \"...\"`", option.name, option.name),
                )),
            }
        }
        if let Some(name) = &name {
            if name.value().trim().is_empty() {
                push(syn::Error::new(
                    name.span(),
                    "`name` must not be empty; it scopes this handler's dedup keys",
                ));
            }
        }
        let key = match key {
            Some(lit) => match KeyPath::parse(lit) {
                Ok(path) => Some(path),
                Err(err) => {
                    push(err);
                    None
                }
            },
            None => {
                push(syn::Error::new(
                    Span::call_site(),
                    "missing `key`: name the message field that holds the dedup key, \
                     e.g. #[idempotent_handler(key = \"payment_id\")]",
                ));
                None
            }
        };
        match (errors, key) {
            (Some(errors), _) => Err(errors),
            (None, Some(key)) => Ok(Self { key, name }),
            (None, None) => unreachable!("a missing key always records an error"),
        }
    }
}

impl KeyPath {
    fn parse(lit: LitStr) -> syn::Result<Self> {
        let value = lit.value();
        let mut segments = Vec::new();
        for part in value.split('.') {
            let member = if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
                part.parse::<u32>()
                    .ok()
                    .map(|index| syn::Member::Unnamed(syn::Index { index, span: lit.span() }))
            } else {
                syn::parse_str::<Ident>(part).ok().map(|mut ident| {
                    ident.set_span(lit.span());
                    syn::Member::Named(ident)
                })
            };
            match member {
                Some(member) => segments.push(member),
                None => {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "`{value}` is not a field path; write the message field holding the key, \
                             e.g. \"payment_id\" or \"order.id\""
                        ),
                    ))
                }
            }
        }
        Ok(Self { lit, segments })
    }
}
