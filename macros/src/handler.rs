//! The handler fn: parsed with syn, checked for the shape the runtime calls.
//!
//! Checks that only the compiler can make (the connection type, the message's
//! `Deserialize`, the error's conversion) are left to it, with the generated code
//! spanned on the user's tokens so its errors underline them (see `expand`).

use syn::spanned::Spanned;

use crate::errors::Errors;
use syn::{FnArg, GenericArgument, ItemFn, PatType, PathArguments, ReturnType, Type};

/// What an argument of the handler fn is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Connection,
    Message,
    Context,
    /// `&mut idemq::Batch<M>`: the new messages of a transaction, together.
    Batch,
    /// `&mut idemq::saga::Saga<S>`: the saga the handler is a step of.
    Saga,
}

/// A handler fn that has the right shape.
pub(crate) struct HandlerFn {
    pub(crate) item: ItemFn,
    /// The first argument's type, as written (`&mut AsyncPgConnection`).
    pub(crate) conn_ty: Type,
    /// The message's type (`T` of a `msg: T` or `msg: &T` argument, `M` of a
    /// `batch: &mut Batch<M>` argument).
    pub(crate) message_ty: Type,
    /// The batch argument's type as written (`&mut idemq::Batch<M>`), for a batch
    /// handler.
    pub(crate) batch_ty: Option<Type>,
    /// The message is taken as `&T`.
    pub(crate) message_by_ref: bool,
    /// The context argument's type (`&mut Context` or `&Context`), if taken.
    pub(crate) ctx_ty: Option<Type>,
    /// What each argument is, in the fn's order.
    pub(crate) roles: Vec<Role>,
    /// The declared return type.
    pub(crate) output: Type,
    /// The `E` of a written-out `Result<(), E>`, to underline error-type errors on it.
    pub(crate) error_ty: Option<Type>,
    /// The `R` of a written-out `Result<R, E>`, to underline a batch handler's
    /// result errors on it.
    pub(crate) ok_ty: Option<Type>,
    /// The saga's state type `S` of a `saga: &mut Saga<S>` argument.
    pub(crate) saga_ty: Option<Type>,
}

