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
    let message_assoc = quote_spanned! {message_ty.span()=> type Message = #message_ty; };
    let conn_expr = quote_spanned! {conn_ty.span()=>
        <#conn_ty as __IdemqConn<'_>>::__idemq_conn(__idemq_conn)
    };
    let into_result = quote_spanned! {output.span()=>
        __IdemqResult::__idemq_into(result)
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
                #[diagnostic::on_unimplemented(
                    message = "a handler's first argument is the transaction's connection, not `{Self}`",
                    label = "write `&mut AsyncPgConnection` here",
                    note = "the handler runs inside idemq's dedup transaction: take `conn: &mut diesel_async::AsyncPgConnection`"
                )]
                trait __IdemqConn<'c> {
                    fn __idemq_conn(conn: &'c mut ::idemq::__private::AsyncPgConnection) -> Self;
                }
                impl<'c> __IdemqConn<'c> for &'c mut ::idemq::__private::AsyncPgConnection {
                    fn __idemq_conn(conn: &'c mut ::idemq::__private::AsyncPgConnection) -> Self {
                        conn
                    }
                }
                #[diagnostic::on_unimplemented(
                    message = "a handler returns `Result<(), E>`, not `{Self}`",
                    label = "write `Result<(), YourError>` here",
                    note = "`E` is any `std::error::Error + Send + Sync + 'static` (retried) or `idemq::HandlerError`"
                )]
                trait __IdemqResult {
                    fn __idemq_into(self) -> ::core::result::Result<(), ::idemq::HandlerError>;
                }
                impl<E: ::core::convert::Into<::idemq::HandlerError>> __IdemqResult for ::core::result::Result<(), E> {
                    fn __idemq_into(self) -> ::core::result::Result<(), ::idemq::HandlerError> {
                        self.map_err(::core::convert::Into::into)
                    }
                }
                let __idemq_conn = #conn_expr;
                ::std::boxed::Box::pin(async move {
                    let result = #ident::call(__idemq_conn, __idemq_message).await;
                    #into_result
                })
            }
        }
    }
}
