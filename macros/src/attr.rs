//! Parsing and validating the attribute's options: `key = "..."` (a field path, a
//! template, `@message_id`, `@header:…`, `@hash`), `key_fn = path`, `name = "..."`,
//! `lane = "..."`, `queue = "..."`, `retry(...)`, `on_conflict = "..."`, `batch = N`,
//! `dedup = false`.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

use crate::errors::Errors;

/// One option as written — `name = value` or `name(...)` — validated later so every
/// error is reported.
struct RawOption {
    name: Ident,
    value: RawValue,
}

enum RawValue {
    /// `name = value`.
    Expr(Expr),
    /// `name(...)`, e.g. `retry(delays = ["1s", "5s"])`.
    List(TokenStream),
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
        if input.peek(syn::token::Paren) {
            let content;
            syn::parenthesized!(content in input);
            return Ok(Self { name, value: RawValue::List(content.parse()?) });
        }
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(name.span(), format!("expected `{name} = \"...\"`")));
        }
        input.parse::<Token![=]>()?;
        Ok(Self { name, value: RawValue::Expr(input.parse()?) })
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
    /// `queue = "..."`: the queue the handler consumes.
    pub(crate) queue: Option<LitStr>,
    /// `retry(...)`: the handler's delays (empty: `retry(none)`).
    pub(crate) retry: Option<Vec<u64>>,
    /// `on_conflict = "ignore"` (true) or `"dead_letter"` (false).
    pub(crate) on_conflict_ignore: Option<bool>,
    /// `batch = N`.
    pub(crate) batch: Option<usize>,
    /// `dedup = false`.
    pub(crate) dedup: bool,
    /// Where `dedup = false` was written, to refuse it on a saga's step.
    pub(crate) no_dedup: Option<Span>,
    /// `idempotency_key_lifetime = "24h"`, in milliseconds.
    pub(crate) idempotency_key_lifetime: Option<u64>,
    /// `saga(start)`, `saga(missing = "...", finished = "...")`.
    pub(crate) saga: Option<SagaOptions>,
}

/// A saga step's policies: what it does for a saga that does not exist, or has
/// finished (the `idemq::saga::IfMissing` and `IfFinished` variants' names).
pub(crate) struct SagaOptions {
    /// The option's name, to point at when the fn takes no saga.
    pub(crate) span: Span,
    pub(crate) missing: Option<&'static str>,
    pub(crate) finished: Option<&'static str>,
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
                       `\"@header:name\"`, `\"@hash\"`), `key_fn = path::to::fn`, `name = \"handler_name\"`, \
                       `lane = \"field.path\"`, `queue = \"queue\"`, `retry(delays = [\"1s\", \"30s\"])` or \
                       `retry(none)`, `on_conflict = \"ignore\"`, `batch = N`, `dedup = false` and \
                       `idempotency_key_lifetime = \"24h\"`; a saga's step also `saga(start)` or \
                       `saga(missing = \"retry\", finished = \"ignore\")`";

/// Every option's name, for typo hints.
const NAMES: [&str; 11] = [
    "key",
    "key_fn",
    "name",
    "lane",
    "queue",
    "retry",
    "on_conflict",
    "batch",
    "dedup",
    "idempotency_key_lifetime",
    "saga",
];

/// The largest `batch = N` (the runtime's own limit).
const MAX_BATCH: usize = 4096;

impl Options {
    /// Parses the attribute's tokens, collecting every error.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let raw = Punctuated::<RawOption, Token![,]>::parse_terminated.parse2(tokens)?;
        let mut errors = Errors::default();
        let mut given: Vec<RawOption> = Vec::new();
        for option in raw {
            let name = option.name.to_string();
            if !NAMES.contains(&name.as_str()) {
                let hint = match closest_option(&name) {
                    Some(known) => format!("did you mean `{known}`? "),
                    None => String::new(),
                };
                errors.push(syn::Error::new(
                    option.name.span(),
                    format!("unknown option `{name}`; {hint}the options are {OPTIONS}"),
                ));
            } else if given.iter().any(|other| other.name == option.name) {
                errors.push(syn::Error::new(
                    option.name.span(),
                    format!("duplicate option `{name}`; give it once"),
                ));
            } else {
                given.push(option);
            }
        }
        let mut take = |name: &str| {
            given.iter().position(|option| option.name == name).map(|index| given.swap_remove(index))
        };
        let (key, key_fn, name, lane, queue) =
            (take("key"), take("key_fn"), take("name"), take("lane"), take("queue"));
        let (retry, on_conflict, batch, dedup) =
            (take("retry"), take("on_conflict"), take("batch"), take("dedup"));
        let key_lifetime = take("idempotency_key_lifetime");
        let saga = take("saga").and_then(|option| errors.take(parse_saga(option)));

