//! The handler fn: parsed with syn, checked for the shape the runtime calls.
//!
//! Checks that only the compiler can make (the connection type, the message's
//! `Deserialize`, the error's conversion) are left to it, with the generated code
//! spanned on the user's tokens so its errors underline them.

use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, PatType, ReturnType, Type};

/// A handler fn that has the right shape.
pub(crate) struct HandlerFn {
    pub(crate) item: ItemFn,
    /// The first argument's type, as written (`&mut AsyncPgConnection`).
    pub(crate) conn_ty: Type,
    /// The second argument's type: the message.
    pub(crate) message_ty: Type,
    /// The declared return type.
    pub(crate) output: Type,
}

impl HandlerFn {
    /// Checks the fn's shape, collecting every error.
    pub(crate) fn validate(item: ItemFn) -> syn::Result<Self> {
        let mut errors: Vec<syn::Error> = Vec::new();
        let sig = &item.sig;
        if sig.asyncness.is_none() {
            errors.push(syn::Error::new(
                sig.fn_token.span(),
                format!("#[idempotent_handler] needs an async fn: write `async fn {}(...)`", sig.ident),
            ));
        }
        if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
            errors.push(syn::Error::new(
                sig.generics.span(),
                "a handler cannot be generic: the runtime needs one concrete message type; \
                 write one handler per message type",
            ));
        }
        if let Some(variadic) = &sig.variadic {
            errors.push(syn::Error::new(variadic.span(), "a handler cannot be variadic"));
        }
        let expected = "a handler takes `(conn: &mut AsyncPgConnection, message: YourMessage)`";
        let mut typed = Vec::new();
        for arg in &sig.inputs {
            match arg {
                FnArg::Receiver(receiver) => errors.push(syn::Error::new(
                    receiver.span(),
                    format!("a handler is a free fn, not a method: remove `self`; {expected}"),
                )),
                FnArg::Typed(pat) => typed.push(pat),
            }
        }
        let (conn_ty, message_ty) = match typed.as_slice() {
            [conn, message] => (check_conn(conn, &mut errors), check_message(message, &mut errors)),
            _ => {
                errors.push(syn::Error::new(
                    sig.paren_token.span.join(),
                    format!("expected 2 arguments, found {}; {expected}", sig.inputs.len()),
                ));
                (None, None)
            }
        };
        let output = match &sig.output {
            ReturnType::Type(_, ty) => Some((**ty).clone()),
            ReturnType::Default => {
                errors.push(syn::Error::new(
                    sig.paren_token.span.close(),
                    "a handler returns `Result<(), E>` (E: any error, or idemq::HandlerError): \
                     add `-> Result<(), YourError>`",
                ));
                None
            }
        };
        let mut errors = errors.into_iter();
        if let Some(mut first) = errors.next() {
            errors.for_each(|err| first.combine(err));
            return Err(first);
        }
        match (conn_ty, message_ty, output) {
            (Some(conn_ty), Some(message_ty), Some(output)) => Ok(Self { item, conn_ty, message_ty, output }),
            _ => unreachable!("every missing part records an error"),
        }
    }
}

fn check_conn(arg: &PatType, errors: &mut Vec<syn::Error>) -> Option<Type> {
    match &*arg.ty {
        Type::Reference(reference) if reference.mutability.is_some() => Some((*arg.ty).clone()),
        other => {
            errors.push(syn::Error::new(
                other.span(),
                "the first argument is the transaction's connection: write `conn: &mut AsyncPgConnection`",
            ));
            None
        }
    }
}

fn check_message(arg: &PatType, errors: &mut Vec<syn::Error>) -> Option<Type> {
    match &*arg.ty {
        Type::Reference(reference) => {
            errors.push(syn::Error::new(
                reference.span(),
                "take the message by value (e.g. `message: PaymentRequested`): \
                 the runtime decodes it and hands it over",
            ));
            None
        }
        Type::ImplTrait(_) | Type::Infer(_) => {
            errors.push(syn::Error::new(
                arg.ty.span(),
                "the message needs a concrete type the body is decoded into",
            ));
            None
        }
        ty => Some(ty.clone()),
    }
}