impl HandlerFn {
    /// Checks the fn's shape, collecting every error.
    pub(crate) fn validate(item: ItemFn) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let sig = &item.sig;
        if sig.asyncness.is_none() {
            errors.push(syn::Error::new(
                sig.fn_token.span(),
                format!("#[idempotent_handler] needs an async fn: write `async fn {}(...)`", sig.ident),
            ));
        }
        let generic = "a handler cannot be generic: the runtime needs one concrete message type; \
                       write one handler per message type";
        if !sig.generics.params.is_empty() {
            errors.push(syn::Error::new_spanned(&sig.generics, generic));
        } else if let Some(where_clause) = &sig.generics.where_clause {
            errors.push(syn::Error::new_spanned(where_clause, generic));
        }
        if let Some(variadic) = &sig.variadic {
            errors.push(syn::Error::new(variadic.span(), "a handler cannot be variadic"));
        }
        let expected = "a handler takes `(conn: &mut AsyncPgConnection, message: YourMessage)` \
                        and optionally `ctx: &mut idemq::Context`";
        let mut typed = Vec::new();
        for arg in &sig.inputs {
            match arg {
                FnArg::Receiver(receiver) => errors.push(syn::Error::new_spanned(
                    receiver,
                    format!("a handler is a free fn, not a method: remove `self`; {expected}"),
                )),
                FnArg::Typed(pat) => typed.push(pat),
            }
        }
        // A saga step: `saga: &mut Saga<S>` anywhere after the connection; the rest
        // is read as without it.
        let mut saga = None;
        if let Some(at) = typed.iter().position(|arg| saga_state(&arg.ty).is_some()) {
            let arg = typed.remove(at);
            match saga_state(&arg.ty) {
                Some(Ok(state)) if at > 0 => saga = Some((at, state)),
                Some(Ok(_)) => errors.push(syn::Error::new_spanned(
                    &arg.ty,
                    "the saga comes after the connection: \
                     `(conn: &mut AsyncPgConnection, msg: YourMessage, saga: &mut Saga<YourState>)`",
                )),
                Some(Err(problem)) => errors.push(syn::Error::new_spanned(&arg.ty, problem)),
                None => unreachable!("found above"),
            }
            if let Some(second) = typed.iter().find(|arg| saga_state(&arg.ty).is_some()) {
                errors.push(syn::Error::new_spanned(
                    &second.ty,
                    "a handler is a step of one saga: take one `&mut Saga<..>` (a message that \
                     moves two sagas is taken by a step of each)",
                ));
            }
        }
        // A batch handler: `(conn, batch: &mut Batch<M>)`, and no context (each
        // message of the batch has its own).
        let batch_at = typed.iter().position(|arg| batch_message(&arg.ty).is_some());
        if let Some(at) = batch_at {
            if saga.is_some() {
                errors.push(syn::Error::new_spanned(
                    &typed[at].ty,
                    "a saga's step takes one message (`msg: YourMessage`), not a batch: each \
                     message locks and moves its saga on its own",
                ));
            }
            let arg = typed[at];
            let message = match batch_message(&arg.ty) {
                Some(Ok(message)) => Some((message, false)),
                Some(Err(problem)) => {
                    errors.push(syn::Error::new_spanned(&arg.ty, problem));
                    None
                }
                None => unreachable!("found above"),
            };
            let batch_ty = Some((*arg.ty).clone());
            let conn_ty = match typed.as_slice() {
                [conn, _] if at == 1 => check_conn(conn, &mut errors),
                [_, _] => {
                    errors.push(syn::Error::new_spanned(
                        &arg.ty,
                        "the batch comes after the connection: \
                         `(conn: &mut AsyncPgConnection, batch: &mut idemq::Batch<YourMessage>)`",
                    ));
                    None
                }
                [_] => {
                    errors.push(syn::Error::new(
                        sig.paren_token.span.join(),
                        "a batch handler takes the connection first: \
                         `(conn: &mut AsyncPgConnection, batch: &mut idemq::Batch<YourMessage>)`",
                    ));
                    None
                }
                _ => {
                    errors.push(syn::Error::new(
                        sig.paren_token.span.join(),
                        "a batch handler takes `(conn: &mut AsyncPgConnection, batch: &mut \
                         idemq::Batch<YourMessage>)` and nothing else: each message of the batch has \
                         its own context (`for (msg, ctx) in batch.iter_mut()`), so remove the \
                         `ctx` argument",
                    ));
                    None
                }
            };
            return finish(
                errors,
                item,
                (conn_ty, message, None, vec![Role::Connection, Role::Batch]),
                batch_ty,
                None,
            );
        }
        // After the connection, the argument of type `&mut Context` (or `&Context`)
        // is the context, the other the message: either order is accepted.
        let parts = match typed.as_slice() {
            [conn, message] => (
                check_conn(conn, &mut errors),
                check_message(message, &mut errors),
                None,
                vec![Role::Connection, Role::Message],
            ),
            [conn, a, b] => {
                let conn_ty = check_conn(conn, &mut errors);
                let (message, ctx, roles) = match (is_context(&a.ty), is_context(&b.ty)) {
                    (false, true) => (a, b, vec![Role::Connection, Role::Message, Role::Context]),
                    (true, false) => (b, a, vec![Role::Connection, Role::Context, Role::Message]),
                    _ => {
                        errors.push(syn::Error::new(
                            sig.paren_token.span.join(),
                            "of the two arguments after the connection, one is the message \
                             (`message: YourMessage` or `&YourMessage`) and one the context \
                             (`ctx: &mut idemq::Context`, or `&idemq::Context`)",
                        ));
                        (a, b, Vec::new())
                    }
                };
                (conn_ty, check_message(message, &mut errors), Some((*ctx.ty).clone()), roles)
            }
            _ => {
                errors.push(syn::Error::new(
                    sig.paren_token.span.join(),
                    format!("expected 2 or 3 arguments, found {}; {expected}", sig.inputs.len()),
                ));
                (None, None, None, Vec::new())
            }
        };
        let (conn_ty, message, ctx_ty, mut roles) = parts;
        let saga_ty = saga.map(|(at, state)| {
            if !roles.is_empty() {
                roles.insert(at.min(roles.len()), Role::Saga);
            }
            state
        });
        finish(errors, item, (conn_ty, message, ctx_ty, roles), None, saga_ty)
    }
}

/// The parsed arguments: the connection's type, the message's (and whether by
/// reference), the context's, and each argument's role.
type Parts = (Option<Type>, Option<(Type, bool)>, Option<Type>, Vec<Role>);

/// The return type checked, and every error collected, into the handler fn.
fn finish(
    mut errors: Errors,
    item: ItemFn,
    parts: Parts,
    batch_ty: Option<Type>,
    saga_ty: Option<Type>,
) -> syn::Result<HandlerFn> {
    let sig = &item.sig;
    let (conn_ty, message, ctx_ty, roles) = parts;
    let output = match &sig.output {
        ReturnType::Type(_, ty) => Some((**ty).clone()),
        ReturnType::Default => {
            errors.push(syn::Error::new(
                sig.paren_token.span.close(),
                "a handler returns `Result<R, E>` (R: `()` or a result to store and reply with; \
                     E: any error, or idemq::HandlerError): add `-> Result<(), YourError>`",
            ));
            None
        }
    };
    let validated = errors.finish(|| ());
    validated?;
    match (conn_ty, message, output) {
        (Some(conn_ty), Some((message_ty, message_by_ref)), Some(output)) => {
            let (ok_ty, error_ty) = result_types(&output).unzip();
            Ok(HandlerFn {
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
            })
        }
        _ => unreachable!("every missing part records an error"),
    }
}