        let key = key.and_then(|option| errors.take(string(option)));
        let name = name.and_then(|option| errors.take(string(option)));
        let lane = lane.and_then(|option| errors.take(string(option)));
        let queue = queue.and_then(|option| errors.take(string(option)));
        if let Some(name) = &name {
            if name.value().trim().is_empty() {
                errors.push(syn::Error::new(
                    name.span(),
                    "`name` must not be empty; it scopes this handler's dedup keys",
                ));
            }
        }
        if let Some(queue) = &queue {
            if queue.value().is_empty() || queue.value().len() > 255 {
                errors.push(syn::Error::new(queue.span(), "`queue` is a queue name: 1 to 255 bytes"));
            }
        }
        let lane = lane.and_then(|lit| errors.take(KeyPath::parse(lit, "lane")));
        let retry = retry.and_then(|option| errors.take(parse_retry(option)));
        let on_conflict_ignore = on_conflict.and_then(|option| {
            let lit = errors.take(string(option))?;
            match lit.value().as_str() {
                "ignore" => Some(true),
                "dead_letter" => Some(false),
                other => {
                    errors.push(syn::Error::new(
                        lit.span(),
                        format!(
                            "`on_conflict` is \"dead_letter\" (the default: a key reused for another payload \
                             is a client bug) or \"ignore\" (ack it as a duplicate and log), not \"{other}\""
                        ),
                    ));
                    None
                }
            }
        });
        let batch = batch.and_then(|option| {
            let int = errors.take(literal::<syn::LitInt>(option, "batch", "batch = 16"))?;
            match int.base10_parse::<usize>() {
                Ok(n) if (1..=MAX_BATCH).contains(&n) => Some(n),
                _ => {
                    errors.push(syn::Error::new(
                        int.span(),
                        format!("`batch` is 1..={MAX_BATCH} deliveries per transaction (1: one at a time)"),
                    ));
                    None
                }
            }
        });
        let idempotency_key_lifetime = key_lifetime.and_then(|option| {
            let lit = errors.take(string(option))?;
            let ms = parse_duration(&lit.value());
            if ms.is_none() {
                errors.push(syn::Error::new(
                    lit.span(),
                    format!(
                        "`idempotency_key_lifetime` is how long the provider keeps an idempotency key: write \
                         e.g. \"24h\" (units ms, s, m, h), not \"{}\"",
                        lit.value()
                    ),
                ));
            }
            ms
        });
        let dedup_span = dedup.as_ref().map(|option| option.name.span());
        let dedup = match dedup {
            Some(option) => {
                errors.take(literal::<syn::LitBool>(option, "dedup", "dedup = false")).is_none_or(|b| b.value)
            }
            None => true,
        };
        let no_dedup = if dedup { None } else { dedup_span };
        let key = match (key, key_fn) {
            (Some(lit), Some(function)) => {
                errors.push(syn::Error::new(
                    function.name.span(),
                    format!(
                        "give `key = {}` or `key_fn`, not both: they are two ways to make one key",
                        lit.token()
                    ),
                ));
                None
            }
            (Some(lit), None) => errors.take(KeySpec::parse(lit)),
            (None, Some(RawOption { value: RawValue::Expr(Expr::Path(path)), .. })) => {
                Some(KeySpec::Function(path.path))
            }
            (None, Some(other)) => {
                errors.push(syn::Error::new(
                    other.name.span(),
                    "`key_fn` takes the path of a fn: write `key_fn = my_key` (a `fn(&Message) -> K`)",
                ));
                None
            }
            // Without dedup rows the key only names the message in logs and start
            // marks: the payload's fingerprint does.
            (None, None) if !dedup => {
                Some(KeySpec::Single { lit: LitStr::new("@hash", Span::call_site()), source: Source::Hash })
            }
            (None, None) => None,
        };
        errors.finish(|| Self {
            key,
            name,
            lane,
            queue,
            retry,
            on_conflict_ignore,
            batch,
            dedup,
            no_dedup,
            idempotency_key_lifetime,
            saga,
        })
    }
}

