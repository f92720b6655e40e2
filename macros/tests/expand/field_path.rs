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
    ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
        let _ = __idemq_metadata;
        let __idemq_keyed = __idemq_message;
        ::idemq::key::KeyField::to_key(&(*__idemq_keyed).payment_id)
    }
    #[allow(clippy::needless_borrow)]
    fn wire(&self) -> ::idemq::__private::Wire<<Self as ::idemq::Handler>::Message> {
        #[allow(unused_imports)]
        use ::idemq::__private::{
            __IdemqNamedProbe as _, __IdemqNoSchemaProbe as _, __IdemqSchemaProbe as _,
            __IdemqUnnamedProbe as _, __IdemqUnversionedProbe as _,
            __IdemqVersionedProbe as _,
        };
        let probe = ::idemq::__private::__IdemqProbe::<
            <Self as ::idemq::Handler>::Message,
        >::new();
        ::idemq::__private::Wire::of(
            (&probe).__idemq_type_name(),
            (&probe).__idemq_versions(),
            (&probe).__idemq_schema(),
        )
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
        let __idemq_conn = <&mut AsyncPgConnection as ::idemq::__private::__IdemqConnection<
            '_,
        >>::__idemq_connection(__idemq_conn);
        let _ = __idemq_ctx;
        ::std::boxed::Box::pin(async move {
            let result = apply_payment::call(__idemq_conn, __idemq_message).await;
            match <Result<
                (),
                Error,
            > as ::idemq::__private::__IdemqResult<_, _>>::__idemq_result(result) {
                ::core::result::Result::Ok(value) => {
                    ::idemq::__private::__IdemqOutput::__idemq_output(&value)
                }
                ::core::result::Result::Err(error) => {
                    ::core::result::Result::Err(
                        ::idemq::__private::__IdemqError::__idemq_error(error),
                    )
                }
            }
        })
    }
}
