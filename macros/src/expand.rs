//! Code generation: the unit struct that replaces the fn and its `idemq::Handler` impl.
//!
//! A batch handler (`batch: &mut Batch<M>`) gets `batched` (true), `handle_batch`
//! (the fn) and a `handle` that runs a batch of one.
//!
//! The type checks the macro cannot make itself go through traits of
//! `idemq::__private` (`__IdemqConnection`, `__IdemqContext`, `__IdemqResult`,
//! `__IdemqOutput`, `__IdemqError`, and for batch handlers `__IdemqBatch` and
//! `__IdemqBatchOutput`), defined once there: each has an
//! `on_unimplemented` message saying what to write, is used on the user's own tokens
//! (so the error underlines them), and its impl is `do_not_recommend` (so rustc
//! reports that message, not the impl's unmet bound or a pointer into the expansion).

use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::ItemFn;

use crate::attr::{KeySpec, Options, Part, SagaOptions, Source};
use crate::errors::Errors;
use crate::handler::{HandlerFn, Role};

pub(crate) fn idempotent_handler(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item: ItemFn = match syn::parse2(item.clone()) {
        Ok(item) => item,
        Err(err) => {
            let err = syn::Error::new(
                err.span(),
                "#[idempotent_handler] goes on an async fn: `async fn name(conn: &mut AsyncPgConnection, message: YourMessage) -> Result<(), E>`",
            )
            .to_compile_error();
            return quote! { #item #err };
        }
    };
    let options = Options::parse(attr);
    let handler = HandlerFn::validate(item.clone());
    let mut errors = Errors::default();
    let (options, handler) = (errors.take(options), errors.take(handler));
    if let (Some(options), Some(handler)) = (&options, &handler) {
        if let (Some(saga), None) = (&options.saga, &handler.saga_ty) {
            errors.push(syn::Error::new(
                saga.span,
                "`saga(..)` is for a saga's step: take the saga as an argument, \
                 `saga: &mut idemq::saga::Saga<YourState>`",
            ));
        }
        if let (Some(span), Some(_)) = (options.no_dedup, &handler.saga_ty) {
            errors.push(syn::Error::new(
                span,
                "a saga's step needs its dedup rows: without them a duplicate or a redelivery would \
                 run the step again and move the saga twice; remove `dedup = false`",
            ));
        }
    }
    match (errors.finish(|| ()), options, handler) {
        (Ok(()), Some(options), Some(handler)) => expand(&options, &handler),
        (Err(err), _, _) => fallback(&item, &err),
        (Ok(()), _, _) => unreachable!("a missing part always records an error"),
    }
}

/// The user's fn unchanged plus the errors, so the rest of the crate still type-checks.
fn fallback(item: &ItemFn, err: &syn::Error) -> TokenStream {
    let err = err.to_compile_error();
    quote! { #item #err }
}

fn expand(options: &Options, handler: &HandlerFn) -> TokenStream {
    let HandlerFn {
        item,
        conn_ty,
        message_ty,
        message_by_ref,
        batch_ty,
        ctx_ty,
        roles,
        output,
        error_ty,
        ok_ty,
        saga_ty,
    } = handler;
    let ItemFn { attrs, vis, sig, block } = item;
    let ident = &sig.ident;
    let inputs = &sig.inputs;
    let name = match &options.name {
        Some(name) => name.value(),
        None => ident.to_string(),
    };
    // Key and lane expressions name the message through this binding.
    let message_binding = Ident::new(MESSAGE, Span::mixed_site());
    let (key_expr, key_path) = match &options.key {
        Some(spec) => {
            let key_path = spec.describe();
            (key_expr(spec), quote! { #key_path })
        }
        // No key in the attribute: the message type's own (`#[derive(Message)]` with
        // `#[message(key)]`), or an error on the message type saying what to write.
        None => (
            quote_spanned! {message_ty.span()=>
                <#message_ty as ::idemq::key::KeyedMessage>::message_key(__idemq_message)
            },
            quote_spanned! {message_ty.span()=> <#message_ty as ::idemq::key::KeyedMessage>::KEY_PATH },
        ),
    };
    // A lane reads its field the way the key does (any type a key may have).
    let lane = options.lane.as_ref().map(|lane| {
        let (lane_lit, lane_segments) = (&lane.lit, &lane.segments);
        let lane_path = lane_lit.value();
        let lane_expr = field_expr(lane_lit, lane_segments);
        quote! {
            fn lane_path(&self) -> ::core::option::Option<&'static str> {
                ::core::option::Option::Some(#lane_path)
            }

            fn lane(
                &self,
                __idemq_message: &<Self as ::idemq::Handler>::Message,
            ) -> ::core::option::Option<::core::result::Result<::idemq::Key, ::idemq::key::KeyError>> {
                let #message_binding = __idemq_message;
                ::core::option::Option::Some(#lane_expr)
            }
        }
    });
    // A saga's step: the saga's correlation key, read as the saga says for this
    // message type (an error on the message type if the saga does not take it).
    let saga_key = saga_ty.as_ref().map(|state_ty| {
        let takes = quote_spanned! {message_ty.span()=> <#state_ty as ::idemq::saga::Takes<#message_ty>> };
        quote! {
            fn saga_key(
                &self,
                __idemq_message: &<Self as ::idemq::Handler>::Message,
                __idemq_metadata: &::idemq::Metadata<'_>,
            ) -> ::core::option::Option<::core::result::Result<::idemq::Key, ::idemq::key::KeyError>> {
                ::core::option::Option::Some(#takes::correlate(__idemq_message, __idemq_metadata))
            }

            fn saga_key_path(&self) -> ::core::option::Option<&'static str> {
                ::core::option::Option::Some(#takes::KEY_PATH)
            }

            fn saga(&self) -> ::core::option::Option<::idemq::__private::SagaShape> {
                ::core::option::Option::Some(::idemq::__private::SagaShape {
                    name: <#state_ty as ::idemq::saga::SagaState>::NAME,
                    takes: <#state_ty as ::idemq::saga::SagaState>::TAKES,
                    sends: <#state_ty as ::idemq::saga::SagaState>::SENDS,
                })
            }
        }
    });
    let settings = settings(options);
    let reply = reply_type(ok_ty.as_ref(), batch_ty.is_some());
    // The checks only the compiler can make go through local traits whose
    // `on_unimplemented` says what to write, each spanned on the user's own tokens.
    let message_assoc = quote_spanned! {message_ty.span()=> type Message = #message_ty; };
    let conn_expr = quote_spanned! {conn_ty.span()=>
        <#conn_ty as ::idemq::__private::__IdemqConnection<'_>>::__idemq_connection(__idemq_conn)
    };
    let ctx_expr = ctx_ty.as_ref().map(|ctx_ty| {
        quote_spanned! {ctx_ty.span()=>
            let __idemq_ctx = <#ctx_ty as ::idemq::__private::__IdemqContext<'_>>::__idemq_context(&mut *__idemq_ctx);
        }
    });
    // The arguments in the fn's own order.
    let call_args = roles
        .iter()
        .map(|role| match role {
            Role::Connection => quote! { __idemq_conn },
            Role::Message if *message_by_ref => quote! { &__idemq_message },
            Role::Message => quote! { __idemq_message },
            Role::Context => quote! { __idemq_ctx },
            Role::Batch => quote! { __idemq_batch },
            Role::Saga => quote! { &mut __idemq_saga },
        })
        .collect::<Vec<_>>();
    let unused_ctx = ctx_ty.is_none().then(|| quote! { let _ = __idemq_ctx; });
    // Naming the return type underlines all of it; `impl Trait` (legal in an async
    // fn's return type) cannot be named in an expression, so it is inferred instead.
    let result_expr = if mentions_impl_trait(output.to_token_stream()) {
        quote_spanned! {output.span()=> ::idemq::__private::__IdemqResult::__idemq_result(result) }
    } else {
        quote_spanned! {output.span()=> <#output as ::idemq::__private::__IdemqResult<_, _>>::__idemq_result(result) }
    };
    let output_expr =
        quote_spanned! {output.span()=> ::idemq::__private::__IdemqOutput::__idemq_output(&value) };
    let error_span = error_ty.as_ref().map_or_else(|| output.span(), Spanned::span);
    let error_expr = quote_spanned! {error_span=>
        ::idemq::__private::__IdemqError::__idemq_error(error)
    };
    // Spanned on the fn's name: a future that is not `Send` is reported there (with
    // rustc's note on the value held across an `.await`), not on the attribute.
    // The fn called, its result converted: `ok` turns its `Ok` value into the trait's.
    let call_and_convert = |ok: &TokenStream| {
        quote_spanned! {ident.span()=>
            ::std::boxed::Box::pin(async move {
                let result = #ident::call(#(#call_args),*).await;
                match #result_expr {
                    ::core::result::Result::Ok(value) => #ok,
                    ::core::result::Result::Err(error) => ::core::result::Result::Err(#error_expr),
                }
            })
        }
    };
    let handle = match (batch_ty, saga_ty) {
        // A saga's step: the saga is locked and read before the fn, written after it
        // returned `Ok`, on the same connection (see `idemq::saga`).
        (None, Some(state_ty)) => saga_handle(
            state_ty,
            options.saga.as_ref(),
            &StepCall {
                ident,
                conn_expr: &conn_expr,
                ctx_expr: ctx_expr.as_ref(),
                call_args: &call_args,
                result_expr: &result_expr,
                output_expr: &output_expr,
                error_expr: &error_expr,
            },
        ),
        (None, None) => {
            let boxed = call_and_convert(&output_expr);
            quote! {
                fn handle<'__idemq_a>(
                    &'__idemq_a self,
                    __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
                    __idemq_ctx: &'__idemq_a mut ::idemq::Context,
                    __idemq_message: <Self as ::idemq::Handler>::Message,
                ) -> ::idemq::BoxFuture<'__idemq_a, ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>> {
                    let __idemq_conn = #conn_expr;
                    #ctx_expr
                    #unused_ctx
                    #boxed
                }
            }
        }
        // A batch handler: `handle_batch` calls the fn; `handle` (one message, for
        // callers of the trait) is a batch of one.
        (Some(batch_ty), _) => {
            let batch_expr = quote_spanned! {batch_ty.span()=>
                <#batch_ty as ::idemq::__private::__IdemqBatch<'_, <Self as ::idemq::Handler>::Message>>::__idemq_batch(__idemq_batch)
            };
            let results_span = ok_ty.as_ref().map_or_else(|| output.span(), Spanned::span);
            let results_expr = quote_spanned! {results_span=>
                ::idemq::__private::__IdemqBatchOutput::__idemq_batch_output(value, __idemq_count)
            };
            let boxed = call_and_convert(&results_expr);
            quote! {
                fn batched(&self) -> bool {
                    true
                }

                fn handle<'__idemq_a>(
                    &'__idemq_a self,
                    __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
                    __idemq_ctx: &'__idemq_a mut ::idemq::Context,
                    __idemq_message: <Self as ::idemq::Handler>::Message,
                ) -> ::idemq::BoxFuture<'__idemq_a, ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>> {
                    ::idemq::__private::__idemq_batch_of_one(self, __idemq_conn, __idemq_ctx, __idemq_message)
                }

                fn handle_batch<'__idemq_a>(
                    &'__idemq_a self,
                    __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
                    __idemq_batch: &'__idemq_a mut ::idemq::Batch<<Self as ::idemq::Handler>::Message>,
                ) -> ::idemq::BoxFuture<'__idemq_a, ::core::result::Result<::std::vec::Vec<::idemq::HandlerOutput>, ::idemq::HandlerError>> {
                    let __idemq_conn = #conn_expr;
                    let __idemq_count = __idemq_batch.len();
                    let __idemq_batch = #batch_expr;
                    #boxed
                }
            }
        }
    };
    // The user's docs describe the handler: they go on the type users register; the
    // other attributes (`#[allow]`, `#[tracing::instrument]`, …) stay on the fn.
    let (docs, fn_attrs): (Vec<_>, Vec<_>) = attrs.iter().partition(|attr| attr.path().is_ident("doc"));
    let described = match &options.key {
        Some(spec) => format!("dedup key `{}`", spec.describe()),
        None => "dedup key from the message type".to_owned(),
    };
    let doc = format!(
        " Idempotent handler `{name}` ({described}); register it with the runtime. \
         The original fn is [`{ident}::call`]."
    );
    let call_doc = format!(
        " The fn `{ident}` as written, for unit tests; the runtime calls it through `idemq::Handler`, \
         inside its transaction."
    );
    let doc = if docs.is_empty() {
        quote! { #[doc = #doc] }
    } else {
        quote! { #(#docs)* #[doc = ""] #[doc = #doc] }
    };

    quote! {
        #doc
        #[allow(non_camel_case_types)]
        #[derive(::core::fmt::Debug, ::core::clone::Clone, ::core::marker::Copy, ::core::default::Default)]
        #vis struct #ident;

        impl #ident {
            #[doc = #call_doc]
            #(#fn_attrs)*
            #vis async fn call(#inputs) -> #output #block
        }

        impl ::idemq::Handler for #ident {
            #message_assoc

            fn name(&self) -> &'static str {
                #name
            }

            fn key_path(&self) -> &'static str {
                #key_path
            }

            fn key(
                &self,
                __idemq_message: &<Self as ::idemq::Handler>::Message,
                __idemq_metadata: &::idemq::Metadata<'_>,
            ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
                let _ = __idemq_metadata;
                let #message_binding = __idemq_message;
                #key_expr
            }

            #lane

            #saga_key

            #settings

            #reply

            #[allow(clippy::needless_borrow)] // the borrow is the probe: it picks the impl
            fn wire(&self) -> ::idemq::__private::Wire<<Self as ::idemq::Handler>::Message> {
                // Which of `MessageType` and `Versioned` the message type implements,
                // found at compile time (see `idemq::__private::__IdemqProbe`).
                #[allow(unused_imports)]
                use ::idemq::__private::{
                    __IdemqNamedProbe as _, __IdemqNoSchemaProbe as _, __IdemqSchemaProbe as _,
                    __IdemqUnnamedProbe as _, __IdemqUnversionedProbe as _, __IdemqVersionedProbe as _,
                };
                let probe = ::idemq::__private::__IdemqProbe::<<Self as ::idemq::Handler>::Message>::new();
                ::idemq::__private::Wire::of(
                    (&probe).__idemq_type_name(),
                    (&probe).__idemq_versions(),
                    (&probe).__idemq_schema(),
                )
            }

            #handle
        }
    }
}

/// What a saga step's `handle` calls, as `expand` made it for the fn.
struct StepCall<'a> {
    ident: &'a Ident,
    conn_expr: &'a TokenStream,
    /// The context converted to the fn's type, a reborrow (the saga's `__end` takes it after).
    ctx_expr: Option<&'a TokenStream>,
    call_args: &'a [TokenStream],
    result_expr: &'a TokenStream,
    output_expr: &'a TokenStream,
    error_expr: &'a TokenStream,
}

/// A saga step's `handle`: the saga locked and read (`__begin`, or the message acked
/// without the step as its policy says), the fn called with it, the saga written back
/// (`__end`) once the fn returned `Ok` — on the handler's connection, in its
/// transaction.
fn saga_handle(state_ty: &syn::Type, policy: Option<&SagaOptions>, call: &StepCall<'_>) -> TokenStream {
    let StepCall { ident, conn_expr, ctx_expr, call_args, result_expr, output_expr, error_expr } = *call;

    let missing = Ident::new(policy.and_then(|p| p.missing).unwrap_or("Retry"), Span::call_site());
    let finished = Ident::new(policy.and_then(|p| p.finished).unwrap_or("Ignore"), Span::call_site());
    let start = if missing == "Start" {
        quote_spanned! {state_ty.span()=>
            ::core::option::Option::Some(::idemq::__private::__idemq_saga_start::<#state_ty>)
        }
    } else {
        quote! { ::core::option::Option::None }
    };
    quote_spanned! {ident.span()=>
        fn handle<'__idemq_a>(
            &'__idemq_a self,
            __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
            __idemq_ctx: &'__idemq_a mut ::idemq::Context,
            __idemq_message: <Self as ::idemq::Handler>::Message,
        ) -> ::idemq::BoxFuture<'__idemq_a, ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>> {
            ::std::boxed::Box::pin(async move {
                let ::core::option::Option::Some(mut __idemq_saga) = ::idemq::saga::__begin::<#state_ty>(
                    &mut *__idemq_conn,
                    &mut *__idemq_ctx,
                    ::idemq::saga::IfMissing::#missing,
                    ::idemq::saga::IfFinished::#finished,
                    #start,
                )
                .await?
                else {
                    return ::core::result::Result::Ok(::idemq::HandlerOutput::none());
                };
                let result = {
                    let __idemq_conn = #conn_expr;
                    #ctx_expr
                    #ident::call(#(#call_args),*).await
                };
                match #result_expr {
                    ::core::result::Result::Ok(value) => {
                        ::idemq::saga::__end(&mut *__idemq_conn, &mut *__idemq_ctx, __idemq_saga).await?;
                        #output_expr
                    }
                    ::core::result::Result::Err(error) => ::core::result::Result::Err(#error_expr),
                }
            })
        }
    }
}