/// `saga(start)`, `saga(missing = "ignore", finished = "dead_letter")`.
fn parse_saga(option: RawOption) -> syn::Result<SagaOptions> {
    let span = option.name.span();
    let RawValue::List(tokens) = option.value else {
        return Err(syn::Error::new(
            span,
            "write `saga(start)` or `saga(missing = \"retry\" | \"dead_letter\" | \"ignore\", finished = \"ignore\" | \"dead_letter\")`",
        ));
    };
    let mut saga = SagaOptions { span, missing: None, finished: None };
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("start") {
            if saga.missing.is_some() {
                return Err(meta.error("`start` is `missing = \"start\"`: give one of them"));
            }
            saga.missing = Some("Start");
        } else if meta.path.is_ident("missing") {
            let lit: LitStr = meta.value()?.parse()?;
            if saga.missing.is_some() {
                return Err(meta.error("`start` is `missing = \"start\"`: give one of them"));
            }
            saga.missing = Some(match lit.value().as_str() {
                "start" => "Start",
                "retry" => "Retry",
                "dead_letter" => "DeadLetter",
                "ignore" => "Ignore",
                other => {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "`missing` is what a message for a saga that does not exist does: \"retry\" (the \
                             default: retried, then dead-lettered), \"dead_letter\", \"ignore\" or \"start\", \
                             not \"{other}\""
                        ),
                    ))
                }
            });
        } else if meta.path.is_ident("finished") {
            let lit: LitStr = meta.value()?.parse()?;
            saga.finished = Some(match lit.value().as_str() {
                "ignore" => "Ignore",
                "dead_letter" => "DeadLetter",
                other => {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "`finished` is what a message for a finished saga does: \"ignore\" (the default) \
                             or \"dead_letter\", not \"{other}\""
                        ),
                    ))
                }
            });
        } else {
            return Err(
                meta.error("a saga step's options are `start`, `missing = \"...\"` and `finished = \"...\"`")
            );
        }
        Ok(())
    });
    parser.parse2(tokens)?;
    Ok(saga)
}

/// A string option's literal; `key = order.id` → suggest `key = "order.id"`.
fn string(option: RawOption) -> syn::Result<LitStr> {
    let name = option.name;
    match option.value {
        RawValue::Expr(Expr::Lit(ExprLit { lit: Lit::Str(lit), .. })) => Ok(lit),
        RawValue::Expr(other) => {
            let example = match &other {
                Expr::Path(_) | Expr::Field(_) => {
                    quote::quote!(#other).to_string().split_whitespace().collect::<String>()
                }
                _ => "...".to_owned(),
            };
            Err(syn::Error::new_spanned(
                other,
                format!("`{name}` takes a string literal: write `{name} = \"{example}\"`"),
            ))
        }
        RawValue::List(_) => Err(syn::Error::new(name.span(), format!("write `{name} = \"...\"`"))),
    }
}

/// A literal option of type `L` (an integer, a bool).
fn literal<L: syn::parse::Parse>(option: RawOption, name: &str, example: &str) -> syn::Result<L> {
    let wrong = |span| syn::Error::new(span, format!("write `{example}`"));
    match option.value {
        RawValue::Expr(Expr::Lit(ExprLit { lit, .. })) => {
            let span = lit.span();
            syn::parse2::<L>(quote::quote!(#lit)).map_err(|_| wrong(span))
        }
        RawValue::Expr(other) => {
            Err(syn::Error::new_spanned(other, format!("`{name}` takes a literal: write `{example}`")))
        }
        RawValue::List(_) => Err(wrong(option.name.span())),
    }
}

/// `retry(delays = ["100ms", "1s", "30s"])` or `retry(none)`: the delays in ms.
fn parse_retry(option: RawOption) -> syn::Result<Vec<u64>> {
    let usage = "write `retry(delays = [\"1s\", \"30s\", \"5m\"])` (one attempt, then one per delay; \
                 units ms, s, m, h) or `retry(none)` (the first transient failure dead-letters)";
    let RawValue::List(tokens) = option.value else {
        return Err(syn::Error::new(option.name.span(), usage));
    };
    let span = option.name.span();
    if let Ok(ident) = syn::parse2::<Ident>(tokens.clone()) {
        if ident == "none" {
            return Ok(Vec::new());
        }
    }
    let meta: syn::MetaNameValue = syn::parse2(tokens).map_err(|err| syn::Error::new(err.span(), usage))?;
    if !meta.path.is_ident("delays") {
        return Err(syn::Error::new_spanned(&meta.path, usage));
    }
    let Expr::Array(array) = meta.value else { return Err(syn::Error::new_spanned(&meta.value, usage)) };
    let mut delays = Vec::new();
    for element in &array.elems {
        let Expr::Lit(ExprLit { lit: Lit::Str(lit), .. }) = element else {
            return Err(syn::Error::new_spanned(element, usage));
        };
        let ms = parse_duration(&lit.value()).ok_or_else(|| {
            syn::Error::new(
                lit.span(),
                format!("`{}` is not a delay: write e.g. \"250ms\", \"5s\", \"2m\", \"1h\"", lit.value()),
            )
        })?;
        delays.push(ms);
    }
    if delays.is_empty() {
        return Err(syn::Error::new(span, "an empty `delays`: write `retry(none)` for no retries"));
    }
    Ok(delays)
}

/// `250ms`, `5s`, `2m`, `1h`, `7d` in milliseconds (at least 1).
pub(crate) fn parse_duration(text: &str) -> Option<u64> {
    let digits = text.trim().bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.trim().split_at(digits);
    let number: u64 = number.parse().ok()?;
    let factor = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    number.checked_mul(factor).filter(|ms| *ms > 0)
}

impl KeySpec {
    /// `@…` forms, a template with `{…}`, or a field path.
    pub(crate) fn parse(lit: LitStr) -> syn::Result<Self> {
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
    NAMES
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
