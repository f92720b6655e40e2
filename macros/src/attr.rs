//! Parsing and validating the attribute's options: `key = "..."` (a field path, a
//! template, `@message_id`, `@header:…`, `@hash`), `key_fn = path`, `name = "..."`,
//! `lane = "..."`.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

use crate::errors::Errors;

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
    /// Where the dedup key comes from; `None`: from the message type
    /// (`#[derive(Message)]` with `#[message(key)]`).
    pub(crate) key: Option<KeySpec>,
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

/// Where a key, or one value of a key template, is read from.
pub(crate) enum Source {
    /// A field path into the message.
    Field(Vec<syn::Member>),
    /// The delivery's AMQP `message_id` (`@message_id`).
    MessageId,
    /// A delivery header (`@header:<name>`).
    Header(String),
    /// The payload's fingerprint (`@hash`).
    Hash,
}

/// One part of a key template.
pub(crate) enum Part {
    Literal(String),
    Value(Source),
}

/// How the dedup key is made.
pub(crate) enum KeySpec {
    /// `key = "..."`: one source (`"payment_id"`, `"@message_id"`, …).
    Single { lit: LitStr, source: Source },
    /// `key = "{tenant}:{order.id}"`.
    Template { lit: LitStr, parts: Vec<Part> },
    /// `key_fn = path::to::fn`.
    Function(syn::Path),
}

impl KeySpec {
    /// The key as written, for error messages and the handler's `key_path`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Single { lit, .. } | Self::Template { lit, .. } => lit.value(),
            Self::Function(path) => {
                format!("key_fn {}", quote::quote!(#path).to_string().split_whitespace().collect::<String>())
            }
        }
    }
}

/// The options, for messages.
const OPTIONS: &str = "`key = \"field.path\"` (or a template `\"{a}:{b.c}\"`, `\"@message_id\"`, \
                       `\"@header:name\"`, `\"@hash\"`), `key_fn = path::to::fn`, `name = \"handler_name\"` \
                       and `lane = \"field.path\"`";

impl Options {
    /// Parses the attribute's tokens, collecting every error.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let raw = Punctuated::<RawOption, Token![,]>::parse_terminated.parse2(tokens)?;
        let mut errors = Errors::default();
        let (mut key, mut key_fn, mut name, mut lane): (
            Option<LitStr>,
            Option<Expr>,
            Option<LitStr>,
            Option<LitStr>,
        ) = (None, None, None, None);
        for option in raw {
            let duplicate = |errors: &mut Errors| {
                errors.push(syn::Error::new(
                    option.name.span(),
                    format!("duplicate option `{}`; give it once", option.name),
                ));
            };
            let slot = match option.name.to_string().as_str() {
                "key" => &mut key,
                "name" => &mut name,
                "lane" => &mut lane,
                "key_fn" => {
                    if key_fn.is_some() {
                        duplicate(&mut errors);
                    } else {
                        key_fn = Some(option.value);
                    }
                    continue;
                }
                other => {
                    let hint = match closest_option(other) {
                        Some(known) => format!("did you mean `{known}`? "),
                        None => String::new(),
                    };
                    errors.push(syn::Error::new(
                        option.name.span(),
                        format!("unknown option `{other}`; {hint}the options are {OPTIONS}"),
                    ));
                    continue;
                }
            };
            if slot.is_some() {
                duplicate(&mut errors);
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
                    errors.push(syn::Error::new_spanned(
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
                errors.push(syn::Error::new(
                    name.span(),
                    "`name` must not be empty; it scopes this handler's dedup keys",
                ));
            }
        }
        let lane = lane.and_then(|lit| errors.take(KeyPath::parse(lit, "lane")));
        let key = match (key, key_fn) {
            (Some(lit), Some(function)) => {
                errors.push(syn::Error::new_spanned(
                    &function,
                    format!(
                        "give `key = {}` or `key_fn`, not both: they are two ways to make one key",
                        lit.token()
                    ),
                ));
                None
            }
            (Some(lit), None) => errors.take(KeySpec::parse(lit)),
            (None, Some(Expr::Path(path))) => Some(KeySpec::Function(path.path)),
            (None, Some(other)) => {
                errors.push(syn::Error::new_spanned(
                    other,
                    "`key_fn` takes the path of a fn: write `key_fn = my_key` (a `fn(&Message) -> K`)",
                ));
                None
            }
            (None, None) => None,
        };
        errors.finish(|| Self { key, name, lane })
    }
}

impl KeySpec {
    /// `@…` forms, a template with `{…}`, or a field path.
    fn parse(lit: LitStr) -> syn::Result<Self> {
        let value = lit.value();
        if value.contains(['{', '}']) {
            let parts = parse_template(&lit, &value)?;
            return Ok(Self::Template { lit, parts });
        }
        let source = parse_source(&lit, &value, "key")?;
        Ok(Self::Single { lit, source })
    }
}

/// One source: `@message_id`, `@header:<name>`, `@hash`, or a field path.
fn parse_source(lit: &LitStr, value: &str, option: &str) -> syn::Result<Source> {
    let Some(form) = value.strip_prefix('@') else {
        return KeyPath::segments(lit, value, option).map(Source::Field);
    };
    match form {
        "message_id" => Ok(Source::MessageId),
        "hash" => Ok(Source::Hash),
        _ => match form.strip_prefix("header:") {
            Some(name) if !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic()) => {
                Ok(Source::Header(name.to_owned()))
            }
            Some(_) => Err(syn::Error::new(
                lit.span(),
                format!(
                    "`{value}` names no header: write `@header:x-idempotency-key` (a header name, no spaces)"
                ),
            )),
            None => Err(syn::Error::new(
                lit.span(),
                format!(
                    "unknown key source `{value}`; a key starting with `@` is `@message_id` (the AMQP \
                     property), `@header:<name>` (a delivery header) or `@hash` (the payload's fingerprint)"
                ),
            )),
        },
    }
}