/// `M` of `&mut Batch<M>` (any path ending in `Batch` with one type argument; the
/// compiler then checks it is idemq's), or what is wrong with a `Batch` argument:
/// `None` for any other type.
fn batch_message(ty: &Type) -> Option<Result<Type, &'static str>> {
    let Type::Reference(reference) = peel(ty) else { return None };
    let mut types = type_args_of(&reference.elem, "Batch")?;
    match (reference.mutability.is_some(), types.len()) {
        (true, 1) => types.pop().map(Ok),
        (true, _) => Some(Err("a batch handler takes `batch: &mut idemq::Batch<YourMessage>`: \
                              name the message type the batch holds")),
        (false, 1) => Some(Err("take the batch as `&mut idemq::Batch<YourMessage>`: the handler \
                               publishes through each message's context in it")),
        // `&Batch` of a message type of the user's own named `Batch`.
        (false, _) => None,
    }
}

/// `S` of `&mut Saga<S>` (any path ending in `Saga` with one type argument; the
/// compiler then checks it is idemq's), or what is wrong with a `Saga` argument:
/// `None` for any other type.
fn saga_state(ty: &Type) -> Option<Result<Type, &'static str>> {
    let (mutable, elem) = match peel(ty) {
        Type::Reference(reference) => (reference.mutability.is_some(), &*reference.elem),
        ty => (false, ty),
    };
    let mut types = type_args_of(elem, "Saga")?;
    match (mutable, types.len()) {
        (true, 1) => types.pop().map(Ok),
        (false, 1) => Some(Err("take the saga as `saga: &mut Saga<YourState>`: the step changes its \
                               state, which is written back with the step's transaction")),
        _ => None,
    }
}

/// The type arguments of a path ending in `name` (`idemq::Batch<M>`: `[M]`; none
/// written: empty); `None` for any other type.
fn type_args_of(ty: &Type, name: &str) -> Option<Vec<Type>> {
    let Type::Path(path) = peel(ty) else { return None };
    let last = path.path.segments.last().filter(|last| path.qself.is_none() && last.ident == name)?;
    Some(match &last.arguments {
        PathArguments::AngleBracketed(args) => args
            .args
            .iter()
            .filter_map(|arg| match arg {
                GenericArgument::Type(ty) => Some(ty.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    })
}

/// `&Context` or `&mut Context` (any path ending in `Context`), or any `&mut`
/// (a message is never taken `&mut`): the context argument, told apart from the
/// message by its type. The compiler then checks it is idemq's `Context`.
fn is_context(ty: &Type) -> bool {
    let Type::Reference(reference) = peel(ty) else { return false };
    if reference.mutability.is_some() {
        return true;
    }
    let Type::Path(path) = peel(&reference.elem) else { return false };
    path.qself.is_none() && path.path.segments.last().is_some_and(|last| last.ident == "Context")
}

/// The type inside any invisible groups (from `macro_rules!` fragments) or parentheses.
fn peel(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => peel(&group.elem),
        Type::Paren(paren) => peel(&paren.elem),
        ty => ty,
    }
}

fn check_conn(arg: &PatType, errors: &mut Errors) -> Option<Type> {
    let message = match peel(&arg.ty) {
        Type::Reference(reference) if matches!(peel(&reference.elem), Type::ImplTrait(_)) => {
            "a handler cannot be generic over its connection: write `conn: &mut AsyncPgConnection`"
        }
        // The type itself is checked by the compiler, through the expansion.
        Type::Reference(reference) if reference.mutability.is_some() => return Some((*arg.ty).clone()),
        Type::Reference(_) => {
            "the connection must be mutable: write `conn: &mut AsyncPgConnection` \
             (the handler writes through it, inside the dedup transaction)"
        }
        _ => {
            "the first argument is the transaction's connection: \
             write `conn: &mut AsyncPgConnection`"
        }
    };
    errors.push(syn::Error::new_spanned(&arg.ty, message));
    None
}

/// The message type, and whether it is taken by reference (`&T`).
fn check_message(arg: &PatType, errors: &mut Errors) -> Option<(Type, bool)> {
    let (ty, by_ref) = match peel(&arg.ty) {
        Type::Reference(reference) if reference.mutability.is_some() => {
            errors.push(syn::Error::new_spanned(
                &arg.ty,
                "take the message by value or as `&T`, not `&mut`: the runtime decodes each \
                 message and hands it over",
            ));
            return None;
        }
        Type::Reference(reference) => (peel(&reference.elem), true),
        ty => (ty, false),
    };
    match ty {
        Type::ImplTrait(_) | Type::Infer(_) => {
            errors.push(syn::Error::new_spanned(
                &arg.ty,
                "the message needs a concrete type the body is decoded into, \
                 e.g. `message: PaymentRequested`",
            ));
            None
        }
        ty => Some((ty.clone(), by_ref)),
    }
}

/// `R` and `E` in `Result<R, E>` (any path ending in `Result` with two type arguments).
fn result_types(output: &Type) -> Option<(Type, Type)> {
    let Type::Path(path) = peel(output) else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    let mut types = args.args.iter().filter_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty),
        _ => None,
    });
    match (types.next(), types.next(), types.next()) {
        (Some(ok), Some(error), None) => Some((ok.clone(), error.clone())),
        _ => None,
    }
}