/// `Handler::reply_type`: the handler's result type (a batch handler's: the `R` of its
/// `Vec<R>`), unless it is `()` or not written out (an alias of `Result`).
fn reply_type(ok_ty: Option<&syn::Type>, batch: bool) -> Option<TokenStream> {
    let mut ty = ok_ty?;
    if batch {
        let syn::Type::Path(path) = ty else { return None };
        let last = path.path.segments.last()?;
        let syn::PathArguments::AngleBracketed(args) = &last.arguments else { return None };
        match (last.ident == "Vec", args.args.first()) {
            (true, Some(syn::GenericArgument::Type(inner))) => ty = inner,
            _ => return None,
        }
    }
    if matches!(ty, syn::Type::Tuple(tuple) if tuple.elems.is_empty()) {
        return None;
    }
    Some(quote! {
        fn reply_type(&self) -> ::core::option::Option<&'static str> {
            ::core::option::Option::Some(::core::any::type_name::<#ty>())
        }
    })
}

/// The `Handler` methods of the options that tune the runtime per handler.
fn settings(options: &Options) -> TokenStream {
    let queue = options.queue.as_ref().map(|queue| {
        quote! {
            fn queue(&self) -> ::core::option::Option<&'static str> {
                ::core::option::Option::Some(#queue)
            }
        }
    });
    let retry = options.retry.as_ref().map(|delays| {
        quote! {
            fn retry(&self) -> ::core::option::Option<::idemq::RetryPolicy> {
                ::core::option::Option::Some(::idemq::RetryPolicy::new([
                    #(::core::time::Duration::from_millis(#delays)),*
                ]))
            }
        }
    });
    let on_conflict = options.on_conflict_ignore.map(|ignore| {
        let variant = if ignore { quote!(Ignore) } else { quote!(DeadLetter) };
        quote! {
            fn on_conflict(&self) -> ::core::option::Option<::idemq::OnConflict> {
                ::core::option::Option::Some(::idemq::OnConflict::#variant)
            }
        }
    });
    let batch = options.batch.map(|size| {
        quote! {
            fn batch_size(&self) -> ::core::option::Option<usize> {
                ::core::option::Option::Some(#size)
            }
        }
    });
    let dedup = (!options.dedup).then(|| {
        quote! {
            fn dedup(&self) -> bool {
                false
            }
        }
    });
    let key_lifetime = options.idempotency_key_lifetime.map(|ms| {
        quote! {
            fn idempotency_key_lifetime(&self) -> ::core::option::Option<::core::time::Duration> {
                ::core::option::Option::Some(::core::time::Duration::from_millis(#ms))
            }
        }
    });
    quote! { #queue #retry #on_conflict #batch #dedup #key_lifetime }
}

/// The message, as key expressions name it (bound with mixed-site hygiene).
pub(crate) const MESSAGE: &str = "__idemq_keyed";

/// The expression making the key (in `Handler::key`, where `__idemq_message` and
/// `__idemq_metadata` are in scope). Spanned on the key literal: a wrong field
/// underlines the `key` string, a key of an unusable type says so there.
pub(crate) fn key_expr(spec: &KeySpec) -> TokenStream {
    match spec {
        KeySpec::Single { lit, source } => source_expr(lit, source),
        KeySpec::Template { lit, parts } => {
            let parts = parts.iter().map(|part| match part {
                Part::Literal(text) => quote! { ::idemq::key::TemplatePart::Literal(#text) },
                Part::Value(source) => {
                    let value = source_expr(lit, source);
                    quote! { ::idemq::key::TemplatePart::Value(#value) }
                }
            });
            quote! { ::idemq::Key::from_template(&[#(#parts),*]) }
        }
        KeySpec::Function(path) => quote_spanned! {path.span()=>
            ::idemq::key::KeyFn::key(&#path, __idemq_message, __idemq_metadata)
        },
    }
}

/// One source's `Result<Key, KeyError>`.
fn source_expr(lit: &syn::LitStr, source: &Source) -> TokenStream {
    match source {
        // Every token at the literal, with the macro's own (mixed-site) hygiene: a
        // wrong field underlines the key string, and rustc offers no "similar field"
        // fix that would replace the whole literal, quotes and all, with a bare name.
        // The explicit deref names the message type (not `&Message`) in errors.
        Source::Field(segments) => field_expr(lit, segments),
        Source::MessageId => quote! { __idemq_metadata.message_id_key() },
        Source::Header(name) => quote! { __idemq_metadata.header_key(#name) },
        Source::Hash => quote! { ::core::result::Result::Ok(__idemq_metadata.hash_key()) },
    }
}

/// A field path's key: every token at the literal, with the macro's own (mixed-site)
/// hygiene, so a wrong field underlines the key string and rustc offers no "similar
/// field" fix replacing the whole literal, quotes and all, with a bare name. The
/// explicit deref names the message type (not `&Message`) in errors.
fn field_expr(lit: &syn::LitStr, segments: &[syn::Member]) -> TokenStream {
    let span = Span::mixed_site().located_at(lit.span());
    let message = Ident::new(MESSAGE, span);
    quote_spanned! {span=> ::idemq::key::KeyField::to_key(&(*#message) #(. #segments)*) }
}

/// Whether the tokens hold an `impl` (e.g. `Result<(), impl Error>`).
fn mentions_impl_trait(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == "impl",
        TokenTree::Group(group) => mentions_impl_trait(group.stream()),
        _ => false,
    })
}