/// `{tenant}:{order.id}` → literal and value parts; `{{` and `}}` are literal braces.
/// Errors give the column (1-based, in characters) inside the template: stable Rust
/// cannot underline inside a string literal.
fn parse_template(lit: &LitStr, template: &str) -> syn::Result<Vec<Part>> {
    let error = |column: usize, what: &str| {
        syn::Error::new(lit.span(), format!("key template `{template}`, column {column}: {what}"))
    };
    let chars: Vec<char> = template.chars().collect();
    let (mut parts, mut literal, mut i) = (Vec::new(), String::new(), 0);
    while i < chars.len() {
        match chars[i] {
            '{' if chars.get(i + 1) == Some(&'{') => {
                literal.push('{');
                i += 2;
            }
            '}' if chars.get(i + 1) == Some(&'}') => {
                literal.push('}');
                i += 2;
            }
            '}' => return Err(error(i + 1, "unmatched `}` (write `}}` for a literal brace)")),
            '{' => {
                let Some(len) = chars[i + 1..].iter().position(|&c| c == '}') else {
                    return Err(error(i + 1, "this `{` is never closed (write `{{` for a literal brace)"));
                };
                let inner: String = chars[i + 1..i + 1 + len].iter().collect();
                if inner.trim().is_empty() {
                    return Err(error(i + 1, "an empty `{}`; name a field, e.g. `{order.id}`"));
                }
                if inner.contains('{') {
                    return Err(error(i + 1, "`{` inside a placeholder; placeholders do not nest"));
                }
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                let source = parse_source(lit, inner.trim(), "key")
                    .map_err(|err| error(i + 2, &format!("in `{{{inner}}}`: {err}")))?;
                parts.push(Part::Value(source));
                i += len + 2;
            }
            c => {
                literal.push(c);
                i += 1;
            }
        }
    }
    if !literal.is_empty() {
        parts.push(Part::Literal(literal));
    }
    if !parts.iter().any(|part| matches!(part, Part::Value(_))) {
        return Err(error(1, "a template needs at least one `{field}`"));
    }
    Ok(parts)
}

/// The known option an unknown one is most likely a typo of (edit distance ≤ 2).
fn closest_option(unknown: &str) -> Option<&'static str> {
    ["key", "key_fn", "name", "lane"]
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
    /// Parses the value of option `option` (`lane`): a plain field path.
    fn parse(lit: LitStr, option: &str) -> syn::Result<Self> {
        let value = lit.value();
        let segments = Self::segments(&lit, &value, option)?;
        Ok(Self { lit, segments })
    }

    /// The members of a field path, spanned on `lit`.
    fn segments(lit: &LitStr, value: &str, option: &str) -> syn::Result<Vec<syn::Member>> {
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
        // Spanned on the literal (so errors underline it), but marked as the macro's:
        // rustc then offers no "similar field" fix that would replace the whole
        // literal, quotes and all, with a bare field name.
        let span = Span::mixed_site().located_at(lit.span());
        let mut segments = Vec::new();
        for part in value.split('.') {
            let member = if part.is_empty() {
                return Err(invalid("it has an empty segment (fields are separated by a single `.`)".into()));
            } else if part.bytes().all(|b| b.is_ascii_digit()) {
                // A tuple field, e.g. "ids.0".
                part.parse::<u32>().ok().map(|index| syn::Member::Unnamed(syn::Index { index, span }))
            } else {
                // `type` names the field `r#type`.
                syn::parse_str::<Ident>(part)
                    .or_else(|_| syn::parse_str::<Ident>(&format!("r#{part}")))
                    .ok()
                    .map(|mut ident| {
                        ident.set_span(span);
                        syn::Member::Named(ident)
                    })
            };
            match member {
                Some(member) => segments.push(member),
                None => return Err(invalid(format!("`{part}` is not a field name"))),
            }
        }
        Ok(segments)
    }
}
