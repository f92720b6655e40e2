//! Code generation: the unit struct that replaces the fn and its `idemq::Handler` impl.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::ItemFn;

use crate::attr::Options;
use crate::handler::HandlerFn;

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
    match (options, handler) {
        (Ok(options), Ok(handler)) => expand(&options, &handler),
        (Err(mut a), Err(b)) => {
            a.combine(b);
            fallback(&item, &a)
        }
        (Err(err), _) | (_, Err(err)) => fallback(&item, &err),
    }
}

/// The user's fn unchanged plus the errors, so the rest of the crate still type-checks.
fn fallback(item: &ItemFn, err: &syn::Error) -> TokenStream {
    let err = err.to_compile_error();
    quote! { #item #err }
}

fn expand(options: &Options, handler: &HandlerFn) -> TokenStream {
    let HandlerFn { item, conn_ty, message_ty, output } = handler;
    let ItemFn { attrs, vis, sig, block } = item;
    let ident = &sig.ident;
    let inputs = &sig.inputs;
    let name = match &options.name {
        Some(name) => name.value(),
        None => ident.to_string(),
    };
    let key_lit = &options.key.lit;
    let key_path = key_lit.value();
    let segments = &options.key.segments;
    // Spanned on the key literal: a wrong field underlines the `key` string, a key of
    // an unusable type says so there.
    let key_expr = quote_spanned! {key_lit.span()=>
        ::idemq::KeyField::to_key(&__idemq_message #(. #segments)*)
    };
    // Spanned on the user's types, so a mismatch underlines what they wrote.
    let conn_arg = quote_spanned! {conn_ty.span()=> __idemq_conn };
    let message_assoc = quote_spanned! {message_ty.span()=> type Message = #message_ty; };
    let into_error = quote_spanned! {output.span()=>
        ::idemq::__private::into_handler_result(result)
    };
    let boxed = quote_spanned! {sig.span()=>
        ::std::boxed::Box::pin(async move {
            let result = #ident::call(#conn_arg, __idemq_message).await;
            #into_error
        })
    };
    let doc = format!(
        "Idempotent handler `{name}` (dedup key `{key_path}`); register it with the runtime. \
         The original fn is [`{ident}::call`]."
    );

    quote! {
        #[doc = #doc]
        #[allow(non_camel_case_types)]
        #[derive(::core::fmt::Debug, ::core::clone::Clone, ::core::marker::Copy, ::core::default::Default)]
        #vis struct #ident;

        impl #ident {
            #(#attrs)*
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
            ) -> ::core::result::Result<::idemq::Key, ::idemq::KeyError> {
                #key_expr
            }

            fn handle<'__idemq_a>(
                &'__idemq_a self,
                __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
                __idemq_message: <Self as ::idemq::Handler>::Message,
            ) -> ::idemq::BoxFuture<'__idemq_a, ::core::result::Result<(), ::idemq::HandlerError>> {
                #boxed
            }
        }
    }
}
