//! Parsing and validating the attribute's options: `key = "..."`, `name = "..."`,
//! `lane = "..."`.

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
        if input.peek(LitStr) {
            let lit: LitStr = input.parse()?;
            return Err(syn::Error::new(
                lit.span(),
                format!("name the option: write `key = {}`", lit.token()),
            ));
        }
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
    /// `lane = "..."`, if given: the field whose value picks the pipeline.
    pub(crate) lane: Option<KeyPath>,
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
        let mut lane: Option<LitStr> = None;
        // Whether `key` was written (even misspelled or malformed), so that a missing
        // key is not reported on top of the error that explains it.
        let mut key_attempted = false;
        for option in raw {
            let slot = match option.name.to_string().as_str() {
                "key" => {
                    key_attempted = true;
                    &mut key
                }
                "name" => &mut name,
                "lane" => &mut lane,
                other => {
                    let hint = match closest_option(other) {
                        Some(known) => {
                            key_attempted |= known == "key";
                            format!("did you mean `{known}`? ")
                        }
                        None => String::new(),
                    };
                    push(syn::Error::new(
                        option.name.span(),
                        format!(
                            "unknown option `{other}`; {hint}the options are `key = \"field.path\"`, \
                             `name = \"handler_name\"` and `lane = \"field.path\"`"
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
                other => {
                    // `key = order.id` → suggest `key = "order.id"`.
                    let example = match &other {
                        Expr::Path(_) | Expr::Field(_) => {
                            quote::quote!(#other).to_string().split_whitespace().collect::<String>()
                        }
                        _ => "...".to_owned(),
                    };
                    push(syn::Error::new_spanned(
                        other,
                        format!(
                            "`{name}` takes a string literal: write `{name} = \"{example}\"`",
                            name = option.name
                        ),
                    ));
                }
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
        let lane = lane.and_then(|lit| KeyPath::parse(lit, "lane").map_err(&mut push).ok());
        let key = match key {
            Some(lit) => match KeyPath::parse(lit, "key") {
                Ok(path) => Some(path),
                Err(err) => {
                    push(err);
                    None
                }
            },
            None if key_attempted => None,
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
            (None, Some(key)) => Ok(Self { key, name, lane }),
            (None, None) => unreachable!("a missing or misspelled key always records an error"),
        }
    }
}

/// The known option an unknown one is most likely a typo of (edit distance ≤ 2).
fn closest_option(unknown: &str) -> Option<&'static str> {
    ["key", "name", "lane"]
        .into_iter()
        .map(|known| (edit_distance(unknown, known), known))
        .filter(|(distance, _)| *distance <= 2)
        .min()
        .map(|(_, known)| known)
}

/// Levenshtein distance, counting an adjacent transposition (`kye`) as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// Example field paths for an option's messages.
fn example(option: &str) -> &'static str {
    match option {
        "lane" => "\"account\" or \"order.customer_id\"",
        _ => "\"payment_id\" or \"order.id\"",
    }
}

impl KeyPath {
    /// Parses the value of option `option` (`key` or `lane`).
    fn parse(lit: LitStr, option: &str) -> syn::Result<Self> {
        let value = lit.value();
        let invalid = |why: String| {
            syn::Error::new(
                lit.span(),
                format!(
                    "`{value}` is not a field path: {why}; write the message field holding the {option}, \
                     e.g. {}",
                    example(option)
                ),
            )
        };
        if value.is_empty() {
            return Err(syn::Error::new(
                lit.span(),
                format!(
                    "`{option}` is empty; write the message field holding the {option}, e.g. {}",
                    example(option)
                ),
            ));
        }
        let mut segments = Vec::new();
        for part in value.split('.') {
            let member = if part.is_empty() {
                return Err(invalid("it has an empty segment (fields are separated by a single `.`)".into()));
            } else if part.bytes().all(|b| b.is_ascii_digit()) {
                // A tuple field, e.g. "ids.0".
                part.parse::<u32>()
                    .ok()
                    .map(|index| syn::Member::Unnamed(syn::Index { index, span: lit.span() }))
            } else {
                // `type` names the field `r#type`.
                syn::parse_str::<Ident>(part)
                    .or_else(|_| syn::parse_str::<Ident>(&format!("r#{part}")))
                    .ok()
                    .map(|mut ident| {
                        ident.set_span(lit.span());
                        syn::Member::Named(ident)
                    })
            };
            match member {
                Some(member) => segments.push(member),
                None => return Err(invalid(format!("`{part}` is not a field name"))),
            }
        }
        Ok(Self { lit, segments })
    }
}
