/// Applies a payment.
///
/// Idempotent handler `apply_payment` (dedup key `payment_id`); register it with the runtime. The original fn is [`apply_payment::call`].
#[allow(non_camel_case_types)]
#[derive(
    ::core::fmt::Debug,
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::default::Default
)]
struct apply_payment;
impl apply_payment {
    /// The fn `apply_payment` as written, for unit tests; the runtime calls it through `idemq::Handler`, inside its transaction.
    async fn call(
        conn: &mut AsyncPgConnection,
        msg: PaymentRequested,
    ) -> Result<(), Error> {
        Ok(())
    }
}
impl ::idemq::Handler for apply_payment {
    type Message = PaymentRequested;
    fn name(&self) -> &'static str {
        "apply_payment"
    }
    fn key_path(&self) -> &'static str {
        "payment_id"
    }
    fn key(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
        __idemq_metadata: &::idemq::Metadata<'_>,
    ) -> ::core::result::Result<::idemq::Key, ::idemq::KeyError> {
        let _ = __idemq_metadata;
        let __idemq_keyed = __idemq_message;
        ::idemq::KeyField::to_key(&(*__idemq_keyed).payment_id)
    }
    fn handle<'__idemq_a>(
        &'__idemq_a self,
        __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
        __idemq_ctx: &'__idemq_a mut ::idemq::Context,
        __idemq_message: <Self as ::idemq::Handler>::Message,
    ) -> ::idemq::BoxFuture<
        '__idemq_a,
        ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>,
    > {
        #[diagnostic::on_unimplemented(
            message = "a handler's first argument is the transaction's connection, not `{Self}`",
            label = "write `&mut AsyncPgConnection` here",
            note = "the handler runs inside idemq's dedup transaction: \
                            take `conn: &mut diesel_async::AsyncPgConnection`"
        )]
        trait __IdemqConnection<'c> {
            fn __idemq_connection(
                conn: &'c mut ::idemq::__private::AsyncPgConnection,
            ) -> Self;
        }
        #[diagnostic::do_not_recommend]
        impl<'c> __IdemqConnection<'c>
        for &'c mut ::idemq::__private::AsyncPgConnection {
            fn __idemq_connection(
                conn: &'c mut ::idemq::__private::AsyncPgConnection,
            ) -> Self {
                conn
            }
        }
        #[diagnostic::on_unimplemented(
            message = "a handler's context argument is `&mut idemq::Context` (or `&idemq::Context`), not `{Self}`",
            label = "write `&mut idemq::Context` here",
            note = "after the connection, the message is one argument (by value or `&T`) and the \
                            context the other"
        )]
        trait __IdemqContext<'c> {
            fn __idemq_context(ctx: &'c mut ::idemq::Context) -> Self;
        }
        #[diagnostic::do_not_recommend]
        impl<'c> __IdemqContext<'c> for &'c mut ::idemq::Context {
            fn __idemq_context(ctx: &'c mut ::idemq::Context) -> Self {
                ctx
            }
        }
        #[diagnostic::do_not_recommend]
        impl<'c> __IdemqContext<'c> for &'c ::idemq::Context {
            fn __idemq_context(ctx: &'c mut ::idemq::Context) -> Self {
                ctx
            }
        }
        #[diagnostic::on_unimplemented(
            message = "a handler returns `Result<R, E>`, not `{Self}`",
            label = "write `Result<(), E>` here",
            note = "`E` is your error type (any `std::error::Error + Send + Sync + 'static`, \
                            retried) or `idemq::HandlerError`; `R` is `()` or a result to store and reply with"
        )]
        trait __IdemqResult<R, E> {
            fn __idemq_result(self) -> ::core::result::Result<R, E>;
        }
        #[diagnostic::do_not_recommend]
        impl<R, E> __IdemqResult<R, E> for ::core::result::Result<R, E> {
            fn __idemq_result(self) -> ::core::result::Result<R, E> {
                self
            }
        }
        #[diagnostic::on_unimplemented(
            message = "a handler's result `{Self}` must implement `serde::Serialize`",
            label = "`{Self}` is not `Serialize`",
            note = "idemq stores what a handler returns with its dedup row and sends it again as the \
                            reply to a duplicated request: derive `serde::Serialize` on it, or return `()`"
        )]
        trait __IdemqOutput {
            fn __idemq_output(
                &self,
            ) -> ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>;
        }
        #[diagnostic::do_not_recommend]
        impl<T: ::idemq::__private::Serialize> __IdemqOutput for T {
            fn __idemq_output(
                &self,
            ) -> ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError> {
                ::idemq::HandlerOutput::json(self)
            }
        }
        #[diagnostic::on_unimplemented(
            message = "`{Self}` cannot be a handler's error type",
            label = "`{Self}` is not an error",
            note = "the error must implement `std::error::Error + Send + Sync + 'static`, \
                            or be `idemq::HandlerError`",
            note = "for a plain message, return `Result<(), idemq::HandlerError>` \
                            and `Err(HandlerError::transient(msg))` (or `Permanent(msg).into()`)"
        )]
        trait __IdemqError {
            fn __idemq_error(self) -> ::idemq::HandlerError;
        }
        #[diagnostic::do_not_recommend]
        impl<E: ::core::convert::Into<::idemq::HandlerError>> __IdemqError for E {
            fn __idemq_error(self) -> ::idemq::HandlerError {
                ::core::convert::Into::into(self)
            }
        }
        let __idemq_conn = <&mut AsyncPgConnection as __IdemqConnection<
            '_,
        >>::__idemq_connection(__idemq_conn);
        let _ = __idemq_ctx;
        ::std::boxed::Box::pin(async move {
            let result = apply_payment::call(__idemq_conn, __idemq_message).await;
            match <Result<(), Error> as __IdemqResult<_, _>>::__idemq_result(result) {
                ::core::result::Result::Ok(value) => {
                    __IdemqOutput::__idemq_output(&value)
                }
                ::core::result::Result::Err(error) => {
                    ::core::result::Result::Err(__IdemqError::__idemq_error(error))
                }
            }
        })
    }
}
